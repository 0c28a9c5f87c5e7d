"""What a run measures and where it goes: the update's sums, the iteration's metrics row, the
metrics.jsonl / console / wandb writer, and the dynamics plot. README "What each metric means".

1. Every rank's sums travel in one gather per iteration (`MetricsLog.row`), so the row is the
   whole batch's whatever the process count (ratio_max: the largest of any rank).
2. The update's statistics are token-weighted sums over its passes (`UpdateLog`), turned into
   means only when the row is made.
3. One fixed-format console line per iteration, a few sampled completions every --sample_every,
   and every completion of the batch (all ranks', gathered) into samples.jsonl every
   --samples_every iterations (`SamplesLog`), as metrics.jsonl rewritten at --resume.
4. What the loss reports (its stats' names, its mu buckets) and the --answer_probe are the
   caller's (train.py hands them in): this module imports neither gppo.py nor data/.
"""
import json
import math
import os
import time

import numpy as np
import torch
from accelerate.utils import gather_object


# Where the trainer's weights at the iteration's start (the proximal policy) meet the sampler's
# log-probs, per token d = log proximal - log mu: at K = 0 the train/inference mismatch alone, at
# --async_lag K also K iterations of staleness. The row gives |d| (logp_gap_vllm) and, at K >= 1,
# the ratio e^d's mean, its k3 KL(mu || proximal) and the share of tokens in each bin of d:
MISMATCH_BINS = (-1.0, -0.3, -0.1, -0.03, 0.03, 0.1, 0.3, 1.0)


def mismatch_sums(samples):
    """Over the tokens of the samples whose start log-probs were computed (Samples.start_logp):
    [sum |d|, tokens, sum e^d, sum k3, tokens per bin] (zeros when none were)."""
    done = [i for i, lp in enumerate(samples.start_logp) if lp is not None]
    if not done:
        return [0.0] * (len(MISMATCH_BINS) + 5)
    lp = torch.cat([samples.start_logp[i] for i in done])
    mu = torch.cat([torch.tensor(samples.batch.logprobs[i], dtype=torch.float32) for i in done])
    d = (lp - mu).double()
    bins = torch.bucketize(d, torch.tensor(MISMATCH_BINS, dtype=torch.float64))
    return [d.abs().sum().item(), float(len(d)), d.exp().sum().item(),
            (d.exp() - 1 - d).sum().item()] + \
        torch.bincount(bins, minlength=len(MISMATCH_BINS) + 1).tolist()


class Stopwatch:
    """time_<phase>_s of each phase of an iteration, and time_iter_s of the whole."""

    def __init__(self):
        self.start = self.last = time.time()
        self.times = {}

    def lap(self, phase):
        now = time.time()
        self.times[f"time_{phase}_s"], self.last = now - self.last, now

    def total(self):
        return {**self.times, "time_iter_s": time.time() - self.start}


class UpdateLog:
    """What update() measures, as token-weighted sums over its passes (log rows turn them into
    means)."""

    def __init__(self, stats, buckets, lr=None):
        """stats: the names of the loss's scalar stats (gppo.STATS); buckets: its number of mu
        buckets (gppo.MU_BUCKETS)."""
        self.stats, self.lr = stats, lr           # lr: the lr of the iteration's first step
        self.sums = {k: 0.0 for k in stats + ("entropy", "kl_ref", "n_tok")}
        self.tok_b = [0.0] * buckets              # tokens per mu bucket
        self.clip_b = [0.0] * buckets             # clipped tokens per mu bucket
        self.norms, self.kls = [], []             # per step: gradient norm, KL(mu || pi) before
                                                  # it (train.minibatch_kl)

    def add(self, st, ent, mask, kl_ref=0.0):
        """One pass: the loss's stats, the entropy per token, the loss mask, the reference KL."""
        w = mask.sum().item()
        for k in self.stats:
            if k == "ratio_max":
                self.sums[k] = max(self.sums[k], st[k])
            else:
                self.sums[k] += st[k] * w
        for b in range(len(self.tok_b)):
            self.tok_b[b] += st["token_frac_by_mu"][b] * w
            self.clip_b[b] += st["clip_frac_by_mu"][b] * st["token_frac_by_mu"][b] * w
        self.sums["entropy"] += (ent * mask).sum().item()
        self.sums["kl_ref"] += kl_ref
        self.sums["n_tok"] += w


class MetricsLog:
    """The run's metrics: one row per iteration into metrics.jsonl, wandb and the console."""

    def __init__(self, args, run, history, probe=None):
        """run: train.setup's namespace (its acc, the data sets' names, its main-process log);
        probe: --answer_probe's data.probes.ProbeRun, or None."""
        acc = run.acc
        self.args, self.acc, self.sources, self.history = args, acc, run.sources, history
        self.log, self.model, self.probe = run.log, run.model, probe
        self.path = os.path.join(args.out_dir, "metrics.jsonl")
        if acc.is_main_process:   # rewritten, not appended blindly: a crash may have logged
            with open(self.path + ".tmp", "w") as f:   # iterations past the resumed checkpoint
                f.writelines(json.dumps(r) + "\n" for r in history)
            os.replace(self.path + ".tmp", self.path)
        self.file = open(self.path if acc.is_main_process else os.devnull, "a")
        self.samples = SamplesLog(args, acc, history[-1]["iter"] if history else 0)
        self.wandb = None
        if args.wandb and acc.is_main_process:
            import wandb   # optional: only runs that ask for it need it installed
            wandb.init(project=args.wandb, name=os.path.basename(args.out_dir), config=vars(args),
                       resume="allow")
            self.wandb = wandb

    def row(self, it, samples, upd, times):
        """The iteration's metrics row: every rank's sums, named, in one gather."""
        args, G, s, buckets = self.args, self.args.group_size, samples, range(len(upd.tok_b))
        gap = mismatch_sums(s)   # the trainer's start log-probs against vLLM's mu
        groups, shaped = s.rewards.view(-1, G), s.shaped.view(-1, G)
        src = [s.rows[i // G]["source"] for i in range(len(s.rewards))]
        by_source = {}
        for x in self.sources:
            by_source[f"r:{x}"] = sum(r for r, y in zip(s.rewards.tolist(), src) if y == x)
            by_source[f"n:{x}"] = src.count(x)
        parts = s.parts or {}   # what the part "overlong" took off (--overlong punish)
        penalty = -(args.reward_weights["overlong"] * parts["overlong"]).sum() \
            if "overlong" in parts else 0.0
        local = {"n": len(s.rewards), "reward": s.rewards.sum(), "reward2": (s.rewards ** 2).sum(),
                 "len": sum(map(len, s.batch.completion_ids)), "truncated": sum(s.batch.truncated),
                 "kept": s.keep.sum(), "penalty": penalty,
                 "groups": len(groups), "solved": (groups.max(1).values > 0).sum(),
                 "uniform": (shaped.max(1).values == shaped.min(1).values).sum(),
                 **{f"mismatch{j}": v for j, v in enumerate(gap)},   # 0, 1: |d| sum, tokens
                 **by_source, **{f"part:{k}": v.sum() for k, v in parts.items()},
                 **{k: v for k, v in upd.sums.items() if k != "ratio_max"},
                 **{f"tok{b}": upd.tok_b[b] for b in buckets},
                 **{f"clip{b}": upd.clip_b[b] for b in buckets}}
        values = [float(v) for v in local.values()] + [upd.sums["ratio_max"]]
        every = self.acc.gather(torch.tensor([values], dtype=torch.float64,
                                             device=self.acc.device)).cpu()
        t = dict(zip(local, every[:, :-1].sum(0).tolist()))
        N, n_tok = t["n"], max(t["n_tok"], 1.0)
        means = {k: t[k] / n_tok for k in upd.sums if k not in ("ratio_max", "n_tok")}
        row = dict(
            iter=it, reward_mean=t["reward"] / N,
            reward_std=math.sqrt(max(0.0, (t["reward2"] - t["reward"] ** 2 / N) / max(N - 1, 1))),
            reward_by_source={x: t[f"r:{x}"] / max(t[f"n:{x}"], 1) for x in self.sources},
            reward_parts={k: t[f"part:{k}"] / N for k in parts},
            solve_rate=t["solved"] / t["groups"], response_len=t["len"] / N,
            truncated_frac=t["truncated"] / N, kept_frac=t["kept"] / N,
            overlong_penalty=t["penalty"] / N, uniform_group_frac=t["uniform"] / t["groups"],
            lr=upd.lr, logp_gap_vllm=t["mismatch0"] / max(t["mismatch1"], 1), **means,
            ratio_max=every[:, -1].max().item(),
            token_frac_by_mu=[t[f"tok{b}"] / n_tok for b in buckets],
            clip_frac_by_mu=[t[f"clip{b}"] / max(t[f"tok{b}"], 1.0) for b in buckets],
            kl_k3_max=max(upd.kls, default=0.0), updates=len(upd.norms),
            grad_norm=float(np.mean(upd.norms)) if upd.norms else 0.0, **times)
        if args.async_lag:   # how stale the batch was, and proximal / mu (MISMATCH_BINS)
            n_mis = max(t["mismatch1"], 1.0)
            row.update(staleness=it - 1 - s.version, mismatch_ratio_mean=t["mismatch2"] / n_mis,
                       mismatch_kl_k3=t["mismatch3"] / n_mis,
                       mismatch_hist=[t[f"mismatch{j}"] / n_mis
                                      for j in range(4, len(MISMATCH_BINS) + 5)])
        if args.vllm_server and not args.async_lag:   # a server's samples: their versions' age
            row["staleness"] = it - 1 - s.version
        row["tokens_per_s"] = t["len"] / row["time_iter_s"]
        if self.probe and it % args.probe_every == 0:   # the weights after this update
            t0 = time.time()
            row["answer_prob"] = self.probe.measure(self.model, self.acc, args.micro_batch_size,
                                                    args.head_precision)
            row["time_probe_s"] = time.time() - t0
        return row

    def write(self, row, samples):
        """The row into metrics.jsonl and wandb, its console line, and now and then a few
        sampled completions with their rewards."""
        args, G, it = self.args, self.args.group_size, row["iter"]
        self.history.append(row)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb:
            self.wandb.log(row, step=it)
        self.log(f"iter {it}/{args.iters} | reward {row['reward_mean']:.3f} | "
                 f"solve {row['solve_rate']:.2f} | clip {row['clip_frac']:.3f} | "
                 f"ent {row['entropy']:.3f} | len {row['response_len']:.1f} | "
                 f"kl {row['kl_k3']:.4f} | gn {row['grad_norm']:.2f} | {row['time_iter_s']:.1f}s")
        if args.samples_every and (it % args.samples_every == 0 or it == args.iters):
            self.samples.write(it, samples)
        if args.sample_every and (it % args.sample_every == 0 or it == args.iters):
            texts = samples.batch.texts
            for i in range(0, min(len(texts), 3 * G), G):
                problem = samples.rows[i // G]["problem"].strip()
                self.log(f"  [{samples.rewards[i]:.0f}] {problem!r} -> {texts[i]!r}")

    def plot(self, path):
        """Reward and entropy against iteration (the paper's Figure 2 in spirit)."""
        import matplotlib   # only the main process plots, once, at the end
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        its = [h["iter"] for h in self.history]
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
        ax[0].plot(its, [h["reward_mean"] for h in self.history])
        ax[0].set_title(f"{self.args.cell}: reward")
        ax[1].plot(its, [h["entropy"] for h in self.history])
        ax[1].set_title("entropy (nats/token)")
        for a in ax:
            a.set_xlabel("iteration")
            a.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


class SamplesLog:
    """samples.jsonl in the run folder: one line per completion of the iterations it is written
    at, every rank's (one gather), by the main process:
        {"iter", "position" (the prompt's, 0..P-1), "sample" (0..G-1), "source", "prompt",
         "completion", "reward" (the judge's), "parts" ({part: value} of --reward), "shaped",
         "advantage", "length" (tokens), "truncated", "kept" (took part in the updates)}
    At --resume the lines of iterations past the checkpoint are dropped (they are redone)."""

    def __init__(self, args, acc, last_iter):
        self.args, self.acc = args, acc
        self.path = os.path.join(args.out_dir, "samples.jsonl")
        if acc.is_main_process:
            kept = []
            if os.path.exists(self.path):   # a resumed run: the lines up to its checkpoint
                with open(self.path) as f:
                    for line in f:
                        try:
                            if json.loads(line)["iter"] <= last_iter:
                                kept.append(line if line.endswith("\n") else line + "\n")
                        except (ValueError, KeyError):   # a line cut short by a kill
                            pass
            with open(self.path + ".tmp", "w") as f:
                f.writelines(kept)
            os.replace(self.path + ".tmp", self.path)

    def write(self, it, s):
        G = self.args.group_size
        lines = [json.dumps({
            "iter": it, "position": s.positions[i // G], "sample": i % G,
            "source": s.rows[i // G]["source"], "prompt": s.rows[i // G]["prompt"],
            "completion": s.batch.texts[i], "reward": s.rewards[i].item(),
            "parts": {k: v[i].item() for k, v in (s.parts or {}).items()},
            "shaped": s.shaped[i].item(), "advantage": s.advantages[i].item(),
            "length": len(s.batch.completion_ids[i]), "truncated": bool(s.batch.truncated[i]),
            "kept": bool(s.keep[i])}) + "\n" for i in range(len(s.batch.texts))]
        if self.acc.num_processes > 1:   # every rank's, in rank order
            lines = [x for part in gather_object([lines]) for x in part]
        if self.acc.is_main_process:
            with open(self.path, "a") as f:
                f.writelines(lines)
