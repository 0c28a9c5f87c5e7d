"""Two-process checks of the trainer's distributed bookkeeping (infra/), run by conftest.py's two_ranks
fixture (for tests/test_checkpoint.py and tests/test_distributed.py) as
`accelerate launch --num_processes 2 tests/two_ranks.py OUT` (CPU, gloo). Rank 0 writes
OUT/result.json for the tests to read; nothing here asserts.

- save_checkpoint: rank 1 is slowed before its save_state, so a rename of iter_N.tmp that does not
  wait for every rank would commit a folder without rank 1's files. Rank 0 lists what the folder
  holds at the moment of the rename (os.replace watched) and after the save.
- train.minibatch_passes: each rank holds another share of a mini-batch (4 sequences kept on rank 0,
  1 on rank 1); the denominator each returns must be the whole mini-batch's for every aggregation,
  divided by the process count, and both ranks must run as many passes (a filler on rank 1).
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import train  # noqa: E402
from infra.checkpoints import save_checkpoint  # noqa: E402
from rollout import RolloutBatch  # noqa: E402


def main(out):
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    rank, result = acc.process_index, {"world": acc.num_processes}
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    acc.backward(model(torch.ones(2, 4)).sum())
    opt.step()

    # -- the commit point of save_checkpoint --
    args = train.parse_args(["--keep_last", "2"])
    ckpt = os.path.join(out, "checkpoints")
    if rank == 1:                                     # the slow rank: its files come 3 s late
        save = acc.save_state
        acc.save_state = lambda path: (time.sleep(3), save(path))[1]
    replace, at_commit = os.replace, {}

    def watched(src, dst):                            # the folder's contents when it is committed
        if os.path.isdir(src):
            at_commit[os.path.basename(dst)] = sorted(os.listdir(src))
        return replace(src, dst)

    os.replace = watched
    try:
        save_checkpoint(args, acc, ckpt, 1)
    finally:
        os.replace = replace
    result["at_commit"] = at_commit
    result["after"] = {n: sorted(os.listdir(os.path.join(ckpt, n)))
                       for n in sorted(os.listdir(ckpt))}

    # -- minibatch_passes: one mini-batch of 4 prompts x 2, prompts 0, 1 on rank 0 and 2, 3 on
    # rank 1; every sequence kept on rank 0 (3 + 5 + 2 + 7 tokens), only the first on rank 1 (4)
    lengths = [3, 5, 2, 7] if rank == 0 else [4, 1, 1, 1]
    batch = RolloutBatch([[1]] * 4, [[2] * n for n in lengths], [[0.0] * n for n in lengths],
                         [False] * 4, [""] * 4)
    s = train.Samples(batch, rows=None, positions=[0, 1] if rank == 0 else [2, 3],
                      keep=torch.tensor([True] * 4 if rank == 0 else [True, False, False, False]))
    run = train.Run(acc=acc, model=None, opt=None, pad_id=0)
    result["counts"] = {}
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        margs = train.parse_args(["--agg", agg, "--micro_batch_size", "2", "--group_size", "2"])
        passes, count = train.minibatch_passes(margs, run, s, [0, 1, 2, 3])
        result["counts"][agg] = [count, passes]
    acc.wait_for_everyone()
    if acc.is_main_process:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
