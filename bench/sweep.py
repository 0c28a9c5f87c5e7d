"""
The paper's comparison at toy scale, with statistics: every cell of the Divergence x Estimator grid
and every baseline, several paired seeds each, each method's avg@8 difference against tv-mc (GRPO)
with a 95% interval, and the paper's orderings checked one by one.

    bash run.sh sweep --dry_run                                   # list what would run, run nothing
    bash run.sh sweep --seeds 0-4 --only grpo,dapo,dppo,ripo,kl-atomic,drpo,dgpo   # 5 seeds of these
    bash run.sh sweep --seeds 0-2                                 # then 3 seeds of everything
    bash run.sh sweep --jobs 2 --publish                          # two at a time; copy to bench/results/sweep/
    bash run.sh sweep --only grpo,kl-atomic --seeds 0 --iters 2   # any train.py flag passes through
    bash run.sh sweep --task rare --seeds 0-4 --only grpo,dapo,kl-atomic   # on data/tiny_rare (out/sweep-rare)
    bash run.sh sweep --task rare --seeds 0-4 --only grpo,dapo,kl-atomic,dppo,ripo,dgpo --target_kl 0 \
        --eval_every 10 --jobs 2 --publish                        # the rare-answer comparison (issue 26)

Writes into --out (out/sweep/): <method>-seed<s>/ per run (train.py's folder, its train.log and
result.json), eval_start.json, table.md, sweep.json, dynamics.png, clip_by_mu.png, regions.png and
invocations.jsonl; with --task rare also answer_prob.png. Paths are relative to the repository root,
as in run.sh.

Choices:
1. One `train.py` subprocess per (method, seed), all at train.py's defaults plus the same
   pass-through flags: no per-cell tuning, delta calibrated per divergence (gppo.default_delta).
   Method names are gppo's: baselines run as `--method NAME`, cells as --divergence/--estimator,
   and --only accepts gppo.METHODS' names (grpo = tv-mc, ...). The flags the sweep sets itself
   (--method, --objective, --divergence, --estimator, --delta, --seed, --out_dir, --eval_data) are
   refused as pass-through, so no cell can get its own.
2. Paired seeds: train.py seeds data order, sampling and init by --seed alone, so seed s of every
   method starts from the same model and samples the same first iteration. Methods are compared on
   the seeds both finished: the per-seed difference cancels what the seed does to both.
3. 95% intervals are Student t intervals of the paired differences. Not a bootstrap: at 3-5 seeds
   a percentile bootstrap has a handful of distinct resamples (10 at n = 3), its interval never
   leaves the range of the data, and it ignores that the spread is itself estimated from n points,
   so it covers far less than 95%. The t interval is exact for normal differences and honest about
   n: at n = 3 its half-width is 2.5 standard deviations of the differences. "Distinguishable" means
   the interval excludes 0. The intervals are per comparison, not corrected for the many made.
4. Resumable: a finished run writes result.json atomically (tmp + os.replace) and is skipped next
   time; a run folder without one is wiped and redone (train.py appends to metrics.jsonl). The
   table uses every finished run in --out, whatever --seeds/--only this invocation had, so the
   sweep can be run in pieces with different seed sets per method (each row states its n).
5. A run's settings are train.py's *resolved* flags (its parse_args), so a changed default is seen
   as well as a changed flag. A finished run with other settings is an error, not a silent mix;
   flags only one side knows (train.py gained or lost one) are not compared.
6. --jobs K runs K at once, each with --threads 1 unless --threads is given: on 2 cores two
   single-threaded runs can beat one two-threaded run. Thread count is not part of the settings.
7. The warm-start row is eval.py on the start model once per --out (eval_start.json), with the
   runs' evaluation settings (k, response length, context, template, backend, dtype).
8. Learning speed (table.md's section with --task rare, or whenever runs have eval_avg@k rows): per
   run, the iterations to a train reward of REWARD_TARGET (0.5; the first metrics row with
   reward_mean >= 0.5, a run that never gets there counts as its last iteration + 1 and the table
   counts them) and the area under the held-out avg@k curve: iteration 0 from the warm start
   (eval_start.json), then train.py's eval_avg@k rows (--eval_every N), trapezoid divided by the
   span, i.e. the mean avg@k over training; each paired against tv-mc like the final avg@k. On the
   rare task the answer is the one token after `\\boxed{`, so avg@k estimates the mean probability of
   the answer token; answer_prob.png shows it per method beside the default task's curve (its
   eval_avg@k if the default sweep has such rows, else its train reward, as the panel title says).
   --eval_every is one of the settings: runs scored at other iterations are not mixed.
"""
import argparse, glob, json, math, os, platform, shutil, statistics, subprocess, sys, time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import gppo  # noqa: E402
import train  # noqa: E402  (import does no work: parse_args is all the sweep uses)

EVAL_SETS = ("tiny-math", "tiny-code")   # the --task's eval sets (main sets them)
# --task: each embedded task's model, data folder, held-out sets, train.py flags (before the
# pass-through ones, which may override them), sweep folder and publish folder
TASKS = {
    "default": dict(model="data/tiny/model", data_dir="data/tiny", eval_sets=("tiny-math", "tiny-code"),
                    flags=[], out="out/sweep", publish_dir="bench/results/sweep", prepare=[]),
    # data/tiny_rare (data/prepare.py --variant rare): the right answer letter starts rare (mu ~ 0.03)
    "rare": dict(model="data/tiny_rare/model", data_dir="data/tiny_rare", eval_sets=("tiny-rare-math",),
                 flags=["--train_data", "tiny-rare-math"], out="out/sweep-rare",
                 publish_dir="bench/results/sweep-rare", prepare=["--variant", "rare"]),
}
REFERENCE = "tv-mc"
REWARD_TARGET = 0.5        # the learning-speed table's train reward to reach (choice 8)
# table labels of the named cells, from gppo.METHODS: tv-mc -> "GRPO / PPO", kl-mc -> "DAPO", ...
LABELS = {"-".join(cell): " / ".join(n.upper() for n, c in gppo.METHODS.items() if c == cell)
          for cell in gppo.METHODS.values()}
OWNED = ("--method", "--objective", "--divergence", "--estimator", "--delta", "--seed", "--out_dir", "--eval_data")
# train.py flags that are not a run's settings: set per run by the sweep, or not changing what it computes
NOT_SETTINGS = {"method", "objective", "divergence", "estimator", "delta", "cell", "seed", "out_dir",
                "threads", "sample_every", "wandb", "ckpt_every", "keep_last", "eval_before"}
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


def cell_of(name):
    """A method name as the sweep names its runs: gppo.METHODS' names (grpo, dapo, ...) -> their cell."""
    name = name.strip().lower()
    return "-".join(gppo.METHODS[name]) if name in gppo.METHODS else name


def select(only):
    """Method names of --only, in table order; all when empty."""
    names = [n for n, _ in methods()]
    if not only:
        return names
    want = {cell_of(w) for w in only.split(",") if w.strip()}
    unknown = sorted(want - set(names))
    if unknown:
        raise SystemExit(f"unknown --only {unknown}; accepted: {', '.join(names + list(gppo.METHODS))}")
    return [n for n in names if n in want]


def parse_seeds(text):
    """'0-4' or '0,1,2' or '0-2,7' -> sorted distinct seeds."""
    seeds = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        seeds.update(range(int(lo), int(hi or lo) + 1))
    if not seeds:
        raise SystemExit(f"--seeds {text!r}: no seeds")
    return sorted(seeds)


def split_passthrough(extra):
    """train.py flags from the command line -> (flags without --threads, threads or None)."""
    # --flag=value -> --flag value, so both spellings are the same settings
    extra = [x for a in extra for x in (a.split("=", 1) if a.startswith("--") and "=" in a else [a])]
    flags, threads, i = [], None, 0
    while i < len(extra):
        key = extra[i]
        if key in OWNED:
            raise SystemExit(f"{key} is set by the sweep for every run (use --seeds / --only / its own flags)")
        if key == "--threads":
            threads, i = int(extra[i + 1]), i + 1
        else:
            flags.append(extra[i])
        i += 1
    return flags, threads


def make_settings(model, data_dir, flags):
    """What every run of this invocation computes with: the pass-through flags and train.py's
    resolved flags (defaults included; choice 5), as JSON values."""
    try:
        a = vars(train.parse_args(["--model", model, "--data_dir", data_dir, "--eval_data", ",".join(EVAL_SETS),
                                   *flags]))
    except ValueError as e:
        raise SystemExit(f"train.py refuses these flags: {e}")
    return dict(model=model, data_dir=data_dir, train_flags=flags,
                train_args=json.loads(json.dumps({k: v for k, v in a.items() if k not in NOT_SETTINGS})))


def changed(old, new):
    """How a finished run's settings (old) differ from this invocation's (new): train.py's resolved
    flags compared on the keys both know."""
    if "train_args" not in old:
        return ["made before the sweep recorded train.py's resolved flags"]
    a, b = old["train_args"], new["train_args"]
    return [f"--{k} {a[k]!r} (now {b[k]!r})" for k in sorted(a.keys() & b.keys()) if a[k] != b[k]]


# ----------------------------------------------------------------------------------------------
# runs: plan, run one, result files

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


def plan(out, names, seeds, settings, all_names=None):
    """[(name, seed, status)], status 'run', 'redo' (folder without result.json) or 'done'.
    Raises if any finished run in `out` of `all_names` (any seed) was made with other settings."""
    for res in finished(out, all_names or names):
        diff = changed(res["settings"], settings)
        if diff:
            raise SystemExit(f"{run_dir(out, res['name'], res['seed'])} finished with other settings: "
                             f"{'; '.join(diff)}\nuse another --out or delete it")
    rows = []
    for name in names:
        for s in seeds:
            if load_result(out, name, s) is not None:
                rows.append((name, s, "done"))
            else:
                rows.append((name, s, "redo" if os.path.isdir(run_dir(out, name, s)) else "run"))
    return rows


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_cmd(name, flags, seed, out, settings, threads):
    cmd = [sys.executable, "train.py", *flags, "--seed", str(seed), "--out_dir", run_dir(out, name, seed),
           "--model", settings["model"], "--data_dir", settings["data_dir"], "--eval_data", ",".join(EVAL_SETS)]
    return cmd + (["--threads", str(threads)] if threads else []) + settings["train_flags"]


def run_one(name, flags, seed, out, settings, threads):
    """Train and evaluate one (method, seed); returns its result dict, or None if it failed."""
    d = run_dir(out, name, seed)
    shutil.rmtree(d, ignore_errors=True)          # a half-finished run is redone from scratch
    os.makedirs(d)
    cmd = train_cmd(name, flags, seed, out, settings, threads)
    t0 = time.time()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with open(os.path.join(d, "train.log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env).returncode
    wall = time.time() - t0
    k = settings["train_args"]["eval_k"]
    try:                                          # train.py's final evaluation, {"avg@k": {set: %}, ...}
        with open(os.path.join(d, "eval.json")) as f:
            ev = json.load(f)[f"avg@{k}"]
        hist = read_metrics(os.path.join(d, "metrics.jsonl"))
    except (OSError, KeyError, json.JSONDecodeError):
        ev = hist = None
    if rc != 0 or not ev or not hist:
        text = Path(d, "train.log").read_text(errors="replace")
        print(f"FAILED {name} seed {seed} (exit {rc}); last lines of {d}/train.log:\n" +
              "\n".join(text.splitlines()[-15:]), flush=True)
        return None
    res = dict(name=name, seed=seed, settings=settings, threads=threads, cmd=cmd[1:], eval=ev,
               final=hist[-1], iters=len(hist), wall_s=wall,
               iter_s_mean=statistics.mean(h["time_iter_s"] for h in hist),
               other_s=wall - sum(h["time_iter_s"] for h in hist))   # start-up, save, eval
    write_json_atomic(os.path.join(d, "result.json"), res)
    return res


# ----------------------------------------------------------------------------------------------
# statistics (choices 2-3)

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
# learning speed (choice 8): iterations to a train reward, area under the held-out avg@k curve

def iters_to_reward(hist, target=REWARD_TARGET):
    """(iteration, reached): the first iteration whose metrics row has reward_mean >= target; a run
    that never gets there counts as its last iteration + 1, reached False."""
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
    short = " / ".join(_short(key) for key in EVAL_SETS)
    lines = ["| method | n | " + "".join(f"{key} avg@{k} | Δ {_short(key)} vs GRPO [95% CI] | " for key in EVAL_SETS)
             + f"gain over warm start, {short} | entropy, last iter | train reward, last iter |",
             "|" + "---|" * (5 + 2 * len(EVAL_SETS))]
    if warm is not None:
        lines.append("| warm start (before RL) | - | " + "".join(f"{warm.get(key, 0):.1f} | - | " for key in EVAL_SETS)
                     + "- | - | - |")
    for name in sorted(rows, key=lambda n: n != REFERENCE):      # stable: the reference, then table order
        row = rows[name]
        if row["n"] == 0:
            lines.append(f"| {_label(name)} | 0 | not run |" + " |" * (2 + 2 * len(EVAL_SETS)))
            continue
        gain = " / ".join("-" if row["gain_" + key] is None else f"{row['gain_' + key]:+.1f}" for key in EVAL_SETS)
        deltas = ["reference" if name == REFERENCE else _ci(row["vs_ref_" + key], row["n"]) for key in EVAL_SETS]
        label = f"**{_label(name)}**" if name == REFERENCE else _label(name)
        lines.append(f"| {label} | {row['n']} | " + "".join(f"{_ms(row[key])} | {d} | " for key, d in zip(EVAL_SETS, deltas))
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
            d = [row["vs_ref_" + key]["per_seed"].get(s) for key in EVAL_SETS]
            cells.append("-" if None in d else " / ".join(f"{x:+.1f}" for x in d))
        lines.append(f"| {_label(name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def format_orderings(orders):
    """The paper's orderings: one row per comparison, then a count of verdicts per claim."""
    lines = ["| claim | a − b | paper Δ math / code | n | " +
             "".join(f"Δ {_short(key)} [95% CI] | {_short(key)} | " for key in EVAL_SETS).rstrip(),
             "|" + "---|" * (4 + 2 * len(EVAL_SETS))]
    for o in orders:
        paper = "-" if o["paper"] is None else " / ".join(f"{x:+.1f}" for x in o["paper"])
        n = sorted({o[key]["n"] for key in EVAL_SETS})
        lines.append(f"| {o['claim']} | {o['a']} − {o['b']} | {paper} | {'/'.join(map(str, n))} | "
                     + " | ".join(f"{_ci(o[key])} | {o[key]['verdict']}" for key in EVAL_SETS) + " |")
    lines.append("")
    for claim in dict.fromkeys(o["claim"] for o in orders):
        counts = [(key, Counter(o[key]["verdict"] for o in orders if o["claim"] == claim)) for key in EVAL_SETS]
        lines.append(f"- {claim}: " + "; ".join(f"{key}: " + ", ".join(f"{v} {c}" for v, c in cnt.items())
                                                for key, cnt in counts))
    return "\n".join(lines) + "\n"


def main_key():
    """The eval set of the one-column tables and the figure: the task's only set, or "all"."""
    return EVAL_SETS[0] if len(EVAL_SETS) == 1 else "all"


def format_speed(sp, rows, k, key):
    """The learning-speed table: per method the iterations to a train reward of REWARD_TARGET, the area
    under the held-out avg@k curve (its mean over training) and the final avg@k, each with its paired
    difference against the reference and 95% interval."""
    lines = [f"| method | n | iterations to train reward {REWARD_TARGET:g} | not reached | Δ iterations vs GRPO "
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
# figures: dynamics with a min-max band over seeds, and where each region clips by mu

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


def plot_clip_by_mu(stats, path):
    """One panel per divergence, one line per estimator: the share of each mu bucket's tokens that
    were clipped (mean over seeds, bars min-max), and as light bars on the right axis the bucket's
    share of all response tokens."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nan = float("nan")
    pct = lambda xs: [nan if x is None else 100 * x for x in xs]
    labels, x = mu_buckets(), range(gppo.MU_BUCKETS)
    divs = [d for d in gppo.DIVERGENCES if any(f"{d}-{e}" in stats for e in gppo.ESTIMATORS)] or ["tv"]
    fig, axes = plt.subplots(1, len(divs), figsize=(3.7 * len(divs), 3.9), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, d in zip(axes, divs):
        tw = ax.twinx()
        ax.set_zorder(tw.get_zorder() + 1)     # lines in front of the token-share bars
        ax.patch.set_visible(False)
        for c, e in enumerate(gppo.ESTIMATORS):
            st = stats.get(f"{d}-{e}")
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


def warm_start(settings, out):
    """avg@k of the start model: <out>/eval_start.json, made once by eval.py with the runs'
    evaluation settings (choice 7). Returns (scores or None, the eval.py command)."""
    a, path = settings["train_args"], os.path.join(out, "eval_start.json")
    cmd = [sys.executable, "eval.py", "--model", settings["model"], "--data", ",".join(EVAL_SETS),
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


# ----------------------------------------------------------------------------------------------
def draw_regions(out):
    """regions.txt (`python gppo.py`: the regions as a table at a few mu) and regions.png
    (bench/plot_regions.py: every cell's region against mu), once per sweep folder."""
    regions = os.path.join(out, "regions.png")
    if not os.path.exists(regions):
        with open(os.path.join(out, "regions.txt"), "w") as f:
            subprocess.run([sys.executable, "gppo.py"], cwd=ROOT, stdout=f, check=True)
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
    if task != "default":
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
        speed_md = (f"\n## Learning speed: {key}\n\nIterations to a train reward of {REWARD_TARGET:g}: the first "
                    f"iteration whose metrics row has reward_mean ≥ {REWARD_TARGET:g} (the batch's mean reward, "
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
            f"avg@{k} (%) on the held-out {' and '.join(EVAL_SETS)} problems, mean ± sample std over each "
            f"method's finished seeds (n). Δ: the paired difference against tv-mc (GRPO) over the seeds both "
            f"finished (seed s of every method starts from the same model and samples the same first "
            f"iteration), its mean and 95% Student t interval; ✱ marks a difference distinguishable from 0 "
            f"(the interval excludes 0). The intervals are per comparison and not corrected for the "
            f"{n_comparisons} comparisons below: about 1 in 20 of those with no true difference shows a ✱ "
            f"by chance. Entropy (nats/token) and train reward: the last RL iteration. "
            f"Every run: `python train.py <method> --seed S --model {settings['model']} --data_dir "
            f"{settings['data_dir']} --eval_data {','.join(EVAL_SETS)}{flags}`, train.py's defaults "
            f"otherwise (delta calibrated per divergence, gppo.default_delta). Warm start: "
            f"`{' '.join(warm_cmd)}`{'' if warm else ' (not available)'}.\n\n"
            + format_table(rows, k, warm) +
            "\n## The paper's orderings\n\nEach claim \"a above b\" as the paired a − b over the seeds "
            "both finished, next to the paper's Table 1 difference. Rule: **reproduced** when the 95% "
            "interval lies above 0, **not reproduced (reversed)** when it lies below 0, **undecided** at "
            "this budget when it contains 0 (or fewer than 2 paired seeds); identical regions give a tie.\n\n"
            + format_orderings(orders) +
            f"\n## Per seed: Δ vs GRPO, {' / '.join(map(_short, EVAL_SETS))}\n\n" + format_per_seed(rows) +
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
        mu_buckets=mu_buckets(), curves=curv, reward_target=REWARD_TARGET, eval_curve_key=key, eval_curves=ev,
        speed={n: r for n, r in sp.items() if r["n"]},
        runs=[{key: r[key] for key in ("name", "seed", "eval", "final", "iters", "wall_s",
                                       "iter_s_mean", "other_s", "threads")} for r in results]))
    return text


def main():
    p = argparse.ArgumentParser(description="Run the GPPO grid and baselines; unknown flags go to train.py",
                                allow_abbrev=False)   # so train.py's --seed is not read as --seeds
    p.add_argument("--seeds", default="0-2", help="seeds run for every selected method: '0-4', '0,1,2', '0-2,7'")
    p.add_argument("--only", default="", help="comma-separated methods (e.g. gspo,kl-atomic,grpo); default all")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each with --threads 1 unless given)")
    p.add_argument("--task", default="default", choices=list(TASKS),
                   help="embedded task: default (data/tiny: tiny-math, tiny-code) or rare (data/tiny_rare: "
                        "tiny-rare-math); sets the defaults of the next four")
    p.add_argument("--model", default=None, help="model folder for every run (default: the task's)")
    p.add_argument("--data_dir", default=None, help="folder with the task's data sets (default: the task's)")
    p.add_argument("--out", default=None, help="sweep folder: one sub-folder per run, tables, figures "
                                               "(default out/sweep, out/sweep-rare for --task rare)")
    p.add_argument("--dry_run", action="store_true", help="list what would run, and run nothing")
    p.add_argument("--publish", action="store_true", help="copy tables, sweep.json and figures to --publish_dir")
    p.add_argument("--publish_dir", default=None,
                   help="committed folder for --publish (default bench/results/sweep, or sweep-rare)")
    args, extra = p.parse_known_args()
    global EVAL_SETS
    task = TASKS[args.task]
    EVAL_SETS = task["eval_sets"]
    for key in ("model", "data_dir", "out", "publish_dir"):
        setattr(args, key, getattr(args, key) or task[key])
    command = " ".join(["bench/sweep.py", *map(shown, sys.argv[1:])])
    os.chdir(ROOT)
    flags, threads = split_passthrough(task["flags"] + extra)
    if threads is None and args.jobs > 1:
        threads = 1
    seeds = parse_seeds(args.seeds)
    settings = make_settings(args.model, args.data_dir, flags)
    table = dict(methods())
    todo = plan(args.out, select(args.only), seeds, settings, list(table))

    pending = [(n, s) for n, s, status in todo if status != "done"]
    if args.dry_run:
        for n, s, status in todo:
            print(f"{status:>5}  {run_dir(args.out, n, s)}")
        print(f"{len(pending)} of {len(todo)} runs to do, {args.jobs} at a time; e.g.")
        if pending:
            n, s = pending[0]
            print("  " + " ".join(train_cmd(n, table[n], s, args.out, settings, threads)[1:]))
        return
    if args.model == task["model"] and not os.path.exists(os.path.join(task["model"], "config.json")):
        subprocess.run([sys.executable, "data/prepare.py", *task["prepare"]], check=True)   # as run.sh does
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    print(f"sweep: {len(pending)} runs to do of {len(todo)}, {args.jobs} at a time, into {args.out}", flush=True)

    def job(i_ns):
        i, (n, s) = i_ns
        res = run_one(n, table[n], s, args.out, settings, threads)
        if res:
            ev = " | ".join(f"{key} {res['eval'].get(key, float('nan')):.1f}" for key in EVAL_SETS)
            print(f"[{i + 1}/{len(pending)}] {n} seed {s}: {res['wall_s']:.0f}s | {ev} | "
                  f"reward {res['final']['reward_mean']:.3f} | ent {res['final']['entropy']:.3f}", flush=True)
        return res

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        failed = [ns for ns, res in zip(pending, pool.map(job, enumerate(pending))) if res is None]
    # every invocation that ran something is logged, so the table can say how long the whole sweep
    # took, piece by piece (a --publish with nothing left to run adds no line)
    invocations = os.path.join(args.out, "invocations.jsonl")
    if pending:
        with open(invocations, "a") as f:
            f.write(json.dumps(dict(command=command, ran=len(pending) - len(failed), failed=len(failed),
                                    jobs=args.jobs, wall_s=time.time() - t0,
                                    at=time.strftime("%Y-%m-%d %H:%M", time.localtime(t0)))) + "\n")
    text = report(args.out, settings, threads, args.jobs, read_metrics(invocations) if os.path.exists(invocations) else [],
                  args.task)
    print(text, flush=True)
    if args.publish:
        os.makedirs(args.publish_dir, exist_ok=True)
        for f in ("table.md", "sweep.json", "dynamics.png", "clip_by_mu.png", "answer_prob.png", "regions.png",
                  "regions.txt"):
            if os.path.exists(os.path.join(args.out, f)):
                shutil.copy(os.path.join(args.out, f), os.path.join(args.publish_dir, f))
        print(f"published to {args.publish_dir}")
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed (redone next time): {failed}")


if __name__ == "__main__":
    main()
