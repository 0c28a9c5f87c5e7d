"""
Where an iteration's time goes in a train.py run: rollout, reward, behaviour log-probs, updates, glue.

    python bench/bench_breakdown.py                                  # runs train.py: data/tiny, 1 + 4 iterations
    python bench/bench_breakdown.py --model /tmp/h6tiny/model --data_dir /tmp/h6tiny
    python bench/bench_breakdown.py --metrics out/kl-atomic-seed0/metrics.jsonl --warmup 1   # an existing run

What it measures: the timers train.py writes per iteration into metrics.jsonl (`time_rollout_s`,
`time_reward_s`, `time_logp_s`, `time_update_s`, `time_sync_s`, `time_iter_s`), summed over the
iterations after `--warmup` and shown as a share of the iteration.
1. glue = iter - (rollout + reward + logp + update): everything outside the four timed phases, i.e.
   the weight sync into vLLM, advantages, prompt selection and the gathering of the logged stats.
   Sync is also shown on its own, and glue without sync beside it. train.py stops `time_iter_s`
   before it writes and prints the iteration's line, so that (and wandb) is in no timer.
2. Shares are of summed seconds (a ratio of sums, not a mean of ratios), so long iterations weigh more.
3. When it runs train.py itself, every flag after `--` is passed on, e.g. `-- --group_size 16`.
4. `--threads 1` on a shared 2-core machine: another busy process makes torch's default of 2
   threads stall at every parallel region (bench_trl.py --threads).
"""
import argparse, json, os, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

p = argparse.ArgumentParser(description="share of each phase of a train.py iteration",
                            allow_abbrev=False)
p.add_argument("--metrics", default="", help="read this metrics.jsonl instead of running train.py")
p.add_argument("--model", default="data/tiny/model", help="model folder for the train.py run")
p.add_argument("--data_dir", default=None, help="data folder for the train.py run (default data/tiny)")
p.add_argument("--warmup", type=int, default=1, help="first iterations left out")
p.add_argument("--iters", type=int, default=4, help="iterations counted (the run makes warmup + iters)")
p.add_argument("--threads", type=int, default=0, help="train.py --threads (0 = torch's default; 1 on a busy machine)")
p.add_argument("--out", default="", help="also write the JSON result here")
p.add_argument("train_args", nargs="*", help="extra train.py flags, after --")
args = p.parse_args()

config = dict(warmup=args.warmup, cores=len(os.sched_getaffinity(0)), load_avg_start=os.getloadavg()[0])
if args.metrics:
    path = Path(args.metrics)
    config.update(metrics=str(path))
else:
    out_dir = Path(tempfile.mkdtemp(prefix="bench_breakdown_"))
    cmd = [sys.executable, "train.py", "--model", args.model, "--iters", str(args.warmup + args.iters),
           "--out_dir", str(out_dir), "--sample_every", "0", "--threads", str(args.threads)] + (["--data_dir", args.data_dir] if args.data_dir else [])
    cmd += args.train_args
    # the temporary folder's name is no result: the command as it would be typed, with a placeholder
    config.update(command=" ".join(cmd[1:]).replace(str(out_dir), "TMPDIR"), iters=args.iters)
    print("running:", " ".join(cmd[1:]), flush=True)
    t = time.time()
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"train.py failed (rc {run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    config["wall_s"] = time.time() - t
    path = out_dir / "metrics.jsonl"

rows = [json.loads(line) for line in open(path) if line.strip()][args.warmup:]
if not rows:
    sys.exit(f"{path}: no iterations after the first {args.warmup}")
total = {k: sum(r[f"time_{k}_s"] for r in rows) for k in ("rollout", "reward", "logp", "update", "sync", "iter")}
total["glue"] = total["iter"] - sum(total[k] for k in ("rollout", "reward", "logp", "update"))  # choice 1
total["glue_without_sync"] = total["glue"] - total["sync"]
n, it = len(rows), total["iter"]
config.update(counted_iters=n, response_len=sum(r["response_len"] for r in rows) / n)
print("config:", json.dumps(config))
print(f"\n{'phase':<28}{'s / iter':>10}{'share':>9}")
names = [("rollout (vLLM sampling)", "rollout"), ("reward (reward.score)", "reward"),
         ("behaviour log-probs", "logp"), ("updates (P/M AdamW steps)", "update"),
         ("glue (incl. sync)", "glue"), ("  of which sync", "sync"), ("  glue without sync", "glue_without_sync"),
         ("iteration", "iter")]
for label, k in names:
    print(f"{label:<28}{total[k] / n:10.3f}{100 * total[k] / it:8.1f}%")
result = dict(bench="breakdown", config=config, seconds_per_iter={k: v / n for k, v in total.items()},
              share={k: v / it for k, v in total.items() if k != "iter"}, glue_share=total["glue"] / it)
line = json.dumps(result)
print(line)
if args.out:
    Path(args.out).write_text(line + "\n")
