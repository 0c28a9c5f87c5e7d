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
import argparse, json, math, os, random, shutil, signal, sys, time

import numpy as np
import torch
from accelerate import Accelerator
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM

import gppo
import reward
from eval import avg_at_k, load_rows
from rollout import make_engine

# ----------------------------------------------------------------------------------------------
# configuration: every knob is a flag; defaults are the embedded CPU default
p = argparse.ArgumentParser(description="GPPO trainer", fromfile_prefix_chars="@")
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
g = p.add_argument_group("run")
g.add_argument("--seed", type=int, default=0, help="seed for data order, sampling and init")
g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
g.add_argument("--sample_every", type=int, default=10, help="print a few completions every N iterations")
g.add_argument("--eval_k", type=int, default=8, help="k of avg@k for --eval_data")
g.add_argument("--wandb", default="", help="wandb project name (off when empty)")
args = p.parse_args()

# derived sizes, checked once
assert args.prompts_per_iter % args.prompts_per_update == 0, \
    f"--prompts_per_iter={args.prompts_per_iter} must be a multiple of --prompts_per_update={args.prompts_per_update}"
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
                              ("--backend", args.backend, ("vllm", "hf"))]:
    if value not in accepted:
        raise ValueError(f"{flag}={value!r}; accepted: {', '.join(accepted)}")
out_dir = args.out_dir or os.path.join("out", f"{cell}-seed{args.seed}")

accelerator = Accelerator(cpu=not torch.cuda.is_available())
rank, world = accelerator.process_index, accelerator.num_processes
master = accelerator.is_main_process
assert args.prompts_per_update % world == 0, \
    f"--prompts_per_update={args.prompts_per_update} must be a multiple of the {world} processes"
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
    body = accelerator.unwrap_model(model).model
    head = accelerator.unwrap_model(model).lm_head.weight
    hidden = body(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]  # (B, T-1, H)
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
    (`proportional`). Deterministic in (seed, iteration) and identical on every rank."""

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
# checkpoints: written to a temporary folder, then renamed into place

def save_policy(model, tokenizer, path):
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    accelerator.unwrap_model(model).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
def main():
    os.makedirs(out_dir, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    model, opt = accelerator.prepare(model, opt)
    engine = make_engine(args.model, backend=args.backend, max_model_len=args.max_model_len,
                         seed=args.seed + rank, kv_cache_gib=args.kv_cache_gib,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         tensor_parallel_size=args.tensor_parallel_size, sleep_mode=args.sleep_mode)
    tok = engine.tokenizer
    rows = load_rows(args.train_data, "train", args.data_dir, args.template, tok)
    log(f"{cell}: {len(rows)} train prompts | {updates_per_iter} updates/iter | {world} process(es) | out {out_dir}")
    if args.wandb and master:
        import wandb
        wandb.init(project=args.wandb, name=os.path.basename(out_dir), config=vars(args))
    metrics_file = open(os.path.join(out_dir, "metrics.jsonl"), "a" if master else os.devnull)
    sampler, history = PromptSampler(rows, args.train_mix, args.seed), []
    per_rank, G, dev = args.prompts_per_iter // world, args.group_size, accelerator.device

    for it in range(1, args.iters + 1):
        t_iter = time.time()
        # -- 1. rollout: this rank's share of the iteration's prompts (whole groups) --
        chosen = sampler.take(args.prompts_per_iter, it)
        take = [rows[i] for i in chosen[rank * per_rank:(rank + 1) * per_rank]]
        engine.wake_up()
        t = time.time()
        batch = engine.generate([r["prompt_ids"] for r in take], n=G, max_tokens=args.max_new_tokens,
                                seed=args.seed * 100003 + it * 101 + rank)
        time_rollout = time.time() - t
        engine.sleep()
        # -- 2. reward and group-relative advantages --
        t = time.time()
        rewards = torch.zeros(len(batch.texts))
        for task in sorted({r["task"] for r in take}):
            idx = [i for i in range(len(batch.texts)) if take[i // G]["task"] == task]
            got = reward.score(task, [batch.texts[i] for i in idx], [take[i // G]["ground_truth"] for i in idx])
            rewards[idx] = torch.tensor(got)
        time_reward = time.time() - t
        adv = group_advantages(rewards, G)
        # -- 3. behaviour log-probs mu, once, before any update --
        t = time.time()
        n = len(batch.texts)
        micro = [list(range(s, min(s + args.micro_batch_size, n))) for s in range(0, n, args.micro_batch_size)]
        old, gap = [None] * n, []          # old[i]: sample i's behaviour log-probs, (len_i,)
        with torch.no_grad():
            for idx in micro:
                ids, attn, resp, vllm_lp = collate(batch, idx, tok.pad_token_id, dev, batch.logprobs)
                lp, _ = token_logprobs(model, ids, attn, resp, args.logp_chunk)
                m = resp[:, 1:].bool()
                gap.append((lp - vllm_lp).abs()[m])
                src = lp if args.mu_source == "recompute" else vllm_lp
                for j, i in enumerate(idx):
                    old[i] = src[j][m[j]].cpu()
        time_logp = time.time() - t
        # -- 4. P/M updates, each a token-mean over its whole mini-batch --
        t = time.time()
        prompt_order = random.Random(args.seed * 7919 + it).sample(range(per_rank), per_rank)
        per_update = args.prompts_per_update // world
        # token-weighted sums over the iteration (ratio_max a max), so micro-batching does not
        # change what is logged
        acc, n_tok, grad_norms = {k: 0.0 for k in gppo.STATS + ("entropy",)}, 0.0, []
        for u in range(updates_per_iter):
            prompts_u = prompt_order[u * per_update:(u + 1) * per_update]
            samples = [q * G + j for q in prompts_u for j in range(G)]
            chunks = [samples[s:s + args.micro_batch_size] for s in range(0, len(samples), args.micro_batch_size)]
            local = sum(len(batch.completion_ids[i]) for i in samples)
            if args.agg == "token-mean":
                count = torch.tensor(float(local), device=dev)
            else:   # seq-mean-*: the denominator counts sequences with at least one token
                count = torch.tensor(float(sum(len(batch.completion_ids[i]) > 0 for i in samples)), device=dev)
            count = accelerator.reduce(count, "sum").item()
            for idx in chunks:
                ids, attn, resp, old_lp = collate(batch, idx, tok.pad_token_id, dev, old)
                lp, ent = token_logprobs(model, ids, attn, resp, args.logp_chunk)
                m = resp[:, 1:].float()
                # DDP averages gradients over ranks, so scale by world to keep the global mean
                loss, st = policy_loss(lp, old_lp, adv[idx].to(dev), m, count / world)
                accelerator.backward(loss)
                w = m.sum().item()
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
        engine.sync_weights(accelerator.unwrap_model(model).state_dict().items())
        time_sync = time.time() - t

        # -- logging: gathered over ranks --
        lens = torch.tensor([len(c) for c in batch.completion_ids], dtype=torch.float32)
        rewards_all = accelerator.gather(rewards.to(dev)).cpu()
        lens_all = accelerator.gather(lens.to(dev)).cpu()
        trunc = accelerator.gather(torch.tensor(batch.truncated, dtype=torch.float32, device=dev)).cpu()
        gap_all = torch.cat(gap)
        row = dict(iter=it, reward_mean=rewards_all.mean().item(), reward_std=rewards_all.std().item(),
                   solve_rate=(rewards_all.view(-1, G).max(1).values > 0).float().mean().item(),
                   response_len=lens_all.mean().item(), truncated_frac=trunc.mean().item(),
                   lr=opt.param_groups[0]["lr"], logp_gap_vllm=gap_all.mean().item() if len(gap_all) else 0.0,
                   **{k: v if k == "ratio_max" else v / max(n_tok, 1.0) for k, v in acc.items()},
                   grad_norm=float(np.mean(grad_norms)),
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

    if master:
        save_policy(model, tok, os.path.join(out_dir, "final"))
        plot(history, os.path.join(out_dir, "dynamics.png"))
        log(f"saved {out_dir}/final, {out_dir}/metrics.jsonl, {out_dir}/dynamics.png")
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
