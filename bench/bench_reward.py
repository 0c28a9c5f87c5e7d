"""
Throughput of reward.score on a realistic batch: math (math-verify workers) and code (sandboxes).

    python bench/bench_reward.py                   # 256 math + 256 code, one worker per core
    python bench/bench_reward.py --workers 4 --repeats 3

The mix: math completions are ~1/2 correct (in assorted equivalent forms, \\boxed or `Answer:`),
~1/4 wrong, ~1/8 with no answer, ~1/8 long (about 3 kB of working before the answer); code
completions are ~80% short call-based functions (correct, wrong, crashing) and ~20% stdin
programs with 3 tests each. The first call includes the worker start-up and is reported apart.
"""
import argparse, os, random, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reward  # noqa: E402
from infra import checkers, sandbox  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[1], allow_abbrev=False)
parser.add_argument("--n-math", type=int, default=256, help="math completions per batch")
parser.add_argument("--n-code", type=int, default=256, help="code completions per batch")
parser.add_argument("--workers", type=int, default=None, help="parallel items (default: cores)")
parser.add_argument("--repeats", type=int, default=2, help="timed batches after the warm-up")
parser.add_argument("--seed", type=int, default=0, help="seed for the batch mix")
args = parser.parse_args()
rng = random.Random(args.seed)


def math_item(i):
    p, q = rng.randint(1, 9), rng.randint(10, 99)
    gold, right = rf"\frac{{{p}}}{{{q}}}", rng.choice([rf"\frac{{{p}}}{{{q}}}", f"{p}/{q}",
                                                        rf"\dfrac{{{p}}}{{{q}}}", f"x = {p}/{q}"])
    working = "Let us compute step by step. " * rng.choice([2, 2, 2, 100])
    kind = i % 8
    if kind < 4:
        text = working + (rf"so \boxed{{{right}}}" if kind % 2 else f"\nAnswer: {right}")
    elif kind < 6:
        text = working + rf"so \boxed{{\frac{{{p + 1}}}{{{q}}}}}"
    elif kind == 6:
        text = working + "I am not sure."
    else:
        text = working + rf"so \boxed{{{gold}}}" + " and more text." * 200
    return text, gold


def code_item(i):
    a = rng.randint(1, 9)
    if i % 5 == 4:  # stdin program, 3 tests
        spec = {"inputs": [f"{n}\n" for n in (3, 5, 8)], "outputs": [str(n * a) for n in (3, 5, 8)]}
        body = f"n = int(input())\nprint(n * {a if i % 2 else a + 1})"
    else:  # call-based, 4 tests
        spec = {"fn_name": "f", "inputs": [[n] for n in range(4)], "outputs": [[n * a] for n in range(4)]}
        body = [f"def f(n):\n    return n * {a}", f"def f(n):\n    return n + {a}",
                "def f(n):\n    return undefined_name", f"def f(n):\n    return sum([{a}] * n)"][i % 4]
    return f"Here is my solution.\n```python\n{body}\n```\n", spec


math_batch = [math_item(i) for i in range(args.n_math)]
code_batch = [code_item(i) for i in range(args.n_code)]
workers = args.workers or len(os.sched_getaffinity(0))
mode = ("bwrap, as root: per-run uid + nested user namespace" if sandbox.BWRAP and os.geteuid() == 0
        else "bwrap" if sandbox.BWRAP else "FALLBACK (no bwrap)")
print(f"config: workers={workers} cores={len(os.sched_getaffinity(0))} sandbox={mode} "
      f"math_timeout={reward.MATH_TIMEOUT_S}s code_timeout={reward.CODE_TIMEOUT_S}s "
      f"max_tests={reward.CODE_MAX_TESTS} python={sys.version.split()[0]}")
for task, batch in (("math", math_batch), ("code", code_batch)):
    completions, truths = [c for c, _ in batch], [t for _, t in batch]
    t = time.perf_counter()
    scores = reward.score(task, completions, truths, workers=workers)
    first = time.perf_counter() - t
    rates = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        assert reward.score(task, completions, truths, workers=workers) == scores
        rates.append(len(batch) / (time.perf_counter() - t))
    print(f"{task}: {len(batch)} items, mean reward {sum(scores) / len(scores):.2f} | "
          f"first call {first:.2f}s (incl. start-up) | steady {max(rates):.0f} items/s "
          f"(best of {args.repeats}; all: {', '.join(f'{r:.0f}' for r in rates)})")
checkers.close()
