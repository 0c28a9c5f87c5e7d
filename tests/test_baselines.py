"""Tests for the baseline objectives in gppo.py: hand-computed gradients on tiny batches, numerics."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import gppo
from test_gppo import extremes, finite, stat_floats, stats_well_formed  # the grid's extreme inputs

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
    # abs: a difference of two ~0.5 terms whose float32 log-ratios carry ~4e-8 rounding
    assert loss == pytest.approx(-(s0 - s1) / 2, abs=1e-7) and stats["clip_frac"] == 0
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
    loss, stats = gppo.clip_cov_loss(p, old, adv, MASK, detach=own_draw(logp, old, adv, MASK))
    loss.backward()
    close(p.grad, [[0.0, -2 * 1.1 / 5, -2 * 0.9 / 5], [2 * 1.0 / 5, 0.0, 0.0]])
    assert loss.item() == pytest.approx(-(2 * (1.5 + 1.1 + 0.9) - 2 * (1.0 + 0.95)) / 5, rel=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 5) and stats["clip_frac_upper"] == pytest.approx(1 / 5)


def own_draw(logp, old, adv, mask, clip_ratio=2e-4, seed=0):
    """Clip-Cov's draw on one batch: the candidates at the batch's centre, k of them picked (what
    infra/clip_cov.py does over a whole mini-batch, all micro-batches and ranks)."""
    valid, logp = mask.bool(), logp.detach()
    a = adv if adv.dim() == 2 else adv[:, None].expand_as(logp)   # per token or per sequence
    cand = gppo.clip_cov_candidates(logp, old, adv, mask, (logp[valid].mean(), a[valid].mean()))
    return gppo.clip_cov_draw(cand, int(valid.sum()), clip_ratio, torch.Generator().manual_seed(seed))


def test_clip_cov_generator_makes_draw_reproducible():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(64, 64, generator=g) * 6
    old, adv, mask = logp.clone(), torch.randn(64, generator=g) * 3, torch.ones(64, 64, dtype=torch.bool)

    def draw(seed):
        p = logp.clone().requires_grad_(True)
        loss, stats = gppo.clip_cov_loss(p, old, adv, mask,
                                         detach=own_draw(logp, old, adv, mask, 0.01, seed))
        loss.backward()
        return p.grad == 0, stats["clip_frac"]

    (a, fa), (b, fb), (c, _) = draw(1), draw(1), draw(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert fa == fb == pytest.approx(int(0.01 * 64 * 64) / (64 * 64))  # on-policy: only Clip-Cov clips


def test_baselines_share_the_stats_keys():
    for name, fn in gppo.BASELINES.items():
        _, _, stats = run(fn, [[1.0, 1.1, 0.9], [1.6, 0.7, 1.0]], [1.0, -1.0])
        assert stats_well_formed(stats) and stats["div_mean"] == 0.0, name
        assert all(math.isfinite(x) for x in stat_floats(stats)), name
        assert stats["ratio_max"] == pytest.approx(1.6, rel=1e-5), name
        # MU = [[0.5, 0.25, 0.8], [0.1, 0.5, (masked)]]: buckets 0, 0, 2 (0.25, 0.1), 3 (0.5, 0.8, 0.5)
        assert stats["token_frac_by_mu"] == pytest.approx([0, 0, 2 / 5, 3 / 5]), name


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
    assert all(math.isfinite(v) for v in stat_floats(stats))
    assert stats["token_frac_by_mu"] == [0.0] * 4 and stats["clip_frac_by_mu"] == [0.0] * 4


@pytest.mark.parametrize("name", sorted(set(gppo.BASELINES) - {"clip_cov"}))  # Clip-Cov: test below
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


def test_clip_cov_micro_batches_sum_to_whole_batch():
    # The trainer's recipe (gppo.clip_cov_loss docstring): candidates from the whole mini-batch's centre,
    # one draw of k = max(1, int(clip_ratio * N)) over the mini-batch, each micro-batch its slice of
    # `detach` and the global count. Its summed gradients are the whole-batch loss's with that detach.
    g = torch.Generator().manual_seed(5)
    B, T, clip_ratio = 12, 40, 0.02
    old = -torch.rand(B, T, generator=g) * 6
    logp = (old + 0.3 * torch.randn(B, T, generator=g)).clamp(max=0)
    adv, mask = torch.randn(B, generator=g) * 3, torch.rand(B, T, generator=g) < 0.8
    mask[2] = False
    valid = mask
    center = (logp[valid].mean(), adv[:, None].expand(B, T)[valid].mean())
    sizes = [5, 4, 3]
    parts = zip(*(x.split(sizes) for x in (logp, old, adv, mask)))
    candidates = torch.cat([gppo.clip_cov_candidates(*p, center) for p in parts])  # per micro-batch
    assert torch.equal(candidates, gppo.clip_cov_candidates(logp, old, adv, mask, center))
    n = int(mask.sum())
    detach = gppo.clip_cov_draw(candidates, n, clip_ratio, torch.Generator().manual_seed(0))
    assert int(detach.sum()) == max(1, int(clip_ratio * n)) and not (detach & ~candidates).any()

    def grad(*t, **kw):
        p = t[0].clone().requires_grad_(True)
        gppo.clip_cov_loss(p, *t[1:], clip_ratio=clip_ratio, **kw)[0].backward()
        return p.grad

    whole = grad(logp, old, adv, mask, detach=detach)
    split = [grad(*t, detach=d, global_count=n)
             for *t, d in zip(*(x.split(sizes) for x in (logp, old, adv, mask, detach)))]
    torch.testing.assert_close(torch.cat(split), whole)
    # the detached tokens lose their gradient; without `detach` the draw is this batch's own
    assert (whole[detach] == 0).all() and (whole[candidates & ~detach] != 0).any()


def test_clip_cov_without_detach_is_ppos_clip():
    # no draw handed in: no token is detached, the loss and its gradient are PPO's (eps 0.2)
    logp, old, adv, mask = random_batch(1)
    adv = adv[:, 0]
    _, g_cov, s_cov = grad_of(gppo.clip_cov_loss, logp, old, adv, mask)
    r = (logp - old).exp()
    clipped = ((adv[:, None] > 0) & (r > 1.2)) | ((adv[:, None] < 0) & (r < 0.8))
    assert clipped[mask].any() and (g_cov[mask & ~clipped] != 0).all() and (g_cov[clipped] == 0).all()
    assert s_cov["clip_frac"] == pytest.approx((clipped & mask).sum().item() / mask.sum().item())


# ---- DRPO (arXiv 2606.09821) and DGPO (arXiv 2603.14389): references written from the papers' formulas ----

def random_batch(seed, spread=0.5, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    old = torch.empty(B, T).uniform_(math.log(1e-3), 0, generator=g)
    logp = (old + spread * torch.randn(B, T, generator=g)).clamp(max=0)
    adv, mask = torch.randn(B, T, generator=g), torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True
    return logp, old, adv, mask


def grad_of(fn, logp, *args, **kw):
    p = logp.detach().clone().requires_grad_(True)
    loss, stats = fn(p, *args, **kw)
    loss.backward()
    return loss, p.grad, stats


def drpo_reference(logp, old, adv, mask, delta):
    """Their eq. 8 as written, float64, token-mean: -A r + |A| mu (r - 1)^2 / (2 delta)."""
    r, mu, A = (logp.double() - old.double()).exp(), old.double().exp(), adv.double()
    per_token = -A * r + A.abs() * mu * (r - 1) ** 2 / (2 * delta)
    return (per_token * mask).sum() / mask.sum(), {}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("delta", [0.1, 0.02, 12.5])
def test_drpo_matches_reference_and_weight(seed, delta):
    logp, old, adv, mask = random_batch(seed, spread=1.0)
    loss, g, stats = grad_of(gppo.drpo_loss, logp, old, adv, mask, delta=delta)
    ref_loss, ref_g, _ = grad_of(drpo_reference, logp.double(), old, adv, mask, delta)
    torch.testing.assert_close(g.double(), ref_g, rtol=1e-5, atol=1e-7)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    # the gradient is A grad r times their Table 1 weight 1 - sign(A)(pi - mu)/delta
    pi, mu, r = logp.double().exp(), old.double().exp(), (logp.double() - old.double()).exp()
    weight = 1 - adv.sign() * (pi - mu) / delta
    torch.testing.assert_close(g.double(), -(adv * r * weight * mask) / mask.sum(), rtol=1e-5, atol=1e-7)
    # clip_frac: the tokens whose weight reached or crossed 0
    assert stats["clip_frac"] == pytest.approx(((weight <= 0) & mask).sum().item() / mask.sum().item())
    if delta == 12.5:                        # the authors' threshold: the weight never reaches 0
        assert stats["clip_frac"] == 0 and weight.min() > 0.9


def test_drpo_weight_vanishes_on_the_dppo_boundary():
    # mu = 0.5, delta 0.1: pi - mu = +-0.1 is where the push stops; beyond it the gradient turns around
    mu, adv = torch.tensor([[0.5] * 6]), torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]])
    pi = torch.tensor([[0.55, 0.6, 0.65, 0.45, 0.4, 0.35]])
    _, g, stats = grad_of(gppo.drpo_loss, pi.log(), mu.log(), adv, torch.ones_like(mu).bool())
    assert (g[0, [0, 3]] * adv[0, [0, 3]] < 0).all()                  # inside: descent moves pi with A
    assert g[0, [1, 4]].abs().max() < 1e-6                             # on the boundary: weight 0
    assert (g[0, [2, 5]] * adv[0, [2, 5]] > 0).all()                   # beyond: corrective
    # clip_frac counts weight <= 0; exactly on the boundary float32 rounding decides, so step past it
    pi = torch.tensor([[0.55, 0.6001, 0.65, 0.45, 0.3999, 0.35]])
    _, _, stats = grad_of(gppo.drpo_loss, pi.log(), mu.log(), adv, torch.ones_like(mu).bool())
    assert stats["clip_frac"] == pytest.approx(4 / 6) and stats["clip_frac_upper"] == pytest.approx(2 / 6)


def test_drpo_rejects_bad_delta():
    with pytest.raises(ValueError, match="delta"):
        gppo.drpo_loss(*random_batch(0), delta=0.0)


def dgpo_reference(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, n=1, m=2):
    """The authors' VeRL branch (DGPO-RL verl/trainer/ppo/core_algos.py, ratio_mode "dgpo"), float64."""
    logp, old, adv = logp.double(), old.double(), adv.double()
    ratio = torch.exp(logp - old)
    low, high = 1 - eps_low, 1 + eps_high
    neg_low, pos_high = (ratio < low) & (adv < 0), (ratio > high) & (adv > 0)
    ratio = torch.where(neg_low, torch.exp(logp + n * logp.detach() - (n + 1) * old) / low ** n, ratio)
    ratio = torch.where(pos_high, torch.exp(logp + math.log(high) / m - old * (m - 1) / m - logp.detach() / m),
                        ratio)
    return ((-adv * ratio) * mask).sum() / mask.sum(), {}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("n,m", [(1, 2), (2, 2), (3, 1)])
def test_dgpo_matches_authors_code(seed, n, m):
    logp, old, adv, mask = random_batch(seed, spread=0.5)
    loss, g, stats = grad_of(gppo.dgpo_loss, logp, old, adv, mask, n=n, m=m)
    ref_loss, ref_g, _ = grad_of(dgpo_reference, logp.double(), old, adv, mask, n=n, m=m)
    torch.testing.assert_close(g.double(), ref_g, rtol=1e-5, atol=1e-7)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    r = (logp - old).exp()
    ppo = (((r < 0.8) & (adv < 0)) | ((r > 1.2) & (adv > 0))) & mask
    assert ppo.any() and stats["clip_frac"] == pytest.approx(ppo.sum().item() / mask.sum().item())


@pytest.mark.parametrize("adv,bound,far", [(-1.0, 0.8, 0.64), (1.0, 1.2, 1.44)])
def test_dgpo_continuous_at_the_clip_boundary(adv, bound, far):
    # just inside and just outside PPO's bound, value and gradient agree to first order; further out the
    # clipped token keeps a gradient of PPO's sign whose weight on grad pi (grad / r) has decayed
    step = 1e-4 if adv > 0 else -1e-4                                  # outwards
    ratios = {"in": bound * (1 - step), "out": bound * (1 + step), "far": far}
    res = {}
    for k, r in ratios.items():
        old = torch.tensor([[math.log(0.3)]])
        A, mask = torch.tensor([[adv]]), torch.tensor([[True]])
        loss, g, _ = grad_of(gppo.dgpo_loss, old + math.log(r), old, A, mask)
        res[k] = (loss.item(), g.item())
    assert res["out"][0] == pytest.approx(res["in"][0], rel=1e-3)
    assert res["out"][1] == pytest.approx(res["in"][1], rel=1e-3)
    assert res["in"][1] == pytest.approx(-adv * ratios["in"], rel=1e-5)   # PPO inside: d(-A r)/dlog pi
    assert res["far"][1] * -adv > 0                                    # same direction as PPO's
    assert abs(res["far"][1]) / far < abs(res["out"][1]) / ratios["out"] < 1.0001


def test_dgpo_rejects_bad_exponents():
    with pytest.raises(ValueError, match="m=0"):
        gppo.dgpo_loss(*random_batch(0), m=0)


@pytest.mark.parametrize("name", ["dgpo", "gspo"])
def test_asymmetric_clip_per_side(name):
    """eps_low and eps_high each bound their own side: with eps_low = 0.1, eps_high = 0.5, a ratio of 1.3
    pushed up is inside and 0.85 pushed down is outside (swapping the two would reverse both). One token
    per sequence, so GSPO's sequence ratio is the token's."""
    r = torch.tensor([[1.3], [0.85], [1.6], [0.95]])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    old = torch.full_like(r, math.log(0.3))
    logp, mask = (old + r.log()).requires_grad_(True), torch.ones_like(r, dtype=torch.bool)
    _, stats = gppo.BASELINES[name](logp, old, adv, mask, eps_low=0.1, eps_high=0.5)
    # clipped: 0.85 < 1 - 0.1 (lower side) and 1.6 > 1 + 0.5 (upper side); 1.3 and 0.95 are inside
    assert stats["clip_frac_lower"] == pytest.approx(1 / 4) and stats["clip_frac_upper"] == pytest.approx(1 / 4)
    if name == "gspo":   # GSPO clips whole sequences: no gradient there
        loss, _ = gppo.gspo_loss(logp, old, adv, mask, eps_low=0.1, eps_high=0.5)
        loss.backward()
        assert (logp.grad[:, 0] != 0).tolist() == [True, False, False, True]
