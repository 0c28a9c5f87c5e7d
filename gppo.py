"""
GPPO: the {Divergence x Estimator} proximal region as a policy loss, plus the paper's baselines.

Pure math: tensors in, (loss, stats) out. The paper is "Generalized Proximal Policy Optimization"
(Cai et al., arXiv 2610.13015); equation numbers below are its own. Run `python gppo.py
[--out gppo_regions.png]` to print every cell's region at a few mu and plot them against mu.

Choices, in the order a reader meets them:
1. The clip is a mask (section 5): a token gives no policy gradient exactly when |D(r)| > delta and
   r left the region on the side its advantage pushes (r > 1 & A > 0, or r < 1 & A < 0); every other
   token gives A * grad r. Binary regions have no closed form, so we never compute clip_R(r).
2. The loss *value* is the unclipped surrogate -A * r for every token, its gradient -A r grad log pi
   only on the kept ones: the gradient of min(rA, clip_R(r)A), and the value is comparable across cells.
3. "Dual clipping with bounds 0.5 and 10" (paper section 4.1) is, in our reading, two rules: the region
   is intersected with `ratio_bounds` (the public RIPO code bounds its interval by [0.5, 10]), and
   tokens with A < 0 and r > dual_clip give no gradient (classic dual clip, Ye et al. 2020).
4. The log-ratio is clamped to +-20 before exp (r in [2e-9, 5e8]), so loss and grad stay finite. Inside
   the clamp gradients are exact; beyond it the clamp's own zero gradient removes them, even where a
   region reaches further (kl-atomic at mu < 0.011, other atomic/binary cells at tiny mu). There the
   lost gradient is either ~0 (r < 2e-9) or one ratio_bounds removes anyway (r > 5e8 > 10).
5. D(r) needs no gradient and is computed in float32: r = e^(log r) and mu = e^(log mu) are exact to
   an ulp; binary's complement ratio (1-pi)/(1-mu) divides two expm1's, so mu or pi near 1 keep their
   complement mass (no 1 - x cancellation; mu == 1 has none and the term is 0); tv/chi2/hellinger/js
   sum non-negative terms and kl's two terms are within a small factor of D near the boundary, so
   nothing cancels there. float32's |D| is then within 2e-6 * delta of float64's near the boundary
   (3e-5 for js): tokens within NEAR * delta of it are decided again in float64, as are those float32
   cannot hold (a denormal 1 - mu, |log mu| < 1.2e-38, overflows the complement ratio), so every
   decision is float64's (tests/test_gppo.py checks a dense grid). A D that is NaN counts as outside.
6. Aggregation takes `global_count`, the denominator over the whole update (all micro-batches and
   ranks), so summed micro-batch gradients equal the whole-batch gradient exactly.
7. Baselines (GSPO, GMPO, SAPO, CISPO, Clip-Cov, DRPO, DGPO) follow their authors' definitions and
   default aggregation, and share the ratio, aggregation and stats code with the grid.
8. Speed (bench/bench_objective.py; cost is passes over (B, T) memory). Every loss gives its per-token
   objective and the objective's derivative in log pi (the "gradient weight" these papers compare),
   applied in one backward pass by _Surrogate: autograd through masks and clamps costs several passes,
   and on CPU torch.where (also inside clamp's backward) is not vectorised, ~20x a multiply. Padding is
   zeroed by a bitwise and (_zero_off); buffers the loss owns are reused in place (a fresh 4 MB
   temporary page-faults on CPU); the stats are one histogram plus five sums in one device sync.
"""
import math

import torch

LOG_RATIO_CLAMP = 20.0  # choice 4
# Tokens with |D| within NEAR * delta of delta are decided again in float64 (choice 5): near the boundary
# float32's |D| is within 2e-6 * delta of float64's (js: 3e-5), measured on a 16M-point (mu, r) grid.
NEAR = 1e-4
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


def group_advantages(rewards, G):
    """GRPO's group-relative advantage (GPPO.md section 2): (R - mean_group) / (std_group + 1e-6)
    per group of G completions, each group's G samples consecutive. (P*G,) -> (P*G,)"""
    r = rewards.view(-1, G)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)


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


def _bits(keep):
    """(B, T) bool -> int32, all ones where True: the operand of _zero_off."""
    return keep.to(torch.int32).neg_()


def _zero_off(x, bits):
    """torch.where(keep, x, 0) for float32 x, as a bitwise and with _bits(keep): bit-identical, NaN-safe,
    and vectorised on CPU, where torch.where is not (choice 8)."""
    return (x.view(torch.int32) & bits).view(torch.float32)


def _kept(x, keep):
    """x where keep, else 0, for finite x: a multiply by keep's bytes (2x faster than by the bool on CPU)."""
    return x * keep.view(torch.uint8)


def _prepare(logp, old_logp, advantages, mask):
    """(valid, old, adv, log_r, free): float32 copies of log mu and A, zeroed off the mask so padding (even
    NaN) never reaches loss or grad, log r clamped (choice 4), and `free`, where the clamp left log r as is
    (the gradient is exact there, 0 beyond). In place where the buffer is ours (choice 8)."""
    with torch.no_grad():
        valid = mask.bool()                                                  # (B, T)
        bits = _bits(valid)
        old = _zero_off(old_logp.detach().float(), bits)
        adv = advantages.detach().float()
        adv = _zero_off((adv[:, None] if adv.dim() == 1 else adv).expand(valid.shape), bits)
        log_r = _zero_off(logp.detach().float(), bits).sub_(old)             # 0 off the mask
        free = (log_r >= -LOG_RATIO_CLAMP) & (log_r <= LOG_RATIO_CLAMP)      # NaN: not free
        return valid, old, adv, log_r.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), free


class _Surrogate(torch.autograd.Function):
    """A loss value with its gradient written out (choice 8): forward returns `value` (logp only links the
    graph), backward gives logp the gradient coef * scale * grad."""
    @staticmethod
    def forward(ctx, logp, value, coef, scale):
        ctx.save_for_backward(coef, scale)
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        coef, scale = ctx.saved_tensors
        return coef * (scale * grad), None, None, None


def _loss(logp, obj, coef, valid, agg, global_count):
    """The loss -sum_t w_t obj_t, w the aggregation weights (choice 6), with gradient -w_t coef_t on each
    log pi_t: every loss here gives its per-token objective and the objective's derivative in log pi.
    coef may be a bool mask `keep`, meaning obj where keep and 0 elsewhere: made in obj's buffer."""
    w = _weights(valid, agg, global_count)
    total = obj.sum() * w if w.dim() == 0 else (obj * w).sum()
    if coef.dtype == torch.bool:
        coef = obj.mul_(coef.view(torch.uint8))
    return _Surrogate.apply(logp, -total, coef, -w)


def _complement(log_r, old):
    """(mu_c, r_c) = (1 - mu, (1 - pi)/(1 - mu)): binary's "every other token" (eq. 20). Both masses come
    from expm1, so mu or pi near 1 keep them exactly. At mu == 1 there is none: 0/0 or x/0, and r_c = 1
    makes the term mu_c * f(1) = 0 (choice 5)."""
    mu_m1 = torch.expm1(old)                                                 # mu - 1
    r_c = (old + log_r).clamp_(max=0).expm1_().div_(mu_m1)                  # (pi - 1)/(mu - 1), pi <= 1
    return mu_m1.neg_(), r_c.nan_to_num_(nan=1.0, posinf=1.0, neginf=1.0)


def _divergence(f, est, log_r, old, r=None):
    """|D(r)| (eqs. 18-20) from log r and log mu (r = e^log r if given), in their dtype, without gradient
    (choice 5). mc reads neither mu nor the complement and atomic no complement: they are not computed."""
    with torch.no_grad():
        mu = mu_c = r_c = None
        if est is not mc:
            mu = old.exp()
        if est is not mc and est is not atomic:
            mu_c, r_c = _complement(log_r, old)
        return est(f, log_r.exp() if r is None else r, mu, r_c, mu_c).abs_()


def _outside(f, est, log_r, old, delta, r=None):
    """(outside, d): |D(r)| > delta (NaN counts as outside) and |D(r)|, decided in float32 (choice 5).
    Tokens float32 cannot decide are decided again in float64: those within NEAR * delta of the
    boundary and, for binary, those with a denormal 1 - mu, whose complement ratio can overflow."""
    with torch.no_grad():
        d = _divergence(f, est, log_r, old, r)                               # (B, T) float32
        sure_in = d <= delta * (1 - NEAR)
        unsure = ~sure_in & (d <= delta * (1 + NEAR))
        if est is not mc and est is not atomic:
            unsure |= (old < 0) & (old > -torch.finfo(torch.float32).tiny)
        outside = ~sure_in
        if torch.count_nonzero(unsure):
            i = unsure.flatten().nonzero().squeeze(1)
            d64 = _divergence(f, est, log_r.flatten()[i].double(), old.flatten()[i].double())
            outside.view(-1)[i], d.view(-1)[i] = ~(d64 <= delta), d64.float()
        return outside, d


def _pushing(r, adv):
    """Which way each token's advantage pushes its ratio: (up, down), each (B, T) bool."""
    return (r > 1) & (adv > 0), (r < 1) & (adv < 0)


def _weights(valid, agg, global_count):
    """Each token's weight in the aggregated loss: loss = sum(w * per_token) (choice 6). A scalar for
    token-mean, else (B, 1)."""
    if agg == "token-mean":
        count, w = torch.count_nonzero(valid), 1.0
    else:
        n = valid.view(torch.uint8).sum(-1, keepdim=True, dtype=torch.float32)  # (B, 1) tokens per sequence
        count = torch.count_nonzero(n)                                       # sequences with a token
        w = 1 / n.clamp(min=1) if agg == "seq-mean-token-mean" else 1.0
    count = count if global_count is None else global_count
    return w / torch.as_tensor(count, dtype=torch.float32, device=valid.device).clamp(min=1)


def _aggregate(per_token, valid, agg, global_count):
    """Sum of per-token losses (zero off the mask) over the chosen denominator (choice 6)."""
    return (per_token * _weights(valid, agg, global_count)).sum()


def _stats(valid, log_r, old, r, d=None, **fracs):
    """Python floats over this batch's valid tokens, plus the BY_MU lists, in one device-to-host copy.
    log_r, old: as _prepare returns them; r = e^log r; d = |D(r)|, capped in place. fracs: name -> (B, T)
    bool, False off the mask (every loss here has A = 0 there, so its clip masks are), "clip_frac" the
    clipped mask the BY_MU split uses; missing keys are 0. Off the mask log r = log mu = D = 0."""
    with torch.no_grad():
        rv = _kept(r, valid)                                                 # r on the mask, 0 off it
        r_max = rv.amax() if rv.numel() else r.new_zeros(())               # r > 0 = padding
        # one histogram for every count: bit i of a token's code says whether clip mask i fired, the
        # high bits how many MU_EDGES lie above its mu (3 - its bucket; padding: 0, as mu = 1 there)
        names = [k for k in STATS if k in fracs]
        code = sum((old < math.log(e)).view(torch.uint8) for e in MU_EDGES) * (1 << len(names))
        for i, k in enumerate(names):
            code += fracs[k].view(torch.uint8) * (1 << i)
        hist = torch.bincount(code.flatten(), minlength=(len(MU_EDGES) + 1) << len(names))
        rm1 = torch.sub(r, 1, out=rv)                                         # rv's buffer, 0 off the mask
        # n, sum of r - 1, of k3 = r - 1 - log r (KL(mu || pi)), max r, sum of D capped (kl-binary: inf at pi = 1)
        sums = [torch.count_nonzero(valid), rm1.sum(), rm1.sub_(log_r).sum(),
                r_max, r.new_zeros(()) if d is None else d.clamp_(max=1e6).sum()]
        v = torch.cat([torch.stack([x.double() for x in sums]), hist.double()]).tolist()   # one device sync
    (n, s_rm1, s_k3, r_max, s_d), hist = v[:5], v[5:]
    m, per = max(n, 1.0), 1 << len(names)                                  # per: codes per bucket
    fired = lambda k, h: sum(x for c, x in enumerate(h) if k in names and c >> names.index(k) & 1)
    out = {k: fired(k, hist) / m for k in STATS}
    out.update(ratio_mean=(s_rm1 + n) / m, ratio_max=r_max, kl_k3=s_k3 / m, div_mean=s_d / m)
    n_b, c_b = [], []
    for above in reversed(range(len(MU_EDGES) + 1)):                         # bucket 0: mu < MU_EDGES[0]
        h = hist[above * per:(above + 1) * per]
        n_b.append(sum(h) - (log_r.numel() - n if above == 0 else 0))      # padding sits in mu >= 0.5
        c_b.append(fired("clip_frac", h))
    return {**out, "token_frac_by_mu": [x / m for x in n_b],
            "clip_frac_by_mu": [c / max(x, 1.0) for c, x in zip(c_b, n_b)]}

# -----------------------------------------------------------------------------
# The GPPO loss (paper eq. 11 as a mask, section 5).

def gppo_loss(logp, old_logp, advantages, mask, divergence, estimator, delta=None,
              ratio_bounds=(0.5, 10.0), dual_clip=10.0, agg="token-mean", global_count=None):
    """logp, old_logp, mask: (B, T); advantages: (B,) or (B, T). Returns (scalar loss, stats)."""
    f, est, delta = _check(divergence, estimator, delta, ratio_bounds, dual_clip, agg)
    valid, old, adv, log_r, free = _prepare(logp, old_logp, advantages, mask)
    with torch.no_grad():
        r = log_r.exp()                                                      # (B, T)
        outside, d = _outside(f, est, log_r, old, delta, r)                 # |D(r)| > delta, |D(r)|
        up, down = _pushing(r, adv)                                          # False off the mask (A = 0)
        push = up | down
        region = push & outside
        upper, lower = region & up, region & down
        none = torch.zeros_like(valid)
        bounds = none if ratio_bounds is None else \
            push & ((r > ratio_bounds[1]) | (r < ratio_bounds[0]))          # on the pushed side: lo <= 1 <= hi
        dual = none if dual_clip is None else (adv < 0) & (r > dual_clip)
        clipped = region | bounds | dual                                     # (B, T): no gradient
        obj = adv.mul_(r)                                                    # A r, in A's buffer (choice 8)
    # choice 2: the value is every token's -A r; the gradient -A r grad log pi only where kept
    return _loss(logp, obj, free & ~clipped, valid, agg, global_count), _stats(
        valid, log_r, old, r, d, clip_frac=clipped, clip_frac_upper=upper, clip_frac_lower=lower,
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
# The paper's other baselines (section 4.1), and two newer refinements of DPPO's and PPO's regions
# (DRPO, DGPO), each as its authors define it, with their defaults. Same inputs and stats keys as
# gppo_loss; keys a method has no notion of are 0.0. Each gives its objective and its derivative in log pi.

def gspo_loss(logp, old_logp, advantages, mask, agg="seq-mean-token-mean", global_count=None,
              eps_low=3e-4, eps_high=4e-4):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071, eq. 5): PPO's clip on the length-normalised sequence
    ratio s_i = exp(mean_t log r_t), eps 3e-4/4e-4. GSPO-token form: the token term sg(s_i) pi_t/sg(pi_t)
    has value s_i and gradient s_i * grad log pi_t; under seq-mean-token-mean (their 1/G sum_i, the
    default) this is exactly the sequence-level GSPO gradient."""
    _lookup(AGGS, agg, "agg")
    valid, old, adv, log_r, _ = _prepare(logp, old_logp, advantages, mask)
    with torch.no_grad():
        n = valid.view(torch.uint8).sum(-1, keepdim=True, dtype=torch.float32).clamp(min=1)   # (B, 1)
        log_s = log_r.sum(-1, keepdim=True) / n                             # (B, 1) log s_i
        s = log_s.exp()
        up, down = _pushing(s, adv)
        upper, lower = up & (s > 1 + eps_high), down & (s < 1 - eps_low)  # the sequence is clipped
        clipped = upper | lower
        obj = adv * s                                                        # (B, T)
        coef = _kept(obj, ~clipped)
    return _loss(logp, obj, coef, valid, agg, global_count), _stats(
        valid, log_r, old, log_r.exp(), clip_frac=clipped, clip_frac_upper=upper, clip_frac_lower=lower)


def gmpo_loss(logp, old_logp, advantages, mask, agg="seq-mean-token-mean", global_count=None,
              clip_low=0.4, clip_high=0.4):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673, their eq. for J_GMPO): maximise A_i times the
    geometric mean of the token ratios, each clipped PPO-style in log space to [-0.4, 0.4]
    (r in [e^-0.4, e^0.4]) on the side the advantage pushes. A clipped token keeps its clipped value
    in the geometric mean and gives no gradient; the others give A_i g_i grad log pi_t. Token form as in
    gspo_loss: exact under seq-mean-token-mean (the authors' 1/G sum_i)."""
    _lookup(AGGS, agg, "agg")
    valid, old, adv, log_r, free = _prepare(logp, old_logp, advantages, mask)
    with torch.no_grad():
        r = log_r.exp()
        up, down = _pushing(r, adv)
        upper, lower = up & (log_r > clip_high), down & (log_r < -clip_low)
        clipped = upper | lower
        log_rt = log_r + _kept(log_r.clamp(-clip_low, clip_high) - log_r, clipped)   # (B, T)
        n = valid.view(torch.uint8).sum(-1, keepdim=True, dtype=torch.float32).clamp(min=1)
        obj = adv * torch.exp(log_rt.sum(-1, keepdim=True) / n)             # (B, T): A_i g_i
        coef = _kept(obj, free & ~clipped)
    return _loss(logp, obj, coef, valid, agg, global_count), _stats(
        valid, log_r, old, r, clip_frac=clipped, clip_frac_upper=upper, clip_frac_lower=lower)


def sapo_loss(logp, old_logp, advantages, mask, agg="seq-mean-token-mean", global_count=None,
              tau_pos=1.0, tau_neg=1.05):
    """SAPO (Gao et al. 2025, arXiv 2511.20347): the hard clip becomes the soft gate
    f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos if A > 0 else tau_neg; its gradient weight
    4 sigma (1 - sigma) is 1 at r = 1 and decays smoothly. Aggregated as the authors do,
    1/G sum_i 1/|y_i| sum_t (seq-mean-token-mean). Nothing is clipped: clip_frac is 0."""
    _lookup(AGGS, agg, "agg")
    valid, old, adv, log_r, free = _prepare(logp, old_logp, advantages, mask)
    with torch.no_grad():
        r = log_r.exp()
        tau = tau_neg + (tau_pos - tau_neg) * (adv > 0)                     # (B, T)
        sigma = torch.sigmoid(tau * (r - 1))
        obj = adv * sigma * 4 / tau
        coef = _kept(adv * 4 * sigma * (1 - sigma) * r, free)              # d f/d log pi = 4 sigma (1-sigma) r
    return _loss(logp, obj, coef, valid, agg, global_count), _stats(valid, log_r, old, r)


def cispo_loss(logp, old_logp, advantages, mask, agg="token-mean", global_count=None,
               eps_low=None, eps_high=0.2):
    """CISPO (MiniMax-M1, arXiv 2506.13585, J_CISPO): REINFORCE weighted by the clipped, stop-gradient
    importance weight, sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi, over all tokens (token-mean).
    MiniMax set no lower bound (eps_low=None) and tuned only eps_high, value unpublished; 0.2 is VeRL's
    CISPO example. No token loses its gradient (not even beyond the log-ratio clamp); clip_frac counts
    tokens whose weight was clipped. Value -A w, comparable to the others; gradient -A w grad log pi."""
    _lookup(AGGS, agg, "agg")
    valid, old, adv, log_r, _ = _prepare(logp, old_logp, advantages, mask)
    with torch.no_grad():
        r = log_r.exp()
        w = r.clamp(min=None if eps_low is None else 1 - eps_low, max=1 + eps_high)   # (B, T)
        obj = adv * w
    return _loss(logp, obj, obj, valid, agg, global_count), _stats(
        valid, log_r, old, r, clip_frac=w != r, clip_frac_upper=w < r, clip_frac_lower=w > r)


def _ppo_clipped(r, adv, eps_low, eps_high):
    """PPO's clip as a mask: (upper, lower), the tokens pushed past 1 + eps_high or below 1 - eps_low."""
    up, down = _pushing(r, adv)
    return up & (r > 1 + eps_high), down & (r < 1 - eps_low)


def _clip_cov_candidates(lp, adv, r, valid, center, eps, cov_low, cov_high):
    upper, lower = _ppo_clipped(r, adv, eps, eps)
    cov = (lp - center[0]) * (adv - center[1])                              # (B, T) centred covariance
    return valid & ~(upper | lower) & (cov > cov_low) & (cov < cov_high)


def clip_cov_candidates(logp, old_logp, advantages, mask, center, eps=0.2, cov_low=1.0, cov_high=5.0):
    """Clip-Cov's candidates (Cui et al. 2025, arXiv 2505.22617, sec. 5), (B, T) bool: tokens PPO did not
    clip whose centred covariance (log pi - center[0]) (A - center[1]) lies in (cov_low, cov_high).
    center = (mean log pi, mean A) over the valid tokens of the whole mini-batch, so a trainer that
    computes it across micro-batches and ranks gets the whole-batch candidates in every micro-batch."""
    valid, _, adv, log_r, _ = _prepare(logp, old_logp, advantages, mask)
    lp = _zero_off(logp.detach().float(), _bits(valid))
    return _clip_cov_candidates(lp, adv, log_r.exp(), valid, center, eps, cov_low, cov_high)


def clip_cov_draw(candidates, n_valid, clip_ratio=2e-4, generator=None):
    """Clip-Cov's draw: (B, T) bool of k = max(1, int(clip_ratio * n_valid)) candidates picked uniformly
    (all of them if fewer), n_valid the valid tokens of the same batch; their gradient is detached."""
    idx = candidates.flatten().nonzero().squeeze(1)
    k = min(max(int(clip_ratio * n_valid), 1), idx.numel())
    device = generator.device if generator is not None else idx.device
    pick = idx[torch.randperm(idx.numel(), generator=generator, device=device)[:k].to(idx.device)]
    return torch.zeros_like(candidates).flatten().index_fill_(0, pick, True).view_as(candidates)


def clip_cov_loss(logp, old_logp, advantages, mask, agg="token-mean", global_count=None,
                  eps=0.2, clip_ratio=2e-4, cov_low=1.0, cov_high=5.0, generator=None, detach=None):
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617, sec. 5): PPO clip (eps 0.2), plus: of the tokens
    PPO did not clip whose centred covariance (log pi - mean)(A - mean) over the batch lies in
    (cov_low, cov_high), a random max(1, clip_ratio * N) (N = valid tokens) have their gradient
    detached. `generator` (torch.Generator) makes the draw reproducible. `detach` ((B, T) bool) replaces
    this batch's draw: under micro-batching the trainer draws once over the whole mini-batch
    (clip_cov_candidates with the mini-batch centre, then clip_cov_draw) and passes each micro-batch
    its slice, which makes the summed update the whole-batch one."""
    _lookup(AGGS, agg, "agg")
    valid, old, adv, log_r, free = _prepare(logp, old_logp, advantages, mask)
    with torch.no_grad():
        r = log_r.exp()
        upper, lower = _ppo_clipped(r, adv, eps, eps)                       # PPO's own clip
        if detach is None:
            n, lp = torch.count_nonzero(valid), _zero_off(logp.detach().float(), _bits(valid))
            center = (lp.sum() / n.clamp(min=1), adv.sum() / n.clamp(min=1))  # lp, A are 0 off the mask
            candidates = _clip_cov_candidates(lp, adv, r, valid, center, eps, cov_low, cov_high)
            by_cov = clip_cov_draw(candidates, n.item(), clip_ratio, generator)
        else:
            by_cov = detach.bool() & valid
        clipped = upper | lower | by_cov
        obj = adv * r
        coef = _kept(obj, free & ~clipped)
    return _loss(logp, obj, coef, valid, agg, global_count), _stats(
        valid, log_r, old, r, clip_frac=clipped, clip_frac_upper=upper, clip_frac_lower=lower)


def drpo_loss(logp, old_logp, advantages, mask, agg="token-mean", global_count=None, delta=0.1):
    """DRPO (Yao et al. 2026, "Rethinking the Divergence Regularization in LLM RL", arXiv 2606.09821,
    eq. 8; code: github.com/Tencent-Hunyuan/UniRL, unirl/algorithms/drpo.py): DPPO's binary-TV region
    |pi - mu| <= delta made smooth. Per token -A r + |A| mu (r - 1)^2 / (2 delta), r differentiable; as
    mu (r - 1) = pi - mu, the gradient is -A r grad log pi times 1 - sign(A)(pi - mu)/delta (their Table 1):
    1 at pi = mu, 0 on the region's boundary on the pushed side, negative (corrective) beyond it.
    Nothing is masked; clip_frac counts the tokens whose weight has reached or crossed 0
    (sign(A)(pi - mu) >= delta, DPPO's clipped set): there the penalty has cancelled the push.
    delta: the authors set this "regularization threshold" to 12.5 (paper sec. 4, drpo_epsilon=12.5),
    which under this formula is no region: |pi - mu| <= 1, so the weight stays in [0.92, 1.08] and never
    reaches 0. We default to 0.1, the tv-binary (DPPO) cell's delta (GPPO.md section 6), so the weight
    vanishes on that cell's boundary; delta=12.5 reproduces the authors' runs. Token-mean, as their code."""
    _lookup(AGGS, agg, "agg")
    if not delta > 0:
        raise ValueError(f"delta must be > 0, got {delta!r}")
    valid, old, adv, log_r, free = _prepare(logp, old_logp, advantages, mask)
    with torch.no_grad():
        r = log_r.exp()
        rm1 = r - 1
        shift = old.exp().mul_(rm1)                                          # pi - mu (mu = 1 off the mask)
        weight = (adv.sign() * shift).div_(-delta).add_(1)                   # their Table 1: 1 - sign(A) shift/delta
        ar = adv * r
        obj = ar - adv.abs().mul_(shift).mul_(rm1).div_(2 * delta)          # A r - |A| mu (r - 1)^2 / (2 delta)
        coef = ar.mul_(weight).mul_(free.view(torch.uint8))                  # A r weight, in A r's buffer
        upper, lower = (adv > 0) & (weight <= 0), (adv < 0) & (weight <= 0)  # the penalty cancelled the push
    return _loss(logp, obj, coef, valid, agg, global_count), _stats(
        valid, log_r, old, r, clip_frac=upper | lower, clip_frac_upper=upper, clip_frac_lower=lower)


def dgpo_loss(logp, old_logp, advantages, mask, agg="token-mean", global_count=None,
              eps_low=0.2, eps_high=0.2, n=1, m=2):
    """DGPO (Fu et al. 2026, arXiv 2603.14389; code: github.com/VenomRose-Juri/DGPO-RL,
    verl/trainer/ppo/core_algos.py, ratio_mode "dgpo"): PPO's clip [1 - eps_low, 1 + eps_high], but the
    tokens PPO would clip keep a decaying gradient. The loss is -A w per token, w with value w and
    gradient w grad log pi: w = r inside (PPO); r^(n+1) / (1 - eps_low)^n for A < 0, r < 1 - eps_low;
    (1 + eps_high)^(1/m) r^((m-1)/m) for A > 0, r > 1 + eps_high. Both equal r on their boundary, so value
    and weight are continuous, and the clipped tokens still move the way PPO's inner tokens do (A > 0 up,
    A < 0 down) with a weight on grad pi = pi grad log pi, w / r, that decays outwards as
    (r / (1 - eps_low))^n and ((1 + eps_high) / r)^(1/m). Defaults are the authors' (n=1, m=2, VeRL's eps
    0.2, token-mean); their DGPO branch skips the dual clip, and so do we. clip_frac: PPO's clipped tokens."""
    _lookup(AGGS, agg, "agg")
    if not (n >= 0 and m > 0):
        raise ValueError(f"need n >= 0 and m > 0, got n={n!r}, m={m!r}")
    valid, old, adv, log_r, free = _prepare(logp, old_logp, advantages, mask)
    with torch.no_grad():
        r = log_r.exp()
        upper, lower = _ppo_clipped(r, adv, eps_low, eps_high)
        lo, hi = math.log1p(-eps_low), math.log1p(eps_high)
        decay = _kept(n * (log_r - lo), lower) + _kept((hi - log_r) / m, upper)   # log w - log r, 0 inside
        obj = adv * torch.exp(log_r + decay)                                # A w
    return _loss(logp, obj, _kept(obj, free), valid, agg, global_count), _stats(
        valid, log_r, old, r, clip_frac=upper | lower, clip_frac_upper=upper, clip_frac_lower=lower)


BASELINES = {"gspo": gspo_loss, "gmpo": gmpo_loss, "sapo": sapo_loss, "cispo": cispo_loss,
             "clip_cov": clip_cov_loss, "drpo": drpo_loss, "dgpo": dgpo_loss}

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
