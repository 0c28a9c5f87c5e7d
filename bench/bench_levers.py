"""
Each CPU performance lever of train.py, measured against the same run without it.

    python bench/bench_levers.py                      # the tiny default and the SmolLM2 preset
    python bench/bench_levers.py --arms tiny --iters 4

What it measures: one short train.py subprocess per (arm, lever): `--warmup` + `--iters`
iterations, then from metrics.jsonl the median seconds per iteration and of each phase after the
warm-up, the trainer-vLLM log-prob gap (`logp_gap_vllm`), and the ratio of the iteration time to
the arm's baseline. Levers:
1. `tcmalloc+iomp`: LD_PRELOAD of Debian's libtcmalloc_minimal and the venv's Intel OpenMP, the
   libraries vLLM's CPU worker asks for "for best performance" (set for the whole process).
2. `vllm_bf16`: the engine in bfloat16 beside the fp32 trainer (this CPU has AVX-512 BF16).
3. `autocast_bf16`: the trainer's forward/backward under bf16 autocast (the LM head stays fp32).
4. `mu_vllm`: `--mu_source vllm`, no behaviour forward pass (mu is vLLM's log-prob).
Every run has the same seed, so the first iteration samples the same prompts; later iterations
differ, so compare times per token (the table prints the mean response length too).
Rewards are scored in a thread while mu is computed in every run (train.py does it always); the
`time_reward_s` column is the wait beyond the log-probs.
"""
import argparse, json, os, statistics, subprocess, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
ARMS = {"tiny": [],
        "smollm2": ["@configs/smollm2_cpu.args", "--prompts_per_iter", "8", "--prompts_per_update", "4",
                    "--mixed_precision", "no", "--vllm_dtype", "float32"]}
LEVERS = {"baseline": ([], {}),
          "tcmalloc+iomp": ([], {"LD_PRELOAD": f"{TCMALLOC}:{ROOT / '.venv/lib/libiomp5.so'}"}),
          "vllm_bf16": (["--vllm_dtype", "bfloat16"], {}),
          "autocast_bf16": (["--mixed_precision", "bf16"], {}),
          "mu_vllm": (["--mu_source", "vllm"], {})}
PHASES = ("rollout", "logp", "reward", "update", "sync", "iter")

p = argparse.ArgumentParser(description="train.py's CPU levers, each against the same run without it",
                            allow_abbrev=False)
p.add_argument("--arms", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
p.add_argument("--levers", default=",".join(LEVERS), help="comma-separated lever names (baseline first)")
p.add_argument("--warmup", type=int, default=1, help="iterations run and not counted")
p.add_argument("--iters", type=int, default=3, help="iterations counted")
p.add_argument("--threads", type=int, default=0, help="train.py --threads (0 = torch's default)")
p.add_argument("--out", default="", help="also write the JSON result here")
args = p.parse_args()


def run(arm, lever):
    flags, env = LEVERS[lever]
    out = Path(tempfile.mkdtemp(prefix=f"levers_{arm}_{lever}_"))
    cmd = [sys.executable, "train.py", *ARMS[arm], *flags, "--iters", str(args.warmup + args.iters),
           "--out_dir", str(out), "--sample_every", "0", "--ckpt_every", "0", "--eval_data", "",
           "--threads", str(args.threads)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{arm}/{lever} failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")][args.warmup:]
    med = lambda k: statistics.median(r[k] for r in rows)                       # noqa: E731
    return {**{p_: med(f"time_{p_}_s") for p_ in PHASES}, "gap": statistics.mean(r["logp_gap_vllm"] for r in rows),
            "len": statistics.mean(r["response_len"] for r in rows), "cmd": " ".join(cmd[1:]), "env": env}


result = {"config": dict(warmup=args.warmup, iters=args.iters, threads=args.threads or "torch default",
                         cores=len(os.sched_getaffinity(0)), load_avg_start=os.getloadavg()[0]), "arms": {}}
for arm in args.arms.split(","):
    res = {lever: run(arm, lever) for lever in args.levers.split(",")}
    base = res[args.levers.split(",")[0]]["iter"]
    print(f"\n{arm}: median seconds per iteration after {args.warmup} warm-up")
    print(f"{'lever':<15}" + "".join(f"{p_:>9}" for p_ in PHASES) + f"{'vs base':>9}{'gap':>9}{'len':>7}")
    for lever, r in res.items():
        r["ratio"] = r["iter"] / base
        print(f"{lever:<15}" + "".join(f"{r[p_]:9.2f}" for p_ in PHASES) + f"{r['ratio']:9.2f}{r['gap']:9.4f}{r['len']:7.1f}")
    result["arms"][arm] = res
line = json.dumps(result)
print(line)
if args.out:
    Path(args.out).write_text(line + "\n")
