"""What a newcomer runs first: run.sh's folder, closing table and refusals, and what git ignores.

Run: .venv/bin/python -m pytest tests/test_run_sh.py -q   (CPU, no network; about 1 minute, the
tiny model of conftest.py included)

run.sh forwards its flags to train.py, which takes the last --out_dir it is given; the closing
table must read the folder train.py wrote. The folder choice is checked on a copy of run.sh whose
Python is a stub that only records its arguments (no training, nothing written under out/); one
short real run then checks the whole command with --out_dir.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

import gppo

from conftest import ENV, ROOT, ok, run

STUB = """#!/bin/sh
exec {py} -c 'import json, sys; open(sys.argv[1], "a").write(json.dumps(sys.argv[2:]) + "\\n")' {calls} "$@"
"""


@pytest.mark.parametrize("argv,env_out,folder", [
    (["kl", "atomic"], None, "out/kl-atomic-seed0"),
    (["kl", "atomic", "--seed", "7"], None, "out/kl-atomic-seed7"),
    (["kl", "atomic", "--seed=7", "--lr=1e-4"], None, "out/kl-atomic-seed7"),
    (["grpo", "--seed=3"], None, "out/grpo-seed3"),
    (["kl", "atomic", "--seed", "7", "--out_dir", "{tmp}/mine"], None, "{tmp}/mine"),
    (["kl", "atomic", "--out_dir={tmp}/mine/"], None, "{tmp}/mine"),
    (["kl", "atomic", "--seed=1"], "out/protocol/kl-atomic-s1", "out/protocol/kl-atomic-s1"),  # README's OUT=...
    (["kl", "atomic", "--out_dir", "{tmp}/mine"], "out/ignored", "{tmp}/mine"),               # the flag wins
    (["kl", "atomic", "--task", "rare", "--seed=2"], None, "out/kl-atomic-rare-seed2"),      # data/tiny_rare
    (["grpo", "--task=rare"], None, "out/grpo-rare-seed0"),
])
def test_the_closing_table_reads_the_folder_train_py_writes(tmp_path, argv, env_out, folder):
    import train
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(ROOT / "run.sh", repo / "run.sh")
    calls, py = tmp_path / "calls.jsonl", tmp_path / "py"
    py.write_text(STUB.format(py=sys.executable, calls=calls))
    py.chmod(0o755)
    argv, folder = [a.replace("{tmp}", str(tmp_path)) for a in argv], folder.replace("{tmp}", str(tmp_path))
    env = {**ENV, "PY": str(py), **({"OUT": env_out} if env_out else {})}
    proc = subprocess.run(["bash", str(repo / "run.sh"), *argv], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = {c[0]: c[1:] for c in map(json.loads, calls.read_text().splitlines())}
    assert train.parse_args(got["train.py"]).out_dir.rstrip("/") == folder   # where train.py writes, its own parser
    assert got["eval.py"] == ["--compare", f"{folder}/eval_start.json", f"{folder}/eval.json"]
    assert os.path.isfile(os.path.join(repo, f"{folder}.log"))       # the log beside the folder
    args = train.parse_args(got["train.py"])
    rare = "rare" in argv or "--task=rare" in argv                   # taken out, never given to train.py
    assert "--task" not in " ".join(got["train.py"])
    assert (args.model, args.train_data, args.eval_data) == (
        ("data/tiny_rare/model", "tiny-rare-math", "tiny-rare-math") if rare else
        ("data/tiny/model", "tiny-math,tiny-code", "tiny-math,tiny-code"))


@pytest.mark.slow
def test_run_sh_with_out_dir_trains_there_and_prints_the_table(tiny, tmp_path):
    out = tmp_path / "runs" / "mine"
    proc, secs = run(["bash", "run.sh", "kl", "atomic", "--model", str(tiny / "model"), "--data_dir", str(tiny),
                      "--iters", "1", "--prompts_per_iter", "8", "--prompts_per_update", "8", "--group_size", "2",
                      "--max_new_tokens", "8", "--eval_k", "1", "--threads", "1", "--seed", "3",
                      "--out_dir", str(out)], timeout=240)
    ok(proc)
    for name in ("eval_start.json", "eval.json", "metrics.jsonl", "final/config.json"):
        assert (out / name).is_file(), name
    assert (tmp_path / "runs" / "mine.log").is_file()
    table = proc.stdout[proc.stdout.index("data set"):].splitlines()
    assert [line.split()[0] for line in table[1:4]] == ["tiny-math", "tiny-code", "all"], proc.stdout
    assert f"policy {out}/final" in proc.stdout
    # no transformers progress bars between the iteration lines (issue 27, item 2)
    text = proc.stdout + proc.stderr
    assert "Loading weights" not in text and "Writing model shards" not in text, text[-3000:]


def test_gitignore_ignores_a_venv_folder_and_a_venv_symlink(tmp_path):
    """`.venv/` matches only a directory; a symlink to a shared environment needs `.venv`."""
    repo = tmp_path / "clone"
    repo.mkdir()
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")
    (tmp_path / "shared-env").mkdir()
    os.symlink(tmp_path / "shared-env", repo / ".venv")
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True)  # noqa: E731
    ok(git("init", "-q"))
    assert git("check-ignore", "-q", ".venv").returncode == 0, "a .venv symlink is not ignored"
    (repo / ".venv").unlink()
    (repo / ".venv").mkdir()
    (repo / ".venv" / "pyvenv.cfg").write_text("")
    assert git("check-ignore", "-q", ".venv/pyvenv.cfg").returncode == 0, "a .venv folder is not ignored"


def test_a_second_run_in_the_same_folder_stops_at_start_and_keeps_the_log(tmp_path):
    """bash run.sh into a folder that holds a run: train.py stops before loading anything, naming
    the folder and the two ways on; the earlier run's metrics and log are untouched."""
    out, log = tmp_path / "kl-atomic-seed0", tmp_path / "kl-atomic-seed0.log"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"iter": 1}\n')
    log.write_text("the first run's log\n")
    # small flags: were the refusal gone, the run would end in seconds and fail the checks below
    small = ["--iters", "1", "--prompts_per_iter", "8", "--prompts_per_update", "8", "--eval_k",
             "1", "--max_new_tokens", "8", "--threads", "1"]
    proc, _ = run(["bash", "run.sh", "kl", "atomic", "--seed=0", "--out_dir", str(out), *small],
                  timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    assert f"--out_dir {out} already holds a run" in text and "--resume" in text \
        and "--overwrite" in text, text
    assert (out / "metrics.jsonl").read_text() == '{"iter": 1}\n'
    assert log.read_text().startswith("the first run's log\n") and "already holds a run" in \
        log.read_text()
    assert "iter 1/" not in text and "evaluating" not in text   # nothing ran


def test_run_sh_stops_when_train_py_fails(tmp_path):
    """train.py runs inside `| tee`: when it fails (here a flag it refuses), run.sh stops with
    train.py's exit code and does not go on to compare whatever evaluations the folder holds (an
    earlier run's, planted here: eval.py --compare would print them as this run's)."""
    out = tmp_path / "kl-atomic-seed0"
    out.mkdir()
    for name, value in (("eval_start.json", 10.0), ("eval.json", 90.0)):
        (out / name).write_text(json.dumps({"avg@8": {"all": value}}))
    proc, _ = run(["bash", "run.sh", "kl", "atomic", "--out_dir", str(out), "--iters=many"],
                  timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, (proc.returncode, text)
    assert "--iters: invalid int value: 'many'" in text, text
    assert "done in" not in text and "+80.0" not in text, text


@pytest.mark.slow
def test_run_sh_trains_a_divergence_with_a_parameter(tiny, tmp_path):
    """bash run.sh alpha:0.5 atomic: the README's parametric divergence, 2 iterations end to end;
    its rows carry the cell's divergence estimate, and the sweep's default cells are unchanged."""
    out = tmp_path / "alpha"
    proc, _ = run(["bash", "run.sh", "alpha:0.5", "atomic", "--model", str(tiny / "model"),
                   "--data_dir", str(tiny), "--iters", "2", "--prompts_per_iter", "8",
                   "--prompts_per_update", "4", "--group_size", "4", "--max_new_tokens", "16",
                   "--eval_k", "1", "--threads", "1", "--out_dir", str(out)], timeout=300)
    ok(proc)
    assert proc.stdout.splitlines()[0].startswith("alpha:0.5-atomic: "), proc.stdout[:500]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in rows] == [1, 2] and all(r["updates"] >= 1 for r in rows)
    assert rows[-1]["div_mean"] > 0
    sys.path.insert(0, str(ROOT / "bench"))
    import sweep
    names = [name for name, _ in sweep.methods()]
    cells = len(gppo.DIVERGENCES) * len(gppo.ESTIMATORS)   # named divergences only, however many
    assert len(names) == len(gppo.BASELINES) + cells and not any(":" in n for n in names)


@pytest.mark.parametrize("argv,bad,accepted", [
    (["foo"], "foo", "'grpo', 'ppo', 'dapo', 'dppo', 'ripo', 'gspo'"),
    (["foo", "atomic"], "foo", f"accepted: {', '.join(gppo.divergence_names())}"),   # any added too
    (["kl", "foo"], "foo", "'mc', 'atomic', 'binary'"),
])
def test_run_sh_refuses_unknown_cells(tmp_path, argv, bad, accepted):
    """An unknown cell is refused naming it and what is accepted, and leaves no run folder."""
    out = tmp_path / "out" / "run"
    proc, _ = run(["bash", "run.sh", *argv, f"--out_dir={out}"], timeout=60)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"'{bad}'" in text and accepted in text, text
    assert not out.exists(), f"a refused run left {out}"


@pytest.mark.parametrize("argv,says", [
    (["kl", "atomic", "--task", "nope"], "run.sh: error: --task=nope; accepted: default, rare"),
    (["smollm2", "--task=rare"], "run.sh: error: --task=rare; accepted: default with smollm2"),
    (["kl", "atomic", "--prompts_per_update=7", "--prompts_per_iter=16"],
     "train.py: error: --prompts_per_iter=16; accepted: a multiple of --prompts_per_update=7"),
])
def test_run_sh_refuses_a_value_as_argparse_does(tmp_path, argv, says):
    """run.sh's own refusals and train.py's end the same way: usage, `<tool>: error: --flag=value;
    accepted: ...` as the last line, exit status 2, no traceback (train.py's stderr reaches the
    terminal through run.sh's log, on stdout)."""
    proc, _ = run(["bash", "run.sh", *argv, f"--out_dir={tmp_path / 'out'}"], timeout=120)
    text = proc.stdout + proc.stderr
    lines = text.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in text, text[-2000:]
    assert lines[-2].startswith("usage:") and lines[-1].startswith(says), lines[-2:]
