"""infra/distributed.py under DDP (two processes, gloo on the CPU): which passes all-reduce.

DDP's gradient all-reduce must run at a step's last micro-batch only (infra.distributed.gradient_sync): the
earlier passes accumulate locally, and the last one's backward all-reduces the sum. A run that
all-reduced at the others instead would leave each rank with its own last pass unreduced. This
file, run as a script under `accelerate launch --num_processes 2`, registers a DDP communication
hook that records each all-reduce and a forward hook that records each pass, and runs train.update
on a real batch of the committed tiny-rare model in micro-batches. A second test reads the run of
tests/two_ranks.py (conftest.py's two_ranks fixture): train.minibatch_passes' denominator
sums every rank's share.

Run: .venv/bin/python -m pytest tests/test_distributed.py -q   (CPU, gloo, ~30 s)
"""
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ddp_all_reduces_only_at_each_steps_last_micro_batch(tmp_path):
    """Two AdamW steps of 3 micro-batches on each of 2 ranks: each rank's events are 3 forwards and
    then the all-reduce, twice (one "r" per DDP bucket), and the ranks end with the same weights."""
    from conftest import ENV, LAUNCH_2
    proc = subprocess.run(LAUNCH_2 + [__file__, str(tmp_path)], cwd=ROOT,
                          env={**ENV, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for got in ranks:
        assert got["world"] == 2 and got["ddp"], got
        passes = re.sub("r+", "r", "".join(got["events"]))   # one all-reduce per DDP bucket
        assert passes == "fffr" * 2, got["events"]
    assert ranks[0]["weights"] == ranks[1]["weights"]


@pytest.mark.slow
def test_minibatch_passes_denominator_spans_every_rank(two_ranks):
    """The mini-batch's 5 kept sequences (3 + 5 + 2 + 7 + 4 = 21 tokens) split 4 / 1 over the ranks:
    the denominator is every rank's tokens for token-mean and every rank's sequences for the
    seq-means, over the 2 processes (DDP averages the ranks' gradients); rank 0's passes are 2
    micro-batches of 2 sequences (rank 1 pads its one with a filler, None)."""
    passes = [[0, 1], [2, 3]]
    assert two_ranks["counts"] == {"token-mean": [10.5, passes], "seq-mean-token-mean": [2.5, passes],
                                   "seq-mean-token-sum": [2.5, passes]}


def main(out):
    """One rank: train.update on 2 mini-batches of 2 prompts x 3 samples (this rank's share: one
    prompt), micro-batches of 1; writes the pass (f) and all-reduce (r) events in order, and a
    checksum of the weights after the update."""
    sys.path.insert(0, str(ROOT))
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import train
    from data.loaders import load_rows
    from rollout import RolloutBatch
    rare = ROOT / "data" / "tiny_rare"
    args = train.parse_args(["--prompts_per_iter", "4", "--group_size", "3",
                             "--prompts_per_update", "2", "--micro_batch_size", "1",
                             "--max_new_tokens", "8", "--target_kl", "0"])
    acc = Accelerator(cpu=True)
    tok = AutoTokenizer.from_pretrained(rare / "model")
    model = AutoModelForCausalLM.from_pretrained(rare / "model", dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, opt = acc.prepare(model, opt)
    rows = load_rows("tiny-rare-math", "test", str(rare), "plain", tok)[:4]
    completions = [[tok.convert_tokens_to_ids(c) for c in "abcd"[:1 + i % 4]] for i in range(12)]
    batch = RolloutBatch([rows[i // 3]["prompt_ids"] for i in range(12)], completions,
                         [[0.0] * len(c) for c in completions], [False] * 12,
                         tok.batch_decode(completions))
    run = SimpleNamespace(acc=acc, model=model, opt=opt, ref_model=None, pad_id=tok.pad_token_id)
    s = train.Samples(batch, rows=rows, positions=[0, 1, 2, 3])
    s.proximal_logp, s.tis, s.start_logp = train.proximal_logprobs(args, model, batch, run.pad_id, acc.device)
    s.rewards = torch.tensor([1.0, 0.0, 0.0] * 4)
    s.shaped, s.advantages, s.keep = train.advantages(args, s.rewards, batch)

    events = []
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    if ddp:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def watched(state, bucket):
            events.append("r")
            return allreduce_hook(state, bucket)
        model.register_comm_hook(None, watched)
    acc.unwrap_model(model).register_forward_pre_hook(lambda m, a: events.append("f"))
    train.update(args, run, s, train.minibatches(args, 1), 1)
    weights = [p.detach().double().sum().item() for p in acc.unwrap_model(model).parameters()]
    Path(out, f"rank{acc.process_index}.json").write_text(json.dumps(dict(
        world=acc.num_processes, ddp=ddp, events=events, weights=weights)))


if __name__ == "__main__":
    main(sys.argv[1])
