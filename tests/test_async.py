"""--async_lag K (infra/prefetch.py, train.py): the sampler works K iterations ahead of the trainer.

1. Which weights sampled each batch, read from the weights themselves: the log-probs the engine
   recorded for the batch of iteration t are those of the checkpoint after iteration t - 1 - K.
2. A resumed run trains on the batches an unbroken one does (the in-flight ones are checkpointed).
3. Two processes make the one-process update at K = 1 (slow tier).
4. What cannot sample ahead is refused at parse time, naming the flag.
"""
import json
import math
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import train
from conftest import LAUNCH_2, MP, load_params, metrics, ok, run, train_cmd, update_of
from infra.prefetch import Prefetch

TIMERS = ("time_rollout_s", "time_reward_s", "time_logp_s", "time_update_s", "time_sync_s",
          "time_iter_s", "tokens_per_s")


def test_prefetch_samples_each_batch_with_the_weights_k_iterations_older():
    """The loop's calls in order, with a sampler that records the version of the weights it sees
    and the thread it runs in."""
    for lag in (0, 1, 3):
        version, seen = {"now": 0}, {}

        def sample(it):
            seen[it] = (version["now"], threading.current_thread() is threading.main_thread())
            return it

        ahead = Prefetch(lag, restore=None, acc=None)
        for it in range(1, 8):
            assert ahead.take(it, sample) == it
            ahead.idle()              # before the sync, as train.py does
            version["now"] = it       # the sync: the engine now holds the weights after it
        assert {it: v for it, (v, _) in seen.items() if it < 8} == \
            {it: max(0, it - 1 - lag) for it in range(1, 8)}, lag
        assert all(main == (lag == 0) for _, main in seen.values()), "K >= 1 samples in a thread"
        assert max(seen) == 7 + lag, "the last iteration also samples K ahead"


def test_a_failed_sampling_fails_the_batches_queued_behind_it():
    """The error reaches the loop, and nothing more is sampled (a process whose engine failed
    exits instead of waiting at exit for the worker to sample the queued batches with it)."""
    calls = []

    def sample(it):
        calls.append(it)
        if it == 2:
            raise RuntimeError("engine failed")
        return it

    ahead = Prefetch(3, restore=None, acc=None)
    assert ahead.take(1, sample) == 1
    with pytest.raises(RuntimeError, match="engine failed"):
        ahead.take(2, sample)
    with pytest.raises(RuntimeError, match="batch 3 not sampled: sampling batch 2 failed"):
        ahead.take(3, sample)
    ahead.pool.shutdown(wait=True)
    assert calls == [1, 2], calls


def _logprobs(model, rollouts):
    """The model's log-prob of every sampled token of a saved RolloutBatch, flattened."""
    out = []
    with torch.no_grad():
        for p, c in zip(rollouts["prompt_ids"], rollouts["completion_ids"]):
            ids = torch.tensor([p + c])
            lp = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(lp[len(p) - 1:])
    return torch.cat(out)


def test_the_batch_of_iteration_t_was_sampled_by_the_weights_after_t_minus_1_minus_k(tiny, tmp_path):
    out, saved = tmp_path / "run", tmp_path / "rollouts"
    ok(run(train_cmd(tiny, out, *MP, "--iters", "4", "--async_lag", "1", "--mu_source", "vllm",
                     "--ckpt_every", "1", "--keep_last", "10", "--save_rollouts", str(saved)),
           timeout=300)[0])
    rows = metrics(out)
    assert [r["staleness"] for r in rows] == [0, 1, 1, 1]
    model = AutoModelForCausalLM.from_pretrained(str(tiny / "model"), dtype=torch.float32).eval()
    weights = {0: load_params(tiny / "model")}
    for v in (1, 2, 3):
        weights[v] = load_params(out / "checkpoints" / f"iter_{v:06d}")
    for t in (2, 3, 4):
        batch = json.loads((saved / f"iter_{t:06d}_rank000.json").read_text())
        recorded = torch.tensor([x for lp in batch["logprobs"] for x in lp])
        gap = {}
        for v, state in weights.items():
            model.load_state_dict(state, strict=False)   # a checkpoint stores the tied head once
            model.tie_weights()
            gap[v] = (_logprobs(model, batch) - recorded).abs().max().item()
        sampler = t - 2                                   # t - 1 - K
        print(f"\niteration {t}: max |log-prob gap| per weights {gap}")
        assert gap[sampler] < 1e-4, (t, gap)
        assert all(g > 100 * gap[sampler] for v, g in gap.items() if v != sampler), (t, gap)


def test_the_backward_pass_leaves_torch_s_generator_to_the_sampler(tiny, monkeypatch):
    """vLLM's sampler draws from torch's global generator in the prefetch thread while the trainer
    runs its backward pass. token_logprobs recomputes its head chunks there; had the recompute
    restored the generator to its forward-time state (torch.utils.checkpoint's default), the
    sampler would redraw old numbers and lose its own draws: seen as two unbroken K = 1 runs
    sampling different batches. The recompute must see the live stream."""
    from infra import logprobs
    seen, chunk = [], logprobs._chunk_logp_entropy
    monkeypatch.setattr(logprobs, "_chunk_logp_entropy",
                        lambda *a: seen.append(torch.random.get_rng_state()) or chunk(*a))
    model = AutoModelForCausalLM.from_pretrained(str(tiny / "model"), dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 4, 7, 3]])
    torch.manual_seed(0)
    logp, _ = logprobs.token_logprobs(model, ids, torch.ones_like(ids), torch.tensor([[0, 0, 1, 1, 1, 1]]))
    torch.rand(7)                           # the sampler's draws between forward and backward
    live = torch.random.get_rng_state()
    logp.sum().backward()
    assert len(seen) == 2, "the head chunk was not recomputed in the backward pass"
    assert torch.equal(seen[1], live), "the recompute rewound torch's generator"


@pytest.mark.slow
def test_the_options_of_mature_trainers_work_at_k_1(tiny, tmp_path):
    """LoRA, dynamic sampling, the KL guard and the reference KL in one run at K = 1."""
    out = tmp_path / "options"
    ok(run(train_cmd(tiny, out, *MP, "--iters", "3", "--async_lag", "1", "--mu_source", "vllm",
                     "--lora_rank", "4", "--drop_uniform_groups", "--target_kl", "0.05",
                     "--kl_coef", "0.01"), timeout=300)[0])
    rows = metrics(out)
    assert [r["staleness"] for r in rows] == [0, 1, 1]
    # under LoRA the reference is the policy with its adapters off
    assert rows[-1]["kl_ref"] > 0, "the adapters never moved the policy from the base model"
    assert sum(r["updates"] for r in rows) > 0


@pytest.mark.parametrize("mu", [["--mu_source", "vllm"], ["--tis_cap", "2"]],
                         ids=["coupled", "decoupled"])
@pytest.mark.slow
def test_resume_at_k_1_trains_the_batches_of_the_unbroken_run(tiny, tmp_path, mu):
    """A run SIGKILLed while it writes a checkpoint, then resumed: the batches are the same as the
    unbroken run's, token for token; the update is the same to float32 noise. Not
    bitwise: the first iterations after --resume differ from the unbroken run's in the last bits
    (1e-6 relative, measured) although both run on one thread each. Serialising the sampler
    (waiting for its batch before the update) makes them bitwise equal, so the difference comes
    from sampling and training overlapping in time, whose timing differs in a fresh process;
    two unbroken runs are bitwise equal."""
    flags = [*MP, "--async_lag", "1", *mu, "--iters", "4"]
    for out, kill, more in (("straight", [], []), ("broken", ["during", "3"], ["--ckpt_every", "1"]),
                            ("broken", [], ["--resume"])):
        # the broken run is SIGKILLed in the middle of iteration 3's checkpoint (tests/kill_at.py):
        # the resume starts from iteration 2's, with the batch then in flight
        cmd = train_cmd(tiny, tmp_path / out, *flags, *more,
                        "--save_rollouts", str(tmp_path / f"{out}-rollouts"))
        proc = run([cmd[0], "tests/kill_at.py", *kill, *cmd[2:]] if kill else cmd, timeout=300)[0]
        assert proc.returncode == -9 if kill else ok(proc)
    assert "(after iteration 2)" in proc.stdout
    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "broken")
    assert [r["iter"] for r in b] == [1, 2, 3, 4]
    for t in range(1, 5):    # the batches trained; batch 4 was sampled by the checkpoint's weights
        name = f"iter_{t:06d}_rank000.json"
        assert (tmp_path / "straight-rollouts" / name).read_text() == \
            (tmp_path / "broken-rollouts" / name).read_text(), f"batch {t} differs"
    for ra, rb in zip(a, b):
        assert ra["reward_mean"] == rb["reward_mean"] and ra["staleness"] == rb["staleness"]
        for k in ("ratio_mean", "kl_k3", "entropy", "grad_norm", "mismatch_kl_k3"):
            assert math.isclose(ra[k], rb[k], rel_tol=1e-4, abs_tol=1e-9), (ra["iter"], k)
    assert max(r["mismatch_kl_k3"] for r in a[1:]) > 0, "no staleness: the check says nothing"
    one, two = update_of(tmp_path / "straight", tiny), update_of(tmp_path / "broken", tiny)
    assert one.abs().max().item() > 1e-4, "the update barely moved the weights"
    assert (one - two).abs().max().item() < 1e-5


@pytest.mark.slow
def test_two_processes_make_the_one_process_update_at_k_1(tiny, recorded, tmp_path):
    # the recorded batches of iterations 1-2: iteration 1 trains while batch 2 is taken ahead in
    # each rank's thread, and the final checkpoint gathers both ranks' in-flight batches
    flags = [*MP, "--iters", "1", "--async_lag", "1", "--mu_source", "vllm",
             "--replay_rollouts", str(recorded / "rollouts")]
    ok(run(train_cmd(tiny, tmp_path / "one", *flags))[0])
    ok(run(LAUNCH_2 + train_cmd(tiny, tmp_path / "two", *flags)[1:], timeout=300)[0])
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for ra, rb in zip(a, b):
        assert ra["reward_mean"] == rb["reward_mean"] and ra["updates"] == rb["updates"]
        assert math.isclose(ra["kl_k3"], rb["kl_k3"], rel_tol=1e-4, abs_tol=1e-9)
    one, two = update_of(tmp_path / "one", tiny), update_of(tmp_path / "two", tiny)
    diff = (one - two).abs().max().item()
    assert one.abs().max().item() > 1e-4, "the update barely moved the weights"
    assert diff < 1e-4, f"1 vs 2 processes at K = 1: max |param diff| {diff:.3g}"   # as test_scale
    state = torch.load(tmp_path / "two" / "checkpoints" / "iter_000001" / "custom_checkpoint_1.pkl",
                       weights_only=False)                  # the prefetcher's: every rank's batch 2
    assert [list(r) for r in state["ranks"]] == [[2], [2]], state["ranks"]


@pytest.mark.parametrize("flags, named", [
    (["--async_lag", "-1"], "--async_lag"),
    (["--async_lag", "1", "--backend", "hf"], "--backend"),
    (["--async_lag", "1", "--sleep_mode"], "--sleep_mode"),
    (["--async_lag", "1", "--lora_rank", "4", "--lora_dropout", "0.1"], "--lora_dropout"),
])
def test_what_cannot_sample_ahead_is_refused_naming_the_flag(flags, named):
    with pytest.raises(ValueError, match=named):
        train.parse_args(flags + ["--out_dir", str(Path("/nonexistent"))])
