"""
The trainer's log-prob path against a plain full-logits path on a Qwen2.5-0.5B-shaped random model:
time, peak memory and TFLOP/s of one forward + backward, for each LM head precision.

    python bench/gpu_logprob.py                      # GPU: 8 x 2048 tokens, 1536 of them response
    python bench/gpu_logprob.py --small              # a CPU rehearsal on a tiny shape (bench/gpu_check.sh)

1. Model: Qwen2 with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
   intermediate 4864, vocab 151,936, tied embeddings), random weights, float32 parameters, the
   forward and backward under bf16 autocast (train.py --mixed_precision bf16). No download.
2. Paths: `fp32`, `tf32`, `bf16`: infra.logprobs.token_logprobs (imported) with --head_precision set so and
   --logp_chunk_mb unset (sized from free memory); `plain`: the model's full (B, T, V) logits,
   float32 log_softmax, gather. Loss: the sum of the response tokens' log-probs, backpropagated.
3. Figures: the median of `--reps` timed passes after one untimed; peak memory is
   torch.cuda.max_memory_allocated over the timed passes; TFLOP/s counts 6 x parameters x tokens
   (the usual estimate, attention's score FLOPs left out), the same count for every path, so the
   ratios are those of the times. Log-prob max abs difference is against the fp32 path.
"""
import argparse, json, statistics, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import infra.logprobs  # noqa: E402

p = argparse.ArgumentParser(description="log-prob path vs full logits on a 0.5B-shaped model",
                            allow_abbrev=False)
p.add_argument("--batch", type=int, default=8, help="sequences")
p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
p.add_argument("--response", type=int, default=1536, help="response tokens per sequence (the rest is prompt)")
p.add_argument("--reps", type=int, default=3, help="timed passes per path (median)")
p.add_argument("--small", action="store_true", help="tiny shape for a CPU rehearsal (2 layers, hidden 64, 2 x 64)")
p.add_argument("--out", default="", help="also write the JSON result here")
args = p.parse_args()


def model_and_inputs(device):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    shape = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936)
    if args.small:
        shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=128, vocab_size=1000)
        args.batch, args.seq, args.response = 2, 64, 48
    config = Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=max(args.seq, 2048),
                         use_cache=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
    attn = torch.ones_like(ids)
    resp = torch.zeros_like(ids)
    resp[:, args.seq - args.response:] = 1
    return model, ids, attn, resp


def plain(model, ids, attn, resp):
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()   # (B, T-1, V)
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)                       # (B, T-1)
    return logp * resp[:, 1:]


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, ids, attn, resp = model_and_inputs(device)
    n_params = sum(p.numel() for p in model.parameters())
    flops = 6 * n_params * ids.numel()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    paths = {hp: (lambda hp: lambda: infra.logprobs.token_logprobs(model, ids, attn, resp, None, hp)[0])(hp)
             for hp in ("fp32", "tf32", "bf16")}
    paths["plain"] = lambda: plain(model, ids, attn, resp)
    rows, ref = {}, None
    for name, fn in paths.items():
        if device == "cuda":   # what train.setup sets for the run from --head_precision (plain: the default)
            torch.backends.cuda.matmul.fp32_precision = "tf32" if name == "tf32" else "ieee"
        times = []
        for rep in range(args.reps + 1):                     # the first pass is untimed
            model.zero_grad(set_to_none=True)
            if rep == 1 and device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sync(); t = time.perf_counter()
            with torch.autocast(device, dtype=torch.bfloat16):
                lp = fn()
            lp.sum().backward()
            sync(); times.append(time.perf_counter() - t)
        lp = lp.detach().float()
        ref = lp if name == "fp32" else ref
        t = statistics.median(times[1:])
        rows[name] = dict(s=round(t, 4), tflops=round(flops / t / 1e12, 2),
                          peak_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1) if device == "cuda" else None,
                          max_abs_diff_vs_fp32=float((lp - ref).abs().max()))
        print(f"{name:<6} {t:8.3f} s  {rows[name]['tflops']:7.2f} TFLOP/s  peak {rows[name]['peak_gb']} GB  "
              f"max |logp - fp32| {rows[name]['max_abs_diff_vs_fp32']:.2e}", flush=True)
        del lp
        if device == "cuda":
            torch.cuda.empty_cache()
    line = json.dumps(dict(bench="gpu_logprob", device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                           shape=f"{args.batch}x{args.seq} ({args.response} response)", params=n_params,
                           torch=torch.__version__, rows=rows))
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
