"""train.py, killed by SIGKILL at one point of one iteration's checkpoint (tests/test_checkpoint.py).

    python tests/kill_at.py POINT ITER [train.py flags ...]

POINT, in the order a checkpoint is made (infra/checkpoints.save_checkpoint):
  before  the iteration's metrics row is written, its checkpoint not begun
  during  accelerate's save_state has filled iter_N.tmp, trainer_state.json is not written yet
  commit  iter_N.tmp is complete (trainer_state.json written), not renamed yet
  after   renamed to iter_N, the older checkpoints not deleted yet
The kill is real (os.kill(own pid, SIGKILL): no handler, no cleanup, no flush); only its moment
is chosen, by wrapping the function that runs just before it.
"""
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import accelerate  # noqa: E402

import infra.checkpoints as checkpoints  # noqa: E402
import train  # noqa: E402

POINTS = ("before", "during", "commit", "after")


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    point, at, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if point not in POINTS:
        raise SystemExit(f"unknown point {point!r}; one of {', '.join(POINTS)}")
    tmp = f"iter_{at:06d}.tmp"
    save_checkpoint, save_state, replace = (train.save_checkpoint,
                                            accelerate.Accelerator.save_state, checkpoints._replace)

    def save_checkpoint_at(args, acc, ckpt_dir, it):
        if point == "before" and it == at:
            die()
        save_checkpoint(args, acc, ckpt_dir, it)

    def save_state_at(self, output_dir=None, **kw):
        out = save_state(self, output_dir, **kw)
        if point == "during" and str(output_dir).endswith(tmp):
            die()
        return out

    def replace_at(src, dst):
        if point == "commit" and src.endswith(tmp):
            die()
        replace(src, dst)
        if point == "after" and src.endswith(tmp):
            die()

    train.save_checkpoint = save_checkpoint_at
    accelerate.Accelerator.save_state = save_state_at
    checkpoints._replace = replace_at
    train.main(argv)


if __name__ == "__main__":
    main()
