"""
The sweep's statistics, and the files of a sweep folder they are read from: each method's mean and
spread over seeds, its paired difference against tv-mc (GRPO) with a 95% interval, the paper's
orderings, learning speed, and the curves over seeds. Result dicts and metrics rows in, numbers
out: no runs, no matplotlib.

    from bench.stats import paired, finished       # bench/sweep.py, sweep_report.py, rare_shortcut.py
    .venv/bin/python -m pytest tests/test_sweep.py -q          # its tests (CPU, no model)

Choices:
1. 95% intervals are Student t intervals of the paired differences over the seeds both methods
   finished (bench/sweep.py pairs seeds: seed s of every method starts from the same model and
   samples the same first iteration). Not a bootstrap: at 3-5 seeds a percentile bootstrap has a
   handful of distinct resamples (10 at n = 3), its interval never leaves the range of the data,
   and it ignores that the spread is itself estimated from n points, so it covers far less than
   95%. The t interval is exact for normal differences and honest about n: at n = 3 its half-width
   is 2.5 standard deviations of the differences. "Distinguishable" means the interval excludes 0.
   The intervals are per comparison, not corrected for the many made.
2. Learning speed, per run: the iterations to a train reward of REWARD_TARGET (0.5; the first
   metrics row with reward_mean >= 0.5, a run that never gets there counts as its last iteration + 1
   and the table counts them) and the area under the held-out avg@k curve: iteration 0 from the warm
   start (eval_start.json), then train.py's eval_avg@k rows (--eval_every N), trapezoid divided by
   the span, i.e. the mean avg@k over training; each paired against tv-mc like the final avg@k.
3. EVAL_SETS, the eval sets of the tables, is the default task's until bench/sweep.py's main sets
   its --task's: read it as stats.EVAL_SETS (not imported by name), so that the change is seen.
"""
import glob
import json
import math
import os
import statistics
from pathlib import Path

import gppo

ROOT = Path(__file__).resolve().parents[1]

EVAL_SETS = ("tiny-math", "tiny-code")   # the --task's eval sets (choice 3: sweep.py's main sets them)


def preset_flags(path):
    """A configs/*.args file's flags, one 'flag=value' per line ('#' starts a comment line)."""
    return [ln.strip() for ln in open(ROOT / path) if ln.strip() and not ln.lstrip().startswith("#")]


SMOLLM2_PRESET = preset_flags("configs/smollm2_cpu.args")
SMOLLM2_FLAGS = [f for f in SMOLLM2_PRESET if f.split("=", 1)[0] not in ("--model", "--out_dir", "--eval_data")]
SMOLLM2_TASK = next(f.split("=", 1)[1] for f in SMOLLM2_PRESET if f.startswith("--eval_data="))
# --task: each embedded task's model, data folder, held-out sets, train.py flags (before the
# pass-through ones, which may override them), sweep folder, publish folder, the command that makes
# the model when it is missing, and the learning-speed table's train reward to reach
TASKS = {
    "default": dict(model="data/tiny/model", data_dir="data/tiny", eval_sets=("tiny-math", "tiny-code"),
                    flags=[], out="out/sweep", publish_dir="bench/results/sweep",
                    prepare=["data/prepare.py"], reward_target=0.5),
    # data/tiny_rare (data/prepare.py --variant rare): the right answer letter starts rare (mu ~ 0.03)
    "rare": dict(model="data/tiny_rare/model", data_dir="data/tiny_rare", eval_sets=("tiny-rare-math",),
                 flags=["--train_data", "tiny-rare-math"], out="out/sweep-rare",
                 publish_dir="bench/results/sweep-rare", prepare=["data/prepare.py", "--variant", "rare"],
                 reward_target=0.5),
    # the real model: configs/smollm2_cpu.args (its train and held-out task, reasoning-gym arithmetic
    # the start model solves ~30-40% of, two-shot prompts, bf16), less what the sweep sets itself
    "smollm2": dict(model="data/smollm2/model", data_dir="data/tiny", eval_sets=(SMOLLM2_TASK,),
                    flags=SMOLLM2_FLAGS, out="out/sweep-smollm2", publish_dir="bench/results/sweep-smollm2",
                    prepare=["data/smollm2.py"], reward_target=0.8),
}
REFERENCE = "tv-mc"
REWARD_TARGET = 0.5        # the learning-speed table's train reward to reach (choice 2; sweep.py's main
                           # sets the --task's, like EVAL_SETS)
# table labels of the named cells, from gppo.METHODS: tv-mc -> "GRPO / PPO", kl-mc -> "DAPO", ...
LABELS = {"-".join(cell): " / ".join(n.upper() for n, c in gppo.METHODS.items() if c == cell)
          for cell in gppo.METHODS.values()}
# the paper's Table 1 (arXiv 2610.13015 section 4.2), avg@8 in %: (math, code)
PAPER = {"tv-mc": (27.7, 52.4), "tv-binary": (39.0, 53.8), "tv-atomic": (36.3, 54.9),
         "hellinger-mc": (31.8, 54.4), "hellinger-binary": (35.4, 55.9), "hellinger-atomic": (36.9, 58.1),
         "chi2-mc": (27.7, 52.4), "chi2-binary": (34.8, 54.8), "chi2-atomic": (40.5, 57.2),
         "kl-mc": (34.6, 54.3), "kl-binary": (37.2, 55.9), "kl-atomic": (41.5, 59.7),
         "gspo": (35.1, 53.7), "gmpo": (35.1, 54.4), "sapo": (35.0, 53.5), "cispo": (30.5, 51.3),
         "clip_cov": (31.5, 53.0)}
# Student t quantiles t(0.975, df) for df = 1..30, the two-sided 95% critical values of any standard
# table (e.g. NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.2); scipy is not a
# dependency. tests/test_sweep.py checks each against the t CDF integrated numerically. Beyond
# df = 30 the df = 30 value is used: slightly wide (the limit is 1.960), never too narrow.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def methods():
    """(name, train.py flags) of every baseline, then every grid cell grouped by divergence."""
    out = [(b, ["--method", b]) for b in gppo.BASELINES]
    out += [(f"{d}-{e}", ["--objective", "gppo", "--divergence", d, "--estimator", e])
            for d in gppo.DIVERGENCES for e in gppo.ESTIMATORS]
    return out


# ----------------------------------------------------------------------------------------------
# a sweep folder: <method>-seed<s>/ per run, its result.json and metrics.jsonl

def write_json_atomic(path, obj):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def run_dir(out, name, seed):
    return os.path.join(out, f"{name}-seed{seed}")


def shown(arg):
    """A command-line word as committed results print it: a path (or --flag=path) relative to the
    repository when inside it, else its last part alone; no machine's absolute paths."""
    flag, eq, path = arg.rpartition("=") if arg.startswith("--") else ("", "", arg)
    if not os.path.isabs(path):
        return arg
    p = Path(path).resolve()
    return flag + eq + (os.path.relpath(p, ROOT) if p.is_relative_to(ROOT) else p.name)


def load_result(out, name, seed):
    path = os.path.join(run_dir(out, name, seed), "result.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def finished(out, names):
    """Every finished run in `out` of the methods `names`, at any seed, in table then seed order."""
    found = []
    for name in names:
        dirs = glob.glob(os.path.join(glob.escape(out), f"{name}-seed*"))
        seeds = sorted(int(s) for d in dirs if (s := d.rsplit("-seed", 1)[1]).isdigit())
        found += [r for s in seeds if (r := load_result(out, name, s)) is not None]
    return found


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def histories(out, results, by_seed=False):
    """{name: [metrics rows of each finished seed]}, or {name: {seed: rows}} with by_seed"""
    hists = {}
    for r in results:
        rows = read_metrics(os.path.join(run_dir(out, r["name"], r["seed"]), "metrics.jsonl"))
        if by_seed:
            hists.setdefault(r["name"], {})[r["seed"]] = rows
        else:
            hists.setdefault(r["name"], []).append(rows)
    return hists


# ----------------------------------------------------------------------------------------------
# statistics (paired seeds, as bench/sweep.py runs them; choice 1 above)

def mean_std(xs):
    """(mean, sample std) of xs; std None for fewer than 2 values, both None for none."""
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def paired(a, b):
    """The paired difference a - b over the seeds both have ({seed: value} each): (n, mean, lo, hi),
    lo..hi its 95% t interval (None below 2 seeds; everything None with no common seed)."""
    d = [a[s] - b[s] for s in sorted(a.keys() & b.keys())]
    if not d:
        return 0, None, None, None
    m = statistics.mean(d)
    if len(d) < 2:
        return 1, m, None, None
    half = T975[min(len(d) - 1, len(T975)) - 1] * statistics.stdev(d) / math.sqrt(len(d))
    return len(d), m, m - half, m + half


def distinguishable(lo, hi):
    """Is the difference distinguishable from zero: does its 95% interval exclude 0?"""
    return lo is not None and (lo > 0 or hi < 0)


def verdict(n, mean, lo, hi):
    """The rule of the orderings table for a claim "a above b", from the paired a - b."""
    if lo is None:
        return "undecided (n < 2)"
    if lo == hi == 0:
        return "tie: identical on every seed"
    if lo > 0:
        return "reproduced"
    return "not reproduced (reversed)" if hi < 0 else "undecided"


def by_seed(results):
    """{name: {seed: result}}"""
    runs = {}
    for r in results:
        runs.setdefault(r["name"], {})[r["seed"]] = r
    return runs


def scores(runs_of, key):
    """{seed: avg@k on eval set `key`} of one method's runs."""
    return {s: r["eval"][key] for s, r in runs_of.items() if r["eval"].get(key) is not None}


def vs_ref(mine, theirs):
    """One method's paired difference against the reference ({seed: value} each): n, mean, 95% t
    interval (paired), distinguishable, and the difference on every common seed."""
    n, m, lo, hi = paired(mine, theirs)
    return dict(n=n, mean=m, lo=lo, hi=hi, distinguishable=distinguishable(lo, hi),
                per_seed={s: mine[s] - theirs[s] for s in sorted(mine.keys() & theirs.keys())})


def aggregate(results, names, warm=None):
    """{name: row}: n and seeds; per eval set (and "all") mean/std, the paired difference against
    tv-mc (n, mean, 95% interval, per seed) and the gain of the mean over the warm start; the last
    iteration's entropy and reward."""
    runs = by_seed(results)
    ref = runs.get(REFERENCE, {})
    rows = {}
    for name in names:
        rs = runs.get(name, {})
        row = {"n": len(rs), "seeds": sorted(rs)}
        for key in EVAL_SETS + ("all",):
            mine, theirs = scores(rs, key), scores(ref, key)
            row[key] = mean_std(mine.values())
            row["vs_ref_" + key] = vs_ref(mine, theirs)
            w = (warm or {}).get(key)
            row["gain_" + key] = None if w is None or row[key][0] is None else row[key][0] - w
        row["entropy"] = mean_std([r["final"].get("entropy") for r in rs.values()])
        row["reward"] = mean_std([r["final"].get("reward_mean") for r in rs.values()])
        row["wall_s"] = mean_std([r["wall_s"] for r in rs.values()])
        rows[name] = row
    return rows


def claims(names):
    """The paper's orderings as (claim, a, b), each meaning "a above b"."""
    divs, ests = list(gppo.DIVERGENCES), list(gppo.ESTIMATORS)
    out = [(f"{e} above mc", f"{d}-{e}", f"{d}-mc") for e in ("atomic", "binary") for d in divs]
    out += [("curvature above tv", f"{d}-{e}", f"tv-{e}") for e in ests for d in divs if d != "tv"]
    return out + [("kl-atomic best", "kl-atomic", n) for n in names if n != "kl-atomic"]


def orderings(results, names):
    """Every claim whose two methods have finished runs: the paper's difference and ours, paired."""
    runs, out = by_seed(results), []
    for claim, a, b in claims(names):
        if not runs.get(a) or not runs.get(b):
            continue
        row = dict(claim=claim, a=a, b=b,
                   paper=[x - y for x, y in zip(PAPER[a], PAPER[b])] if a in PAPER and b in PAPER else None)
        for key in EVAL_SETS:
            n, m, lo, hi = paired(scores(runs[a], key), scores(runs[b], key))
            row[key] = dict(n=n, mean=m, lo=lo, hi=hi, verdict=verdict(n, m, lo, hi))
        out.append(row)
    return out


# ----------------------------------------------------------------------------------------------
# learning speed (choice 2): iterations to a train reward, area under the held-out avg@k curve

def iters_to_reward(hist, target=None):
    """(iteration, reached): the first iteration whose metrics row has reward_mean >= target (default
    REWARD_TARGET, the --task's); a run that never gets there counts as its last iteration + 1,
    reached False."""
    target = REWARD_TARGET if target is None else target
    for row in hist:
        if row.get("reward_mean") is not None and row["reward_mean"] >= target:
            return row["iter"], True
    return (hist[-1]["iter"] if hist else 0) + 1, False


def eval_points(hist, k, start=None, final=None):
    """[(iteration, {eval set: avg@k})] of one run, by iteration: 0 from `start` (the warm start's
    scores), every metrics row's eval_avg@k (train.py --eval_every), and `final` (eval.json) at the last
    iteration when its row has none. [] when no row has eval_avg@k (the run had no --eval_every):
    start and end alone are no curve."""
    key = f"eval_avg@{k}"
    pts = {row["iter"]: row[key] for row in hist if row.get(key)}
    if not pts:
        return []
    if start:
        pts.setdefault(0, start)
    if final and hist and hist[-1]["iter"] not in pts:
        pts[hist[-1]["iter"]] = final
    return sorted(pts.items())


def auc(points, key):
    """The mean of eval set `key`'s avg@k over training: the trapezoid area under its curve
    (iteration, value), divided by the span of iterations. None with fewer than 2 points."""
    xy = [(it, v[key]) for it, v in points if v.get(key) is not None]
    if len(xy) < 2 or xy[-1][0] == xy[0][0]:
        return None
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(xy, xy[1:]))
    return area / (xy[-1][0] - xy[0][0])


def run_start(out, r, warm):
    """A run's iteration-0 scores: the sweep's warm start (eval_start.json of --out, the same for every
    run, so it shifts every method's area alike), else the run's own eval_start.json (--eval_before)."""
    if warm:
        return warm
    try:
        with open(os.path.join(run_dir(out, r["name"], r["seed"]), "eval_start.json")) as f:
            return next(iter(json.load(f).values()))       # {"avg@k": {...}, "model": ...}
    except (OSError, json.JSONDecodeError, StopIteration):
        return None


def speed(out, results, hists, names, k, warm=None):
    """{name: row} of the learning-speed table, from the finished runs and their metrics rows
    (hists: {name: {seed: rows}}, histories(..., by_seed=True)): per method n, the iterations to a train reward of
    REWARD_TARGET (mean ± std, how many runs did not reach it, paired difference against tv-mc) and,
    per eval set (and "all"), the area under the held-out avg@k curve (the same) and the number of
    curve points; plus "points" {seed: [(iteration, {set: avg@k})]} for the figure."""
    runs = by_seed(results)
    per = {}                                   # name -> {seed: dict(reach, reached, points)}
    for name, rs in runs.items():
        per[name] = {}
        for s, r in rs.items():
            h = hists.get(name, {}).get(s, [])
            it, ok = iters_to_reward(h)
            per[name][s] = dict(reach=it, reached=ok, points=eval_points(h, k, run_start(out, r, warm), r["eval"]))
    ref = per.get(REFERENCE, {})
    rows = {}
    for name in names:
        rs = per.get(name, {})
        reach = {s: v["reach"] for s, v in rs.items()}
        row = dict(n=len(rs), reach=mean_std(reach.values()), not_reached=sum(not v["reached"] for v in rs.values()),
                   vs_ref_reach=vs_ref(reach, {s: v["reach"] for s, v in ref.items()}),
                   points={s: v["points"] for s, v in sorted(rs.items())})
        for key in EVAL_SETS + ("all",):
            mine = {s: a for s, v in rs.items() if (a := auc(v["points"], key)) is not None}
            theirs = {s: a for s, v in ref.items() if (a := auc(v["points"], key)) is not None}
            row["auc_" + key] = mean_std(mine.values())
            row["auc_n_" + key] = len(mine)
            row["vs_ref_auc_" + key] = vs_ref(mine, theirs)
        rows[name] = row
    return rows


def eval_curves(rows, key):
    """{name: {"iters", "median", "min", "max"}} of eval set `key`'s avg@k over seeds, at the
    iterations every seed of the method has a point."""
    out = {}
    for name, row in rows.items():
        pts = [dict((it, v.get(key)) for it, v in p) for p in row.get("points", {}).values() if p]
        if not pts:
            continue
        iters = sorted(set.intersection(*({it for it, v in p.items() if v is not None} for p in pts)))
        if iters:
            out[name] = dict(iters=iters, n=len(pts), **{stat: [f([p[it] for p in pts]) for it in iters]
                             for stat, f in (("median", statistics.median), ("min", min), ("max", max))})
    return out


# ----------------------------------------------------------------------------------------------
# curves over seeds: reward and entropy, and where each region clips by mu

def curves(hists):
    """{name: {metric: {"mean", "median", "min", "max"} over seeds, per iteration}} of reward and entropy,
    over the iterations every seed reached."""
    out = {}
    for name, hs in hists.items():
        n = min(len(h) for h in hs)
        out[name] = {key: {stat: [f([h[i][key] for h in hs]) for i in range(n)]
                           for stat, f in (("mean", statistics.mean), ("median", statistics.median),
                                           ("min", min), ("max", max))}
                     for key in ("reward_mean", "entropy")}
    return out


def clip_by_mu(hists):
    """{name: {"token", "clip", "clip_min", "clip_max", "n"}}, each a list over the mu buckets
    (gppo.MU_EDGES): a run's token share is its mean over iterations; its clipped share of a
    bucket pools the iterations (weighted by the bucket's token share in each, so an iteration with
    no token in the bucket does not count as 0% clipped); then mean, min and max over seeds."""
    out = {}
    for name, hs in hists.items():
        runs = [h for h in hs if h and all("clip_frac_by_mu" in row for row in h)]   # older runs lack them
        if not runs:
            continue
        nb = gppo.MU_BUCKETS
        tok = [[statistics.mean(row["token_frac_by_mu"][b] for row in h) for b in range(nb)] for h in runs]
        clip = [[sum(row["clip_frac_by_mu"][b] * row["token_frac_by_mu"][b] for row in h) /
                 sum(row["token_frac_by_mu"][b] for row in h) if any(row["token_frac_by_mu"][b] for row in h)
                 else None for b in range(nb)] for h in runs]
        per_bucket = [[c[b] for c in clip if c[b] is not None] for b in range(nb)]
        out[name] = dict(n=len(runs), token=[statistics.mean(t[b] for t in tok) for b in range(nb)],
                         clip=[statistics.mean(v) if v else None for v in per_bucket],
                         clip_min=[min(v) if v else None for v in per_bucket],
                         clip_max=[max(v) if v else None for v in per_bucket])
    return out


def mu_buckets():
    """Labels of the mu buckets: mu<0.01, 0.01-0.1, 0.1-0.5, mu≥0.5 for the default edges."""
    e = gppo.MU_EDGES
    return [f"μ<{e[0]:g}"] + [f"{a:g}-{b:g}" for a, b in zip(e, e[1:])] + [f"μ≥{e[-1]:g}"]

