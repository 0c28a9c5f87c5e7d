"""Tests for the baseline objectives in gppo.py: hand-computed gradients on tiny batches, numerics."""
import math
import os
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # gppo.py lives at the repo root
import gppo  # noqa: E402
from test_gppo import extremes, finite  # noqa: E402  (same extreme inputs as the grid)

MU = [[0.5, 0.25, 0.8], [0.1, 0.5, 0.4]]
MASK = torch.tensor([[True, True, True], [True, True, False]])


def tiny(ratios, adv, mu=MU):
    """(logp, old_logp, advantages, mask) for a 2 x 3 batch with the given ratios pi/mu."""
    old = torch.tensor(mu).log()
    logp = (old + torch.tensor(ratios).log()).requires_grad_(True)
    return logp, old, torch.tensor(adv), MASK


def run(fn, ratios, adv, **kw):
    logp, old, a, m = tiny(ratios, adv)
    loss, stats = fn(logp, old, a, m, **kw)
    loss.backward()
    return loss.item(), logp.grad, stats


def close(grad, rows):
    torch.testing.assert_close(grad, torch.tensor(rows), rtol=1e-5, atol=1e-7)


def test_gspo_hand_example():
    # seq 0 near on-policy, A > 0: s0 = (1.0001 * 0.9999 * 1)^(1/3) is inside [1 - 3e-4, 1 + 4e-4].
    # seq 1 (two valid tokens), A < 0: s1 = (1.6 * 0.7)^(1/2) = 1.0583 > 1 + 4e-4, but A < 0 pushes
    # s down, so it is not clipped. Gradient of seq-mean-token-mean: -(1/2) A_i s_i / |y_i| per token.
    loss, g, stats = run(gppo.gspo_loss, [[1.0001, 0.9999, 1.0], [1.6, 0.7, 1.0]], [1.0, -1.0])
    s0, s1 = (1.0001 * 0.9999) ** (1 / 3), (1.6 * 0.7) ** 0.5
    close(g, [[-s0 / 6] * 3, [s1 / 4, s1 / 4, 0.0]])
    assert loss == pytest.approx(-(s0 - s1) / 2, rel=1e-6) and stats["clip_frac"] == 0
    # With A > 0 on seq 1 the whole sequence is clipped: no gradient, value -s1 kept.
    loss, g, stats = run(gppo.gspo_loss, [[1.0001, 0.9999, 1.0], [1.6, 0.7, 1.0]], [1.0, 1.0])
    close(g, [[-s0 / 6] * 3, [0.0, 0.0, 0.0]])
    assert stats["clip_frac"] == pytest.approx(2 / 5) and stats["clip_frac_upper"] == pytest.approx(2 / 5)


def test_gmpo_hand_example():
    # log-space clip [-0.4, 0.4], A = +1 for both: seq 0 untouched, g0 = (1 * 1.1 * 0.9)^(1/3).
    # seq 1: log 1.6 = 0.47 > 0.4 is clipped to 0.4 (no gradient); log 0.7 = -0.36 is kept.
    # g1 = exp((0.4 + log 0.7) / 2). Gradient: -(1/2) A g_i / |y_i| per unclipped token.
    loss, g, stats = run(gppo.gmpo_loss, [[1.0, 1.1, 0.9], [1.6, 0.7, 1.0]], [1.0, 1.0])
    g0, g1 = 0.99 ** (1 / 3), math.exp((0.4 + math.log(0.7)) / 2)
    close(g, [[-g0 / 6] * 3, [0.0, -g1 / 4, 0.0]])
    assert loss == pytest.approx(-(g0 + g1) / 2, rel=1e-6) and stats["clip_frac"] == pytest.approx(1 / 5)


def test_sapo_hand_example():
    # gate f(r) = sigmoid(tau (r - 1)) 4 / tau, f'(r) = 4 s (1 - s), tau 1.0 for A > 0, 1.05 for A < 0;
    # d/dlogp of -A f(r) is -A 4 s (1 - s) r, averaged per sequence then over the 2 sequences.
    ratios, adv = [[1.0, 1.1, 0.9], [1.6, 0.7, 1.0]], [1.0, -1.0]
    loss, g, _ = run(gppo.sapo_loss, ratios, adv)
    sig = lambda x: 1 / (1 + math.exp(-x))
    want, value = [], 0.0
    for row, n, a in zip(ratios, (3, 2), adv):
        tau = 1.0 if a > 0 else 1.05
        want.append([-a * 4 * sig(tau * (r - 1)) * (1 - sig(tau * (r - 1))) * r / (2 * n) if t < n else 0.0
                     for t, r in enumerate(row)])
        value += sum(-a * sig(tau * (r - 1)) * 4 / tau for r in row[:n]) / (2 * n)
    close(g, want)
    assert loss == pytest.approx(value, abs=1e-6)
    assert g[0, 0].item() == pytest.approx(-1 / 6)                    # at r = 1 the gate weight is 1


def test_cispo_hand_example():
    # token-mean over 5 tokens; weight sg(min(r, 1.2)); gradient -A w / 5. r = 1.6 gets w = 1.2 but
    # keeps its gradient; r = 0.7 is not clipped from below (no lower bound).
    loss, g, stats = run(gppo.cispo_loss, [[1.0, 1.1, 0.9], [1.6, 0.7, 1.0]], [1.0, -1.0])
    close(g, [[-1.0 / 5, -1.1 / 5, -0.9 / 5], [1.2 / 5, 0.7 / 5, 0.0]])
    assert loss == pytest.approx(-((1.0 + 1.1 + 0.9) - (1.2 + 0.7)) / 5, rel=1e-6)
    assert stats["clip_frac"] == pytest.approx(1 / 5)


def test_clip_cov_hand_example():
    # logp = [[-0.1, -2.0, -0.3], [-0.2, -1.5]], A = [2, -2]. Means over the 5 tokens: logp -0.82,
    # A 0.4. cov = (logp + 0.82)(A - 0.4) = [[1.152, -1.888, 0.832], [-1.488, 1.632]].
    # Token (0, 0) has r = 1.5 > 1.2 with A > 0: PPO clips it, so it is no Clip-Cov candidate.
    # Only (1, 1) (cov 1.632 in (1, 5)) remains; max(1, 2e-4 * 5) = 1 token is detached: that one.
    logp = torch.tensor([[-0.1, -2.0, -0.3], [-0.2, -1.5, -9.0]])
    ratios = torch.tensor([[1.5, 1.1, 0.9], [1.0, 0.95, 1.0]])
    old, adv = logp - ratios.log(), torch.tensor([2.0, -2.0])
    p = logp.clone().requires_grad_(True)
    loss, stats = gppo.clip_cov_loss(p, old, adv, MASK, generator=torch.Generator().manual_seed(0))
    loss.backward()
    close(p.grad, [[0.0, -2 * 1.1 / 5, -2 * 0.9 / 5], [2 * 1.0 / 5, 0.0, 0.0]])
    assert loss.item() == pytest.approx(-(2 * (1.5 + 1.1 + 0.9) - 2 * (1.0 + 0.95)) / 5, rel=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 5) and stats["clip_frac_upper"] == pytest.approx(1 / 5)


def test_clip_cov_generator_makes_draw_reproducible():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(64, 64, generator=g) * 6
    old, adv, mask = logp.clone(), torch.randn(64, generator=g) * 3, torch.ones(64, 64, dtype=torch.bool)

    def draw(seed):
        p = logp.clone().requires_grad_(True)
        loss, stats = gppo.clip_cov_loss(p, old, adv, mask, clip_ratio=0.01,
                                         generator=torch.Generator().manual_seed(seed))
        loss.backward()
        return p.grad == 0, stats["clip_frac"]

    (a, fa), (b, fb), (c, _) = draw(1), draw(1), draw(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert fa == fb == pytest.approx(int(0.01 * 64 * 64) / (64 * 64))  # on-policy: only Clip-Cov clips


def test_baselines_share_the_stats_keys():
    for name, fn in gppo.BASELINES.items():
        _, _, stats = run(fn, [[1.0, 1.1, 0.9], [1.6, 0.7, 1.0]], [1.0, -1.0])
        assert set(stats) == set(gppo.STATS) and stats["div_mean"] == 0.0, name
        assert stats["ratio_max"] == pytest.approx(1.6, rel=1e-5), name


@settings(max_examples=40, deadline=None)
@given(extremes(), st.sampled_from(sorted(gppo.BASELINES)), st.sampled_from(gppo.AGGS), st.booleans())
def test_baselines_finite_at_extremes(x, name, agg, bf16):
    logp, old, adv = x
    if bf16:
        logp, old = logp.bfloat16(), old.bfloat16()
    assert finite(gppo.BASELINES[name], logp, old, adv, torch.ones_like(logp, dtype=torch.bool), agg=agg)


@pytest.mark.parametrize("name", sorted(gppo.BASELINES))
def test_baselines_empty_mask_gives_zero(name):
    logp, old, adv, _ = tiny([[1.0, 1.1, 0.9], [1.6, 0.7, 1.0]], [1.0, -1.0])
    loss, stats = gppo.BASELINES[name](logp, old, adv, torch.zeros_like(MASK))
    loss.backward()
    assert loss.item() == 0 and torch.equal(logp.grad, torch.zeros_like(logp))
    assert all(math.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("name", ["gspo", "gmpo", "sapo", "cispo"])  # Clip-Cov's draw is per batch
@pytest.mark.parametrize("agg", gppo.AGGS)
def test_baselines_micro_batches_sum_to_whole_batch(name, agg):
    g = torch.Generator().manual_seed(3)
    old = torch.empty(6, 7).uniform_(-5, 0, generator=g)
    logp = (old + 0.02 * torch.randn(6, 7, generator=g)).clamp(max=0)
    adv, mask = torch.randn(6, generator=g), torch.rand(6, 7, generator=g) < 0.8
    count = mask.sum() if agg == "token-mean" else (mask.sum(-1) > 0).sum()

    def grad(*t, **kw):
        p = t[0].clone().requires_grad_(True)
        gppo.BASELINES[name](p, *t[1:], agg=agg, **kw)[0].backward()
        return p.grad

    parts = [grad(*t, global_count=count) for t in zip(*(x.split([2, 4]) for x in (logp, old, adv, mask)))]
    torch.testing.assert_close(torch.cat(parts), grad(logp, old, adv, mask))
