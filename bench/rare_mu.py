"""
How rare is the right answer at the start? The behaviour probability mu of the correct answer's
first token, and pass@k / avg@k, of a model on held-out problems.

    python bench/rare_mu.py                                          # data/tiny_rare (tiny-rare-math)
    python bench/rare_mu.py --model data/tiny/model --data tiny-math  # the default, for comparison
    python bench/rare_mu.py --model out/kl-atomic-rare-seed0/final    # a trained policy

mu: with transformers, in float32, the model's probability of the correct answer's first token at
the answer position, i.e. after the prompt and the text the demonstrator writes before the answer
("\\boxed{"): exactly the probability with which one sample at temperature 1 starts the right
answer there (given the model wrote the prefix, which the warm start does almost always). Printed:
its mean, median and quantiles over problems, and 1 - (1 - mu)^k averaged (the pass@k the mu alone
predicts, if the rest of the answer is right).
pass@k / avg@k: k samples per problem at temperature 1 (vLLM, or --backend hf), scored by reward.py
as eval.py scores them (avg@k is eval.py's number; pass@k: the share of problems with a right sample).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PREFIX = "\\boxed{"


@torch.no_grad()
def answer_mu(model, tok, rows, batch=100):
    """[p(first token of row's answer | prompt + PREFIX)] for each row (left-padded batches)."""
    out = []
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        ctx = [r["prompt_ids"] + tok(PREFIX, add_special_tokens=False)["input_ids"] for r in chunk]
        first = [tok(r["ground_truth"], add_special_tokens=False)["input_ids"][0] for r in chunk]
        T = max(map(len, ctx))
        ids = torch.full((len(ctx), T), tok.pad_token_id)
        attn = torch.zeros((len(ctx), T), dtype=torch.long)
        for j, c in enumerate(ctx):
            ids[j, T - len(c):], attn[j, T - len(c):] = torch.tensor(c), 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1].float()
        out += logits.softmax(-1)[torch.arange(len(ctx)), torch.tensor(first)].tolist()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--model", default="data/tiny_rare/model")
    p.add_argument("--data", default="tiny-rare-math", help="data set (data/loaders.py); its answers follow \\boxed{")
    p.add_argument("--data_dir", default=None)
    p.add_argument("--split", default="test")
    p.add_argument("--k", type=int, default=8, help="samples per problem for pass@k / avg@k (0: mu only)")
    p.add_argument("--max_new_tokens", type=int, default=48)
    p.add_argument("--backend", default="vllm", choices=("vllm", "hf"))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="", help="also write the JSON result here")
    args = p.parse_args()
    os.chdir(ROOT)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from data.loaders import load_rows
    import reward

    tok = AutoTokenizer.from_pretrained(args.model)
    rows = load_rows(args.data, args.split, args.data_dir, "plain", tok)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    t0 = time.time()
    mu = answer_mu(model, tok, rows)
    qs = statistics.quantiles(mu, n=10)
    res = {"model": args.model, "data": args.data, "problems": len(rows),
           "mu_mean": statistics.mean(mu), "mu_median": statistics.median(mu), "mu_p10": qs[0], "mu_p90": qs[-1],
           "mu_min": min(mu), "mu_max": max(mu),
           "share_mu_below_0.01": sum(m < 0.01 for m in mu) / len(mu),
           "share_mu_0.01_to_0.1": sum(0.01 <= m < 0.1 for m in mu) / len(mu)}
    if args.k:
        res[f"pass@{args.k}_predicted_by_mu"] = 100 * statistics.mean(1 - (1 - m) ** args.k for m in mu)
    print(f"answer mu on {len(rows)} {args.split} problems of {args.data} ({args.model}, {time.time() - t0:.1f}s): "
          f"mean {res['mu_mean']:.4f}, median {res['mu_median']:.4f}, 10-90% {qs[0]:.4f}-{qs[-1]:.4f}, "
          f"min {res['mu_min']:.4f}, max {res['mu_max']:.4f}", flush=True)
    if args.k:
        from rollout import make_engine
        engine = make_engine(args.model, backend=args.backend, max_model_len=256, seed=args.seed,
                             kv_cache_sequences=len(rows) * args.k,
                             kv_cache_tokens=max(len(r["prompt_ids"]) for r in rows) + args.max_new_tokens)
        batch = engine.generate([r["prompt_ids"] for r in rows], n=args.k, max_tokens=args.max_new_tokens,
                                seed=args.seed)
        scores = reward.score_rows(batch.texts, [rows[i // args.k] for i in range(len(batch.texts))])
        per = [scores[i * args.k:(i + 1) * args.k] for i in range(len(rows))]
        res[f"avg@{args.k}"] = 100 * statistics.mean(s for ps in per for s in ps)
        res[f"pass@{args.k}"] = 100 * statistics.mean(float(max(ps) > 0) for ps in per)
        prefix_ok = statistics.mean(t.startswith(PREFIX) for t in batch.texts)
        res["samples_starting_with_prefix"] = prefix_ok
        print(f"avg@{args.k} {res[f'avg@{args.k}']:.1f}%  pass@{args.k} {res[f'pass@{args.k}']:.1f}%  "
              f"(predicted by mu: {res[f'pass@{args.k}_predicted_by_mu']:.1f}%); samples starting with "
              f"{PREFIX!r}: {100 * prefix_ok:.1f}%", flush=True)
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
