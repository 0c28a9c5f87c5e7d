"""
Rewards do not depend on the machine's load: one batch of programs and math answers scored on a
quiet machine, then again while N busy processes (default 16, on however many cores there are)
compete for the CPU; the two lists of rewards must be equal. (On a 2-core EPYC the former wall-clock
limits turned the two heavier right answers to 0 under 24 busy processes, not under 8.)

    python bench/reward_under_load.py                    # limit 2 CPU-s, 16 busy processes
    python bench/reward_under_load.py --limit 5 --busy 16

The batch: correct programs (one trivial, one that computes for about 0.5 s of CPU), a wrong one,
and the hostile ones (an infinite loop, a sleep, a fork bomb, a 100 GB allocation) that must score
0 within bounded time (the wall-clock guard: infra/sandbox.WALL_GUARD x the limit); math answers,
right, wrong, and an exponent tower. Prints both reward lists, whether they are equal, and the
seconds each scoring took. tests/test_reward.py runs it at a 1 s limit.
"""
import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import reward  # noqa: E402

# about 0.5 s of CPU on a 2-core EPYC: a prime count by trial division
HEAVY = ("n = int(input())\nprint(sum(all(k % d for d in range(2, int(k ** 0.5) + 1))"
         " for k in range(2, n)))")
PROGRAMS = [  # (name, program, stdin, expected stdout, the reward it must get)
    ("trivial, right", "print(int(input()) * 2)", "21", "42", 1.0),
    ("0.5 s of CPU, right", HEAVY, "200000", "17984", 1.0),
    ("wrong", "print(int(input()) + 2)", "21", "42", 0.0),
    ("infinite loop", "print(42, flush=True)\nwhile True:\n    pass", "", "42", 0.0),
    ("sleep", "import time\nprint(42, flush=True)\ntime.sleep(10 ** 6)", "", "42", 0.0),
    ("fork bomb", "import os\nprint(42, flush=True)\nwhile True:\n    try:\n        os.fork()\n"
                  "    except OSError:\n        pass", "", "42", 0.0),
    ("100 GB", "x = bytearray(100 * 2**30)\nprint(42)", "", "42", 0.0),
]
MATH = [("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\boxed{3}", "4", 0.0),
        ("\\boxed{9^{9^{9^{9}}}}", "1", 0.0), ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0)]


def score_batch(limit):
    """(rewards of PROGRAMS then MATH, seconds)."""
    t = time.monotonic()
    code = reward.score("code", [f"```python\n{p}\n```" for _, p, _, _, _ in PROGRAMS],
                        [{"inputs": [i], "outputs": [o]} for _, _, i, o, _ in PROGRAMS],
                        timeout=limit)
    math = reward.score("math", [a for a, _, _ in MATH], [g for _, g, _ in MATH], timeout=limit)
    return code + math, time.monotonic() - t


@contextlib.contextmanager
def busy(n):
    """n processes that only compute, for as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
             for _ in range(n)]   # each its own session, as other jobs: Linux shares the CPU
    # between sessions (autogroups) first, so busy processes of one session would barely load it
    try:
        time.sleep(0.5)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=float, default=2.0, help="CPU seconds per item")
    p.add_argument("--busy", type=int, default=16, help="busy processes for the loaded scoring")
    a = p.parse_args()
    reward.score("math", ["\\boxed{1}"], ["1"])   # the workers up: their start is not timed
    want = [r for *_, r in PROGRAMS] + [r for *_, r in MATH]
    quiet, t_quiet = score_batch(a.limit)
    with busy(a.busy):
        loaded, t_loaded = score_batch(a.limit)
    names = [n for n, *_ in PROGRAMS] + [f"math {x!r}" for x, _, _ in MATH]
    print(f"{os.cpu_count()} cores, limit {a.limit} CPU-s per item, {a.busy} busy processes")
    print(f"{'item':<32}{'want':>6}{'quiet':>7}{'loaded':>8}")
    for n, w, q, lo in zip(names, want, quiet, loaded):
        print(f"{n:<32}{w:>6.0f}{q:>7.0f}{lo:>8.0f}")
    print(f"quiet {t_quiet:.1f} s, loaded {t_loaded:.1f} s; equal: {quiet == loaded}; "
          f"as wanted: {quiet == want}")


if __name__ == "__main__":
    main()
