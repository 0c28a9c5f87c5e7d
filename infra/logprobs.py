"""Per-token log-probs and entropy of a batch, in memory a 150K vocabulary can afford.

What token_logprobs computes is, in one line (train.py shows it beside its calls):
    model(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
1. Only the response tokens' logits are made, from the decoder's last hidden states, in chunks of at
   most `chunk_mb` of float32 logits; each chunk's logits are recomputed in the backward pass
   (torch.utils.checkpoint), so one chunk lives at a time.
2. The LM head's matmul runs at --head_precision (fp32 on the CPU, tf32 on CUDA, or bf16); the
   log-softmax is always float32: trainer/sampler mismatch in the ratio starts at the head.
3. `collate` lays samples out right-padded, with per-token values aligned to the log-probs
   (position t holds the value for predicting token t+1).
4. share_prompts: the samples of a pass that share a prompt (a group's G completions) go through
   the model as one row, the prompt once and each completion behind it, attending to the prompt
   and to itself only (`shared_prompt_rows`: a block mask, each completion's positions going on
   from the prompt's). A causal model's prompt states do not depend on what follows them, so
   every log-prob is the plain layout's and, summed over the group, so is the gradient (the prompt
   copy's gradient is the sum of the G copies'); the idea of Prefix Grouper, arXiv 2506.05433.
   The results come back in the plain layout, so nothing downstream changes.
"""
import torch
from accelerate.utils import extract_model_from_parallel
from torch.utils.checkpoint import checkpoint

from infra.distributed import full_tensor


def _chunk_logp_entropy(hidden, head, targets, precision=None, entropy_grad=False):
    """The LM head and log-softmax of one chunk. precision: bf16 multiplies bf16 inputs (float32
    accumulate); fp32 and tf32 multiply float32 inputs, on TF32 tensor cores when train.setup
    allowed them for the run (tf32 on CUDA). The log-softmax is float32 whatever the choice.
    The entropy keeps its graph only under entropy_grad (--entropy_coef): else it is a metric."""
    with torch.autocast(hidden.device.type, enabled=False):          # the head as chosen
        if precision == "bf16":
            logits = (hidden.bfloat16() @ head.bfloat16().t()).float()  # (n, V)
        else:
            logits = hidden.float() @ head.float().t()
        logp_all = logits.log_softmax(-1)
        logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (n,)
        entropy = -(logp_all.exp() * logp_all).sum(-1)                 # (n,)
    return logp, entropy if entropy_grad else entropy.detach()


SHARED_PROMPT_ATTENTION = ("sdpa", "eager")   # the attentions that take a 4D mask as given


def shared_prompt_rows(ids, attn, resp_mask, max_len):
    """The samples of a (B, T) right-padded batch packed one row per distinct prompt: the prompt,
    then each of its completions, in the order of the batch. Returns (ids, 4D boolean attention
    mask, position ids, (row, column) of the hidden state that predicts each response token, in
    the order of resp_mask[:, 1:]'s True entries), or None when no two samples share a prompt or
    a packed row would pass max_len tokens (its mask is max_len^2 booleans; the plain layout)."""
    n = attn.sum(1).tolist()
    n_prompt = [k - r for k, r in zip(n, resp_mask.sum(1).tolist())]
    tokens = ids.cpu()                          # one copy off the device, read row by row below
    rows = {}                                   # prompt tokens -> the samples that share them
    for i in range(len(n)):
        rows.setdefault(tuple(tokens[i, :n_prompt[i]].tolist()), []).append(i)
    lengths = [len(p) + sum(n[i] - n_prompt[i] for i in members) for p, members in rows.items()]
    if len(rows) == len(n) or max(lengths) > max_len:
        return None
    R, L = len(rows), max(lengths)
    packed = torch.zeros((R, L), dtype=ids.dtype)
    positions = torch.zeros((R, L), dtype=torch.long)
    # segment of each position: 0 the prompt, k the row's k-th completion, < 0 padding (unique)
    segment = -torch.arange(1, L + 1).repeat(R, 1)
    where = [None] * len(n)                     # sample -> (row, columns) of its predictors
    for r, (prompt, members) in enumerate(rows.items()):
        p = len(prompt)
        packed[r, :p], positions[r, :p], segment[r, :p] = torch.tensor(prompt), torch.arange(p), 0
        start = p
        for k, i in enumerate(members, 1):
            m = n[i] - p                        # the completion's tokens
            packed[r, start:start + m] = tokens[i, p:n[i]]
            positions[r, start:start + m] = torch.arange(p, p + m)
            segment[r, start:start + m] = k
            # each token is predicted by the position before it; the first, by the prompt's last
            cols = torch.arange(start - 1, start + m - 1)
            cols[:1] = p - 1
            where[i] = (r, cols)
            start += m
    causal = torch.ones((L, L), dtype=torch.bool).tril()
    same = segment[:, :, None] == segment[:, None, :]
    sees_prompt = (segment[:, None, :] == 0) & (segment[:, :, None] >= 0)
    mask = (causal & (same | sees_prompt))[:, None]             # (R, 1, L, L); padding sees itself
    row = torch.cat([torch.full_like(cols, r) for r, cols in where])
    col = torch.cat([cols for _, cols in where])
    device = ids.device
    return (packed.to(device), mask.to(device), positions.to(device),
            (row.to(device), col.to(device)))


def token_logprobs(model, ids, attn, resp_mask, chunk_mb=None, head_precision=None,
                   entropy_grad=False, share_prompts=0):
    """Log-prob of each next token and the policy's entropy there. ids: (B, T) -> (B, T-1) x 2.

    The forward goes through the (DDP/FSDP-)wrapped model, so its gradient hooks run, but asks for
    the logits of one position only; the decoder's output (the normed last hidden states) is taken
    with a forward hook. chunk_mb: MB of float32 logits per chunk; None: 1/32 of the GPU's free
    memory on CUDA (at least 256), 256 on the CPU. entropy_grad: the entropy with its gradient
    (recomputed in the backward pass like the log-probs), for an entropy bonus. share_prompts:
    the longest packed row of shared_prompt_rows (4. above); 0: the plain layout."""
    inner, seen = extract_model_from_parallel(model), {}
    targets, where = ids[:, 1:], resp_mask[:, 1:].bool()                 # t predicts t+1
    shared = shared_prompt_rows(ids, attn, resp_mask, share_prompts) if share_prompts else None
    hook = inner.get_decoder().register_forward_hook(lambda m, i, out: seen.update(h=out[0]))
    try:
        if shared is None:
            model(input_ids=ids, attention_mask=attn, logits_to_keep=1, use_cache=False)
        else:
            packed, mask, positions, _ = shared
            if inner.config._attn_implementation == "eager":   # it adds the mask to the scores
                mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, -torch.inf)
            model(input_ids=packed, attention_mask=mask, position_ids=positions,
                  logits_to_keep=1, use_cache=False)
    finally:
        hook.remove()
    head = full_tensor(inner.get_output_embeddings().weight)             # (V, H), whole
    h = seen["h"][:, :-1][where] if shared is None else seen["h"][shared[3]]   # (N, H)
    y = targets[where]                                                   # (N,)
    if chunk_mb is None:   # on GPUs larger chunks run the head at matmul speed
        free_mb = torch.cuda.mem_get_info(ids.device)[0] >> 20 if ids.is_cuda else 0
        chunk_mb = max(256, free_mb // 32)
    rows = max(1, (chunk_mb << 20) // (4 * head.shape[0]))             # tokens per chunk
    parts = []
    for s in range(0, len(y), rows):
        chunk = (h[s:s + rows], head, y[s:s + rows], head_precision, entropy_grad)
        if torch.is_grad_enabled():   # recomputed in backward; the chunk draws no random number,
            # and saving/restoring torch's generator (the default) would rewind it under vLLM's
            # sampler, which draws from it in --async_lag's thread at that moment
            parts.append(checkpoint(_chunk_logp_entropy, *chunk, use_reentrant=False,
                                    preserve_rng_state=False))
        else:
            parts.append(_chunk_logp_entropy(*chunk))
    logp = torch.zeros(targets.shape, dtype=torch.float32, device=ids.device)
    ent = torch.zeros(targets.shape, dtype=torch.float32, device=ids.device)
    if parts:
        logp = logp.masked_scatter(where, torch.cat([a for a, _ in parts]))
        ent = ent.masked_scatter(where, torch.cat([b for _, b in parts]))
    return logp, ent


def collate(batch, idx, pad_id, device, per_token=()):
    """Right-padded prompt+completion ids of samples `idx`, their completion mask, and each of
    `per_token` (lists of completion-length values per sample) laid out like the log-probs.
    (B, T), (B, T), (B, T), then (B, T-1) each."""
    seqs = [batch.prompt_ids[i] + batch.completion_ids[i] for i in idx]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(idx), T), dtype=torch.long)
    resp = torch.zeros((len(idx), T), dtype=torch.long)
    values = [torch.zeros((len(idx), T - 1)) for _ in per_token]
    for j, i in enumerate(idx):
        n_p, n = len(batch.prompt_ids[i]), len(seqs[j])
        ids[j, :n], attn[j, :n], resp[j, n_p:n] = torch.tensor(seqs[j]), 1, 1
        for v, src in zip(values, per_token):
            v[j, n_p - 1:n - 1] = torch.as_tensor(src[i], dtype=torch.float32)
    return [t.to(device) for t in (ids, attn, resp, *values)]
