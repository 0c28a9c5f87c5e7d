"""
avg@k of a model folder on held-out problems: k samples per problem, scored by reward.py.

    python eval.py --model data/tiny/model                       # the warm-start model
    python eval.py --model out/kl-atomic-seed0/final --k 8       # any trained policy
    python eval.py --model Qwen/Qwen3-8B-Base --data aime24,aime25 --template dapo --max_new_tokens 20000

Choices:
1. avg@k is the mean reward over k samples per problem (temperature 1, as the paper's avg@8),
   averaged over problems: the expected accuracy of one sample, with less noise than k = 1.
2. Samples come from vLLM (rollout.py), the same engine the trainer samples with.
3. One table row per data set, then one JSON line (`{"avg@k": {...}}`) for scripts.
"""
import argparse
import json
import time

import reward
from data.loaders import format_prompt, load_problems


def load_rows(names, split, data_dir, template, tokenizer):
    """Problems of the comma-separated data sets `names`, each with its prompt text and ids."""
    rows = []
    for name in [n for n in names.split(",") if n]:
        for row in load_problems(name, split=split, data_dir=data_dir):
            row["prompt"] = format_prompt(row, template, tokenizer)
            row["prompt_ids"] = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
            rows.append(row)
    if not rows:
        raise ValueError(f"no problems in data sets {names!r} (split {split!r})")
    return rows


def avg_at_k(engine, rows, k, max_new_tokens, seed=0):
    """{source: avg@k in %} over `rows`, plus "all"."""
    batch = engine.generate([r["prompt_ids"] for r in rows], n=k, max_tokens=max_new_tokens, seed=seed)
    scores = [0.0] * len(batch.texts)
    for task in sorted({r["task"] for r in rows}):
        idx = [i for i in range(len(batch.texts)) if rows[i // k]["task"] == task]
        got = reward.score(task, [batch.texts[i] for i in idx], [rows[i // k]["ground_truth"] for i in idx])
        for i, s in zip(idx, got):
            scores[i] = s
    out = {}
    for source in dict.fromkeys(r["source"] for r in rows):
        s = [scores[i] for i in range(len(scores)) if rows[i // k]["source"] == source]
        out[source] = 100.0 * sum(s) / len(s)
    out["all"] = 100.0 * sum(scores) / len(scores)
    return out


def main():
    p = argparse.ArgumentParser(description="avg@k on held-out problems")
    p.add_argument("--model", default="data/tiny/model", help="model folder (or hub name)")
    p.add_argument("--data", default="tiny-math,tiny-code", help="comma-separated data set names")
    p.add_argument("--split", default="test", help="data split")
    p.add_argument("--data_dir", default=None, help="folder with local copies of hub data sets")
    p.add_argument("--template", default="plain", help="prompt template: plain, dapo, code, chat")
    p.add_argument("--k", type=int, default=8, help="samples per problem")
    p.add_argument("--max_new_tokens", type=int, default=48, help="max response length, tokens")
    p.add_argument("--max_model_len", type=int, default=256, help="vLLM context length")
    p.add_argument("--backend", default="vllm", help="vllm, or hf (fallback)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed")
    p.add_argument("--out", default="", help="also write the JSON result to this file")
    args = p.parse_args()

    from rollout import make_engine
    t0 = time.time()
    engine = make_engine(args.model, backend=args.backend, max_model_len=args.max_model_len, seed=args.seed)
    rows = load_rows(args.data, args.split, args.data_dir, args.template, engine.tokenizer)
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
