"""--share_prompts (infra/logprobs.py 4.): each group's prompt through the model once, its
completions behind it, gives the plain layout's log-probs, entropies and gradients.

Run: .venv/bin/python -m pytest tests/test_share_prompts.py -q   (CPU; SmolLM2's case is in
tests/test_smollm2.py)

Every comparison runs the real model both ways on the same batch: right-padded rows of
prompt + completion (train.py's collate) against the packed rows, float32.
"""
from types import SimpleNamespace

import pytest
import torch

from conftest import MP, metrics, ok, run, train_cmd
from infra.logprobs import shared_prompt_rows, token_logprobs
from infra.lora import add_adapters
from test_scale import assert_same_update


def plain_batch(samples):
    """(ids, attn, resp) of (prompt, completion) token lists, right-padded as collate lays them."""
    T = max(len(p) + len(c) for p, c in samples)
    ids, attn, resp = (torch.zeros((len(samples), T), dtype=torch.long) for _ in range(3))
    for j, (p, c) in enumerate(samples):
        ids[j, :len(p) + len(c)] = torch.tensor(p + c)
        attn[j, :len(p) + len(c)] = 1
        resp[j, len(p):len(p) + len(c)] = 1
    return ids, attn, resp


def groups(vocab, seed=0):
    """Two groups with prompts of 7 and 4 tokens (3 and 2 completions of 1-9 tokens, not adjacent
    in the batch) and a lone sample: what a micro-batch holding part of a group looks like."""
    g = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(1, vocab, (n,), generator=g).tolist()   # noqa: E731
    a, b, lone = tokens(7), tokens(4), tokens(5)
    return [(a, tokens(5)), (b, tokens(3)), (a, tokens(1)), (a, tokens(9)), (b, tokens(6)),
            (lone, tokens(4))]


def both_layouts(model, samples, **kw):
    """Log-probs, entropies and every gradient of sum(logp) + 0.1 sum(entropy), plain and shared."""
    ids, attn, resp = plain_batch(samples)
    got = []
    for share in (0, 4096):
        model.zero_grad()
        lp, ent = token_logprobs(model, ids, attn, resp, share_prompts=share, entropy_grad=True, **kw)
        w = resp[:, 1:].float()
        ((lp * w).sum() + 0.1 * (ent * w).sum()).backward()
        got.append((lp.detach(), ent.detach(),
                    {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return got


def assert_same(plain, shared, lp_tol=2e-5, grad_rel=1e-5):
    (lp0, ent0, g0), (lp1, ent1, g1) = plain, shared
    assert (lp0 != 0).sum() > 20, "no response tokens: a vacuous comparison"
    assert (lp0 - lp1).abs().max() < lp_tol and (ent0 - ent1).abs().max() < lp_tol, \
        ((lp0 - lp1).abs().max(), (ent0 - ent1).abs().max())
    assert g0.keys() == g1.keys() and g0
    for n in g0:
        scale = g0[n].abs().max().clamp(min=1e-3)
        assert (g0[n] - g1[n]).abs().max() / scale < grad_rel, (n, (g0[n] - g1[n]).abs().max(), scale)


def tiny_model(tiny, attention="sdpa"):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32,
                                                attn_implementation=attention)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompts_give_the_plain_log_probs_and_gradients(tiny, attention):
    model = tiny_model(tiny, attention)
    assert_same(*both_layouts(model, groups(model.config.vocab_size)))


def test_shared_prompts_under_bf16_head_and_lora(tiny):
    model = tiny_model(tiny)
    args = SimpleNamespace(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_target_modules="all-linear")
    model = add_adapters(model, args)
    for p in model.parameters():   # adapters start with B = 0; move it so A gets a gradient too
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    plain, shared = both_layouts(model, groups(model.config.vocab_size, seed=1), head_precision="bf16")
    assert all("lora" in n for n in plain[2]), "base weights got a gradient under LoRA"
    assert_same(plain, shared)


def test_the_packed_rows_mask_and_positions_by_hand():
    # prompt [5, 6] with completions [7, 8] and [9]; the lone prompt [3] with completion [4]
    ids, attn, resp = plain_batch([([5, 6], [7, 8]), ([3], [4]), ([5, 6], [9])])
    packed, mask, positions, (row, col) = shared_prompt_rows(ids, attn, resp, max_len=64)
    assert packed.tolist() == [[5, 6, 7, 8, 9], [3, 4, 0, 0, 0]]
    assert positions.tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 0, 0]]
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0],    # prompt: causal
                                         [1, 1, 0, 0, 0],
                                         [1, 1, 1, 0, 0],    # completion 1: the prompt and itself
                                         [1, 1, 1, 1, 0],
                                         [1, 1, 0, 0, 1]]    # completion 2: not completion 1
    assert mask[1, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0],
                                         [0, 0, 0, 1, 0], [0, 0, 0, 0, 1]]   # padding sees itself
    # predictors in the order of the plain layout's response tokens: 7 <- 6, 8 <- 7; 4 <- 3; 9 <- 6
    assert list(zip(row.tolist(), col.tolist())) == [(0, 1), (0, 2), (1, 0), (0, 1)]


def test_no_shared_prompt_or_too_long_a_row_runs_plain():
    ids, attn, resp = plain_batch([([5, 6], [7, 8]), ([3], [4])])
    assert shared_prompt_rows(ids, attn, resp, max_len=64) is None            # nothing shared
    ids, attn, resp = plain_batch([([5, 6], [7, 8]), ([5, 6], [9])])
    assert shared_prompt_rows(ids, attn, resp, max_len=4) is None             # 5 tokens > 4
    assert shared_prompt_rows(ids, attn, resp, max_len=5) is not None


@pytest.mark.slow
@pytest.mark.parametrize("option", [[], ["--lora_rank", "4", "--lr", "3e-3", "--entropy_coef", "0.01",
                                         "--kl_coef", "0.05"]], ids=["plain", "lora+entropy+kl"])
def test_train_py_makes_the_plain_update_with_shared_prompts(tiny, recorded, tmp_path, option):
    """The same recorded batch trained with --share_prompts (the default) and with 0: the same
    first row and final weights, micro-batches of 3 cutting the groups of 8 (MP)."""
    replay = ["--replay_rollouts", str(recorded / "rollouts")]
    ok(run(train_cmd(tiny, tmp_path / "plain", *MP, *option, *replay, "--share_prompts", "0"))[0])
    ok(run(train_cmd(tiny, tmp_path / "shared", *MP, *option, *replay))[0])
    a, b = metrics(tmp_path / "plain")[0], metrics(tmp_path / "shared")[0]
    if "--kl_coef" in option:
        assert abs(a["kl_ref"] - b["kl_ref"]) <= 1e-5 * abs(a["kl_ref"]) + 1e-9, (a["kl_ref"], b["kl_ref"])
    assert_same_update(a, b, tmp_path / "plain", tmp_path / "shared", tiny, f"{option or 'plain'}: shared vs plain")
