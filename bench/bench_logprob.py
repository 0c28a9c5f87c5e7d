"""
Peak memory and time of log-probs + entropy at a real vocabulary (Qwen's 151,936), forward + backward.

    python bench/bench_logprob.py                         # 16 x 2048 tokens where it fits, and a scaled 2 x 2048 config
    python bench/bench_logprob.py --configs 2x2048 --reps 2

What the heads see is the last hidden states (N, H) and the LM head weight (V, H); this benchmark
feeds them random tensors (H = 64 by default, a tiny body: the cost here is the (N, V) logits, not the
body) and random targets, and backpropagates sum(logp * g) for a fixed random g into both. Paths:
1. `ours`: the trainer's `infra.logprobs._chunk_logp_entropy` (imported), called per chunk of at most `--chunk_mb`
   MB of float32 logits (train.py's `--logp_chunk_mb` default, 256: 441 tokens at this vocabulary)
   under `torch.utils.checkpoint` (use_reentrant=False), exactly as `infra.logprobs.token_logprobs`
   does: at most one chunk's logits live.
2. `plain`: logits = h @ W.T, log_softmax, gather; entropy from the same log-softmax under no_grad.
3. `trl_helpers`: the full (B, T, V) logits through TRL's public helpers
   `trl.trainer.utils.selective_log_softmax` (per-sequence logsumexp) and `entropy_from_logits`
   (128-row chunks, under no_grad).
4. `trl_fused`: what TRL 1.16's GRPOTrainer itself runs (`add_fused_lm_head` ->
   `trl.kernels.ChunkedLogProbFunction`, 4096-token x 32768-vocab tiles, online logsumexp, tiles
   recomputed in the backward; torch ops on CPU, no Triton here).
Each path runs in its own subprocess. Peak memory: the process's peak RSS (VmHWM) is reset through
/proc/self/clear_refs once the inputs exist, so the figure is the peak *added* by forward + backward
(gradients of h and W included, the same for all). A path whose estimated need exceeds 85% of the
memory available is not run; its need is then shown by arithmetic, labelled as such. All paths that
ran on a config are checked against one another: max abs difference of logp, entropy and both gradients.
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("ours", "plain", "trl_helpers", "trl_fused")

p = argparse.ArgumentParser(description="log-prob + entropy peak memory and time at a real vocabulary",
                            allow_abbrev=False)
p.add_argument("--configs", default="16x2048,2x2048", help="comma-separated BxT token batches")
p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen2/3: 151,936)")
p.add_argument("--hidden", type=int, default=64, help="hidden size of the random hidden states")
p.add_argument("--chunk_mb", type=int, default=256, help="ours: MB of float32 logits per chunk (train.py --logp_chunk_mb)")
p.add_argument("--paths", default=",".join(PATHS), help="which paths to run")
p.add_argument("--reps", type=int, default=1, help="timed forward+backward passes per path (median)")
p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
p.add_argument("--out", default="", help="also write the JSON result here")
p.add_argument("--worker", default="", help=argparse.SUPPRESS)    # internal: "path:B:T:file"
args = p.parse_args()


def ours_rows():
    """Tokens per chunk of infra.logprobs.token_logprobs at this vocabulary."""
    return max(1, (args.chunk_mb << 20) // (4 * args.vocab))


def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024          # kB -> bytes
    raise KeyError(key)


def worker(path, B, T, out_file):
    import torch
    from torch.utils.checkpoint import checkpoint
    if args.threads:
        torch.set_num_threads(args.threads)
    g_ = torch.Generator().manual_seed(args.seed)
    N, H, V = B * T, args.hidden, args.vocab
    h = torch.randn(N, H, generator=g_).requires_grad_()                            # (N, H)
    W = (torch.randn(V, H, generator=g_) * 2 / H ** 0.5).requires_grad_()            # (V, H), logits std ~2
    y = torch.randint(0, V, (N,), generator=g_)                                      # (N,)
    g = torch.randn(N, generator=g_)                                                 # upstream gradient of logp

    if path == "ours":
        sys.path.insert(0, str(ROOT))
        from infra.logprobs import _chunk_logp_entropy as fn
        rows = ours_rows()
        def run(h, W, y, B, T):
            parts = [checkpoint(fn, h[s:s + rows], W, y[s:s + rows], use_reentrant=False)
                     for s in range(0, len(y), rows)]
            return torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])
    elif path == "plain":
        def run(h, W, y, B, T):
            logp_all = (h @ W.t()).log_softmax(-1)                                   # (N, V)
            logp = logp_all.gather(-1, y[:, None]).squeeze(-1)
            with torch.no_grad():
                ent = -(logp_all.exp() * logp_all).sum(-1)
            return logp, ent
    elif path == "trl_helpers":
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax
        def run(h, W, y, B, T):
            logits = (h @ W.t()).view(B, T, V)                                       # (B, T, V)
            logp = selective_log_softmax(logits, y.view(B, T))
            with torch.no_grad():
                ent = entropy_from_logits(logits)
            return logp.reshape(-1), ent.reshape(-1)
    elif path == "trl_fused":
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE
        def run(h, W, y, B, T):
            logp, ent, *_ = ChunkedLogProbFunction.apply(h, W, None, y, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE,
                                                         None, 1.0, ("entropy",))
            return logp, ent.detach()
    else:
        raise ValueError(path)

    # one tiny untimed pass first, so lazy initialisation is not counted as the path's memory
    hw, Ww = h[:8].detach().requires_grad_(), W.detach().requires_grad_()
    lw, _ = run(hw, Ww, y[:8], 1, 8)
    lw.sum().backward()
    del hw, Ww, lw
    times, peaks = [], []
    for _ in range(args.reps):
        h.grad = W.grad = None
        base = rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:       # reset VmHWM to the current RSS
            f.write("5")
        t = time.perf_counter()
        logp, ent = run(h, W, y, B, T)
        (logp * g).sum().backward()
        times.append(time.perf_counter() - t)
        peaks.append(rss("VmHWM") - base)
    torch.save({"logp": logp.detach(), "entropy": ent.detach(), "grad_h": h.grad, "grad_W": W.grad}, out_file + ".pt")
    Path(out_file).write_text(json.dumps({"time_s": times, "peak_delta_gb": max(peaks) / 1e9,
                                          "threads": torch.get_num_threads()}))


if args.worker:
    path, B, T, out_file = args.worker.split(":", 3)
    worker(path, int(B), int(T), out_file)
    sys.exit(0)


def need_gb(path, N):
    """Rough peak of each path, fp32, by arithmetic: how many (n, V) tensors live at once."""
    NV = N * args.vocab * 4 / 1e9
    cV = min(N, ours_rows()) * args.vocab * 4 / 1e9
    return {"ours": 5 * cV,                 # chunk logits, log-softmax, exp, product (+ grads in backward)
            "plain": 4 * NV,                # logits, log-softmax (saved), exp and product for the entropy
            "trl_helpers": 3 * NV,          # logits (saved by logsumexp), its grad, gather's scattered grad
            "trl_fused": 0.5}[path]         # a 4096 x 32768 tile and fp32 gradient accumulators


def main():
    import psutil, torch
    work = Path(tempfile.mkdtemp(prefix="bench_logprob_"))
    avail = psutil.virtual_memory().available / 1e9
    paths = [q for q in args.paths.split(",") if q]
    config = dict(vocab=args.vocab, hidden=args.hidden, ours_chunk_mb=args.chunk_mb, ours_chunk_tokens=ours_rows(), reps=args.reps, dtype="float32",
                  memory_available_gb=round(avail, 1), cores=len(os.sched_getaffinity(0)),
                  threads=args.threads or torch.get_num_threads(), load_avg_start=os.getloadavg()[0],
                  ours_source="infra.logprobs._chunk_logp_entropy (imported) + checkpoint loop as in token_logprobs")
    print("config:", json.dumps(config), flush=True)
    results = {}
    for cfg in [c for c in args.configs.split(",") if c]:
        B, T = map(int, cfg.lower().split("x"))
        N = B * T
        res = results[cfg] = {"B": B, "T": T, "tokens": N, "logits_gb": N * args.vocab * 4 / 1e9, "paths": {}}
        for path in paths:
            est = need_gb(path, N)
            if est > 0.85 * avail:
                res["paths"][path] = {"skipped": f"needs about {est:.1f} GB by arithmetic, {avail:.1f} GB available",
                                      "need_gb_arithmetic": est}
                print(f"{cfg} {path}: skipped, {res['paths'][path]['skipped']}", flush=True)
                continue
            f = str(work / f"{cfg}-{path}.json")
            run = subprocess.run([sys.executable, __file__, "--worker", f"{path}:{B}:{T}:{f}"] + sys.argv[1:],
                                 capture_output=True, text=True)
            if run.returncode:
                res["paths"][path] = {"failed": f"rc {run.returncode}: {run.stderr.strip().splitlines()[-1:]}",
                                      "need_gb_arithmetic": est}
                print(f"{cfg} {path}: failed, {res['paths'][path]['failed']}", flush=True)
                continue
            r = json.loads(Path(f).read_text())
            res["paths"][path] = {"peak_gb": r["peak_delta_gb"], "time_s": statistics.median(r["time_s"]),
                                  "times_s": r["time_s"], "need_gb_arithmetic": est}
            print(f"{cfg} {path}: peak +{r['peak_delta_gb']:.2f} GB, {statistics.median(r['time_s']):.2f} s", flush=True)
        # numerical agreement with the first path that ran (plain when it ran)
        ran = [q for q in paths if "peak_gb" in res["paths"][q]]
        ref = "plain" if "plain" in ran else (ran[0] if ran else None)
        if ref:
            a = torch.load(work / f"{cfg}-{ref}.json.pt")
            for q in ran:
                b = torch.load(work / f"{cfg}-{q}.json.pt")
                res["paths"][q]["max_abs_diff_vs_" + ref] = {k: (a[k] - b[k]).abs().max().item() for k in a}
        res["reference"] = ref

    print(f"\n{'config':<9}{'path':<13}{'peak GB':>10}{'vs plain':>10}{'vs ours':>9}{'time s':>9}"
          f"{'vs plain':>10}   max|diff| logp / ent / grad_h / grad_W (vs ref)")
    for cfg, res in results.items():
        P = res["paths"]
        base = {k: P.get(k, {}) for k in ("plain", "ours")}
        for q, r in P.items():
            if "peak_gb" not in r:
                print(f"{cfg:<9}{q:<13}{'(' + format(r['need_gb_arithmetic'], '.1f') + ')':>10}  "
                      f"not run: {r.get('skipped') or r.get('failed')}")
                continue
            rp = lambda k: (f"{r['peak_gb'] / base[k]['peak_gb']:.3f}" if "peak_gb" in base[k]
                            else f"{r['peak_gb'] / base[k]['need_gb_arithmetic']:.3f}*" if base[k] else "-")
            tp = f"{r['time_s'] / base['plain']['time_s']:.2f}" if "time_s" in base["plain"] else "-"
            d = r.get(f"max_abs_diff_vs_{res['reference']}", {})
            print(f"{cfg:<9}{q:<13}{r['peak_gb']:10.2f}{rp('plain'):>10}{rp('ours'):>9}{r['time_s']:9.2f}{tp:>10}   "
                  + " / ".join(f"{d[k]:.1e}" for k in ("logp", "entropy", "grad_h", "grad_W")) + f" ({res['reference']})")
        print(f"{cfg:<9}(full logits alone, fp32: {res['logits_gb']:.1f} GB; "
              f"figures in parentheses and ratios marked * are arithmetic, not measured)")
    result = dict(bench="logprob", config=config, results=results, load_avg_end=os.getloadavg()[0])
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
