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
as in run.sh. The statistics are bench/stats.py's, the tables and figures bench/sweep_report.py's.

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
3. 95% intervals are Student t intervals of the paired differences; "distinguishable" means the
   interval excludes 0 (bench/stats.py says why not a bootstrap: at 3-5 seeds it covers far less
   than 95%).
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
   run, the iterations to a train reward of 0.5 and the area under the held-out avg@k curve, each
   paired against tv-mc (bench/stats.py: iters_to_reward, auc); answer_prob.png draws the
   curves (bench/sweep_report.py: on the rare task avg@k estimates the answer token's
   probability). --eval_every is one of the settings: runs scored at other iterations are not
   mixed.
9. Kept beyond out/ (ignored, so a fresh checkout or another machine has none): with --publish each
   run's small files (RUN_FILES) are archived under --publish_dir/runs/<method>-seed<s>/ as soon as
   it finishes, beside the sweep's SWEEP_FILES, and a later --publish restores into --out every
   archived run it lacks before planning (choice 5 then checks their settings). A study of hours
   goes on over sessions and machines, and the committed folder holds each run's metrics.
"""
import argparse, json, os, shutil, statistics, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import gppo  # noqa: E402
import train  # noqa: E402  (import does no work: parse_args is all the sweep uses)
from bench import stats  # noqa: E402  (stats.EVAL_SETS: main sets it per --task)
from bench.stats import (TASKS, finished, load_result, methods, read_metrics, run_dir,  # noqa: E402
                         shown, write_json_atomic)
from bench.sweep_report import report  # noqa: E402

OWNED = ("--method", "--objective", "--divergence", "--estimator", "--delta", "--seed", "--out_dir", "--eval_data")
# train.py flags that are not a run's settings: set per run by the sweep, or not changing what it computes
NOT_SETTINGS = {"method", "objective", "divergence", "estimator", "delta", "cell", "seed", "out_dir",
                "threads", "sample_every", "wandb", "ckpt_every", "keep_last", "eval_before"}


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
        a = vars(train.parse_args(["--model", model, "--data_dir", data_dir, "--eval_data", ",".join(stats.EVAL_SETS),
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
# runs: keep, plan, run one

RUN_FILES = ("metrics.jsonl", "eval.json", "result.json")   # result.json last: it marks a run finished
SWEEP_FILES = ("eval_start.json", "invocations.jsonl")


def copy_run(src, dst):
    """One run's RUN_FILES from folder src to folder dst, result.json last and atomically, so a copy
    cut short is a run without result.json (redone), never a finished run missing its metrics."""
    os.makedirs(dst, exist_ok=True)
    for f in RUN_FILES:
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f + ".tmp"))
            os.replace(os.path.join(dst, f + ".tmp"), os.path.join(dst, f))


def archive(out, publish_dir, runs):
    """Choice 9: the finished `runs` [(name, seed)] of `out` and its SWEEP_FILES into publish_dir/runs/."""
    keep = os.path.join(publish_dir, "runs")
    for name, seed in runs:
        copy_run(run_dir(out, name, seed), run_dir(keep, name, seed))
    for f in SWEEP_FILES:
        if os.path.exists(os.path.join(out, f)):
            shutil.copy(os.path.join(out, f), os.path.join(keep, f))


def restore(out, publish_dir):
    """Choice 9: every run archived in publish_dir/runs/ that `out` has not finished, and the
    SWEEP_FILES `out` lacks, copied into `out`; returns the runs restored."""
    keep = os.path.join(publish_dir, "runs")
    if not os.path.isdir(keep):
        return []
    got = []
    for res in finished(keep, [n for n, _ in methods()]):
        if load_result(out, res["name"], res["seed"]) is None:
            shutil.rmtree(run_dir(out, res["name"], res["seed"]), ignore_errors=True)   # a half-finished one
            copy_run(run_dir(keep, res["name"], res["seed"]), run_dir(out, res["name"], res["seed"]))
            got.append((res["name"], res["seed"]))
    for f in SWEEP_FILES:
        if os.path.exists(os.path.join(keep, f)) and not os.path.exists(os.path.join(out, f)):
            shutil.copy(os.path.join(keep, f), os.path.join(out, f))
    return got

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


def train_cmd(name, flags, seed, out, settings, threads):
    cmd = [sys.executable, "train.py", *flags, "--seed", str(seed), "--out_dir", run_dir(out, name, seed),
           "--model", settings["model"], "--data_dir", settings["data_dir"], "--eval_data", ",".join(stats.EVAL_SETS)]
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


def main():
    p = argparse.ArgumentParser(description="Run the GPPO grid and baselines; unknown flags go to train.py",
                                allow_abbrev=False)   # so train.py's --seed is not read as --seeds
    p.add_argument("--seeds", default="0-2", help="seeds run for every selected method: '0-4', '0,1,2', '0-2,7'")
    p.add_argument("--only", default="", help="comma-separated methods (e.g. gspo,kl-atomic,grpo); default all")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each with --threads 1 unless given)")
    p.add_argument("--task", default="default", choices=list(TASKS),
                   help="default (data/tiny: tiny-math, tiny-code), rare (data/tiny_rare: tiny-rare-math) "
                        "or smollm2 (configs/smollm2_cpu.args); sets the defaults of the next four")
    p.add_argument("--model", default=None, help="model folder for every run (default: the task's)")
    p.add_argument("--data_dir", default=None, help="folder with the task's data sets (default: the task's)")
    p.add_argument("--out", default=None, help="sweep folder: one sub-folder per run, tables, figures "
                                               "(default out/sweep, out/sweep-rare for --task rare)")
    p.add_argument("--dry_run", action="store_true", help="list what would run, and run nothing")
    p.add_argument("--publish", action="store_true", help="copy tables, sweep.json and figures to --publish_dir")
    p.add_argument("--publish_dir", default=None,
                   help="committed folder for --publish (default bench/results/sweep, or sweep-rare)")
    args, extra = p.parse_known_args()
    task = TASKS[args.task]
    stats.EVAL_SETS, stats.REWARD_TARGET = task["eval_sets"], task["reward_target"]
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
    if args.publish and not args.dry_run:
        os.makedirs(args.out, exist_ok=True)
        back = restore(args.out, args.publish_dir)
        if back:
            print(f"restored {len(back)} finished run(s) from {args.publish_dir}/runs into {args.out}", flush=True)
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
        subprocess.run([sys.executable, *task["prepare"]], check=True)   # as run.sh does
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    print(f"sweep: {len(pending)} runs to do of {len(todo)}, {args.jobs} at a time, into {args.out}", flush=True)

    def job(i_ns):
        i, (n, s) = i_ns
        res = run_one(n, table[n], s, args.out, settings, threads)
        if res and args.publish:
            # kept at once, so a session cut short loses no finished run
            copy_run(run_dir(args.out, n, s), run_dir(os.path.join(args.publish_dir, "runs"), n, s))
        if res:
            ev = " | ".join(f"{key} {res['eval'].get(key, float('nan')):.1f}" for key in stats.EVAL_SETS)
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
        archive(args.out, args.publish_dir, [(r["name"], r["seed"]) for r in finished(args.out, list(table))])
        print(f"published to {args.publish_dir} (each run's {', '.join(RUN_FILES)} under runs/)")
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed (redone next time): {failed}")


if __name__ == "__main__":
    main()
