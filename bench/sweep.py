"""
The paper's comparison at toy scale (issue #7): every cell of the Divergence x Estimator grid and
every baseline, several seeds each, tabulated like the paper's Table 1.

    bash run.sh sweep                                   # 20 methods x seeds 0,1,2, resumable
    bash run.sh sweep --dry_run                         # list what would run, run nothing
    bash run.sh sweep --only grpo,kl-atomic --seeds 0 --iters 2    # any train.py flag passes through
    bash run.sh sweep --jobs 2                          # two runs at once, --threads 1 each
    bash run.sh sweep --publish                         # also copy the outputs to bench/results/sweep/

Writes into --out (out/sweep/): <method>-seed<s>/ per run (train.py's folder, its train.log and
result.json), table.md, sweep.json, dynamics.png and regions.png. Paths are relative to the
repository root, as in run.sh.

Choices:
1. One `train.py` subprocess per (method, seed), all with the same flags: no per-cell tuning, and
   delta calibrated per divergence by gppo.default_delta (mc's lower bound at 0.8), as in the
   paper. The flags the sweep sets itself (--objective, --divergence, --estimator, --delta, --seed,
   --out_dir, --eval_data) are refused as pass-through, so no cell can get its own.
2. Resumable: a finished run writes result.json atomically (tmp + os.replace) and is skipped next
   time; a run folder without one is wiped and redone (train.py appends to metrics.jsonl). A
   finished run with other settings than this invocation's is an error, not a silent mix.
3. --jobs K runs K at once, each with --threads 1 unless --threads is given: on 2 cores two
   single-threaded runs can beat one two-threaded run (the tiny matmuls scale poorly). Thread
   count is not part of a run's settings.
4. The table gives mean +- sample std (n - 1) over seeds, and the difference of means against
   tv-mc (GRPO), the paper's baseline cell. Every seed uses the same data order and sampling seeds
   in every cell.
5. The warm-start row is <data_dir>/eval_start.json (run.sh writes it), else eval.py is run once
   into <out>/eval_start.json with the same k and response length as the runs' evaluation.
"""
import argparse, json, os, platform, shutil, statistics, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import gppo  # noqa: E402

EVAL_SETS = ("tiny-math", "tiny-code")
# methods named by the paper, as in run.sh's case
ALIASES = {"grpo": "tv-mc", "ppo": "tv-mc", "dapo": "kl-mc", "dppo": "tv-binary", "ripo": "chi2-atomic"}
LABELS = {"tv-mc": "GRPO / PPO", "kl-mc": "DAPO", "tv-binary": "DPPO", "chi2-atomic": "RIPO"}
REFERENCE = "tv-mc"
OWNED = ("--objective", "--divergence", "--estimator", "--delta", "--seed", "--out_dir", "--eval_data")


def methods():
    """(name, train.py flags) of every baseline, then every grid cell grouped by divergence."""
    out = [(b, ["--objective", b]) for b in gppo.BASELINES]
    out += [(f"{d}-{e}", ["--objective", "gppo", "--divergence", d, "--estimator", e])
            for d in gppo.DIVERGENCES for e in gppo.ESTIMATORS]
    return out


def select(only):
    """Method names of --only (aliases allowed), in table order; all when empty."""
    names = [n for n, _ in methods()]
    if not only:
        return names
    want = {ALIASES.get(w.strip().lower(), w.strip().lower()) for w in only.split(",") if w.strip()}
    unknown = sorted(want - set(names))
    if unknown:
        raise SystemExit(f"unknown --only {unknown}; accepted: {', '.join(names + list(ALIASES))}")
    return [n for n in names if n in want]


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


# ----------------------------------------------------------------------------------------------
# runs: plan, run one, result files

def write_json_atomic(path, obj):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def run_dir(out, name, seed):
    return os.path.join(out, f"{name}-seed{seed}")


def load_result(out, name, seed):
    path = os.path.join(run_dir(out, name, seed), "result.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def plan(out, names, seeds, settings, all_names=None):
    """[(name, seed, status)], status 'run', 'redo' (folder without result.json) or 'done'.
    Raises if any finished run of `all_names` x `seeds` was made with other settings."""
    for name in all_names or names:
        for s in seeds:
            res = load_result(out, name, s)
            if res is not None and res["settings"] != settings:
                raise SystemExit(f"{run_dir(out, name, s)} finished with other settings:\n  {res['settings']}\n"
                                 f"not\n  {settings}\nuse another --out or delete it")
    rows = []
    for name in names:
        for s in seeds:
            if load_result(out, name, s) is not None:
                rows.append((name, s, "done"))
            else:
                rows.append((name, s, "redo" if os.path.isdir(run_dir(out, name, s)) else "run"))
    return rows


def parse_eval(text):
    """The last `{"eval": {...}}` line train.py printed, or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith('{"eval"'):
            try:
                return json.loads(line)["eval"]
            except json.JSONDecodeError:
                continue
    return None


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
    text = Path(d, "train.log").read_text(errors="replace")
    ev = parse_eval(text)
    metrics_path = os.path.join(d, "metrics.jsonl")
    if rc != 0 or ev is None or not os.path.exists(metrics_path):
        print(f"FAILED {name} seed {seed} (exit {rc}); last lines of {d}/train.log:\n" +
              "\n".join(text.splitlines()[-15:]), flush=True)
        return None
    hist = read_metrics(metrics_path)
    res = dict(name=name, seed=seed, settings=settings, threads=threads, cmd=cmd[1:], eval=ev,
               final=hist[-1], iters=len(hist), wall_s=wall,
               iter_s_mean=statistics.mean(h["time_iter_s"] for h in hist),
               other_s=wall - sum(h["time_iter_s"] for h in hist))   # start-up, save, eval
    write_json_atomic(os.path.join(d, "result.json"), res)
    return res


# ----------------------------------------------------------------------------------------------
# aggregation and the table

def mean_std(xs):
    """(mean, sample std) of xs; std None for fewer than 2 values, both None for none."""
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def aggregate(results, names):
    """{name: row} over seeds: n, mean/std of each eval set, final entropy and reward, and the
    difference of means against tv-mc."""
    rows = {}
    for name in names:
        rs = [r for r in results if r["name"] == name]
        row = {"n": len(rs), "seeds": sorted(r["seed"] for r in rs)}
        for key in EVAL_SETS:
            row[key] = mean_std([r["eval"].get(key) for r in rs])
        row["entropy"] = mean_std([r["final"].get("entropy") for r in rs])
        row["reward"] = mean_std([r["final"].get("reward_mean") for r in rs])
        row["wall_s"] = mean_std([r["wall_s"] for r in rs])
        rows[name] = row
    ref = rows.get(REFERENCE) or aggregate(results, [REFERENCE])[REFERENCE]
    for row in rows.values():
        for key in EVAL_SETS:
            m, r = row[key][0], ref[key][0]
            row["delta_" + key] = None if m is None or r is None else m - r
    return rows


def _ms(ms, digits=1):
    m, s = ms
    if m is None:
        return "-"
    return f"{m:.{digits}f}" if s is None else f"{m:.{digits}f} ± {s:.{digits}f}"


def _delta(x):
    return "-" if x is None else f"{x:+.1f}"


def format_table(rows, k, n_seeds, warm=None):
    """Markdown table shaped like the paper's Table 1 (baselines, then the grid by divergence)."""
    head = (f"| method | seeds | tiny-math avg@{k} | Δ vs GRPO | tiny-code avg@{k} | Δ vs GRPO | "
            f"entropy, last iter | train reward, last iter |")
    lines = [head, "|" + "---|" * 8]
    if warm is not None:
        lines.append(f"| warm start (before RL) | - | {warm.get('tiny-math', 0):.1f} | - | "
                     f"{warm.get('tiny-code', 0):.1f} | - | - | - |")
    for name, row in rows.items():
        label = f"{name} ({LABELS[name]})" if name in LABELS else name
        if name == REFERENCE:
            label = f"**{label}**"
        if row["n"] == 0:
            lines.append(f"| {label} | 0/{n_seeds} | not run | | | | | |")
            continue
        lines.append(f"| {label} | {row['n']}/{n_seeds} | {_ms(row['tiny-math'])} | {_delta(row['delta_tiny-math'])} | "
                     f"{_ms(row['tiny-code'])} | {_delta(row['delta_tiny-code'])} | "
                     f"{_ms(row['entropy'], 3)} | {_ms(row['reward'], 3)} |")
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
# figures

def plot_dynamics(out, names, seeds, path):
    """Reward and entropy against iteration, mean over seeds: one column per divergence (its three
    estimators) and one for the baselines; tv-mc (GRPO) dashed grey in every other column."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {}
    for name in names:
        hists = [read_metrics(os.path.join(run_dir(out, name, s), "metrics.jsonl")) for s in seeds
                 if load_result(out, name, s) is not None]
        if hists:
            n = min(len(h) for h in hists)     # iterations every seed reached
            curves[name] = {key: [statistics.mean(h[i][key] for h in hists) for i in range(n)]
                            for key in ("reward_mean", "entropy")}
    groups = [("baselines", list(gppo.BASELINES))] + \
             [(d, [f"{d}-{e}" for e in gppo.ESTIMATORS]) for d in gppo.DIVERGENCES]
    fig, axes = plt.subplots(2, len(groups), figsize=(3.2 * len(groups), 5.6), sharex=True, sharey="row")
    for j, (title, members) in enumerate(groups):
        for i, key in enumerate(("reward_mean", "entropy")):
            ax = axes[i, j]
            if REFERENCE in curves and REFERENCE not in members:
                ax.plot(range(1, len(curves[REFERENCE][key]) + 1), curves[REFERENCE][key],
                        color="grey", ls="--", lw=1, label="tv-mc (GRPO)")
            for c, m in enumerate(members):     # one colour per estimator in every column
                if m in curves:
                    ax.plot(range(1, len(curves[m][key]) + 1), curves[m][key], lw=1.3, color=f"C{c}",
                            label=m.split("-", 1)[1] if title != "baselines" else m)
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(title)
                ax.legend(fontsize=7)
            else:
                ax.set_xlabel("iteration")
        axes[0, 0].set_ylabel("train reward (mean)")
        axes[1, 0].set_ylabel("entropy (nats/token)")
    fig.suptitle(f"reward and entropy, mean over seeds {','.join(map(str, seeds))}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return curves


def warm_start(settings, out, k):
    """avg@k of the warm-start model: <data_dir>/eval_start.json (run.sh's, at eval.py's defaults)
    unless the runs change how they evaluate, else eval.py once into <out> with the runs' flags."""
    ep = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--max_new_tokens", "--max_model_len", "--backend", "--template"):
        ep.add_argument(flag)
    same, _ = ep.parse_known_args(settings["train_flags"])
    path = os.path.join(out, "eval_start.json")
    default_eval = all(v is None for v in vars(same).values())
    for p in ([os.path.join(settings["data_dir"], "eval_start.json")] if default_eval else []) + [path]:
        if os.path.exists(p):
            with open(p) as f:
                got = json.load(f).get(f"avg@{k}")
            if got is not None:
                return got, p
    cmd = [sys.executable, "eval.py", "--model", settings["model"], "--data", ",".join(EVAL_SETS),
           "--data_dir", settings["data_dir"], "--k", str(k), "--out", path]
    cmd += [x for flag, v in vars(same).items() if v is not None for x in (f"--{flag}", v)]
    print("warm start:", " ".join(cmd[1:]), f"(log {path[:-5]}.log)", flush=True)
    with open(path[:-5] + ".log", "w") as log:
        if subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            print(f"warm-start evaluation failed; see {path[:-5]}.log", flush=True)
            return None, None
    with open(path) as f:
        return json.load(f)[f"avg@{k}"], path


# ----------------------------------------------------------------------------------------------
def main():
    p = argparse.ArgumentParser(description="Run the GPPO grid and baselines; unknown flags go to train.py",
                                allow_abbrev=False)   # so train.py's --seed is not read as --seeds
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, each run for every method")
    p.add_argument("--only", default="", help="comma-separated methods (e.g. gspo,kl-atomic,grpo); default all")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each with --threads 1 unless given)")
    p.add_argument("--model", default="data/tiny/model", help="model folder for every run")
    p.add_argument("--data_dir", default="data/tiny", help="folder with tiny-math / tiny-code (and eval_start.json)")
    p.add_argument("--out", default="out/sweep", help="sweep folder: one sub-folder per run, table, figures")
    p.add_argument("--dry_run", action="store_true", help="list what would run, and run nothing")
    p.add_argument("--publish", action="store_true", help="copy table, sweep.json and figures to --publish_dir")
    p.add_argument("--publish_dir", default="bench/results/sweep", help="committed folder for --publish")
    args, extra = p.parse_known_args()
    os.chdir(ROOT)
    flags, threads = split_passthrough(extra)
    if threads is None and args.jobs > 1:
        threads = 1
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    settings = dict(model=args.model, data_dir=args.data_dir, eval_data=",".join(EVAL_SETS), train_flags=flags)
    table = dict(methods())
    names, all_names = select(args.only), list(table)
    todo = plan(args.out, names, seeds, settings, all_names)
    k_parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    k_parser.add_argument("--eval_k", type=int, default=8)
    k = k_parser.parse_known_args(flags)[0].eval_k

    pending = [(n, s) for n, s, status in todo if status != "done"]
    if args.dry_run:
        for n, s, status in todo:
            print(f"{status:>5}  {run_dir(args.out, n, s)}")
        print(f"{len(pending)} of {len(todo)} runs to do, {args.jobs} at a time; e.g.")
        if pending:
            n, s = pending[0]
            print("  " + " ".join(train_cmd(n, table[n], s, args.out, settings, threads)[1:]))
        return
    if args.model == "data/tiny/model" and not os.path.exists("data/tiny/model/config.json"):
        subprocess.run([sys.executable, "data/prepare.py"], check=True)   # as run.sh does
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
    wall = time.time() - t0

    # -- outputs: every finished run of every method for these seeds --
    results = [r for n in all_names for s in seeds if (r := load_result(args.out, n, s)) is not None]
    rows = aggregate(results, all_names)
    warm, warm_path = warm_start(settings, args.out, k)
    curves = plot_dynamics(args.out, all_names, seeds, os.path.join(args.out, "dynamics.png"))
    regions = os.path.join(args.out, "regions.png")
    if not os.path.exists(regions):
        with open(os.path.join(args.out, "regions.txt"), "w") as f:
            subprocess.run([sys.executable, "gppo.py", "--out", regions], cwd=ROOT, stdout=f, check=True)
    mach = machine(threads, args.jobs)
    # the threads the finished runs really had (they may come from several invocations)
    used = sorted({r["threads"] or mach["default_threads"] for r in results}) or [mach["torch_threads"]]
    mach["torch_threads"] = ",".join(map(str, used))
    run_s = sum(r["wall_s"] for r in results)
    text = (f"# GPPO grid and baselines on the embedded default\n\n"
            f"avg@{k} on the held-out tiny-math and tiny-code problems, mean ± sample std over seeds "
            f"{','.join(map(str, seeds))}; Δ: difference of means against tv-mc (GRPO). Entropy (nats/token) "
            f"and train reward: the last RL iteration, mean over seeds. Every run: `python train.py "
            f"<cell> --seed S --model {args.model} --data_dir {args.data_dir} --eval_data "
            f"{','.join(EVAL_SETS)} {' '.join(flags)}`, train.py's defaults otherwise (delta calibrated "
            f"per divergence, gppo.default_delta). Warm start: {warm_path or 'not available'}.\n\n"
            + format_table(rows, k, len(seeds), warm) +
            f"\nMachine: {mach['cpu']}, {mach['cores']} cores, GPU {mach['gpu'] or 'none'}, torch threads "
            f"{mach['torch_threads']} per run (this invocation: --jobs {args.jobs}).\n"
            f"Wall time: {len(results)} finished runs took {run_s / 60:.1f} min summed "
            f"({run_s / max(len(results), 1):.0f} s per run); this invocation ran {len(pending) - len(failed)} "
            f"of them in {wall / 60:.1f} min.\n\nFigures: dynamics.png (reward and entropy against iteration), "
            f"regions.png (every cell's proximal region against mu).\n")
    Path(args.out, "table.md").write_text(text)
    summary = dict(settings=settings, seeds=seeds, k=k, machine=mach, wall_s_this_invocation=wall,
                   run_wall_s_sum=run_s, warm_start=warm, warm_start_file=warm_path, rows=rows, curves=curves,
                   runs=[{key: r[key] for key in ("name", "seed", "eval", "final", "iters", "wall_s",
                                                  "iter_s_mean", "other_s", "threads")} for r in results])
    write_json_atomic(os.path.join(args.out, "sweep.json"), summary)
    print(text, flush=True)
    if args.publish:
        os.makedirs(args.publish_dir, exist_ok=True)
        for f in ("table.md", "sweep.json", "dynamics.png", "regions.png", "regions.txt"):
            if os.path.exists(os.path.join(args.out, f)):
                shutil.copy(os.path.join(args.out, f), os.path.join(args.publish_dir, f))
        print(f"published to {args.publish_dir}")
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed (redone next time): {failed}")


if __name__ == "__main__":
    main()
