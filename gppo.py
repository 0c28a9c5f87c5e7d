"""
GPPO: the {Divergence x Estimator} proximal region as a policy loss, plus the paper's baselines.

Pure math: tensors in, (loss, stats) out. The paper is "Generalized Proximal Policy Optimization"
(Cai et al., arXiv 2610.13015); equation numbers below are its own. Run `python gppo.py
[--out gppo_regions.png]` to print every cell's region at a few mu and plot them against mu.

Choices, in the order a reader meets them:
1. The clip is a mask (section 5): a token gives no policy gradient exactly when |D(r)| > delta and
   r left the region on the side its advantage pushes (r > 1 & A > 0, or r < 1 & A < 0); every other
   token gives A * grad r. Binary regions have no closed form, so we never compute clip_R(r).
2. The loss *value* is the unclipped surrogate -A * r for every token, clipped ones contributing
   r.detach(): same gradient as min(rA, clip_R(r)A), and the value is comparable across cells.
3. "Dual clipping with bounds 0.5 and 10" (paper section 4.1) is, in our reading, two rules: the region
   is intersected with `ratio_bounds` (the public RIPO code bounds its interval by [0.5, 10]), and
   tokens with A < 0 and r > dual_clip give no gradient (classic dual clip, Ye et al. 2020).
4. The log-ratio is clamped to +-20 before exp (r in [2e-9, 5e8]), so loss and grad stay finite. Inside
   the clamp gradients are exact; beyond it the clamp's own zero gradient removes them, even where a
   region reaches further (kl-atomic at mu < 0.011, other atomic/binary cells at tiny mu). There the
   lost gradient is either ~0 (r < 2e-9) or one ratio_bounds removes anyway (r > 5e8 > 10).
5. D(r) needs no gradient; it is computed in float64. Binary's complement ratio (1-pi)/(1-mu) comes
   from logp/old_logp in log space (log1mexp), so mu near 1 keeps its complement mass; mu == 1 has
   none (the term is 0). A D that still evaluates to NaN counts as outside the region.
6. Aggregation takes `global_count`, the denominator over the whole update (all micro-batches and
   ranks), so summed micro-batch gradients equal the whole-batch gradient exactly.
7. Baselines (GSPO, GMPO, SAPO, CISPO, Clip-Cov) follow their authors' definitions and default
   aggregation, and share the ratio, aggregation and stats code with the grid.
"""
import math

import torch

LOG_RATIO_CLAMP = 20.0  # choice 4
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
STATS = ("clip_frac", "clip_frac_upper", "clip_frac_lower", "clip_frac_bounds", "clip_frac_dual",
         "ratio_mean", "ratio_max", "div_mean", "kl_k3")
# Where the region bites (the measured counterpart of the paper's Figure 1): tokens are bucketed by
# their behaviour probability mu at these edges, mu < 0.01 | < 0.1 | < 0.5 | >= 0.5. Two more stats,
# each a list of 4 floats: `token_frac_by_mu` (share of the valid tokens in each bucket) and
# `clip_frac_by_mu` (share of each bucket's tokens that were clipped, i.e. counted in clip_frac).
MU_EDGES = (0.01, 0.1, 0.5)
BY_MU = ("token_frac_by_mu", "clip_frac_by_mu")

# -----------------------------------------------------------------------------
# Divergence generators f(r), r = pi/mu, f convex with f(1) = 0 (paper eqs. 14-17).

def tv(r):        return (r - 1).abs() / 2                  # eq. 14, total variation
def chi2(r):      return (r - 1) ** 2                       # eq. 15, Pearson chi^2
def kl(r):        return -torch.log(r)                      # eq. 16, KL(mu || pi)
def hellinger(r): return (torch.sqrt(r) - 1) ** 2           # eq. 17, squared Hellinger
# Not in the paper: Jensen-Shannon, the standard generator of JS(pi, mu) = KL(pi||m)/2 + KL(mu||m)/2
# with m = (pi + mu)/2; bounded by log 2, symmetric in pi and mu. xlogy makes js(0) = log(2)/2.
def js(r):        return (torch.xlogy(r, r) - torch.xlogy(r + 1, (r + 1) / 2)) / 2

# Estimators D(r) of D_f(pi || mu) from the one sampled token (eqs. 18-20). mu: its behaviour
# probability; mu_c = 1 - mu and r_c = (1 - pi)/(1 - mu): mass and ratio of "every other token".

def mc(f, r, mu, r_c, mu_c):     return f(r)                             # eq. 18
def atomic(f, r, mu, r_c, mu_c): return mu * f(r)                        # eq. 19
def binary(f, r, mu, r_c, mu_c): return mu * f(r) + mu_c * f(r_c)        # eq. 20

# Add a divergence with one line here; default_delta calibrates it and proximal_bounds bisects it.
DIVERGENCES = {"tv": tv, "chi2": chi2, "kl": kl, "hellinger": hellinger, "js": js}
ESTIMATORS = {"mc": mc, "atomic": atomic, "binary": binary}
# Known methods as cells (paper section 3.4).
METHODS = {"grpo": ("tv", "mc"), "ppo": ("tv", "mc"), "dapo": ("kl", "mc"),
           "dppo": ("tv", "binary"), "ripo": ("chi2", "atomic")}
# Closed-form inverse of |f(r)| <= c (c = delta for mc, delta/mu for atomic), for proximal_bounds.
SUBLEVEL = {"tv": lambda c: (1 - 2 * c, 1 + 2 * c),
            "chi2": lambda c: (1 - c.sqrt(), 1 + c.sqrt()),
            "kl": lambda c: ((-c).exp(), c.exp()),
            "hellinger": lambda c: ((1 - c.sqrt()).clamp(min=0) ** 2, (1 + c.sqrt()) ** 2)}


def default_delta(divergence, r_min=0.8):
    """delta = |f(r_min)|: the mc region's lower bound is PPO's r_min (paper section 4.1)."""
    f = _lookup(DIVERGENCES, divergence, "divergence")
    if not 0 < r_min < 1:
        raise ValueError(f"r_min must be in (0, 1), got {r_min!r}")
    return abs(float(f(torch.tensor(r_min, dtype=torch.float64))))

# -----------------------------------------------------------------------------
# Shared pieces: config checks, sanitised log-ratios, |D|, aggregation, stats.

def _lookup(table, key, kind):
    if key not in table:
        raise ValueError(f"unknown {kind} {key!r}; expected one of {', '.join(table)}")
    return table[key] if isinstance(table, dict) else key


def _check(divergence, estimator, delta, ratio_bounds, dual_clip, agg):
    f, est = _lookup(DIVERGENCES, divergence, "divergence"), _lookup(ESTIMATORS, estimator, "estimator")
    _lookup(AGGS, agg, "agg")
    delta = default_delta(divergence) if delta is None else delta
    if not delta > 0:
        raise ValueError(f"delta must be > 0, got {delta!r}")
    if ratio_bounds is not None and not (0 <= ratio_bounds[0] <= 1 <= ratio_bounds[1]
                                         and ratio_bounds[0] < ratio_bounds[1]):
        raise ValueError(f"ratio_bounds must be (low, high) with 0 <= low <= 1 <= high and low < high, "
                         f"got {ratio_bounds!r}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 or None, got {dual_clip!r}")
    return f, est, float(delta)


def _prepare(logp, old_logp, advantages, mask):
    """float32 copies, zeroed off the mask so padding (even NaN) never reaches loss or grad."""
    valid = mask.bool()                                                      # (B, T)
    lp = torch.where(valid, logp.float(), 0.0)                              # (B, T), carries grad
    old = torch.where(valid, old_logp.detach().float(), 0.0)                # (B, T)
    adv = advantages.detach().float()
    adv = torch.where(valid, adv[:, None] if adv.dim() == 1 else adv, 0.0)  # (B,) or (B, T) -> (B, T)
    log_r = (lp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)             # choice 4
    return valid, lp, old, adv, log_r


def _log1mexp(x):
    """log(1 - e^x) for x <= 0, accurate at both ends (Maechler 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _divergence(f, est, log_r, old_logp):
    """|D(r)| (eqs. 18-20) from log r and log mu, in float64, without gradient (choice 5)."""
    with torch.no_grad():
        log_r, old = log_r.double(), old_logp.double()
        mu, mu_c = old.exp(), -torch.expm1(old)                        # mu_c = 1 - mu, exact near 1
        log_pi = (old + log_r).clamp(max=0)                            # pi <= 1
        r_c = torch.exp(_log1mexp(log_pi) - _log1mexp(old))          # (1 - pi)/(1 - mu)
        r_c = torch.where(mu_c > 0, r_c, torch.ones_like(r_c))        # mu == 1: no complement, f(1) = 0
        return est(f, log_r.exp(), mu, r_c, mu_c).abs()


def _pushing(r, adv):
    """Which way each token's advantage pushes its ratio: (up, down), each (B, T) bool."""
    return (r > 1) & (adv > 0), (r < 1) & (adv < 0)


def _aggregate(per_token, valid, agg, global_count):
    """Sum of per-token losses (zero off the mask) over the chosen denominator (choice 6)."""
    if agg == "token-mean":
        total, count = per_token.sum(), valid.sum()
    else:
        n = valid.sum(-1)                                                    # (B,) tokens per sequence
        per_seq = per_token.sum(-1)                                          # (B,)
        if agg == "seq-mean-token-mean":
            per_seq = per_seq / n.clamp(min=1)
        total, count = per_seq.sum(), (n > 0).sum()
    count = count if global_count is None else global_count
    return total / torch.as_tensor(count, dtype=total.dtype, device=total.device).clamp(min=1)


def _stats(valid, log_r, old_logp, d=None, **fracs):
    """Python floats over this batch's valid tokens, plus the BY_MU lists; fracs: name -> (B, T)
    bool, where "clip_frac" is the clipped mask the BY_MU split uses; missing keys are 0."""
    with torch.no_grad():
        n = valid.sum().clamp(min=1)
        mean = lambda x: torch.where(valid, x, 0).sum().float() / n
        r = log_r.exp()
        out = {k: mean(fracs[k] & valid) if k in fracs else n.new_zeros((), dtype=torch.float)
               for k in STATS}
        out["ratio_mean"] = mean(r)
        out["ratio_max"] = torch.where(valid, r, 0).max().float()
        out["kl_k3"] = mean((r - 1) - log_r)                 # k3 estimate of KL(mu || pi), sampled from mu
        if d is not None:                                     # capped: pi == 1 under kl-binary gives inf
            out["div_mean"] = mean(torch.where(d <= 1e6, d, 1e6).float())
        # bucket of each token by mu: 0..3 (searchsorted on log mu, so mu = 1e-30 is bucket 0)
        edges = torch.tensor(MU_EDGES, dtype=torch.float64, device=valid.device).log()
        bucket = torch.bucketize(old_logp.detach().double(), edges, right=True)            # (B, T)
        clipped = fracs.get("clip_frac", torch.zeros_like(valid)) & valid
        in_b = torch.stack([(bucket == b) & valid for b in range(len(MU_EDGES) + 1)])      # (4, B, T)
        n_b = in_b.flatten(1).sum(1).float()                                                # (4,)
        token_frac = n_b / n
        clip_frac = (in_b & clipped).flatten(1).sum(1).float() / n_b.clamp(min=1)
        flat = torch.cat([torch.stack(list(out.values())), token_frac, clip_frac]).tolist()  # one device sync
        k = len(out)
        return {**dict(zip(out, flat[:k])), "token_frac_by_mu": flat[k:k + 4], "clip_frac_by_mu": flat[k + 4:]}

# -----------------------------------------------------------------------------
# The GPPO loss (paper eq. 11 as a mask, section 5).

def gppo_loss(logp, old_logp, advantages, mask, divergence, estimator, delta=None,
              ratio_bounds=(0.5, 10.0), dual_clip=10.0, agg="token-mean", global_count=None):
    """logp, old_logp, mask: (B, T); advantages: (B,) or (B, T). Returns (scalar loss, stats)."""
    f, est, delta = _check(divergence, estimator, delta, ratio_bounds, dual_clip, agg)
    valid, lp, old, adv, log_r = _prepare(logp, old_logp, advantages, mask)
    r = log_r.exp()                                                          # (B, T)
    with torch.no_grad():
        d = _divergence(f, est, log_r, old)                                  # (B, T) |D(r)|
        up, down = _pushing(r, adv)
        outside = ~(d <= delta)                                             # NaN counts as outside
        upper, lower = outside & up, outside & down
        bounds = torch.zeros_like(valid) if ratio_bounds is None else \
            (up & (r > ratio_bounds[1])) | (down & (r < ratio_bounds[0]))
        dual = torch.zeros_like(valid) if dual_clip is None else (adv < 0) & (r > dual_clip)
        clipped = (upper | lower | bounds | dual) & valid                    # (B, T): no gradient
    per_token = -adv * torch.where(clipped, r.detach(), r)                  # choice 2
    return _aggregate(per_token, valid, agg, global_count), _stats(
        valid, log_r, old, d, clip_frac=clipped, clip_frac_upper=upper, clip_frac_lower=lower,
        clip_frac_bounds=bounds, clip_frac_dual=dual)


def _bisect(inside, near, far, iters=64):
    """Vectorised bisection between `near` (inside the region) and `far` (outside); returns near."""
    for _ in range(iters):
        mid = (near + far) / 2
        ok = inside(mid)
        near, far = torch.where(ok, mid, near), torch.where(ok, far, mid)
    return near


def proximal_bounds(old_logp, divergence, estimator, delta=None, ratio_bounds=(0.5, 10.0)):
    """Per-token (low, high) of {r > 0 : |D(r)| <= delta} (intersected with ratio_bounds), float64.

    Closed form for every mc/atomic cell of a divergence in SUBLEVEL and for tv-binary; otherwise
    bisection on log r in [-100, 100] (binary: r <= 1/mu, as pi <= 1), valid because D is convex in r
    with D(1) = 0. A region reaching past e^-100 reports low = 0. For tests and plots, not the loss.
    """
    f, est, delta = _check(divergence, estimator, delta, ratio_bounds, None, "token-mean")
    old = old_logp.detach().double()
    mu = old.exp()
    if estimator != "binary" and divergence in SUBLEVEL:
        low, high = SUBLEVEL[divergence](delta / mu if estimator == "atomic" else torch.full_like(mu, delta))
    elif (divergence, estimator) == ("tv", "binary"):                      # |pi - mu| <= delta
        low, high = 1 - delta / mu, torch.minimum(1 + delta / mu, 1 / mu)
    else:
        inside = lambda x: _divergence(f, est, x, old) <= delta
        zero = torch.zeros_like(old)
        top = (-old).clamp(max=100) if estimator == "binary" else zero + 100
        high = torch.where(inside(top), top, _bisect(inside, zero, top)).exp()
        low = torch.where(inside(zero - 100), -math.inf, _bisect(inside, zero, zero - 100)).exp()
    low = low.clamp(min=0)
    if ratio_bounds is not None:
        low, high = low.clamp(min=ratio_bounds[0]), high.clamp(max=ratio_bounds[1])
    return low, high

# -----------------------------------------------------------------------------
# The paper's other baselines (section 4.1), each as its authors define it, with their defaults.
# Same inputs and stats keys as gppo_loss; keys a method has no notion of are 0.0.

def gspo_loss(logp, old_logp, advantages, mask, agg="seq-mean-token-mean", global_count=None,
              eps_low=3e-4, eps_high=4e-4):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071, eq. 5): PPO's clip on the length-normalised sequence
    ratio s_i = exp(mean_t log r_t), eps 3e-4/4e-4. GSPO-token form: the token term sg(s_i) pi_t/sg(pi_t)
    has value s_i and gradient s_i * grad log pi_t; under seq-mean-token-mean (their 1/G sum_i, the
    default) this is exactly the sequence-level GSPO gradient."""
    _lookup(AGGS, agg, "agg")
    valid, lp, old, adv, log_r = _prepare(logp, old_logp, advantages, mask)
    n = valid.sum(-1, keepdim=True).clamp(min=1)                           # (B, 1)
    log_s = (log_r.sum(-1, keepdim=True) / n).detach()                     # (B, 1) log s_i
    s = torch.exp(log_s + lp - lp.detach())                                # (B, T): value s_i
    up, down = _pushing(s.detach(), adv)
    upper, lower = up & (s > 1 + eps_high), down & (s < 1 - eps_low)      # the sequence is clipped
    clipped = (upper | lower) & valid
    per_token = -adv * torch.where(clipped, s.detach(), s)
    return _aggregate(per_token, valid, agg, global_count), _stats(
        valid, log_r, old, clip_frac=clipped, clip_frac_upper=upper, clip_frac_lower=lower)


def gmpo_loss(logp, old_logp, advantages, mask, agg="seq-mean-token-mean", global_count=None,
              clip_low=0.4, clip_high=0.4):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673, their eq. for J_GMPO): maximise A_i times the
    geometric mean of the token ratios, each clipped PPO-style in log space to [-0.4, 0.4]
    (r in [e^-0.4, e^0.4]) on the side the advantage pushes. A clipped token keeps its clipped value
    in the geometric mean and gives no gradient. Token form as in gspo_loss: exact under
    seq-mean-token-mean (the authors' 1/G sum_i)."""
    _lookup(AGGS, agg, "agg")
    valid, lp, old, adv, log_r = _prepare(logp, old_logp, advantages, mask)
    up, down = _pushing(log_r.exp(), adv)
    upper, lower = up & (log_r > clip_high) & valid, down & (log_r < -clip_low) & valid
    clipped = upper | lower
    log_rt = torch.where(clipped, log_r.clamp(-clip_low, clip_high).detach(), log_r)  # (B, T)
    n = valid.sum(-1, keepdim=True).clamp(min=1)
    gmean = torch.exp(log_rt.sum(-1, keepdim=True) / n).detach()            # (B, 1)
    per_token = -adv * gmean * torch.exp(log_rt - log_rt.detach())          # value A g_i, grad A g_i grad log r_t
    return _aggregate(per_token, valid, agg, global_count), _stats(
        valid, log_r, old, clip_frac=clipped, clip_frac_upper=upper, clip_frac_lower=lower)


def sapo_loss(logp, old_logp, advantages, mask, agg="seq-mean-token-mean", global_count=None,
              tau_pos=1.0, tau_neg=1.05):
    """SAPO (Gao et al. 2025, arXiv 2511.20347): the hard clip becomes the soft gate
    f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos if A > 0 else tau_neg; its gradient weight
    4 sigma (1 - sigma) is 1 at r = 1 and decays smoothly. Aggregated as the authors do,
    1/G sum_i 1/|y_i| sum_t (seq-mean-token-mean). Nothing is clipped: clip_frac is 0."""
    _lookup(AGGS, agg, "agg")
    valid, _, old, adv, log_r = _prepare(logp, old_logp, advantages, mask)
    tau = torch.where(adv > 0, tau_pos, tau_neg)                           # (B, T)
    gate = torch.sigmoid(tau * (log_r.exp() - 1)) * 4 / tau
    return _aggregate(-adv * gate, valid, agg, global_count), _stats(valid, log_r, old)


def cispo_loss(logp, old_logp, advantages, mask, agg="token-mean", global_count=None,
               eps_low=None, eps_high=0.2):
    """CISPO (MiniMax-M1, arXiv 2506.13585, J_CISPO): REINFORCE weighted by the clipped, stop-gradient
    importance weight, sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi, over all tokens (token-mean).
    MiniMax set no lower bound (eps_low=None) and tuned only eps_high, value unpublished; 0.2 is VeRL's
    CISPO example. No token loses its gradient; clip_frac counts tokens whose weight was clipped.
    Written as w * exp(logp - sg(logp)): same gradient, and the value -A w is comparable to the others."""
    _lookup(AGGS, agg, "agg")
    valid, lp, old, adv, log_r = _prepare(logp, old_logp, advantages, mask)
    r = log_r.exp()
    w = r.clamp(min=None if eps_low is None else 1 - eps_low, max=1 + eps_high)   # (B, T)
    per_token = -adv * w.detach() * torch.exp(lp - lp.detach())
    return _aggregate(per_token, valid, agg, global_count), _stats(
        valid, log_r, old, clip_frac=w != r, clip_frac_upper=w < r, clip_frac_lower=w > r)


def clip_cov_loss(logp, old_logp, advantages, mask, agg="token-mean", global_count=None,
                  eps=0.2, clip_ratio=2e-4, cov_low=1.0, cov_high=5.0, generator=None):
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617, sec. 5): PPO clip (eps 0.2), plus: of the tokens
    PPO did not clip whose centred covariance (log pi - mean)(A - mean) over the batch lies in
    (cov_low, cov_high), a random max(1, clip_ratio * N) (N = valid tokens) have their gradient
    detached. `generator` (torch.Generator) makes the draw reproducible."""
    _lookup(AGGS, agg, "agg")
    valid, lp, old, adv, log_r = _prepare(logp, old_logp, advantages, mask)
    r = log_r.exp()
    up, down = _pushing(r, adv)
    upper, lower = up & (r > 1 + eps) & valid, down & (r < 1 - eps) & valid   # PPO's own clip
    with torch.no_grad():
        n = valid.sum()
        mean = lambda x: torch.where(valid, x, 0).sum() / n.clamp(min=1)
        cov = (lp - mean(lp)) * (adv - mean(adv))                           # (B, T)
        candidates = valid & ~(upper | lower) & (cov > cov_low) & (cov < cov_high)
        idx = candidates.flatten().nonzero().squeeze(1)
        k = min(max(int(clip_ratio * n.item()), 1), idx.numel())
        device = generator.device if generator is not None else idx.device
        pick = idx[torch.randperm(idx.numel(), generator=generator, device=device)[:k].to(idx.device)]
        by_cov = torch.zeros_like(candidates).flatten().index_fill_(0, pick, True).view_as(candidates)
    clipped = upper | lower | by_cov
    per_token = -adv * torch.where(clipped, r.detach(), r)
    return _aggregate(per_token, valid, agg, global_count), _stats(
        valid, log_r, old, clip_frac=clipped, clip_frac_upper=upper, clip_frac_lower=lower)


BASELINES = {"gspo": gspo_loss, "gmpo": gmpo_loss, "sapo": sapo_loss, "cispo": cispo_loss,
             "clip_cov": clip_cov_loss}

# -----------------------------------------------------------------------------
# `python gppo.py`: the region of every cell at the default delta, as a table and as a plot.

if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Print and plot the GPPO proximal regions.")
    parser.add_argument("--out", default="gppo_regions.png", help="where to write the PNG plot")
    args = parser.parse_args()

    mus = [0.99, 0.9, 0.5, 0.1, 0.01, 0.001]
    old = torch.tensor(mus).log()
    print("region [low, high] of r = pi/mu at the default delta (ratio_bounds off)")
    print(f"{'cell':<17}{'delta':>9}  " + "".join(f" {'mu=' + str(m):^22}" for m in mus))
    for div in DIVERGENCES:
        for est in ESTIMATORS:
            low, high = proximal_bounds(old, div, est, ratio_bounds=None)
            cells = "".join(f" {f'[{lo:.4g}, {hi:.4g}]':^22}" for lo, hi in zip(low.tolist(), high.tolist()))
            print(f"{div + '-' + est:<17}{default_delta(div):>9.5g}  {cells}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    mu = torch.logspace(-4, math.log10(0.999), 400, dtype=torch.float64)
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5), sharex=True, sharey=True)
    for ax, div in zip(axes.flat, DIVERGENCES):
        for est, color in zip(ESTIMATORS, ("tab:blue", "tab:orange", "tab:green")):
            low, high = proximal_bounds(mu.log(), div, est, ratio_bounds=None)
            ax.plot(mu, high, color=color, label=est)
            ax.plot(mu, low, color=color, ls="--")
        ax.axhline(1, color="grey", lw=0.5)
        ax.axhspan(0.5, 10, color="grey", alpha=0.06, lw=0)              # default ratio_bounds
        ax.set(xscale="log", yscale="log", ylim=(0.05, 20), title=f"{div}  (delta = {default_delta(div):.4g})")
        ticks = [0.1, 0.2, 0.5, 0.8, 1.25, 2, 5, 10]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
    for ax in axes[1]:
        ax.set_xlabel("mu = behaviour probability of the sampled token")
    for ax in axes[:, 0]:
        ax.set_ylabel("r = pi / mu  (upper solid, lower dashed)")
    axes.flat[-1].axis("off")
    axes.flat[0].legend(loc="upper right", title="estimator")
    fig.suptitle("GPPO proximal regions {r : |D(r)| <= delta} against mu (shaded: ratio_bounds [0.5, 10])")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
