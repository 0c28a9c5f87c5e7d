"""
avg@k of a model folder on held-out problems: k samples per problem, scored by reward.py.

    python eval.py --model data/tiny/model                       # the warm-start model
    python eval.py --model out/kl-atomic-seed0/final --k 8       # any trained policy
    python eval.py --data jsonl:data/mytask/reverse              # data/mytask/reverse_test.jsonl
    python eval.py --model Qwen/Qwen3-8B-Base --data aime24,aime25 --template dapo \
        --max_new_tokens 20480 --max_model_len 21504             # the paper's math evaluation
    python eval.py --compare out/kl-atomic-seed0 out/grpo-seed0   # runs: table + out/compare.png

Choices:
1. avg@k is the mean reward over k samples per problem (temperature 1, as the paper's avg@8),
   averaged over problems: the expected accuracy of one sample, with less noise than k = 1.
2. Samples come from vLLM (rollout.py), the same engine the trainer samples with. Under
   `accelerate launch` (train.py's final evaluation) each process scores its share of the
   problems and the scores are gathered, so no rank waits alone in a collective.
3. Problems are checked when they are loaded: a row of an unknown task, a ground truth its task
   cannot use (reward.TASKS' check: code tests that cannot run, a word as a math answer) or a
   prompt that leaves no room for the response (prompt + max_new_tokens > max_model_len) is
   refused there, naming the row, not in the middle of a run.
4. One table row per data set, then one JSON line (`{"avg@k": {...}}`) for scripts;
   `--compare BEFORE AFTER` prints two such results side by side (run.sh's closing table).
5. `--compare RUN_DIR RUN_DIR ...` compares train.py run folders, each named by its folder: one
   figure (--plot) of train reward, held-out avg@k and kl_k3 against iteration, one line per run,
   and a table of each run's last evaluation. avg@k's points are eval_start.json (iteration 0),
   the --eval_every rows of metrics.jsonl and eval.json (the last iteration): without
   --eval_every a run has its two ends only. Unfinished runs compare too (their last row).
"""
import argparse
import hashlib
import json
import math
import os
import time

import reward
from data.loaders import load_rows


def avg_at_k(engine, rows, k, max_new_tokens, seed=0, acc=None):
    """{source: avg@k in %} over `rows`, plus "all". With an Accelerator `acc`, each process
    samples and scores rows[rank::world] and every process gets the whole result (choice 2)."""
    rank, world = (acc.process_index, acc.num_processes) if acc else (0, 1)
    mine = rows[rank::world]
    batch = engine.generate([r["prompt_ids"] for r in mine], n=k, max_tokens=max_new_tokens,
                            seed=seed + rank)
    sample_rows = [mine[i // k] for i in range(len(batch.texts))]
    scores = reward.score_rows(batch.texts, sample_rows) if mine else []
    pairs = [(r["source"], s) for i, r in enumerate(mine) for s in scores[i * k:(i + 1) * k]]
    if acc:
        from accelerate.utils import gather_object
        pairs = gather_object(pairs)
    out = {}
    for source in dict.fromkeys(r["source"] for r in rows):
        s = [x for src, x in pairs if src == source]
        out[source] = 100.0 * sum(s) / len(s)
    out["all"] = 100.0 * sum(x for _, x in pairs) / len(pairs)
    return out


def evaluate(args, run, name):
    """train.py's evaluations (--eval_before, --eval_every, the end of the run): avg@k of the
    engine's current weights on the held-out rows (every rank scores its share), written to
    out_dir/name and logged as one readable line."""
    run.log(f"evaluating avg@{args.eval_k}: {len(run.eval_rows)} held-out problems "
            f"({args.eval_data}) x {args.eval_k} samples ...")
    res = avg_at_k(run.engine, run.eval_rows, args.eval_k, args.max_new_tokens, seed=args.seed,
                   acc=run.acc)
    start = name == "eval_start.json"
    if run.acc.is_main_process:
        model = args.model if start else os.path.join(args.out_dir, "final")
        with open(os.path.join(args.out_dir, name), "w") as f:
            json.dump({f"avg@{args.eval_k}": res, "model": model}, f)
    scores = " | ".join(f"{k} {v:.1f}" for k, v in res.items())
    run.log(f"{'start ' if start else ''}avg@{args.eval_k}: {scores} ({name})")
    return res


def table_name(name):
    """A data set's name for a table row. reasoning-gym names carry their options
    (`rg:<set>?<options>`, a hundred characters or more): the set and a short hash of the options
    (`rg:basic_arithmetic#3f2a`) tell sets apart and stay readable."""
    if "?" not in name:
        return name
    base, options = name.split("?", 1)
    return f"{base}#{hashlib.sha1(options.encode()).hexdigest()[:4]}"


def compare_table(before, after):
    """The end-of-run table: each data set's avg@k before and after training and the difference,
    then, under it, the full name of each set the table shortened.
    `before` / `after`: the JSON objects eval.py --out and train.py's eval.json hold."""
    (key, a), (_, b) = next(iter(before.items())), next(iter(after.items()))
    names = [n for n in [n for n in b if n != "all"] + ["all"] if n in a and n in b]
    w = max([16] + [len(table_name(n)) for n in names])     # the name column fits the longest name
    lines = [f"{'data set':<{w}}{'before':>9}{'after':>9}{'change':>9}   ({key}, %)"]
    for name in names:
        change = b[name] - a[name]
        lines.append(f"{table_name(name):<{w}}{a[name]:>9.1f}{b[name]:>9.1f}{change:>+9.1f}")
    lines += [f"  {table_name(n)} = {n}" for n in names if table_name(n) != n]
    return "\n".join(lines)


def run_names(folders):
    """Each run's name: its folder's name, or as many trailing path parts as tell it apart
    (out/a/seed0 and out/b/seed0 are a/seed0 and b/seed0)."""
    parts = [os.path.normpath(os.path.abspath(f)).split(os.sep) for f in folders]
    for n in range(1, max(map(len, parts)) + 1):
        names = ["/".join(p[-n:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    raise SystemExit(f"--compare: the same folder twice in {folders}")


def read_run(folder):
    """A train.py run folder as --compare reads it (choice 5): its metrics rows, its avg@k key
    ("avg@8") and evaluation points [(iteration, {data set: avg@k})]."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"--compare: {folder} is not a run folder (no metrics.jsonl); give run "
                         "folders (train.py --out_dir), or two result files (eval.py --out)")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    ends = {}   # eval_start.json, eval.json: {"avg@8": {data set: %}, "model": ...}
    for name in ("eval_start.json", "eval.json"):
        if os.path.isfile(os.path.join(folder, name)):
            with open(os.path.join(folder, name)) as f:
                ends[name] = next((k, v) for k, v in json.load(f).items() if k.startswith("avg@"))
    keys = [k for k, _ in ends.values()]
    keys += [k.removeprefix("eval_") for r in rows for k in r if k.startswith("eval_avg@")]
    key = keys[0] if keys else None
    points = {r["iter"]: r[f"eval_{key}"] for r in rows if f"eval_{key}" in r}
    if "eval_start.json" in ends:
        points[0] = ends["eval_start.json"][1]
    if "eval.json" in ends and rows:   # the final weights: the last iteration's
        points[rows[-1]["iter"]] = ends["eval.json"][1]
    return dict(rows=rows, key=key, points=sorted(points.items()))


def runs_table(runs, last=5):
    """One line per run: its iterations, each data set's last avg@k (the change from iteration 0
    in brackets), and its train reward and kl_k3 averaged over the last `last` iterations."""
    sets = [n for r in runs.values() for _, v in r["points"] for n in v if n != "all"]
    sets = list(dict.fromkeys(sets)) + ["all"]
    w = max([12] + [len(n) for n in runs])              # the name column fits the longest name
    cols = [max(15, len(table_name(n)) + 2) for n in sets]
    head = "".join(f"{table_name(n):>{c}}" for n, c in zip(sets, cols))
    lines = [f"{'run':<{w}}{'iters':>6}{'eval at':>8}{head}{'reward':>9}{'kl_k3':>9}"]
    for name, r in runs.items():
        rows, pts = r["rows"], r["points"]
        at, end = pts[-1] if pts else ("-", {})
        start = pts[0][1] if pts and pts[0][0] == 0 and at != 0 else {}
        cells = ""
        for n, c in zip(sets, cols):
            cell = "-" if n not in end else f"{end[n]:.1f}"
            if n in end and n in start:
                cell += f" ({end[n] - start[n]:+.1f})"
            cells += f"{cell:>{c}}"
        tail = rows[-last:] or [{"reward_mean": math.nan, "kl_k3": math.nan}]
        reward = sum(x["reward_mean"] for x in tail) / len(tail)
        kl = sum(x["kl_k3"] for x in tail) / len(tail)
        lines.append(f"{name:<{w}}{len(rows):>6}{at:>8}{cells}{reward:>9.3f}{kl:>9.1e}")
    keys = "/".join(sorted({r["key"] for r in runs.values() if r["key"]})) or "avg@k"
    lines.append(f"({keys} in %, held out: the run's last evaluation, at iteration 'eval at' "
                 "(eval.json once the run finished), in brackets the change from iteration 0 "
                 f"(eval_start.json); reward and kl_k3: train batch means over the last {last} "
                 "iterations of metrics.jsonl)")
    lines += [f"  {table_name(n)} = {n}" for n in sets if table_name(n) != n]
    return "\n".join(lines)


def plot_runs(runs, path):
    """Train reward, held-out avg@k (all data sets) and kl_k3 against iteration, one colour per
    run in all three panels (choice 5)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    handles = []
    for c, (name, r) in enumerate(runs.items()):
        its = [x["iter"] for x in r["rows"]]
        (h,) = axes[0].plot(its, [x["reward_mean"] for x in r["rows"]], color=f"C{c}", lw=1.3)
        handles.append(h)
        pts = [(it, v["all"]) for it, v in r["points"] if "all" in v]
        if pts:   # dotted when only the two ends were measured: nothing is known in between
            axes[1].plot(*zip(*pts), color=f"C{c}", lw=1.3, marker="o", ms=3,
                         ls=":" if len(pts) <= 2 else "-")
        axes[2].plot(its, [x["kl_k3"] for x in r["rows"]], color=f"C{c}", lw=1.3)
    keys = "/".join(sorted({r["key"] for r in runs.values() if r["key"]})) or "avg@k"
    titles = ["train reward (reward_mean, batch mean)",
              f"held-out {keys}, all data sets (%)\n"
              "(0: eval_start.json, last: eval.json, between: --eval_every)",
              "kl_k3: KL(mu || pi) per token\n(mean over the iteration's updates)"]
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if all(x["kl_k3"] > 0 for r in runs.values() for x in r["rows"]):
        axes[2].set_yscale("log")   # KL spans decades: on a linear axis one spike flattens the rest
    fig.legend(handles, list(runs), loc="lower center", ncol=min(4, len(runs)), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.04 * ((len(runs) - 1) // 4), 1, 1))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(paths, plot):
    """--compare: two result files -> the before/after table (run.sh's end); run folders -> the
    runs' table, and their curves into `plot` (choice 5)."""
    if len(paths) == 2 and all(os.path.isfile(p) for p in paths):
        before, after = (json.load(open(f)) for f in paths)
        print(compare_table({k: v for k, v in before.items() if k.startswith("avg@")},
                            {k: v for k, v in after.items() if k.startswith("avg@")}))
        return
    runs = dict(zip(run_names(paths), map(read_run, paths)))
    print(runs_table(runs))
    plot_runs(runs, plot)
    print(f"curves: {plot}")


def main():
    p = argparse.ArgumentParser(description="avg@k on held-out problems", allow_abbrev=False)
    p.add_argument("--model", default="data/tiny/model", help="model folder (or hub name)")
    p.add_argument("--data", default="tiny-math,tiny-code", help="comma-separated data set names")
    p.add_argument("--split", default="test", help="data split")
    p.add_argument("--data_dir", default=None, help="folder with local copies of hub data sets")
    p.add_argument("--template", default="plain", help="prompt template (data/loaders.py)")
    p.add_argument("--k", type=int, default=8, help="samples per problem")
    p.add_argument("--max_new_tokens", type=int, default=48, help="max response length, tokens")
    p.add_argument("--max_model_len", type=int, default=256,
                   help="vLLM context length (prompt + response)")
    p.add_argument("--dtype", default="auto",
                   help="vLLM dtype: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16")
    p.add_argument("--backend", default="vllm", choices=("vllm", "hf"),
                   help="vllm, or the transformers fallback")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed")
    p.add_argument("--out", default="", help="also write the JSON result to this file")
    p.add_argument("--compare", nargs="+", metavar="PATH",
                   help="only compare: run folders (train.py --out_dir; a table and --plot's "
                        "curves), or two result files BEFORE AFTER (run.sh's closing table)")
    p.add_argument("--plot", default="out/compare.png",
                   help="--compare with run folders: the figure's file")
    args = p.parse_args()
    if args.compare:
        compare(args.compare, args.plot)
        return
    if args.max_new_tokens >= args.max_model_len:
        p.error(f"--max_new_tokens={args.max_new_tokens}; accepted: fewer tokens than "
                f"--max_model_len={args.max_model_len} (prompt and response share it)")

    from transformers import AutoTokenizer
    from transformers.utils.logging import disable_progress_bar
    from rollout import make_engine
    disable_progress_bar()   # transformers' "Loading weights" bars (the HF backend loads a model)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(args.model)
    rows = load_rows(args.data, args.split, args.data_dir, args.template, tok,
                     max_prompt_tokens=args.max_model_len - args.max_new_tokens)
    longest = max(len(r["prompt_ids"]) for r in rows)
    engine = make_engine(args.model, backend=args.backend, max_model_len=args.max_model_len,
                         seed=args.seed, dtype=args.dtype, kv_cache_sequences=len(rows) * args.k,
                         kv_cache_tokens=longest + args.max_new_tokens)
    print(f"avg@{args.k}: {len(rows)} problems x {args.k} samples of {args.model} ...", flush=True)
    res = avg_at_k(engine, rows, args.k, args.max_new_tokens, seed=args.seed)
    print(f"{'data set':<16} avg@{args.k}  ({args.model}, {time.time() - t0:.0f}s)")
    for name, v in res.items():
        print(f"{name:<16} {v:6.1f}")
    line = json.dumps({f"avg@{args.k}": res, "model": args.model})
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
