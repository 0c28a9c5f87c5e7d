"""Tests for the GPPO grid in gppo.py: known methods as cells, regions, rules, numerics, config errors."""
import decimal
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

import gppo
from bench.regions import proximal_bounds

CELLS = [(d, e) for d in gppo.DIVERGENCES for e in gppo.ESTIMATORS]
# the alpha family (gppo.FAMILIES) at a few parameters: r^a's overflow for a > 1, +inf at r = 0 for a < 0
ALPHAS = ["alpha:-1", "alpha:0.5", "alpha:2", "alpha:3"]
ALPHA_CELLS = [(d, e) for d in ALPHAS for e in gppo.ESTIMATORS]
OFF = dict(ratio_bounds=None, dual_clip=None)  # the bare region, no dual clipping


def batch(seed, B=6, T=20, spread=0.4):
    """Random valid log-probs (pi <= 1), advantages (B,) and a mask with every row non-empty."""
    g = torch.Generator().manual_seed(seed)
    old = torch.empty(B, T).uniform_(math.log(1e-3), 0, generator=g)
    logp = (old + spread * torch.randn(B, T, generator=g)).clamp(max=0)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True
    return logp, old, adv, mask


def grad_and_stats(loss_fn, logp, *args, **kw):
    logp = logp.detach().clone().requires_grad_(True)
    loss, stats = loss_fn(logp, *args, **kw)
    loss.backward()
    return logp.grad, stats


def grad(loss_fn, logp, *args, **kw):
    return grad_and_stats(loss_fn, logp, *args, **kw)[0]


def textbook(logp, old, adv, mask, low, high):
    """Per-token-bound PPO clip written independently: -min(r A, clip(r, low, high) A), token-mean."""
    r, A = (logp - old).exp(), adv[:, None]
    obj = torch.minimum(r * A, torch.clamp(r, low, high) * A)
    return -(obj * mask).sum() / mask.sum(), {}


def masked_pg(logp, old, adv, mask, drop):
    """-A r over kept tokens, token-mean: the gradient of any mask-form clip."""
    r, A = (logp - old).exp(), adv[:, None].expand_as(logp)
    keep = mask & ~drop
    return -(torch.where(keep, A * r, 0)).sum() / mask.sum(), {}


def pushes_out(logp, old, adv):
    A = adv[:, None]
    return (logp > old) & (A > 0), (logp < old) & (A < 0)


def beyond(logp, old, adv, mask, low, high):
    """(upper, lower): valid tokens a clip [low, high] stops: r > high with A > 0, r < low with A < 0."""
    r, A = (logp - old).exp(), adv[:, None]
    return mask & (A > 0) & (r > high), mask & (A < 0) & (r < low)


# A gradient equality with an independent clip says nothing unless the batch's tokens were clipped, on
# both sides. CELL_BATCH (~830 valid tokens) with spread 0.4 (std of log r) against the mc regions'
# log r in about +-0.2, and 1.0 against the binary and atomic regions (they widen as mu falls), leaves the
# region on each side for at least 12 tokens of every seed below (kl-binary's lower side; others >= 32).
CELL_BATCH = dict(B=16, T=64)
MIN_SIDE = 10


def assert_clipped_both_sides(stats, mask, upper, lower):
    """At least MIN_SIDE valid tokens each were stopped above the region (upper) and below it (lower),
    as counted from the cell's closed form, and the loss's own stats count exactly those tokens."""
    n = mask.sum().item()
    assert upper.sum() >= MIN_SIDE and lower.sum() >= MIN_SIDE, (upper.sum(), lower.sum())
    assert stats["clip_frac_upper"] == pytest.approx(upper.sum().item() / n)
    assert stats["clip_frac_lower"] == pytest.approx(lower.sum().item() / n)


# ---- known methods are cells (the paper (arXiv 2610.13015) section 3.4) ----

@pytest.mark.parametrize("seed", range(3))
def test_tv_mc_is_ppo_clip(seed):
    logp, old, adv, mask = batch(seed, **CELL_BATCH, spread=0.4)
    ours, stats = grad_and_stats(gppo.gppo_loss, logp, old, adv, mask, "tv", "mc", delta=0.1, **OFF)
    torch.testing.assert_close(ours, grad(textbook, logp, old, adv, mask, 0.8, 1.2))
    assert_clipped_both_sides(stats, mask, *beyond(logp, old, adv, mask, 0.8, 1.2))


@pytest.mark.parametrize("seed", range(3))
def test_kl_mc_is_dapo_clip_higher(seed):
    logp, old, adv, mask = batch(seed, **CELL_BATCH, spread=0.4)
    low, high = math.exp(-0.23), math.exp(0.23)
    ours, stats = grad_and_stats(gppo.gppo_loss, logp, old, adv, mask, "kl", "mc", delta=0.23, **OFF)
    torch.testing.assert_close(ours, grad(textbook, logp, old, adv, mask, low, high))
    assert_clipped_both_sides(stats, mask, *beyond(logp, old, adv, mask, low, high))


@pytest.mark.parametrize("seed", range(3))
def test_tv_binary_is_dppo(seed):
    logp, old, adv, mask = batch(seed, **CELL_BATCH, spread=1.0)
    delta = 0.1
    up, down = pushes_out(logp, old, adv)
    pi, mu = logp.exp(), old.exp()
    upper, lower = mask & up & (pi - mu > delta), mask & down & (mu - pi > delta)   # |pi - mu| <= delta
    ours, stats = grad_and_stats(gppo.gppo_loss, logp, old, adv, mask, "tv", "binary", delta=delta, **OFF)
    torch.testing.assert_close(ours, grad(masked_pg, logp, old, adv, mask, upper | lower))
    assert_clipped_both_sides(stats, mask, upper, lower)


@pytest.mark.parametrize("seed", range(3))
def test_kl_binary_is_bernoulli_kl_mask(seed):
    logp, old, adv, mask = batch(seed, **CELL_BATCH, spread=1.0)
    logp = logp.clamp(max=-1e-3)  # the naive formula below needs 1 - pi > 0
    delta = gppo.default_delta("kl")
    pi, mu = logp.double().exp(), old.double().exp()
    bern = mu * torch.log(mu / pi) + (1 - mu) * torch.log((1 - mu) / (1 - pi))
    up, down = pushes_out(logp, old, adv)
    upper, lower = mask & up & (bern > delta), mask & down & (bern > delta)
    ours, stats = grad_and_stats(gppo.gppo_loss, logp, old, adv, mask, "kl", "binary", **OFF)
    torch.testing.assert_close(ours, grad(masked_pg, logp, old, adv, mask, upper | lower))
    assert_clipped_both_sides(stats, mask, upper, lower)


@pytest.mark.parametrize("seed", range(3))
def test_chi2_atomic_is_ripo(seed):
    logp, old, adv, mask = batch(seed, **CELL_BATCH, spread=1.0)
    delta = 0.04
    w = (delta / old.exp()).sqrt()
    ours, stats = grad_and_stats(gppo.gppo_loss, logp, old, adv, mask, "chi2", "atomic", delta=delta, **OFF)
    torch.testing.assert_close(ours, grad(textbook, logp, old, adv, mask, 1 - w, 1 + w))
    assert_clipped_both_sides(stats, mask, *beyond(logp, old, adv, mask, 1 - w, 1 + w))


def test_methods_are_cells():
    for div, est in gppo.METHODS.values():
        assert div in gppo.DIVERGENCES and est in gppo.ESTIMATORS


# ---- regions ----

@pytest.mark.parametrize("div,est", CELLS + ALPHA_CELLS)
def test_bounds_agree_with_mask(div, est):
    """On a dense ratio grid, a token is clipped by the loss exactly when proximal_bounds says so."""
    mus = torch.tensor([0.999, 0.9, 0.5, 0.1, 0.01, 1e-3, 1e-4])
    low, high = proximal_bounds(mus.log(), div, est, ratio_bounds=None)
    assert (low < 1).all() and (high > 1).all()                     # every region contains r = 1
    x = torch.linspace(-19, 19, 1901, dtype=torch.float64)            # log r; inside the +-20 clamp
    x = x[None, :].clamp(max=-mus.double().log()[:, None])           # binary: pi <= 1
    old = mus.log()[:, None].expand_as(x).float()
    logp = (old.double() + x).float()
    log_r = (logp - old).double()                                     # the ratio the loss sees
    adv = torch.where(log_r > 0, 1.0, -1.0).float()                   # push every token outwards
    g = grad(gppo.gppo_loss, logp, old, adv, torch.ones_like(logp, dtype=torch.bool), div, est, **OFF)
    inside = (log_r <= high.log()[:, None]) & (log_r >= low.log()[:, None])
    lb, hb = low.log()[:, None], high.log()[:, None]
    far = ((log_r - hb).abs() > 1e-4) & ((log_r - lb).abs() > 1e-4) & (log_r != 0)
    assert torch.equal((g != 0)[far], inside[far])


@pytest.mark.parametrize("div,high", [("tv", 1.2), ("chi2", 1.2), ("kl", 1.25), ("hellinger", 1.2223)])
def test_default_delta_calibrates_mc(div, high):
    low, hi = proximal_bounds(torch.tensor([-0.5]), div, "mc", ratio_bounds=None)
    assert low.item() == pytest.approx(0.8, abs=1e-9) and hi.item() == pytest.approx(high, abs=5e-5)


def test_default_deltas():
    want = {"tv": 0.1, "chi2": 0.04, "hellinger": 0.011146, "kl": 0.22314}
    for div, delta in want.items():
        assert gppo.default_delta(div) == pytest.approx(delta, rel=1e-4)
    low, _ = proximal_bounds(torch.tensor([-1.0]), "js", "mc", ratio_bounds=None)
    assert low.item() == pytest.approx(0.8, abs=1e-9)                 # js is calibrated by bisection too
    # alpha:a: |f_a(0.8)| = |0.8^a - 0.8 a + a - 1| / |a (a - 1)|; a = 1, 0: the two KLs' limits
    for a in (-1.0, 0.5, 2.0, 3.0, -3.0, 7.0):
        assert gppo.default_delta(f"alpha:{a}") == pytest.approx(abs((0.8 ** a - 0.8 * a + a - 1) / (a * (a - 1))))
    assert gppo.default_delta("alpha:1") == pytest.approx(0.8 * math.log(0.8) - 0.8 + 1)
    assert gppo.default_delta("alpha:0") == pytest.approx(0.8 - 1 - math.log(0.8))
    for a in ALPHAS:
        low, _ = proximal_bounds(torch.tensor([-1.0]), a, "mc", ratio_bounds=None)
        assert low.item() == pytest.approx(0.8, abs=1e-9), a


@pytest.mark.parametrize("a", [-2.5, -1e-9, 1e-9, 0.3, 0.5, 0.8, 1 - 1e-9, 1 + 1e-9, 2.0, 3.0, 40.0])
def test_alpha_is_its_formula(a):
    """f_a against (r^a - a r + a - 1) / (a (a - 1)) evaluated in 80-digit decimals: both of gppo's
    branches (a < 1/2, a >= 1/2), and parameters next to the limits, where float64 arithmetic on
    the formula as written would lose most digits."""
    f = gppo.get_divergence(f"alpha:{a}")
    r = torch.tensor([0.0, 1e-30, 0.01, 0.3, 0.8, 0.999, 1.001, 1.25, 4.0, 1e3, 1e30], dtype=torch.float64)
    with decimal.localcontext(decimal.Context(prec=80)):
        A = decimal.Decimal(a)
        for x, got in zip(r.tolist(), f(r).tolist()):
            if x == 0:
                assert got == pytest.approx(1 / a if a > 0 else math.inf, rel=1e-12)
                continue
            X = decimal.Decimal(x)
            want = float((X ** A - A * X + A - 1) / (A * (A - 1)))
            assert got == pytest.approx(want, rel=1e-9, abs=1e-300), (x, got, want)


def test_alpha_limits_are_the_kls():
    """alpha:1 and alpha:0 are the limits a -> 1 and a -> 0 (no jump at either side), and
    alpha:2 = chi2 / 2, alpha:0.5 = 2 hellinger as generators."""
    r = torch.logspace(-6, 6, 121, dtype=torch.float64)
    for lim, near in ((1, 1e-7), (0, 1e-7)):
        at = gppo.get_divergence(f"alpha:{lim}")(r)
        for side in (lim - near, lim + near):
            torch.testing.assert_close(gppo.get_divergence(f"alpha:{side}")(r), at, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(gppo.get_divergence("alpha:2")(r), gppo.chi2(r) / 2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gppo.get_divergence("alpha:0.5")(r), 2 * gppo.hellinger(r), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("est", list(gppo.ESTIMATORS))
@pytest.mark.parametrize("a,named", [("alpha:2", "chi2"), ("alpha:0.5", "hellinger")])
def test_alpha_regions_equal_named(a, named, est):
    """f_2 = chi2 / 2 and f_0.5 = 2 hellinger: default_delta scales by the same factor, so every
    cell's region is the named divergence's: the same bounds and the same tokens clipped."""
    mus = torch.logspace(-6, math.log10(0.999), 200, dtype=torch.float64)
    got, want = (proximal_bounds(mus.log(), d, est, ratio_bounds=None) for d in (a, named))
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w.tolist(), rel=1e-9, abs=1e-12)
    logp, old, adv, mask = batch(5, **CELL_BATCH, spread=1.0)
    g_alpha, s_alpha = grad_and_stats(gppo.gppo_loss, logp, old, adv, mask, a, est)
    g_named, s_named = grad_and_stats(gppo.gppo_loss, logp, old, adv, mask, named, est)
    assert torch.equal(g_alpha, g_named) and s_alpha["clip_frac"] == s_named["clip_frac"] > 0


def test_binary_complement_near_mu_one():
    # pi = 0.9 against mu = 1 - 1e-30 (float32 rounds mu to 1): the complement moved from 1e-30 to
    # 0.1, a chi2 of 1e28, so a token pushed down is clipped. At mu == 1 exactly there is no
    # complement and the region is chi2-mc's, capped at r = 1; r = 0.9 is inside it.
    old = torch.tensor([[-1e-30, 0.0]])
    logp, adv, mask = torch.full_like(old, math.log(0.9)), -torch.ones_like(old), torch.ones_like(old).bool()
    kept = grad(gppo.gppo_loss, logp, old, adv, mask, "chi2", "binary", **OFF) != 0
    assert kept.tolist() == [[False, True]]


def test_bounds_intersect_ratio_bounds():
    low, high = proximal_bounds(torch.tensor([math.log(1e-3)]), "kl", "atomic")
    assert (low.item(), high.item()) == (0.5, 10.0)


# ---- chi2- and hellinger-binary against an oracle derived by hand ----
# gppo.py bisects these regions on its own D (proximal_bounds), so test_bounds_agree_with_mask cannot
# catch a wrong formula the two share. The oracle below is derived on paper from eq. 20 and checked here
# against the definition in plain Python floats; nothing in it calls gppo.
#
# Binary: D(r) = mu f(r) + (1 - mu) f(r_c), r_c = (1 - pi)/(1 - mu), pi = mu r in [0, 1].
# chi2: r_c - 1 = mu (1 - r)/(1 - mu), so D = mu (r-1)^2 + mu^2 (r-1)^2/(1 - mu) = mu (r-1)^2/(1 - mu),
#   and the region is |r - 1| <= w = sqrt(delta (1 - mu)/mu), cut to [0, 1/mu].
# hellinger: expanding both squares (mu sqrt r = sqrt(mu pi)), D = 2 (1 - sqrt(mu pi) - sqrt((1-mu)(1-pi))):
#   twice one minus the Bhattacharyya coefficient of Bernoulli(mu) and Bernoulli(pi). Put sqrt(mu) = cos a,
#   sqrt(1-mu) = sin a, sqrt(pi) = cos b, sqrt(1-pi) = sin b (a, b in [0, pi/2]): the coefficient is
#   cos(b - a), so the region is the arc |b - a| <= theta = arccos(1 - delta/2) (the "spherical" geometry
#   of the paper (arXiv 2610.13015) section 3.2, eq. 17). pi = cos^2 b falls as b grows:
#   pi_high = cos^2(max(a - theta, 0)) and pi_low = cos^2(a + theta), or 0 once a + theta >= pi/2.

PLAIN_F = {"chi2": lambda r: (r - 1) ** 2, "hellinger": lambda r: (math.sqrt(r) - 1) ** 2}   # eqs. 15, 17
PLAIN_DELTA = {"chi2": 0.2 ** 2, "hellinger": (math.sqrt(0.8) - 1) ** 2}   # |f(0.8)|, the paper's section 4.1
CLOSED_D = {"chi2": lambda mu, r: mu * (r - 1) ** 2 / (1 - mu),
            "hellinger": lambda mu, r: 2 * (1 - mu * math.sqrt(r) - math.sqrt((1 - mu) * (1 - mu * r)))}
# both regimes of each side occur: a side reaches its end of [0, 1/mu] (chi2: low for mu <= delta/(1+delta),
# high for mu >= 1/(1+delta); hellinger: mu <= sin^2 theta = 0.0111, mu >= cos^2 theta = 0.9889), or not
ORACLE_MUS = [1e-6, 1e-4, 1e-3, 0.01, 0.02, 0.05, 0.1, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99, 0.999]


def binary_by_definition(div, mu, r):
    """Eq. 20 as written, in Python floats: the f-divergence of the partition {sampled token, the rest}."""
    f = PLAIN_F[div]
    return mu * f(r) + (1 - mu) * f((1 - mu * r) / (1 - mu))


def oracle_bounds(div, mu, delta):
    """(low, high) of r for the binary region, from the closed forms above; 0 < mu < 1."""
    if div == "chi2":
        w = math.sqrt(delta * (1 - mu) / mu)
        return max(1 - w, 0.0), min(1 + w, 1 / mu)
    a, theta = math.acos(math.sqrt(mu)), math.acos(1 - delta / 2)
    pi_low = 0.0 if a + theta >= math.pi / 2 else math.cos(a + theta) ** 2
    return pi_low / mu, math.cos(max(a - theta, 0.0)) ** 2 / mu


@pytest.mark.parametrize("div", ["chi2", "hellinger"])
def test_binary_closed_form_is_definition(div):
    """The hand-simplified D equals eq. 20 evaluated as written, for pi = mu r across [0, 1]."""
    for mu in ORACLE_MUS:
        for pi in [k / 20 for k in range(21)] + [mu * 0.999, mu * 1.001]:
            r = pi / mu
            want = binary_by_definition(div, mu, r)
            assert CLOSED_D[div](mu, r) == pytest.approx(want, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("div", ["chi2", "hellinger"])
def test_binary_oracle_bounds_solve_definition(div):
    """Each oracle bound inside (0, 1/mu) is where eq. 20 crosses delta: D = delta on it, below just inside
    and above just outside; a bound at an end of [0, 1/mu] has D <= delta there (the side never closes)."""
    delta, low_ends, high_ends = PLAIN_DELTA[div], 0, 0
    for mu in ORACLE_MUS:
        D = lambda r: binary_by_definition(div, mu, r)
        low, high = oracle_bounds(div, mu, delta)
        if high < 1 / mu:
            assert D(high) == pytest.approx(delta, rel=1e-9)
            assert D(high * (1 - 1e-6)) < delta < D(high * (1 + 1e-6))
        else:                                                         # open up to pi = 1
            assert high == 1 / mu and D(high) <= delta
            high_ends += 1
        if low > 0:
            assert D(low) == pytest.approx(delta, rel=1e-9)
            assert D(low * (1 + 1e-6)) < delta < D(low * (1 - 1e-6))
        else:                                                         # open down to pi = 0
            assert D(0.0) <= delta
            low_ends += 1
    assert 0 < low_ends < len(ORACLE_MUS) and 0 < high_ends < len(ORACLE_MUS)   # both regimes were seen


@pytest.mark.parametrize("div", ["chi2", "hellinger"])
def test_binary_bounds_match_oracle(div):
    """gppo.proximal_bounds (bisection on gppo's own D) finds the oracle's bounds, on a dense mu grid."""
    delta = PLAIN_DELTA[div]
    mus = torch.logspace(-6, math.log10(0.999), 400, dtype=torch.float64)
    low, high = proximal_bounds(mus.log(), div, "binary", delta=delta, ratio_bounds=None)
    want = [oracle_bounds(div, mu, delta) for mu in mus.tolist()]
    assert low.tolist() == pytest.approx([lo for lo, _ in want], rel=1e-9, abs=1e-12)
    assert high.tolist() == pytest.approx([hi for _, hi in want], rel=1e-9)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("div", ["chi2", "hellinger"])
def test_binary_mask_matches_oracle(div, seed):
    """gppo_loss gives no gradient to exactly the tokens the oracle's region stops: r > high with A > 0 or
    r < low with A < 0. Tokens within a relative 1e-4 of a bound are left out, so rounding decides none."""
    logp, old, adv, mask = batch(seed, B=32, T=64, spread=1.0)
    delta = PLAIN_DELTA[div]
    bounds = [oracle_bounds(div, mu, delta) for mu in old.double().exp().flatten().tolist()]
    low, high = torch.tensor(bounds, dtype=torch.float64).T.reshape(2, *old.shape)
    log_r = (logp - old).double()                                    # the ratio the loss sees
    far = ((log_r - high.log()).abs() > 1e-4) & ((log_r - low.log()).abs() > 1e-4) & mask
    A = adv[:, None]
    upper, lower = far & (A > 0) & (log_r > high.log()), far & (A < 0) & (log_r < low.log())
    kept = grad(gppo.gppo_loss, logp, old, adv, mask, div, "binary", delta=delta, **OFF) != 0
    assert torch.equal(kept[far], ~(upper | lower)[far])
    assert upper.sum() >= MIN_SIDE and lower.sum() >= MIN_SIDE and far.sum() > 0.9 * mask.sum()


# ---- ratio_bounds and dual_clip, token by token ----

def test_ratio_bounds_and_dual_clip():
    # kl-atomic at mu = 1e-3 has region [e^-223, e^223]: only the extra rules can clip here.
    r = torch.tensor([[20.0, 5.0, 0.3, 0.3, 20.0, 5.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0, -1.0, -1.0]])
    old = torch.full_like(r, math.log(1e-3))
    logp, mask = old + r.log(), torch.ones_like(r, dtype=torch.bool)
    kept = lambda **kw: (grad(gppo.gppo_loss, logp, old, adv, mask, "kl", "atomic", **kw) != 0)[0].tolist()
    assert kept(**OFF) == [True] * 6
    # bounds clip only on the side the advantage pushes: r > 10 with A > 0, r < 0.5 with A < 0
    assert kept(ratio_bounds=(0.5, 10.0), dual_clip=None) == [False, True, False, True, True, True]
    # dual clip: A < 0 and r > c gives no gradient, whatever the region
    assert kept(ratio_bounds=None, dual_clip=3.0) == [True, True, True, True, False, False]
    assert kept() == [False, True, False, True, False, True]          # the defaults: (0.5, 10) and 10
    _, stats = gppo.gppo_loss(logp, old, adv, mask, "kl", "atomic")
    assert stats["clip_frac_bounds"] == pytest.approx(2 / 6) and stats["clip_frac_dual"] == pytest.approx(1 / 6)
    assert stats["clip_frac"] == pytest.approx(3 / 6) and stats["clip_frac_upper"] == 0


def stat_floats(stats):
    """Every number in a stats dict: the STATS floats, and the BY_MU lists element by element."""
    return [x for v in stats.values() for x in (v if isinstance(v, list) else [v])]


def stats_well_formed(stats):
    """The trainer's interface: STATS as floats, BY_MU as lists of one float per mu bucket."""
    return set(stats) == set(gppo.STATS) | set(gppo.BY_MU) and \
        all(isinstance(stats[k], float) for k in gppo.STATS) and \
        all(isinstance(stats[k], list) and len(stats[k]) == len(gppo.MU_EDGES) + 1 for k in gppo.BY_MU) and \
        all(isinstance(x, float) for x in stat_floats(stats))


def test_stats_keys_and_values():
    logp, old, adv, mask = batch(0)
    loss, stats = gppo.gppo_loss(logp, old, adv, mask, "tv", "mc", **OFF)
    assert stats_well_formed(stats)
    r = (logp - old).exp()[mask]
    assert stats["ratio_mean"] == pytest.approx(r.mean().item(), rel=1e-5)
    assert stats["ratio_max"] == pytest.approx(r.max().item(), rel=1e-5)
    assert stats["kl_k3"] == pytest.approx((r - 1 - r.log()).mean().item(), rel=1e-4)
    assert stats["div_mean"] == pytest.approx(((r - 1).abs() / 2).mean().item(), rel=1e-4)
    assert stats["clip_frac"] == pytest.approx(stats["clip_frac_upper"] + stats["clip_frac_lower"])
    assert loss.item() == pytest.approx(-(adv[:, None] * (logp - old).exp())[mask].mean().item(), rel=1e-5)


def test_stats_pair_values_with_names(monkeypatch):
    """_stats labels each value by its name, not by its place in STATS: reordering STATS changes no
    value, a STATS name nothing computes raises, and so does a misspelt mask name."""
    logp, old, adv, mask = batch(0, spread=1.0)
    _, want = gppo.gppo_loss(logp, old, adv, mask, "kl", "binary")
    assert len(set(want[k] for k in gppo.STATS)) == len(gppo.STATS)    # distinct values: a swap shows
    monkeypatch.setattr(gppo, "STATS", gppo.STATS[::-1])
    assert gppo.gppo_loss(logp, old, adv, mask, "kl", "binary")[1] == want
    monkeypatch.setattr(gppo, "STATS", gppo.STATS + ("entropy",))
    with pytest.raises(AssertionError, match="entropy"):
        gppo.gppo_loss(logp, old, adv, mask, "kl", "binary")
    monkeypatch.undo()
    valid, _, old_, log_r, _ = gppo._prepare(logp, old, adv, mask)
    with pytest.raises(ValueError, match="clip_frac_uper"):
        gppo._stats(valid, log_r, old_, clip_frac_uper=valid)


# ---- where the region bites: the stats by behaviour probability (BY_MU) ----

def test_by_mu_hand_example():
    # tv-mc, region [0.8, 1.2]. Buckets mu < 0.01 | < 0.1 | < 0.5 | >= 0.5; the masked token (mu 0.05,
    # r 2 pushed up) counts nowhere. Clipped: r 1.5 with A > 0, or r 0.5 with A < 0.
    mu = [[0.001, 0.005, 0.05, 0.2, 0.3], [0.4, 0.6, 0.9, 0.95, 0.05]]
    r = [[1.5, 1.0, 1.5, 0.5, 1.1], [1.0, 1.5, 1.0, 0.5, 2.0]]
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, 1.0], [1.0, 1.0, -1.0, 1.0, 1.0]])
    mask = torch.tensor([[True] * 5, [True] * 4 + [False]])
    old = torch.tensor(mu).log()
    _, stats = gppo.gppo_loss(old + torch.tensor(r).log(), old, adv, mask, "tv", "mc", **OFF)
    # valid tokens per bucket: 2, 1, 3, 3; clipped: (0.001, r 1.5), (0.05, r 1.5), (0.2, r 0.5 A < 0),
    # (0.6, r 1.5); (0.95, r 0.5) has A > 0, pushed back in, not clipped
    assert stats["token_frac_by_mu"] == pytest.approx([2 / 9, 1 / 9, 3 / 9, 3 / 9])
    assert stats["clip_frac_by_mu"] == pytest.approx([1 / 2, 1 / 1, 1 / 3, 1 / 3])
    assert stats["clip_frac"] == pytest.approx(4 / 9)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cell", [("tv", "mc"), ("kl", "atomic"), ("chi2", "binary")])
def test_token_frac_by_mu_sums_to_one(seed, cell):
    logp, old, adv, mask = batch(seed, spread=1.0)
    old[0, :4] = torch.tensor([1e-3, 0.05, 0.3, 0.9]).log()         # every bucket is used
    _, stats = gppo.gppo_loss(logp, old, adv, mask, *cell)
    assert sum(stats["token_frac_by_mu"]) == pytest.approx(1.0)
    assert all(x > 0 for x in stats["token_frac_by_mu"])
    # the buckets split clip_frac: sum_b share_b * clip_frac_b = clip_frac
    split = sum(t * c for t, c in zip(stats["token_frac_by_mu"], stats["clip_frac_by_mu"]))
    assert split == pytest.approx(stats["clip_frac"]) and stats["clip_frac"] > 0


@pytest.mark.parametrize("cell", CELLS)
def test_by_mu_empty_mask_gives_zeros(cell):
    logp, old, adv, mask = batch(4)
    _, stats = gppo.gppo_loss(logp, old, adv, torch.zeros_like(mask), *cell)
    assert stats["token_frac_by_mu"] == [0.0] * 4 and stats["clip_frac_by_mu"] == [0.0] * 4


# ---- float32 region decisions (gppo.estimate: |D(r)| decides who is clipped, in float64) ----

def reference_outside(div, est, log_r, old, delta):
    """|D(r)| > delta in float64, written from eqs. 18-20 independently of gppo's float32 path."""
    f = gppo.get_divergence(div)
    log_r, old = log_r.double(), old.double()
    r, mu, mu_c = log_r.exp(), old.exp(), -torch.expm1(old)
    d = f(r) if est == "mc" else mu * f(r)
    if est == "binary":
        pi_c = -torch.expm1((old + log_r).clamp(max=0))
        d = d + torch.where(mu_c > 0, mu_c * f(pi_c / torch.where(mu_c > 0, mu_c, 1.0)), 0.0)
    return ~(d.abs() <= delta)


@pytest.mark.parametrize("div,est", CELLS + [(d, e) for d in ("alpha:-1", "alpha:3") for e in gppo.ESTIMATORS])
def test_region_decisions_match_float64_reference(div, est):
    """On a dense (mu, r) grid of float32 inputs with the hard cases (mu near 1, denormal 1 - mu, mu = delta
    where tv-binary's region ends at r = 0, r at the clamp), gppo.estimate (what gppo_loss decides with)
    puts exactly the tokens outside the region that the independent float64 reference does."""
    delta = gppo.default_delta(div)
    log_mu = torch.cat([torch.linspace(math.log(1e-30), 0, 300), -torch.logspace(-30, -0.01, 100),
                        torch.tensor([0.0, -1e-7, -1e-30, -1e-40, -1e-44, math.log(delta), math.log(0.1)])])
    log_r = torch.cat([torch.linspace(-20, 20, 1001), torch.tensor([-1e-6, 1e-6])])
    old = log_mu[:, None].expand(len(log_mu), len(log_r)).float().contiguous()
    lr = log_r[None, :].expand_as(old).float()
    lr = (torch.minimum(lr, -old) if est == "binary" else lr).contiguous()   # binary: pi <= 1
    assert old.numel() > 4 * gppo.ESTIMATE_CHUNK                       # estimate's chunk seams are crossed too
    outside = ~(gppo.estimate(lr, old, div, est) <= delta)
    assert torch.equal(outside, reference_outside(div, est, lr, old, delta))


def neyman(r):
    return (r - 1) ** 2 / r        # Neyman chi^2, the README how-to's example divergence


RULE_ALPHAS = ALPHAS + ["alpha:0", "alpha:1", "alpha:1e-12", "alpha:0.999999999999", "alpha:7", "alpha:-100",
                       f"alpha:{gppo.ALPHA_MAX}", f"alpha:{-gppo.ALPHA_MAX}"]


@pytest.mark.parametrize("f", [*gppo.DIVERGENCES.values(), neyman, *map(gppo.get_divergence, RULE_ALPHAS)],
                         ids=[*gppo.DIVERGENCES, "neyman", *RULE_ALPHAS])
def test_divergence_rule(f):
    """The rule a new divergence must obey (gppo.py, above DIVERGENCES): on float64 r anywhere in
    [0, 1e45] (binary's complement ratio reaches ~1e45 for 1 - mu at float32's smallest denormal) it is
    finite or +inf, never NaN, and 0 at r = 1."""
    r = torch.cat([torch.zeros(1), torch.logspace(-45, 45, 2001, dtype=torch.float64)]).double()
    v = f(r)
    assert v.dtype == torch.float64 and not torch.isnan(v).any() and (v > -math.inf).all()
    assert f(torch.ones(1, dtype=torch.float64)).abs().item() < 1e-15


# ---- numerics (hypothesis) ----

extreme_logmu = st.one_of(st.sampled_from([0.0, -1e-30, -1e-7, math.log(1e-30)]),
                          st.floats(math.log(1e-30), 0.0))
extreme_logr = st.one_of(st.sampled_from([0.0, math.log(1e-20), math.log(1e20)]),
                         st.floats(math.log(1e-20), math.log(1e20)))


@st.composite
def extremes(draw, n=8):
    old = torch.tensor([draw(extreme_logmu) for _ in range(n)])
    logp = old + torch.tensor([draw(extreme_logr) for _ in range(n)])
    if draw(st.booleans()):
        logp = logp.clamp(max=0)                                      # valid probabilities, pi == 1 allowed
    adv = torch.tensor([draw(st.sampled_from([-1.0, 0.0, 1.0, 3.0])) for _ in range(n)])
    return logp.view(2, -1), old.view(2, -1), adv.view(2, -1)


def finite(loss_fn, logp, *args, **kw):
    logp = logp.detach().clone().requires_grad_(True)
    loss, stats = loss_fn(logp, *args, **kw)
    loss.backward()
    return torch.isfinite(loss).item() and torch.isfinite(logp.grad).all().item() and \
        all(math.isfinite(v) for v in stat_floats(stats))


@settings(max_examples=60, deadline=None)
@given(extremes(), st.sampled_from(CELLS + ALPHA_CELLS), st.sampled_from(gppo.AGGS), st.booleans())
def test_finite_at_extremes(x, cell, agg, bf16):
    logp, old, adv = x
    if bf16:
        logp, old = logp.bfloat16(), old.bfloat16()
    mask = torch.ones_like(logp, dtype=torch.bool)
    assert finite(gppo.gppo_loss, logp, old, adv, mask, *cell, agg=agg)
    assert finite(gppo.gppo_loss, logp, old, adv, mask, *cell, agg=agg, **OFF)


@pytest.mark.parametrize("agg", gppo.AGGS)
def test_empty_mask_gives_zero(agg):
    logp, old, adv, mask = batch(1)
    logp[0, 0], old[1, 1] = float("nan"), float("-inf")                # padding may hold anything
    p = logp.requires_grad_(True)
    loss, stats = gppo.gppo_loss(p, old, adv, torch.zeros_like(mask), "kl", "binary", agg=agg)
    loss.backward()
    assert loss.item() == 0 and torch.equal(p.grad, torch.zeros_like(p))
    assert all(math.isfinite(v) for v in stat_floats(stats))


def test_padding_garbage_does_not_leak():
    logp, old, adv, mask = batch(1)
    mask[0, 1] = mask[1, 2] = False
    dirty_logp, dirty_old = logp.clone(), old.clone()
    dirty_logp[0, 1], dirty_old[1, 2] = float("nan"), float("-inf")
    clean = grad(gppo.gppo_loss, logp, old, adv, mask, "chi2", "binary")
    torch.testing.assert_close(grad(gppo.gppo_loss, dirty_logp, dirty_old, adv, mask, "chi2", "binary"), clean)


@pytest.mark.parametrize("agg", gppo.AGGS)
def test_zero_advantages_give_zero(agg):
    logp, old, adv, mask = batch(3)
    p = logp.requires_grad_(True)
    loss, _ = gppo.gppo_loss(p, old, torch.zeros_like(adv), mask, "hellinger", "atomic", agg=agg)
    loss.backward()
    assert loss.item() == 0 and torch.equal(p.grad, torch.zeros_like(p))


def test_bf16_inputs():
    logp, old, adv, mask = batch(2)
    p = logp.bfloat16().requires_grad_(True)
    loss, _ = gppo.gppo_loss(p, old.bfloat16(), adv.bfloat16(), mask, "kl", "atomic")
    loss.backward()
    assert loss.dtype == torch.float32 and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all()


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(gppo.AGGS), st.sampled_from(CELLS),
       st.lists(st.integers(1, 7), min_size=1, max_size=4))
def test_micro_batches_sum_to_whole_batch(seed, agg, cell, sizes):
    B = sum(sizes)
    logp, old, adv, mask = batch(seed, B=B, T=9)
    mask[0] = False                                                   # a sequence with no valid token
    count = mask.sum() if agg == "token-mean" else (mask.sum(-1) > 0).sum()
    whole = grad(gppo.gppo_loss, logp, old, adv, mask, *cell, agg=agg)
    parts = [grad(gppo.gppo_loss, lp, o, a, m, *cell, agg=agg, global_count=count)
             for lp, o, a, m in zip(*(t.split(sizes) for t in (logp, old, adv, mask)))]
    torch.testing.assert_close(torch.cat(parts), whole)


# ---- configuration errors ----

@pytest.mark.parametrize("kw,bad", [
    (dict(divergence="renyi"), "renyi"), (dict(estimator="topk"), "topk"), (dict(agg="sum"), "sum"),
    (dict(delta=0.0), "0.0"), (dict(delta=-0.1), "-0.1"), (dict(ratio_bounds=(1.5, 10.0)), "1.5"),
    (dict(ratio_bounds=(0.5, 0.9)), "0.9"), (dict(ratio_bounds=(0.9, 0.5)), "0.9"),
    (dict(dual_clip=1.0), "1.0"), (dict(dual_clip=0.5), "0.5")])
def test_bad_config_raises(kw, bad):
    """check_config, which train.py runs once at parse time (infra/flags.py) instead of on every
    loss call, refuses each of gppo_loss's settings, naming the value."""
    args = dict(divergence="tv", estimator="mc") | kw
    with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
        gppo.check_config(**args)


@pytest.mark.parametrize("name,says", [
    ("alpha:x", "'x' is not a number"), ("alpha", "needs a parameter"), ("alpha:", "'' is not a number"),
    ("kl:2", "kl takes no parameter"), ("alpha:inf", "got inf"), ("alpha:nan", "got nan"),
    ("alpha:2e6", "got 2000000.0"), ("renyi:2", "unknown divergence")])
def test_bad_divergence_names(name, says):
    """check_config (what train.py calls at load time) refuses each, naming the value and what is
    accepted; so do the other entry points."""
    for call in (lambda: gppo.check_config(name, "mc"), lambda: gppo.default_delta(name),
                 lambda: proximal_bounds(torch.tensor([-1.0]), name, "atomic"),
                 lambda: gppo.estimate(torch.zeros(1), torch.zeros(1), name, "binary")):
        with pytest.raises(ValueError) as e:
            call()
        assert repr(name) in str(e.value) and says in str(e.value) and "alpha:A" in str(e.value)
    names = gppo.divergence_names()   # the named ones first, then one FAMILY:A per family (a new
    assert names[:len(gppo.DIVERGENCES)] == list(gppo.DIVERGENCES) and "alpha:A" in names   # one too)


BAD_CALLS = [(dict(delta=0.0), "0.0"), (dict(delta=-1.0), "-1.0"), (dict(delta=math.nan), "nan"),
             (dict(delta="0.1"), "'0.1'"), (dict(divergence="renyi"), "renyi"),
             (dict(estimator="topk"), "topk"), (dict(agg="sum"), "sum"),
             (dict(ratio_bounds=(1.5, 10.0)), "1.5"), (dict(dual_clip=0.5), "0.5")]


@pytest.mark.parametrize("kw,bad", BAD_CALLS)
def test_gppo_loss_called_directly_refuses_nonsense(kw, bad):
    """gppo_loss called on its own (a notebook, a student's loop: no train.py parse step) refuses
    a setting outside its domain, naming the value and what is accepted; delta = 0 or -1 would
    otherwise return a loss in which no token ever has a gradient."""
    logp, old, adv, mask = batch(0)
    args = dict(divergence="kl", estimator="atomic") | kw
    with pytest.raises(ValueError, match=bad.replace(".", r"\.")) as e:
        gppo.gppo_loss(logp.requires_grad_(), old, adv, mask, **args)
    assert any(w in str(e.value) for w in ("> 0", "expected one of", "accepted", "must be"))


@pytest.mark.parametrize("name", [*gppo.BASELINES])
def test_baselines_and_helpers_refuse_an_unknown_aggregation(name):
    """Every public function that takes an aggregation refuses one it does not know, naming it
    and the accepted ones; drpo's delta is refused as gppo_loss's is."""
    logp, old, adv, mask = batch(1)
    with pytest.raises(ValueError, match="'sum'.*token-mean"):
        gppo.BASELINES[name](logp, old, adv, mask, agg="sum")
    for call in (lambda: gppo.aggregate(logp, mask, "sum"),
                 lambda: gppo.denominator(mask.sum(-1), "sum")):
        with pytest.raises(ValueError, match="'sum'.*token-mean"):
            call()
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="delta must be a number > 0"):
            gppo.drpo_loss(logp, old, adv, mask, delta=bad)


def test_bad_names_elsewhere_raise():
    with pytest.raises(ValueError, match="renyi"):
        gppo.default_delta("renyi")
    with pytest.raises(ValueError, match="topk"):
        proximal_bounds(torch.tensor([-1.0]), "tv", "topk")


ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_main_prints_table_without_plotting():
    """`python bench/regions.py` prints every cell's region, examples of the alpha family and the
    line saying any alpha:A works, and imports no plotting library."""
    code = ("import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
            "print('matplotlib' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "bench", "regions.py")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[-1] == "False" and lines[-2].startswith("any alpha:A works")
    rows = {line.split()[0]: line.split(None, 1)[1] for line in lines[2:-2]}
    assert list(rows) == [f"{d}-{e}" for d in [*gppo.DIVERGENCES, "alpha:0.5", "alpha:3"] for e in gppo.ESTIMATORS]
    for est in gppo.ESTIMATORS:           # the same regions as hellinger's, at twice its delta
        assert rows[f"alpha:0.5-{est}"].split(None, 1)[1] == rows[f"hellinger-{est}"].split(None, 1)[1]


def test_plot_regions_writes_png(tmp_path):
    """bench/plot_regions.py draws the regions; by default into out/gppo_regions.png under the
    working directory, creating out/; parametric names work, bad ones are refused."""
    script = os.path.join(ROOT, "bench", "plot_regions.py")
    res = subprocess.run([sys.executable, script, "--divergences", "kl,alpha:0.5"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out" / "gppo_regions.png").stat().st_size > 10_000
    res = subprocess.run([sys.executable, script, "--divergences", "kl,alpha:x", "--out", str(tmp_path / "x.png")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "'alpha:x'" in res.stderr and not (tmp_path / "x.png").exists()
