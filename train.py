"""
GPPO training loop: rollout -> reward -> group advantages -> AdamW updates -> weight sync, repeated.

    python train.py                                          # the embedded CPU default (kl-atomic)
    python train.py --divergence tv --estimator mc           # GRPO's clip, any cell, any baseline
    accelerate launch --num_processes 8 train.py @configs/math_8gpu.args   # README "Scaling up"

How one iteration goes, and where it departs from textbook GRPO:
1. Sample `prompts_per_iter` prompts x `group_size` completions with vLLM (rollout.py) at
   temperature 1. Each rank samples its share of every mini-batch's prompts (whole groups), so
   the mini-batches are the same whatever the number of processes.
2. Score with reward.py (binary 0/1) and form GRPO's group-relative advantage
   (R - mean_group) / (std_group + 1e-6), broadcast to every token of the response.
3. The behaviour log-probs mu are recomputed once with the current weights before any update
   (`--mu_source recompute`, default: trainer and sampler numerics then agree exactly at the
   first update), or taken from vLLM (`--mu_source vllm`, one forward pass fewer).
4. `epochs` passes over the batch in mini-batches of `prompts_per_update` prompts, one AdamW step
   each (P/M x epochs steps; the paper: 128/16 x 1). Each step minimises the loss of gppo.py
   aggregated over the *whole* mini-batch (all micro-batches, all ranks), so micro-batching and
   the process count never change the update. The grid aggregates by token-mean (the paper), a
   baseline by its authors' default unless --agg says otherwise; --loss_kwargs sets any other
   keyword of the chosen loss. Every rank runs the same number of forward/backward passes
   (zero-weight fillers where it kept fewer samples), so DDP/FSDP's collectives always pair up:
   that bookkeeping lives in micro_batches() and gradient_sync(), beside update().
5. No KL penalty, no entropy bonus, constant learning rate, gradient clipping (paper settings).
   Two guards the paper does not use are on in the CPU default (README "The embedded default"),
   each for a failure measured there: `--target_kl` skips the iteration's remaining steps once a
   mini-batch has drifted further than target_kl from mu (the early stop of Schulman's PPO code,
   SB3 and CleanRL: the per-token region cannot bound how far *other* tokens move the shared
   weights in one iteration), and `--overlong punish` (DAPO's soft overlong punishment: the
   reward reads the last answer and ignores what follows, so EOS erodes without it).
6. Log-probs and entropy come from the last hidden states in chunks of at most `logp_chunk_mb` of
   float32 logits, each chunk's logits recomputed in the backward pass (one chunk lives at a time).
   The LM head's matmul runs at `--head_precision` (fp32 on the CPU, tf32 on CUDA), the
   log-softmax always in float32: trainer/sampler mismatch in the ratio starts at the head.
7. After the updates the new weights stream into the running vLLM engine in memory (rollout.py).
Everything is logged once per iteration (one line, metrics.jsonl), reduced over ranks.
"""
import argparse, json, logging, math, os, random, shutil, signal, sys, time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

import gppo
import reward

# ----------------------------------------------------------------------------------------------
# configuration: every knob is a flag; the defaults are the embedded CPU default


def parser():
    p = argparse.ArgumentParser(description="GPPO trainer", fromfile_prefix_chars="@")
    # @file presets (configs/*.args): one or more flags per line, '#' starts a comment line
    p.convert_arg_line_to_args = lambda line: [] if line.lstrip().startswith("#") else line.split()
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="data/tiny/model", help="Hugging Face model folder or hub name")
    g.add_argument("--train_data", default="tiny-math,tiny-code", help="comma-separated data set names (data/loaders.py)")
    g.add_argument("--eval_data", default="", help="held-out sets scored at the end, e.g. tiny-math,tiny-code")
    g.add_argument("--train_mix", default="balanced", choices=("balanced", "proportional"),
                   help="equal share of each data set per iteration, or in proportion to their sizes")
    g.add_argument("--data_dir", default=None, help="folder holding local copies of hub data sets")
    g.add_argument("--template", default="plain", help="prompt template (data/loaders.py TEMPLATES)")
    g.add_argument("--out_dir", default="", help="run folder (default out/<cell>-seed<seed>)")
    g = p.add_argument_group("objective (GPPO.md sections 4-6)")
    g.add_argument("--method", default=None, choices=(*gppo.METHODS, *gppo.BASELINES),
                   help="a method by name: a cell of gppo.METHODS (grpo = tv-mc, ...) or a baseline")
    g.add_argument("--objective", default="gppo", choices=("gppo", *gppo.BASELINES), help="the grid, or a baseline")
    g.add_argument("--divergence", default="kl", choices=tuple(gppo.DIVERGENCES), help="f of the region")
    g.add_argument("--estimator", default="atomic", choices=tuple(gppo.ESTIMATORS), help="D(r) of the region")
    g.add_argument("--delta", type=float, default=None, help="region size; default calibrates mc's lower bound to 0.8")
    g.add_argument("--ratio_bounds", default="0.5,10", help="'low,high' bounds intersected with the region, or 'none'")
    g.add_argument("--dual_clip", default="10", help="no gradient for A<0 tokens with ratio above this, or 'none'")
    g.add_argument("--agg", default=None, choices=gppo.AGGS,
                   help="loss aggregation (default: token-mean for the grid, each baseline's own otherwise)")
    g.add_argument("--loss_kwargs", default="", help="any other keyword of the chosen loss in gppo.py, "
                   "'k=v,k=v' (e.g. --method gspo --loss_kwargs eps_low=3e-4,eps_high=4e-4)")
    g = p.add_argument_group("rollout")
    g.add_argument("--backend", default="vllm", choices=("vllm", "hf"),
                   help="vllm (fast), or transformers.generate on the policy's own weights (no vLLM needed)")
    g.add_argument("--prompts_per_iter", type=int, default=64, help="P: prompts sampled per iteration (all ranks)")
    g.add_argument("--group_size", type=int, default=8, help="G: completions per prompt")
    g.add_argument("--max_new_tokens", type=int, default=48, help="max response length, tokens")
    g.add_argument("--max_model_len", type=int, default=256, help="vLLM context length (prompt + response), tokens")
    g.add_argument("--mu_source", default="recompute", choices=("recompute", "vllm"), help="where mu comes from")
    g.add_argument("--vllm_dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="vLLM's dtype; auto: bfloat16 on GPU, the trainer's float32 on the CPU")
    g.add_argument("--gpu_memory_utilization", type=float, default=0.4, help="vLLM share of GPU memory")
    g.add_argument("--tensor_parallel_size", type=int, default=1, help="vLLM tensor parallel size")
    g.add_argument("--sleep_mode", action="store_true", help="free vLLM's KV cache while training (GPU)")
    g.add_argument("--sync_bucket_mb", type=int, default=256, help="weight sync into vLLM in buckets of this size")
    g = p.add_argument_group("optimisation")
    g.add_argument("--iters", type=int, default=60, help="RL iterations")
    g.add_argument("--prompts_per_update", type=int, default=8, help="M: prompts per mini-batch (one AdamW step)")
    g.add_argument("--epochs", type=int, default=1, help="passes over each iteration's batch")
    g.add_argument("--micro_batch_size", type=int, default=64, help="sequences per forward/backward")
    g.add_argument("--lr", type=float, default=1.5e-4, help="AdamW learning rate (constant; README: why 1.5e-4)")
    g.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=float, default=1.0, help="max global gradient norm")
    g.add_argument("--target_kl", type=float, default=0.05, help="skip the iteration's remaining steps once a "
                   "mini-batch's k3 KL(mu || pi) per token exceeds this; 0 = off (the paper)")
    g.add_argument("--logp_chunk_mb", type=int, default=None,
                   help="float32 logits per log-softmax chunk, MB (default: 1/32 of free GPU memory, 256 on the CPU)")
    g.add_argument("--head_precision", default=None, choices=("fp32", "tf32", "bf16"),
                   help="LM head matmul of the log-probs; log-softmax always fp32 (default: tf32 on CUDA, fp32 on CPU)")
    g.add_argument("--mixed_precision", default=None, choices=("no", "bf16", "fp16"),
                   help="autocast of the policy's forward/backward (default: accelerate's config, else no)")
    g = p.add_argument_group("options of mature trainers (the paper uses none; the CPU default uses --overlong punish)")
    g.add_argument("--overlong", default="punish", choices=("off", "mask", "punish"),
                   help="truncated responses: kept (the paper), no loss, or DAPO's soft punishment")
    g.add_argument("--overlong_buffer", type=int, default=4, help="punish: reward - (excess over max_new_tokens - buffer) / buffer")
    g.add_argument("--drop_uniform_groups", action="store_true", help="DAPO dynamic sampling without the refill: drop groups whose rewards are all equal")
    g.add_argument("--tis_cap", type=float, default=None, help="truncated IS: weight tokens by min(pi_old / mu_vllm, cap)")
    g.add_argument("--kl_coef", type=float, default=0.0, help="KL penalty to a frozen reference (k3 estimator); 0 = off")
    g.add_argument("--ref_model", default="", help="reference model for --kl_coef (default: --model)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--ckpt_every", type=int, default=20, help="save a resumable checkpoint every N iterations (and at exit); 0 = only at exit")
    g.add_argument("--keep_last", type=int, default=2, help="checkpoints kept (older ones deleted)")
    g.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from out_dir's latest complete checkpoint, or from the checkpoint folder given")
    g.add_argument("--resume_with_changes", action="store_true", help="let --resume continue with other run flags")
    g.add_argument("--save_rollouts", default="", help="debug: write every iteration's rollouts to this folder")
    g.add_argument("--replay_rollouts", default="", help="debug: train on the rollouts a --save_rollouts run wrote (any process count)")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0, help="seed for data order, sampling and init")
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    g.add_argument("--sample_every", type=int, default=10, help="print a few completions every N iterations")
    g.add_argument("--eval_k", type=int, default=8, help="k of avg@k for --eval_data")
    g.add_argument("--eval_before", action="store_true", help="also score the start model (eval_start.json)")
    g.add_argument("--eval_every", type=int, default=0, help="also score --eval_data every N iterations, into "
                   "that iteration's metrics row (eval_avg@k) and eval_iter_N.json; 0 = only at the end")
    g.add_argument("--wandb", default="", help="wandb project name (off when empty)")
    return p


# flags that do not change what a run computes: --resume may continue with other values
RUN_NEUTRAL = {"iters", "eval_data", "eval_k", "eval_before", "out_dir", "ckpt_every", "keep_last", "resume",
               "resume_with_changes", "save_rollouts", "threads", "sample_every", "wandb"}


def parse_args(argv=None):
    """Flags -> args, with every derived size and value checked before anything is loaded."""
    args = parser().parse_args(argv)
    if args.method in gppo.METHODS:          # one name per thing: run.sh and the sweep map names here
        args.objective, (args.divergence, args.estimator) = "gppo", gppo.METHODS[args.method]
    elif args.method:
        args.objective = args.method

    def bad(flag, accepted):
        raise ValueError(f"--{flag}={getattr(args, flag)!r}; accepted: {accepted}")

    for flag in ("prompts_per_iter", "prompts_per_update", "max_new_tokens", "iters", "epochs",
                 "micro_batch_size", "keep_last", "overlong_buffer", "sync_bucket_mb"):
        if getattr(args, flag) < 1:
            bad(flag, "an integer >= 1")
    if args.logp_chunk_mb is not None and args.logp_chunk_mb < 1:
        bad("logp_chunk_mb", "an integer >= 1, or unset (sized from free GPU memory)")
    if args.group_size < 2:
        bad("group_size", "2 or more (group-relative advantages need a group)")
    if args.prompts_per_iter % args.prompts_per_update:
        bad("prompts_per_iter", f"a multiple of --prompts_per_update={args.prompts_per_update}")
    if args.max_new_tokens >= args.max_model_len:
        bad("max_new_tokens", f"fewer tokens than --max_model_len={args.max_model_len} (the prompt needs room)")
    if args.overlong_buffer >= args.max_new_tokens:
        bad("overlong_buffer", f"fewer tokens than --max_new_tokens={args.max_new_tokens}")
    if args.ckpt_every < 0 or args.eval_every < 0:
        bad("ckpt_every" if args.ckpt_every < 0 else "eval_every", "an integer >= 0")
    if args.tis_cap is not None and args.tis_cap <= 0:
        bad("tis_cap", "a positive number")
    if args.tis_cap is not None and args.mu_source == "vllm":   # mu would already be vLLM's: corrected twice
        bad("tis_cap", "unset with --mu_source vllm (TIS reweights from vLLM's mu to the trainer's)")
    if args.kl_coef < 0 or args.target_kl < 0:
        bad("kl_coef" if args.kl_coef < 0 else "target_kl", "a number >= 0")
    args.ratio_bounds = None if args.ratio_bounds == "none" else tuple(float(x) for x in args.ratio_bounds.split(","))
    args.dual_clip = None if args.dual_clip == "none" else float(args.dual_clip)
    args.agg, args.loss_kwargs = loss_settings(args)
    if args.objective == "gppo":   # fails fast on a bad delta or bounds
        gppo.check_config(args.divergence, args.estimator, args.delta, args.ratio_bounds, args.dual_clip, args.agg)
    args.cell = f"{args.divergence}-{args.estimator}" if args.objective == "gppo" else args.objective
    args.out_dir = args.out_dir or os.path.join("out", f"{args.cell}-seed{args.seed}")
    return args


def loss_settings(args):
    """(agg, loss_kwargs) of the chosen loss: --agg or the loss's own default aggregation (a baseline
    trains as its authors define it), and --loss_kwargs parsed and checked against the loss's
    signature, then tried once on a tiny batch so a bad value fails here, not mid-run."""
    import ast, inspect, re
    fn = gppo.gppo_loss if args.objective == "gppo" else gppo.BASELINES[args.objective]
    params = inspect.signature(fn).parameters
    agg = args.agg or params["agg"].default
    flagged = {"delta": "--delta", "ratio_bounds": "--ratio_bounds", "dual_clip": "--dual_clip", "agg": "--agg"}
    fixed = {"logp", "old_logp", "advantages", "mask", "divergence", "estimator", "global_count", "generator",
             "detach"} | (set(flagged) if args.objective == "gppo" else {"agg"})
    settable = [k for k in params if k not in fixed]
    kwargs = {}
    for item in filter(None, re.split(r",(?=\s*\w+\s*=)", args.loss_kwargs)):   # commas inside a tuple stay
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or key not in settable:
            hint = f" (it has its own flag, {flagged[key]})" if key in flagged else ""
            raise ValueError(f"--loss_kwargs: {item!r}{hint}; accepted keys of {fn.__name__}: "
                             f"{', '.join(settable) or 'none'}, as key=value")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"--loss_kwargs: {key}={value!r} is not a Python literal (number, None, tuple)") from None
    try:   # a bad value (a negative delta, an eps of the wrong type) raises here
        one = torch.zeros(1, 2)
        kw = {"divergence": args.divergence, "estimator": args.estimator} if args.objective == "gppo" else {}
        fn(one, one, torch.ones(1), torch.ones(1, 2, dtype=torch.bool), agg=agg, **kw, **kwargs)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--loss_kwargs={args.loss_kwargs!r} for {fn.__name__}: {e}") from None
    return agg, kwargs


# ----------------------------------------------------------------------------------------------
# log-probs and entropy from the last hidden states, in chunks (choice 6)

def _chunk_logp_entropy(hidden, head, targets, precision=None):
    """The LM head and log-softmax of one chunk. precision (--head_precision): bf16 multiplies bf16
    inputs (float32 accumulate); fp32 and tf32 multiply float32 inputs, on TF32 tensor cores when
    setup() allowed them for the run (tf32 on CUDA). The log-softmax is float32 whatever the choice
    (README "Head precision")."""
    with torch.autocast(hidden.device.type, enabled=False):              # the head as chosen, even under bf16
        if precision == "bf16":
            logits = (hidden.bfloat16() @ head.bfloat16().t()).float()    # (n, V)
        else:
            logits = hidden.float() @ head.float().t()
        logp_all = logits.log_softmax(-1)
        logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)    # (n,)
        entropy = -(logp_all.exp() * logp_all).sum(-1)                   # (n,)
    return logp, entropy.detach()


def token_logprobs(model, ids, attn, resp_mask, chunk_mb=None, head_precision=None):
    """Log-prob of each next token and the policy's entropy there. ids: (B, T) -> (B, T-1) x 2.

    The forward goes through the (DDP/FSDP-)wrapped model, so its gradient hooks run, but asks for
    the logits of one position only; the decoder's output (the normed last hidden states) is taken
    with a forward hook, and the logits of the response tokens are made here chunk by chunk.
    chunk_mb: MB of float32 logits per chunk; None: 1/32 of the GPU's free memory on CUDA (at least
    256), 256 on the CPU. head_precision: see _chunk_logp_entropy."""
    from accelerate.utils import extract_model_from_parallel
    inner, seen = extract_model_from_parallel(model), {}
    hook = inner.get_decoder().register_forward_hook(lambda m, i, out: seen.update(h=out[0]))
    try:
        model(input_ids=ids, attention_mask=attn, logits_to_keep=1, use_cache=False)
    finally:
        hook.remove()
    head = inner.get_output_embeddings().weight                             # (V, H)
    head = head.full_tensor() if hasattr(head, "full_tensor") else head    # FSDP2 shard -> whole (differentiable)
    targets, where = ids[:, 1:], resp_mask[:, 1:].bool()                   # position t predicts t+1
    h, y = seen["h"][:, :-1][where], targets[where]                         # (N, H), (N,)
    if chunk_mb is None:   # on GPUs larger chunks run the head at matmul speed (README "Head precision")
        chunk_mb = max(256, (torch.cuda.mem_get_info(ids.device)[0] >> 20) // 32) if ids.is_cuda else 256
    rows = max(1, (chunk_mb << 20) // (4 * head.shape[0]))                # tokens per chunk of fp32 logits
    fn, hp = _chunk_logp_entropy, head_precision
    parts = [checkpoint(fn, h[s:s + rows], head, y[s:s + rows], hp, use_reentrant=False) if torch.is_grad_enabled()
             else fn(h[s:s + rows], head, y[s:s + rows], hp) for s in range(0, len(y), rows)]
    logp = torch.zeros(targets.shape, dtype=torch.float32, device=ids.device)
    ent = torch.zeros(targets.shape, dtype=torch.float32, device=ids.device)
    if parts:
        logp = logp.masked_scatter(where, torch.cat([a for a, _ in parts]))
        ent = ent.masked_scatter(where, torch.cat([b for _, b in parts]))
    return logp, ent


def collate(batch, idx, pad_id, device, per_token=()):
    """Right-padded prompt+completion ids of samples `idx`, their completion mask, and each of
    `per_token` (lists of completion-length values per sample) laid out like the log-probs:
    position t holds the value for predicting token t+1. (B, T), (B, T), (B, T), then (B, T-1) each."""
    seqs = [batch.prompt_ids[i] + batch.completion_ids[i] for i in idx]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
    attn, resp = torch.zeros((len(idx), T), dtype=torch.long), torch.zeros((len(idx), T), dtype=torch.long)
    values = [torch.zeros((len(idx), T - 1)) for _ in per_token]
    for j, i in enumerate(idx):
        n_p, n = len(batch.prompt_ids[i]), len(seqs[j])
        ids[j, :n], attn[j, :n], resp[j, n_p:n] = torch.tensor(seqs[j]), 1, 1
        for v, src in zip(values, per_token):
            v[j, n_p - 1:n - 1] = torch.as_tensor(src[i], dtype=torch.float32)
    return [t.to(device) for t in (ids, attn, resp, *values)]


# ----------------------------------------------------------------------------------------------
# rewards and advantages

def advantages(args, rewards, batch):
    """Phase 2 after scoring: (shaped rewards, advantages, kept samples), each (P*G,). Shaped: the
    reward less DAPO's overlong penalty under --overlong punish; advantages: GRPO's group-relative
    (R - mean_group) / (std_group + 1e-6) of the shaped rewards."""
    shaped = rewards
    if args.overlong == "punish":
        shaped = rewards - torch.tensor(reward.overlong_penalty(
            [len(c) for c in batch.completion_ids], args.max_new_tokens, args.overlong_buffer))
    return shaped, gppo.group_advantages(shaped, args.group_size), kept_samples(args, shaped, batch)


def kept_samples(args, shaped, batch):
    """Samples that take part in the updates: --drop_uniform_groups removes whole groups whose
    rewards are all equal (zero advantage, DAPO's dynamic sampling); --overlong mask removes
    truncated responses (they neither push nor pull)."""
    keep = torch.ones(len(shaped), dtype=torch.bool)
    if args.drop_uniform_groups:
        r = shaped.view(-1, args.group_size)
        keep &= (r.max(1).values > r.min(1).values).repeat_interleave(args.group_size)
    if args.overlong == "mask":
        keep &= ~torch.tensor(batch.truncated, dtype=torch.bool)
    return keep


# ----------------------------------------------------------------------------------------------
# the updates (choices 4-5)

def minibatches(args, it, world):
    """The iteration's mini-batches as lists of prompt positions (0..P-1), the same for every
    process count, and `mine(rank)`: the positions a rank samples, its share of every mini-batch."""
    P, M = args.prompts_per_iter, args.prompts_per_update
    perm = random.Random(args.seed * 7919 + it).sample(range(P), P)
    batches = [perm[u * M:(u + 1) * M] for u in range(P // M)]
    share = M // world
    return batches, lambda rank: sorted(p for b in batches for p in b[rank * share:(rank + 1) * share])


def minibatch_order(args, it, epoch, n):
    """The first epoch takes the n mini-batches in order; later epochs reshuffle them (seeded)."""
    return list(range(n)) if epoch == 0 else random.Random(args.seed * 7919 + it * 131 + epoch).sample(range(n), n)


def policy_loss(args, lp, old_lp, adv, mask, count, **extra):
    """The chosen objective of gppo.py with its flags and --loss_kwargs."""
    if args.objective == "gppo":
        return gppo.gppo_loss(lp, old_lp, adv, mask, args.divergence, args.estimator, delta=args.delta,
                              ratio_bounds=args.ratio_bounds, dual_clip=args.dual_clip, agg=args.agg,
                              global_count=count, **args.loss_kwargs)
    return gppo.BASELINES[args.objective](lp, old_lp, adv, mask, agg=args.agg, global_count=count,
                                          **args.loss_kwargs, **extra)


# -- the multi-process bookkeeping of update(), fenced here (choice 4) --

def micro_batches(args, acc, batch, samples):
    """This rank's samples of one mini-batch as micro-batches, padded with None (a zero-weight filler
    pass) up to the most micro-batches any rank has, so every rank runs the same forward/backward
    passes and DDP/FSDP's collectives pair up; and the loss denominator of the whole mini-batch over
    all ranks (tokens for token-mean, sequences otherwise). One collective for both."""
    chunks = [samples[s:s + args.micro_batch_size] for s in range(0, len(samples), args.micro_batch_size)]
    tokens = [len(batch.completion_ids[i]) for i in samples]
    local_count = sum(tokens) if args.agg == "token-mean" else sum(t > 0 for t in tokens)
    sizes = acc.gather(torch.tensor([[float(local_count), float(len(chunks))]], device=acc.device))
    n_passes = int(sizes[:, 1].max().item())
    return chunks + [None] * (n_passes - len(chunks)), sizes[:, 0].sum().item()


def gradient_sync(acc, model, last):
    """DDP all-reduces gradients at every backward unless told not to: only at the step's last pass.
    FSDP reduce-scatters at every pass on purpose: deferring it would keep whole unsharded gradients
    between passes (~33 GB per GPU at 8B in fp32), the memory sharding exists to save."""
    ddp = acc.distributed_type.name in ("MULTI_CPU", "MULTI_GPU")
    return acc.no_sync(model) if ddp and not last else nullcontext()


def reference_kl(args, ref_model, ids, attn, resp, lp, mask, count):
    """--kl_coef: the k3 estimate of KL(pi || ref) per token, aggregated like the policy loss; returns
    (penalty to add to the loss, summed KL over the tokens for the log)."""
    with torch.no_grad():
        ref_lp, _ = token_logprobs(ref_model, ids, attn, resp, args.logp_chunk_mb, args.head_precision)
    d = ref_lp - lp
    kl = d.exp() - d - 1
    return args.kl_coef * gppo.aggregate(kl, mask.bool(), args.agg, count), (kl.detach() * mask).sum().item()


class UpdateLog:
    """What update() measures, as token-weighted sums over its passes (log_row turns them into means)."""

    def __init__(self):
        self.sums = {k: 0.0 for k in gppo.STATS + ("entropy", "kl_ref", "n_tok")}
        self.tok_b, self.clip_b = [0.0] * gppo.MU_BUCKETS, [0.0] * gppo.MU_BUCKETS   # tokens and clipped tokens per mu bucket
        self.norms, self.kls = [], []                     # per step: gradient norm, KL(mu || pi) before it
        self.gap = [0.0, 0]                               # |trainer - vLLM| log-prob sum and count (mu_source vllm)
        self.step = [0.0, 0.0]                            # this step's k3 KL sum and token count

    def add(self, st, lp, old_lp, ent, mask, kl_ref=0.0, measure_gap=False):
        w = mask.sum().item()
        for k in gppo.STATS:
            self.sums[k] = max(self.sums[k], st[k]) if k == "ratio_max" else self.sums[k] + st[k] * w
        for b in range(gppo.MU_BUCKETS):
            self.tok_b[b] += st["token_frac_by_mu"][b] * w
            self.clip_b[b] += st["clip_frac_by_mu"][b] * st["token_frac_by_mu"][b] * w
        self.sums["entropy"] += (ent * mask).sum().item()
        self.sums["kl_ref"] += kl_ref
        self.sums["n_tok"] += w
        self.step = [self.step[0] + st["kl_k3"] * w, self.step[1] + w]
        if measure_gap and not self.norms:   # mu_source vllm, no step taken yet: pi is the sampler's weights
            self.gap = [self.gap[0] + ((lp - old_lp).abs() * mask).sum().item(), self.gap[1] + w]

    def step_kl(self, acc):
        """The mini-batch's KL(mu || pi) per token over all ranks (what --target_kl compares)."""
        s = acc.reduce(torch.tensor(self.step, dtype=torch.float64, device=acc.device), "sum")
        self.step = [0.0, 0.0]
        self.kls.append((s[0] / s[1].clamp(min=1)).item())
        return self.kls[-1]


def update(args, acc, model, opt, ref_model, batch, old, tis, adv, keep, batches, local, it, pad_id):
    """`epochs` passes over the mini-batches, one AdamW step each (choices 4-5). Returns an UpdateLog."""
    G, dev = args.group_size, acc.device
    where = {pos: k for k, pos in enumerate(local)}            # prompt position -> index in this rank's batch
    share = args.prompts_per_update // acc.num_processes
    log = UpdateLog()
    for epoch in range(args.epochs):
        for u in minibatch_order(args, it, epoch, len(batches)):
            mine = [where[p] for p in batches[u][acc.process_index * share:(acc.process_index + 1) * share]]
            samples = [q * G + j for q in mine for j in range(G) if keep[q * G + j]]
            passes, count = micro_batches(args, acc, batch, samples)
            if count == 0:          # every sample of this mini-batch dropped, on every rank
                continue
            detach = clip_cov_selection(args, acc, model, batch, passes, old, adv, it, u, pad_id) \
                if args.objective == "clip_cov" else [None] * len(passes)
            for c, idx in enumerate(passes):
                ids, attn, resp, old_lp, w_tis = collate(batch, idx or [0], pad_id, dev, (old, tis))
                mask = resp[:, 1:].float() * (idx is not None)  # a filler pass has zero weight
                a = adv[idx or [0]].to(dev)
                if args.tis_cap:    # truncated IS: a positive per-token weight on A is TIS's weight on the loss
                    a = a[:, None] * w_tis
                with gradient_sync(acc, model, last=c == len(passes) - 1):
                    lp, ent = token_logprobs(model, ids, attn, resp, args.logp_chunk_mb, args.head_precision)
                    # DDP averages gradients over ranks: count / world keeps the whole mini-batch's mean
                    loss, st = policy_loss(args, lp, old_lp, a, mask, count / acc.num_processes,
                                           **({} if detach[c] is None else {"detach": detach[c]}))
                    kl_ref = 0.0
                    if ref_model is not None:
                        penalty, kl_ref = reference_kl(args, ref_model, ids, attn, resp, lp, mask,
                                                       count / acc.num_processes)
                        loss = loss + penalty
                    acc.backward(loss)
                if idx is not None:
                    log.add(st, lp.detach(), old_lp, ent, mask, kl_ref, measure_gap=args.mu_source == "vllm")
            kl = log.step_kl(acc)
            if args.target_kl and kl > args.target_kl:   # choice 5: drifted too far, skip the rest
                opt.zero_grad(set_to_none=True)
                return log
            log.norms.append(float(acc.clip_grad_norm_(model.parameters(), args.grad_clip)))
            opt.step()
            opt.zero_grad(set_to_none=True)
    return log


def clip_cov_selection(args, acc, model, batch, passes, old, adv, it, u, pad_id):
    """Clip-Cov's covariance rule over the whole mini-batch (all micro-batches and ranks), so that
    micro-batching does not change it: a no-grad pass gives the centre (mean log-prob and advantage)
    and the candidates (gppo.clip_cov_candidates); k = max(1, clip_ratio x N) of all candidates are
    drawn by a generator seeded alike on every rank. Returns a (B, T-1) bool per pass."""
    import inspect
    defaults = {k: p.default for k, p in inspect.signature(gppo.clip_cov_loss).parameters.items()}
    kw = {k: args.loss_kwargs.get(k, defaults[k]) for k in ("eps", "cov_low", "cov_high", "clip_ratio")}
    parts = []                                     # per pass: log-prob, mu, advantage, valid
    with torch.no_grad():
        for idx in passes:                         # as many forwards as the training pass: collectives pair up
            ids, attn, resp, old_lp = collate(batch, idx or [0], pad_id, acc.device, (old,))
            lp, _ = token_logprobs(model, ids, attn, resp, args.logp_chunk_mb, args.head_precision)
            a = adv[idx or [0]].to(lp.device)[:, None].expand_as(lp)
            parts.append((lp, old_lp, a, resp[:, 1:].bool() & (idx is not None)))
    tot = sum(torch.stack([torch.where(m, lp, 0).sum(), torch.where(m, a, 0).sum(), m.sum()]).double()
              for lp, _, a, m in parts)
    s_lp, s_a, n = acc.reduce(tot, "sum").tolist()
    center = (s_lp / max(n, 1), s_a / max(n, 1))
    cands = [gppo.clip_cov_candidates(lp, o, a, m, center, kw["eps"], kw["cov_low"], kw["cov_high"]) & m
             for lp, o, a, m in parts]
    flat = torch.cat([c.flatten() for c in cands]).cpu()                 # this rank's candidates, in order
    counts = acc.gather(flat.sum().view(1).to(acc.device)).tolist()      # every rank's number of them
    drawn = torch.zeros(sum(counts), dtype=torch.bool)
    k = min(max(1, int(kw["clip_ratio"] * n)), sum(counts))
    seed = args.seed * 1_000_003 + it * 1009 + u
    drawn[torch.randperm(sum(counts), generator=torch.Generator().manual_seed(seed))[:k]] = True
    rank = acc.process_index
    detach = torch.zeros_like(flat)
    detach[flat.nonzero().squeeze(1)[drawn[sum(counts[:rank]):sum(counts[:rank + 1])]]] = True
    return [d.view_as(c).to(c.device) for d, c in zip(detach.split([c.numel() for c in cands]), cands)]


# ----------------------------------------------------------------------------------------------
# logging: every rank's sums in one gather

def log_row(args, acc, it, batch, rows, rewards, shaped, keep, gap, upd, sources, times):
    """The iteration's metrics row (README "What each metric means"): every rank's sums, named, in
    one gather (ratio_max: the largest of any rank)."""
    stats, tok_b, clip_b, norms, kls = upd.sums, upd.tok_b, upd.clip_b, upd.norms, upd.kls
    groups, sg, src = rewards.view(-1, args.group_size), shaped.view(-1, args.group_size), \
        [rows[i // args.group_size]["source"] for i in range(len(rewards))]
    local = {"n": len(rewards), "reward": rewards.sum(), "reward2": (rewards ** 2).sum(),
             "len": sum(map(len, batch.completion_ids)), "truncated": sum(batch.truncated), "kept": keep.sum(),
             "penalty": (rewards - shaped).sum(), "groups": len(groups), "solved": (groups.max(1).values > 0).sum(),
             "uniform": (sg.max(1).values == sg.min(1).values).sum(), "gap": gap[0], "gap_n": gap[1],
             **{f"r:{x}": sum(r for r, y in zip(rewards.tolist(), src) if y == x) for x in sources},
             **{f"n:{x}": src.count(x) for x in sources}, **{k: v for k, v in stats.items() if k != "ratio_max"},
             **{f"tok{b}": tok_b[b] for b in range(gppo.MU_BUCKETS)},
             **{f"clip{b}": clip_b[b] for b in range(gppo.MU_BUCKETS)}}
    every = acc.gather(torch.tensor([[float(v) for v in local.values()] + [stats["ratio_max"]]],
                                    dtype=torch.float64, device=acc.device)).cpu()
    s = dict(zip(local, every[:, :-1].sum(0).tolist()))
    N, n_tok = s["n"], max(s["n_tok"], 1.0)
    row = dict(iter=it, reward_mean=s["reward"] / N,
               reward_std=math.sqrt(max(0.0, (s["reward2"] - s["reward"] ** 2 / N) / max(N - 1, 1))),
               reward_by_source={x: s[f"r:{x}"] / max(s[f"n:{x}"], 1) for x in sources},
               solve_rate=s["solved"] / s["groups"], response_len=s["len"] / N, truncated_frac=s["truncated"] / N,
               kept_frac=s["kept"] / N, overlong_penalty=s["penalty"] / N, uniform_group_frac=s["uniform"] / s["groups"],
               lr=args.lr, logp_gap_vllm=s["gap"] / max(s["gap_n"], 1),
               **{k: s[k] / n_tok for k in stats if k not in ("ratio_max", "n_tok")}, ratio_max=every[:, -1].max().item(),
               token_frac_by_mu=[s[f"tok{b}"] / n_tok for b in range(gppo.MU_BUCKETS)],
               clip_frac_by_mu=[s[f"clip{b}"] / max(s[f"tok{b}"], 1.0) for b in range(gppo.MU_BUCKETS)],
               kl_k3_max=max(kls, default=0.0), updates=len(norms), grad_norm=float(np.mean(norms)) if norms else 0.0,
               **times)
    row["tokens_per_s"] = s["len"] / row["time_iter_s"]
    return row


# ----------------------------------------------------------------------------------------------
# checkpoints: accelerate's save_state (model, optimizer, every rank's RNG, the prompt sampler),
# written to iter_N.tmp and renamed: a crash never leaves a half-written folder under a final name

def checkpoints(ckpt_dir):
    """Complete checkpoints, oldest first (a '.tmp' folder is an interrupted write: ignored)."""
    names = sorted(n for n in os.listdir(ckpt_dir) if n.startswith("iter_") and not n.endswith(".tmp")) \
        if os.path.isdir(ckpt_dir) else []
    return [os.path.join(ckpt_dir, n) for n in names]


def _not_tied_weights_notice(record):
    """save_state stores tied weights once (lm_head.weight is embed_tokens) and warns "Removed shared
    tensor ... while saving" at every checkpoint; load_state ties them again (resume is tested to be
    bitwise), so the warning says nothing here and is dropped."""
    return "Removed shared tensor" not in record.getMessage()


def save_checkpoint(args, acc, ckpt_dir, it):
    logging.getLogger("accelerate.utils.other").addFilter(_not_tied_weights_notice)   # skipped if already there
    path = os.path.join(ckpt_dir, f"iter_{it:06d}")
    if acc.is_main_process:
        shutil.rmtree(path + ".tmp", ignore_errors=True)
    acc.wait_for_everyone()
    acc.save_state(path + ".tmp")
    acc.wait_for_everyone()                          # every rank's files (its RNG state, shards) are written
    if acc.is_main_process:
        with open(os.path.join(path + ".tmp", "trainer_state.json"), "w") as f:
            json.dump({"iter": it, "args": {k: v for k, v in vars(args).items() if k != "cell"}}, f)
            f.flush(); os.fsync(f.fileno())
        os.replace(path + ".tmp", path)              # the commit point
        for stale in checkpoints(ckpt_dir)[:-args.keep_last]:
            shutil.rmtree(stale, ignore_errors=True)
    acc.wait_for_everyone()


def load_checkpoint(args, acc, ckpt_dir):
    """--resume: restore the latest (or the given) checkpoint; returns the iteration it followed.
    Flags that change the run must match the checkpoint's unless --resume_with_changes."""
    path = args.resume
    if path == "latest":
        if not checkpoints(ckpt_dir):
            raise FileNotFoundError(f"--resume: no complete checkpoint in {ckpt_dir}")
        path = checkpoints(ckpt_dir)[-1]
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise FileNotFoundError(f"--resume={path!r} is not a complete checkpoint folder "
                                f"(no trainer_state.json); complete ones: {checkpoints(ckpt_dir)}")
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    now = json.loads(json.dumps({k: v for k, v in vars(args).items() if k != "cell"}))   # tuples as lists
    changed = {k: (v, now.get(k)) for k, v in state["args"].items() if k not in RUN_NEUTRAL and now.get(k) != v}
    if changed and not args.resume_with_changes:
        raise ValueError(f"--resume: {path} was made with other flags: "
                         + ", ".join(f"--{k} {a!r} (now {b!r})" for k, (a, b) in changed.items())
                         + "; pass --resume_with_changes to continue anyway")
    acc.load_state(path)
    return path, state["iter"]


class StopRequest:
    """Ctrl-C / SIGTERM (torchrun sends it to every worker, then SIGKILL 30 s later): finish the
    running iteration, checkpoint, exit 130. A second signal kills at once. The handler only sets
    a flag and writes with os.write: print() inside a signal handler can raise on reentry."""

    def __init__(self, master):
        self.requested, self.master = False, master
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True
        if self.master:
            os.write(2, f"\n{signal.Signals(signum).name}: stopping after this iteration (again to abort)\n".encode())
        signal.signal(signal.SIGINT, signal.SIG_DFL); signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ----------------------------------------------------------------------------------------------
# the loop

def behaviour_logprobs(args, model, batch, pad_id, device):
    """Phase 3: mu per sample, (len_i,) each: the trainer's log-probs under the weights that
    sampled (recompute), or vLLM's own (no forward pass). Also the truncated-IS weights and the
    summed |trainer - vLLM| log-prob gap over tokens (with mu_source vllm, update() measures it)."""
    n = len(batch.texts)
    if args.mu_source == "vllm":   # no TIS (refused with it): weight 1 on every token
        old = [torch.tensor(lp) for lp in batch.logprobs]
        return old, [torch.ones_like(o) for o in old], [0.0, 0]
    old, tis, gap = [None] * n, [None] * n, [0.0, 0]
    with torch.no_grad():
        for s in range(0, n, args.micro_batch_size):
            idx = list(range(s, min(s + args.micro_batch_size, n)))
            ids, attn, resp, vllm_lp = collate(batch, idx, pad_id, device, (batch.logprobs,))
            lp, _ = token_logprobs(model, ids, attn, resp, args.logp_chunk_mb, args.head_precision)
            m = resp[:, 1:].bool()
            gap[0] += (lp - vllm_lp).abs()[m].sum().item()
            gap[1] += m.sum().item()
            # truncated IS: the samples came from vLLM's mu_vllm, not from the trainer's pi_old;
            # weight each token by min(pi_old / mu_vllm, cap) (Yao et al., 2025)
            w = (lp - vllm_lp).exp().clamp(max=args.tis_cap) if args.tis_cap else torch.ones_like(lp)
            for j, i in enumerate(idx):
                old[i], tis[i] = lp[j][m[j]].cpu(), w[j][m[j]].cpu()
    return old, tis, gap


def fsdp_on_the_cpu(acc):
    """An FSDP launch config on the CPU (configs/accelerate_fsdp_cpu.yaml) really shards. accelerate 1.16
    makes a launch FSDP only on accelerators and silently trains plain data parallel on the CPU
    (state.py skips MULTI_CPU; the checkpoints come out unsharded), though torch's fully_shard runs
    over gloo. So the FSDP path is switched on by hand, as accelerate itself would on a GPU: the
    shared state's distributed type (read by prepare, save_state, load_state) and the plugin, built
    from the launch's FSDP_* variables."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    if acc.distributed_type != DistributedType.MULTI_CPU or os.environ.get("ACCELERATE_USE_FSDP", "").lower() != "true":
        return
    PartialState._shared_state["distributed_type"] = acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    if acc.mixed_precision != "no":
        acc.state.fsdp_plugin.set_mixed_precision(acc.mixed_precision)


def setup(args):
    """Accelerator, data (checked first: a bad row fails before any model loads), policy and
    optimizer, reference model, rollout engine. Returns them in one namespace."""
    from types import SimpleNamespace
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.logging import disable_progress_bar
    disable_progress_bar()   # transformers' "Loading weights" / "Writing model shards" bars, at every load and save
    from data.loaders import PromptSampler
    from eval import load_rows
    from rollout import make_engine
    acc = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=args.mixed_precision)
    fsdp_on_the_cpu(acc)
    if torch.cuda.is_available():
        # --head_precision tf32 (the CUDA default): float32 matmuls run on TF32 tensor cores for the
        # whole run. Under bf16 autocast (the GPU presets) the LM head of the log-probs is the only
        # float32 matmul, so it is the one this speeds up; fp32 keeps IEEE float32 everywhere.
        args.head_precision = args.head_precision or "tf32"
        torch.backends.cuda.matmul.fp32_precision = "tf32" if args.head_precision == "tf32" else "ieee"
    rank, world = acc.process_index, acc.num_processes
    if args.tensor_parallel_size > 1 and world > 1:   # each rank samples its own prompts with its own engine
        raise ValueError(f"--tensor_parallel_size={args.tensor_parallel_size}; accepted: 1 when {world} "
                         "training processes each run an engine")
    if args.prompts_per_update % world:
        raise ValueError(f"--prompts_per_update={args.prompts_per_update}; accepted: a multiple of the {world} processes")
    if args.threads:   # before the engine starts: vLLM's CPU worker then refuses torch.set_num_threads
        torch.set_num_threads(args.threads)
    random.seed(args.seed + rank); np.random.seed(args.seed + rank); torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id   # Llama: no pad token
    if pad_id is None:
        raise ValueError(f"--model={args.model!r}: its tokenizer has neither a pad nor an EOS token")
    limit = args.max_model_len - args.max_new_tokens
    rows = load_rows(args.train_data, "train", args.data_dir, args.template, tok, max_prompt_tokens=limit)
    eval_rows = load_rows(args.eval_data, "test", args.data_dir, args.template, tok, max_prompt_tokens=limit) \
        if args.eval_data else []
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    model, opt = acc.prepare(model, opt)
    sampler = PromptSampler(rows, args.train_mix, args.seed)
    acc.register_for_checkpointing(sampler)           # its position goes into every checkpoint
    ref_model = None
    if args.kl_coef > 0:
        ref_model = AutoModelForCausalLM.from_pretrained(args.ref_model or args.model, dtype=torch.float32)
        ref_model = acc.prepare_model(ref_model.eval().requires_grad_(False), evaluation_mode=True)
    longest = max(len(r["prompt_ids"]) for r in rows + eval_rows)
    engine = make_engine(args.model, backend=args.backend, policy=model, max_model_len=args.max_model_len, seed=args.seed + rank,
                         dtype=args.vllm_dtype, kv_cache_sequences=args.prompts_per_iter // world * args.group_size,
                         kv_cache_tokens=longest + args.max_new_tokens,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         tensor_parallel_size=args.tensor_parallel_size, sleep_mode=args.sleep_mode)
    log = (lambda *a: print(*a, flush=True)) if acc.is_main_process else (lambda *a: None)
    return SimpleNamespace(acc=acc, tok=tok, pad_id=pad_id, rows=rows, eval_rows=eval_rows, model=model, opt=opt,
                           sampler=sampler, ref_model=ref_model, engine=engine, log=log,
                           sources=sorted({r["source"] for r in rows}))


def rollout(args, run, it):
    """Phase 1: this rank's share of every mini-batch's prompts, G completions each."""
    from rollout import replayed_rollouts, save_rollouts
    chosen = run.sampler.take(args.prompts_per_iter, it)
    batches, mine = minibatches(args, it, run.acc.num_processes)
    local = mine(run.acc.process_index)
    take = [run.rows[chosen[p]] for p in local]
    if args.replay_rollouts:
        batch = replayed_rollouts(args.replay_rollouts, it, local, args.group_size)
    else:
        batch = run.engine.generate([r["prompt_ids"] for r in take], n=args.group_size, max_tokens=args.max_new_tokens,
                                    seed=args.seed * 100003 + it * 101 + run.acc.process_index)
    if args.save_rollouts:
        save_rollouts(args.save_rollouts, it, run.acc.process_index, batch, local)
    run.engine.sleep()          # --sleep_mode: vLLM frees its KV cache and offloads its weights (GPU)
    return batch, take, batches, local


def main(argv=None):
    args = parse_args(argv)
    from rollout import weight_buckets
    run = setup(args)
    acc, log, G = run.acc, run.log, args.group_size
    os.makedirs(args.out_dir, exist_ok=True)
    ckpt_dir, metrics_path = os.path.join(args.out_dir, "checkpoints"), os.path.join(args.out_dir, "metrics.jsonl")
    history, start = [], 0
    if args.resume:
        path, start = load_checkpoint(args, acc, ckpt_dir)
        run.engine.sync_weights(weight_buckets(run.model, args.sync_bucket_mb))   # it started from --model
        if os.path.exists(metrics_path):                                          # rows past it are redone
            history = [r for r in map(json.loads, open(metrics_path)) if r["iter"] <= start]
        log(f"resumed from {path} (after iteration {start})")
    if acc.is_main_process:   # rewritten, not appended blindly: a crash may have logged iterations past `start`
        with open(metrics_path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in history)
        os.replace(metrics_path + ".tmp", metrics_path)
    log(f"{args.cell}: {len(run.rows)} train prompts | {args.prompts_per_iter // args.prompts_per_update * args.epochs} "
        f"updates/iter | {acc.num_processes} process(es) | out {args.out_dir}")
    if args.wandb and acc.is_main_process:
        import wandb
        wandb.init(project=args.wandb, name=os.path.basename(args.out_dir), config=vars(args), resume="allow")
    metrics_file = open(metrics_path if acc.is_main_process else os.devnull, "a")
    stop, scorer = StopRequest(acc.is_main_process), ThreadPoolExecutor(1)
    if args.eval_before and run.eval_rows and start == 0:
        evaluate(args, run, "eval_start.json")

    for it in range(start + 1, args.iters + 1):
        t0 = t = time.time()
        # -- 1. rollout --
        batch, take, batches, local = rollout(args, run, it)
        times = {"time_rollout_s": time.time() - t}
        # -- 2 and 3 at once: rewards (sandboxes, verifier processes) in a thread while the
        # behaviour log-probs mu are computed, once, before any update --
        t = time.time()
        scoring = scorer.submit(reward.score_rows, batch.texts, [take[i // G] for i in range(len(batch.texts))])
        old, tis, gap = behaviour_logprobs(args, run.model, batch, run.pad_id, acc.device)
        times["time_logp_s"], t = time.time() - t, time.time()
        rewards = torch.tensor(scoring.result())         # time_reward_s: the wait beyond the log-probs
        shaped, adv, keep = advantages(args, rewards, batch)
        times["time_reward_s"], t = time.time() - t, time.time()
        # -- 4. the updates --
        upd = update(args, acc, run.model, run.opt, run.ref_model, batch, old, tis, adv, keep, batches, local, it,
                     run.pad_id)
        times["time_update_s"], t = time.time() - t, time.time()
        # -- 5. new weights into the rollout engine --
        run.engine.sync_weights(weight_buckets(run.model, args.sync_bucket_mb))
        times["time_sync_s"], times["time_iter_s"] = time.time() - t, time.time() - t0

        row = log_row(args, acc, it, batch, take, rewards, shaped, keep, upd.gap if args.mu_source == "vllm" else gap,
                      upd, run.sources, times)
        if args.eval_every and it % args.eval_every == 0 and run.eval_rows:   # the engine has the new weights
            row[f"eval_avg@{args.eval_k}"] = evaluate(args, run, f"eval_iter_{it:06d}.json")
        history.append(row)
        metrics_file.write(json.dumps(row) + "\n"); metrics_file.flush()
        if args.wandb and acc.is_main_process:
            wandb.log(row, step=it)
        log(f"iter {it}/{args.iters} | reward {row['reward_mean']:.3f} | solve {row['solve_rate']:.2f} | "
            f"clip {row['clip_frac']:.3f} | ent {row['entropy']:.3f} | len {row['response_len']:.1f} | "
            f"kl {row['kl_k3']:.4f} | gn {row['grad_norm']:.2f} | {row['time_iter_s']:.1f}s")
        if args.sample_every and (it % args.sample_every == 0 or it == args.iters):
            for i in range(0, min(len(batch.texts), 3 * G), G):
                log(f"  [{rewards[i]:.0f}] {take[i // G]['problem'].strip()!r} -> {batch.texts[i]!r}")
        # stop requests are agreed on by all ranks, so every rank checkpoints together
        stopping = acc.reduce(torch.tensor(float(stop.requested), device=acc.device), "sum").item() > 0
        if (args.ckpt_every and it % args.ckpt_every == 0) or stopping or it == args.iters:
            save_checkpoint(args, acc, ckpt_dir, it)
        if stopping:
            log(f"stopped after iteration {it}; continue with --resume (checkpoint in {ckpt_dir})")
            sys.exit(130)

    save_policy(acc, run.model, run.tok, os.path.join(args.out_dir, "final"))
    if acc.is_main_process:
        plot(args, history, os.path.join(args.out_dir, "dynamics.png"))
        log(f"saved {args.out_dir}/final, metrics.jsonl, dynamics.png, checkpoints in {ckpt_dir}")
    if run.eval_rows:
        evaluate(args, run, "eval.json")
    acc.wait_for_everyone()


def evaluate(args, run, name):
    """avg@k of the engine's current weights on the held-out rows (every rank scores its share),
    written to out_dir/name and logged as one readable line."""
    from eval import avg_at_k
    run.log(f"evaluating avg@{args.eval_k}: {len(run.eval_rows)} held-out problems ({args.eval_data}) x "
            f"{args.eval_k} samples ...")
    res = avg_at_k(run.engine, run.eval_rows, args.eval_k, args.max_new_tokens, seed=args.seed, acc=run.acc)
    if run.acc.is_main_process:
        with open(os.path.join(args.out_dir, name), "w") as f:
            json.dump({f"avg@{args.eval_k}": res, "model": args.model if name == "eval_start.json"
                       else os.path.join(args.out_dir, "final")}, f)
    scores = " | ".join(f"{k} {v:.1f}" for k, v in res.items())
    run.log(f"{'start ' if name == 'eval_start.json' else ''}avg@{args.eval_k}: {scores} ({name})")
    return res


def save_policy(acc, model, tokenizer, path):
    """The policy alone, in Hugging Face format (loadable by eval.py, vLLM and transformers)."""
    state = acc.get_state_dict(model)        # gathered from the shards under FSDP
    if acc.is_main_process:
        shutil.rmtree(path + ".tmp", ignore_errors=True)
        acc.unwrap_model(model).save_pretrained(path + ".tmp", state_dict=state)
        tokenizer.save_pretrained(path + ".tmp")
        shutil.rmtree(path, ignore_errors=True)
        os.replace(path + ".tmp", path)
    acc.wait_for_everyone()


def plot(args, history, path):
    """Reward and entropy against iteration (the paper's Figure 2 in spirit)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    its = [h["iter"] for h in history]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    ax[0].plot(its, [h["reward_mean"] for h in history]); ax[0].set_title(f"{args.cell}: reward")
    ax[1].plot(its, [h["entropy"] for h in history]); ax[1].set_title("entropy (nats/token)")
    for a in ax:
        a.set_xlabel("iteration"); a.grid(alpha=0.3)
    fig.tight_layout(); fig.savefig(path, dpi=120); plt.close(fig)


if __name__ == "__main__":
    main()
