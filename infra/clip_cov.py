"""Clip-Cov's token selection over the whole mini-batch (all micro-batches and ranks), so that
micro-batching and the process count do not change which tokens it clips (gppo.clip_cov_loss).

1. A no-grad pass over the mini-batch's passes gives the centre (mean log-prob and advantage) and
   each rank's candidates (gppo.clip_cov_candidates).
2. k = max(1, clip_ratio x N) of all ranks' candidates are drawn by gppo.clip_cov_draw (the draw
   the loss makes on a single batch) with a generator seeded alike on every rank; each rank keeps
   the draws that fall on its own candidates.
3. The math (the loss's defaults, the candidates, the draw) is gppo.py's, handed in by the caller:
   this module is the whole-mini-batch bookkeeping around it and imports no algorithm.
"""
import inspect

import torch

from infra.logprobs import token_logprobs


def clip_cov_selection(args, acc, model, tensors, passes, seed, gppo):
    """The tokens Clip-Cov detaches: a (B, T-1) bool per pass of update()'s mini-batch.
    tensors(idx): the pass's tensors (train.pass_tensors, which lays out a filler pass); `gppo`:
    the gppo module (its clip_cov_loss, clip_cov_candidates, clip_cov_draw)."""
    defaults = {k: p.default for k, p in inspect.signature(gppo.clip_cov_loss).parameters.items()}
    kw = {k: args.loss_kwargs.get(k, defaults[k]) for k in ("eps", "cov_low", "cov_high",
                                                             "clip_ratio")}
    parts = []                                     # per pass: log-prob, mu, advantage, valid
    with torch.no_grad():
        for idx in passes:                         # as many forwards as training: collectives pair
            ids, attn, resp, old_logp, _, adv, mask = tensors(idx)
            lp, _ = token_logprobs(model, ids, attn, resp, args.logp_chunk_mb, args.head_precision,
                                   share_prompts=args.share_prompts)
            parts.append((lp, old_logp, adv[:, None].expand_as(lp), mask.bool()))
    tot = sum(torch.stack([torch.where(m, lp, 0).sum(), torch.where(m, a, 0).sum(),
                           m.sum()]).double() for lp, _, a, m in parts)
    s_lp, s_a, n = acc.reduce(tot, "sum").tolist()
    center = (s_lp / max(n, 1), s_a / max(n, 1))
    cands = [gppo.clip_cov_candidates(lp, o, a, m, center, kw["eps"], kw["cov_low"],
                                      kw["cov_high"]) & m for lp, o, a, m in parts]
    flat = torch.cat([c.flatten() for c in cands]).cpu()                 # this rank's, in order
    counts = acc.gather(flat.sum().view(1).to(acc.device)).tolist()      # every rank's number
    # gppo.clip_cov_draw over every rank's candidates at once (the same draw on every rank)
    drawn = gppo.clip_cov_draw(torch.ones(sum(counts), dtype=torch.bool), n, kw["clip_ratio"],
                               torch.Generator().manual_seed(seed))
    rank = acc.process_index
    detach = torch.zeros_like(flat)
    detach[flat.nonzero().squeeze(1)[drawn[sum(counts[:rank]):sum(counts[:rank + 1])]]] = True
    sizes = [c.numel() for c in cands]
    return [d.view_as(c).to(c.device) for d, c in zip(detach.split(sizes), cands)]
