"""
Iteration time as the group size and the max response length grow, and the cost per generated token.

    python bench/bench_scaling.py                                      # G in 4,8,16; max length in 64,128,256
    python bench/bench_scaling.py --model /tmp/h6tiny/model --data_dir /tmp/h6tiny --threads 1

What it measures: one train.py subprocess per setting (train.py's defaults otherwise: P=64, M=8,
kl-atomic), `--warmup` + `--iters` iterations; from metrics.jsonl, after the warm-up, the median
`time_iter_s`, the mean response length actually generated, the share of completions that hit the
limit (`truncated_frac`), and seconds per generated token = time_iter_s / (P * G * response_len).
1. Group axis: G in `--groups` at train.py's default max length (48 tokens). Length axis: max length in
   `--lengths` at G = 8; `--max_model_len` is set to the limit + 128 so vLLM accepts it.
2. Read the length axis with care: the tiny model answers math in about 10 tokens and code in about 41, and stops at EOS, so a
   larger limit barely changes what is generated; the table shows the real mean length and
   truncated share. train.py has no flag to ignore EOS, and this benchmark adds none, so it cannot
   force long responses: with the embedded model the length axis mostly measures fixed costs
   (engine scheduling, the batch's longer padding when a rare completion runs long).
3. Per-token cost should stay flat if nothing grows faster than the number of generated tokens; a
   rising column points at a per-sequence or per-padded-position cost.
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

p = argparse.ArgumentParser(description="iteration time vs group size and max response length",
                            allow_abbrev=False)
p.add_argument("--model", default="data/tiny/model", help="model folder")
p.add_argument("--data_dir", default=None, help="data folder (default data/tiny)")
p.add_argument("--groups", default="4,8,16", help="group sizes G, at train.py's default max length (48)")
p.add_argument("--lengths", default="64,128,256", help="max response lengths, at G = 8")
p.add_argument("--prompts_per_iter", type=int, default=64, help="P")
p.add_argument("--warmup", type=int, default=1, help="iterations run and not counted")
p.add_argument("--iters", type=int, default=2, help="iterations counted")
p.add_argument("--threads", type=int, default=0, help="train.py --threads (0 = torch's default; 1 on a busy machine)")
p.add_argument("--out", default="", help="also write the JSON result here")
args = p.parse_args()
DEFAULT_LEN = 48   # train.py's --max_new_tokens default: the group axis runs at it


def run(G, L):
    out_dir = Path(tempfile.mkdtemp(prefix=f"bench_scaling_G{G}_L{L}_"))
    cmd = [sys.executable, "train.py", "--model", args.model, "--iters", str(args.warmup + args.iters),
           "--group_size", str(G), "--max_new_tokens", str(L), "--max_model_len", str(max(256, L + 128)),
           "--prompts_per_iter", str(args.prompts_per_iter), "--out_dir", str(out_dir), "--sample_every", "0",
           "--threads", str(args.threads)] + (["--data_dir", args.data_dir] if args.data_dir else [])
    t = time.time()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"train.py failed (rc {r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    rows = [json.loads(l) for l in open(out_dir / "metrics.jsonl")][args.warmup:]
    it = statistics.median(x["time_iter_s"] for x in rows)
    lens = sum(x["response_len"] for x in rows) / len(rows)
    tokens = args.prompts_per_iter * G * lens
    return dict(G=G, max_new_tokens=L, iter_s=it, iter_s_all=[x["time_iter_s"] for x in rows],
                rollout_s=statistics.median(x["time_rollout_s"] for x in rows),
                update_s=statistics.median(x["time_update_s"] for x in rows),
                response_len=lens, truncated_frac=sum(x["truncated_frac"] for x in rows) / len(rows),
                tokens_per_iter=tokens, ms_per_token=1e3 * it / tokens, wall_s=time.time() - t)


def main():
    config = dict(model=args.model, P=args.prompts_per_iter, warmup=args.warmup, iters=args.iters,
                  threads=args.threads or "torch default", cores=len(os.sched_getaffinity(0)),
                  load_avg_start=os.getloadavg()[0])
    print("config:", json.dumps(config), flush=True)
    settings = [(int(g), DEFAULT_LEN) for g in args.groups.split(",") if g] + [(8, int(l)) for l in args.lengths.split(",") if l]
    res = []
    print(f"{'G':>3}{'max len':>8}{'s/iter':>9}{'rollout':>9}{'update':>8}{'mean len':>9}{'trunc':>7}"
          f"{'tokens':>8}{'ms/token':>10}", flush=True)
    for G, L in settings:
        r = run(G, L)
        res.append(r)
        print(f"{G:>3}{L:>8}{r['iter_s']:9.2f}{r['rollout_s']:9.2f}{r['update_s']:8.2f}{r['response_len']:9.1f}"
              f"{r['truncated_frac']:7.3f}{r['tokens_per_iter']:8.0f}{r['ms_per_token']:10.3f}", flush=True)
    per_tok = [r["ms_per_token"] for r in res]
    summary = dict(ms_per_token_max_over_min=max(per_tok) / min(per_tok),
                   max_truncated_frac=max(r["truncated_frac"] for r in res))
    print(f"per-token cost, max/min over settings: {summary['ms_per_token_max_over_min']:.2f}; "
          f"largest truncated share {summary['max_truncated_frac']:.3f} (the length limit binds only that often)")
    line = json.dumps(dict(bench="scaling", config=config, rows=res, summary=summary, load_avg_end=os.getloadavg()[0]))
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
