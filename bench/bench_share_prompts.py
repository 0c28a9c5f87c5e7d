"""
Each group's prompt once (--share_prompts, infra/logprobs.py 4.) against the plain layout
(--share_prompts 0), on the embedded default and on the SmolLM2 preset, in one run.

    python bench/bench_share_prompts.py                    # both arms, 1 + 3 iterations each
    python bench/bench_share_prompts.py --arms smollm2 --iters 2

What it measures: one train.py subprocess per (arm, layout), same seed: `--warmup` + `--iters`
iterations; from metrics.jsonl the median seconds per iteration and per phase after the warm-up,
and from bench/measure.py the largest single process's peak RSS (the trainer's; vLLM's engine
does not change with the layout). Printed: each phase's time, shared over plain, and the peak
RSS ratio. Both layouts sample the same first batch from the same weights, so the first row's
metrics must agree within float noise: the largest relative difference over its keys (timers
aside; below 1e-6 absolute, as the sampler gap is in float32) is printed, beside the same
figure for a yardstick that changes the float noise only, the plain layout at half the
micro-batch size (one iteration). Later iterations drift apart (a last-bit difference, chaotic
training), so compare their times per token (the response length is printed).
"""
import argparse, json, platform, statistics, subprocess, sys, tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import run_measured  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"tiny": [], "smollm2": ["@configs/smollm2_cpu.args"]}
MICRO_BATCH = {"tiny": 64, "smollm2": 16}   # each arm's --micro_batch_size
LAYOUTS = {"plain": ["--share_prompts", "0"], "shared": []}
PHASES = ("rollout", "logp", "reward", "update", "sync", "iter")

p = argparse.ArgumentParser(description="--share_prompts against the plain layout", allow_abbrev=False)
p.add_argument("--arms", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
p.add_argument("--warmup", type=int, default=1, help="iterations run and not counted")
p.add_argument("--iters", type=int, default=3, help="iterations counted")
p.add_argument("--threads", type=int, default=0, help="train.py --threads (0 = torch's default)")
p.add_argument("--out", default="", help="also write the JSON result here")


def cpu_name():
    """lscpu's model name with its family and model numbers (the machines here are all "AMD EPYC"
    or "Intel Xeon" by name; the numbers tell the generations apart)."""
    info = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if ":" in line)
    name = info.get("Model name", platform.processor()).strip()
    return f"{name} (family {info.get('CPU family', '?').strip()} model {info.get('Model', '?').strip()})"


def first_row_gap(a, b):
    """Largest relative difference between two metrics rows' numbers, timers aside; values below
    1e-6 are compared absolutely (logp_gap_vllm is ~4e-8 on the CPU, float32 noise itself)."""
    worst = (0.0, "")
    for k, x in a.items():
        if k.startswith("time_") or k == "tokens_per_s" or not isinstance(x, (int, float)):
            continue
        gap = abs(x - b[k]) / max(abs(x), abs(b[k]), 1e-6)
        worst = max(worst, (gap, k))
    return worst


def run(args, arm, layout, flags=(), iters=None):
    if arm == "smollm2" and not (ROOT / "data/smollm2/model/config.json").exists():
        subprocess.run([sys.executable, "data/smollm2.py"], cwd=ROOT, check=True)
    out = Path(tempfile.mkdtemp(prefix=f"share_{arm}_{layout}_"))
    cmd = [sys.executable, "train.py", *ARMS[arm], *flags, "--iters",
           str(iters or args.warmup + args.iters), "--out_dir", str(out), "--sample_every", "0",
           "--ckpt_every", "0", "--samples_every", "0", "--eval_data", "", "--target_kl", "0", "--threads", str(args.threads)]
    rc, wall, _, peak_gb = run_measured(cmd, out / "log.txt", cwd=ROOT)
    if rc:
        sys.exit(f"{arm}/{layout} failed ({rc}):\n{(out / 'log.txt').read_text()[-3000:]}")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    if iters == 1:
        return {"first_row": rows[0], "cmd": " ".join(cmd[1:])}
    med = lambda k: statistics.median(r[k] for r in rows[args.warmup:])          # noqa: E731
    return {**{ph: med(f"time_{ph}_s") for ph in PHASES}, "peak_gb": peak_gb, "wall_s": wall,
            "len": statistics.mean(r["response_len"] for r in rows[args.warmup:]),
            "first_row": rows[0], "cmd": " ".join(cmd[1:])}


def main():
    args = p.parse_args()
    result = {"cpu": cpu_name(), "arms": {}}
    print(f"CPU: {result['cpu']}; median over iterations {args.warmup + 1}-{args.warmup + args.iters}")
    for arm in args.arms.split(","):
        got = {layout: run(args, arm, layout, flags) for layout, flags in LAYOUTS.items()}
        half = ["--share_prompts", "0", "--micro_batch_size", str(MICRO_BATCH[arm] // 2)]
        yardstick = run(args, arm, "plain-half-micro", half, iters=1)
        plain, shared = got["plain"], got["shared"]
        gap, key = first_row_gap(plain["first_row"], shared["first_row"])
        noise, noise_key = first_row_gap(plain["first_row"], yardstick["first_row"])
        result["arms"][arm] = {**got, "plain-half-micro": yardstick, "first_row_rel_gap": [gap, key],
                               "yardstick_rel_gap": [noise, noise_key]}
        print(f"\n{arm}: seconds per iteration and phase (response length plain "
              f"{plain['len']:.1f}, shared {shared['len']:.1f} tokens)")
        print(f"{'':8}" + "".join(f"{ph:>9}" for ph in PHASES) + f"{'peak GB':>9}")
        for name, r in got.items():
            print(f"{name:8}" + "".join(f"{r[ph]:9.2f}" for ph in PHASES) + f"{r['peak_gb']:9.2f}")
        print(f"{'ratio':8}" + "".join(f"{shared[ph] / max(plain[ph], 1e-9):9.2f}" for ph in PHASES)
              + f"{shared['peak_gb'] / plain['peak_gb']:9.2f}   (shared / plain)")
        print(f"first iteration's metrics, largest relative difference: shared {gap:.1e} ({key}); "
              f"plain at micro-batch {MICRO_BATCH[arm] // 2} {noise:.1e} ({noise_key})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
