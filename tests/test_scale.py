"""Issue #5 at tiny scale on this CPU: two processes against one, checkpoints and resume, the options.

Run: .venv/bin/python -m pytest tests/test_scale.py -q   (CPU, no network, ~5 min on 2 cores)

Every test runs train.py as a subprocess, as a user would, on the session's tiny model
(conftest.py). Runs that train on *the same batch* use --save_rollouts / --replay_rollouts: one
run samples and writes its rollouts, the others train on them, so a difference in the update is
the trainer's, never the sampler's.
"""
import json
import math
import os
import signal
import subprocess
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import ENV, PY, ROOT, load_params, metrics, ok, run, update_of

# `accelerate launch` with two processes: --multi_gpu is its torchrun launcher; on a machine
# without GPUs train.py's Accelerator(cpu=True) then runs them as MULTI_CPU over gloo
LAUNCH_2 = [PY, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
TIMERS = ("time_rollout_s", "time_reward_s", "time_logp_s", "time_update_s", "time_sync_s",
          "time_iter_s", "tokens_per_s")


def train_cmd(tiny, out, *flags):
    return [PY, "train.py", "--model", str(tiny / "model"), "--data_dir", str(tiny), "--threads", "1",
            "--prompts_per_iter", "8", "--out_dir", str(out), *flags]


def run_parallel(cmds, timeout=400):
    """Two train.py runs at a time (2 cores); every one must succeed."""
    for i in range(0, len(cmds), 2):
        procs = [subprocess.Popen(c, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for c in cmds[i:i + 2]]
        for c, p in zip(cmds[i:i + 2], procs):
            text, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"{' '.join(c[1:])}: exit {p.returncode}\n{text[-4000:]}"


# ----------------------------------------------------------------------------------------------
# 1. two processes compute the update one process computes on the same batch

def test_two_processes_make_the_one_process_update(tiny, tmp_path):
    rollouts = tmp_path / "rollouts"
    # one update per iteration (M = P = 8 prompts): each rank holds 4 of the 8 groups
    flags = ["--iters", "1", "--prompts_per_update", "8"]
    ok(run(train_cmd(tiny, tmp_path / "one", *flags, "--save_rollouts", str(rollouts)))[0])
    two = ok(run(LAUNCH_2 + train_cmd(tiny, tmp_path / "two", *flags, "--replay_rollouts", str(rollouts))[1:],
                 timeout=400)[0])
    assert "2 process(es)" in two.stdout + two.stderr, "accelerate launch did not start two processes"
    a, b = metrics(tmp_path / "one")[0], metrics(tmp_path / "two")[0]
    assert a["reward_mean"] == b["reward_mean"] and a["response_len"] == b["response_len"]
    for k in ("entropy", "grad_norm", "clip_frac", "ratio_mean", "div_mean", "kl_k3"):
        assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-9), f"{k}: 1 process {a[k]}, 2 processes {b[k]}"
    one, two_ = update_of(tmp_path / "one", tiny), update_of(tmp_path / "two", tiny)
    diff, rel = (one - two_).abs().max().item(), ((one - two_).norm() / one.norm()).item()
    # Measured: max |diff| 1.9e-7, relative 4.5e-6, against an update of 3e-4 (lr 3e-4, one AdamW
    # step): gloo's all-reduce sums in another order. A trainer whose forward bypassed DDP's
    # wrapper (so no gradient all-reduce: each rank stepped on its own half) gave max 6e-4.
    print(f"\n1 vs 2 processes: max |param diff| {diff:.3g}, relative {rel:.3g}, update {one.abs().max():.3g}")
    assert one.abs().max().item() > 1e-4, "the update barely moved the weights; the comparison would be vacuous"
    assert diff < 1e-5 and rel < 1e-4, f"1 vs 2 processes: max |param diff| {diff:.3g}, relative {rel:.3g}"


# ----------------------------------------------------------------------------------------------
# 2. Ctrl-C, then --resume, gives the run that was never stopped

def test_ctrl_c_then_resume_equals_the_straight_run(tiny, tmp_path):
    flags = ["--iters", "4", "--prompts_per_update", "4", "--ckpt_every", "100"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    ok(run(train_cmd(tiny, straight, *flags))[0])

    proc = subprocess.Popen(train_cmd(tiny, stopped, *flags), cwd=ROOT, env={**ENV, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:                      # Ctrl-C as soon as iteration 2 is logged
        lines.append(line)
        if line.startswith("iter 2/4"):
            proc.send_signal(signal.SIGINT)
    proc.wait(timeout=300)
    text = "".join(lines)
    assert proc.returncode == 130, f"exit {proc.returncode} after SIGINT\n{text[-3000:]}"
    done = len(metrics(stopped))
    # the signal lands before or after iteration 2's end-of-iteration check: it stops after 2 or 3
    assert done in (2, 3), f"stopped after {done} iterations"
    ckpt = stopped / "checkpoints" / f"iter_{done:06d}"
    assert (ckpt / "trainer_state.json").is_file(), f"no checkpoint of iteration {done}: {os.listdir(ckpt.parent)}"
    assert not (stopped / "final").exists()

    resumed = ok(run(train_cmd(tiny, stopped, *flags, "--resume"))[0])
    assert f"resumed from {ckpt}" in resumed.stdout + resumed.stderr
    a, b = metrics(straight), metrics(stopped)
    assert [r["iter"] for r in b] == [1, 2, 3, 4], "metrics.jsonl must continue, not restart or repeat"
    for ra, rb in zip(a, b):
        for k in ra:
            if k not in TIMERS:
                assert ra[k] == rb[k], f"iteration {ra['iter']} {k}: straight {ra[k]}, resumed {rb[k]}"
    # Measured: bitwise equal. The sampler's data position, AdamW's moments, every RNG state and
    # vLLM's sampling (seeded per call from (seed, iteration), rollout.py) are all restored.
    pa, pb = load_params(straight / "final"), load_params(stopped / "final")
    assert all(torch.equal(pa[k], pb[k]) for k in pa), "the resumed run's weights differ from the straight run's"
    print(f"\nstopped after iteration {done} by SIGINT, resumed: metrics and weights bitwise equal")


# ----------------------------------------------------------------------------------------------
# 3. SIGKILL in the middle of writing a checkpoint leaves the previous one loadable

def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(tiny, tmp_path):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    proc = subprocess.Popen(train_cmd(tiny, out, "--iters", "30", "--prompts_per_update", "8",
                                      "--ckpt_every", "1", "--keep_last", "5"),
                            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    caught, deadline = None, time.time() + 300
    try:
        while proc.poll() is None and time.time() < deadline:
            names = os.listdir(ckpts) if ckpts.is_dir() else []
            tmp = [n for n in names if n.endswith(".tmp")]
            if tmp and any(not n.endswith(".tmp") for n in names):   # writing, with one complete before
                os.kill(proc.pid, signal.SIGKILL)
                caught = tmp[0]
                break
            time.sleep(0.0005)
    finally:
        proc.kill()
        proc.wait()
    assert caught, "never saw a checkpoint being written (the run ended or timed out first)"
    if not (ckpts / caught).exists():
        pytest.skip(f"the kill came just after {caught} was renamed into place; nothing half-written to test")
    complete = sorted(n for n in os.listdir(ckpts) if not n.endswith(".tmp"))
    last = int(complete[-1].split("_")[1])
    assert caught == f"iter_{last + 1:06d}.tmp", (caught, complete)

    resumed = ok(run(train_cmd(tiny, out, "--iters", str(last + 1), "--prompts_per_update", "8",
                               "--ckpt_every", "1", "--keep_last", "5", "--resume"))[0])
    assert f"resumed from {ckpts / complete[-1]}" in resumed.stdout + resumed.stderr
    assert [r["iter"] for r in metrics(out)] == list(range(1, last + 2))
    assert not (ckpts / caught).exists() and (ckpts / caught[:-4] / "trainer_state.json").is_file()
    print(f"\nSIGKILL while {caught} was being written; resumed from {complete[-1]}")


# ----------------------------------------------------------------------------------------------
# 4. the options of mature trainers, each against a run on the same batch without it

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
    run_parallel([train_cmd(tiny, d / name, *base, *flags, "--replay_rollouts", str(d / "rollouts"))
                  for name, flags in options.items()])
    return d


def rollouts_of(d):
    with open(d / "rollouts" / "iter_000001_rank000.json") as f:
        return json.load(f)


def test_overlong_mask_drops_truncated_responses(same_batch, tiny):
    off, mask = metrics(same_batch / "off")[0], metrics(same_batch / "mask")[0]
    truncated = sum(rollouts_of(same_batch)["truncated"]) / 64
    assert 0 < truncated < 1 and off["truncated_frac"] == truncated
    assert off["kept_frac"] == 1.0
    assert math.isclose(mask["kept_frac"], 1 - truncated, abs_tol=1e-9)
    assert (update_of(same_batch / "mask", tiny) - update_of(same_batch / "off", tiny)).abs().max() > 1e-6


def test_overlong_punish_is_dapos_soft_penalty(same_batch):
    # DAPO eq. 13: 0 up to max - buffer tokens, then -(len - (max - buffer)) / buffer, -1 at max
    lens = [len(c) for c in rollouts_of(same_batch)["completion_ids"]]
    expected = sum(min(max(0, n - (20 - 8)) / 8, 1.0) for n in lens) / len(lens)
    got = metrics(same_batch / "punish")[0]["overlong_penalty"]
    assert expected > 0 and math.isclose(got, expected, rel_tol=1e-6), (got, expected)
    assert metrics(same_batch / "off")[0]["overlong_penalty"] == 0.0


def test_drop_uniform_groups_removes_whole_zero_advantage_groups(same_batch, tiny):
    off, drop = metrics(same_batch / "off")[0], metrics(same_batch / "drop")[0]
    uniform = off["uniform_group_frac"]
    assert 0 < uniform < 1, f"uniform_group_frac {uniform}: the batch cannot show what is dropped"
    assert drop["uniform_group_frac"] == uniform
    assert math.isclose(drop["kept_frac"], 1 - uniform, abs_tol=1e-9) and off["kept_frac"] == 1.0
    # dropping zero-advantage groups changes only the token-mean's denominator: the same direction
    # of gradient, a larger norm by (all tokens) / (kept tokens) > 1
    assert drop["grad_norm"] > off["grad_norm"] * 1.01


def test_truncated_importance_sampling_weights_the_advantages(same_batch):
    # vLLM's and the trainer's log-probs agree here to ~1e-7, so every weight
    # min(pi_old / mu_vllm, 0.5) is 0.5: the gradient is exactly half the plain one
    off, tis = metrics(same_batch / "off")[0], metrics(same_batch / "tis")[0]
    assert off["logp_gap_vllm"] < 1e-4
    assert math.isclose(tis["grad_norm"], 0.5 * off["grad_norm"], rel_tol=1e-4), (tis["grad_norm"], off["grad_norm"])


@torch.no_grad()
def completion_logprobs(model_dir, batch):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for p, c in zip(batch["prompt_ids"], batch["completion_ids"]):
        ids = torch.tensor([p + c])
        lp = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        out.append(lp[len(p) - 1:])
    return torch.cat(out)


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
