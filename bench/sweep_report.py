"""
The report of a sweep folder (bench/sweep.py's): table.md (each method against tv-mc with 95%
intervals, the paper's orderings, per seed, learning speed, clipping by mu), sweep.json (every
number), and the figures dynamics.png, clip_by_mu.png, regions.png and, with --task rare,
answer_prob.png. The numbers come from bench/stats.py; this file formats and draws them.

    bash run.sh sweep --publish        # on a folder whose runs are all finished: it only reports
    from bench.sweep_report import report

Choices:
1. The report reads every finished run in the folder, whatever --seeds/--only the invocation had
   (bench/sweep.py is resumable and can be run in pieces); each row states its n.
2. The warm-start row is eval.py on the start model, once per folder (eval_start.json), with the
   runs' evaluation settings.
3. On the rare task the answer is the one token after `\\boxed{`, so avg@k estimates the mean
   probability of the answer token; answer_prob.png shows it per method beside the default task's
   curve (its eval_avg@k if the default sweep has such rows, else its train reward, as the panel
   title says).
"""
import json
import os
import platform
import subprocess
import sys
from collections import Counter
from pathlib import Path

import gppo
from bench import stats   # stats.EVAL_SETS: bench/sweep.py's main sets it per --task
from bench.stats import (LABELS, REFERENCE, ROOT, TASKS, aggregate, curves, clip_by_mu,
                         distinguishable, eval_curves, finished, histories, methods, mu_buckets,
                         orderings, shown, speed, write_json_atomic)


# ----------------------------------------------------------------------------------------------
# the tables

def _ms(ms, digits=1):
    m, s = ms
    if m is None:
        return "-"
    return f"{m:.{digits}f}" if s is None else f"{m:.{digits}f} ± {s:.{digits}f}"


def _ci(p, n_row=None):
    """'+3.1 [-0.4, +6.6]', '✱' when distinguishable, '(n=3)' when fewer seeds paired than the row has."""
    if p["mean"] is None:
        return "-"
    s = f"{p['mean']:+.1f} " + ("[n < 2]" if p["lo"] is None else f"[{p['lo']:+.1f}, {p['hi']:+.1f}]")
    if distinguishable(p["lo"], p["hi"]):
        s += " ✱"
    return s + (f" (n={p['n']})" if n_row is not None and p["n"] != n_row else "")


def _short(key):
    """tiny-math -> math, tiny-rare-math -> math: the column names of an eval set."""
    return key.rsplit("-", 1)[-1]


def _label(name):
    return f"{name} ({LABELS[name]})" if name in LABELS else name


def format_table(rows, k, warm=None):
    """One row per method, the reference first: n, avg@k mean ± std, paired Δ against it with its 95%
    interval, gain over the warm start, and the last iteration's entropy and train reward."""
    short = " / ".join(_short(key) for key in stats.EVAL_SETS)
    lines = ["| method | n | " + "".join(f"{key} avg@{k} | Δ {_short(key)} vs GRPO [95% CI] | " for key in stats.EVAL_SETS)
             + f"gain over warm start, {short} | entropy, last iter | train reward, last iter |",
             "|" + "---|" * (5 + 2 * len(stats.EVAL_SETS))]
    if warm is not None:
        lines.append("| warm start (before RL) | - | " + "".join(f"{warm.get(key, 0):.1f} | - | " for key in stats.EVAL_SETS)
                     + "- | - | - |")
    for name in sorted(rows, key=lambda n: n != REFERENCE):      # stable: the reference, then table order
        row = rows[name]
        if row["n"] == 0:
            lines.append(f"| {_label(name)} | 0 | not run |" + " |" * (2 + 2 * len(stats.EVAL_SETS)))
            continue
        gain = " / ".join("-" if row["gain_" + key] is None else f"{row['gain_' + key]:+.1f}" for key in stats.EVAL_SETS)
        deltas = ["reference" if name == REFERENCE else _ci(row["vs_ref_" + key], row["n"]) for key in stats.EVAL_SETS]
        label = f"**{_label(name)}**" if name == REFERENCE else _label(name)
        lines.append(f"| {label} | {row['n']} | " + "".join(f"{_ms(row[key])} | {d} | " for key, d in zip(stats.EVAL_SETS, deltas))
                     + f"{gain} | {_ms(row['entropy'], 3)} | {_ms(row['reward'], 3)} |")
    return "\n".join(lines) + "\n"


def format_per_seed(rows):
    """Each method's difference against the reference on every seed, math / code."""
    seeds = sorted({s for row in rows.values() for s in row["seeds"]})
    lines = ["| method | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|" + "---|" * (len(seeds) + 1)]
    for name, row in rows.items():
        if name == REFERENCE or row["n"] == 0:
            continue
        cells = []
        for s in seeds:
            d = [row["vs_ref_" + key]["per_seed"].get(s) for key in stats.EVAL_SETS]
            cells.append("-" if None in d else " / ".join(f"{x:+.1f}" for x in d))
        lines.append(f"| {_label(name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def format_orderings(orders):
    """The paper's orderings: one row per comparison, then a count of verdicts per claim."""
    lines = ["| claim | a − b | paper Δ math / code | n | " +
             "".join(f"Δ {_short(key)} [95% CI] | {_short(key)} | " for key in stats.EVAL_SETS).rstrip(),
             "|" + "---|" * (4 + 2 * len(stats.EVAL_SETS))]
    for o in orders:
        paper = "-" if o["paper"] is None else " / ".join(f"{x:+.1f}" for x in o["paper"])
        n = sorted({o[key]["n"] for key in stats.EVAL_SETS})
        lines.append(f"| {o['claim']} | {o['a']} − {o['b']} | {paper} | {'/'.join(map(str, n))} | "
                     + " | ".join(f"{_ci(o[key])} | {o[key]['verdict']}" for key in stats.EVAL_SETS) + " |")
    lines.append("")
    for claim in dict.fromkeys(o["claim"] for o in orders):
        counts = [(key, Counter(o[key]["verdict"] for o in orders if o["claim"] == claim)) for key in stats.EVAL_SETS]
        lines.append(f"- {claim}: " + "; ".join(f"{key}: " + ", ".join(f"{v} {c}" for v, c in cnt.items())
                                                for key, cnt in counts))
    return "\n".join(lines) + "\n"


def main_key():
    """The eval set of the one-column tables and the figure: the task's only set, or "all"."""
    return stats.EVAL_SETS[0] if len(stats.EVAL_SETS) == 1 else "all"


def format_speed(sp, rows, k, key):
    """The learning-speed table: per method the iterations to a train reward of REWARD_TARGET, the area
    under the held-out avg@k curve (its mean over training) and the final avg@k, each with its paired
    difference against the reference and 95% interval."""
    lines = [f"| method | n | iterations to train reward {stats.REWARD_TARGET:g} | not reached | Δ iterations vs GRPO "
             f"[95% CI] | avg@{k} over training (AUC) | Δ AUC vs GRPO [95% CI] | final avg@{k} | Δ final vs GRPO "
             f"[95% CI] |", "|" + "---|" * 9]
    for name in sorted(sp, key=lambda n: n != REFERENCE):
        row, main = sp[name], rows.get(name, {})
        if row["n"] == 0:
            continue
        ref = name == REFERENCE
        cis = ["reference" if ref else _ci(p, row["n"]) if p else "-"
               for p in (row["vs_ref_reach"], row["vs_ref_auc_" + key], main.get("vs_ref_" + key))]
        auc_ms = _ms(row["auc_" + key]) + ("" if row["auc_n_" + key] in (0, row["n"]) else f" (n={row['auc_n_' + key]})")
        label = f"**{_label(name)}**" if ref else _label(name)
        lines.append(f"| {label} | {row['n']} | {_ms(row['reach'])} | {row['not_reached']} of {row['n']} | {cis[0]} | "
                     f"{auc_ms} | {cis[1]} | {_ms(main.get(key, (None, None)))} | {cis[2]} |")
    return "\n".join(lines) + "\n"


def format_clip_by_mu(by_mu):
    """Per method and mu bucket: the clipped share of the bucket's tokens (mean over seeds) and, in
    brackets, the bucket's share of all response tokens, both in %."""
    pct = lambda x, d: "-" if x is None else f"{100 * x:.{d}f}"
    lines = ["| method | n | " + " | ".join(mu_buckets()) + " |", "|" + "---|" * (2 + len(mu_buckets()))]
    for name in sorted(by_mu, key=lambda n: n != REFERENCE):
        st = by_mu[name]
        lines.append(f"| {_label(name)} | {st['n']} | " +
                     " | ".join(f"{pct(c, 2)} ({pct(t, 1)})" for c, t in zip(st["clip"], st["token"])) + " |")
    return "\n".join(lines) + "\n"


def machine(threads, jobs):
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    import torch
    return dict(cpu=cpu, cores=len(os.sched_getaffinity(0)), jobs=jobs,
                torch_threads=threads or torch.get_num_threads(), default_threads=torch.get_num_threads(),
                gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                torch=torch.__version__, python=platform.python_version())


# ----------------------------------------------------------------------------------------------
# figures: reward and entropy with a min-max band over seeds, and where each region clips by mu

def plot_dynamics(curv, path):
    """Reward and entropy against iteration, mean over seeds with a min-max band: one column per
    divergence with runs (its three estimators) and one for the baselines; tv-mc dashed grey in the others."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [("baselines", list(gppo.BASELINES))] + \
             [(d, [f"{d}-{e}" for e in gppo.ESTIMATORS]) for d in gppo.DIVERGENCES]
    groups = [(t, ms) for t, ms in groups if any(m in curv for m in ms if m != REFERENCE)] or groups[:1]
    fig, axes = plt.subplots(2, len(groups), figsize=(3.2 * len(groups), 5.6), sharex=True, sharey="row",
                             squeeze=False)
    for j, (title, members) in enumerate(groups):
        for i, key in enumerate(("reward_mean", "entropy")):
            ax = axes[i, j]
            if REFERENCE in curv and REFERENCE not in members:
                ax.plot(range(1, len(curv[REFERENCE][key]["mean"]) + 1), curv[REFERENCE][key]["mean"],
                        color="grey", ls="--", lw=1, label="tv-mc (GRPO)")
            for c, m in enumerate(members):     # one colour per estimator in every column
                if m in curv:
                    band, x = curv[m][key], range(1, len(curv[m][key]["mean"]) + 1)
                    ax.fill_between(x, band["min"], band["max"], color=f"C{c}", alpha=0.15, lw=0)
                    ax.plot(x, band["mean"], lw=1.3, color=f"C{c}",
                            label=m.split("-", 1)[1] if title != "baselines" else m)
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(title)
                ax.legend(fontsize=7)
            else:
                ax.set_xlabel("iteration")
    axes[0, 0].set_ylabel("train reward (mean)")
    axes[1, 0].set_ylabel("entropy (nats/token)")
    fig.suptitle("reward and entropy: mean over seeds (line) and min-max over seeds (band)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_clip_by_mu(by_mu, path):
    """One panel per divergence, one line per estimator: the share of each mu bucket's tokens that
    were clipped (mean over seeds, bars min-max), and as light bars on the right axis the bucket's
    share of all response tokens."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nan = float("nan")
    pct = lambda xs: [nan if x is None else 100 * x for x in xs]
    labels, x = mu_buckets(), range(gppo.MU_BUCKETS)
    divs = [d for d in gppo.DIVERGENCES if any(f"{d}-{e}" in by_mu for e in gppo.ESTIMATORS)] or ["tv"]
    fig, axes = plt.subplots(1, len(divs), figsize=(3.7 * len(divs), 3.9), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, d in zip(axes, divs):
        tw = ax.twinx()
        ax.set_zorder(tw.get_zorder() + 1)     # lines in front of the token-share bars
        ax.patch.set_visible(False)
        for c, e in enumerate(gppo.ESTIMATORS):
            st = by_mu.get(f"{d}-{e}")
            if st is None:
                continue
            tw.bar([i + (c - 1) * 0.25 for i in x], pct(st["token"]), width=0.25, color=f"C{c}", alpha=0.18)
            mean, lo, hi = pct(st["clip"]), pct(st["clip_min"]), pct(st["clip_max"])
            ax.errorbar(x, mean, yerr=[[m - a for m, a in zip(mean, lo)], [b - m for m, b in zip(mean, hi)]],
                        color=f"C{c}", marker="o", ms=4, lw=1.4, capsize=2, label=f"{e} (n={st['n']})")
        ax.set_yscale("symlog", linthresh=0.1)    # 0 .. 0.1% linear, log above: mc vs atomic spans decades
        ax.set_ylim(bottom=0)
        tw.set_ylim(0, 100)
        tw.tick_params(labelsize=7, colors="grey")
        if d == divs[-1]:
            tw.set_ylabel("share of response tokens in the bucket (%, bars)", color="grey")
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_title(d)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower left", title="estimator", title_fontsize=7)
        ax.set_xlabel("behaviour probability mu of the token")
    axes[0].set_ylabel("clipped share of the bucket's tokens (%)")
    fig.suptitle("where each region clips, measured on the training batches (averaged over iterations; "
                 "points: mean over seeds, error bars: min-max)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def default_panel(k, folder=TASKS["default"]["out"],
                  summary=os.path.join(TASKS["default"]["publish_dir"], "sweep.json")):
    """The default task's curves for answer_prob.png's second panel, from what exists, in this order:
    held-out avg@k ("all") from the eval_avg@k rows of the finished runs in `folder`, or from the
    published `summary`'s eval_curves; else the train reward of `folder`'s runs (median over seeds),
    or the summary's reward curves (its median if it has one, else its mean).
    Returns dict(title, ylabel, curves={name: {"iters", "line", "min", "max"}}, line) or None."""
    names = [n for n, _ in methods()]
    results = finished(folder, names) if os.path.isdir(folder) else []
    hists = histories(folder, results, by_seed=True)
    sm = {}
    if os.path.exists(summary):
        with open(summary) as f:
            sm = json.load(f)
    as_panel = lambda ev: {n: dict(iters=c["iters"], line=c["median"], min=c["min"], max=c["max"])
                           for n, c in ev.items()}
    if any(f"eval_avg@{k}" in row for hs in hists.values() for h in hs.values() for row in h):
        try:
            with open(os.path.join(folder, "eval_start.json")) as f:
                warm = json.load(f).get(f"avg@{k}")
        except (OSError, json.JSONDecodeError):
            warm = None
        ev = eval_curves(speed(folder, results, hists, names, k, warm), "all")
        return dict(title=f"default task ({folder}): held-out avg@{k}, all sets", ylabel=f"avg@{k} (%)",
                    line="median", curves=as_panel(ev))
    if sm.get("eval_curves"):
        return dict(title=f"default task ({summary}): held-out avg@{sm.get('k', k)}, all sets",
                    ylabel=f"avg@{sm.get('k', k)} (%)", line="median", curves=as_panel(sm["eval_curves"]))
    if hists:
        rew, src, stat = curves({n: list(h.values()) for n, h in hists.items()}), folder, "median"
    else:
        rew, src = sm.get("curves") or {}, summary
        stat = "median" if all("median" in c["reward_mean"] for c in rew.values()) else "mean"
    if not rew:
        return None
    pct = lambda xs: [100 * x for x in xs]
    return dict(title=f"default task ({src}): TRAIN REWARD (batch mean),\nnot avg@{k}: no eval_avg@{k} rows there",
                ylabel="train reward, batch mean (%)", line=stat,
                curves={n: dict(iters=list(range(1, len(c["reward_mean"][stat]) + 1)), line=pct(c["reward_mean"][stat]),
                                min=pct(c["reward_mean"]["min"]), max=pct(c["reward_mean"]["max"]))
                        for n, c in rew.items()})


def plot_answer_prob(ev, k, key, path, other=None):
    """Per cell, the held-out avg@k against iteration (median over seeds, min-max band) on this task,
    and beside it `other` (default_panel's) when given. One colour per method in both panels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [dict(title=f"rare task: held-out {key} avg@{k} ≈ mean probability\nof the answer token",
                   ylabel=f"avg@{k} (%)", line="median",
                   curves={n: dict(iters=c["iters"], line=c["median"], min=c["min"], max=c["max"])
                           for n, c in ev.items()})] + ([other] if other else [])
    order = [n for n, _ in methods() if any(n in p["curves"] for p in panels)]
    order = sorted(order, key=lambda n: n != REFERENCE)
    if other and set(other["curves"]) & set(ev):      # the other task's curves of this sweep's methods only
        other = dict(other, curves={n: c for n, c in other["curves"].items() if n in ev})
        panels[1:] = [other]
        order = [n for n in order if n in ev]
    color = {REFERENCE: "black", **{n: f"C{i}" for i, n in enumerate(n for n in order if n != REFERENCE)}}
    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 4.6), squeeze=False)
    handles = {}
    for ax, p in zip(axes[0], panels):
        for n in order:
            c = p["curves"].get(n)
            if not c:
                continue
            ax.fill_between(c["iters"], c["min"], c["max"], color=color[n], alpha=0.13, lw=0)
            (h,) = ax.plot(c["iters"], c["line"], color=color[n], lw=1.8 if n == REFERENCE else 1.4,
                           marker="o" if len(c["iters"]) <= 20 else None, ms=3)
            handles[n] = h
        ax.set_title(f"{p['title']}\n(line: {p['line']} over seeds, band: min-max)", fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylabel(p["ylabel"])
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    fig.legend([handles[n] for n in order if n in handles], [_label(n) for n in order if n in handles],
               loc="lower center", ncol=min(4, len(handles)) or 1, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.04 * ((len(handles) - 1) // 4), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# the report: warm start, regions, tables, figures, sweep.json

def warm_start(settings, out):
    """avg@k of the start model: <out>/eval_start.json, made once by eval.py with the runs'
    evaluation settings (k, response length, context, template, backend, dtype). Returns (scores or
    None, the eval.py command)."""
    a, path = settings["train_args"], os.path.join(out, "eval_start.json")
    cmd = [sys.executable, "eval.py", "--model", settings["model"], "--data", ",".join(stats.EVAL_SETS),
           "--data_dir", settings["data_dir"], "--template", a["template"], "--k", str(a["eval_k"]),
           "--max_new_tokens", str(a["max_new_tokens"]), "--max_model_len", str(a["max_model_len"]),
           "--backend", a["backend"], "--dtype", a["vllm_dtype"], "--out", path]
    public = [shown(c) for c in cmd[1:-1]] + [os.path.join(shown(out), "eval_start.json")]  # sweep.json's
    if not os.path.exists(path):
        print("warm start:", " ".join(cmd[1:]), f"(log {path[:-5]}.log)", flush=True)
        with open(path[:-5] + ".log", "w") as log:
            if subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                print(f"warm-start evaluation failed; see {path[:-5]}.log", flush=True)
                return None, public
    with open(path) as f:
        return json.load(f).get(f"avg@{a['eval_k']}"), public


def draw_regions(out):
    """regions.txt (`python bench/regions.py`: the regions as a table at a few mu) and regions.png
    (bench/plot_regions.py: every cell's region against mu), once per sweep folder."""
    regions = os.path.join(out, "regions.png")
    if not os.path.exists(regions):
        with open(os.path.join(out, "regions.txt"), "w") as f:
            subprocess.run([sys.executable, os.path.join("bench", "regions.py")], cwd=ROOT, stdout=f, check=True)
        subprocess.run([sys.executable, "bench/plot_regions.py", "--out", os.path.abspath(regions)],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def report(out, settings, threads, jobs, invocations, task="default"):
    """Tables, figures and sweep.json from every finished run in `out`; returns table.md's text."""
    all_names = [n for n, _ in methods()]
    results = finished(out, all_names)
    k = settings["train_args"]["eval_k"]
    warm, warm_cmd = warm_start(settings, out)
    rows, orders = aggregate(results, all_names, warm), orderings(results, all_names)
    hists_s = histories(out, results, by_seed=True)
    hists = {n: list(h.values()) for n, h in hists_s.items()}
    curv, by_mu = curves(hists), clip_by_mu(hists)
    key = main_key()
    sp = speed(out, results, hists_s, all_names, k, warm)
    ev = eval_curves(sp, key)
    plot_dynamics(curv, os.path.join(out, "dynamics.png"))
    plot_clip_by_mu(by_mu, os.path.join(out, "clip_by_mu.png"))
    figures = ""
    if task == "rare":
        if ev:
            other = default_panel(k)
            plot_answer_prob(ev, k, key, os.path.join(out, "answer_prob.png"), other)
            figures = (f", answer_prob.png (held-out {key} avg@{k} against iteration per method, median and "
                       f"min-max band over seeds; beside it " + (other["title"].replace("\n", " ") if other else
                       "nothing: no default sweep found") + ")")
        else:
            figures = f" (no answer_prob.png: no run has eval_avg@{k} rows; run with --eval_every N)"
    speed_md = ""
    if task != "default" or ev:
        grid = next(iter(ev.values()))["iters"] if ev else []
        grid_txt = ", ".join(map(str, grid)) if len(grid) <= 8 else f"{grid[0]}, {grid[1]}, …, {grid[-1]}"
        speed_md = (f"\n## Learning speed: {key}\n\nIterations to a train reward of {stats.REWARD_TARGET:g}: the first "
                    f"iteration whose metrics row has reward_mean ≥ {stats.REWARD_TARGET:g} (the batch's mean reward, "
                    f"on training prompts); a run that never gets there counts as its last iteration + 1, and "
                    f"\"not reached\" says how many did not, so those means are lower bounds. AUC: the held-out "
                    f"avg@{k} curve over iterations {grid_txt or '(none: no eval_avg@' + str(k) + ' rows)'} "
                    f"(0: the warm start, eval_start.json; then the eval_avg@{k} rows of metrics.jsonl, "
                    f"train.py --eval_every, the last from eval.json if its row has none), its trapezoid area "
                    f"divided by the span of iterations: the mean avg@{k} over training. Final: avg@{k} after "
                    f"the last iteration (eval.json), as in the table above. Δ: paired against tv-mc (GRPO), "
                    f"95% t interval, ✱ as above; fewer iterations (Δ < 0) is faster.\n\n"
                    + format_speed(sp, rows, k, key))
    clip_md = ""
    if by_mu:
        clip_md = ("\n## Where each region clips, by behaviour probability mu\n\nPer method and mu bucket of "
                   "the training batches' response tokens: the clipped share of the bucket's tokens in % (pooled "
                   "over iterations, mean over seeds) and, in brackets, the bucket's share of all response tokens "
                   "in % (mean over iterations and seeds).\n\n" + format_clip_by_mu(by_mu))
    draw_regions(out)
    mach = machine(threads, jobs)
    # the threads the finished runs really had (they may come from several invocations)
    used = sorted({r["threads"] or mach["default_threads"] for r in results}) or [mach["torch_threads"]]
    mach["torch_threads"] = ",".join(map(str, used))
    run_s = sum(r["wall_s"] for r in results)
    inv_s = sum(i["wall_s"] for i in invocations)
    flags = "".join(" " + f for f in settings["train_flags"])
    n_comparisons = sum(r["n"] > 0 for r in rows.values()) - 1 + len(orders)
    text = (f"# GPPO grid and baselines: paired comparison against GRPO (tv-mc)\n\n"
            f"avg@{k} (%) on the held-out {' and '.join(stats.EVAL_SETS)} problems, mean ± sample std over each "
            f"method's finished seeds (n). Δ: the paired difference against tv-mc (GRPO) over the seeds both "
            f"finished (seed s of every method starts from the same model and samples the same first "
            f"iteration), its mean and 95% Student t interval; ✱ marks a difference distinguishable from 0 "
            f"(the interval excludes 0). The intervals are per comparison and not corrected for the "
            f"{n_comparisons} comparisons below: about 1 in 20 of those with no true difference shows a ✱ "
            f"by chance. Entropy (nats/token) and train reward: the last RL iteration. "
            f"Every run: `python train.py <method> --seed S --model {settings['model']} --data_dir "
            f"{settings['data_dir']} --eval_data {','.join(stats.EVAL_SETS)}{flags}`, train.py's defaults "
            f"otherwise (delta calibrated per divergence, gppo.default_delta). Warm start: "
            f"`{' '.join(warm_cmd)}`{'' if warm else ' (not available)'}.\n\n"
            + format_table(rows, k, warm) +
            "\n## The paper's orderings\n\nEach claim \"a above b\" as the paired a − b over the seeds "
            "both finished, next to the paper's Table 1 difference. Rule: **reproduced** when the 95% "
            "interval lies above 0, **not reproduced (reversed)** when it lies below 0, **undecided** at "
            "this budget when it contains 0 (or fewer than 2 paired seeds); identical regions give a tie.\n\n"
            + format_orderings(orders) +
            f"\n## Per seed: Δ vs GRPO, {' / '.join(map(_short, stats.EVAL_SETS))}\n\n" + format_per_seed(rows) +
            speed_md + clip_md +
            f"\nMachine: {mach['cpu']}, {mach['cores']} cores, GPU {mach['gpu'] or 'none'}, torch threads "
            f"{mach['torch_threads']} per run.\n"
            f"Wall time: {len(results)} finished runs took {run_s / 60:.1f} min summed "
            f"({run_s / max(len(results), 1):.0f} s per run); the {len(invocations)} invocation(s) of the "
            f"sweep took {inv_s / 60:.1f} min:\n\n"
            + "".join(f"- `{i['command']}`: {i['ran']} runs in {i['wall_s'] / 60:.1f} min (--jobs {i['jobs']}, "
                      f"{i['at']})\n" for i in invocations) +
            f"\nFigures: dynamics.png (reward and entropy against iteration, mean and min-max band over "
            f"seeds), clip_by_mu.png (clipped share of each behaviour-probability bucket's tokens, per "
            f"cell, next to the bucket's token share), regions.png (every cell's proximal region "
            f"against mu){figures}.\n")
    Path(out, "table.md").write_text(text)
    write_json_atomic(os.path.join(out, "sweep.json"), dict(
        settings=settings, k=k, machine=mach, invocations=invocations, run_wall_s_sum=run_s,
        warm_start=warm, warm_start_cmd=warm_cmd, rows=rows, orderings=orders, clip_by_mu=by_mu,
        mu_buckets=mu_buckets(), curves=curv, reward_target=stats.REWARD_TARGET, eval_curve_key=key, eval_curves=ev,
        speed={n: r for n, r in sp.items() if r["n"]},
        runs=[{key: r[key] for key in ("name", "seed", "eval", "final", "iters", "wall_s",
                                       "iter_s_mean", "other_s", "threads")} for r in results]))
    return text

