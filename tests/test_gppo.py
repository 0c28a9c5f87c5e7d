"""Tests for the GPPO grid in gppo.py: known methods as cells, regions, rules, numerics, config errors."""
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # gppo.py lives at the repo root
import gppo  # noqa: E402

CELLS = [(d, e) for d in gppo.DIVERGENCES for e in gppo.ESTIMATORS]
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


def grad(loss_fn, logp, *args, **kw):
    logp = logp.detach().clone().requires_grad_(True)
    loss, _ = loss_fn(logp, *args, **kw)
    loss.backward()
    return logp.grad


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


# ---- known methods are cells (GPPO.md section 7) ----

@pytest.mark.parametrize("seed", range(3))
def test_tv_mc_is_ppo_clip(seed):
    logp, old, adv, mask = batch(seed)
    ours = grad(gppo.gppo_loss, logp, old, adv, mask, "tv", "mc", delta=0.1, **OFF)
    ref = grad(textbook, logp, old, adv, mask, 0.8, 1.2)
    torch.testing.assert_close(ours, ref)
    assert ref.abs().sum() > 0 and (ref == 0).sum() > (~mask).sum()  # some tokens clipped, some not


@pytest.mark.parametrize("seed", range(3))
def test_kl_mc_is_dapo_clip_higher(seed):
    logp, old, adv, mask = batch(seed)
    ours = grad(gppo.gppo_loss, logp, old, adv, mask, "kl", "mc", delta=0.23, **OFF)
    torch.testing.assert_close(ours, grad(textbook, logp, old, adv, mask, math.exp(-0.23), math.exp(0.23)))


@pytest.mark.parametrize("seed", range(3))
def test_tv_binary_is_dppo(seed):
    logp, old, adv, mask = batch(seed, spread=1.0)
    delta = 0.1
    up, down = pushes_out(logp, old, adv)
    pi, mu = logp.exp(), old.exp()
    drop = ((pi - mu > delta) & up) | ((mu - pi > delta) & down)
    ours = grad(gppo.gppo_loss, logp, old, adv, mask, "tv", "binary", delta=delta, **OFF)
    torch.testing.assert_close(ours, grad(masked_pg, logp, old, adv, mask, drop))
    assert (drop & mask).any()


@pytest.mark.parametrize("seed", range(3))
def test_kl_binary_is_bernoulli_kl_mask(seed):
    logp, old, adv, mask = batch(seed, spread=1.0)
    logp = logp.clamp(max=-1e-3)  # the naive formula below needs 1 - pi > 0
    delta = gppo.default_delta("kl")
    pi, mu = logp.double().exp(), old.double().exp()
    bern = mu * torch.log(mu / pi) + (1 - mu) * torch.log((1 - mu) / (1 - pi))
    up, down = pushes_out(logp, old, adv)
    drop = (bern > delta) & (up | down)
    ours = grad(gppo.gppo_loss, logp, old, adv, mask, "kl", "binary", **OFF)
    torch.testing.assert_close(ours, grad(masked_pg, logp, old, adv, mask, drop))
    assert (drop & mask).any()


@pytest.mark.parametrize("seed", range(3))
def test_chi2_atomic_is_ripo(seed):
    logp, old, adv, mask = batch(seed, spread=1.0)
    delta = 0.04
    w = (delta / old.exp()).sqrt()
    ours = grad(gppo.gppo_loss, logp, old, adv, mask, "chi2", "atomic", delta=delta, **OFF)
    torch.testing.assert_close(ours, grad(textbook, logp, old, adv, mask, 1 - w, 1 + w))


def test_methods_are_cells():
    for div, est in gppo.METHODS.values():
        assert div in gppo.DIVERGENCES and est in gppo.ESTIMATORS


# ---- regions ----

@pytest.mark.parametrize("div,est", CELLS)
def test_bounds_agree_with_mask(div, est):
    """On a dense ratio grid, a token is clipped by the loss exactly when proximal_bounds says so."""
    mus = torch.tensor([0.999, 0.9, 0.5, 0.1, 0.01, 1e-3, 1e-4])
    low, high = gppo.proximal_bounds(mus.log(), div, est, ratio_bounds=None)
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
    low, hi = gppo.proximal_bounds(torch.tensor([-0.5]), div, "mc", ratio_bounds=None)
    assert low.item() == pytest.approx(0.8, abs=1e-9) and hi.item() == pytest.approx(high, abs=5e-5)


def test_default_deltas():
    want = {"tv": 0.1, "chi2": 0.04, "hellinger": 0.011146, "kl": 0.22314}
    for div, delta in want.items():
        assert gppo.default_delta(div) == pytest.approx(delta, rel=1e-4)
    low, _ = gppo.proximal_bounds(torch.tensor([-1.0]), "js", "mc", ratio_bounds=None)
    assert low.item() == pytest.approx(0.8, abs=1e-9)                 # js is calibrated by bisection too


def test_binary_complement_near_mu_one():
    # pi = 0.9 against mu = 1 - 1e-30 (float32 rounds mu to 1): the complement moved from 1e-30 to
    # 0.1, a chi2 of 1e28, so a token pushed down is clipped. At mu == 1 exactly there is no
    # complement and the region is chi2-mc's, capped at r = 1; r = 0.9 is inside it.
    old = torch.tensor([[-1e-30, 0.0]])
    logp, adv, mask = torch.full_like(old, math.log(0.9)), -torch.ones_like(old), torch.ones_like(old).bool()
    kept = grad(gppo.gppo_loss, logp, old, adv, mask, "chi2", "binary", **OFF) != 0
    assert kept.tolist() == [[False, True]]


def test_bounds_intersect_ratio_bounds():
    low, high = gppo.proximal_bounds(torch.tensor([math.log(1e-3)]), "kl", "atomic")
    assert (low.item(), high.item()) == (0.5, 10.0)


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


def test_stats_keys_and_values():
    logp, old, adv, mask = batch(0)
    loss, stats = gppo.gppo_loss(logp, old, adv, mask, "tv", "mc", **OFF)
    assert set(stats) == set(gppo.STATS) and all(isinstance(v, float) for v in stats.values())
    r = (logp - old).exp()[mask]
    assert stats["ratio_mean"] == pytest.approx(r.mean().item(), rel=1e-5)
    assert stats["ratio_max"] == pytest.approx(r.max().item(), rel=1e-5)
    assert stats["kl_k3"] == pytest.approx((r - 1 - r.log()).mean().item(), rel=1e-4)
    assert stats["div_mean"] == pytest.approx(((r - 1).abs() / 2).mean().item(), rel=1e-4)
    assert stats["clip_frac"] == pytest.approx(stats["clip_frac_upper"] + stats["clip_frac_lower"])
    assert loss.item() == pytest.approx(-(adv[:, None] * (logp - old).exp())[mask].mean().item(), rel=1e-5)


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
        all(math.isfinite(v) for v in stats.values())


@settings(max_examples=60, deadline=None)
@given(extremes(), st.sampled_from(CELLS), st.sampled_from(gppo.AGGS), st.booleans())
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
    assert all(math.isfinite(v) for v in stats.values())


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
    logp, old, adv, mask = batch(0, B=2, T=3)
    args = dict(divergence="tv", estimator="mc") | kw
    with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
        gppo.gppo_loss(logp, old, adv, mask, **args)


def test_bad_names_elsewhere_raise():
    with pytest.raises(ValueError, match="renyi"):
        gppo.default_delta("renyi")
    with pytest.raises(ValueError, match="topk"):
        gppo.proximal_bounds(torch.tensor([-1.0]), "tv", "topk")


def test_main_prints_table_and_writes_plot(tmp_path):
    out = tmp_path / "regions.png"
    res = subprocess.run([sys.executable, os.path.join(os.path.dirname(gppo.__file__), "gppo.py"),
                          "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "kl-atomic" in res.stdout and out.stat().st_size > 10_000
