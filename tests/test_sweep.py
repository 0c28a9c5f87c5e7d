"""The sweep's pure parts (bench/sweep.py): method list, pass-through flags, resume plan, table.

Run: .venv/bin/python -m pytest tests/test_sweep.py -q   (CPU, no model, a few seconds)

Result dicts are written as real result.json files into a tmp folder, shaped as run_one writes
them; nothing of the project is mocked. The end-to-end sweep (train.py subprocesses, vLLM) is
not run here: one run costs ~40 s of engine start and evaluation even at 2 iterations, and
tests/test_trainer.py already runs train.py end to end. Only --dry_run is invoked for real.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import gppo  # noqa: E402

spec = importlib.util.spec_from_file_location("sweep", ROOT / "bench" / "sweep.py")
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)

SETTINGS = dict(model="m", data_dir="d", eval_data="tiny-math,tiny-code", train_flags=["--iters", "2"])


def fake(name, seed, math_, code, entropy=0.1, reward=0.5):
    return dict(name=name, seed=seed, settings=SETTINGS, threads=None, cmd=[],
                eval={"tiny-math": math_, "tiny-code": code, "all": (math_ + code) / 2},
                final={"entropy": entropy, "reward_mean": reward}, iters=2, wall_s=10.0,
                iter_s_mean=2.0, other_s=6.0)


def write(out, res):
    d = sweep.run_dir(out, res["name"], res["seed"])
    os.makedirs(d, exist_ok=True)
    sweep.write_json_atomic(os.path.join(d, "result.json"), res)


def test_methods_cover_every_cell_and_baseline_once():
    names = [n for n, _ in sweep.methods()]
    cells = [f"{d}-{e}" for d in gppo.DIVERGENCES for e in gppo.ESTIMATORS]
    assert names == list(gppo.BASELINES) + cells          # baselines first, grid by divergence
    assert len(names) == len(set(names)) == len(gppo.BASELINES) + len(gppo.DIVERGENCES) * len(gppo.ESTIMATORS)
    paper = {"gspo", "gmpo", "sapo", "cispo", "clip_cov", "js-mc", "js-atomic", "js-binary"} | \
            {f"{d}-{e}" for d in ("tv", "chi2", "kl", "hellinger") for e in ("mc", "atomic", "binary")}
    assert paper <= set(names)                             # the paper's 12 cells + js + 5 baselines
    flags = dict(sweep.methods())
    assert flags["kl-atomic"] == ["--objective", "gppo", "--divergence", "kl", "--estimator", "atomic"]
    assert flags["gspo"] == ["--objective", "gspo"]


def test_only_accepts_aliases_and_keeps_table_order():
    assert sweep.select("kl-atomic,grpo,gspo") == ["gspo", "tv-mc", "kl-atomic"]
    assert sweep.select("DAPO, ripo") == ["chi2-atomic", "kl-mc"]
    assert sweep.select("") == [n for n, _ in sweep.methods()]
    with pytest.raises(SystemExit):
        sweep.select("kl-nope")


def test_passthrough_refuses_per_cell_flags_and_strips_threads():
    flags, threads = sweep.split_passthrough(["--lr=1e-4", "--iters", "5", "--threads", "2"])
    assert flags == ["--lr", "1e-4", "--iters", "5"] and threads == 2
    assert sweep.split_passthrough(["--threads=1"]) == ([], 1)
    for bad in (["--delta", "0.3"], ["--seed=1"], ["--divergence", "kl"], ["--out_dir", "x"]):
        with pytest.raises(SystemExit):
            sweep.split_passthrough(bad)


def test_mean_std():
    assert sweep.mean_std([1, 2, 3]) == (2, 1.0)           # sample std, n - 1
    m, s = sweep.mean_std([30.0, 34.0])
    assert m == 32.0 and math.isclose(s, math.sqrt(8))
    assert sweep.mean_std([5.0]) == (5.0, None)
    assert sweep.mean_std([]) == (None, None)


def test_aggregate_and_table_against_grpo():
    results = [fake("tv-mc", 0, 30.0, 0.0, 0.05, 0.40), fake("tv-mc", 1, 34.0, 2.0, 0.07, 0.44),
               fake("kl-atomic", 0, 40.0, 1.0), fake("kl-atomic", 1, 38.0, 3.0)]
    names = [n for n, _ in sweep.methods()]
    rows = sweep.aggregate(results, names)
    assert list(rows) == names
    assert rows["tv-mc"]["n"] == 2 and rows["tv-mc"]["tiny-math"][0] == 32.0
    assert math.isclose(rows["tv-mc"]["entropy"][0], 0.06)
    assert rows["kl-atomic"]["delta_tiny-math"] == 7.0      # 39 - 32
    assert rows["kl-atomic"]["delta_tiny-code"] == 1.0      # 2 - 1
    assert rows["tv-mc"]["delta_tiny-math"] == 0.0
    assert rows["gspo"]["n"] == 0 and rows["gspo"]["delta_tiny-math"] is None
    # the reference is found even when tv-mc is not among the rows asked for
    assert sweep.aggregate(results, ["kl-atomic"])["kl-atomic"]["delta_tiny-math"] == 7.0

    md = sweep.format_table(rows, 8, 2, warm={"tiny-math": 25.0, "tiny-code": 0.0})
    lines = md.splitlines()
    assert lines[0].startswith("| method |") and "avg@8" in lines[0]
    assert lines[2].startswith("| warm start") and "25.0" in lines[2]
    assert lines[3].startswith("| gspo | 0/2 | not run")                 # baselines first
    kl = next(line for line in lines if line.startswith("| kl-atomic |"))
    assert "39.0 ± 1.4" in kl and "+7.0" in kl and "2/2" in kl
    assert any(line.startswith("| **tv-mc (GRPO / PPO)** |") for line in lines)
    assert len(lines) == 2 + 1 + len(names)


def test_plan_skips_finished_redoes_half_finished(tmp_path):
    out = str(tmp_path)
    write(out, fake("tv-mc", 0, 30.0, 0.0))                              # finished
    os.makedirs(sweep.run_dir(out, "tv-mc", 1))                          # started, no result.json
    Path(sweep.run_dir(out, "kl-atomic", 0)).mkdir()
    Path(sweep.run_dir(out, "kl-atomic", 0), "result.json.tmp").write_text("{")   # torn write
    got = sweep.plan(out, ["tv-mc", "kl-atomic"], [0, 1], SETTINGS)
    assert got == [("tv-mc", 0, "done"), ("tv-mc", 1, "redo"), ("kl-atomic", 0, "redo"), ("kl-atomic", 1, "run")]
    # a finished run with other settings refuses the whole sweep, even outside --only
    other = dict(SETTINGS, train_flags=["--iters", "3"])
    with pytest.raises(SystemExit):
        sweep.plan(out, ["kl-atomic"], [0, 1], other, all_names=["tv-mc", "kl-atomic"])


def test_write_json_atomic_leaves_no_tmp(tmp_path):
    path = tmp_path / "result.json"
    sweep.write_json_atomic(str(path), {"a": 1})
    sweep.write_json_atomic(str(path), {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert os.listdir(tmp_path) == ["result.json"]


def test_parse_eval_takes_the_last_eval_line():
    log = ('iter 1/2 | reward 0.1\n{"eval": {"tiny-math": 1.0}}\nnoise {"eval": 3}\n'
           '  {"eval": {"tiny-math": 12.5, "tiny-code": 0.0, "all": 6.2}}\nsaved\n')
    assert sweep.parse_eval(log) == {"tiny-math": 12.5, "tiny-code": 0.0, "all": 6.2}
    assert sweep.parse_eval("no eval here\n") is None


def test_dry_run_lists_every_run_and_writes_nothing(tmp_path):
    out = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "bench/sweep.py", "--dry_run", "--out", str(out), "--seeds", "0,1",
                           "--model", "nowhere", "--iters", "2"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    n = 2 * len(sweep.methods())
    assert proc.stdout.count("  run  ") == n and f"{n} of {n} runs to do" in proc.stdout
    assert "--iters 2" in proc.stdout and "--eval_data tiny-math,tiny-code" in proc.stdout
    assert not out.exists()
