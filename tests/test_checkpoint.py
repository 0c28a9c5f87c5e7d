"""Checkpoints, in seconds: what a resume restores, and the commit point of a multi-process save.

Run: .venv/bin/python -m pytest tests/test_checkpoint.py -q   (~30 s on 2 cores)

1. In-process, through train.setup itself (--backend hf: no vLLM engine): a run takes an AdamW step,
   advances the prompt sampler and draws from every RNG, saves with infra.checkpoints.save_checkpoint, then
   goes on; a second train.setup restored by infra.checkpoints.load_checkpoint must hold the same AdamW
   moments and weights, and its next sampler draw and RNG draws must be the ones the first run
   made after the save. (Setup preparing the optimizer with accelerate and registering the sampler
   for checkpointing is what puts them into save_state.)
2. The lr schedule through train.py (--backend hf, 3 short iterations): a run resumed from its first
   checkpoint logs the straight run's rows, lr included; a resume that would change the schedule's
   length (--iters under a decaying schedule, --warmup_steps) is refused, naming the values.
3. Killed any way, nothing lost (tests/kill_at.py): a run SIGKILLed before, during, at the commit
   of and after a checkpoint write, resumed each time, ends with an unbroken run's weights and
   metrics rows; a checkpoint write that fails (a file-size limit) stops the run naming the
   folder and the space needed, and the previous checkpoint stays the latest and usable.
4. Two processes (accelerate launch, gloo; tests/two_ranks.py): rank 1 is slowed before its
   save_state, so iter_N.tmp may be renamed only once every rank's files are in it (the barrier
   in save_checkpoint). (The same run's minibatch_passes check is in tests/test_distributed.py.)
"""
import copy
import json
import os
import random
import resource
import subprocess

import numpy as np
import pytest
import torch

from conftest import ENV, PY, ROOT, load_params, metrics, ok, run

import train
from infra.checkpoints import load_checkpoint, prepare_out_dir, resume, save_checkpoint
from infra.flags import run_neutral

MODEL = str(ROOT / "data" / "tiny" / "model")     # the committed tiny model and its data sets
FLAGS = ["--backend", "hf", "--model", MODEL, "--prompts_per_iter", "8", "--prompts_per_update",
         "4", "--threads", "1", "--seed", "3"]


def start(out, *flags):
    """args and train.setup's run namespace, as train.main starts a run."""
    args = train.parse_args([*FLAGS, "--out_dir", str(out), *flags])
    return args, train.setup(args)


def step(args, run, it):
    """An iteration's worth of state changes: the sampler's draw, an AdamW step on its prompt."""
    chosen = run.sampler.take(args.prompts_per_iter, it)
    ids = torch.tensor([run.rows[chosen[0]]["prompt_ids"]])
    loss = run.model(input_ids=ids, labels=ids).loss
    run.acc.backward(loss)
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    return chosen


def draws(args, run, it):
    """What the run draws next: the sampler's prompts and every RNG accelerate checkpoints."""
    return {"sampler": run.sampler.take(args.prompts_per_iter, it), "torch": torch.rand(4).tolist(),
            "python": [random.random() for _ in range(3)], "numpy": np.random.rand(3).tolist()}


def test_resume_restores_optimizer_sampler_and_rngs(tmp_path):
    args, a = start(tmp_path)
    ckpt = os.path.join(args.out_dir, "checkpoints")
    step(args, a, 1)
    step(args, a, 2)
    torch.rand(5), random.random(), np.random.rand(2)        # the RNGs move on from their seeds
    save_checkpoint(args, a.acc, ckpt, 2)
    saved_opt = copy.deepcopy(a.opt.state_dict())
    saved_w = {k: v.clone() for k, v in a.acc.unwrap_model(a.model).state_dict().items()}
    straight = draws(args, a, 3)
    step(args, a, 4)                                    # the first run goes on before the resume
    assert sorted(os.listdir(ckpt)) == ["iter_000002"]

    args_b, b = start(tmp_path, "--resume")
    path, it = load_checkpoint(args_b, b.acc, ckpt)
    assert (path, it) == (os.path.join(ckpt, "iter_000002"), 2)
    got = b.opt.state_dict()
    assert saved_opt["state"] and got["state"].keys() == saved_opt["state"].keys(), \
        "AdamW's moments are not in the checkpoint"
    for k, st in saved_opt["state"].items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got["state"][k][name], st[name]), f"param {k}: {name} not restored"
    assert got["param_groups"] == saved_opt["param_groups"]
    w = b.acc.unwrap_model(b.model).state_dict()
    assert all(torch.equal(w[k], saved_w[k]) for k in saved_w)
    resumed = draws(args_b, b, 3)
    for k in straight:
        assert resumed[k] == straight[k], f"{k}: the resumed run draws other values than the first"


@pytest.mark.parametrize("earlier", [["metrics.jsonl"], ["checkpoints/iter_000003"],
                                     ["metrics.jsonl", "checkpoints/iter_000003"]])
def test_a_fresh_run_refuses_a_folder_holding_a_run(tmp_path, earlier):
    """A folder holding an earlier run's metrics, or its checkpoints alone (a run killed before
    its first row, or whose metrics were moved away), stops train.setup before anything loads,
    naming what it holds and the ways on; nothing in it changes. A later --resume would
    otherwise mix two runs."""
    for name in earlier:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir() if "checkpoints" in name else path.write_text('{"iter": 1}\n')
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    args = train.parse_args([*FLAGS, "--out_dir", str(tmp_path)])
    with pytest.raises(FileExistsError) as e:
        train.setup(args)
    says = str(e.value)
    assert f"--out_dir {tmp_path} already holds a run" in says and "--resume" in says \
        and "--overwrite" in says, says
    assert all(name.split("/")[0] in says for name in earlier), says
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_overwrite_deletes_every_file_of_the_earlier_run_and_nothing_else(tmp_path):
    """--overwrite: the earlier run's metrics, checkpoints, final policy, adapters, evaluations
    (eval_iter_* included), plot and the leftovers of an interrupted write go; a file of the
    user's stays."""
    for name in ("metrics.jsonl", "eval.json", "eval_start.json", "eval_iter_000010.json",
                 "eval_iter_000020.json", "dynamics.png", "metrics.jsonl.tmp", "notes.txt"):
        (tmp_path / name).write_text("x")
    for name in ("checkpoints/iter_000020", "final", "adapter", "final.tmp"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "model.safetensors").write_text("x")
    prepare_out_dir(train.parse_args([*FLAGS, "--out_dir", str(tmp_path), "--overwrite"]), True)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_resume_without_a_path_restores_the_newest_checkpoint(tmp_path):
    """Checkpoints after iterations 1, 9 and 10, each after one more AdamW step, a '.tmp' of an
    interrupted 11th: a plain --resume restores iteration 10's (its weights), and keeps the
    metrics rows up to 10 (the 11th is redone)."""
    args, a = start(tmp_path, "--keep_last", "5")
    ckpt = os.path.join(args.out_dir, "checkpoints")
    for it in (1, 9, 10):
        step(args, a, it)
        save_checkpoint(args, a.acc, ckpt, it)
    saved = {k: v.clone() for k, v in a.acc.unwrap_model(a.model).state_dict().items()}
    os.makedirs(os.path.join(ckpt, "iter_000011.tmp"))
    with open(os.path.join(args.out_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"iter": it}) + "\n" for it in range(1, 12))
    args_b, b = start(tmp_path, "--resume")
    path, it, history = resume(args_b, b.acc, ckpt)
    assert (path, it) == (os.path.join(ckpt, "iter_000010"), 10)
    assert [r["iter"] for r in history] == list(range(1, 11))
    w = b.acc.unwrap_model(b.model).state_dict()
    assert all(torch.equal(w[k], saved[k]) for k in saved), "not iteration 10's weights"


SCHEDULE = ["--train_data", "tiny-math", "--group_size", "2", "--max_new_tokens", "16", "--iters", "3",
            "--lr_schedule", "cosine", "--warmup_steps", "1", "--min_lr_ratio", "0.1", "--target_kl", "0",
            "--ckpt_every", "1", "--keep_last", "3", "--sample_every", "0"]


@pytest.mark.slow
def test_lr_schedule_resumes_exactly(tmp_path):
    """A cosine schedule with warmup over 3 iterations x 2 AdamW steps: each row logs the lr of the
    iteration's first step (train.learning_rate of steps 0, 2, 4: three different values), and the
    run resumed from its iteration-1 checkpoint redoes iterations 2-3 with the straight run's rows,
    every key but the timers (the weights, hence rewards and entropy, depend on every earlier lr)."""
    out = tmp_path / "run"
    cmd = [PY, "train.py", *FLAGS, *SCHEDULE, "--out_dir", str(out)]
    ok(run(cmd, timeout=300)[0])
    straight = metrics(out)
    args = train.parse_args([*FLAGS, *SCHEDULE])
    lrs = [r["lr"] for r in straight]
    assert lrs == [train.learning_rate(args, k) for k in (0, 2, 4)] and len(set(lrs)) == 3
    ok(run(cmd + ["--resume", str(out / "checkpoints" / "iter_000001")], timeout=300)[0])
    resumed = metrics(out)
    assert [r["iter"] for r in resumed] == [1, 2, 3]
    for a, b in zip(straight, resumed):
        for k in a:
            if not k.startswith("time_") and k != "tokens_per_s":
                assert a[k] == b[k], f"iteration {a['iter']} {k}: {a[k]} vs {b[k]}"


def test_resume_refuses_a_changed_schedule_length(tmp_path):
    """--iters is run-neutral (a run may be extended) except under a decaying schedule, whose length
    it sets: there a resume with another --iters is refused naming both values and why, as is
    another --warmup_steps or --lr_schedule; --resume_with_changes passes the check."""
    args = train.parse_args([*FLAGS, *SCHEDULE, "--out_dir", str(tmp_path)])
    ckpt = tmp_path / "checkpoints" / "iter_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps(
        {"iter": 1, "args": {k: v for k, v in vars(args).items() if k != "cell"}}))
    for changed, says in [(["--iters", "5"], "--iters 3 (now 5) (the lr schedule cosine decays"),
                          (["--warmup_steps", "2"], "--warmup_steps 1 (now 2)"),
                          (["--lr_schedule", "linear"], "--lr_schedule 'cosine' (now 'linear')")]:
        again = train.parse_args([*FLAGS, *SCHEDULE, "--out_dir", str(tmp_path), "--resume", *changed])
        with pytest.raises(ValueError) as e:
            load_checkpoint(again, None, str(tmp_path / "checkpoints"))   # refused before loading
        assert says in str(e.value) and "--resume_with_changes" in str(e.value), str(e.value)
    again = train.parse_args([*FLAGS, *SCHEDULE, "--out_dir", str(tmp_path), "--resume", "--iters", "5",
                              "--resume_with_changes"])
    with pytest.raises(AttributeError):       # past the check: the load itself (no accelerator here)
        load_checkpoint(again, None, str(tmp_path / "checkpoints"))
    assert "iters" in run_neutral({"lr_schedule": "constant"}) and "iters" in run_neutral({})
    assert "iters" not in run_neutral({"lr_schedule": "cosine"})


KILLED = [*FLAGS, "--train_data", "tiny-math", "--group_size", "4", "--max_new_tokens", "16",
          "--target_kl", "0", "--sample_every", "0", "--ckpt_every", "1", "--keep_last", "2"]


def complete(out):
    return [p.name for p in sorted((out / "checkpoints").iterdir()) if "." not in p.name
            and (p / "trainer_state.json").is_file()]


def same_rows(a, b):
    assert [r["iter"] for r in a] == [r["iter"] for r in b]
    for ra, rb in zip(a, b):
        for k in ra:
            if not k.startswith("time_") and k != "tokens_per_s":
                assert ra[k] == rb[k], f"iteration {ra['iter']} {k}: {ra[k]} vs {rb[k]}"


@pytest.mark.slow
def test_sigkill_at_any_point_of_a_checkpoint_loses_nothing(tmp_path):
    """One run SIGKILLed four times, at a different point of a checkpoint write each time, and
    resumed with a plain --resume after each kill, ends with the unbroken run's final weights
    (bitwise) and metrics rows (every key but the timers), at --async_lag 0. After each kill the
    newest complete checkpoint is the one the point allows, and the next run resumes from it."""
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    cmd = [*KILLED, "--iters", "5", "--samples_every", "1"]
    unbroken = subprocess.Popen([PY, "train.py", *cmd, "--out_dir", str(straight)], cwd=ROOT, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # (point, iteration killed at, complete checkpoints left, the iteration the next run resumes
    # after): before: iteration 2's row written, its checkpoint not begun; during: iter_3.tmp
    # written by save_state, no trainer_state.json; commit: iter_4.tmp complete, not renamed;
    # after: iter_5 renamed, iter_3 not yet deleted
    stages = [("before", 2, ["iter_000001"], None), ("during", 3, ["iter_000001", "iter_000002"], 1),
              ("commit", 4, ["iter_000002", "iter_000003"], 2),
              ("after", 5, ["iter_000003", "iter_000004", "iter_000005"], 3)]
    for point, it, left, after in stages:
        more = ["--resume"] if after is not None else []
        proc, _ = run([PY, "tests/kill_at.py", point, str(it), *cmd, "--out_dir", str(broken),
                       *more], timeout=300)
        assert proc.returncode == -9, f"{point}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        if after is not None:
            assert f"(after iteration {after})" in proc.stdout, proc.stdout[-2000:]
        assert complete(broken) == left, (point, sorted(os.listdir(broken / "checkpoints")))
        assert [r["iter"] for r in metrics(broken)][-1] == it, point   # the row died with it
    proc = ok(run([PY, "train.py", *cmd, "--out_dir", str(broken), "--resume"], timeout=300)[0])
    assert "(after iteration 5)" in proc.stdout
    assert unbroken.wait(timeout=300) == 0, unbroken.stdout.read()[-3000:]
    same_rows(metrics(straight), metrics(broken))
    # samples.jsonl: each iteration's completions once (a killed iteration's lines are dropped at
    # --resume and written again), the same as the unbroken run's
    lines = [[json.loads(x) for x in (d / "samples.jsonl").read_text().splitlines()] for d in (straight, broken)]
    assert [x["iter"] for x in lines[1]] == [x["iter"] for x in lines[0]] and lines[0], "samples.jsonl"
    assert [x["completion"] for x in lines[1]] == [x["completion"] for x in lines[0]]
    a, b = load_params(straight / "final"), load_params(broken / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "weights differ"
    assert complete(broken) == ["iter_000003", "iter_000004", "iter_000005"]   # no save since


def limit_file_size(size):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


@pytest.mark.slow
def test_a_checkpoint_that_cannot_be_written_stops_the_run_and_keeps_the_last(tmp_path):
    """A disk with no room for the next checkpoint, simulated by a 1 MB file-size limit (the tiny
    model's weights alone are 2.7 MB): the run stops with an error naming the checkpoint folder,
    the space free and what a checkpoint takes; iter_000001 stays the latest, no '.tmp' is left,
    and a --resume with room continues from it."""
    out = tmp_path / "run"
    cmd = [PY, "train.py", *KILLED, "--out_dir", str(out)]
    ok(run(cmd + ["--iters", "1"], timeout=300)[0])
    proc, _ = run(cmd + ["--iters", "2", "--resume"], timeout=300,
                  preexec_fn=limit_file_size(1 << 20))
    assert proc.returncode != 0
    said = proc.stderr.strip().splitlines()[-1]
    assert f"could not write a checkpoint in {out / 'checkpoints'}" in said, proc.stderr[-3000:]
    assert "a checkpoint needs about" in said and "MB are free there" in said, said
    assert "the latest checkpoint is still" in said and "iter_000001" in said, said
    assert sorted(os.listdir(out / "checkpoints")) == ["iter_000001"]
    proc = ok(run(cmd + ["--iters", "2", "--resume"], timeout=300)[0])
    assert "(after iteration 1)" in proc.stdout and [r["iter"] for r in metrics(out)] == [1, 2]


def test_a_second_ctrl_c_aborts_saying_what_is_lost():
    """StopRequest: the first SIGINT asks for a stop after the iteration; the second kills the
    process by SIGINT, as without a handler, after saying that the running iteration is lost."""
    code = ("import os, signal, time\nfrom infra.checkpoints import StopRequest\n"
            "stop = StopRequest(True)\nos.kill(os.getpid(), signal.SIGINT)\nassert stop.requested\n"
            "print('still running', flush=True)\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)\n")
    proc, _ = run([PY, "-c", code], timeout=120)
    assert proc.returncode == -2 and proc.stdout == "still running\n", (proc.returncode, proc.stderr)
    said = proc.stderr.strip().splitlines()
    assert said == ["SIGINT: stopping after this iteration (again to abort)", "",
                    "SIGINT again: aborting; this iteration is lost, and --resume redoes it and any "
                    "others after the last checkpoint"], said


@pytest.mark.slow
def test_checkpoint_commits_only_when_every_rank_wrote(two_ranks):
    """Rank 1 writes its files 3 s after rank 0: iter_000001.tmp is renamed only once they are in
    it, so the committed folder holds both ranks' RNG states and no '.tmp' folder is left behind."""
    assert two_ranks["world"] == 2
    need = {"random_states_0.pkl", "random_states_1.pkl", "trainer_state.json"}
    at_commit = two_ranks["at_commit"]["iter_000001"]
    assert need <= set(at_commit), f"committed before every rank wrote: {at_commit}"
    assert list(two_ranks["after"]) == ["iter_000001"], two_ranks["after"]
    assert need <= set(two_ranks["after"]["iter_000001"])
