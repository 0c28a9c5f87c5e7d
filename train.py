"""
GPPO training: sample, score, advantages, AdamW updates of gppo.py's loss, weight sync; repeated.

    python train.py                                          # the embedded CPU default (kl-atomic)
    python train.py --divergence tv --estimator mc           # GRPO's clip, any cell, any baseline
    accelerate launch --num_processes 8 train.py @configs/math_8gpu.args   # README "Scaling up"

One iteration, in the order main() runs it (the loop's comments use the same numbers):
1. Sample `prompts_per_iter` x `group_size` completions at temperature 1 with vLLM (rollout.py),
   each rank its share of every mini-batch's prompts (whole groups).
2. Score them with reward.py (binary 0/1), in a thread while step 3 runs.
3. The log-probs of the proximal policy, which the region bounds pi against: the trainer's own
   before any update (the default: the ratio is exactly 1 at the first step; at K = 0 the weights
   that sampled), or mu's as vLLM recorded them (`--mu_source vllm`: mu is the proximal policy).
4. GRPO's group-relative advantage (R - mean_group) / (std_group + 1e-6), on every token
   (`--advantage`: rloo, dr_grpo or reinforce instead; gppo.ADVANTAGES).
5. `epochs` passes in mini-batches of `prompts_per_update` prompts, one AdamW step each (the
   paper: 128/16 = 8 steps, 1 epoch), on gppo.py's loss over the *whole* mini-batch (all
   micro-batches and ranks: the same samples give the same update at any process count). The
   paper's settings: no KL penalty or entropy bonus, constant lr, gradient clipping (--kl_coef,
   --entropy_coef and --lr_schedule add them as TRL and verl do).
6. The new weights stream into the running vLLM engine, in memory (rollout.py).
7. One metrics row (metrics.jsonl, console, wandb), a checkpoint every `ckpt_every` iterations.

Two guards the paper does not use are on in the CPU default, each for a failure measured there
(README "The embedded default"): `--target_kl` skips the iteration's remaining steps once a
mini-batch has drifted further than target_kl from mu, checked before its own step (as SB3's PPO):
the per-token region cannot bound how far *other* tokens move the shared weights. `--overlong
punish`: DAPO's soft overlong punishment (the reward reads the last answer: EOS erodes without it).

Off-policy, `--async_lag K` (prime-rl's async_level; 0 by default): the batch trained at iteration
t was sampled, in a background thread (infra/prefetch.py), by the weights after iteration
t - 1 - K. Those weights are gone, so mu is vLLM's recorded log-probs, used in one of two ways:
- coupled, `--mu_source vllm`: the region bounds pi against mu itself (eq. 11 as written);
- decoupled, `--mu_source recompute --tis_cap C` (AReaL; Hilton et al. 2021): the region bounds pi
  against the proximal policy (the weights at the iteration's start, step 3), each token weighted
  by min(proximal / mu, C). (recompute alone ignores mu, as verl's default does.)
The machinery (run flags, loading, several processes, checkpoints, metrics) is in infra/: it moves,
stores, pads, gathers and logs, and decides nothing about what is trained, so it can be skipped.
"""
import argparse
import functools
import inspect
import math
import os
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from infra import flags   # argparse alone: the flags are read before the heavy imports below

# configuration: the algorithm's flags (LoRA's: what is trained) and their resolution; the run's
# flags and every range check: infra/flags.py


def parser():
    """train.py's flags. Declaring them imports nothing heavy: the names from gppo.py's tables are
    read only when a value is checked or -h is asked for (flags.Names), so a mistyped flag is
    refused before the ~13 s of imports."""
    p = argparse.ArgumentParser(description="GPPO trainer", fromfile_prefix_chars="@",
                                allow_abbrev=False,   # --iter is a typo, not --iters
                                usage="python train.py [--flag value ...] [@preset.args] "
                                      "(python train.py -h lists the flags)")
    # @file presets (configs/*.args): one or more flags per line, '#' starts a comment line
    p.convert_arg_line_to_args = lambda line: [] if line.lstrip().startswith("#") else line.split()
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="data/tiny/model", help="Hugging Face model folder or name")
    g.add_argument("--train_data", default="tiny-math,tiny-code", help="data sets (data/loaders)")
    g.add_argument("--eval_data", default="", help="held-out sets scored at the end")
    g.add_argument("--train_mix", default="balanced", choices=("balanced", "proportional"))
    g.add_argument("--data_dir", default=None, help="folder holding local copies of hub data sets")
    g.add_argument("--template", default="plain", help="prompt template (data/loaders.py)")
    g.add_argument("--seed", type=int, default=0, help="seed for data order and sampling")
    g = p.add_argument_group("objective (the paper, arXiv 2610.13015: eqs. 11, 14-20, sec. 4.1)")
    g.add_argument("--method", choices=flags.Names("gppo.METHODS", "gppo.BASELINES"),
                   metavar="NAME", help="a cell or baseline: %(choices)s")
    g.add_argument("--objective", default="gppo", metavar="NAME",
                   choices=flags.Names("gppo.BASELINES", extra=("gppo",)), help="%(choices)s")
    g.add_argument("--divergence", default="kl", help="f of the region: a name of "
                   "gppo.DIVERGENCES (tv, chi2, kl, hellinger, js) or of a family, e.g. alpha:0.5")
    g.add_argument("--estimator", default="atomic", choices=flags.Names("gppo.ESTIMATORS"),
                   metavar="NAME", help="D(r): %(choices)s")
    g.add_argument("--delta", type=float, help="region size (default: mc's lower bound is 0.8)")
    g.add_argument("--ratio_bounds", default="0.5,10", type=flags.numbers_or_none(2),
                   help="'low,high' or 'none': ratio bounds")
    g.add_argument("--dual_clip", default="10", type=flags.numbers_or_none(1),
                   help="no gradient if A<0 and ratio > it; 'none'")
    g.add_argument("--agg", default=None, choices=flags.Names("gppo.AGGS"), metavar="AGG", help=
                   "%(choices)s (default: token-mean for the grid, each baseline's own otherwise)")
    g.add_argument("--loss_kwargs", default="", help="a baseline's other keywords, 'k=v,k=v'")
    g.add_argument("--advantage", default="grpo", choices=flags.Names("gppo.ADVANTAGES"),
                   metavar="NAME", help="gppo.ADVANTAGES: grpo (R - mean_group) / std_group, "
                   "rloo (leave-one-out), dr_grpo (R - mean_group), reinforce (R - batch mean)")
    g = p.add_argument_group("sampling and optimisation")
    g.add_argument("--iters", type=int, default=60, help="RL iterations")
    g.add_argument("--prompts_per_iter", type=int, default=64, help="P: prompts per iteration")
    g.add_argument("--group_size", type=int, default=8, help="G: completions per prompt")
    g.add_argument("--max_new_tokens", type=int, default=48, help="max response length, tokens")
    g.add_argument("--mu_source", default="recompute", choices=("recompute", "vllm"))  # step 3
    g.add_argument("--async_lag", type=int, default=0, metavar="K", help="sample K iterations "
                   "ahead, in the background, by weights K iterations older; 0: synchronous")
    g.add_argument("--prompts_per_update", type=int, default=8, help="M: prompts per AdamW step")
    g.add_argument("--epochs", type=int, default=1, help="passes over each iteration's batch")
    g.add_argument("--lr", type=float, default=1.5e-4, help="AdamW lr (--lr_schedule's peak)")
    g.add_argument("--lr_schedule", default="constant", choices=("constant", "cosine", "linear"),
                   help="constant (the paper), or decays to --min_lr_ratio x --lr at the run's end")
    g.add_argument("--warmup_steps", type=int, default=0, help="AdamW steps of warmup from 0")
    g.add_argument("--min_lr_ratio", type=float, default=0.0, help="decays' floor, x --lr")
    g.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--grad_clip", type=float, default=1.0, help="max global gradient norm")
    g.add_argument("--target_kl", type=float, default=0.05, help="skip the iteration's remaining "
                   "steps once a mini-batch's k3 KL(mu || pi) per token exceeds this; 0 = off")
    g = p.add_argument_group("options of mature trainers (the paper uses none)")
    g.add_argument("--reward", default="correct=1", help="the reward as weighted named parts, "
                   "'correct=1,format=0.1': correct (the task's judge) and reward.PARTS' "
                   "(format, length, overlong; --overlong punish adds overlong=1)")
    g.add_argument("--overlong", default="punish", choices=("off", "mask", "punish"),
                   help="truncated responses: kept (the paper), no loss, or DAPO's punishment")
    g.add_argument("--overlong_buffer", type=int, default=4, help="tokens of punish's ramp")
    g.add_argument("--drop_uniform_groups", action="store_true",
                   help="DAPO's dynamic sampling without the refill: drop equal-reward groups")
    g.add_argument("--tis_cap", type=float, help="truncated IS: weigh by min(pi_old/mu_vllm, cap)")
    g.add_argument("--kl_coef", type=float, default=0.0, help="k3 KL penalty to ref_model; 0: off")
    g.add_argument("--ref_model", default="", help="reference model of --kl_coef (def. --model)")
    g.add_argument("--entropy_coef", type=float, default=0.0, help="entropy bonus; 0: off")
    g = p.add_argument_group("what is trained: LoRA adapters through peft (infra/lora.py)")
    g.add_argument("--lora_rank", type=int, default=0, help="adapter rank; 0 = full fine-tune")
    g.add_argument("--lora_alpha", type=float, default=None,
                   help="the adapters' scale is alpha/rank (default alpha: 2 x rank)")
    g.add_argument("--lora_dropout", type=float, default=0.0, help="dropout on the adapters' input")
    g.add_argument("--lora_target_modules", default="all-linear", help="comma-separated names of "
                   "the linear layers to adapt (default: every one of attention and MLP)")
    flags.add_run_flags(p, flags.Names("data.probes.PROBES", extra=("",)))
    return p


def parse_args(argv=None):
    """The flags, checked (infra/flags.py: every range), then the algorithm's resolved here."""
    args = algorithm_settings(flags.check(parser().parse_args(argv)))
    args.out_dir = args.out_dir or os.path.join("out", f"{args.cell}-seed{args.seed}")
    return args


def algorithm_settings(args):
    """What the algorithm's flags mean, resolved once at parse time (gppo is imported below,
    before any call): a bad value fails here, naming its flag, before anything loads."""
    if args.method in gppo.METHODS:   # a known method is a cell (paper section 3.4)
        args.objective, (args.divergence, args.estimator) = "gppo", gppo.METHODS[args.method]
    elif args.method:                 # or a baseline
        args.objective = args.method
    grid = args.objective == "gppo"
    loss = gppo.gppo_loss if grid else gppo.BASELINES[args.objective]
    # unset --agg: the loss's own aggregation (token-mean for the grid, each baseline's authors')
    args.agg = args.agg or inspect.signature(loss).parameters["agg"].default
    if args.lora_alpha is None:   # LoRA's scale alpha / rank: 2 unless set
        args.lora_alpha = 2.0 * args.lora_rank
    if grid:   # the region checked, one setting at a time so that a refusal names its flag;
        for flag in ("divergence", "delta", "ratio_bounds", "dual_clip"):   # (estimator, agg:
            try:                                                            # argparse's choices)
                gppo.check_config(args.divergence, "mc", **({} if flag == "divergence" else
                                                            {flag: getattr(args, flag)}))
            except ValueError as e:
                raise flags.FlagError(f"--{flag}={getattr(args, flag)!r}: {e}") from None
        # delta defaulted once (the mc region's lower bound at 0.8, paper 4.1) and kept
        args.delta = gppo.check_config(args.divergence, args.estimator, args.delta,
                                       args.ratio_bounds, args.dual_clip, args.agg)
    # --loss_kwargs: the loss's other keywords (not its tensors, nor what has a flag of its own)
    own = {k: f"--{k}" for k in ("agg", *(("delta", "ratio_bounds", "dual_clip") if grid else ()))}
    settable = [k for k in list(inspect.signature(loss).parameters)[4:] if k not in own and k not
                in ("divergence", "estimator", "global_count", "detach")]
    args.loss_kwargs = flags.keyword_values("loss_kwargs", args.loss_kwargs, loss.__name__,
                                            settable, own)
    try:   # the loss with these settings, once, on a tiny batch: a bad keyword value fails now
        one = torch.zeros(1, 2)
        chosen_loss(args)(one, one, torch.ones(1), torch.ones(1, 2, dtype=torch.bool))
    except (ValueError, TypeError) as e:
        raise flags.FlagError(f"--loss_kwargs={args.loss_kwargs!r} for {loss.__name__}: {e}") \
            from None
    # --reward: the reward as a weighted sum of named parts; --overlong punish is DAPO's overlong
    # punishment as the part "overlong" at weight 1 (unless --reward weighs it)
    args.reward_weights = flags.keyword_values("reward", args.reward, "reward.PARTS",
                                               ["correct", *reward.PARTS], {})
    if not args.reward_weights or not all(isinstance(w, (int, float))
                                          for w in args.reward_weights.values()):
        flags.bad(args, "reward", "name=number pairs, comma-separated")
    if args.overlong == "punish":
        args.reward_weights.setdefault("overlong", 1.0)
    args.cell = f"{args.divergence}-{args.estimator}" if grid else args.objective
    return args


def chosen_loss(args):
    """gppo.py's loss named by --objective / --method with its flags bound: called as
    loss(logp, proximal_logp, advantages, mask, global_count=..., [detach=...]) -> (loss, stats)."""
    if args.objective == "gppo":
        return functools.partial(gppo.gppo_loss, divergence=args.divergence,
                                 estimator=args.estimator, delta=args.delta,
                                 ratio_bounds=args.ratio_bounds, dual_clip=args.dual_clip,
                                 agg=args.agg, **args.loss_kwargs)
    return functools.partial(gppo.BASELINES[args.objective], agg=args.agg, **args.loss_kwargs)


def refuse(error):
    """A refused flag value in argparse's form: usage, "train.py: error: ...", exit status 2."""
    parser().error(str(error))


if __name__ == "__main__":   # a mistyped flag, a value out of range or -h is answered here,
    try:                     # before the ~13 s of imports
        checked = flags.check(parser().parse_args())
        for flag in ("model", "ref_model"):   # a path must be a folder (a hub name loads later)
            if getattr(checked, flag):
                flags.check_model(flag, getattr(checked, flag))
    except flags.FlagError as e:
        refuse(e)

# the heavy imports (torch, transformers, accelerate, vLLM's through rollout.py), after the flags
import torch
from transformers.utils.logging import disable_progress_bar

import gppo
import reward
from data.loaders import PromptSampler, load_rows
from data.probes import ProbeRun
from eval import evaluate
from infra.checkpoints import (StopRequest, check_out_dir, prepare_out_dir, resume,
                               save_checkpoint, save_policy)
from infra.clip_cov import clip_cov_selection
from infra.distributed import (agree_to_stop, gradient_sync, make_accelerator, pad_with_fillers,
                               sum_over_ranks)
from infra.logprobs import collate
from infra.lora import adapters_off
# token_logprobs(model, ids, attn, resp) is, in one line (infra/logprobs.py makes it in chunks, and
# under --share_prompts pushes each group's prompt through the model once, the same log-probs):
#   model(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
from infra.logprobs import token_logprobs
from infra.metrics import MetricsLog, Stopwatch, UpdateLog
from infra.models import load_policy, load_reference, load_tokenizer
from infra.prefetch import Prefetch
from infra.vllm_server import ServerError
from infra.replay import replayed_rollouts, save_rollouts
from rollout import RolloutBatch, make_engine, weight_buckets


@dataclass
class Run:
    """What setup() builds and the loop uses; a test builds one with the fields it needs."""
    acc: object                 # accelerate.Accelerator
    model: object               # the policy, prepared
    opt: object                 # AdamW, prepared
    pad_id: int
    tok: object = None
    rows: list = None           # train prompts (data/loaders.py rows)
    eval_rows: list = None
    sampler: object = None      # PromptSampler
    ref_model: object = None    # --kl_coef's reference
    engine: object = None       # rollout engine (vLLM or hf)
    engine_version: int = 0     # the iteration after which the engine's weights were synced
    rollouts: object = None     # infra/prefetch.Prefetch: holds the batches sampled K ahead
    log: object = print         # print on the main process, nothing elsewhere
    sources: list = None        # the train data sets' names


def setup(args):
    """Accelerator, data (checked first: a bad row fails before any model loads), policy and
    optimizer, reference model, rollout engine. Returns them in one Run."""
    check_out_dir(args)   # an earlier run's folder is refused before anything loads
    disable_progress_bar()   # transformers' "Loading weights" bars, at every load and save
    acc = make_accelerator(args)   # also: FSDP on the CPU, head precision, threads, seeds
    rank, world = acc.process_index, acc.num_processes
    tok, pad_id = load_tokenizer(args.model)   # infra/models.py: the loading of models
    rows, eval_rows = load_data(args, "train_data", "train", tok), load_data(args, "eval_data",
                                                                             "test", tok)
    log = (lambda *a: print(*a, flush=True)) if acc.is_main_process else (lambda *a: None)
    steps = args.prompts_per_iter // args.prompts_per_update * args.epochs
    log(f"{args.cell}: {len(rows)} train prompts | {steps} updates/iter | {world} process(es) | "
        f"out {args.out_dir}")
    model = load_policy(args)   # float32; under --lora_rank only the adapters require a gradient
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                            weight_decay=args.weight_decay)
    model, opt = acc.prepare(model, opt)
    sampler = PromptSampler(rows, args.train_mix, args.seed)
    acc.register_for_checkpointing(sampler)           # its position goes into every checkpoint
    ref_model = load_reference(args, acc, model)      # --kl_coef's; None without it
    longest = max(len(r["prompt_ids"]) for r in rows + eval_rows)
    engine = make_engine(args.model, backend="server" if args.vllm_server else args.backend,
                         servers=args.vllm_server.split(",") if args.vllm_server else (),
                         policy=model, seed=args.seed + rank,
                         max_model_len=args.max_model_len, dtype=args.vllm_dtype,
                         kv_cache_sequences=args.prompts_per_iter // world * args.group_size,
                         kv_cache_tokens=longest + args.max_new_tokens,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         tensor_parallel_size=args.tensor_parallel_size,
                         sleep_mode=args.sleep_mode)
    run = Run(acc=acc, tok=tok, pad_id=pad_id, rows=rows, eval_rows=eval_rows, model=model,
              opt=opt, sampler=sampler, ref_model=ref_model, engine=engine, log=log,
              sources=sorted({r["source"] for r in rows}))
    run.rollouts = Prefetch(args.async_lag, Samples.restore, acc)
    if args.async_lag:   # the batches sampled ahead go into every checkpoint
        acc.register_for_checkpointing(run.rollouts)
    return run


def load_data(args, flag, split, tok):
    """The rows of --train_data or --eval_data ([] if empty); one that does not load (an unknown
    name, a missing or malformed file) is refused naming the flag."""
    try:
        return load_rows(getattr(args, flag), split, args.data_dir, args.template, tok,
                         args.max_model_len - args.max_new_tokens) if getattr(args, flag) else []
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        raise flags.FlagError(f"--{flag}={getattr(args, flag)!r}: {e}") from None


@dataclass
class Samples:
    """One iteration's samples on this rank, filled in step by step (tiny-grpo's Experience): per
    prompt its row and position 0..P-1, per sample (G consecutive a group) the rest."""
    batch: object           # rollout.RolloutBatch: ids, vLLM's log-probs, truncated, texts
    rows: list
    positions: list
    proximal_logp: list = None   # the proximal policy's log-probs per completion token (step 3)
    tis: list = None        # truncated-IS weight per completion token (1 without --tis_cap)
    start_logp: list = None  # the trainer's at the iteration's start, or None (the vLLM gap)
    rewards: torch.Tensor = None
    parts: dict = None      # --reward's parts, each (P*G,)
    shaped: torch.Tensor = None
    advantages: torch.Tensor = None
    keep: torch.Tensor = None
    version: int = 0        # the iteration after which the weights that sampled it were synced

    @staticmethod
    def restore(fields):    # from a checkpoint's in-flight batches (infra/prefetch.py)
        return Samples(**{**fields, "batch": RolloutBatch(**fields["batch"])})


def derived_seed(args, what, it, k=0):
    """Every seed the loop derives from --seed, in one place: a function of the iteration (and k:
    the rank, epoch or mini-batch), so a resumed run draws what an unbroken one did. The
    multipliers only keep the streams apart; they are kept as they were so that runs repeat."""
    return {"minibatches": args.seed * 7919 + it,                # k unused
            "sampling": args.seed * 100003 + it * 101 + k,       # k: the rank
            "epoch_order": args.seed * 7919 + it * 131 + k,      # k: the epoch (>= 1)
            "clip_cov": args.seed * 1_000_003 + it * 1009 + k}[what]   # k: the mini-batch


# 1. sample ---------------------------------------------------------------------------------------

def minibatches(args, it):
    """The iteration's mini-batches: lists of prompt positions 0..P-1, whatever the world size."""
    P, M = args.prompts_per_iter, args.prompts_per_update
    perm = random.Random(derived_seed(args, "minibatches", it)).sample(range(P), P)
    return [perm[u * M:(u + 1) * M] for u in range(P // M)]


def rank_share(minibatch, rank, world):
    """The positions of one mini-batch that `rank` samples and trains on: 1/world of them."""
    share = len(minibatch) // world
    return minibatch[rank * share:(rank + 1) * share]


def sample_groups(args, run, it):
    """This rank's share of every mini-batch's prompts, G completions each (--async_lag: in the
    background thread, K iterations ahead)."""
    rank, world = run.acc.process_index, run.acc.num_processes
    chosen = run.sampler.take(args.prompts_per_iter, it)       # row index of each position
    positions = sorted(p for b in minibatches(args, it) for p in rank_share(b, rank, world))
    version = run.engine_version
    rows = [run.rows[chosen[p]] for p in positions]
    if args.replay_rollouts:
        batch = replayed_rollouts(args.replay_rollouts, it, positions, args.group_size)
    else:
        # the paper's sampling: temperature 1 (top-p 1, top-k off: the policy's own distribution)
        batch = run.engine.generate([r["prompt_ids"] for r in rows], n=args.group_size,
                                    max_tokens=args.max_new_tokens, temperature=1.0,
                                    seed=derived_seed(args, "sampling", it, rank))
    if batch.versions:   # a server's samples carry their weights' version (None: the start's)
        version = min(v or 0 for v in batch.versions)
    if args.save_rollouts:
        save_rollouts(args.save_rollouts, it, rank, batch, positions)
    run.engine.sleep()          # --sleep_mode: vLLM frees its KV cache and offloads its weights
    return Samples(batch, rows, positions, version=version)


# 2. score ----------------------------------------------------------------------------------------

def score_in_background(args, scorer, s):
    """Every completion's reward (reward.py: its task's verifier, 0 or 1), in the scorer's thread
    while step 3 runs; returns the future of the list."""
    rows = [s.rows[i // args.group_size] for i in range(len(s.batch.texts))]
    return scorer.submit(reward.score_rows, s.batch.texts, rows)


# 3. the proximal policy -------------------------------------------------------------------------

def proximal_logprobs(args, model, batch, pad_id, device):
    """Per sample, (len_i,) each: the proximal policy's log-probs (which the region bounds pi
    against), the TIS weights, and the trainer's log-probs at the iteration's start (the gap
    metric's). recompute: the trainer's, before any update; under --tis_cap C each token weighs
    min(proximal / mu_vllm, C), as the samples came from vLLM's mu (Yao et al., 2025). vllm: mu
    as vLLM recorded it (coupled: mu is the proximal policy), no forward pass, weight 1; update()
    fills the start log-probs (None until then)."""
    n = len(batch.texts)
    if args.mu_source == "vllm":
        mu = [torch.tensor(lp) for lp in batch.logprobs]
        return mu, [torch.ones_like(m) for m in mu], [None] * n
    proximal, tis = [None] * n, [None] * n
    with torch.no_grad():
        for s in range(0, n, args.micro_batch_size):
            idx = list(range(s, min(s + args.micro_batch_size, n)))
            ids, attn, resp, vllm_logp = collate(batch, idx, pad_id, device, (batch.logprobs,))
            lp, _ = token_logprobs(model, ids, attn, resp, args.logp_chunk_mb, args.head_precision,
                                   share_prompts=args.share_prompts)
            m = resp[:, 1:].bool()
            w = (lp - vllm_logp).exp().clamp(max=args.tis_cap) if args.tis_cap \
                else torch.ones_like(lp)
            for j, i in enumerate(idx):
                proximal[i], tis[i] = lp[j][m[j]].cpu(), w[j][m[j]].cpu()
    return proximal, tis, proximal


# 4. advantages -----------------------------------------------------------------------------------

def reward_parts(args, rewards, batch, rows=None):
    """{part: (P*G,)} for each part of --reward: "correct" is step 2's reward (the judge's), every
    other one reward.PARTS[part] of each completion (rows: one per prompt, G samples each)."""
    done = [reward.Completion(text, len(ids), cut, rows[i // args.group_size] if rows else None,
                              args.max_new_tokens, args.overlong_buffer)
            for i, (text, ids, cut) in enumerate(zip(batch.texts, batch.completion_ids,
                                                     batch.truncated))]
    return {name: rewards if name == "correct" else torch.tensor(reward.part_values(name, done))
            for name in args.reward_weights}


def advantages(args, rewards, batch, parts=None):
    """(shaped rewards, advantages, kept samples), each (P*G,). Shaped: the weighted sum of the
    reward's parts (reward_parts; by default the judge's reward less DAPO's overlong penalty);
    advantages: gppo.ADVANTAGES[--advantage] of the shaped rewards (grpo, the default:
    (R - mean_group) / (std_group + 1e-6))."""
    parts = reward_parts(args, rewards, batch) if parts is None else parts
    shaped = sum(w * parts[name] for name, w in args.reward_weights.items())
    adv = gppo.ADVANTAGES[args.advantage](shaped, args.group_size)
    return shaped, adv, kept_samples(args, shaped, batch)


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


# 5. the updates ----------------------------------------------------------------------------------

def minibatch_order(args, it, epoch, n):
    """The first epoch takes the n mini-batches in order; later epochs reshuffle them (seeded)."""
    if epoch == 0:
        return list(range(n))
    return random.Random(derived_seed(args, "epoch_order", it, epoch)).sample(range(n), n)


def reference_kl(args, ref_model, inputs, lp, mask, count):
    """--kl_coef: the k3 estimate of KL(pi || ref) per token, aggregated like the policy loss;
    returns (the penalty to add to the loss, the summed KL over the tokens for the log)."""
    with torch.no_grad(), adapters_off(ref_model):   # under LoRA the reference is the base model
        ref_logp, _ = token_logprobs(ref_model, *inputs, args.logp_chunk_mb, args.head_precision,
                                     share_prompts=args.share_prompts)
    d = ref_logp - lp
    kl = d.exp() - d - 1
    penalty = args.kl_coef * gppo.aggregate(kl, mask.bool(), args.agg, count)
    return penalty, (kl.detach() * mask).sum().item()


def learning_rate(args, step):
    """--lr_schedule's lr at AdamW step `step` (0-based) of the run: a linear warmup from 0, then
    --lr, or a cosine or linear decay to min_lr_ratio x lr at the run's end (transformers'
    schedules, as TRL and verl use them: tests/test_update.py). A function of the step alone, so
    --resume continues it exactly; a step --target_kl skips still counts (as SB3 and CleanRL)."""
    if step < args.warmup_steps:
        return args.lr * step / args.warmup_steps
    if args.lr_schedule == "constant":
        return args.lr
    total = flags.adamw_steps(args)
    progress = min(1.0, (step - args.warmup_steps) / max(1, total - args.warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if args.lr_schedule == "cosine" \
        else 1 - progress
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * decay)


def pass_tensors(run, s, idx):
    """One pass's ids, attention, response mask, proximal log-probs, TIS weights, advantages and
    loss mask. idx None is a filler pass (pad_with_fillers): sample 0 with a zero mask, weighing
    nothing."""
    rows = idx if idx is not None else [0]
    ids, attn, resp, proximal, tis = collate(s.batch, rows, run.pad_id, run.acc.device,
                                             (s.proximal_logp, s.tis))
    mask = resp[:, 1:].float() * (idx is not None)
    return ids, attn, resp, proximal, tis, s.advantages[rows].to(run.acc.device), mask


def pass_loss(args, run, s, idx, count, detach):
    """The loss of one pass over samples idx: the objective, --tis_cap's weights, --entropy_coef's
    bonus and --kl_coef's penalty, each over the mini-batch's denominator `count`. Returns (loss,
    the objective's stats, log-probs, entropy, loss mask, summed reference KL)."""
    ids, attn, resp, proximal, tis, adv, mask = pass_tensors(run, s, idx)
    lp, ent = token_logprobs(run.model, ids, attn, resp, args.logp_chunk_mb, args.head_precision,
                             args.entropy_coef > 0,   # entropy with its graph only when used
                             share_prompts=args.share_prompts)
    if args.tis_cap:   # truncated IS: each token's advantage times min(proximal / mu, C)
        adv = adv[:, None] * tis
    extra = {} if detach is None else {"detach": detach}       # Clip-Cov's drawn tokens
    loss, st = chosen_loss(args)(lp, proximal, adv, mask, global_count=count, **extra)
    if args.entropy_coef > 0:   # the bonus: coef x entropy per token, aggregated as the loss
        loss = loss - args.entropy_coef * gppo.aggregate(ent, mask.bool(), args.agg, count)
    kl_ref = 0.0
    if run.ref_model is not None:
        penalty, kl_ref = reference_kl(args, run.ref_model, (ids, attn, resp), lp, mask, count)
        loss = loss + penalty
    return loss, st, lp, ent, mask, kl_ref


def minibatch_kl(acc, kl_sum, tokens):
    """What --target_kl compares: the mini-batch's k3 KL(mu || pi) per token over every pass and
    rank, token-weighted (the passes' means weighed by their tokens), before its step."""
    s = acc.reduce(torch.tensor([kl_sum, tokens], dtype=torch.float64, device=acc.device), "sum")
    return (s[0] / s[1].clamp(min=1)).item()


def minibatch_passes(args, run, s, positions):
    """This rank's kept samples of the mini-batch of prompt `positions`, in micro-batch passes
    (None: a filler pass), and the loss denominator each pass divides by."""
    acc, G = run.acc, args.group_size
    where = {pos: k for k, pos in enumerate(s.positions)}     # prompt position -> local index
    mine = [where[p] for p in rank_share(positions, acc.process_index, acc.num_processes)]
    chosen = [q * G + j for q in mine for j in range(G) if s.keep[q * G + j]]
    size = args.micro_batch_size
    passes = pad_with_fillers(acc, [chosen[k:k + size] for k in range(0, len(chosen), size)])
    # The denominator is the whole mini-batch's over every pass and rank, by gppo.denominator's
    # rule (its tokens under token-mean, its sequences otherwise): the passes' summed gradients are
    # the whole mini-batch's. DDP and FSDP average the ranks' gradients, so each rank divides by
    # count / world. 0: every sample of the mini-batch was dropped, on every rank.
    tokens = torch.tensor([len(s.batch.completion_ids[i]) for i in chosen], dtype=torch.long)
    count = sum_over_ranks(acc, gppo.denominator(tokens, args.agg))
    return passes, count / acc.num_processes


def update(args, run, samples, batches, it):
    """`epochs` passes over the mini-batches, one AdamW step each. Returns an UpdateLog."""
    acc, s, n = run.acc, samples, len(batches)
    first = (it - 1) * args.epochs * n                         # the iteration's first step
    log = UpdateLog(gppo.STATS, gppo.MU_BUCKETS, lr=learning_rate(args, first))
    stepped = False                                            # any AdamW step taken yet
    for epoch in range(args.epochs):
        for k, u in enumerate(minibatch_order(args, it, epoch, n)):
            passes, count = minibatch_passes(args, run, s, batches[u])
            if count == 0:          # every sample of this mini-batch dropped, on every rank
                continue
            detach = [None] * len(passes) if args.objective != "clip_cov" else clip_cov_selection(
                args, acc, run.model, functools.partial(pass_tensors, run, s), passes,
                derived_seed(args, "clip_cov", it, u), gppo)
            kl = [0.0, 0.0]                                      # k3 KL sum, tokens
            for c, idx in enumerate(passes):
                with gradient_sync(acc, run.model, last=c == len(passes) - 1):
                    loss, st, lp, ent, mask, kl_ref = pass_loss(args, run, s, idx, count, detach[c])
                    acc.backward(loss)
                if idx is None:     # a filler: nothing to log
                    continue
                w = mask.sum().item()
                kl = [kl[0] + st["kl_k3"] * w, kl[1] + w]
                log.add(st, ent.detach(), mask, kl_ref)
                if not stepped and s.start_logp[idx[0]] is None:   # vllm mu: no forward pass
                    m = mask.bool()  # before any step, so lp is the start weights' (the gap metric)
                    for j, i in enumerate(idx):
                        s.start_logp[i] = lp[j][m[j]].detach().cpu()
            log.kls.append(minibatch_kl(acc, *kl))    # before this mini-batch's step
            if args.target_kl and log.kls[-1] > args.target_kl:   # drifted too far: skip the rest
                run.opt.zero_grad(set_to_none=True)
                return log
            log.norms.append(float(acc.clip_grad_norm_(run.model.parameters(), args.grad_clip)))
            for group in run.opt.param_groups:   # this step's place in the run: its lr
                group["lr"] = learning_rate(args, first + epoch * n + k)
            run.opt.step()
            run.opt.zero_grad(set_to_none=True)
            stepped = True
    return log


# the loop ----------------------------------------------------------------------------------------

def main(argv=None):
    try:   # a refused value (at parse time, or once the launch, the model and data are known)
        args = parse_args(argv)
        run = setup(args)
    except flags.FlagError as e:
        refuse(e)
    except ServerError as e:    # --vllm_server: none at the URL, or another model
        refuse(flags.FlagError(f"--vllm_server={args.vllm_server}: {e}"))
    acc, ckpt_dir = run.acc, os.path.join(args.out_dir, "checkpoints")
    prepare_out_dir(args, acc.is_main_process)
    start, history = 0, []
    if args.resume:
        path, start, history = resume(args, acc, ckpt_dir)
        run.engine.sync_weights(weight_buckets(run.model, args.sync_bucket_mb),   # from --model
                                version=start)
        run.engine_version = start
        run.log(f"resumed from {path} (after iteration {start})")
    elif args.vllm_server:   # a server may hold another run's weights: the start's, version 0
        run.engine.sync_weights(weight_buckets(run.model, args.sync_bucket_mb), version=0)
    probe = ProbeRun(args.answer_probe, run.eval_rows, run.tok, run.pad_id) \
        if args.answer_probe else None   # checked here, before the first iteration
    metrics = MetricsLog(args, run, history, probe)
    stop, scorer = StopRequest(acc.is_main_process), ThreadPoolExecutor(1)
    if args.eval_before and run.eval_rows and start == 0:
        evaluate(args, run, "eval_start.json")

    sample = functools.partial(sample_groups, args, run)   # sample(it): iteration it's groups
    for it in range(start + 1, args.iters + 1):
        clock, batches = Stopwatch(), minibatches(args, it)
        s = run.rollouts.take(it, sample)                   # 1. sample(it) (--async_lag: K ahead)
        clock.lap("rollout")
        scoring = score_in_background(args, scorer, s)                               # 2. score
        s.proximal_logp, s.tis, s.start_logp = proximal_logprobs(                    # 3. proximal
            args, run.model, s.batch, run.pad_id, acc.device)
        clock.lap("logp")
        s.rewards = torch.tensor(scoring.result())               # the judge's: part "correct"
        s.parts = reward_parts(args, s.rewards, s.batch, s.rows)
        s.shaped, s.advantages, s.keep = advantages(args, s.rewards, s.batch, s.parts)  # 4. adv.
        clock.lap("reward")
        upd = update(args, run, s, batches, it)                                      # 5. update
        clock.lap("update")
        run.rollouts.idle()     # --async_lag: the generation under way finishes with its weights
        run.engine.sync_weights(weight_buckets(run.model, args.sync_bucket_mb),      # 6. sync
                                version=it)
        run.engine_version = it
        clock.lap("sync")
        row = metrics.row(it, s, upd, clock.total())                                 # 7. log
        if args.eval_every and it % args.eval_every == 0 and run.eval_rows:   # new weights
            row[f"eval_avg@{args.eval_k}"] = evaluate(args, run, f"eval_iter_{it:06d}.json")
        metrics.write(row, s)
        stopping = agree_to_stop(acc, stop)   # every rank checkpoints together
        if stopping or it == args.iters or (args.ckpt_every and it % args.ckpt_every == 0):
            save_checkpoint(args, acc, ckpt_dir, it)
        if stopping:
            run.log(f"stopped after iteration {it}; continue with --resume (in {ckpt_dir})")
            sys.exit(130)

    save_policy(acc, run.model, run.tok, os.path.join(args.out_dir, "final"))
    if acc.is_main_process:
        metrics.plot(os.path.join(args.out_dir, "dynamics.png"))
        run.log(f"saved {args.out_dir}/final, metrics.jsonl, dynamics.png, checkpoints/")
    if run.eval_rows:
        evaluate(args, run, "eval.json")
    acc.wait_for_everyone()


if __name__ == "__main__":
    try:
        main()
    except ServerError as e:    # --vllm_server: a server that failed mid-run (infra/vllm_server.py)
        sys.exit(f"train.py: stopped: {e}\nthe last checkpoint resumes with --resume once the "
                 f"server is back")
