"""
avg@k and pass@k of a model folder on held-out problems: k samples per problem, scored by
reward.py.

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
4. One table row per data set (avg@k, then pass@k for each k), then one JSON line
   (`{"avg@k": {...}, "pass@k": {"1": {...}, ...}, "model": ...}`) for scripts; `--compare BEFORE
   AFTER` prints two such results side by side (run.sh's closing table), pass@k where they hold it.
5. `--compare RUN_DIR RUN_DIR ...` compares train.py run folders, each named by its folder: one
   figure (--plot) of train reward, held-out avg@k and kl_k3 against iteration, one line per run,
   and a table of each run's last evaluation. avg@k's points are eval_start.json (iteration 0),
   the --eval_every rows of metrics.jsonl and eval.json (the last iteration): without
   --eval_every a run has its two ends only. Unfinished runs compare too (their last row).
   Under it, pass@k of the last evaluation file that holds it (eval.json, eval_iter_N.json).
6. pass@k (Chen et al. 2021, unbiased): the chance that k of a problem's samples hold a correct
   one, for k = 1, 2, 4, ... up to the samples per problem (and that number itself), averaged over
   problems. From the same samples as avg@k: with binary rewards pass@1 is avg@k, and pass@k
   rises with k as far as the model can solve a problem at all. Its own key, not `avg@...`:
   readers that take the first `avg@` key (or the first key) still find avg@k.
"""
import argparse
import hashlib
import json
import math
import os
import time

import reward
from data.loaders import load_rows
from infra import flags


def pass_at_k(n, c, k):
    """pass@k of one problem with `n` samples of which `c` are correct: the chance that `k` of them,
    drawn without replacement, hold a correct one. The unbiased estimator of Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code" (arXiv 2107.03374, section 2.1),
    pass@k = 1 - C(n-c, k) / C(n, k), computed as the paper's code does, without binomials that
    overflow a float: 1 - prod_{i=n-c+1}^{n} (1 - k/i), and 1 when n - c < k (every draw of k
    holds a correct sample)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): accepted 0 <= c <= n, 1 <= k <= n")
    if n - c < k:
        return 1.0
    miss = 1.0   # C(n-c, k) / C(n, k): the chance that no draw of k holds a correct sample
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_ks(n):
    """The k of pass@k for `n` samples per problem: 1, 2, 4, ... up to n, and n itself."""
    ks = [2 ** j for j in range(n.bit_length()) if 2 ** j <= n]
    return ks + ([n] if ks[-1] != n else [])


def sample_scores(engine, rows, k, max_new_tokens, seed=0, acc=None):
    """[(source, [k rewards])], one per problem of `rows`. With an Accelerator `acc`, each process
    samples and scores rows[rank::world] and every process gets every problem (choice 2)."""
    rank, world = (acc.process_index, acc.num_processes) if acc else (0, 1)
    mine = rows[rank::world]
    batch = engine.generate([r["prompt_ids"] for r in mine], n=k, max_tokens=max_new_tokens,
                            seed=seed + rank)
    sample_rows = [mine[i // k] for i in range(len(batch.texts))]
    scores = reward.score_rows(batch.texts, sample_rows) if mine else []
    problems = [(r["source"], scores[i * k:(i + 1) * k]) for i, r in enumerate(mine)]
    if acc and world > 1:
        from accelerate.utils import gather_object
        problems = gather_object(problems)
    return problems


def avg_of(problems, sources):
    """{source: avg@k in %} of sample_scores' `problems` (the mean reward of a source's samples),
    plus "all", in the order of `sources`."""
    out = {}
    for source in sources:
        s = [x for src, xs in problems if src == source for x in xs]
        out[source] = 100.0 * sum(s) / len(s)
    every = [x for _, xs in problems for x in xs]
    out["all"] = 100.0 * sum(every) / len(every)
    return out


def pass_of(problems, sources):
    """{str(k): {source: pass@k in %, ..., "all": %}} for pass_ks(n) of sample_scores' `problems`:
    each problem's pass_at_k, averaged over a source's problems (choice 6)."""
    # rewards are binary (reward.py: 1.0 correct, else 0.0): a sample is correct when its reward
    # is >= 1, so a partial credit, should a task ever give one, would not count
    per = [(src, len(xs), sum(x >= 1 for x in xs)) for src, xs in problems]
    out = {}
    for k in pass_ks(min(n for _, n, _ in per)):
        got = [(src, pass_at_k(n, c, k)) for src, n, c in per]
        res = {}
        for source in sources:
            p = [x for src, x in got if src == source]
            res[source] = 100.0 * sum(p) / len(p)
        res["all"] = 100.0 * sum(x for _, x in got) / len(got)
        out[str(k)] = res
    return out


def avg_and_pass_at_k(engine, rows, k, max_new_tokens, seed=0, acc=None):
    """(avg@k, pass@k) of the same k samples per problem of `rows`: avg_at_k's {source: %} and
    pass_of's {str(k): {source: %}}, each with "all"."""
    problems = sample_scores(engine, rows, k, max_new_tokens, seed=seed, acc=acc)
    sources = list(dict.fromkeys(r["source"] for r in rows))
    return avg_of(problems, sources), pass_of(problems, sources)


def avg_at_k(engine, rows, k, max_new_tokens, seed=0, acc=None):
    """{source: avg@k in %} over `rows`, plus "all". With an Accelerator `acc`, each process
    samples and scores rows[rank::world] and every process gets the whole result (choice 2)."""
    return avg_and_pass_at_k(engine, rows, k, max_new_tokens, seed=seed, acc=acc)[0]


def evaluate(args, run, name):
    """train.py's evaluations (--eval_before, --eval_every, the end of the run): avg@k and pass@k
    of the engine's current weights on the held-out rows (every rank scores its share), written to
    out_dir/name ({"avg@k": ..., "pass@k": ..., "model": ...}) and logged as readable lines.
    Returns avg@k (train.py's eval_avg@k metrics column)."""
    run.log(f"evaluating avg@{args.eval_k}: {len(run.eval_rows)} held-out problems "
            f"({args.eval_data}) x {args.eval_k} samples ...")
    res, passes = avg_and_pass_at_k(run.engine, run.eval_rows, args.eval_k, args.max_new_tokens,
                                    seed=args.seed, acc=run.acc)
    start = name == "eval_start.json"
    if run.acc.is_main_process:
        model = args.model if start else os.path.join(args.out_dir, "final")
        with open(os.path.join(args.out_dir, name), "w") as f:
            json.dump({f"avg@{args.eval_k}": res, "pass@k": passes, "model": model}, f)
    scores = " | ".join(f"{k} {v:.1f}" for k, v in res.items())
    run.log(f"{'start ' if start else ''}avg@{args.eval_k}: {scores} ({name})")
    run.log("  pass@k (all): " + " | ".join(f"pass@{k} {v['all']:.1f}" for k, v in passes.items()))
    return res


def result_table(res, passes, key, note=""):
    """eval.py's table: one row per data set (and "all"), avg@k (`key`) then pass@k for each k,
    in %; `note` ends the header's line."""
    heads = "".join(f"{h:>9}" for h in [key] + [f"pass@{k}" for k in passes])
    lines = [f"{'data set':<16}{heads}{note}"]
    for name in res:
        values = [res[name]] + [p.get(name, math.nan) for p in passes.values()]
        lines.append(f"{name:<16}" + "".join(f"{v:>9.1f}" for v in values))
    return "\n".join(lines)


def table_name(name):
    """A data set's name for a table row. reasoning-gym names carry their options
    (`rg:<set>?<options>`, a hundred characters or more): the set and a short hash of the options
    (`rg:basic_arithmetic#3f2a`) tell sets apart and stay readable."""
    if "?" not in name:
        return name
    base, options = name.split("?", 1)
    return f"{base}#{hashlib.sha1(options.encode()).hexdigest()[:4]}"


def first_avg(res):
    """(key, {data set: %}) of a result's avg@k entry ("avg@8"): its first key starting "avg@"."""
    return next((k, v) for k, v in res.items() if k.startswith("avg@"))


def change_cell(end, start, name):
    """A table cell: `end`'s value of data set `name`, the change from `start` in brackets when
    `start` has it too; "-" when `end` has none."""
    if name not in end:
        return "-"
    cell = f"{end[name]:.1f}"
    return cell + (f" ({end[name] - start[name]:+.1f})" if name in start else "")


def compare_table(before, after):
    """The end-of-run table: each data set's avg@k before and after training and the difference,
    then, when `after` holds pass@k, one column per k: pass@k after training (the change from
    before in brackets, when `before` holds it too); under it, the full name of each set the
    table shortened. `before` / `after`: the JSON objects eval.py --out and train.py's eval.json
    hold ({"avg@8": {...}, "pass@k": {...}, ...}; files older than pass@k have no "pass@k")."""
    (key, a), (_, b) = first_avg(before), first_avg(after)
    pa, pb = before.get("pass@k") or {}, after.get("pass@k") or {}
    names = [n for n in [n for n in b if n != "all"] + ["all"] if n in a and n in b]
    w = max([16] + [len(table_name(n)) for n in names])     # the name column fits the longest name
    cols = [max(15, len(f"pass@{k}") + 2) for k in pb]      # "100.0 (+100.0)" fits
    head = "".join(f"{'pass@' + k:>{c}}" for k, c in zip(pb, cols))
    note = f"{key}, %" + ("; pass@k: after (change), %" if pb else "")
    lines = [f"{'data set':<{w}}{'before':>9}{'after':>9}{'change':>9}{head}   ({note})"]
    for name in names:
        change = b[name] - a[name]
        cells = "".join(f"{change_cell(pb[k], pa.get(k, {}), name):>{c}}" for k, c in zip(pb, cols))
        lines.append(f"{table_name(name):<{w}}{a[name]:>9.1f}{b[name]:>9.1f}{change:>+9.1f}{cells}")
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
    ("avg@8") and evaluation points [(iteration, {data set: avg@k})], and pass@k's points
    [(iteration, {k: {data set: pass@k}})] from the evaluation files that hold it."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"--compare: {folder} is not a run folder (no metrics.jsonl); give run "
                         "folders (train.py --out_dir), or two result files (eval.py --out)")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    res = {}   # eval_start.json, eval.json, eval_iter_N.json: {"avg@8": {data set: %}, ...}
    for name in sorted(os.listdir(folder)):
        if name in ("eval_start.json", "eval.json") or (
                name.startswith("eval_iter_") and name[10:-5].isdigit() and name.endswith(".json")):
            with open(os.path.join(folder, name)) as f:
                res[name] = json.load(f)
    ends = {n: first_avg(res[n]) for n in ("eval_start.json", "eval.json") if n in res}
    passes = {int(n[10:-5]): v["pass@k"] for n, v in res.items()   # eval_iter_000010.json: 10
              if n.startswith("eval_iter_") and v.get("pass@k")}
    if res.get("eval_start.json", {}).get("pass@k"):
        passes[0] = res["eval_start.json"]["pass@k"]
    if res.get("eval.json", {}).get("pass@k") and rows:   # the final weights: the last iteration's
        passes[rows[-1]["iter"]] = res["eval.json"]["pass@k"]
    keys = [k for k, _ in ends.values()]
    keys += [k.removeprefix("eval_") for r in rows for k in r if k.startswith("eval_avg@")]
    key = keys[0] if keys else None
    points = {r["iter"]: r[f"eval_{key}"] for r in rows if f"eval_{key}" in r}
    if "eval_start.json" in ends:
        points[0] = ends["eval_start.json"][1]
    if "eval.json" in ends and rows:   # the final weights: the last iteration's
        points[rows[-1]["iter"]] = ends["eval.json"][1]
    return dict(rows=rows, key=key, points=sorted(points.items()), passes=sorted(passes.items()))


def runs_table(runs, last=5):
    """One line per run: its iterations, each data set's last avg@k (the change from iteration 0
    in brackets), and its train reward and kl_k3 averaged over the last `last` iterations. Under
    it, when a run's evaluation files hold pass@k, one line per run and k: each data set's pass@k
    at the last evaluation that has it (the change from iteration 0 in brackets), in the same
    columns."""
    sets = [n for r in runs.values() for _, v in r["points"] for n in v if n != "all"]
    sets += [n for r in runs.values() for _, p in r.get("passes", []) for v in p.values()
             for n in v if n != "all"]
    sets = list(dict.fromkeys(sets)) + ["all"]
    w = max([12] + [len(n) for n in runs])              # the name column fits the longest name
    cols = [max(15, len(table_name(n)) + 2) for n in sets]
    head = "".join(f"{table_name(n):>{c}}" for n, c in zip(sets, cols))

    def cells(end, start):
        return "".join(f"{change_cell(end, start, n):>{c}}" for n, c in zip(sets, cols))

    lines = [f"{'run':<{w}}{'iters':>6}{'eval at':>8}{head}{'reward':>9}{'kl_k3':>9}"]
    for name, r in runs.items():
        rows, pts = r["rows"], r["points"]
        at, end = pts[-1] if pts else ("-", {})
        start = pts[0][1] if pts and pts[0][0] == 0 and at != 0 else {}
        tail = rows[-last:] or [{"reward_mean": math.nan, "kl_k3": math.nan}]
        reward = sum(x["reward_mean"] for x in tail) / len(tail)
        kl = sum(x["kl_k3"] for x in tail) / len(tail)
        lines.append(f"{name:<{w}}{len(rows):>6}{at:>8}{cells(end, start)}{reward:>9.3f}{kl:>9.1e}")
    keys = "/".join(sorted({r["key"] for r in runs.values() if r["key"]})) or "avg@k"
    lines.append(f"({keys} in %, held out: the run's last evaluation, at iteration 'eval at' "
                 "(eval.json once the run finished), in brackets the change from iteration 0 "
                 f"(eval_start.json); reward and kl_k3: train batch means over the last {last} "
                 "iterations of metrics.jsonl)")
    if any(r.get("passes") for r in runs.values()):
        lines.append(f"{'pass@k':<{w}}{'k':>6}{'eval at':>8}{head}")
        for name, r in runs.items():
            pts = r.get("passes") or []
            if not pts:   # evaluation files older than pass@k
                lines.append(f"{name:<{w}}{'-':>6}{'-':>8}{cells({}, {})}")
                continue
            at, end = pts[-1]
            start = pts[0][1] if pts[0][0] == 0 and at != 0 else {}
            for k, res in end.items():
                lines.append(f"{name:<{w}}{k:>6}{at:>8}{cells(res, start.get(k, {}))}")
        lines.append("(pass@k in %, held out, unbiased (Chen et al. 2021) from the same samples as "
                     "avg@k: the run's last evaluation file that has it (eval.json, "
                     "eval_iter_N.json), in brackets the change from iteration 0)")
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
        print(compare_table(before, after))
        return
    runs = dict(zip(run_names(paths), map(read_run, paths)))
    print(runs_table(runs))
    plot_runs(runs, plot)
    print(f"curves: {plot}")


def main():
    p = argparse.ArgumentParser(description="avg@k and pass@k on held-out problems",
                                allow_abbrev=False)
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
    for flag in ("k", "max_new_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag}={getattr(args, flag)}; accepted: an integer >= 1")
    try:   # refused values in argparse's form, as train.py's (infra/flags.py FlagError)
        flags.check_model("model", args.model)
        from transformers.utils.logging import disable_progress_bar
        from infra.models import load_tokenizer
        from rollout import make_engine
        disable_progress_bar()   # transformers' "Loading weights" bars (the HF backend loads one)
        t0 = time.time()
        tok, _ = load_tokenizer(args.model)
        try:
            rows = load_rows(args.data, args.split, args.data_dir, args.template, tok,
                             max_prompt_tokens=args.max_model_len - args.max_new_tokens)
        except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
            raise flags.FlagError(f"--data={args.data!r}: {e}") from None
    except flags.FlagError as e:
        p.error(str(e))
    longest = max(len(r["prompt_ids"]) for r in rows)
    engine = make_engine(args.model, backend=args.backend, max_model_len=args.max_model_len,
                         seed=args.seed, dtype=args.dtype, kv_cache_sequences=len(rows) * args.k,
                         kv_cache_tokens=longest + args.max_new_tokens)
    print(f"avg@{args.k}: {len(rows)} problems x {args.k} samples of {args.model} ...", flush=True)
    res, passes = avg_and_pass_at_k(engine, rows, args.k, args.max_new_tokens, seed=args.seed)
    print(result_table(res, passes, f"avg@{args.k}",
                       f"   (%; {args.model}, {time.time() - t0:.0f}s)"))
    line = json.dumps({f"avg@{args.k}": res, "pass@k": passes, "model": args.model})
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
