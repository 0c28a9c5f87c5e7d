"""
GPPO: the {Divergence x Estimator} proximal region as a policy loss, plus the paper's baselines.

Pure math: tensors in, (loss, stats) out. The paper is "Generalized Proximal Policy Optimization"
(Cai et al., arXiv 2610.13015); equation and section numbers below are its own.
`python bench/regions.py` prints every cell's region at a few mu (and the alpha family's,
`alpha:A`); `python bench/plot_regions.py` plots them against mu (out/gppo_regions.png).

Choices, in the order a reader meets them:
1. The clip is a mask (paper eq. 11, section 3.1): a token gives no policy gradient exactly when
   |D(r)| > delta and r left the region on the side its advantage pushes (r > 1 & A > 0, or
   r < 1 & A < 0); every other token gives A * grad r. Binary regions have no closed form, so we
   never compute clip_R(r).
2. The textbook form: obj = A * r; loss = -agg(torch.where(clipped, obj.detach(), obj)). The *value*
   is every token's -A r (comparable across cells), the gradient only the kept tokens'.
3. "Dual clipping with bounds 0.5 and 10" (paper section 4.1) is, in our reading, two rules: the
   region is intersected with `ratio_bounds` (the public RIPO code bounds its interval by
   [0.5, 10]), and tokens with A < 0 and r > dual_clip give no gradient (classic dual clip,
   Ye et al. 2020).
4. log r is clamped to +-20 before exp (r in [2e-9, 5e8]), so loss and gradient stay finite; beyond
   the clamp its own zero gradient removes the token, where ratio_bounds would anyway.
5. |D(r)| decides who is clipped and needs no gradient, so it is computed in float64: binary's
   complement ratio (1 - pi)/(1 - mu) reaches ~1e38 for mu near 1, which float32 cannot hold, and
   1 - mu comes from expm1 so it keeps its digits. A NaN D counts as outside.
6. Aggregation (`aggregate`) takes `global_count`, the denominator over the whole update (every
   micro-batch and rank), so summed micro-batch gradients equal the whole-batch gradient exactly.
7. Baselines (GSPO, GMPO, SAPO, CISPO, Clip-Cov, DRPO, DGPO) follow their authors' definitions and
   default aggregation (each signature's `agg`), and share _prepare, aggregate and _stats.
"""
import math

import torch

LOG_RATIO_CLAMP = 20.0  # choice 4
ESTIMATE_CHUNK = 1 << 16  # tokens per float64 pass of estimate(): 512 KB temporaries, kept in heap
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
STATS = ("clip_frac", "clip_frac_upper", "clip_frac_lower", "clip_frac_bounds", "clip_frac_dual",
         "ratio_mean", "ratio_max", "div_mean", "kl_k3")
CLIP_STATS = tuple(k for k in STATS if k.startswith("clip_frac"))  # the masks a loss hands _stats
# Where the region bites (the paper's Figure 1, measured), by mu < 0.01 | < 0.1 | < 0.5 | >= 0.5:
# share of the valid tokens in each bucket, and share of each bucket's tokens that were clipped.
MU_EDGES = (0.01, 0.1, 0.5)
MU_BUCKETS = len(MU_EDGES) + 1
BY_MU = ("token_frac_by_mu", "clip_frac_by_mu")

# -----------------------------------------------------------------------------
# Divergence generators f(r), r = pi/mu, f convex with f(1) = 0 (paper eqs. 14-17, section 3.2). A
# new divergence is one line here. Rule: it receives float64 r anywhere in [0, ~1e45] (binary's
# complement ratio, for 1 - mu as small as float32's smallest denormal) and must give a finite value
# or +inf there, never NaN, and 0 at r = 1; tests/test_gppo.py::test_divergence_rule checks it
# (README "How to add a divergence").

def tv(r):        return (r - 1).abs() / 2                  # eq. 14, total variation
def chi2(r):      return (r - 1) ** 2                       # eq. 15, Pearson chi^2
def kl(r):        return -torch.log(r)                      # eq. 16, KL(mu || pi)
def hellinger(r): return (torch.sqrt(r) - 1) ** 2           # eq. 17, squared Hellinger
# Not in the paper: Jensen-Shannon, JS(pi, mu) with m = (pi + mu)/2; xlogy makes js(0) = log(2)/2.
def js(r):        return (torch.xlogy(r, r) - torch.xlogy(r + 1, (r + 1) / 2)) / 2

# Estimators D(r) of D_f(pi || mu) from the one sampled token (eqs. 18-20, section 3.3). mu: its
# behaviour probability; mu_c = 1 - mu and r_c = (1 - pi)/(1 - mu): mass and ratio of "every other
# token".

def mc(f, r, mu, r_c, mu_c):     return f(r)                             # eq. 18
def atomic(f, r, mu, r_c, mu_c): return mu * f(r)                        # eq. 19
def binary(f, r, mu, r_c, mu_c): return mu * f(r) + mu_c * f(r_c)        # eq. 20

DIVERGENCES = {"tv": tv, "chi2": chi2, "kl": kl, "hellinger": hellinger, "js": js}
ESTIMATORS = {"mc": mc, "atomic": atomic, "binary": binary}

# Parametric families, not in the paper: name -> (parameter -> generator f obeying the rule above;
# ValueError for a parameter outside the family's domain). The divergence "alpha:0.5" is
# FAMILIES["alpha"](0.5), resolved by get_divergence like every name. Families stay out of
# DIVERGENCES, so what iterates it (the sweep's default cells, the region plot) is unchanged.
ALPHA_MAX = 1e6  # |a| bound of the alpha family: keeps a (a - 1) and a r finite in float64


def alpha(a):
    """Amari's alpha-divergence generator f_a(r) = (r^a - a r + a - 1) / (a (a - 1)), for any real
    a with |a| <= ALPHA_MAX. a = 2 is chi2 / 2 and a = 0.5 is 2 x hellinger: the same regions as
    chi2's and hellinger's, since default_delta scales with f. a = 1 and a = 0 are the limits
    r log r - r + 1 (KL(pi || mu)) and r - 1 - log r (KL(mu || pi); unlike kl's -log r it is >= 0
    per token, so its regions differ from kl's). Computed so that both terms of the numerator
    shrink with the distance to the nearer limit (digits kept for a near 0 or 1): expm1(a log r)
    - a (r - 1) for a < 1/2, r expm1((a - 1) log r) - (a - 1)(r - 1) otherwise. At r = 0 f is
    1/a for a > 0 and +inf for a <= 0; for large r it is finite or +inf (a > 1)."""
    a = float(a)
    if not abs(a) <= ALPHA_MAX:                             # NaN fails too
        raise ValueError(f"alpha:A takes a finite number A with |A| <= {ALPHA_MAX:g}, got {a!r}")
    if a == 1:
        return lambda r: torch.xlogy(r, r) - r + 1
    if a == 0:
        return lambda r: r - 1 - torch.log(r)
    if a < 0.5:
        return lambda r: (torch.expm1(a * torch.log(r)) - a * (r - 1)) / (a * (a - 1))
    # r^a - r, written r expm1((a - 1) log r), is 0 at r = 0 (0 * inf there for a < 1)
    return lambda r: (torch.where(r > 0, r * torch.expm1((a - 1) * torch.log(r)), 0.0)
                      - (a - 1) * (r - 1)) / (a * (a - 1))


FAMILIES = {"alpha": alpha}


def divergence_names():
    """What a divergence name may be, for help texts and errors: the DIVERGENCES, then FAMILY:A
    for each family (e.g. ['tv', 'chi2', 'kl', 'hellinger', 'js', 'alpha:A'])."""
    return [*DIVERGENCES, *(f"{k}:A" for k in FAMILIES)]


def get_divergence(name):
    """The generator f of the divergence `name`: a DIVERGENCES key, or FAMILY:A with A a number in
    the family's domain ("alpha:0.5"). Every function here that takes a divergence name resolves
    it with this; ValueError naming the value and what is accepted."""
    if isinstance(name, str) and name in DIVERGENCES:
        return DIVERGENCES[name]
    family, colon, param = str(name).partition(":")
    accepted = f"accepted: {', '.join(divergence_names())}"
    if family in FAMILIES:
        if not colon:
            raise ValueError(f"divergence {name!r} needs a parameter, {family}:A; {accepted}")
        try:
            a = float(param)
        except ValueError:
            raise ValueError(f"divergence {name!r}: its parameter {param!r} is not a number; "
                             f"{accepted}") from None
        try:
            return FAMILIES[family](a)
        except ValueError as e:
            raise ValueError(f"divergence {name!r}: {e}") from None
    if colon and family in DIVERGENCES:
        raise ValueError(f"divergence {name!r}: {family} takes no parameter; {accepted}")
    raise ValueError(f"unknown divergence {name!r}; {accepted}")

# Known methods as cells (paper section 3.4). "dapo" is the paper's mapping of clip-higher to
# kl-mc: region [e^-delta, e^delta] = [0.8, 1.25]; DAPO's own [0.8, 1.28] is no kl-mc region
# (symmetric in log r).
METHODS = {"grpo": ("tv", "mc"), "ppo": ("tv", "mc"), "dapo": ("kl", "mc"),
           "dppo": ("tv", "binary"), "ripo": ("chi2", "atomic")}


def estimate(log_r, log_mu, divergence, estimator):
    """|D(r)| per token in float64 (eqs. 18-20, choice 5), from log r and log mu; no gradient.
    `divergence`: any name get_divergence accepts ("kl", "alpha:0.5"), as everywhere below.
    ESTIMATE_CHUNK tokens at a time: whole-batch float64 temporaries are freed to the OS and
    page-faulted in again at every call (bench/bench_objective.py measures the difference)."""
    f = get_divergence(divergence)
    est = _lookup(ESTIMATORS, estimator, "estimator")
    with torch.no_grad():
        chunks = zip(log_r.flatten().split(ESTIMATE_CHUNK), log_mu.flatten().split(ESTIMATE_CHUNK))
        d = [_estimate_flat(f, est, lr.double(), lm.double()) for lr, lm in chunks]
        return torch.cat(d).view(log_r.shape)


def _estimate_flat(f, est, log_r, log_mu):
    mu = r_c = mu_c = None                                  # what an estimator does not read
    if est is not mc:
        mu = log_mu.exp()
    if est is binary:                                       # only binary reads the complement
        mu_c = -torch.expm1(log_mu)                         # 1 - mu, exact near mu = 1
        pi_c = -torch.expm1((log_mu + log_r).clamp(max=0))  # 1 - pi
        r_c = (pi_c / mu_c).nan_to_num(1.0, 1.0, 1.0)       # mu = 1 (0/0, x/0): no complement
    return est(f, log_r.exp(), mu, r_c, mu_c).abs()


def default_delta(divergence, r_min=0.8):
    """delta = |f(r_min)|: the mc region's lower bound is PPO's r_min (paper section 4.1)."""
    f = get_divergence(divergence)
    if not 0 < r_min < 1:
        raise ValueError(f"r_min must be in (0, 1), got {r_min!r}")
    return abs(float(f(torch.tensor(r_min, dtype=torch.float64))))


def group_advantages(rewards, G):
    """GRPO's group-relative advantage, which the paper uses for every method (section 4.1):
    (R - mean_group) / (std_group + 1e-6) per group of G completions, each group's G samples
    consecutive. (P*G,) -> (P*G,)"""
    r = rewards.view(-1, G)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)


def rloo_advantages(rewards, G):
    """RLOO's leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics:
    Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs"):
    R_i - the mean of its group's other G - 1 rewards. (P*G,) -> (P*G,)"""
    r = rewards.view(-1, G)
    return (r - (r.sum(1, keepdim=True) - r) / (G - 1)).view(-1)


def dr_grpo_advantages(rewards, G):
    """Dr. GRPO's unscaled advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training: A
    Critical Perspective"): R - mean_group, no division by the group's std. (P*G,) -> (P*G,)"""
    r = rewards.view(-1, G)
    return (r - r.mean(1, keepdim=True)).view(-1)


def reinforce_advantages(rewards, G):
    """Plain REINFORCE with a batch-mean baseline (Williams 1992): R - the mean over the whole
    batch; G is unused. (P*G,) -> (P*G,)"""
    return rewards - rewards.mean()


# --advantage NAME (train.py): every entry maps (rewards (P*G,), G) -> advantages (P*G,)
ADVANTAGES = {"grpo": group_advantages, "rloo": rloo_advantages, "dr_grpo": dr_grpo_advantages,
              "reinforce": reinforce_advantages}


def _lookup(table, key, kind):
    if key not in table:
        raise ValueError(f"unknown {kind} {key!r}; expected one of {', '.join(table)}")
    return table[key] if isinstance(table, dict) else key


def _check_delta(delta):
    """delta as a float: a number > 0 (not NaN: no token could ever be inside the region)."""
    try:
        value = math.nan if isinstance(delta, (str, bytes)) else float(delta)
    except (TypeError, ValueError):
        value = math.nan
    if not value > 0:
        raise ValueError(f"delta must be a number > 0, got {delta!r}")
    return value


def check_config(divergence, estimator, delta=None, ratio_bounds=None, dual_clip=None,
                 agg="token-mean"):
    """The region's settings checked (at parse time, and by gppo_loss at every call: a few
    microseconds); returns delta, defaulted to default_delta(divergence)."""
    get_divergence(divergence), _lookup(ESTIMATORS, estimator, "estimator")
    _lookup(AGGS, agg, "agg")
    delta = _check_delta(default_delta(divergence) if delta is None else delta)
    if ratio_bounds is not None and not (0 <= ratio_bounds[0] <= 1 <= ratio_bounds[1]
                                         and ratio_bounds[0] < ratio_bounds[1]):
        raise ValueError(f"ratio_bounds must be (low, high) with 0 <= low <= 1 <= high and "
                         f"low < high, got {ratio_bounds!r}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 or None, got {dual_clip!r}")
    return delta

# -----------------------------------------------------------------------------
# Shared by every loss: inputs made safe, aggregation, stats.

def _prepare(logp, old_logp, advantages, mask):
    """(valid, lp, old, log_r, adv), each (B, T) float32 and 0 off the mask, so padding (even NaN)
    never reaches loss or gradient. lp keeps logp's gradient, log_r = lp - old clamped
    (choice 4)."""
    valid = mask.bool()
    lp = torch.where(valid, logp.float(), 0.0)
    old = torch.where(valid, old_logp.detach().float(), 0.0)
    adv = advantages.detach().float()
    adv = torch.where(valid, adv[:, None] if adv.dim() == 1 else adv, 0.0)
    return valid, lp, old, (lp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), adv


def aggregate(per_token, mask, agg="token-mean", global_count=None):
    """One loss from per-token losses (B, T) (choice 6): token-mean sums every valid token and
    divides by their count; seq-mean-token-mean averages each sequence's tokens, then the sequences;
    seq-mean-token-sum sums each sequence's tokens, then averages the sequences. `global_count`
    replaces the denominator."""
    _lookup(AGGS, agg, "agg")
    mask = mask.bool()
    per_token = torch.where(mask, per_token, 0.0)
    n = mask.sum(-1)                                        # (B,) tokens per sequence
    if agg == "token-mean":
        total = per_token.sum()
    else:
        seq = per_token.sum(-1)
        seq = seq / n.clamp(min=1) if agg == "seq-mean-token-mean" else seq
        total = seq.sum()
    count = denominator(n, agg) if global_count is None else global_count
    return total / torch.as_tensor(count, dtype=torch.float32, device=total.device).clamp(min=1)


def denominator(tokens, agg):
    """What `aggregate` divides by, from the valid tokens per sequence (B,): their sum for
    token-mean, the sequences holding any otherwise; over micro-batches and ranks: global_count."""
    _lookup(AGGS, agg, "agg")
    return tokens.sum() if agg == "token-mean" else (tokens > 0).sum()


def _clipped_loss(obj, clipped, valid, agg, global_count):
    """Choice 2: value -obj for every token, gradient only where not clipped."""
    return aggregate(-torch.where(clipped, obj.detach(), obj), valid, agg, global_count)


def _reinforce(weight, log_x):
    """A term with value `weight` and gradient weight * grad log_x (weight held constant): how CISPO
    and DGPO write sg(w) A log pi while keeping a value comparable to the others' A r."""
    return weight.detach() * torch.exp(log_x - log_x.detach())


def _stats(valid, log_r, old, d=None, **clipped):
    """Python floats over the valid tokens: the STATS (masks in `clipped`: CLIP_STATS name -> (B, T)
    bool; missing ones are 0) and the BY_MU lists. d = |D(r)| for div_mean, capped at 1e6 (kl-binary
    is infinite at pi = 1). Off the mask log r = log mu = 0, so plain sums are the valid tokens'.
    A misspelt mask or a STATS name with no value raises instead of mislabelling."""
    unknown = sorted(set(clipped) - set(CLIP_STATS))
    if unknown:
        raise ValueError(f"_stats: unknown mask {unknown[0]!r}; masks: {', '.join(CLIP_STATS)}")
    with torch.no_grad():
        n = valid.count_nonzero().clamp(min=1)              # a bool .sum() would copy to int64
        log_r = log_r.detach()
        r = log_r.exp()
        zero = log_r.new_zeros(())
        values = {k: (clipped[k] & valid).count_nonzero() / n if k in clipped else zero
                  for k in CLIP_STATS}
        values.update(ratio_mean=1 + (r - 1).sum() / n,
                      ratio_max=torch.where(valid, r, 0).amax() if r.numel() else zero,
                      div_mean=zero if d is None else d.clamp(max=1e6).sum() / n,
                      kl_k3=(r - 1 - log_r).sum() / n)      # k3 estimate of KL(mu || pi)
        if values.keys() != set(STATS):
            raise AssertionError(f"_stats computes {sorted(values)}, STATS names {sorted(STATS)}")
        k = MU_BUCKETS
        # 0: mu < 0.01, ..., 3: mu >= 0.5; padding in a bucket of its own
        bucket = sum((old >= math.log(e)).to(torch.uint8) for e in MU_EDGES)
        bucket = torch.where(valid, bucket, k).flatten()
        clip = clipped.get("clip_frac", torch.zeros_like(valid)) & valid
        in_bucket = torch.bincount(bucket, minlength=k + 1)[:k]
        clip_bucket = torch.where(clip.flatten(), bucket, k)
        clipped_in_bucket = torch.bincount(clip_bucket, minlength=k + 1)[:k]
        v = torch.cat([torch.stack([values[s].float() for s in STATS]), (in_bucket / n).float(),
                       (clipped_in_bucket / in_bucket.clamp(min=1)).float()]).tolist()   # one sync
    return {**dict(zip(STATS, v[:len(STATS)])), "token_frac_by_mu": v[len(STATS):len(STATS) + k],
            "clip_frac_by_mu": v[len(STATS) + k:]}

# -----------------------------------------------------------------------------
# The GPPO loss (paper eq. 11, section 3.1, as a mask).

def gppo_loss(logp, old_logp, advantages, mask, divergence, estimator, delta=None,
              ratio_bounds=(0.5, 10.0), dual_clip=10.0, agg="token-mean", global_count=None):
    """logp, old_logp, mask: (B, T); advantages: (B,) or (B, T). Returns (scalar loss, stats)."""
    # refused here too, not only at parse time: gppo.py is imported on its own (a notebook, a
    # student's loop), and delta <= 0 would silently clip every token
    delta = check_config(divergence, estimator, delta, ratio_bounds, dual_clip, agg)
    valid, lp, old, log_r, adv = _prepare(logp, old_logp, advantages, mask)
    r = log_r.exp()                                         # (B, T), with gradient
    with torch.no_grad():
        d = estimate(log_r, old, divergence, estimator)     # |D(r)|, float64
        outside = ~(d <= delta)                             # NaN counts as outside
        up, down = (r > 1) & (adv > 0), (r < 1) & (adv < 0) # the side A pushes r to
        upper, lower = outside & up, outside & down
        bounds = dual = torch.zeros_like(valid)
        if ratio_bounds is not None:
            bounds = (up | down) & ((r > ratio_bounds[1]) | (r < ratio_bounds[0]))
        if dual_clip is not None:
            dual = (adv < 0) & (r > dual_clip)
        clipped = upper | lower | bounds | dual
    loss = _clipped_loss(adv * r, clipped, valid, agg, global_count)
    return loss, _stats(valid, log_r, old, d, clip_frac=clipped, clip_frac_upper=upper,
                        clip_frac_lower=lower, clip_frac_bounds=bounds, clip_frac_dual=dual)


# -----------------------------------------------------------------------------
# The paper's other baselines (section 4.1) and two newer refinements of DPPO's and PPO's regions
# (DRPO, DGPO), each as its authors define it, with their defaults (aggregation included). Same
# inputs and stats keys as gppo_loss; keys a method has no notion of are 0.0.

def _ppo_clipped(r, adv, eps_low, eps_high):
    """PPO's clip as a mask: (upper, lower), the tokens pushed past 1 + eps_high or below
    1 - eps_low."""
    return (adv > 0) & (r > 1 + eps_high), (adv < 0) & (r < 1 - eps_low)


def gspo_loss(logp, old_logp, advantages, mask, agg="seq-mean-token-mean", global_count=None,
              eps_low=3e-4, eps_high=4e-4):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071, eq. 5): PPO's clip [1 - eps_low, 1 + eps_high] on
    the length-normalised sequence ratio s_i = exp(mean_t log r_t). Every token of sequence i
    carries A_i s_i, so under their 1/G sum_i (seq-mean-token-mean) the loss is exactly GSPO's."""
    valid, lp, old, log_r, adv = _prepare(logp, old_logp, advantages, mask)
    n = valid.sum(-1, keepdim=True).clamp(min=1)            # (B, 1)
    log_s = (lp - old).sum(-1, keepdim=True) / n
    s = log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # (B, 1)
    with torch.no_grad():
        upper, lower = _ppo_clipped(s.expand_as(adv), adv, eps_low, eps_high)   # whole sequences
        upper, lower = upper & valid, lower & valid
    loss = _clipped_loss(adv * s, upper | lower, valid, agg, global_count)
    return loss, _stats(valid, log_r, old, clip_frac=upper | lower, clip_frac_upper=upper,
                        clip_frac_lower=lower)


def gmpo_loss(logp, old_logp, advantages, mask, agg="seq-mean-token-mean", global_count=None,
              clip_low=0.4, clip_high=0.4):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673): maximise A_i times the geometric mean of the token
    ratios, each clipped PPO-style in log space to [-clip_low, clip_high] on the side the advantage
    pushes; a clipped token keeps its clipped value in the mean and gives no gradient."""
    valid, lp, old, log_r, adv = _prepare(logp, old_logp, advantages, mask)
    with torch.no_grad():
        upper, lower = (adv > 0) & (log_r > clip_high), (adv < 0) & (log_r < -clip_low)
    log_r_clipped = torch.where(upper | lower, log_r.clamp(-clip_low, clip_high).detach(), log_r)
    n = valid.sum(-1, keepdim=True).clamp(min=1)
    geo_mean = torch.exp(torch.where(valid, log_r_clipped, 0.0).sum(-1, keepdim=True) / n)  # (B, 1)
    loss = aggregate(-adv * geo_mean, valid, agg, global_count)
    return loss, _stats(valid, log_r, old, clip_frac=upper | lower, clip_frac_upper=upper,
                        clip_frac_lower=lower)


def sapo_loss(logp, old_logp, advantages, mask, agg="seq-mean-token-mean", global_count=None,
              tau_pos=1.0, tau_neg=1.05):
    """SAPO (Gao et al. 2025, arXiv 2511.20347): the hard clip becomes the soft gate
    sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos if A > 0 else tau_neg; its gradient weight
    4 sigma (1 - sigma) is 1 at r = 1 and decays smoothly. Nothing is clipped: clip_frac is 0."""
    valid, lp, old, log_r, adv = _prepare(logp, old_logp, advantages, mask)
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (log_r.exp() - 1)) * 4 / tau
    return aggregate(-adv * gate, valid, agg, global_count), _stats(valid, log_r, old)


def cispo_loss(logp, old_logp, advantages, mask, agg="token-mean", global_count=None,
               eps_low=None, eps_high=0.2):
    """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by the clipped, stop-gradient
    importance weight, sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi, over all tokens. MiniMax set
    no lower bound (eps_low=None) and did not publish eps_high; 0.2 is VeRL's CISPO example. No
    token loses its gradient (not even beyond the log-ratio clamp); clip_frac counts tokens whose
    weight was clipped."""
    valid, lp, old, log_r, adv = _prepare(logp, old_logp, advantages, mask)
    r = log_r.detach().exp()
    w = r.clamp(min=None if eps_low is None else 1 - eps_low, max=1 + eps_high)
    loss = aggregate(-_reinforce(adv * w, lp), valid, agg, global_count)
    return loss, _stats(valid, log_r, old, clip_frac=w != r, clip_frac_upper=w < r,
                        clip_frac_lower=w > r)


def clip_cov_candidates(logp, old_logp, advantages, mask, center, eps=0.2, cov_low=1.0,
                        cov_high=5.0):
    """Clip-Cov's candidates (Cui et al. 2025, arXiv 2505.22617, sec. 5), (B, T) bool: tokens PPO
    did not clip whose centred covariance (log pi - center[0]) (A - center[1]) lies in (cov_low,
    cov_high); center = (mean log pi, mean A) over the whole mini-batch's valid tokens."""
    with torch.no_grad():
        valid, lp, old, log_r, adv = _prepare(logp, old_logp, advantages, mask)
        upper, lower = _ppo_clipped(log_r.exp(), adv, eps, eps)
        cov = (lp - center[0]) * (adv - center[1])
        return valid & ~(upper | lower) & (cov > cov_low) & (cov < cov_high)


def clip_cov_draw(candidates, n_valid, clip_ratio=2e-4, generator=None):
    """Clip-Cov's draw: (B, T) bool of k = max(1, int(clip_ratio * n_valid)) candidates picked
    uniformly (all of them if fewer), n_valid the valid tokens of the same batch; their gradient is
    detached."""
    idx = candidates.flatten().nonzero().squeeze(1)
    k = min(max(int(clip_ratio * n_valid), 1), idx.numel())
    device = generator.device if generator is not None else idx.device
    pick = idx[torch.randperm(idx.numel(), generator=generator, device=device)[:k].to(idx.device)]
    return torch.zeros_like(candidates).flatten().index_fill_(0, pick, True).view_as(candidates)


def clip_cov_loss(logp, old_logp, advantages, mask, agg="token-mean", global_count=None,
                  eps=0.2, clip_ratio=2e-4, cov_low=1.0, cov_high=5.0, detach=None):
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617, sec. 5): PPO's clip (eps 0.2), plus a random
    max(1, clip_ratio * N) of clip_cov_candidates (N = valid tokens) have their gradient detached:
    `detach` ((B, T) bool), clip_cov_draw's pick over the whole mini-batch, sliced per micro-batch
    (infra/clip_cov.py draws it for the trainer; None detaches none). clip_ratio, cov_low and
    cov_high are the draw's settings, read from here by --loss_kwargs."""
    valid, lp, old, log_r, adv = _prepare(logp, old_logp, advantages, mask)
    r = log_r.exp()
    with torch.no_grad():
        upper, lower = _ppo_clipped(r, adv, eps, eps)
        clipped = upper | lower if detach is None else upper | lower | (detach.bool() & valid)
    loss = _clipped_loss(adv * r, clipped, valid, agg, global_count)
    return loss, _stats(valid, log_r, old, clip_frac=clipped, clip_frac_upper=upper,
                        clip_frac_lower=lower)


def drpo_loss(logp, old_logp, advantages, mask, agg="token-mean", global_count=None, delta=0.1):
    """DRPO (Yao et al. 2026, arXiv 2606.09821, eq. 8; code: Tencent-Hunyuan/UniRL, drpo.py):
    DPPO's binary-TV region |pi - mu| <= delta made smooth. Per token -A r + |A| mu (r - 1)^2 /
    (2 delta): as mu (r - 1) = pi - mu, the gradient is -A r grad log pi times
    1 - sign(A)(pi - mu)/delta (their Table 1), 1 at pi = mu, 0 on the region's boundary on the
    pushed side, negative (corrective) beyond it. clip_frac: tokens whose weight reached 0 (DPPO's
    clipped set). The authors' delta 12.5 is no region here (|pi - mu| <= 1): we use 0.1."""
    delta = _check_delta(delta)
    valid, lp, old, log_r, adv = _prepare(logp, old_logp, advantages, mask)
    r = log_r.exp()
    mu = old.exp()
    per_token = -adv * r + adv.abs() * mu * (r - 1) ** 2 / (2 * delta)
    with torch.no_grad():
        stopped = adv.sign() * mu * (r - 1) >= delta        # the penalty cancelled the push
        upper, lower = stopped & (adv > 0), stopped & (adv < 0)
    loss = aggregate(per_token, valid, agg, global_count)
    return loss, _stats(valid, log_r, old, clip_frac=upper | lower, clip_frac_upper=upper,
                        clip_frac_lower=lower)


def dgpo_loss(logp, old_logp, advantages, mask, agg="token-mean", global_count=None,
              eps_low=0.2, eps_high=0.2, n=1, m=2):
    """DGPO (Fu et al. 2026, arXiv 2603.14389; code: VenomRose-Juri/DGPO-RL, ratio_mode "dgpo"):
    PPO's clip, but the tokens PPO would clip keep a decaying gradient. Per token -A w, w with value
    w and gradient w grad log pi: w = r inside; r^(n+1) / (1 - eps_low)^n for A < 0,
    r < 1 - eps_low; (1 + eps_high)^(1/m) r^((m-1)/m) for A > 0, r > 1 + eps_high. Both equal r
    on their boundary; the weight on grad pi, w / r, decays outwards. Authors' defaults (n=1, m=2,
    eps 0.2, token-mean, no dual clip). clip_frac: PPO's clipped tokens."""
    if not (n >= 0 and m > 0):
        raise ValueError(f"need n >= 0 and m > 0, got n={n!r}, m={m!r}")
    valid, lp, old, log_r, adv = _prepare(logp, old_logp, advantages, mask)
    with torch.no_grad():
        upper, lower = _ppo_clipped(log_r.exp(), adv, eps_low, eps_high)
        log_w = torch.where(lower, (n + 1) * log_r - n * math.log1p(-eps_low), log_r)
        log_w = torch.where(upper, math.log1p(eps_high) / m + (m - 1) / m * log_r, log_w)
    loss = aggregate(-_reinforce(adv * log_w.exp(), log_r), valid, agg, global_count)
    return loss, _stats(valid, log_r, old, clip_frac=upper | lower, clip_frac_upper=upper,
                        clip_frac_lower=lower)


BASELINES = {"gspo": gspo_loss, "gmpo": gmpo_loss, "sapo": sapo_loss, "cispo": cispo_loss,
             "clip_cov": clip_cov_loss, "drpo": drpo_loss, "dgpo": dgpo_loss}
