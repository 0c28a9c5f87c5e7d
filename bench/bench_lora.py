"""LoRA against the full fine-tune of the same preset, in one sitting: avg@k gain, time per
iteration, peak memory.

    python bench/bench_lora.py --preset smollm2 --iters 10 --lora_rank 16 --lora_lr 1e-4
    python bench/bench_lora.py --preset tiny --lora_rank 8 --lora_lr 1.5e-3

Choices:
1. Both runs are train.py subprocesses, one after the other (2 cores: never together), on the
   same preset and seed, each scoring its start model and its result (--eval_before); the LoRA
   run adds --lora_rank R and its own --lr (LoRA's adapters start at zero and want a larger lr).
2. Peak memory: the summed RSS of the process tree (trainer and vLLM engine), sampled every 0.2 s,
   and the largest single process's peak (bench/measure.py).
3. Time per iteration: the median of metrics.jsonl's time_iter_s past the first iteration (which
   warms up); the gain: eval.json minus eval_start.json, per data set.
Writes bench/results/lora-<preset>.json (or --out) and prints a table.
"""
import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from measure import run_measured  # noqa: E402

PRESETS = {"tiny": ["--eval_data", "tiny-math,tiny-code"],
           "smollm2": ["@configs/smollm2_cpu.args"]}

p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
p.add_argument("--preset", default="tiny", choices=tuple(PRESETS))
p.add_argument("--iters", type=int, default=None, help="iterations (default: the preset's)")
p.add_argument("--lora_rank", type=int, default=8)
p.add_argument("--lora_lr", type=float, required=True, help="the LoRA run's --lr")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--work", default="out/bench_lora", help="folder for the two runs")
p.add_argument("--out", default="", help="result JSON (default bench/results/lora-<preset>.json)")
args = p.parse_args()

if args.preset == "smollm2" and not (ROOT / "data/smollm2/model/config.json").is_file():
    sys.exit("run `python data/smollm2.py` first (converts the wheel's GGUF once)")
common = [sys.executable, "train.py", *PRESETS[args.preset], "--eval_before", "--seed",
          str(args.seed), *(["--iters", str(args.iters)] if args.iters else [])]
sides = {"full": [], "lora": ["--lora_rank", str(args.lora_rank), "--lr", str(args.lora_lr)]}
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
result = {"preset": args.preset, "seed": args.seed, "iters": args.iters, "cpu": None, "runs": {}}
try:
    result["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                         if line.startswith("model name"))
except (OSError, StopIteration):
    pass
for side, flags in sides.items():
    out = ROOT / args.work / f"{args.preset}-{side}-seed{args.seed}"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = common + flags + ["--out_dir", str(out), "--overwrite"]
    rc, wall, tree_gb, single_gb = run_measured(cmd, f"{out}.log", cwd=ROOT)
    if rc:
        sys.exit(f"{side}: exit {rc}; see {out}.log")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    start = json.load(open(out / "eval_start.json"))
    end = json.load(open(out / "eval.json"))
    key = next(k for k in end if k.startswith("avg@"))
    result["runs"][side] = {
        "flags": flags, "wall_s": round(wall, 1), "peak_tree_rss_gb": round(tree_gb, 3),
        "peak_single_rss_gb": round(single_gb, 3),
        "s_per_iter_median": round(statistics.median(r["time_iter_s"] for r in rows[1:] or rows), 2),
        "update_s_median": round(statistics.median(r["time_update_s"] for r in rows[1:] or rows), 2),
        "start": start[key], "end": end[key],
        "gain": {k: round(end[key][k] - start[key][k], 2) for k in end[key]}}
path = Path(args.out or ROOT / "bench" / "results" / f"lora-{args.preset}.json")
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps(result, indent=1) + "\n")
print(f"{args.preset}, seed {args.seed}, {result['cpu']}")
print(f"{'run':<6}{'s/iter':>8}{'update s':>10}{'peak tree GB':>14}{'peak proc GB':>14}  gain (avg@k)")
for side, r in result["runs"].items():
    gains = ", ".join(f"{k} {v:+.1f}" for k, v in r["gain"].items())
    print(f"{side:<6}{r['s_per_iter_median']:>8.2f}{r['update_s_median']:>10.2f}"
          f"{r['peak_tree_rss_gb']:>14.2f}{r['peak_single_rss_gb']:>14.2f}  {gains}")
print(f"wrote {path}")
