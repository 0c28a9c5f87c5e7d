"""
The sampler as a service (--vllm_server, infra/vllm_server.py) against the in-process engine, on
the embedded default or the SmolLM2 preset, at K = 0 and K = 1, in one run.

    python bench/bench_server.py                         # 1 + 3 iterations per layout and K
    python bench/bench_server.py --preset smollm2 --out bench/results/server_smollm2.json

What it measures: one train.py subprocess per (layout, K), same seed and flags; from metrics.jsonl
the median seconds per iteration and per phase after the warm-up (time_sync_s: the weight sync,
in process or through the server's transfer API), and the peak RSS of each side: the trainer's
process tree (in process: trainer + vLLM engine) and, for the server layout, the server's tree
(API server, engine core, worker). The server is started once (`python rollout.py serve`) and
serves every server run. On this CPU the server and the trainer share the same cores, so the
figure is the cost of the HTTP and transfer path plus that competition; on a GPU layout
(trainer GPUs + sampler GPUs) the two sides would not compete, and it does not say how fast
that is.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_share_prompts import cpu_name  # noqa: E402
from measure import run_measured  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "logp", "update", "sync", "iter")
PORT = 8123
# preset: the model, its train.py flags, and the server's flags (its dtype and KV cache as the
# in-process engine's: --vllm_dtype, P x G sequences)
PRESETS = {
    "tiny": ("data/tiny/model", [], ["--max_model_len", "256"]),
    "smollm2": ("data/smollm2/model", ["@configs/smollm2_cpu.args", "--target_kl", "0"],
                ["--max_model_len", "256", "--dtype", "bfloat16", "--kv_cache_sequences", "128"]),
}

p = argparse.ArgumentParser(description="--vllm_server against the in-process engine",
                            allow_abbrev=False)
p.add_argument("--lags", default="0,1", help="comma-separated --async_lag values")
p.add_argument("--warmup", type=int, default=1, help="iterations run and not counted")
p.add_argument("--iters", type=int, default=3, help="iterations counted")
p.add_argument("--out", default="", help="also write the JSON result here")
p.add_argument("--preset", default="tiny", choices=tuple(PRESETS), help="tiny: the embedded "
               "default; smollm2: configs/smollm2_cpu.args (data/smollm2.py converts the model)")


class Peak(threading.Thread):
    """The peak summed RSS of a process tree, sampled every 0.2 s."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.root, self.peak, self.done = psutil.Process(pid), 0, threading.Event()
        self.start()

    def run(self):
        while not self.done.is_set():
            try:
                tree = [self.root] + self.root.children(recursive=True)
                self.peak = max(self.peak, sum(q.memory_info().rss for q in tree))
            except psutil.Error:
                pass
            self.done.wait(0.2)


def serve(preset):
    import requests
    model, _, serve_flags = PRESETS[preset]
    log = open(Path(tempfile.mkdtemp(prefix="serve_")) / "log.txt", "w")
    proc = subprocess.Popen([sys.executable, "rollout.py", "serve", model, "--port", str(PORT),
                             *serve_flags], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(300):
        try:
            if requests.get(f"http://127.0.0.1:{PORT}/v1/models", timeout=2).ok:
                return proc
        except requests.ConnectionError:
            time.sleep(1)
    sys.exit(f"no server after 300 s: {log.name}")


def run(args, k, server):
    out = Path(tempfile.mkdtemp(prefix=f"server_{'server' if server else 'inproc'}_{k}_"))
    flags = ["--async_lag", str(k)] + (["--mu_source", "vllm"] if k else []) + \
        (["--vllm_server", f"http://127.0.0.1:{PORT}"] if server else [])
    model, preset_flags, _ = PRESETS[args.preset]
    cmd = [sys.executable, "train.py", *preset_flags, "--model", model, *flags,
           "--iters", str(args.warmup + args.iters),
           "--out_dir", str(out), "--sample_every", "0", "--ckpt_every", "0",
           "--samples_every", "0", "--eval_data", "", "--threads", "1"]
    rc, wall, tree_gb, _ = run_measured(cmd, out / "log.txt", cwd=ROOT)
    if rc:
        sys.exit(f"K={k} server={server} failed ({rc}):\n{(out / 'log.txt').read_text()[-3000:]}")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")][args.warmup:]
    return {**{ph: statistics.median(r[f"time_{ph}_s"] for r in rows) for ph in PHASES},
            "trainer_gb": tree_gb, "cmd": " ".join(cmd[1:])}


def main():
    args = p.parse_args()
    result = {"cpu": cpu_name(), "preset": args.preset, "runs": {}}
    print(f"{args.preset}; CPU: {result['cpu']}; train.py --threads 1, the server vLLM's default threads; "
          f"median over iterations {args.warmup + 1}-{args.warmup + args.iters}")
    if args.preset == "smollm2" and not (ROOT / PRESETS["smollm2"][0]).is_dir():
        subprocess.run([sys.executable, "data/smollm2.py"], cwd=ROOT, check=True)
    proc = serve(args.preset)
    server_peak = Peak(proc.pid)
    try:
        for k in (int(x) for x in args.lags.split(",")):
            inproc, served = run(args, k, False), run(args, k, True)
            result["runs"][f"K{k}"] = {"in_process": inproc, "server": served}
            print(f"\nK = {k}: seconds per iteration and phase, trainer peak RSS (GB)")
            print(f"{'':11}" + "".join(f"{ph:>9}" for ph in PHASES) + f"{'trainer':>9}")
            for name, r in (("in process", inproc), ("server", served)):
                print(f"{name:11}" + "".join(f"{r[ph]:9.2f}" for ph in PHASES) +
                      f"{r['trainer_gb']:9.2f}")
            print(f"{'ratio':11}" + "".join(f"{served[ph] / max(inproc[ph], 1e-9):9.2f}"
                                            for ph in PHASES) +
                  f"{served['trainer_gb'] / inproc['trainer_gb']:9.2f}   (server / in process)")
    finally:
        server_peak.done.set()
        import os
        import signal
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    result["server_gb"] = server_peak.peak / 1e9
    print(f"\nthe server's process tree, peak RSS over its runs: {result['server_gb']:.2f} GB")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
