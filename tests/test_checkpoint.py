"""Checkpoints, in seconds: what a resume restores, and the commit point of a multi-process save.

Run: .venv/bin/python -m pytest tests/test_checkpoint.py -q   (~30 s on 2 cores)

1. In-process, through train.setup itself (--backend hf: no vLLM engine): a run takes an AdamW step,
   advances the prompt sampler and draws from every RNG, saves with infra.checkpoints.save_checkpoint, then
   goes on; a second train.setup restored by infra.checkpoints.load_checkpoint must hold the same AdamW
   moments and weights, and its next sampler draw and RNG draws must be the ones the first run
   made after the save. (Setup preparing the optimizer with accelerate and registering the sampler
   for checkpointing is what puts them into save_state.)
2. The lr schedule through train.py (--backend hf, 3 short iterations): a run resumed from its first
   checkpoint logs the straight run's rows, lr included; a resume that would change the schedule's
   length (--iters under a decaying schedule, --warmup_steps) is refused, naming the values.
3. Two processes (accelerate launch, gloo; tests/two_ranks.py): rank 1 is slowed before its
   save_state, so iter_N.tmp may be renamed only once every rank's files are in it (the barrier
   in save_checkpoint). (The same run's micro_batches check is in tests/test_distributed.py.)
"""
import copy
import json
import os
import random

import numpy as np
import pytest
import torch

from conftest import PY, ROOT, metrics, ok, run

import train
from infra.checkpoints import load_checkpoint, save_checkpoint
from infra.flags import run_neutral

MODEL = str(ROOT / "data" / "tiny" / "model")     # the committed tiny model and its data sets
FLAGS = ["--backend", "hf", "--model", MODEL, "--prompts_per_iter", "8", "--prompts_per_update",
         "4", "--threads", "1", "--seed", "3"]


def start(out, *flags):
    """args and train.setup's run namespace, as train.main starts a run."""
    args = train.parse_args([*FLAGS, "--out_dir", str(out), *flags])
    return args, train.setup(args)


def step(args, run, it):
    """An iteration's worth of state changes: the sampler's draw, an AdamW step on its prompt."""
    chosen = run.sampler.take(args.prompts_per_iter, it)
    ids = torch.tensor([run.rows[chosen[0]]["prompt_ids"]])
    loss = run.model(input_ids=ids, labels=ids).loss
    run.acc.backward(loss)
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    return chosen


def draws(args, run, it):
    """What the run draws next: the sampler's prompts and every RNG accelerate checkpoints."""
    return {"sampler": run.sampler.take(args.prompts_per_iter, it), "torch": torch.rand(4).tolist(),
            "python": [random.random() for _ in range(3)], "numpy": np.random.rand(3).tolist()}


def test_resume_restores_optimizer_sampler_and_rngs(tmp_path):
    args, a = start(tmp_path)
    ckpt = os.path.join(args.out_dir, "checkpoints")
    step(args, a, 1)
    step(args, a, 2)
    torch.rand(5), random.random(), np.random.rand(2)        # the RNGs move on from their seeds
    save_checkpoint(args, a.acc, ckpt, 2)
    saved_opt = copy.deepcopy(a.opt.state_dict())
    saved_w = {k: v.clone() for k, v in a.acc.unwrap_model(a.model).state_dict().items()}
    straight = draws(args, a, 3)
    step(args, a, 4)                                    # the first run goes on before the resume
    assert sorted(os.listdir(ckpt)) == ["iter_000002"]

    args_b, b = start(tmp_path, "--resume")
    path, it = load_checkpoint(args_b, b.acc, ckpt)
    assert (path, it) == (os.path.join(ckpt, "iter_000002"), 2)
    got = b.opt.state_dict()
    assert saved_opt["state"] and got["state"].keys() == saved_opt["state"].keys(), \
        "AdamW's moments are not in the checkpoint"
    for k, st in saved_opt["state"].items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got["state"][k][name], st[name]), f"param {k}: {name} not restored"
    assert got["param_groups"] == saved_opt["param_groups"]
    w = b.acc.unwrap_model(b.model).state_dict()
    assert all(torch.equal(w[k], saved_w[k]) for k in saved_w)
    resumed = draws(args_b, b, 3)
    for k in straight:
        assert resumed[k] == straight[k], f"{k}: the resumed run draws other values than the first"


SCHEDULE = ["--train_data", "tiny-math", "--group_size", "2", "--max_new_tokens", "16", "--iters", "3",
            "--lr_schedule", "cosine", "--warmup_steps", "1", "--min_lr_ratio", "0.1", "--target_kl", "0",
            "--ckpt_every", "1", "--keep_last", "3", "--sample_every", "0"]


@pytest.mark.slow
def test_lr_schedule_resumes_exactly(tmp_path):
    """A cosine schedule with warmup over 3 iterations x 2 AdamW steps: each row logs the lr of the
    iteration's first step (train.learning_rate of steps 0, 2, 4: three different values), and the
    run resumed from its iteration-1 checkpoint redoes iterations 2-3 with the straight run's rows,
    every key but the timers (the weights, hence rewards and entropy, depend on every earlier lr)."""
    out = tmp_path / "run"
    cmd = [PY, "train.py", *FLAGS, *SCHEDULE, "--out_dir", str(out)]
    ok(run(cmd, timeout=300)[0])
    straight = metrics(out)
    args = train.parse_args([*FLAGS, *SCHEDULE])
    lrs = [r["lr"] for r in straight]
    assert lrs == [train.learning_rate(args, k) for k in (0, 2, 4)] and len(set(lrs)) == 3
    ok(run(cmd + ["--resume", str(out / "checkpoints" / "iter_000001")], timeout=300)[0])
    resumed = metrics(out)
    assert [r["iter"] for r in resumed] == [1, 2, 3]
    for a, b in zip(straight, resumed):
        for k in a:
            if not k.startswith("time_") and k != "tokens_per_s":
                assert a[k] == b[k], f"iteration {a['iter']} {k}: {a[k]} vs {b[k]}"


def test_resume_refuses_a_changed_schedule_length(tmp_path):
    """--iters is run-neutral (a run may be extended) except under a decaying schedule, whose length
    it sets: there a resume with another --iters is refused naming both values and why, as is
    another --warmup_steps or --lr_schedule; --resume_with_changes passes the check."""
    args = train.parse_args([*FLAGS, *SCHEDULE, "--out_dir", str(tmp_path)])
    ckpt = tmp_path / "checkpoints" / "iter_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps(
        {"iter": 1, "args": {k: v for k, v in vars(args).items() if k != "cell"}}))
    for changed, says in [(["--iters", "5"], "--iters 3 (now 5) (the lr schedule cosine decays"),
                          (["--warmup_steps", "2"], "--warmup_steps 1 (now 2)"),
                          (["--lr_schedule", "linear"], "--lr_schedule 'cosine' (now 'linear')")]:
        again = train.parse_args([*FLAGS, *SCHEDULE, "--out_dir", str(tmp_path), "--resume", *changed])
        with pytest.raises(ValueError) as e:
            load_checkpoint(again, None, str(tmp_path / "checkpoints"))   # refused before loading
        assert says in str(e.value) and "--resume_with_changes" in str(e.value), str(e.value)
    again = train.parse_args([*FLAGS, *SCHEDULE, "--out_dir", str(tmp_path), "--resume", "--iters", "5",
                              "--resume_with_changes"])
    with pytest.raises(AttributeError):       # past the check: the load itself (no accelerator here)
        load_checkpoint(again, None, str(tmp_path / "checkpoints"))
    assert "iters" in run_neutral({"lr_schedule": "constant"}) and "iters" in run_neutral({})
    assert "iters" not in run_neutral({"lr_schedule": "cosine"})


def test_a_second_ctrl_c_aborts_saying_what_is_lost():
    """StopRequest: the first SIGINT asks for a stop after the iteration; the second kills the
    process by SIGINT, as without a handler, after saying that the running iteration is lost."""
    code = ("import os, signal, time\nfrom infra.checkpoints import StopRequest\n"
            "stop = StopRequest(True)\nos.kill(os.getpid(), signal.SIGINT)\nassert stop.requested\n"
            "print('still running', flush=True)\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)\n")
    proc, _ = run([PY, "-c", code], timeout=120)
    assert proc.returncode == -2 and proc.stdout == "still running\n", (proc.returncode, proc.stderr)
    said = proc.stderr.strip().splitlines()
    assert said == ["SIGINT: stopping after this iteration (again to abort)", "",
                    "SIGINT again: aborting; this iteration is lost, and --resume redoes it and any "
                    "others after the last checkpoint"], said


@pytest.mark.slow
def test_checkpoint_commits_only_when_every_rank_wrote(two_ranks):
    """Rank 1 writes its files 3 s after rank 0: iter_000001.tmp is renamed only once they are in
    it, so the committed folder holds both ranks' RNG states and no '.tmp' folder is left behind."""
    assert two_ranks["world"] == 2
    need = {"random_states_0.pkl", "random_states_1.pkl", "trainer_state.json"}
    at_commit = two_ranks["at_commit"]["iter_000001"]
    assert need <= set(at_commit), f"committed before every rank wrote: {at_commit}"
    assert list(two_ranks["after"]) == ["iter_000001"], two_ranks["after"]
    assert need <= set(two_ranks["after"]["iter_000001"])
