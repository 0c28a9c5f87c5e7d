"""
Which rule does each rare-task run learn, and when? Reads sweeps run with `--answer_probe letters`.

    bash run.sh sweep --task rare --seeds 0-4 --only grpo,dapo,kl-atomic,dppo,ripo,dgpo --target_kl 0 \
        --eval_every 10 --jobs 2 --answer_probe letters --out out/rare-probe/paper
    bash run.sh sweep --task rare --seeds 0-4 --only grpo,dapo,kl-atomic --target_kl 0.05 \
        --eval_every 10 --jobs 2 --answer_probe letters --out out/rare-probe/guard
    bash run.sh sweep --task rare --seeds 0-4 --only grpo,dapo,kl-atomic --target_kl 0 --lr 5e-5 \
        --iters 180 --eval_every 30 --jobs 2 --answer_probe letters --out out/rare-probe/low-lr
    python bench/rare_shortcut.py --regime paper=out/rare-probe/paper --regime guard=out/rare-probe/guard \
        --regime low-lr=out/rare-probe/low-lr --out bench/results/rare-shortcut

Writes into --out: classes.md and classes.json (every run of every regime: the rule its final
policy follows, when the shortcut took hold), regimes.md (per regime: stall rate, final avg@8 and
the paired differences with 95% intervals), shortcut.png (the first regime's probabilities
against iteration: mc cells in one row, the others in the next), regimes.png (one row per regime,
tv-mc / kl-mc / kl-atomic).

Choices:
1. A problem's answer is one letter after `\\boxed{`, so the probe's mean probability of a rule's
   letter over the held-out problems of one kind (max or min) is how often the policy writes it.
   The rule of a run = the rule whose letter has mean probability > 0.5 on *both* kinds: right
   (the operator obeyed), largest-letter (right on max problems, wrong on min), smallest-letter,
   middle-letter; else "other" (no single rule: half learnt, or different per kind).
2. A run *stalls* when its final rule is not "right". The shortcut took hold at the first
   iteration where its letter passes 0.5 on the half where it is wrong (largest on min problems,
   smallest on max problems).
3. Paired differences and their 95% t intervals are bench/stats.py's (paired over seeds).
4. Iteration 0 is the warm start (data/tiny_rare/model), measured here by the same probe.
"""
import argparse
import glob
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.stats import paired, read_metrics, shown, write_json_atomic  # noqa: E402

RULES = ("right", "largest", "smallest", "middle")
SHORTCUT_ON = {"largest": "min", "smallest": "max"}   # a shortcut and the kind it gets wrong
ORDER = ("tv-mc", "kl-mc", "kl-atomic", "tv-binary", "chi2-atomic", "dgpo")
LABEL = {"tv-mc": "tv-mc (GRPO)", "kl-mc": "kl-mc (DAPO)", "kl-atomic": "kl-atomic",
         "tv-binary": "tv-binary (DPPO)", "chi2-atomic": "chi2-atomic (RIPO)", "dgpo": "DGPO"}
COLOR = {"tv-mc": "black", "kl-mc": "tab:blue", "kl-atomic": "tab:orange", "tv-binary": "tab:red",
         "chi2-atomic": "tab:purple", "dgpo": "tab:green"}


def warm_start_probe():
    """The probe on the warm start (iteration 0 of every run)."""
    import torch
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.logging import disable_progress_bar
    from data.loaders import load_rows
    from data.probes import ProbeRun
    folder = ROOT / "data" / "tiny_rare"
    disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(folder / "model")
    model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32)
    rows = load_rows("tiny-rare-math", "test", str(folder), "plain", tok)
    cpu = SimpleNamespace(process_index=0, num_processes=1, device=torch.device("cpu"))
    return ProbeRun("letters", rows, tok, tok.pad_token_id).measure(model, cpu)


def rule_of(probs):
    """The rule whose letter has mean probability > 0.5 on both kinds, else "other" (choice 1)."""
    for rule in RULES:
        if all(probs[kind][rule] > 0.5 for kind in ("max", "min")):
            return rule if rule == "right" else f"{rule}-letter"
    return "other"


def first_pass(hist, kind, rule):
    """The first iteration whose probe has `rule`'s letter above 0.5 on `kind`, else None."""
    return next((r["iter"] for r in hist if r.get("answer_prob")
                 and r["answer_prob"][kind][rule] > 0.5), None)


def max_half_at(run):
    """The iteration the right letter passed 0.5 on max problems; a run that never got there
    counts as its last iteration + 1."""
    return run["right_max"] if run["right_max"] is not None else run["iters"] + 1


def read_runs(folder):
    """Every finished run of a sweep folder: name, seed, final avg@k, probe history."""
    runs = []
    for path in sorted(glob.glob(os.path.join(folder, "*", "result.json"))):
        res = json.load(open(path))
        hist = read_metrics(os.path.join(os.path.dirname(path), "metrics.jsonl"))
        probed = [r for r in hist if r.get("answer_prob")]
        if not probed:
            raise SystemExit(f"{path}: no answer_prob rows; run the sweep with --answer_probe letters")
        final = probed[-1]["answer_prob"]
        full = max(r["updates"] for r in hist)       # an iteration --target_kl did not cut
        runs.append(dict(
            name=res["name"], seed=res["seed"], avg=res["eval"]["all"], iters=len(hist),
            final=final, rule=rule_of(final),
            right_max=first_pass(hist, "max", "right"), right_min=first_pass(hist, "min", "right"),
            largest_on_min=first_pass(hist, "min", "largest"),
            smallest_on_max=first_pass(hist, "max", "smallest"),
            cut=sum(r["updates"] < full for r in hist),
            lowest_right={kind: min((r["answer_prob"][kind]["right"], r["iter"]) for r in probed)
                          for kind in ("max", "min")},
            curve=[(r["iter"], r["answer_prob"]) for r in probed]))
    return runs


def _it(x):
    return "never" if x is None else str(x)


def classes_table(regime, runs):
    lines = [f"### {regime}: the rule each run's final policy follows\n",
             "| cell | seed | final avg@8 | rule (choice 1) | p(right) max / min problems | "
             "p(largest) on min | p(smallest) on max | right > 0.5: max / min at iter | "
             "largest > 0.5 on min at iter | smallest > 0.5 on max at iter | lowest p(right) on min "
             "(at iter) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (ORDER.index(r["name"]) if r["name"] in ORDER else 99,
                                         r["seed"])):
        f = r["final"]
        lines.append(f"| {LABEL.get(r['name'], r['name'])} | {r['seed']} | {r['avg']:.1f} | "
                     f"**{r['rule']}** | {f['max']['right']:.3f} / {f['min']['right']:.3f} | "
                     f"{f['min']['largest']:.3f} | {f['max']['smallest']:.3f} | "
                     f"{_it(r['right_max'])} / {_it(r['right_min'])} | {_it(r['largest_on_min'])} | "
                     f"{_it(r['smallest_on_max'])} | {r['lowest_right']['min'][0]:.4f} "
                     f"({r['lowest_right']['min'][1]}) |")
    lines += ["", "| cell | runs | right | largest-letter | smallest-letter | middle-letter | other | "
              "right > 0.5 on max problems at iter, median (min-max) | lowest p(right) on min "
              "problems, median (min-max) |", "|---|---|---|---|---|---|---|---|---|"]
    for name in [n for n in ORDER if any(r["name"] == n for r in runs)]:
        mine = [r for r in runs if r["name"] == name]
        counts = [sum(r["rule"] == c for r in mine) for c in ("right", "largest-letter",
                                                              "smallest-letter", "middle-letter",
                                                              "other")]
        learnt = [max_half_at(r) for r in mine]
        low = [r["lowest_right"]["min"][0] for r in mine]
        lines.append(f"| {LABEL[name]} | {len(mine)} | " + " | ".join(map(str, counts)) +
                     f" | {statistics.median(learnt):g} ({min(learnt)}-{max(learnt)}) | "
                     f"{statistics.median(low):.4f} ({min(low):.4f}-{max(low):.4f}) |")
    lines += ["", "| p(right) > 0.5 on max problems at iteration | runs (all cells) | right | "
              "not right (their cells and seeds) |", "|---|---|---|---|"]
    for it in sorted({max_half_at(r) for r in runs}):
        mine = [r for r in runs if max_half_at(r) == it]
        bad = [f"{r['name']} s{r['seed']} ({r['rule']})" for r in mine if r["rule"] != "right"]
        lines.append(f"| {it} | {len(mine)} | {sum(r['rule'] == 'right' for r in mine)} | "
                     f"{', '.join(bad) or '-'} |")
    return "\n".join(lines) + "\n"


def _ci(d):
    n, m, lo, hi = d
    if m is None:
        return "-"
    return f"{m:+.1f} [{lo:+.1f}, {hi:+.1f}]" if lo is not None else f"{m:+.1f} (n=1)"


def regime_rows(runs):
    """Per cell: n, stalls, final avg@8 mean and t interval; then the paired differences of every
    cell against tv-mc, and of kl-atomic against kl-mc (the estimator alone)."""
    by = {}
    for r in runs:
        by.setdefault(r["name"], {})[r["seed"]] = r
    cells = {}
    for name, seeds in by.items():
        avg = [r["avg"] for r in seeds.values()]
        m = statistics.mean(avg)
        # the t interval of the mean: stats.py's paired interval against zero on every seed
        _, _, lo, hi = paired({s: r["avg"] for s, r in seeds.items()}, {s: 0.0 for s in seeds})
        cells[name] = dict(n=len(avg), stalls=sum(r["rule"] != "right" for r in seeds.values()),
                           rules={s: r["rule"] for s, r in sorted(seeds.items())},
                           avg_mean=m, avg_lo=lo, avg_hi=hi,
                           cut=statistics.mean(r["cut"] for r in seeds.values()),
                           avg=dict(sorted((s, r["avg"]) for s, r in seeds.items())))
    pairs = [(n, "tv-mc") for n in ORDER if n in by and n != "tv-mc"] + [("kl-atomic", "kl-mc")]
    diffs = {}
    for a, b in pairs:
        if a in by and b in by:
            va = {s: r["avg"] for s, r in by[a].items()}
            vb = {s: r["avg"] for s, r in by[b].items()}
            sa = {s: 100.0 * (r["rule"] != "right") for s, r in by[a].items()}   # stall, in %
            sb = {s: 100.0 * (r["rule"] != "right") for s, r in by[b].items()}
            la = {s: max_half_at(r) for s, r in by[a].items()}
            lb = {s: max_half_at(r) for s, r in by[b].items()}
            diffs[f"{a} - {b}"] = dict(avg=paired(va, vb), stall=paired(sa, sb),
                                       max_learnt=paired(la, lb),
                                       per_seed={s: va[s] - vb[s] for s in sorted(va.keys() & vb.keys())})
    return cells, diffs


def regimes_table(regimes):
    lines = ["| regime | cell | seeds | stalled runs (rule != right) | final avg@8, mean [95% t] | "
             "per seed | iterations cut short by --target_kl, mean per run |",
             "|---|---|---|---|---|---|---|"]
    for regime, (cells, _) in regimes.items():
        for name in [n for n in ORDER if n in cells]:
            c = cells[name]
            lines.append(f"| {regime} | {LABEL[name]} | {c['n']} | {c['stalls']} of {c['n']} | "
                         + (f"{c['avg_mean']:.1f} [{c['avg_lo']:.1f}, {c['avg_hi']:.1f}]"
                            if c["avg_lo"] is not None else f"{c['avg_mean']:.1f} (n=1)") + " | "
                         + ", ".join(f"{v:.1f}" for v in c["avg"].values()) + f" | {c['cut']:.1f} |")
    lines += ["", "| regime | paired difference | n | final avg@8, mean [95% t] | stall rate "
              "(%-points), mean [95% t] | iteration p(right) > 0.5 on max problems, mean [95% t] | "
              "per seed (avg@8) |", "|---|---|---|---|---|---|---|"]
    for regime, (_, diffs) in regimes.items():
        for pair, d in diffs.items():
            lines.append(f"| {regime} | {pair} | {d['avg'][0]} | {_ci(d['avg'])} | "
                         f"{_ci(d['stall'])} | {_ci(d['max_learnt'])} | "
                         + ", ".join(f"{v:+.1f}" for v in d["per_seed"].values()) + " |")
    return "\n".join(lines) + "\n"


def band(runs, name, kind, rule, start):
    """iterations, median, min, max over the seeds of one cell (iteration 0 = the warm start)."""
    curves = [dict([(0, start[kind][rule])] + [(it, p[kind][rule]) for it, p in r["curve"]])
              for r in runs if r["name"] == name]
    iters = sorted(set.intersection(*(set(c) for c in curves)))
    vals = [[c[i] for c in curves] for i in iters]
    return iters, [statistics.median(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]


def plot(rows, start, path):
    """One row of two panels per (title, runs, cells): max and min problems, the right letter
    (solid) and the shortcut that is wrong on that kind (dashed), median over seeds and min-max
    band per cell."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(rows), 2, figsize=(11, 3.9 * len(rows)), squeeze=False)
    handles = {}
    for (title, runs, cells), pair in zip(rows, axes):
        names = [n for n in ORDER if n in cells and any(r["name"] == n for r in runs)]
        for ax, kind, wrong in ((pair[0], "max", "smallest"), (pair[1], "min", "largest")):
            for n in names:
                color = COLOR[n]
                for rule, style in (("right", "-"), (wrong, "--")):
                    it, med, lo, hi = band(runs, n, kind, rule, start)
                    ax.fill_between(it, lo, hi, color=color, alpha=0.10, lw=0)
                    (h,) = ax.plot(it, med, style, color=color, lw=1.4)
                    if rule == "right":
                        handles[n] = h
            ax.set_title(f"{title}\n{kind} problems: right letter (solid), {wrong} letter "
                         "(dashed)", fontsize=9)
            ax.set_xlabel("iteration")
            ax.set_ylabel("mean probability (held-out)")
            ax.set_ylim(0, 1)
            ax.axhline(0.5, color="grey", lw=0.6, ls=":")
            ax.grid(alpha=0.3)
    order = [n for n in ORDER if n in handles]
    fig.legend([handles[n] for n in order], [LABEL[n] for n in order], loc="lower center",
               title="median over seeds, band min-max", title_fontsize=8,
               ncol=max(1, len(order)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07 / len(rows), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--regime", action="append", required=True,
                   help="NAME=FOLDER: a sweep folder run with --answer_probe letters (repeatable; "
                        "the first is the one shortcut.png shows with all its cells)")
    p.add_argument("--out", default="bench/results/rare-shortcut")
    args = p.parse_args()
    regimes = {}
    for spec in args.regime:
        name, sep, folder = spec.partition("=")
        if not sep or not os.path.isdir(folder):
            raise SystemExit(f"--regime {spec!r}: accepted NAME=FOLDER with an existing sweep folder")
        regimes[name] = read_runs(folder)
    os.makedirs(args.out, exist_ok=True)
    start = warm_start_probe()
    first = next(iter(regimes))
    stats = {name: regime_rows(runs) for name, runs in regimes.items()}
    # folders relative to the repository, else by their name: no machine's paths in results
    made = " ".join(f"--regime {n}={shown(f)}" for n, f in (s.partition("=")[::2] for s in args.regime))
    text = (f"Made by `python bench/rare_shortcut.py {made} --out {shown(args.out)}` (choices in its "
            "docstring; sweep folders outside the repository by their name).\n\nWarm start "
            "(iteration 0), mean "
            "probability on the held-out max / min problems: right "
            f"{start['max']['right']:.3f} / {start['min']['right']:.3f}, largest "
            f"{start['max']['largest']:.3f} / {start['min']['largest']:.3f}, smallest "
            f"{start['max']['smallest']:.3f} / {start['min']['smallest']:.3f}, middle "
            f"{start['max']['middle']:.3f} / {start['min']['middle']:.3f}.\n\n")
    Path(args.out, "classes.md").write_text(text + "\n".join(classes_table(n, r)
                                                             for n, r in regimes.items()))
    Path(args.out, "regimes.md").write_text(text + regimes_table(stats))
    write_json_atomic(os.path.join(args.out, "classes.json"), dict(
        warm_start=start, regimes={n: dict(runs=[{k: v for k, v in r.items() if k != "curve"}
                                                 for r in runs],
                                           cells=stats[n][0], differences=stats[n][1])
                                   for n, runs in regimes.items()}))
    mc, loose = ("tv-mc", "kl-mc"), ("kl-atomic", "tv-binary", "chi2-atomic", "dgpo")
    plot([(f"{first}, mc cells", regimes[first], mc),
          (f"{first}, atomic/binary cells and DGPO", regimes[first], loose)],
         start, os.path.join(args.out, "shortcut.png"))
    plot([(n, runs, ("tv-mc", "kl-mc", "kl-atomic")) for n, runs in regimes.items()], start,
         os.path.join(args.out, "regimes.png"))
    print(text + classes_table(first, regimes[first]) + "\n" + regimes_table(stats))


if __name__ == "__main__":
    main()
