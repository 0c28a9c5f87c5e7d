"""The README's how-tos, done as a reader would: add a divergence (Neyman chi^2) and a baseline (clipped-IS
REINFORCE) with the code the README shows, and check that they reach every place that reads the registries
(default_delta, all three estimators, proximal_bounds, train.py's flags and loss); use a divergence with a
parameter (alpha:0.5) and add a family (the README's chi^k, executed from README.md); add an advantage
estimator (the README's REINFORCE++-baseline, executed from README.md, through --advantage). The JSONL how-to, a
task from a file, is tests/test_tasks.py::test_howto_word_reversal_from_jsonl (its code-task rows:
tests/test_loaders.py)."""
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import gppo
from bench.regions import proximal_bounds
import reward
import train
from gppo import _prepare, _stats, aggregate  # what the how-to's baseline imports


# -- README "Add a divergence": one line --
def neyman(r):
    return (r - 1) ** 2 / r


# -- README "Add a baseline": clipped-IS REINFORCE, -sg(min(r, cap)) A log pi per token --
def cis_reinforce_loss(logp, old_logp, advantages, mask, agg="token-mean", global_count=None, cap=2.0):
    valid, lp, old, log_r, adv = _prepare(logp, old_logp, advantages, mask)
    r = log_r.detach().exp()
    w = r.clamp(max=cap)
    loss = aggregate(-w * adv * lp, valid, agg, global_count)
    return loss, _stats(valid, log_r, old, clip_frac=w < r)


def batch(seed, B=8, T=16):
    g = torch.Generator().manual_seed(seed)
    old = torch.empty(B, T).uniform_(math.log(1e-3), 0, generator=g)
    logp = (old + torch.randn(B, T, generator=g)).clamp(max=0)
    return logp, old, torch.randn(B, generator=g), torch.rand(B, T, generator=g) < 0.8


def test_add_a_divergence(monkeypatch):
    monkeypatch.setitem(gppo.DIVERGENCES, "neyman", neyman)
    # calibrated like the others: the mc region's lower bound is 0.8
    delta = gppo.default_delta("neyman")
    assert delta == pytest.approx(0.2 ** 2 / 0.8)
    logp, old, adv, mask = batch(0)
    for est in gppo.ESTIMATORS:
        # the mask the loss uses agrees with the region's bounds (bisected for binary)
        low, high = proximal_bounds(old, "neyman", est, ratio_bounds=None)
        p = logp.clone().requires_grad_(True)
        loss, stats = gppo.gppo_loss(p, old, adv, mask, "neyman", est, ratio_bounds=None, dual_clip=None)
        loss.backward()
        r, A = (logp - old).exp().double(), adv[:, None]
        outside = ((r > high * (1 + 1e-6)) & (A > 0)) | ((r < low * (1 - 1e-6)) & (A < 0))
        inside = ((r < high * (1 - 1e-6)) | (A < 0)) & ((r > low * (1 + 1e-6)) | (A > 0))
        assert torch.isfinite(p.grad).all() and stats["clip_frac"] > 0
        assert (p.grad[mask & outside] == 0).all() and (p.grad[mask & inside & (A != 0)] != 0).all()
    # train.py offers it (its flag check resolves the name through gppo.get_divergence)
    assert train.parse_args(["--divergence", "neyman", "--estimator", "binary"]).cell == "neyman-binary"


def test_add_a_baseline(monkeypatch):
    monkeypatch.setitem(gppo.BASELINES, "cis_reinforce", cis_reinforce_loss)
    args = train.parse_args(["--method", "cis_reinforce", "--loss_kwargs", "cap=5"])
    assert args.objective == "cis_reinforce" and args.agg == "token-mean" and args.loss_kwargs == {"cap": 5}
    logp, old, adv, mask = batch(1)
    p = logp.clone().requires_grad_(True)
    loss, stats = train.chosen_loss(args)(p, old, adv, mask)
    loss.backward()
    # the gradient of REINFORCE weighted by min(r, 5): -min(r, 5) A / N per token
    r = (logp - old).exp()
    want = torch.where(mask, -r.clamp(max=5) * adv[:, None] / mask.sum(), 0.0)
    torch.testing.assert_close(p.grad, want)
    assert set(stats) == set(gppo.STATS) | set(gppo.BY_MU) and stats["clip_frac"] > 0
    with pytest.raises(ValueError, match="cap"):
        train.parse_args(["--method", "cis_reinforce", "--loss_kwargs", "cpa=5"])


def readme_block(first_line):
    """The indented code block of README.md that starts with `first_line`, dedented."""
    lines = (Path(__file__).resolve().parents[1] / "README.md").read_text().splitlines()
    start = lines.index("    " + first_line)
    block = []
    for line in lines[start:]:
        if line and not line.startswith("    "):
            break
        block.append(line[4:])
    return "\n".join(block).strip() + "\n"


def test_divergence_with_a_parameter(monkeypatch):
    # README "A divergence with a parameter": alpha:0.5 in every estimator, its mask agreeing with
    # its bounds, which are hellinger's (f_0.5 = 2 hellinger and delta scales with f)
    assert gppo.default_delta("alpha:0.5") == pytest.approx(2 * gppo.default_delta("hellinger"))
    logp, old, adv, mask = batch(2)
    for est in gppo.ESTIMATORS:
        low, high = proximal_bounds(old, "alpha:0.5", est, ratio_bounds=None)
        h_low, h_high = proximal_bounds(old, "hellinger", est, ratio_bounds=None)
        torch.testing.assert_close(low, h_low, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(high, h_high, rtol=1e-9, atol=1e-12)
        p = logp.clone().requires_grad_(True)
        loss, stats = gppo.gppo_loss(p, old, adv, mask, "alpha:0.5", est, ratio_bounds=None, dual_clip=None)
        loss.backward()
        r, A = (logp - old).exp().double(), adv[:, None]
        outside = ((r > high * (1 + 1e-6)) & (A > 0)) | ((r < low * (1 - 1e-6)) & (A < 0))
        inside = ((r < high * (1 - 1e-6)) | (A < 0)) & ((r > low * (1 + 1e-6)) | (A > 0))
        assert stats["clip_frac"] > 0
        assert (p.grad[mask & outside] == 0).all() and (p.grad[mask & inside & (A != 0)] != 0).all()
    for bad in ("alpha:x", "alpha", "kl:2", "alpha:inf"):
        with pytest.raises(ValueError, match="alpha:A"):
            gppo.check_config(bad, "atomic")
        with pytest.raises(ValueError, match=f"--divergence={bad!r}: .*alpha:A"):
            train.parse_args(["--divergence", bad])
    assert train.parse_args(["--divergence", "alpha:0.5", "--estimator", "atomic"]).cell \
        == "alpha:0.5-atomic"
    # a new family: the README's chi^k, run as written there
    monkeypatch.setattr(gppo, "FAMILIES", dict(gppo.FAMILIES))
    exec(readme_block("def chi(k):"), {"FAMILIES": gppo.FAMILIES})
    assert "chi:A" in gppo.divergence_names()
    r = torch.cat([torch.zeros(1), torch.logspace(-45, 45, 2001, dtype=torch.float64)])
    for k in (1, 1.5, 3, 10):                                 # the rule (tests/test_gppo.py)
        f = gppo.get_divergence(f"chi:{k}")
        assert not torch.isnan(f(r)).any() and (f(r) >= 0).all() and f(torch.ones(1, dtype=torch.float64)) == 0
    for est in gppo.ESTIMATORS:                               # chi:2 is chi2
        for got, want in zip(proximal_bounds(old, "chi:2", est), proximal_bounds(old, "chi2", est)):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match=r"'chi:0\.5'.*\[1, 10\], got 0\.5"):
        gppo.check_config("chi:0.5", "mc")


def test_another_advantage_estimator(monkeypatch):
    # README "Another advantage estimator": REINFORCE++-baseline's, run as written there
    monkeypatch.setattr(gppo, "ADVANTAGES", dict(gppo.ADVANTAGES))
    exec(readme_block("def reinforce_pp_advantages(rewards, G):"), {"ADVANTAGES": gppo.ADVANTAGES})
    args = train.parse_args(["--advantage", "reinforce_pp", "--group_size", "3"])
    assert args.advantage == "reinforce_pp"
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    short = SimpleNamespace(texts=[""] * 6, completion_ids=[[1]] * 6, truncated=[False] * 6)   # no overlong penalty
    shaped, adv, _ = train.advantages(args, rewards, short)
    # R - mean_group = [2, -1, -1, 1, 1, -2] / 3, its unbiased std over the batch sqrt(4/15)
    want = torch.tensor([2.0, -1.0, -1.0, 1.0, 1.0, -2.0]) / 3 / (math.sqrt(4 / 15) + 1e-6)
    torch.testing.assert_close(shaped, rewards)
    torch.testing.assert_close(adv, want)
    with pytest.raises(SystemExit):
        train.parse_args(["--advantage", "reinforce_pq"])


def test_a_reward_made_of_parts(monkeypatch):
    # README "A reward made of parts": the reasoning bonus, run as written there
    monkeypatch.setattr(reward, "PARTS", dict(reward.PARTS))
    exec(readme_block("def reasoning_part(c):"), {"PARTS": reward.PARTS})
    args = train.parse_args(["--reward", "correct=1,reasoning=0.1", "--group_size", "2"])
    assert args.reward_weights == {"correct": 1, "reasoning": 0.1, "overlong": 1.0}
    texts = ["2 + 2 is 4. Answer: 4", "Answer: 4", "Answer: 5", "so 5. Answer: 5"]
    batch = SimpleNamespace(texts=texts, completion_ids=[[1] * 60, [1] * 5, [1] * 5, [1] * 5],
                            truncated=[False] * 4)
    rows = [{"task": "math", "problem": "2 + 2 = ?", "ground_truth": "4"}] * 2
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    parts = train.reward_parts(args, rewards, batch, rows)
    assert parts["reasoning"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert parts["overlong"].tolist() == [-1.0, 0.0, 0.0, 0.0]      # 60 tokens: past the budget of 48
    shaped, _, _ = train.advantages(args, rewards, batch, parts)
    torch.testing.assert_close(shaped, torch.tensor([0.1, 1.0, 0.0, 0.1]))
    with pytest.raises(ValueError, match="accepted keys of reward.PARTS: correct, format"):
        train.parse_args(["--reward", "correct=1,reasonnig=0.1"])
