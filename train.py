"""
GPPO training loop: rollout -> reward -> group advantages -> P/M AdamW updates, repeated.

    python train.py --divergence kl --estimator atomic            # the embedded CPU default
    accelerate launch --num_processes 8 train.py @configs/...     # see README "Scaling up"

How one iteration goes, and where it departs from textbook GRPO:
1. Sample `prompts_per_iter` prompts x `group_size` completions with vLLM (rollout.py) at
   temperature 1; each rank samples only its own share of whole groups.
2. Score with reward.py (binary 0/1) and form GRPO's group-relative advantage
   (R - mean_group) / (std_group + 1e-6), broadcast to every token of the response.
3. The behaviour log-probs mu are recomputed once with the current weights before any update
   (`--mu_source recompute`, default: trainer and sampler numerics then agree exactly at the
   first update), or taken from vLLM (`--mu_source vllm`).
4. One pass over the batch in mini-batches of `prompts_per_update` prompts: P/M AdamW updates
   (8 in the paper's 128/16), each minimising gppo_loss with the token-mean over the *whole*
   mini-batch (all micro-batches, all ranks), so micro-batching never changes the update.
5. No KL penalty, no entropy bonus, constant learning rate, gradient clipping (paper settings).
6. Log-probs and entropy come from the hidden states in chunks, each chunk's logits recomputed
   in the backward pass, so at most one (chunk x vocab) float32 tensor lives at a time.
7. After the updates the new weights are pushed into the running vLLM engine in memory.
"""
import argparse, dataclasses, json, math, os, random, shutil, signal, sys, time

import numpy as np
import torch
from accelerate import Accelerator
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM

import gppo
import reward
from eval import avg_at_k, load_rows
from rollout import RolloutBatch, make_engine

# ----------------------------------------------------------------------------------------------
# configuration: every knob is a flag; defaults are the embedded CPU default
p = argparse.ArgumentParser(description="GPPO trainer", fromfile_prefix_chars="@")
# @file presets (configs/*.args): one or more flags per line, '#' starts a comment line
p.convert_arg_line_to_args = lambda line: [] if line.lstrip().startswith("#") else line.split()
g = p.add_argument_group("model and data")
g.add_argument("--model", default="data/tiny/model", help="Hugging Face model folder or hub name")
g.add_argument("--train_data", default="tiny-math,tiny-code", help="comma-separated data set names (data/loaders.py)")
g.add_argument("--eval_data", default="", help="held-out sets scored at the end, e.g. tiny-math,tiny-code")
g.add_argument("--train_mix", default="balanced", help="balanced (equal share of each data set per iteration) or proportional")
g.add_argument("--data_dir", default=None, help="folder holding local copies of hub data sets")
g.add_argument("--template", default="plain", help="prompt template: plain, dapo, code, chat")
g.add_argument("--out_dir", default="", help="run folder (default out/<cell>-seed<seed>)")
g = p.add_argument_group("objective (GPPO.md sections 4-6)")
g.add_argument("--objective", default="gppo", help="gppo, or a baseline: " + ", ".join(gppo.BASELINES))
g.add_argument("--divergence", default="kl", help="tv, chi2, kl, hellinger, js")
g.add_argument("--estimator", default="atomic", help="mc, atomic, binary")
g.add_argument("--delta", type=float, default=None, help="region size; default calibrates mc's lower bound to 0.8")
g.add_argument("--ratio_bounds", default="0.5,10", help="'low,high' bounds intersected with the region, or 'none'")
g.add_argument("--dual_clip", default="10", help="no gradient for A<0 tokens with ratio above this, or 'none'")
g.add_argument("--agg", default="token-mean", help="token-mean, seq-mean-token-mean, seq-mean-token-sum")
g = p.add_argument_group("rollout")
g.add_argument("--backend", default="vllm", help="vllm, or hf (transformers.generate fallback)")
g.add_argument("--prompts_per_iter", type=int, default=64, help="P: prompts sampled per iteration (all ranks)")
g.add_argument("--group_size", type=int, default=8, help="G: completions per prompt")
g.add_argument("--max_new_tokens", type=int, default=48, help="max response length, tokens")
g.add_argument("--max_model_len", type=int, default=256, help="vLLM context length, tokens")
g.add_argument("--mu_source", default="recompute", help="recompute (trainer, default) or vllm")
g.add_argument("--kv_cache_gib", type=int, default=1, help="vLLM CPU KV cache, GiB")
g.add_argument("--gpu_memory_utilization", type=float, default=0.4, help="vLLM share of GPU memory")
g.add_argument("--tensor_parallel_size", type=int, default=1, help="vLLM tensor parallel size")
g.add_argument("--sleep_mode", action="store_true", help="free vLLM's KV cache while training (GPU)")
g = p.add_argument_group("optimisation")
g.add_argument("--iters", type=int, default=60, help="RL iterations")
g.add_argument("--prompts_per_update", type=int, default=8, help="M: prompts per mini-batch; P/M updates per iteration")
g.add_argument("--micro_batch_size", type=int, default=64, help="sequences per forward/backward")
g.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (constant)")
g.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay")
g.add_argument("--grad_clip", type=float, default=1.0, help="max global gradient norm")
g.add_argument("--logp_chunk", type=int, default=4096, help="tokens per log-softmax chunk")
g = p.add_argument_group("options of mature trainers (all off by default; the paper uses none)")
g.add_argument("--overlong", default="off", help="truncated responses: off, mask (no loss), punish (DAPO soft punishment)")
g.add_argument("--overlong_buffer", type=int, default=4, help="punish: reward - 1 * (excess over max_new_tokens - buffer) / buffer")
g.add_argument("--drop_uniform_groups", action="store_true", help="DAPO dynamic sampling without the refill: drop groups whose rewards are all equal")
g.add_argument("--tis_cap", type=float, default=None, help="truncated IS: weight tokens by min(pi_old / mu_vllm, cap)")
g.add_argument("--kl_coef", type=float, default=0.0, help="KL penalty to a frozen reference (k3 estimator); 0 = off")
g.add_argument("--ref_model", default="", help="reference model for --kl_coef (default: --model)")
g = p.add_argument_group("checkpoints")
g.add_argument("--ckpt_every", type=int, default=20, help="save a resumable checkpoint every N iterations (and at exit); 0 = only at exit")
g.add_argument("--keep_last", type=int, default=2, help="checkpoints kept (older ones deleted)")
g.add_argument("--resume", nargs="?", const="latest", default=None,
               help="continue from out_dir's latest complete checkpoint, or from the checkpoint folder given")
g.add_argument("--save_rollouts", default="", help="debug: write every iteration's rollouts to this folder")
g.add_argument("--replay_rollouts", default="", help="debug: train on the rollouts a --save_rollouts run wrote (any process count)")
g = p.add_argument_group("run")
g.add_argument("--seed", type=int, default=0, help="seed for data order, sampling and init")
g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
g.add_argument("--sample_every", type=int, default=10, help="print a few completions every N iterations")
g.add_argument("--eval_k", type=int, default=8, help="k of avg@k for --eval_data")
g.add_argument("--wandb", default="", help="wandb project name (off when empty)")
args = p.parse_args()

# derived sizes and values, checked once, before anything is loaded
def bad(flag, value, accepted):
    raise ValueError(f"{flag}={value!r}; accepted: {accepted}")


for flag in ("prompts_per_iter", "group_size", "prompts_per_update", "max_new_tokens", "iters",
             "micro_batch_size", "logp_chunk", "keep_last", "overlong_buffer"):
    if getattr(args, flag) < 1:
        bad("--" + flag, getattr(args, flag), "an integer >= 1")
if args.prompts_per_iter % args.prompts_per_update:
    bad("--prompts_per_iter", args.prompts_per_iter, f"a multiple of --prompts_per_update={args.prompts_per_update}")
if args.group_size < 2:
    bad("--group_size", args.group_size, "2 or more (group-relative advantages need a group)")
if args.ckpt_every < 0:
    bad("--ckpt_every", args.ckpt_every, "an integer >= 0")
if args.tis_cap is not None and args.tis_cap <= 0:
    bad("--tis_cap", args.tis_cap, "a positive number")
if args.kl_coef < 0:
    bad("--kl_coef", args.kl_coef, "a number >= 0")
if args.overlong_buffer >= args.max_new_tokens:
    bad("--overlong_buffer", args.overlong_buffer, f"fewer tokens than --max_new_tokens={args.max_new_tokens}")
updates_per_iter = args.prompts_per_iter // args.prompts_per_update
ratio_bounds = None if args.ratio_bounds == "none" else tuple(float(x) for x in args.ratio_bounds.split(","))
dual_clip = None if args.dual_clip == "none" else float(args.dual_clip)
if args.objective == "gppo":
    gppo._check(args.divergence, args.estimator, args.delta, ratio_bounds, dual_clip, args.agg)  # fail fast
    cell = f"{args.divergence}-{args.estimator}"
elif args.objective in gppo.BASELINES:
    cell = args.objective
else:
    raise ValueError(f"--objective={args.objective!r}; accepted: gppo, {', '.join(gppo.BASELINES)}")
for flag, value, accepted in [("--mu_source", args.mu_source, ("recompute", "vllm")),
                              ("--train_mix", args.train_mix, ("balanced", "proportional")),
                              ("--overlong", args.overlong, ("off", "mask", "punish")),
                              ("--backend", args.backend, ("vllm", "hf"))]:
    if value not in accepted:
        bad(flag, value, ", ".join(accepted))
out_dir = args.out_dir or os.path.join("out", f"{cell}-seed{args.seed}")

accelerator = Accelerator(cpu=not torch.cuda.is_available())
rank, world = accelerator.process_index, accelerator.num_processes
master = accelerator.is_main_process
if args.tensor_parallel_size > 1 and world > 1:   # each rank samples its own prompts (rollout.py)
    bad("--tensor_parallel_size", args.tensor_parallel_size, f"1 when {world} training processes each run an engine")
if args.prompts_per_update % world:
    bad("--prompts_per_update", args.prompts_per_update, f"a multiple of the {world} processes")
if args.threads:
    torch.set_num_threads(args.threads)
random.seed(args.seed + rank); np.random.seed(args.seed + rank); torch.manual_seed(args.seed)


def log(*a):
    if master:
        print(*a, flush=True)


# ----------------------------------------------------------------------------------------------
# log-probs and entropy, chunked over tokens (choice 6)

def _chunk_logp_entropy(hidden, lm_head_weight, targets):
    logits = (hidden @ lm_head_weight.t()).float()                      # (n, V)
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)       # (n,)
    entropy = -(logp_all.exp() * logp_all).sum(-1)                      # (n,)
    return logp, entropy.detach()


def token_logprobs(model, ids, attn, resp_mask, chunk):
    """Log-prob of each next token and the policy's entropy there. ids: (B, T) -> (B, T-1) x 2."""
    # through the wrapped model's own forward, so that DDP syncs the gradients (a call into the
    # unwrapped body would skip it); logits_to_keep=1 keeps it from building the (B, T, V) logits
    out = model(input_ids=ids, attention_mask=attn, output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1][:, :-1]                                       # (B, T-1, H), normed
    head = accelerator.unwrap_model(model).lm_head.weight
    targets, where = ids[:, 1:], resp_mask[:, 1:].bool()                         # predict t+1
    h, y = hidden[where], targets[where]                                         # (N, H), (N,)
    parts = []
    for s in range(0, len(y), chunk):
        fn = _chunk_logp_entropy
        args_ = (h[s:s + chunk], head, y[s:s + chunk])
        parts.append(checkpoint(fn, *args_, use_reentrant=False) if torch.is_grad_enabled() else fn(*args_))
    logp = torch.zeros(targets.shape, dtype=torch.float32, device=ids.device)
    ent = torch.zeros(targets.shape, dtype=torch.float32, device=ids.device)
    if parts:
        logp = logp.masked_scatter(where, torch.cat([a for a, _ in parts]))
        ent = ent.masked_scatter(where, torch.cat([b for _, b in parts]))
    return logp, ent


def collate(batch, idx, pad_id, device, per_token=None):
    """Right-padded prompt+completion ids of samples `idx`, their completion mask, and
    `per_token` (one list of completion-length values per sample) laid out like the log-probs:
    position t holds the value for predicting token t+1. (B, T), (B, T), (B, T), (B, T-1)"""
    seqs = [batch.prompt_ids[i] + batch.completion_ids[i] for i in idx]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(idx), T), dtype=torch.long)
    resp = torch.zeros((len(idx), T), dtype=torch.long)
    values = torch.zeros((len(idx), T - 1))
    for j, i in enumerate(idx):
        n_p, n = len(batch.prompt_ids[i]), len(seqs[j])
        ids[j, :n], attn[j, :n], resp[j, n_p:n] = torch.tensor(seqs[j]), 1, 1
        if per_token is not None:
            values[j, n_p - 1:n - 1] = torch.as_tensor(per_token[i], dtype=torch.float32)
    return ids.to(device), attn.to(device), resp.to(device), values.to(device)


class PromptSampler:
    """Which prompts each iteration trains on: shuffled epochs without replacement over each data
    set (`--train_mix balanced`: every iteration takes an equal share of each) or over their union
    (`proportional`). Deterministic in (seed, iteration), identical on every rank, and its state
    (epoch and position per data set) is saved in checkpoints."""

    def __init__(self, rows, mix, seed):
        keys = [r["source"] for r in rows] if mix == "balanced" else ["all"] * len(rows)
        self.pools = [[i for i, k in enumerate(keys) if k == key] for key in dict.fromkeys(keys)]
        self.seed, self.epoch, self.pos = seed, [0] * len(self.pools), [0] * len(self.pools)
        self.order = [self._shuffled(p) for p in range(len(self.pools))]

    def _shuffled(self, p):
        return random.Random(self.seed * 1009 + p * 101 + self.epoch[p]).sample(self.pools[p], len(self.pools[p]))

    def take(self, n, it):
        shares = [n // len(self.pools) + (p < n % len(self.pools)) for p in range(len(self.pools))]
        out = []
        for p, k in enumerate(shares):
            if k > len(self.pools[p]):
                raise ValueError(f"--prompts_per_iter={n} asks {k} prompts of a data set with {len(self.pools[p])}")
            if self.pos[p] + k > len(self.pools[p]):     # next epoch, reshuffled
                self.epoch[p], self.pos[p] = self.epoch[p] + 1, 0
                self.order[p] = self._shuffled(p)
            out += self.order[p][self.pos[p]:self.pos[p] + k]
            self.pos[p] += k
        return random.Random(self.seed * 7 + it).sample(out, len(out))   # mix the data sets

    def state_dict(self):                             # for checkpoints: two small lists
        return {"epoch": list(self.epoch), "pos": list(self.pos)}

    def load_state_dict(self, state):
        self.epoch, self.pos = list(state["epoch"]), list(state["pos"])
        self.order = [self._shuffled(p) for p in range(len(self.pools))]


def policy_loss(logp, old_logp, adv, mask, global_count):
    if args.objective == "gppo":
        return gppo.gppo_loss(logp, old_logp, adv, mask, args.divergence, args.estimator,
                              delta=args.delta, ratio_bounds=ratio_bounds, dual_clip=dual_clip,
                              agg=args.agg, global_count=global_count)
    return gppo.BASELINES[args.objective](logp, old_logp, adv, mask, agg=args.agg,
                                           global_count=global_count)


def group_advantages(rewards, G):
    """GRPO: (R - mean_group) / (std_group + eps) per group of G completions. (P*G,) -> (P*G,)"""
    r = rewards.view(-1, G)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)


# ----------------------------------------------------------------------------------------------
# checkpoints: written to a temporary folder, then renamed into place (a crash never leaves a
# half-written folder under a final name), the last --keep_last kept

def save_policy(model, tokenizer, path):
    """The policy alone, in Hugging Face format (loadable by eval.py, vLLM and transformers)."""
    state = accelerator.get_state_dict(model)        # gathered from the shards under FSDP
    if master:
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    accelerator.wait_for_everyone()


def checkpoints(ckpt_dir):
    """Complete checkpoints, oldest first (a '.tmp' folder is an interrupted write: ignored)."""
    if not os.path.isdir(ckpt_dir):
        return []
    names = [n for n in os.listdir(ckpt_dir) if n.startswith("iter_") and not n.endswith(".tmp")]
    return [os.path.join(ckpt_dir, n) for n in sorted(names)]


def save_checkpoint(ckpt_dir, it, sampler, model, tokenizer):
    """Model, optimizer and every rank's RNG states (accelerate's save_state), the data position
    and the iteration: what --resume needs to continue as if never stopped."""
    path = os.path.join(ckpt_dir, f"iter_{it:06d}")
    tmp = path + ".tmp"
    if master:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)                      # model, optimizer, random_states_<rank>.pkl
    if master:
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"iter": it, "sampler": sampler.state_dict(), "args": vars(args)}, f)
            f.flush(); os.fsync(f.fileno())
    accelerator.wait_for_everyone()
    if master:
        os.replace(tmp, path)                        # the commit point
        for old in checkpoints(ckpt_dir)[:-args.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def load_checkpoint(path, sampler):
    """Restore what save_checkpoint wrote; returns the iteration it was taken after."""
    accelerator.load_state(path)
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    sampler.load_state_dict(state["sampler"])
    return state["iter"]


def resume_path(ckpt_dir):
    if args.resume == "latest":
        found = checkpoints(ckpt_dir)
        if not found:
            raise FileNotFoundError(f"--resume: no complete checkpoint in {ckpt_dir}")
        return found[-1]
    if not os.path.isfile(os.path.join(args.resume, "trainer_state.json")):
        raise FileNotFoundError(f"--resume={args.resume!r} is not a complete checkpoint folder "
                                f"(no trainer_state.json); complete ones: {checkpoints(ckpt_dir)}")
    return args.resume


class StopRequest:
    """Ctrl-C / SIGTERM: finish the running iteration, checkpoint, exit. A second one kills."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True
        log(f"\n{signal.Signals(signum).name}: stopping after this iteration (again to abort)")
        signal.signal(signal.SIGINT, signal.SIG_DFL); signal.signal(signal.SIGTERM, signal.SIG_DFL)


def gathered_weights(model):
    """(name, full tensor) one parameter at a time, for the rollout engine: under FSDP2 each
    parameter is a DTensor shard, gathered with full_tensor() only when the engine asks for it."""
    for name, t in accelerator.unwrap_model(model).state_dict().items():
        yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)


def save_rollouts(folder, it, batch):
    """--save_rollouts: this rank's RolloutBatch of iteration `it` as JSON (for --replay_rollouts)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"iter_{it:06d}_rank{rank:03d}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(dataclasses.asdict(batch), f)
    os.replace(path + ".tmp", path)


def replayed_rollouts(folder, it, take, G):
    """--replay_rollouts: the rollouts a --save_rollouts run sampled at iteration `it`, whatever its
    number of processes: its rank files are joined in rank order (the iteration's prompt order)
    and this rank takes its share, so runs on different world sizes train on the same batch."""
    files = sorted(f for f in os.listdir(folder) if f.startswith(f"iter_{it:06d}_rank"))
    if not files:
        raise FileNotFoundError(f"--replay_rollouts={folder!r} has no rollouts of iteration {it}")
    whole = {field.name: [] for field in dataclasses.fields(RolloutBatch)}
    for name in files:
        with open(os.path.join(folder, name)) as f:
            for k, v in json.load(f).items():
                whole[k] += v
    lo, hi = rank * len(take) * G, (rank + 1) * len(take) * G
    part = RolloutBatch(**{k: v[lo:hi] for k, v in whole.items()})
    if part.prompt_ids[::G] != [r["prompt_ids"] for r in take]:
        raise ValueError(f"--replay_rollouts={folder!r}: iteration {it}'s prompts differ from this run's "
                         "(replay needs the same --seed, --train_data, --prompts_per_iter and --group_size)")
    return part


# ----------------------------------------------------------------------------------------------
# options of mature trainers (all off by default)

def shape_rewards(rewards, batch):
    """--overlong punish (DAPO eq. 13's soft punishment): a response longer than
    max_new_tokens - buffer loses (excess / buffer), reaching -1 at the limit; truncated ones -1."""
    if args.overlong != "punish":
        return rewards
    start = args.max_new_tokens - args.overlong_buffer
    excess = torch.tensor([max(0, len(c) - start) for c in batch.completion_ids], dtype=torch.float32)
    return rewards - (excess / args.overlong_buffer).clamp(max=1.0)


def kept_samples(rewards, batch, G):   # rewards: after shape_rewards
    """Samples that take part in the updates: --drop_uniform_groups removes whole groups whose
    rewards are all equal (zero advantage, DAPO's dynamic sampling); --overlong mask removes
    truncated responses (they neither push nor pull)."""
    keep = torch.ones(len(rewards), dtype=torch.bool)
    if args.drop_uniform_groups:
        r = rewards.view(-1, G)
        keep &= (r.max(1).values > r.min(1).values).repeat_interleave(G)
    if args.overlong == "mask":
        keep &= ~torch.tensor(batch.truncated, dtype=torch.bool)
    return keep


def reference_kl(ref_model, ids, attn, resp, logp):
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (Schulman's
    unbiased, always-positive estimator, as GRPO's paper uses)."""
    with torch.no_grad():
        ref_lp, _ = token_logprobs(ref_model, ids, attn, resp, args.logp_chunk)
    d = ref_lp - logp
    return d.exp() - d - 1


# ----------------------------------------------------------------------------------------------
def main():
    os.makedirs(out_dir, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    model, opt = accelerator.prepare(model, opt)
    ref_model = None
    if args.kl_coef > 0:
        ref_model = AutoModelForCausalLM.from_pretrained(args.ref_model or args.model, dtype=torch.float32)
        ref_model = accelerator.prepare_model(ref_model.eval().requires_grad_(False), evaluation_mode=True)
    engine = make_engine(args.model, backend=args.backend, max_model_len=args.max_model_len,
                         seed=args.seed + rank, kv_cache_gib=args.kv_cache_gib,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         tensor_parallel_size=args.tensor_parallel_size, sleep_mode=args.sleep_mode)
    tok = engine.tokenizer
    rows = load_rows(args.train_data, "train", args.data_dir, args.template, tok)
    sampler, history, start = PromptSampler(rows, args.train_mix, args.seed), [], 0
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if args.resume:
        path = resume_path(ckpt_dir)
        start = load_checkpoint(path, sampler)
        engine.sync_weights(gathered_weights(model))          # the engine started from --model
        if os.path.exists(metrics_path):                      # rows past the checkpoint are redone
            history = [r for r in map(json.loads, open(metrics_path)) if r["iter"] <= start]
        log(f"resumed from {path} (after iteration {start})")
    if master:   # rewritten, not appended blindly: a crash may have logged iterations past `start`
        with open(metrics_path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in history)
        os.replace(metrics_path + ".tmp", metrics_path)
    log(f"{cell}: {len(rows)} train prompts | {updates_per_iter} updates/iter | {world} process(es) | out {out_dir}")
    if args.wandb and master:
        import wandb
        wandb.init(project=args.wandb, name=os.path.basename(out_dir), config=vars(args), resume="allow")
    metrics_file = open(metrics_path if master else os.devnull, "a")
    per_rank, G, dev = args.prompts_per_iter // world, args.group_size, accelerator.device
    stop, saved = StopRequest(), start

    for it in range(start + 1, args.iters + 1):
        t_iter = time.time()
        # -- 1. rollout: this rank's share of the iteration's prompts (whole groups) --
        chosen = sampler.take(args.prompts_per_iter, it)
        take = [rows[i] for i in chosen[rank * per_rank:(rank + 1) * per_rank]]
        t = time.time()
        if args.replay_rollouts:
            batch = replayed_rollouts(args.replay_rollouts, it, take, G)
        else:
            batch = engine.generate([r["prompt_ids"] for r in take], n=G, max_tokens=args.max_new_tokens,
                                    seed=args.seed * 100003 + it * 101 + rank)
        if args.save_rollouts:
            save_rollouts(args.save_rollouts, it, batch)
        time_rollout = time.time() - t
        engine.sleep()          # --sleep_mode: vLLM frees its KV cache and moves its weights off the GPU
        # -- 2. reward and group-relative advantages --
        t = time.time()
        rewards = torch.zeros(len(batch.texts))
        for task in sorted({r["task"] for r in take}):
            idx = [i for i in range(len(batch.texts)) if take[i // G]["task"] == task]
            got = reward.score(task, [batch.texts[i] for i in idx], [take[i // G]["ground_truth"] for i in idx])
            rewards[idx] = torch.tensor(got)
        time_reward = time.time() - t
        shaped = shape_rewards(rewards, batch)
        adv = group_advantages(shaped, G)
        keep = kept_samples(shaped, batch, G)
        # -- 3. behaviour log-probs mu, once, before any update --
        t = time.time()
        n = len(batch.texts)
        micro = [list(range(s, min(s + args.micro_batch_size, n))) for s in range(0, n, args.micro_batch_size)]
        old, tis, gap = [None] * n, [None] * n, []   # per sample i: (len_i,) values
        with torch.no_grad():
            for idx in micro:
                ids, attn, resp, vllm_lp = collate(batch, idx, tok.pad_token_id, dev, batch.logprobs)
                lp, _ = token_logprobs(model, ids, attn, resp, args.logp_chunk)
                m = resp[:, 1:].bool()
                gap.append((lp - vllm_lp).abs()[m])
                src = lp if args.mu_source == "recompute" else vllm_lp
                # truncated IS: the samples came from vLLM's mu_vllm, not from the trainer's
                # pi_old; weight each token by min(pi_old / mu_vllm, cap) (Yao et al., 2025)
                w = (lp - vllm_lp).exp().clamp(max=args.tis_cap) if args.tis_cap else torch.ones_like(lp)
                for j, i in enumerate(idx):
                    old[i], tis[i] = src[j][m[j]].cpu(), w[j][m[j]].cpu()
        time_logp = time.time() - t
        # -- 4. P/M updates, each a token-mean over its whole mini-batch --
        t = time.time()
        prompt_order = random.Random(args.seed * 7919 + it).sample(range(per_rank), per_rank)
        per_update = args.prompts_per_update // world
        # token-weighted sums over the iteration (ratio_max a max), so micro-batching does not
        # change what is logged
        acc, n_tok, grad_norms = {k: 0.0 for k in gppo.STATS + ("entropy", "kl_ref")}, 0.0, []
        for u in range(updates_per_iter):
            prompts_u = prompt_order[u * per_update:(u + 1) * per_update]
            samples = [q * G + j for q in prompts_u for j in range(G) if keep[q * G + j]]
            chunks = [samples[s:s + args.micro_batch_size] for s in range(0, len(samples), args.micro_batch_size)]
            local = sum(len(batch.completion_ids[i]) for i in samples)
            if args.agg == "token-mean":
                count = torch.tensor(float(local), device=dev)
            else:   # seq-mean-*: the denominator counts sequences with at least one token
                count = torch.tensor(float(sum(len(batch.completion_ids[i]) > 0 for i in samples)), device=dev)
            count = accelerator.reduce(count, "sum").item()
            if count == 0:          # every sample of this mini-batch dropped, on every rank
                continue
            for idx in chunks:
                ids, attn, resp, old_lp = collate(batch, idx, tok.pad_token_id, dev, old)
                lp, ent = token_logprobs(model, ids, attn, resp, args.logp_chunk)
                m = resp[:, 1:].float()
                a = adv[idx].to(dev)
                if args.tis_cap:    # a positive per-token weight on A is exactly TIS's weight on the loss
                    a = a[:, None] * collate(batch, idx, tok.pad_token_id, dev, tis)[3]
                # DDP averages gradients over ranks, so scale by world to keep the global mean
                loss, st = policy_loss(lp, old_lp, a, m, count / world)
                w = m.sum().item()
                if ref_model is not None:   # same normalisation as the policy loss
                    kl = reference_kl(ref_model, ids, attn, resp, lp)
                    loss = loss + args.kl_coef * (kl * m).sum() / (count / world)
                    acc["kl_ref"] += (kl.detach() * m).sum().item()
                accelerator.backward(loss)
                for k in gppo.STATS:
                    acc[k] = max(acc[k], st[k]) if k == "ratio_max" else acc[k] + st[k] * w
                acc["entropy"] += (ent * m).sum().item()
                n_tok += w
            gn = accelerator.clip_grad_norm_(model.parameters(), args.grad_clip)
            grad_norms.append(float(gn))
            opt.step()
            opt.zero_grad(set_to_none=True)
        time_update = time.time() - t
        # -- 5. new weights into the rollout engine (choice 7) --
        t = time.time()
        engine.wake_up()        # weights back in place before they are overwritten, as vLLM requires
        engine.sync_weights(gathered_weights(model))
        time_sync = time.time() - t

        # -- logging: gathered over ranks --
        lens = torch.tensor([len(c) for c in batch.completion_ids], dtype=torch.float32)
        rewards_all = accelerator.gather(rewards.to(dev)).cpu()
        lens_all = accelerator.gather(lens.to(dev)).cpu()
        trunc = accelerator.gather(torch.tensor(batch.truncated, dtype=torch.float32, device=dev)).cpu()
        kept = accelerator.gather(keep.float().to(dev)).cpu()
        shaped_all = accelerator.gather(shaped.to(dev)).cpu().view(-1, G)
        gap_all = torch.cat(gap)
        gap_sum = accelerator.reduce(torch.tensor([gap_all.sum().item(), len(gap_all)], dtype=torch.float64, device=dev), "sum")
        # the token-weighted sums of every rank (ratio_max: the largest of any rank)
        keys = [k for k in acc if k != "ratio_max"]
        sums = accelerator.reduce(torch.tensor([acc[k] for k in keys] + [n_tok], dtype=torch.float64, device=dev), "sum")
        acc.update(zip(keys, sums[:-1].tolist()))
        n_tok = sums[-1].item()
        acc["ratio_max"] = accelerator.gather(torch.tensor([acc["ratio_max"]], device=dev)).max().item()
        row = dict(iter=it, reward_mean=rewards_all.mean().item(), reward_std=rewards_all.std().item(),
                   solve_rate=(rewards_all.view(-1, G).max(1).values > 0).float().mean().item(),
                   response_len=lens_all.mean().item(), truncated_frac=trunc.mean().item(),
                   kept_frac=kept.mean().item(), overlong_penalty=(rewards_all - shaped_all.flatten()).mean().item(),
                   uniform_group_frac=(shaped_all.max(1).values == shaped_all.min(1).values).float().mean().item(),
                   lr=opt.param_groups[0]["lr"], logp_gap_vllm=(gap_sum[0] / gap_sum[1].clamp(min=1)).item(),
                   **{k: v if k == "ratio_max" else v / max(n_tok, 1.0) for k, v in acc.items()},
                   grad_norm=float(np.mean(grad_norms)) if grad_norms else 0.0,
                   time_rollout_s=time_rollout, time_reward_s=time_reward, time_logp_s=time_logp,
                   time_update_s=time_update, time_sync_s=time_sync)
        row["time_iter_s"] = time.time() - t_iter
        row["tokens_per_s"] = lens_all.sum().item() / row["time_iter_s"]
        history.append(row)
        metrics_file.write(json.dumps(row) + "\n"); metrics_file.flush()
        if args.wandb and master:
            wandb.log(row, step=it)
        log(f"iter {it}/{args.iters} | reward {row['reward_mean']:.3f} | solve {row['solve_rate']:.2f} | "
            f"clip {row['clip_frac']:.3f} | ent {row['entropy']:.3f} | len {row['response_len']:.1f} | "
            f"gn {row['grad_norm']:.2f} | {row['time_iter_s']:.1f}s")
        if args.sample_every and it % args.sample_every == 0:
            for i in range(0, min(len(batch.texts), 3 * G), G):
                log(f"  [{rewards[i]:.0f}] {take[i // G]['problem'].strip()!r} -> {batch.texts[i]!r}")
        # stop requests are agreed on by all ranks, so every rank checkpoints together
        stopping = accelerator.reduce(torch.tensor(float(stop.requested), device=dev), "sum").item() > 0
        if (args.ckpt_every and it % args.ckpt_every == 0) or stopping or it == args.iters:
            save_checkpoint(ckpt_dir, it, sampler, model, tok)
            saved = it
        if stopping:
            log(f"stopped after iteration {it}; continue with --resume (checkpoint in {ckpt_dir})")
            sys.exit(130)

    save_policy(model, tok, os.path.join(out_dir, "final"))
    if master:
        plot(history, os.path.join(out_dir, "dynamics.png"))
        log(f"saved {out_dir}/final, {out_dir}/metrics.jsonl, {out_dir}/dynamics.png, checkpoint {ckpt_dir} (iteration {saved})")
    if args.eval_data and master:
        engine_rows = load_rows(args.eval_data, "test", args.data_dir, args.template, tok)
        res = avg_at_k(engine, engine_rows, args.eval_k, args.max_new_tokens, seed=args.seed)
        log(json.dumps({"eval": res}))
    accelerator.wait_for_everyone()


def plot(history, path):
    """Reward and entropy against iteration (the paper's Figure 2 in spirit)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    its = [h["iter"] for h in history]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    ax[0].plot(its, [h["reward_mean"] for h in history]); ax[0].set_title(f"{cell}: reward")
    ax[1].plot(its, [h["entropy"] for h in history]); ax[1].set_title("entropy (nats/token)")
    for a in ax:
        a.set_xlabel("iteration"); a.grid(alpha=0.3)
    fig.tight_layout(); fig.savefig(path, dpi=120); plt.close(fig)


if __name__ == "__main__":
    main()
