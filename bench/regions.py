"""
The proximal region of every cell, {r > 0 : |D(r)| <= delta} per token, as bounds on r = pi/mu:
what the region table (`python bench/regions.py`) and the plot
(bench/plot_regions.py) show, and what the tests check the loss's mask against. Not on the
training path: the loss never computes a bound (gppo.py: the clip is a mask).

    python bench/regions.py          # every cell's region at a few mu, and the alpha family's
"""
import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gppo  # noqa: E402


def _bisect(inside, near, far, iters=64):
    """Vectorised bisection between `near` (inside the region) and `far` (outside); returns near."""
    for _ in range(iters):
        mid = (near + far) / 2
        ok = inside(mid)
        near, far = torch.where(ok, mid, near), torch.where(ok, far, mid)
    return near


# Closed-form inverse of |f(r)| <= c (c = delta for mc, delta/mu for atomic), for proximal_bounds.
SUBLEVEL = {"tv": lambda c: (1 - 2 * c, 1 + 2 * c),
            "chi2": lambda c: (1 - c.sqrt(), 1 + c.sqrt()),
            "kl": lambda c: ((-c).exp(), c.exp()),
            "hellinger": lambda c: ((1 - c.sqrt()).clamp(min=0) ** 2, (1 + c.sqrt()) ** 2)}


def proximal_bounds(old_logp, divergence, estimator, delta=None, ratio_bounds=(0.5, 10.0)):
    """Per-token (low, high) of {r > 0 : |D(r)| <= delta} (intersected with ratio_bounds), float64.
    Closed form for the mc/atomic cells of SUBLEVEL's divergences and for tv-binary; otherwise
    bisection on log r in [-100, 100] (binary: r <= 1/mu, as pi <= 1), valid as D is convex in r
    with D(1) = 0. A region reaching past e^-100 reports low = 0. For tests and plots, not the
    loss."""
    delta = gppo.check_config(divergence, estimator, delta, ratio_bounds)
    old = old_logp.detach().double()
    mu = old.exp()
    if estimator != "binary" and divergence in SUBLEVEL:
        c = delta / mu if estimator == "atomic" else torch.full_like(mu, delta)
        low, high = SUBLEVEL[divergence](c)
    elif (divergence, estimator) == ("tv", "binary"):       # |pi - mu| <= delta
        low, high = 1 - delta / mu, torch.minimum(1 + delta / mu, 1 / mu)
    else:
        def inside(x):
            return gppo.estimate(x, old, divergence, estimator) <= delta
        zero = torch.zeros_like(old)
        top = (-old).clamp(max=100) if estimator == "binary" else zero + 100
        high = torch.where(inside(top), top, _bisect(inside, zero, top)).exp()
        low = torch.where(inside(zero - 100), -math.inf, _bisect(inside, zero, zero - 100)).exp()
    low = low.clamp(min=0)
    if ratio_bounds is not None:
        low, high = low.clamp(min=ratio_bounds[0]), high.clamp(max=ratio_bounds[1])
    return low, high


def main():
    argparse.ArgumentParser(description="Print every cell's proximal region at a few mu (plot: "
                            "python bench/plot_regions.py).").parse_args()
    mus = [0.99, 0.9, 0.5, 0.1, 0.01, 0.001]
    old = torch.tensor(mus).log()
    print("region [low, high] of r = pi/mu at the default delta (ratio_bounds off)")
    print(f"{'cell':<17}{'delta':>9}  " + "".join(f" {'mu=' + str(m):^22}" for m in mus))
    for div in [*gppo.DIVERGENCES, "alpha:0.5", "alpha:3"]:
        for est in gppo.ESTIMATORS:
            low, high = proximal_bounds(old, div, est, ratio_bounds=None)
            cells = "".join(f" {f'[{lo:.4g}, {hi:.4g}]':^22}"
                            for lo, hi in zip(low.tolist(), high.tolist()))
            print(f"{div + '-' + est:<17}{gppo.default_delta(div):>9.5g}  {cells}")
    print(f"any alpha:A works, |A| <= {gppo.ALPHA_MAX:g} (e.g. --divergence alpha:-1): alpha:2 has "
          f"chi2's regions, alpha:0.5 hellinger's; alpha:1 and alpha:0 are the KL limits "
          f"r log r - r + 1 and r - 1 - log r")


if __name__ == "__main__":
    main()
