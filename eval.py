"""
avg@k of a model folder on held-out problems: k samples per problem, scored by reward.py.

    python eval.py --model data/tiny/model                       # the warm-start model
    python eval.py --model out/kl-atomic-seed0/final --k 8       # any trained policy
    python eval.py --data jsonl:data/mytask/reverse              # data/mytask/reverse_test.jsonl
    python eval.py --model Qwen/Qwen3-8B-Base --data aime24,aime25 --template dapo \
        --max_new_tokens 20480 --max_model_len 21504             # the paper's math evaluation

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
"""
import argparse
import hashlib
import json
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


def main():
    p = argparse.ArgumentParser(description="avg@k on held-out problems")
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
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                   help="only print the before/after table of two result files (run.sh's end)")
    args = p.parse_args()
    if args.compare:
        before, after = (json.load(open(f)) for f in args.compare)
        print(compare_table({k: v for k, v in before.items() if k.startswith("avg@")},
                            {k: v for k, v in after.items() if k.startswith("avg@")}))
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
