"""Unit tests of train.py's update phase on a real batch: the committed tiny model samples a few groups with
transformers, and train.py's own functions (advantages, minibatches, update) run on them in-process, with a
real Accelerator and AdamW. Each test names the invariant it guards; together they catch the refactoring
bugs an end-to-end run does not (advantages without the std, clipping off, a --target_kl that never fires,
epochs or mini-batch order lost, micro-batching that changes the update)."""
import copy
import json
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import gppo  # noqa: E402
import train  # noqa: E402
from rollout import RolloutBatch  # noqa: E402

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


def run_update(sampled, *flags, hook=None):
    """train.update on the sampled batch under `flags`; returns (UpdateLog, the model after it). `hook`:
    an optimizer step pre-hook, called with the gradient each AdamW step uses (after clipping)."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM
    tok, state, batch, rewards = sampled
    args = train.parse_args(["--prompts_per_iter", str(P), "--group_size", str(G), "--prompts_per_update", "2",
                             "--max_new_tokens", "24", "--lr", "1e-3", *flags])
    acc = Accelerator(cpu=True)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "model"), dtype=torch.float32)
    model.load_state_dict(copy.deepcopy(state))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if hook:
        opt.register_step_pre_hook(hook)
    model, opt = acc.prepare(model, opt)
    run = SimpleNamespace(acc=acc, model=model, opt=opt, ref_model=None, pad_id=tok.eos_token_id)
    s = train.Samples(batch, rows=None, positions=list(range(P)))
    s.old_logp, s.tis, _ = train.behaviour_logprobs(args, model, batch, tok.eos_token_id, acc.device)
    _, s.advantages, s.keep = train.advantages(args, rewards, batch)
    log = train.update(args, run, s, train.minibatches(args, 1), 1)
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
    """The summed micro-batch gradients are the whole mini-batch's (gppo.py choice 6): every step's
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
    got, _ = train.policy_loss(args, lp, old, adv, mask, None)
    want, _ = gppo.gspo_loss(lp, old, adv, mask, agg="seq-mean-token-mean", eps_low=0.1, eps_high=0.3)
    assert got.item() == want.item()
    for flags, says in [(["--method", "gspo", "--loss_kwargs", "eps=0.1"], "eps_low, eps_high"),
                        (["--loss_kwargs", "delta=0.1"], "--delta"),
                        (["--method", "drpo", "--loss_kwargs", "delta=-1"], "delta must be > 0"),
                        (["--method", "sapo", "--loss_kwargs", "tau_pos=fast"], "not a Python literal")]:
        with pytest.raises(ValueError, match=says):
            train.parse_args(flags)
