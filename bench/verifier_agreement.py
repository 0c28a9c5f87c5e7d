"""
How often the math reward agrees with other projects' equivalence tests, and what MATH ground
truths the loader builds.

    python bench/verifier_agreement.py                       # agreement per source
    python bench/verifier_agreement.py --show                # ... and every disagreement
    python bench/verifier_agreement.py --gt MATH_TEST.jsonl  # ground truths, old rule vs new

Agreement: every row of tests/data/math_equivalence/*.jsonl is (gold, prediction, equal?) as a
source's own test asserts it, the row naming the repository, commit, file and test:
- math_verify.jsonl: the parametrized cases of huggingface/Math-Verify's tests that run at its
  defaults (strict, precision 6, no set-relation comparison);
- hendrycks_math.jsonl: the cases of hendrycks/math modeling/math_equivalence_test.py;
- math500.jsonl: MATH-500 (openai/prm800k prm800k/math_splits/test.jsonl), each answer column
  against its own worked solution (equal), and each integer answer against the solution of
  another problem with a different integer answer (not equal).
Choices:
1. A prediction is scored as the trainer scores a completion, `reward.score("math", ...)`: a
   worked solution (one with a \\boxed{} or a line break) as it is, a bare answer as the line the
   DAPO prompt asks for, "Answer: <prediction>".
2. A gold with a \\boxed{} is a worked solution: its ground truth is what data/loaders.py builds
   from a MATH solution. A gold the math task refuses (a bare word) is counted as refused, not
   scored: such a row never reaches the reward.
3. FP: scored 1 where the source says not equal (a wrong answer rewarded, the worse error);
   FN: scored 0 where it says equal.
`--gt PATH` reads a MATH-style jsonl ("solution", or ECM's "answer" holding the solution; MATH-500
also has "answer" as its own column) and counts the rows whose ground truth under the loader
differs from the solution's last \\boxed{} (the previous rule), by class, with an example each;
then checks that every ground truth passes the math check and that the solution itself scores 1
against it.
"""
import argparse
import collections
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import reward  # noqa: E402
from data import loaders  # noqa: E402

DATA = ROOT / "tests" / "data" / "math_equivalence"
TIMEOUT = 10.0  # seconds per item: the 5 s default times parses out on a busy 2-core machine


def completion(prediction):
    """Choice 1: a worked solution as it is, a bare answer as the DAPO answer line."""
    return prediction if "\\boxed" in prediction or "\n" in prediction else "Answer: " + prediction


def ground_truth(gold, problem=""):
    """Choice 2: the loader's ground truth of a solution, the gold itself otherwise; None if the
    math task refuses it."""
    if "\\boxed" in gold:
        row = loaders._hendrycks_math({"problem": problem, "solution": gold}, 0)
        return row[2] if row else None
    try:
        return reward.get_task("math").check(gold)
    except ValueError:
        return None


def agreement(show, workers):
    rows = [json.loads(line) for path in sorted(DATA.glob("*.jsonl")) for line in path.open()]
    for source in dict.fromkeys(r["source"] for r in rows):  # in file order
        agree_on([r for r in rows if r["source"] == source], source, show, workers)


def agree_on(rows, source, show, workers):
    if True:
        golds = [ground_truth(r["gold"]) for r in rows]
        kept = [(r, g) for r, g in zip(rows, golds) if g is not None]
        got = reward.score("math", [completion(r["prediction"]) for r, _ in kept],
                           [g for _, g in kept], workers=workers, timeout=TIMEOUT)
        stats = collections.Counter()
        for (r, g), s in zip(kept, got):
            kind = "solution" if completion(r["prediction"]) == r["prediction"] or \
                "\\boxed" in r["gold"] else "answer"
            verdict = "agree" if (s == 1.0) == r["equal"] else ("FP" if s == 1.0 else "FN")
            stats[kind, verdict] += 1
            if show and verdict != "agree":
                print(f"  {verdict} [{kind}] {r['test']}: gold {r['gold'][:80]!r} -> {g[:60]!r}"
                      f" | pred {r['prediction'][-100:]!r}")
        print(f"{source}: {len(rows)} cases, "
              f"{len(rows) - len(kept)} with a gold the math task refuses")
        for kind in ("answer", "solution"):
            n = sum(v for (k, _), v in stats.items() if k == kind)
            if n:
                print(f"  {kind:8s}: {n:4d} scored, agree {stats[kind, 'agree']:4d} "
                      f"({100 * stats[kind, 'agree'] / n:5.1f}%), FP {stats[kind, 'FP']:3d}, "
                      f"FN {stats[kind, 'FN']:3d}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--show", action="store_true", help="print every disagreement")
    p.add_argument("--gt", default="", help="a MATH-style jsonl: count ground-truth changes")
    p.add_argument("--workers", type=int, default=2, help="math-verify worker processes")
    args = p.parse_args(argv)
    if args.gt:
        ground_truths(args.gt, args.show, args.workers)
    else:
        agreement(args.show, args.workers)


def last_box(text):
    """The previous rule (data/loaders.py before multi-box answers): the inside of the last
    \\boxed{...} or \\fbox{...} with balanced braces, None if there is none."""
    found = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        inner = reward._group(text, m.end() - 1)
        found = inner.strip() if inner is not None else found
    return found


def ground_truths(path, show, workers):
    rows = [json.loads(line) for line in open(path)]
    changed, refused, scored = collections.defaultdict(list), collections.Counter(), []
    for i, r in enumerate(rows):
        solution = r.get("solution") or r["answer"]  # ECM's copy keeps the solution in "answer"
        ident = r.get("unique_id", f"row {i}")
        old = last_box(solution)
        old = None if old is None else ground_truth(old)
        new = ground_truth(solution, r.get("problem") or r.get("question") or "")
        refused["old"] += old is None
        refused["new"] += new is None
        if new is not None:
            scored.append((ident, solution, new, r.get("answer") if "solution" in r else None))
        if old != new:
            changed[ident] = (old, new)
    # A joined ground truth where the old (last) box still scores 1 holds one value twice
    same = reward.score("math", ["Answer: " + (o or "") for o, _ in changed.values()],
                        [n or "0" for _, n in changed.values()], workers=workers, timeout=TIMEOUT)
    kinds = collections.defaultdict(list)
    for (ident, (old, new)), s in zip(changed.items(), same):
        kinds["several boxes, one value in two forms (the last box alone still scores 1)" if s
              else "several boxes, distinct answers (the last box alone now scores 0)"
              if old and new else "other"].append((ident, old, new))
    print(f"{path}: {len(rows)} rows; ground truths refused by the math check: "
          f"{refused['old']} under the last-box rule, {refused['new']} now")
    print(f"  ground truths that change: {len(changed)}")
    for kind, items in kinds.items():
        ident, old, new = items[0]
        print(f"    {kind}: {len(items)}, e.g. {ident}: {old!r} -> {new!r}")
        for ident, old, new in items[1:] if show else []:
            print(f"      {ident}: {old!r} -> {new!r}")
    got = reward.score("math", [s for _, s, _, _ in scored], [g for _, _, g, _ in scored],
                       workers=workers, timeout=TIMEOUT)
    print(f"  solutions scoring 1 against their own ground truth: {int(sum(got))}/{len(got)}")
    for (ident, _, gold, _), s in zip(scored, got):
        if s != 1.0:
            print(f"    scores 0: {ident}: {gold!r}")
    column = [(ident, g, a) for ident, _, g, a in scored if a is not None]
    if column:
        same = [g == a for _, g, a in column]
        print(f"  ground truth equal to the answer column: {sum(same)}/{len(column)}")
        for (ident, g, a), ok in zip(column, same):
            if not ok:
                print(f"    {ident}: {g!r} vs answer column {a!r}")


if __name__ == "__main__":
    main()
