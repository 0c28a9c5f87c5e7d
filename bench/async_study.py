"""
Which region tolerates a stale sampler: --async_lag K on the embedded default, --target_kl 0 (the
guard would hide what the region does), three cells, paired seeds, each against K = 0.

    python bench/async_study.py --run --seeds 0-2 --iters 30   # the runs (bench/sweep.py, resumable)
    python bench/async_study.py --run --seeds 3 --configs K0,K3   # more seeds where intervals are wide
    python bench/async_study.py                            # tables + figure from what has finished
    python bench/async_study.py --publish                  # ... into bench/results/async/
    python bench/async_study.py --publish bench/results/async-8seeds   # ... or another folder

Configurations (CONFIGS): coupled (--mu_source vllm: the region bounds pi against the sampler's mu,
eq. 11 as written) at K = 0, 1, 3, and decoupled at K = 3 (--tis_cap 2: the region bounds pi against
the proximal policy, each token weighted by min(proximal / mu, 2); train.py's docstring). Each is a
bench/sweep.py folder out/async/<config>/ of the cells tv-mc (GRPO), kl-atomic, tv-binary (DPPO).

What it reports, per cell and configuration, over the seeds that finished:
1. final avg@8 (both held-out sets), and its paired difference against K0 with a 95% t interval
   (bench/stats.py: at 3-5 seeds a t interval, not a bootstrap);
2. the first iteration whose train reward reaches 0.8 (a run that never does counts as iters + 1),
   paired against K0 the same way; then each cell's change from its own K0 against another
   cell's (the region that tolerates staleness best loses the least);
3. the clip rate by behaviour probability (clip_frac_by_mu; under decoupled the buckets are the
   proximal policy's probability), the mean over iterations and seeds;
4. the distribution of log(proximal / mu) at the first step (the row's mismatch_hist, logged at
   K >= 1; infra/metrics.MISMATCH_BINS) over the iterations whose batch is K iterations stale.
"""
import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.stats import finished, histories, iters_to_reward, paired, shown  # noqa: E402
from infra.metrics import MISMATCH_BINS  # noqa: E402

CELLS = {"grpo": "tv-mc", "kl-atomic": "kl-atomic", "dppo": "tv-binary"}   # sweep name -> run name
CONFIGS = {"K0": ["--async_lag", "0", "--mu_source", "vllm"],
           "K1": ["--async_lag", "1", "--mu_source", "vllm"],
           "K3": ["--async_lag", "3", "--mu_source", "vllm"],
           "K3-decoupled": ["--async_lag", "3", "--tis_cap", "2"]}
COMMON = ["--target_kl", "0"]
TARGET = 0.8


def run(configs, seeds, jobs, iters):
    for name in configs:
        cmd = [sys.executable, "bench/sweep.py", "--out", f"out/async/{name}", "--only",
               ",".join(CELLS), "--seeds", seeds, "--jobs", str(jobs), "--iters", str(iters),
               *COMMON, *CONFIGS[name]]
        print(" ".join(shown(c) for c in cmd), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)


def collect():
    """{config: {cell: {seed: (avg@8 all, iteration to TARGET, metrics rows)}}}"""
    out = {}
    for name in CONFIGS:
        folder = str(ROOT / "out" / "async" / name)
        results = finished(folder, list(CELLS.values())) if os.path.isdir(folder) else []
        hists = histories(folder, results, by_seed=True)
        out[name] = {cell: {r["seed"]: (r["eval"]["all"], iters_to_reward(
            hists[cell][r["seed"]], TARGET)[0], hists[cell][r["seed"]])
            for r in results if r["name"] == cell} for cell in CELLS.values()}
    return out


def interval(n, m, lo, hi):
    if n == 0:
        return "-"
    return f"{m:+.1f} [{lo:+.1f}, {hi:+.1f}] (n={n})" if lo is not None else f"{m:+.1f} (n=1)"


def spread(xs):
    xs = sorted(xs)
    return f"{statistics.median(xs):.1f} [{xs[0]:.1f}, {xs[-1]:.1f}]" if xs else "-"


def never(runs):
    """How many runs never reached TARGET (counted as their last iteration + 1)."""
    n = sum(not iters_to_reward(v[2], TARGET)[1] for v in runs.values())
    return f", {n} never" if n else ""


def report(data):
    lines = ["# --async_lag study: embedded default, --target_kl 0", "",
             "Median [min, max] over seeds; differences are paired against K0 on the seeds both "
             "finished, with a 95% t interval.", "",
             f"| cell | config | final avg@8 | vs K0 | iteration to train reward {TARGET} | vs K0 |",
             "|---|---|---|---|---|---|"]
    for cell in CELLS.values():
        base = data["K0"][cell]
        for name in CONFIGS:
            runs = data[name][cell]
            if not runs:
                continue
            score = {s: v[0] for s, v in runs.items()}
            speed = {s: v[1] for s, v in runs.items()}
            lines.append(
                f"| {cell} | {name} | {spread(score.values())} | "
                f"{interval(*paired(score, {s: v[0] for s, v in base.items()})) if name != 'K0' else ''} | "
                f"{spread(speed.values())}{never(runs)} | "
                f"{interval(*paired(speed, {s: v[1] for s, v in base.items()})) if name != 'K0' else ''} |")
    lines += ["", "Which region tolerates the stale sampler best: each cell's change from its own K0, "
              "against another cell's change, paired by seed ((a at K - a at K0) - (b at K - b at K0); "
              "positive: a lost less avg@8, or took more extra iterations):", "",
              "| config | a - b | avg@8 change | iterations change |", "|---|---|---|---|"]
    for name in [n for n in CONFIGS if n != "K0"]:
        change = {cell: [{s: v[i] - data["K0"][cell][s][i] for s, v in data[name][cell].items()
                          if s in data["K0"][cell]} for i in (0, 1)] for cell in CELLS.values()}
        for a, b in itertools.combinations(CELLS.values(), 2):
            if change[a][0] and change[b][0]:
                lines.append(f"| {name} | {a} - {b} | {interval(*paired(change[a][0], change[b][0]))} "
                             f"| {interval(*paired(change[a][1], change[b][1]))} |")
    lines += ["", "Clip rate by behaviour probability mu (< 0.01 | < 0.1 | < 0.5 | >= 0.5), mean "
              "over iterations and seeds:", "", "| cell | config | clip_frac_by_mu | clip_frac |",
              "|---|---|---|---|"]
    for cell in CELLS.values():
        for name in CONFIGS:
            rows = [r for v in data[name][cell].values() for r in v[2]]
            if rows:
                by_mu = [sum(r["clip_frac_by_mu"][b] for r in rows) / len(rows) for b in range(4)]
                clip = sum(r["clip_frac"] for r in rows) / len(rows)
                lines.append(f"| {cell} | {name} | {' / '.join(f'{x:.4f}' for x in by_mu)} | "
                             f"{clip:.4f} |")
    edges = ["-inf", *map(str, MISMATCH_BINS), "inf"]
    lines += ["", "Share of tokens by log(proximal / mu) at the first step, bins "
              + ", ".join(f"({a}, {b}]" for a, b in zip(edges, edges[1:]))
              + " (mean over the stale iterations and seeds; not logged at K0, where "
              "logp_gap_vllm is ~1e-7):", "", "| cell | config | shares | ratio mean | k3 KL |",
              "|---|---|---|---|---|"]
    for cell in CELLS.values():
        for name in CONFIGS:
            rows = [r for v in data[name][cell].values() for r in v[2]
                    if r.get("staleness", 0) >= int(name[1]) > 0]
            if rows:
                hist = [sum(r["mismatch_hist"][b] for r in rows) / len(rows)
                        for b in range(len(MISMATCH_BINS) + 1)]
                mean = sum(r["mismatch_ratio_mean"] for r in rows) / len(rows)
                kl = sum(r["mismatch_kl_k3"] for r in rows) / len(rows)
                lines.append(f"| {cell} | {name} | {' / '.join(f'{x:.3f}' for x in hist)} | "
                             f"{mean:.4f} | {kl:.5f} |")
    return "\n".join(lines) + "\n"


def figure(data, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(CELLS), figsize=(4 * len(CELLS), 3.2), sharey=True)
    for ax, cell in zip(axes, CELLS.values()):
        for name in CONFIGS:
            runs = list(data[name][cell].values())
            if not runs:
                continue
            n = min(len(v[2]) for v in runs)
            mean = [sum(v[2][i]["reward_mean"] for v in runs) / len(runs) for i in range(n)]
            ax.plot(range(1, n + 1), mean, label=f"{name} (n={len(runs)})")
        ax.axhline(TARGET, color="grey", lw=0.5)
        ax.set_title(cell)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("train reward (mean over seeds)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="the --async_lag study", allow_abbrev=False)
    p.add_argument("--run", action="store_true", help="run the missing runs first")
    p.add_argument("--seeds", default="0-2", help="seeds to run, as bench/sweep.py reads them")
    p.add_argument("--configs", default=",".join(CONFIGS), help="which configurations to run")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (sweep.py: 1 thread each)")
    p.add_argument("--iters", type=int, default=60, help="train.py --iters of every run")
    p.add_argument("--publish", nargs="?", const="bench/results/async", default="",
                   metavar="DIR", help="write the tables and figure into DIR (bench/results/async/)")
    a = p.parse_args()
    if a.run:
        run(a.configs.split(","), a.seeds, a.jobs, a.iters)
    data = collect()
    text = report(data)
    print(text)
    dest = ROOT / (a.publish or "out/async")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "table.md").write_text(text)
    (dest / "runs.json").write_text(json.dumps(
        {name: {cell: {s: v[:2] for s, v in runs.items()} for cell, runs in cells.items()}
         for name, cells in data.items()}, indent=1))
    figure(data, dest / "reward.png")
    print(f"wrote {shown(str(dest))}/table.md, runs.json, reward.png")
