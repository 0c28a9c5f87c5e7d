"""
Debug replay of rollouts: train.py's --save_rollouts writes each iteration's samples to a folder,
and --replay_rollouts trains on them instead of sampling, so two runs can be compared on the very
same batches: a difference in the update is then the trainer's, never the sampler's
(tests/test_scale.py, tests/test_trainer.py).

    save_rollouts("out/rollouts", it, rank, batch, positions)          # after sampling
    batch = replayed_rollouts("out/rollouts", it, positions, G)        # instead of sampling

Choices:
1. One JSON file per iteration and rank, written to a temporary name and renamed: a crashed
   run leaves no half-written file.
2. Each file records the iteration-wide positions of its prompts, and replay searches the files
   of every rank: a run may replay another's rollouts with a different number of processes.
3. A prompt position missing from the saved files is an error naming the flags that must match.
"""
import dataclasses
import json
import os

from infra.vllm_engine import RolloutBatch


def save_rollouts(folder, it, rank, batch, positions):
    """--save_rollouts: this rank's RolloutBatch of iteration `it` and the iteration-wide positions
    of its prompts (JSON), so --replay_rollouts can hand each prompt to whichever rank owns it."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"iter_{it:06d}_rank{rank:03d}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"positions": positions, **dataclasses.asdict(batch)}, f)
    os.replace(path + ".tmp", path)


def replayed_rollouts(folder, it, positions, G):
    """--replay_rollouts: the groups a --save_rollouts run sampled at iteration `it` for the prompt
    `positions`, whatever its number of processes (files of every rank are searched)."""
    files = sorted(f for f in os.listdir(folder) if f.startswith(f"iter_{it:06d}_rank"))
    if not files:
        raise FileNotFoundError(f"--replay_rollouts={folder!r} has no rollouts of iteration {it}")
    groups = {}                                  # iteration position -> that prompt's G samples
    for name in files:
        with open(os.path.join(folder, name)) as f:
            saved = json.load(f)
        for k, pos in enumerate(saved.pop("positions")):
            groups[pos] = {key: v[k * G:(k + 1) * G] for key, v in saved.items()}
    missing = [p for p in positions if p not in groups]
    if missing:
        raise ValueError(f"--replay_rollouts={folder!r}: iteration {it} has no rollouts for prompt "
                         f"positions {missing[:5]} (replay needs the same --seed, "
                         f"--prompts_per_iter and --group_size)")
    return RolloutBatch(*[[x for p in positions for x in groups[p][f.name]]
                          for f in dataclasses.fields(RolloutBatch)])

