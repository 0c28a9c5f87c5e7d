"""infra/metrics.py: a metrics row says what the iteration did. train.py's own proximal_logprobs
and update run in-process on a real batch (the committed tiny-rare model, a real Accelerator on the
CPU), and the row's numbers are checked against a plain forward pass by hand.

1. kl_k3_max, the KL(mu || pi) that --target_kl compares, is the mini-batch's token-weighted k3
   mean: micro-batches of different lengths weigh by their tokens.
2. logp_gap_vllm under --mu_source vllm is the mean |trainer - vLLM| log-prob over the tokens.
3. entropy is the mean over completion tokens, not over prompt or padding positions.
4. time_<phase>_s is each phase's own time, so the phases add up to at most time_iter_s.
5. answer_prob (--answer_probe) is read at --head_precision.

Run: .venv/bin/python -m pytest tests/test_metrics.py -q   (CPU, under a minute)
"""
import copy
import math
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT

import gppo
import train
from data.loaders import load_rows
from data.probes import ProbeRun
from infra.metrics import MetricsLog, Stopwatch, UpdateLog
from rollout import RolloutBatch

RARE = ROOT / "data" / "tiny_rare"
LENGTHS = [5, 1, 3, 7]              # completion tokens per sample (2 prompts x 2)
OFFSET = [0.4, -0.2, 0.1, -0.05]    # vLLM's log-prob minus the trainer's, per sample
FLAGS = ["--prompts_per_iter", "2", "--group_size", "2", "--prompts_per_update", "2",
         "--micro_batch_size", "3", "--max_new_tokens", "8", "--mu_source", "vllm",
         "--target_kl", "0", "--eval_data", "tiny-rare-math"]


def by_hand(model, prompt, completion):
    """One plain forward pass of prompt + completion: the completion tokens' log-probs, and the
    policy's entropy at every position (position t predicts token t+1)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1)      # (T-1, V)
    token = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)             # (T-1,)
    return token[-len(completion):], -(logp.exp() * logp).sum(-1)


@pytest.fixture(scope="module")
def updated():
    """One iteration's update under --mu_source vllm on 4 samples whose "vLLM" log-probs are the
    trainer's plus OFFSET: train.update's UpdateLog, its Samples and run, and the values by hand."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(RARE / "model")
    model = AutoModelForCausalLM.from_pretrained(RARE / "model", dtype=torch.float32)
    rows = load_rows("tiny-rare-math", "test", str(RARE), "plain", tok)[:20]
    prompts = [rows[i // 2]["prompt_ids"] for i in range(4)]
    completions = [[tok.convert_tokens_to_ids(c) for c in "abcdefg"[:n]] for n in LENGTHS]
    lp, ent = zip(*(by_hand(model, p, c) for p, c in zip(prompts, completions)))
    batch = RolloutBatch(prompts, completions, [(x + o).tolist() for x, o in zip(lp, OFFSET)],
                         [False] * 4, tok.batch_decode(completions))
    args = train.parse_args(FLAGS)
    acc = Accelerator(cpu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    policy, opt = acc.prepare(model, opt)   # the values by hand are the weights before the step
    run = SimpleNamespace(acc=acc, model=policy, opt=opt, ref_model=None, pad_id=tok.pad_token_id,
                          sources=["tiny-rare-math"], log=print, eval_rows=rows, tok=tok)
    s = train.Samples(batch, rows=rows[:2], positions=[0, 1])
    s.proximal_logp, s.tis, s.start_logp = train.proximal_logprobs(args, policy, batch, run.pad_id, acc.device)
    s.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    s.shaped, s.advantages, s.keep = train.advantages(args, s.rewards, batch)
    upd = train.update(args, run, s, train.minibatches(args, 1), 1)
    # the entropy where each completion token is predicted: the last len(c) positions
    ent_completion = torch.cat([e[-n:] for e, n in zip(ent, LENGTHS)])
    return SimpleNamespace(args=args, run=run, s=s, upd=upd, rows=rows,
                           ent=ent, ent_completion=ent_completion, prompts=prompts, lp=lp)


def row_of(updated, tmp_path, **flags):
    """MetricsLog.row of the fixture's iteration, under the fixture's flags changed by `flags`."""
    args = copy.copy(updated.args)
    vars(args).update(out_dir=str(tmp_path), **flags)
    run = updated.run
    probe = ProbeRun(args.answer_probe, run.eval_rows, run.tok, run.pad_id) if args.answer_probe else None
    return MetricsLog(args, run, [], probe).row(1, updated.s, updated.upd, {"time_iter_s": 1.0})


def test_target_kl_compares_the_token_weighted_kl_of_the_minibatch(updated, tmp_path):
    """The k3 KL(mu || pi) per token over the mini-batch, before its step: sum_i n_i k3(o_i) / sum_i
    n_i with k3(o) = e^-o - 1 + o (log pi/mu = -o); its micro-batches (3 and 1 samples) hold
    different token counts, so a mean over passes or a sum of per-pass means is another number."""
    assert len(updated.upd.kls) == 1 and len(updated.upd.norms) == 1   # one mini-batch, one step
    k3 = [math.exp(-o) - 1 + o for o in OFFSET]
    want = sum(n * k for n, k in zip(LENGTHS, k3)) / sum(LENGTHS)
    row = row_of(updated, tmp_path)
    assert row["kl_k3_max"] == pytest.approx(want, rel=1e-4)
    assert row["kl_k3"] == pytest.approx(want, rel=1e-4)     # the same KL from the passes' stats


def test_logp_gap_vllm_is_measured_under_mu_source_vllm(updated, tmp_path):
    """--mu_source vllm: the trainer's log-probs are never recomputed before the update, so the
    update measures the gap on its first passes: mean |trainer - vLLM| = sum n_i |o_i| / sum n_i."""
    want = sum(n * abs(o) for n, o in zip(LENGTHS, OFFSET)) / sum(LENGTHS)
    assert all(lp is not None for lp in updated.s.start_logp)   # proximal_logprobs left them to update
    assert row_of(updated, tmp_path)["logp_gap_vllm"] == pytest.approx(want, rel=1e-4)


def test_entropy_is_the_mean_over_completion_tokens(updated, tmp_path):
    """The row's entropy is the mean over the 16 completion tokens only; and UpdateLog.add, given
    an entropy at every position (prompt ones included), still averages over the mask alone."""
    want = updated.ent_completion.mean().item()
    assert row_of(updated, tmp_path)["entropy"] == pytest.approx(want, rel=1e-4)
    ent = updated.ent[0]                                   # (T-1,): every position of sample 0
    mask = torch.zeros_like(ent)
    mask[-LENGTHS[0]:] = 1.0
    assert ent[:-LENGTHS[0]].mean() > 0                    # the prompt positions weigh something
    lp = torch.zeros_like(ent)
    lp[-LENGTHS[0]:] = updated.lp[0]
    _, st = gppo.gppo_loss(lp[None], lp[None], torch.ones(1), mask[None], "tv", "mc")
    log = UpdateLog(gppo.STATS, gppo.MU_BUCKETS)
    log.add(st, ent[None], mask[None])
    assert log.sums["entropy"] / log.sums["n_tok"] == pytest.approx(ent[-LENGTHS[0]:].mean().item(),
                                                                    rel=1e-6)


def test_phase_timers_are_each_phases_own_time():
    """time_<phase>_s is the time since the previous lap, not since the iteration began: each is at
    least its phase's sleep and they add up to at most time_iter_s."""
    clock = Stopwatch()
    for phase, seconds in (("rollout", 0.2), ("logp", 0.05), ("update", 0.1)):
        time.sleep(seconds)
        clock.lap(phase)
    times = clock.total()
    assert times["time_rollout_s"] >= 0.2 and times["time_logp_s"] >= 0.05
    assert times["time_update_s"] >= 0.1
    phases = times["time_rollout_s"] + times["time_logp_s"] + times["time_update_s"]
    assert phases <= times["time_iter_s"] + 1e-6, times


def test_answer_probe_reads_the_policy_at_head_precision(updated, tmp_path):
    """--answer_probe with --head_precision bf16: the row's answer_prob is the probe's at bf16,
    which differs from fp32's (the premise, checked) on these rows."""
    model, acc = updated.run.model, updated.run.acc
    probe = ProbeRun("letters", updated.rows, updated.run.tok, updated.run.pad_id)
    at = {hp: probe.measure(model, acc, 3, hp) for hp in ("bf16", "fp32")}
    apart = max(abs(at["bf16"][k][r] - at["fp32"][k][r]) for k in at["bf16"] for r in at["bf16"][k])
    assert apart > 1e-5, at
    row = row_of(updated, tmp_path, answer_probe="letters", head_precision="bf16")
    assert row["answer_prob"] == at["bf16"]
