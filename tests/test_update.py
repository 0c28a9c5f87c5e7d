"""Unit tests of train.py's update phase on a real batch: the committed tiny model samples a few groups with
transformers, and train.py's own functions (advantages, minibatches, update) run on them in-process, with a
real Accelerator and AdamW. Each test names the invariant it guards; together they catch the refactoring
bugs an end-to-end run does not (advantages without the std, clipping off, a --target_kl that never fires,
epochs or mini-batch order lost, micro-batching that changes the update), and flags that must reach
the computation (--head_precision, --epochs' reshuffle, --kl_coef's sign and size,
--drop_uniform_groups, each --agg's whole-mini-batch denominator, --entropy_coef's gradient,
--lr_schedule's lr at every AdamW step).

The last section runs train.py itself (slow tier): the options of mature trainers (--overlong mask
and punish, --drop_uniform_groups, --tis_cap, --kl_coef with --ref_model), each against a run on the
same recorded batch without it (--save_rollouts / --replay_rollouts, conftest.py's tiny model)."""
import copy
import json
import math
import os
import subprocess

import pytest
import torch

from conftest import ENV, MP, ROOT, metrics, ok, run, train_cmd, update_of

import gppo
import infra.logprobs
from infra.metrics import mismatch_sums
import train
from rollout import RolloutBatch

TINY = os.path.join(os.path.dirname(__file__), "..", "data", "tiny")
P, G = 8, 4          # prompts per iteration, completions per prompt


@pytest.fixture(scope="module")
def sampled():
    """(tokenizer, model state, RolloutBatch, rewards): P problems x G completions sampled at temperature 1
    by the committed warm start, seeded; rewards 0/1 drawn so that every group has both."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(os.path.join(TINY, "model"))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "model"), dtype=torch.float32)
    with open(os.path.join(TINY, "math_train.jsonl")) as f:
        problems = [json.loads(line)["problem"] for line, _ in zip(f, range(P))]
    prompts, completions, truncated = [], [], []
    torch.manual_seed(0)
    for text in problems:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out = model.generate(torch.tensor([ids]), do_sample=True, top_k=0, top_p=1.0, max_new_tokens=24,
                             num_return_sequences=G, pad_token_id=tok.eos_token_id)
        for seq in out[:, len(ids):].tolist():
            end = seq.index(tok.eos_token_id) + 1 if tok.eos_token_id in seq else len(seq)
            prompts.append(ids), completions.append(seq[:end]), truncated.append(end == len(seq) and
                                                                                 seq[-1] != tok.eos_token_id)
    batch = RolloutBatch(prompts, completions, [[0.0] * len(c) for c in completions], truncated,
                         tok.batch_decode(completions))
    rewards = torch.tensor([float(j < 1 + i % (G - 1)) for i in range(P) for j in range(G)])
    return tok, model.state_dict(), batch, rewards


def update_args(*flags):
    """run_update's flags: the sampled batch's sizes, then `flags`."""
    return train.parse_args(["--prompts_per_iter", str(P), "--group_size", str(G),
                             "--prompts_per_update", "2", "--max_new_tokens", "24", "--lr", "1e-3",
                             *flags])


def tiny_model(state):
    """The committed tiny model holding the weights `state` (a copy)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "model"), dtype=torch.float32)
    model.load_state_dict(copy.deepcopy(state))
    return model


def run_update(sampled, *flags, hook=None, ref=None, it=1):
    """train.update on the sampled batch under `flags` as iteration `it`; returns (UpdateLog, the
    model after it). `hook`: an optimizer step pre-hook, called with the gradient each AdamW step
    uses (after clipping). `ref`: weights (a state dict) of --kl_coef's frozen reference, prepared
    as train.setup prepares it."""
    from accelerate import Accelerator
    tok, state, batch, rewards = sampled
    args = update_args(*flags)
    acc = Accelerator(cpu=True)
    model = tiny_model(state)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if hook:
        opt.register_step_pre_hook(hook)
    model, opt = acc.prepare(model, opt)
    ref_model = None
    if ref is not None:
        ref_model = acc.prepare_model(tiny_model(ref).eval().requires_grad_(False),
                                      evaluation_mode=True)
    run = train.Run(acc=acc, model=model, opt=opt, ref_model=ref_model, pad_id=tok.eos_token_id)
    s = train.Samples(batch, rows=None, positions=list(range(P)))
    s.proximal_logp, s.tis, s.start_logp = train.proximal_logprobs(args, model, batch, tok.eos_token_id, acc.device)
    _, s.advantages, s.keep = train.advantages(args, rewards, batch)
    log = train.update(args, run, s, train.minibatches(args, it), it)
    return log, acc.unwrap_model(model)


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_advantages_by_hand():
    """GRPO's advantage, (R - mean) / (std + 1e-6) with the sample std, per group, on groups whose stds differ,
    and the shaped reward of --overlong punish it is computed from (train.advantages, what the loop uses)."""
    args = train.parse_args(["--group_size", "4", "--max_new_tokens", "8", "--overlong_buffer", "4"])
    lengths = [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 8]            # the last response hit max_new_tokens
    batch = RolloutBatch([[1]] * 12, [[5] * n for n in lengths], [[0.0] * n for n in lengths],
                         [n == 8 for n in lengths], [""] * 12)
    rewards = torch.tensor([1., 0., 0., 0.,   1., 1., 0., 0.,   1., 1., 1., 1.])
    shaped, adv, keep = train.advantages(args, rewards, batch)
    # group 1: mean 1/4, std sqrt(3/4 / 3) = 1/2; group 2: mean 1/2, std sqrt(1/3);
    # group 3: the last reward is punished fully (8 tokens = max): 1, 1, 1, 0 -> as group 1, reversed
    s2 = math.sqrt(1 / 3)
    hand = [1.5, -0.5, -0.5, -0.5, 0.5 / s2, 0.5 / s2, -0.5 / s2, -0.5 / s2, 0.5, 0.5, 0.5, -1.5]
    assert shaped.tolist() == [1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0]
    assert adv.tolist() == pytest.approx(hand, rel=1e-5) and keep.all()


def test_grad_clip_bounds_every_step(sampled):
    """With a tiny --grad_clip, the gradient AdamW steps with has at most that norm, and the logged
    (pre-clip) norm is larger, so clipping really happened."""
    seen = []
    hook = lambda opt, *a: seen.append(math.sqrt(sum(p.grad.double().pow(2).sum().item()
                                                     for g in opt.param_groups for p in g["params"]
                                                     if p.grad is not None)))
    log, _ = run_update(sampled, "--grad_clip", "1e-4", "--target_kl", "0", hook=hook)
    assert len(seen) == P // 2 and max(seen) <= 1e-4 * (1 + 1e-4)
    assert min(log.norms) > 1e-3


def test_target_kl_stops_after_the_first_step(sampled):
    """mu is recomputed, so the first mini-batch sees KL 0 and steps; after a large step the second sees
    KL > target and the iteration's remaining steps are skipped. Without the guard every step is taken."""
    log, _ = run_update(sampled, "--target_kl", "1e-9", "--lr", "0.05")
    assert log.kls[0] == pytest.approx(0, abs=1e-9) and log.kls[1] > 1e-9
    assert len(log.norms) == 1 and len(log.kls) == 2
    log, _ = run_update(sampled, "--target_kl", "0", "--lr", "0.05")
    assert len(log.norms) == P // 2 and len(log.kls) == P // 2


def test_epochs_take_every_minibatch_each_epoch(sampled):
    """--epochs 2: two passes, P/M steps each; the first in sampling order, the second reshuffled."""
    log, _ = run_update(sampled, "--epochs", "2", "--target_kl", "0")
    assert len(log.norms) == 2 * (P // 2)
    args = train.parse_args(["--seed", "3"])
    assert train.minibatch_order(args, 5, 0, 8) == list(range(8))
    second = train.minibatch_order(args, 5, 1, 8)
    assert sorted(second) == list(range(8)) and second != list(range(8))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_minibatches_are_the_same_for_any_process_count(world):
    """Every prompt lands in exactly one mini-batch of M (minibatches does not know the process
    count), and the ranks' shares of them are disjoint and cover the iteration."""
    args = train.parse_args(["--prompts_per_iter", "16", "--prompts_per_update", "4", "--seed", "2"])
    batches = train.minibatches(args, 7)
    assert sorted(p for b in batches for p in b) == list(range(16)) and all(len(b) == 4 for b in batches)
    shares = [p for r in range(world) for b in batches for p in train.rank_share(b, r, world)]
    assert sorted(shares) == list(range(16))


@pytest.mark.parametrize("method", ["kl-atomic", "gspo", "clip_cov"])
def test_micro_batching_does_not_change_the_update(sampled, method):
    """The summed micro-batch gradients are the whole mini-batch's (gppo.aggregate's global_count): every step's
    gradient agrees to float32 rounding. (Weights are not compared: AdamW's first step moves a weight by
    about lr * sign(g) even where g is 1e-12, so rounding-level differences show up as lr-sized ones.)"""
    flags = ["--method", method] if method != "kl-atomic" else []
    grads = lambda out: (lambda opt, *a: out.append(torch.cat([p.grad.flatten() for g in opt.param_groups
                                                               for p in g["params"] if p.grad is not None])))
    whole, parts = [], []
    run_update(sampled, *flags, "--target_kl", "0", "--lr", "1e-6", hook=grads(whole))
    run_update(sampled, *flags, "--target_kl", "0", "--lr", "1e-6", "--micro_batch_size", "3", hook=grads(parts))
    assert len(whole) == len(parts) == P // 2
    for a, b in zip(whole, parts):
        assert a.norm() > 0 and ((a - b).norm() / a.norm()).item() < 1e-4


def test_baselines_train_with_their_own_aggregation():
    """Without --agg each baseline uses its signature's default (GSPO, GMPO, SAPO: seq-mean-token-mean);
    --agg overrides it; the grid defaults to token-mean."""
    import inspect
    for name, fn in gppo.BASELINES.items():
        own = inspect.signature(fn).parameters["agg"].default
        assert train.parse_args(["--method", name]).agg == own
    assert train.parse_args(["--method", "gspo"]).agg == "seq-mean-token-mean"
    assert train.parse_args(["--method", "gspo", "--agg", "token-mean"]).agg == "token-mean"
    assert train.parse_args([]).agg == "token-mean"


def test_loss_kwargs_reach_the_loss_and_bad_ones_fail_at_parse_time():
    args = train.parse_args(["--method", "gspo", "--loss_kwargs", "eps_low=0.1,eps_high=0.3"])
    assert args.loss_kwargs == {"eps_low": 0.1, "eps_high": 0.3}
    g = torch.Generator().manual_seed(0)
    old = torch.rand(4, 6, generator=g).log()
    lp = (old + 0.3 * torch.randn(4, 6, generator=g)).clamp(max=0)
    adv, mask = torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.ones(4, 6, dtype=torch.bool)
    got, _ = train.chosen_loss(args)(lp, old, adv, mask)
    want, _ = gppo.gspo_loss(lp, old, adv, mask, agg="seq-mean-token-mean", eps_low=0.1, eps_high=0.3)
    assert got.item() == want.item()
    for flags, says in [(["--method", "gspo", "--loss_kwargs", "eps=0.1"], "eps_low, eps_high"),
                        (["--loss_kwargs", "delta=0.1"], "--delta"),
                        (["--method", "drpo", "--loss_kwargs", "delta=-1"], "delta must be a number > 0"),
                        (["--method", "sapo", "--loss_kwargs", "tau_pos=fast"], "not a Python literal")]:
        with pytest.raises(ValueError, match=says):
            train.parse_args(flags)


# ----------------------------------------------------------------------------------------------
# flags that must reach the computation: --head_precision, --epochs, --kl_coef,
# --drop_uniform_groups, --agg's denominator

def logprobs_by_hand(model, ids, attn):
    """log pi of each next token, (B, T-1): the plain float32 forward, log-softmax, gather."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_head_precision_reaches_the_head(sampled):
    """token_logprobs' head matmul runs at --head_precision, with and without gradient (the
    checkpointed chunks): fp32 is the plain float32 computation to float32 noise, bf16 differs from
    it by bf16-sized amounts. proximal_logprobs takes the flag from args."""
    tok, state, batch, _ = sampled
    model, pad = tiny_model(state), tok.eos_token_id
    ids, attn, resp = infra.logprobs.collate(batch, list(range(len(batch.texts))), pad, "cpu")
    mask = resp[:, 1:].bool()
    plain = logprobs_by_hand(model, ids, attn)[mask]
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            fp32, bf16 = (infra.logprobs.token_logprobs(model, ids, attn, resp, None, hp)[0][mask].detach()
                          for hp in ("fp32", "bf16"))
        # measured: fp32 ~1e-6 from the plain forward, bf16 ~1e-2
        assert (fp32 - plain).abs().max().item() < 1e-5
        assert 1e-4 < (bf16 - plain).abs().max().item() < 0.1
    mu = {hp: torch.cat(train.proximal_logprobs(update_args("--head_precision", hp), model, batch,
                                                pad, "cpu")[0]) for hp in ("fp32", "bf16")}
    assert (mu["fp32"] - plain).abs().max().item() < 1e-5
    assert 1e-4 < (mu["bf16"] - plain).abs().max().item() < 0.1


def test_epochs_reshuffle_inside_update(sampled, monkeypatch):
    """--epochs 2 in update() itself (8 mini-batches of one prompt): every epoch takes each
    mini-batch once, the first in sampling order, the second in another order. Recorded where
    update hands a mini-batch's passes to train.pad_with_fillers."""
    used, real = [], train.pad_with_fillers

    def spy(acc, passes):
        used.append(sorted({i // G for p in passes for i in p}))
        return real(acc, passes)

    monkeypatch.setattr(train, "pad_with_fillers", spy)
    flags = ["--epochs", "2", "--prompts_per_update", "1", "--target_kl", "0"]
    log, _ = run_update(sampled, *flags)
    batches = train.minibatches(update_args(*flags), 1)
    order = [batches.index(b) for b in used]
    assert len(batches) == P and len(order) == 2 * P and len(log.norms) == 2 * P
    assert order[:P] == list(range(P))
    assert sorted(order[P:]) == list(range(P)) and order[P:] != order[:P], order


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_reference_kl_by_hand(sampled, agg):
    """train.reference_kl against a hand computation of k3 = e^d - d - 1, d = log ref - log pi per
    token: the penalty is kl_coef x k3 aggregated, and its gradient wrt log pi is
    kl_coef x (1 - e^d) over the denominator; a gradient-descent step moves log pi towards log ref
    at every token."""
    tok, state, batch, _ = sampled
    ref = tiny_model(state).eval()
    ids, attn, resp = infra.logprobs.collate(batch, list(range(12)), tok.eos_token_id, "cpu")
    mask = resp[:, 1:].float()
    ref_lp = logprobs_by_hand(ref, ids, attn)
    g = torch.Generator().manual_seed(0)
    lp = (ref_lp + 0.3 * torch.randn(ref_lp.shape, generator=g)).requires_grad_()
    args = train.parse_args(["--kl_coef", "0.5", "--agg", agg])
    n_tok = mask.sum(-1, keepdim=True)
    count = mask.sum() if agg == "token-mean" else (n_tok > 0).sum()
    w = mask / count if agg == "token-mean" else mask / n_tok.clamp(min=1) / count   # token weights
    penalty, kl_sum = train.reference_kl(args, ref, (ids, attn, resp), lp, mask, count.item())
    penalty.backward()
    d = ref_lp - lp.detach()
    k3 = d.exp() - d - 1
    assert penalty.item() > 0
    assert penalty.item() == pytest.approx(0.5 * (k3 * w).sum().item(), rel=1e-5)
    assert kl_sum == pytest.approx((k3 * mask).sum().item(), rel=1e-5)
    want = 0.5 * (1 - d.exp()) * w
    assert (lp.grad - want).abs().max().item() < 1e-4 * want.abs().max().item()
    towards = -lp.grad * d                 # descent's change of log pi, signed towards log ref
    assert (towards[mask.bool()] > 0).all()


def k3_to(ref, model, batch, pad):
    """Mean k3 estimate of KL(pi || ref) over the batch's response tokens."""
    ids, attn, resp = infra.logprobs.collate(batch, list(range(len(batch.texts))), pad, "cpu")
    m = resp[:, 1:].bool()
    d = logprobs_by_hand(ref, ids, attn)[m] - logprobs_by_hand(model, ids, attn)[m]
    return (d.exp() - d - 1).mean().item()


def test_reference_kl_pulls_the_policy_to_the_reference(sampled):
    """--kl_coef through update(): with equal rewards (zero advantages, no overlong shaping) the KL
    penalty is the whole loss, so the steps bring a perturbed policy closer to the reference."""
    tok, state, batch, _ = sampled
    g = torch.Generator().manual_seed(0)
    moved = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    flags = ["--kl_coef", "1", "--overlong", "off", "--target_kl", "0", "--lr", "1e-4"]
    _, adv, _ = train.advantages(update_args(*flags), torch.ones(P * G), batch)
    assert not adv.any()
    ref, pad = tiny_model(state), tok.eos_token_id
    before = k3_to(ref, tiny_model(moved), batch, pad)
    log, model = run_update((tok, moved, batch, torch.ones(P * G)), *flags, ref=state)
    after = k3_to(ref, model, batch, pad)
    print(f"\nKL(pi || ref) before {before:.4g}, after {len(log.norms)} steps {after:.4g}")
    assert len(log.norms) == P // 2 and log.sums["kl_ref"] > 0
    # measured: 0.016 -> 0.003 (lr 1e-3 overshoots: 0.07)
    assert after < 0.5 * before


def test_drop_uniform_groups_keeps_exactly_the_mixed_groups():
    """--drop_uniform_groups: the kept samples are exactly the groups whose rewards are not all
    equal (the groups with a non-zero advantage), whole groups; without the flag all are kept."""
    groups = [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 1], [.5, .5, .5, .5],
              [0, 0, .5, 0]]
    rewards = torch.tensor([r for grp in groups for r in grp], dtype=torch.float32)
    n = len(rewards)
    batch = RolloutBatch([[1]] * n, [[5, 5]] * n, [[0.0] * 2] * n, [False] * n, [""] * n)
    args = train.parse_args(["--group_size", "4", "--overlong", "off", "--drop_uniform_groups"])
    want = torch.tensor([False, False, True, True, False, True]).repeat_interleave(4)
    _, adv, keep = train.advantages(args, rewards, batch)
    assert keep.tolist() == want.tolist()
    assert keep.tolist() == (adv.view(-1, 4).abs().amax(1) > 0).repeat_interleave(4).tolist()
    assert train.kept_samples(args, rewards, batch).tolist() == want.tolist()
    plain = train.parse_args(["--group_size", "4", "--overlong", "off"])
    assert train.kept_samples(plain, rewards, batch).all()


@pytest.mark.parametrize("agg", gppo.AGGS)
def test_update_denominator_is_the_whole_minibatch(sampled, agg):
    """--agg's denominator in update(): the first step's gradient, micro-batched 3 sequences a pass,
    is the gradient of the loss of the whole first mini-batch in one pass with gppo.aggregate's own
    denominator (tokens for token-mean, sequences for the seq-means), computed here."""
    tok, state, batch, rewards = sampled
    flags = ["--agg", agg, "--target_kl", "0", "--grad_clip", "1e9", "--micro_batch_size", "3"]
    grads = lambda opt: torch.cat([p.grad.flatten() for g in opt.param_groups for p in g["params"]])
    got = []
    run_update(sampled, *flags, hook=lambda opt, *a: got.append(grads(opt)))
    args, model, pad = update_args(*flags), tiny_model(state), tok.eos_token_id
    old, _, _ = train.proximal_logprobs(args, model, batch, pad, "cpu")
    _, adv, keep = train.advantages(args, rewards, batch)
    batches = train.minibatches(args, 1)
    idx = [p * G + j for p in batches[0] for j in range(G)]
    assert keep[idx].all() and len(idx) > 3
    ids, attn, resp, old_lp = infra.logprobs.collate(batch, idx, pad, "cpu", (old,))
    lp, _ = infra.logprobs.token_logprobs(model, ids, attn, resp)
    loss, _ = train.chosen_loss(args)(lp, old_lp, adv[idx], resp[:, 1:].float())
    loss.backward()
    want = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert want.norm() > 0 and ((got[0] - want).norm() / want.norm()).item() < 1e-4


# ----------------------------------------------------------------------------------------------
# --entropy_coef and --lr_schedule: each changes the update as its formula says

def entropy_by_hand(model, ids, attn):
    """The policy's entropy at each next-token position, (B, T-1), with its graph: the plain
    float32 forward over the whole vocabulary."""
    logp = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def test_entropy_keeps_its_gradient_through_the_chunks(sampled):
    """token_logprobs(entropy_grad=True) in several checkpointed chunks (1 MB of logits: 1020 tokens
    of the tiny model's 257-token vocabulary): the entropy and its gradient are the plain forward's;
    without entropy_grad (the default, a metric) it has no graph."""
    tok, state, batch, _ = sampled
    model = tiny_model(state)
    idx = list(range(len(batch.texts))) * 4
    ids, attn, resp = infra.logprobs.collate(batch, idx, tok.eos_token_id, "cpu")
    mask = resp[:, 1:].float()
    assert mask.sum() > 1020, "precondition: more than one chunk"
    _, ent = infra.logprobs.token_logprobs(model, ids, attn, resp, 1, entropy_grad=True)
    (ent * mask).sum().backward()
    got = flat_grad(model)
    model.zero_grad()
    want_ent = entropy_by_hand(model, ids, attn)
    (want_ent * mask).sum().backward()
    want = flat_grad(model)
    assert (ent - want_ent).mul(mask).abs().max().item() < 1e-5
    assert want.norm() > 0 and ((got - want).norm() / want.norm()).item() < 1e-4
    _, ent = infra.logprobs.token_logprobs(model, ids, attn, resp, 1)
    assert not ent.requires_grad


def flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def step_grad(opt):
    """The gradient an AdamW step uses, flat (read by an optimizer step pre-hook)."""
    return torch.cat([p.grad.flatten() for g in opt.param_groups for p in g["params"]])


def aggregated_by_hand(per_token, mask, agg):
    """--agg's definition over a whole batch (B, T): token-mean, or a mean over the sequences of
    each one's token mean or token sum."""
    if agg == "token-mean":
        return (per_token * mask).sum() / mask.sum()
    seq = (per_token * mask).sum(-1)
    return (seq / mask.sum(-1) if agg == "seq-mean-token-mean" else seq).mean()


@pytest.mark.parametrize("agg", gppo.AGGS)
def test_entropy_bonus_adds_the_gradient_of_minus_entropy(sampled, agg):
    """--entropy_coef 1 in update(): one AdamW step on the whole batch (micro-batched 5 sequences a
    pass), whose gradient less the --entropy_coef 0 one is the gradient of -coef x the entropy of
    the batch aggregated as --agg says, computed here by hand; the logged entropy is the same in
    both runs."""
    tok, state, batch, rewards = sampled
    flags = ["--prompts_per_update", str(P), "--target_kl", "0", "--grad_clip", "1e9",
             "--micro_batch_size", "5", "--agg", agg]
    got = {}
    logs = {}
    for coef in (0, 1):
        seen = []
        logs[coef], _ = run_update(sampled, *flags, "--entropy_coef", str(coef),
                                   hook=lambda opt, *a: seen.append(step_grad(opt)))
        assert len(seen) == 1
        got[coef] = seen[0]
    model, pad = tiny_model(state), tok.eos_token_id
    ids, attn, resp = infra.logprobs.collate(batch, list(range(P * G)), pad, "cpu")
    mask = resp[:, 1:].float()
    (-1.0 * aggregated_by_hand(entropy_by_hand(model, ids, attn), mask, agg)).backward()
    want = flat_grad(model)
    diff = got[1] - got[0]
    print(f"\n|grad of -entropy| {want.norm():.4g}, |policy gradient| {got[0].norm():.4g}")
    assert want.norm() > 1e-3 * got[0].norm()
    assert ((diff - want).norm() / want.norm()).item() < 1e-3
    assert logs[0].sums["entropy"] == logs[1].sums["entropy"] > 0


def peer_schedule(name, warmup, total, floor):
    """transformers' schedule of that name (what TRL and verl step), as a function of the step."""
    from transformers import (get_constant_schedule_with_warmup,
                              get_cosine_with_min_lr_schedule_with_warmup,
                              get_linear_schedule_with_warmup)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = {"constant": lambda: get_constant_schedule_with_warmup(opt, warmup),
             "cosine": lambda: get_cosine_with_min_lr_schedule_with_warmup(
                 opt, warmup, total, min_lr_rate=floor),
             "linear": lambda: get_linear_schedule_with_warmup(opt, warmup, total)}[name]()
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("name,warmup,floor", [("constant", 3, 0.0), ("cosine", 3, 0.1),
                                               ("cosine", 0, 0.0), ("linear", 2, 0.0)])
def test_learning_rate_is_transformers_schedule(name, warmup, floor):
    """train.learning_rate at every step of a run of 5 iterations x 4 steps equals transformers'
    schedule of the same name and settings (linear without a floor: transformers has none);
    the linear floor by hand."""
    flags = ["--iters", "5", "--prompts_per_iter", "8", "--prompts_per_update", "2"]
    args = train.parse_args([*flags, "--lr", "2.0", "--lr_schedule", name, "--warmup_steps",
                             str(warmup), "--min_lr_ratio", str(floor)])
    ours = [train.learning_rate(args, k) / 2.0 for k in range(20)]
    assert ours == pytest.approx(peer_schedule(name, warmup, 20, floor), abs=1e-12)
    args = train.parse_args([*flags, "--lr_schedule", "linear", "--min_lr_ratio", "0.2"])
    assert train.learning_rate(args, 5) == pytest.approx(args.lr * (0.2 + 0.8 * (1 - 5 / 20)))
    assert train.learning_rate(args, 19) == pytest.approx(args.lr * (0.2 + 0.8 * (1 - 19 / 20)))


@pytest.mark.parametrize("epochs", [1, 2])
def test_lr_schedule_reaches_every_adamw_step(sampled, epochs):
    """--lr_schedule cosine with warmup through update(), 1 or 2 epochs: the AdamW steps of
    iterations 1 and 2, in order, run at transformers' cosine schedule over the run's
    iters x epochs x P/M steps (each epoch's steps further along it), and the UpdateLog (the
    metrics row's lr) holds each iteration's first step's lr."""
    flags = ["--lr_schedule", "cosine", "--warmup_steps", "3", "--iters", "2", "--target_kl", "0",
             "--lr", "1e-4", "--epochs", str(epochs)]
    steps = epochs * P // 2                             # AdamW steps per iteration
    seen, logged = [], []
    for it in (1, 2):
        log, _ = run_update(sampled, *flags, it=it,
                            hook=lambda opt, *a: seen.append(opt.param_groups[0]["lr"]))
        logged.append(log.lr)
    want = [1e-4 * x for x in peer_schedule("cosine", 3, 2 * steps, 0.0)]
    assert seen == pytest.approx(want, rel=1e-9, abs=1e-15) and len(set(want)) == len(want)
    assert logged == pytest.approx([want[0], want[steps]], abs=1e-15) and logged[0] != logged[1]


# ----------------------------------------------------------------------------------------------
# the options of mature trainers through train.py (subprocess runs on the session's tiny model,
# conftest.py), each against a run on the same recorded batch without it

def run_parallel(cmds, timeout=400):
    """Two train.py runs at a time (2 cores); every one must succeed."""
    for i in range(0, len(cmds), 2):
        procs = [subprocess.Popen(c, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for c in cmds[i:i + 2]]
        for c, p in zip(cmds[i:i + 2], procs):
            text, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"{' '.join(c[1:])}: exit {p.returncode}\n{text[-4000:]}"


def uniform_groups(tiny, saved, G=8):
    """Sample indices of the groups of a saved rollout file whose G rewards are all equal (scored
    here, independently of train.py)."""
    import reward
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny / "model"))
    rows = {json.loads(line)["problem"]: json.loads(line)
            for name in ("math_train.jsonl", "code_train.jsonl") for line in open(tiny / name)}
    out = set()
    for g in range(len(saved["texts"]) // G):
        row = rows[tok.decode(saved["prompt_ids"][g * G])]
        if len(set(reward.score_rows(saved["texts"][g * G:(g + 1) * G], [row] * G))) == 1:
            out |= set(range(g * G, (g + 1) * G))
    return out


@pytest.mark.slow
def test_overlong_mask_gives_truncated_tokens_no_gradient(tiny, recorded, tmp_path):
    """--overlong mask: a truncated response's tokens must not reach the gradient. Every third
    sample of the groups with mixed rewards (non-zero advantages) is marked truncated in a copy of
    the recorded rollouts; a second copy also replaces those samples' tokens. Under the option the
    two copies give the same update; without it they do not."""
    marked, edited = tmp_path / "marked", tmp_path / "edited"
    marked.mkdir(), edited.mkdir()
    picked = 0
    for f in (recorded / "rollouts").iterdir():
        saved = json.loads(f.read_text())
        pick = [i for i in range(len(saved["texts"])) if i % 3 == 0 and i not in uniform_groups(tiny, saved)]
        for i in pick:
            saved["truncated"][i] = True                         # as if cut at the length limit
        (marked / f.name).write_text(json.dumps(saved))
        for i in pick:
            saved["completion_ids"][i] = [(t * 7 + 3) % 200 + 1 for t in saved["completion_ids"][i]]
        (edited / f.name).write_text(json.dumps(saved))
        picked += len(pick)
    assert picked > 0, "no sample with a non-zero advantage to mark in the recorded batch"
    # replayed rollouts need no sampler: --backend hf skips vLLM's start (the update is the same)
    run_parallel([train_cmd(tiny, tmp_path / (name + sub), *MP, *flags, "--backend", "hf",
                            "--replay_rollouts", str(folder))
                  for name, folder in (("marked", marked), ("edited", edited))
                  for flags, sub in ((["--overlong", "mask"], ""), ([], "-off"))])
    same = (update_of(tmp_path / "marked", tiny) - update_of(tmp_path / "edited", tiny)).abs().max().item()
    off = (update_of(tmp_path / "marked-off", tiny) - update_of(tmp_path / "edited-off", tiny)).abs().max().item()
    print(f"\n{picked} samples marked truncated; update change under --overlong mask {same:.3g}, without {off:.3g}")
    assert off > 1e-6, "without the option the edited tokens must change the update (else the test is vacuous)"
    assert same <= 1e-7, f"--overlong mask: the tokens of truncated responses changed the update by {same:.3g}"


@pytest.fixture(scope="module")
def same_batch(tiny, tmp_path_factory):
    """One update on one iteration's rollouts, 20-token responses (every code answer and some
    math ones are cut short), plus the same update with each option on the same rollouts."""
    d = tmp_path_factory.mktemp("options")
    base = ["--iters", "1", "--prompts_per_update", "8", "--max_new_tokens", "20"]
    ok(run(train_cmd(tiny, d / "off", *base, "--save_rollouts", str(d / "rollouts")))[0])
    options = {"mask": ["--overlong", "mask"],
               "punish": ["--overlong", "punish", "--overlong_buffer", "8"],
               "drop": ["--drop_uniform_groups"],
               "tis": ["--tis_cap", "0.5"],
               "kl": ["--kl_coef", "1.0", "--ref_model", str(d / "off" / "final")]}
    run_parallel([train_cmd(tiny, d / name, *base, *flags, "--backend", "hf",   # replayed: no sampler
                            "--replay_rollouts", str(d / "rollouts")) for name, flags in options.items()])
    return d


def rollouts_of(d):
    with open(d / "rollouts" / "iter_000001_rank000.json") as f:
        return json.load(f)


@pytest.mark.slow
def test_overlong_mask_drops_truncated_responses(same_batch, tiny):
    off, mask = metrics(same_batch / "off")[0], metrics(same_batch / "mask")[0]
    truncated = sum(rollouts_of(same_batch)["truncated"]) / 64
    assert 0 < truncated < 1 and off["truncated_frac"] == truncated
    assert off["kept_frac"] == 1.0
    assert math.isclose(mask["kept_frac"], 1 - truncated, abs_tol=1e-9)
    assert (update_of(same_batch / "mask", tiny) - update_of(same_batch / "off", tiny)).abs().max() > 1e-6


@pytest.mark.slow
def test_overlong_punish_is_dapos_soft_penalty(same_batch):
    # DAPO eq. 13: 0 up to max - buffer tokens, then -(len - (max - buffer)) / buffer, -1 at max
    lens = [len(c) for c in rollouts_of(same_batch)["completion_ids"]]
    expected = sum(min(max(0, n - (20 - 8)) / 8, 1.0) for n in lens) / len(lens)
    got = metrics(same_batch / "punish")[0]["overlong_penalty"]
    assert expected > 0 and math.isclose(got, expected, rel_tol=1e-6), (got, expected)
    assert metrics(same_batch / "off")[0]["overlong_penalty"] == 0.0


@pytest.mark.slow
def test_drop_uniform_groups_removes_whole_zero_advantage_groups(same_batch, tiny):
    off, drop = metrics(same_batch / "off")[0], metrics(same_batch / "drop")[0]
    uniform = off["uniform_group_frac"]
    assert 0 < uniform < 1, f"uniform_group_frac {uniform}: the batch cannot show what is dropped"
    assert drop["uniform_group_frac"] == uniform
    assert math.isclose(drop["kept_frac"], 1 - uniform, abs_tol=1e-9) and off["kept_frac"] == 1.0
    # dropping zero-advantage groups changes only the token-mean's denominator: the same direction
    # of gradient, a larger norm by (all tokens) / (kept tokens) > 1
    assert drop["grad_norm"] > off["grad_norm"] * 1.01


@pytest.mark.slow
def test_truncated_importance_sampling_weights_the_advantages(same_batch):
    # vLLM's and the trainer's log-probs agree here to ~1e-7, so every weight
    # min(pi_old / mu_vllm, 0.5) is 0.5: the gradient is exactly half the plain one
    off, tis = metrics(same_batch / "off")[0], metrics(same_batch / "tis")[0]
    assert off["logp_gap_vllm"] < 1e-4
    assert math.isclose(tis["grad_norm"], 0.5 * off["grad_norm"], rel_tol=1e-4), (tis["grad_norm"], off["grad_norm"])


@pytest.mark.slow
def test_truncated_importance_sampling_weighs_each_token(same_batch, tiny):
    """Per token, the TIS weight is min(pi_old / mu_vllm, cap) with pi_old the trainer's log-prob:
    vLLM's log-probs of the recorded batch are shifted by a different amount at every token, and
    train.proximal_logprobs must return exactly those per-token ratios, capped."""
    from transformers import AutoModelForCausalLM
    saved = rollouts_of(same_batch)
    saved.pop("positions")
    shift = lambda t: 0.3 * math.sin(1.7 * t + 0.4)          # noqa: E731  per-token shift of mu_vllm
    saved["logprobs"] = [[lp + shift(t) for t, lp in enumerate(lps)] for lps in saved["logprobs"]]
    batch = RolloutBatch(**saved)
    args = train.parse_args(["--model", str(tiny / "model"), "--tis_cap", "1.1", "--micro_batch_size", "5"])
    model = AutoModelForCausalLM.from_pretrained(str(tiny / "model"), dtype=torch.float32).eval()
    old, tis, start = train.proximal_logprobs(args, model, batch, 0, torch.device("cpu"))
    trainer = completion_logprobs(tiny / "model", saved)                 # written out independently
    vllm = torch.tensor([x for lps in saved["logprobs"] for x in lps])
    expected = (trainer - vllm).exp().clamp(max=1.1)
    got = torch.cat(tis)
    assert got.std() > 0.05 and (got < 1.1).any() and (got == 1.1).any(), "weights must vary per token and hit the cap"
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    assert torch.allclose(torch.cat(old), trainer, atol=1e-5)           # mu: the trainer's own log-probs
    assert start is old        # recompute: the start log-probs are the proximal policy's
    gap = mismatch_sums(train.Samples(batch, None, None, start_logp=start))   # the row's gap
    assert gap[1] == len(got) and math.isclose(gap[0] / gap[1], (trainer - vllm).abs().mean().item(), rel_tol=1e-4)


@torch.no_grad()
def completion_logprobs(model_dir, batch):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for p, c in zip(batch["prompt_ids"], batch["completion_ids"]):
        ids = torch.tensor([p + c])
        lp = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        out.append(lp[len(p) - 1:])
    return torch.cat(out)


@pytest.mark.slow
def test_kl_penalty_to_a_reference_is_k3(same_batch, tiny):
    # reference = the policy after the plain update, so KL(policy || ref) > 0 from the first token;
    # with one update over one micro-batch the logged kl_ref is the k3 mean at the start policy
    batch = rollouts_of(same_batch)
    d = completion_logprobs(same_batch / "off" / "final", batch) - completion_logprobs(tiny / "model", batch)
    expected = (d.exp() - d - 1).mean().item()
    got = metrics(same_batch / "kl")[0]["kl_ref"]
    assert expected > 0 and math.isclose(got, expected, rel_tol=1e-3), (got, expected)
    assert metrics(same_batch / "off")[0]["kl_ref"] == 0.0
    assert (update_of(same_batch / "kl", tiny) - update_of(same_batch / "off", tiny)).abs().max() > 1e-6
