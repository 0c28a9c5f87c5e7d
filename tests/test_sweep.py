"""The sweep's parts (bench/sweep.py, stats.py, sweep_report.py): method list, flags, seeds,
resume plan, paired statistics, tables, figures, and the report of a sweep folder.

Run: .venv/bin/python -m pytest tests/test_sweep.py -q   (CPU, no model, a few seconds)

Runs are written as real files into a tmp folder (result.json shaped as run_one writes it, and a
metrics.jsonl with train.py's keys); nothing of the project is mocked. train.py is never started:
one run costs ~40 s of engine start and evaluation even at 2 iterations, and tests/test_trainer.py
already runs it end to end. The sweep itself is invoked for real with --dry_run, and on a folder
whose runs are all finished (it then only reports).
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gppo
from bench import stats, sweep, sweep_report

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = sweep.make_settings("m", "d", ["--iters", "2"])
NAMES = [n for n, _ in stats.methods()]


def fake(name, seed, math_, code, entropy=0.1, reward=0.5):
    return dict(name=name, seed=seed, settings=SETTINGS, threads=None, cmd=[],
                eval={"tiny-math": math_, "tiny-code": code, "all": (math_ + code) / 2},
                final={"entropy": entropy, "reward_mean": reward}, iters=2, wall_s=10.0,
                iter_s_mean=2.0, other_s=6.0)


def write(out, res, metrics=None):
    d = stats.run_dir(out, res["name"], res["seed"])
    os.makedirs(d, exist_ok=True)
    stats.write_json_atomic(os.path.join(d, "result.json"), res)
    if metrics is not None:
        Path(d, "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


def metrics(n, reward, entropy, token, clip):
    """n metrics.jsonl rows with the keys the sweep reads."""
    return [dict(iter=i + 1, reward_mean=reward + 0.01 * i, entropy=entropy - 0.001 * i, time_iter_s=2.0,
                 token_frac_by_mu=token, clip_frac_by_mu=clip) for i in range(n)]


def test_methods_cover_every_cell_and_baseline_once():
    cells = [f"{d}-{e}" for d in gppo.DIVERGENCES for e in gppo.ESTIMATORS]
    assert NAMES == list(gppo.BASELINES) + cells           # baselines first, grid by divergence
    assert len(NAMES) == len(set(NAMES))
    paper = {"gspo", "gmpo", "sapo", "cispo", "clip_cov", "drpo", "dgpo", "js-mc", "js-atomic", "js-binary"} | \
            {f"{d}-{e}" for d in ("tv", "chi2", "kl", "hellinger") for e in ("mc", "atomic", "binary")}
    assert paper <= set(NAMES)
    flags = dict(stats.methods())
    assert flags["kl-atomic"] == ["--objective", "gppo", "--divergence", "kl", "--estimator", "atomic"]
    assert flags["drpo"] == ["--method", "drpo"]            # train.py maps the name (one map, in gppo)


def test_only_takes_gppo_method_names_and_keeps_table_order():
    assert sweep.select("kl-atomic,grpo,gspo") == ["gspo", "tv-mc", "kl-atomic"]
    assert sweep.select("DAPO, ripo,dppo") == ["tv-binary", "chi2-atomic", "kl-mc"]
    assert sweep.select("") == NAMES
    with pytest.raises(SystemExit):
        sweep.select("kl-nope")
    # labels come from gppo.METHODS, so a name added there shows up in the table
    for cell, names in {"tv-mc": ["GRPO", "PPO"], "kl-mc": ["DAPO"], "tv-binary": ["DPPO"], "chi2-atomic": ["RIPO"]}.items():
        assert set(names) <= set(stats.LABELS[cell].split(" / ")), stats.LABELS   # more may be added


def test_passthrough_refuses_per_cell_flags_and_strips_threads():
    flags, threads = sweep.split_passthrough(["--lr=1e-4", "--iters", "5", "--threads", "2"])
    assert flags == ["--lr", "1e-4", "--iters", "5"] and threads == 2
    assert sweep.split_passthrough(["--threads=1"]) == ([], 1)
    for bad in (["--delta", "0.3"], ["--seed=1"], ["--divergence", "kl"], ["--out_dir", "x"], ["--method", "dapo"]):
        with pytest.raises(SystemExit):
            sweep.split_passthrough(bad)


def test_seeds_accept_ranges_and_lists():
    assert sweep.parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert sweep.parse_seeds("0,1,2") == [0, 1, 2]
    assert sweep.parse_seeds("3, 0-1,1") == [0, 1, 3]
    assert sweep.parse_seeds("7") == [7]
    with pytest.raises(SystemExit):
        sweep.parse_seeds(" , ")


def test_mean_std():
    assert stats.mean_std([1, 2, 3]) == (2, 1.0)           # sample std, n - 1
    m, s = stats.mean_std([30.0, 34.0])
    assert m == 32.0 and math.isclose(s, math.sqrt(8))
    assert stats.mean_std([5.0]) == (5.0, None)
    assert stats.mean_std([]) == (None, None)


def test_t_quantiles_match_the_t_distribution():
    """Each tabulated t(0.975, df) has CDF 0.975, the density integrated by Simpson's rule."""
    for df, q in enumerate(stats.T975, start=1):
        c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
        dens = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)
        n = 2000
        h = q / n
        area = h / 3 * sum((1 if i in (0, n) else 4 if i % 2 else 2) * dens(i * h) for i in range(n + 1))
        assert abs(0.5 + area - 0.975) < 5e-5 * df, (df, q, 0.5 + area)   # 3 decimals of q


def test_paired_difference_and_its_t_interval():
    # seeds 0-2 in both: differences 2, 3, 4 -> mean 3, sd 1, half-width t(0.975, 2) / sqrt(3) = 2.4844
    a = {0: 10.0, 1: 12.0, 2: 14.0, 3: 99.0}              # seed 3: only a has it, ignored
    b = {0: 8.0, 1: 9.0, 2: 10.0, 5: -50.0}               # seed 5: only b has it, ignored
    n, m, lo, hi = stats.paired(a, b)
    assert n == 3 and m == 3.0
    assert math.isclose(lo, 3 - 4.303 / math.sqrt(3)) and math.isclose(hi, 3 + 4.303 / math.sqrt(3))
    assert math.isclose(lo, 0.5157, abs_tol=1e-4) and stats.distinguishable(lo, hi)
    # differences 1, -1, 3: mean 1, sd 2 -> [1 - 4.969, 1 + 4.969] contains 0
    n, m, lo, hi = stats.paired({0: 1.0, 1: -1.0, 2: 3.0}, {0: 0.0, 1: 0.0, 2: 0.0})
    assert (n, m) == (3, 1.0) and lo < 0 < hi and not stats.distinguishable(lo, hi)
    assert math.isclose(hi - lo, 2 * 4.303 * 2 / math.sqrt(3))
    # below 0 is distinguishable too; one common seed has no interval; none has nothing
    assert stats.distinguishable(*stats.paired({0: 0.0, 1: 1.0}, {0: 5.0, 1: 5.5})[2:])
    assert stats.paired({0: 3.0, 1: 1.0}, {0: 1.0}) == (1, 2.0, None, None)
    assert stats.paired({0: 3.0}, {1: 1.0}) == (0, None, None, None)
    assert not stats.distinguishable(None, None)


def test_verdict_rule():
    assert stats.verdict(3, 3.0, 0.5, 5.5) == "reproduced"
    assert stats.verdict(3, -3.0, -5.5, -0.5) == "not reproduced (reversed)"
    assert stats.verdict(3, 1.0, -4.0, 6.0) == "undecided"
    assert stats.verdict(1, 1.0, None, None) == "undecided (n < 2)"
    assert stats.verdict(3, 0.0, 0.0, 0.0) == "tie: identical on every seed"   # chi2-mc is tv-mc's region


def results_two_budgets():
    """tv-mc and kl-atomic at seeds 0-4 (kl-atomic +8 math on every seed, give or take 1), gspo at 0-2
    (code noise around 0), chi2-mc identical to tv-mc (the same region), hellinger-mc at seed 7 only."""
    grpo_math, grpo_code = [30.0, 34.0, 28.0, 40.0, 33.0], [20.0, 10.0, 30.0, 25.0, 15.0]
    res = [fake("tv-mc", s, m, c, 0.05, 0.40) for s, (m, c) in enumerate(zip(grpo_math, grpo_code))]
    res += [fake("chi2-mc", s, m, c, 0.05, 0.40) for s, (m, c) in enumerate(zip(grpo_math, grpo_code))]
    res += [fake("kl-atomic", s, m + 8 + (-1) ** s, c + 3 * (-1) ** s, 0.2, 0.6)
            for s, (m, c) in enumerate(zip(grpo_math, grpo_code))]
    res += [fake("gspo", s, m - 2, c + d) for s, (m, c, d) in enumerate(zip(grpo_math, grpo_code, [-9.0, 4.0, 6.0]))]
    return res + [fake("hellinger-mc", 7, 50.0, 50.0)]


def test_aggregate_pairs_on_common_seeds_and_keeps_every_n():
    rows = stats.aggregate(results_two_budgets(), NAMES, warm={"tiny-math": 25.0, "tiny-code": 20.0, "all": 22.5})
    assert list(rows) == NAMES
    assert rows["tv-mc"]["n"] == 5 and rows["gspo"]["n"] == 3 and rows["gspo"]["seeds"] == [0, 1, 2]
    assert rows["tv-mc"]["tiny-math"][0] == 33.0 and rows["tv-mc"]["gain_tiny-math"] == 8.0
    kl = rows["kl-atomic"]["vs_ref_tiny-math"]          # differences 9, 7, 9, 7, 9
    assert kl["n"] == 5 and math.isclose(kl["mean"], 8.2) and kl["distinguishable"]
    assert kl["per_seed"] == {0: 9.0, 1: 7.0, 2: 9.0, 3: 7.0, 4: 9.0}
    assert not rows["kl-atomic"]["vs_ref_tiny-code"]["distinguishable"]     # +-3 around 0
    g = rows["gspo"]["vs_ref_tiny-math"]
    assert g["n"] == 3 and g["mean"] == -2.0 and g["lo"] == g["hi"] == -2.0 and g["distinguishable"]
    assert rows["hellinger-mc"]["vs_ref_tiny-math"]["n"] == 0                # seed 7: no GRPO partner
    assert rows["sapo"]["n"] == 0 and rows["sapo"]["vs_ref_tiny-math"]["mean"] is None
    # the reference is found even when tv-mc is not among the rows asked for
    assert stats.aggregate(results_two_budgets(), ["kl-atomic"])["kl-atomic"]["vs_ref_tiny-math"]["n"] == 5


def test_table_has_paired_ci_columns_and_marks():
    rows = stats.aggregate(results_two_budgets(), NAMES, warm={"tiny-math": 25.0, "tiny-code": 20.0})
    lines = sweep_report.format_table(rows, 8, warm={"tiny-math": 25.0, "tiny-code": 20.0}).splitlines()
    assert "Δ math vs GRPO [95% CI]" in lines[0] and "Δ code vs GRPO [95% CI]" in lines[0] and "| n |" in lines[0]
    assert lines[2].startswith("| warm start") and "25.0" in lines[2]
    assert lines[3].startswith("| **tv-mc (GRPO / PPO)** | 5 | 33.0 ± 4.6 | reference |")    # reference first
    assert lines[4].startswith("| gspo | 3 |")                                              # then table order
    kl = next(line for line in lines if line.startswith("| kl-atomic |")).split(" | ")
    lo, hi = 8.2 - 2.776 * 1.0954451 / math.sqrt(5), 8.2 + 2.776 * 1.0954451 / math.sqrt(5)
    assert kl[3] == f"+8.2 [{lo:+.1f}, {hi:+.1f}] ✱"                                       # distinguishable
    assert "✱" not in kl[5] and kl[5].startswith("+0.6 [")                                  # code: not
    assert kl[6] == "+16.2 / +0.6"                                                          # over warm start
    assert next(line for line in lines if line.startswith("| hellinger-mc |")).split(" | ")[3] == "-"
    assert any(line.startswith("| sapo | 0 | not run") for line in lines)
    assert len(lines) == 2 + 1 + len(NAMES)
    per_seed = sweep_report.format_per_seed(rows).splitlines()
    assert per_seed[0] == "| method | seed 0 | seed 1 | seed 2 | seed 3 | seed 4 | seed 7 |"
    assert "| kl-atomic | +9.0 / +3.0 | +7.0 / -3.0 |" in "\n".join(per_seed)


def test_orderings_pair_each_claim_and_state_a_verdict():
    orders = stats.orderings(results_two_budgets(), NAMES)
    got = {(o["a"], o["b"]): o for o in orders}
    # only comparisons whose two methods ran; hellinger-mc has no tv partner seed
    assert set(got) == {("chi2-mc", "tv-mc"), ("kl-atomic", "tv-mc"), ("kl-atomic", "gspo"),
                        ("kl-atomic", "chi2-mc"), ("kl-atomic", "hellinger-mc"), ("hellinger-mc", "tv-mc")}
    assert got[("chi2-mc", "tv-mc")]["claim"] == "curvature above tv"
    assert got[("chi2-mc", "tv-mc")]["tiny-math"]["verdict"] == "tie: identical on every seed"
    assert got[("kl-atomic", "tv-mc")]["tiny-math"]["verdict"] == "reproduced"
    assert got[("kl-atomic", "tv-mc")]["tiny-code"]["verdict"] == "undecided"
    assert [round(x, 1) for x in got[("kl-atomic", "tv-mc")]["paper"]] == [13.8, 7.3]
    assert got[("kl-atomic", "gspo")]["tiny-math"]["n"] == 3                 # gspo's seeds only
    assert got[("hellinger-mc", "tv-mc")]["tiny-math"]["verdict"] == "undecided (n < 2)"
    md = sweep_report.format_orderings(orders)
    assert "| kl-atomic best | kl-atomic − tv-mc | +13.8 / +7.3 | 5 |" in md
    assert "- kl-atomic best: tiny-math: reproduced 3, undecided (n < 2) 1" in md
    # every claim kind of the paper is asked once all methods have run
    kinds = {c for c, _, _ in stats.claims(NAMES)}
    assert kinds == {"atomic above mc", "binary above mc", "curvature above tv", "kl-atomic best"}
    assert ("atomic above mc", "js-atomic", "js-mc") in stats.claims(NAMES)
    assert ("curvature above tv", "kl-binary", "tv-binary") in stats.claims(NAMES)


def test_plan_skips_finished_redoes_half_finished(tmp_path):
    out = str(tmp_path)
    write(out, fake("tv-mc", 0, 30.0, 0.0))                              # finished
    os.makedirs(stats.run_dir(out, "tv-mc", 1))                          # started, no result.json
    Path(stats.run_dir(out, "kl-atomic", 0)).mkdir()
    Path(stats.run_dir(out, "kl-atomic", 0), "result.json.tmp").write_text("{")   # torn write
    got = sweep.plan(out, ["tv-mc", "kl-atomic"], [0, 1], SETTINGS)
    assert got == [("tv-mc", 0, "done"), ("tv-mc", 1, "redo"), ("kl-atomic", 0, "redo"), ("kl-atomic", 1, "run")]
    assert [(r["name"], r["seed"]) for r in stats.finished(out, NAMES)] == [("tv-mc", 0)]
    # a finished run with other settings refuses the whole sweep, even outside --only and --seeds
    other = sweep.make_settings("m", "d", ["--iters", "3"])
    with pytest.raises(SystemExit, match="--iters 2 .now 3."):
        sweep.plan(out, ["kl-atomic"], [5], other, all_names=["tv-mc", "kl-atomic"])


def test_settings_are_train_py_resolved_flags():
    assert SETTINGS["train_args"]["iters"] == 2 and SETTINGS["train_args"]["eval_k"] == 8
    assert "seed" not in SETTINGS["train_args"] and "threads" not in SETTINGS["train_args"]
    # the same value spelled out, or a flag that does not change the result, is the same settings
    lr = SETTINGS["train_args"]["lr"]
    assert sweep.changed(SETTINGS, sweep.make_settings("m", "d", ["--iters", "2", "--lr", str(lr)])) == []
    assert sweep.changed(SETTINGS, sweep.make_settings("m", "d", ["--iters", "2", "--sample_every", "3"])) == []
    # a changed default shows as a changed value; a flag only one side knows is not compared
    old = json.loads(json.dumps(SETTINGS))
    old["train_args"]["lr"], old["train_args"]["retired_flag"] = lr * 2, 1
    assert sweep.changed(old, SETTINGS) == [f"--lr {lr * 2!r} (now {lr!r})"]
    assert sweep.changed({"train_flags": []}, SETTINGS)                   # a run of the old sweep
    with pytest.raises(SystemExit):
        sweep.make_settings("m", "d", ["--prompts_per_iter", "7"])         # train.py refuses it


def test_shown_keeps_machine_paths_out_of_committed_results():
    """What sweep.json, table.md and bench/rare_shortcut.py print of a command line: paths inside
    the repository relative to it, others by their last part; other words unchanged."""
    assert stats.shown(str(ROOT / "data" / "tiny" / "model")) == "data/tiny/model"
    assert stats.shown("/work/runs/lowlr") == "lowlr" and stats.shown("--out=/work/runs/guard/") == "--out=guard"
    for word in ("out/sweep", "--lr=1e-4", "rg:chain_sum?min_digits=2", "--only"):
        assert stats.shown(word) == word


def test_write_json_atomic_leaves_no_tmp(tmp_path):
    path = tmp_path / "result.json"
    stats.write_json_atomic(str(path), {"a": 1})
    stats.write_json_atomic(str(path), {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert os.listdir(tmp_path) == ["result.json"]


def synthetic_sweep(out):
    """tv-mc, tv-atomic (2 seeds) and kl-atomic (1 seed) with metrics, as train.py writes them."""
    mc = dict(token=[0.05, 0.15, 0.3, 0.5], clip=[0.3, 0.1, 0.02, 0.0])      # mc clips the rare tokens
    at = dict(token=[0.04, 0.16, 0.3, 0.5], clip=[0.0, 0.001, 0.01, 0.0])    # atomic lets them move
    for s in (0, 1):
        write(out, fake("tv-mc", s, 30.0 + s, 20.0), metrics(4, 0.3 + 0.1 * s, 0.5, **mc))
        write(out, fake("tv-atomic", s, 35.0 + s, 21.0), metrics(3 + s, 0.4, 0.6 + 0.1 * s, **at))
    write(out, fake("kl-atomic", 0, 40.0, 22.0), metrics(4, 0.5, 0.7, **at))


def test_curves_and_clip_by_mu_from_run_folders(tmp_path):
    out = str(tmp_path)
    synthetic_sweep(out)
    hists = stats.histories(out, stats.finished(out, NAMES))
    assert {n: len(h) for n, h in hists.items()} == {"tv-mc": 2, "tv-atomic": 2, "kl-atomic": 1}
    curv = stats.curves(hists)
    assert len(curv["tv-atomic"]["entropy"]["mean"]) == 3                 # iterations both seeds reached
    band = curv["tv-mc"]["reward_mean"]
    assert band["min"][0] == 0.3 and math.isclose(band["max"][0], 0.4) and math.isclose(band["mean"][0], 0.35)
    by_mu = stats.clip_by_mu(hists)
    assert by_mu["tv-mc"]["clip"] == pytest.approx([0.3, 0.1, 0.02, 0.0]) and by_mu["tv-mc"]["n"] == 2
    assert by_mu["tv-mc"]["token"] == pytest.approx([0.05, 0.15, 0.3, 0.5])
    assert stats.mu_buckets() == ["μ<0.01", "0.01-0.1", "0.1-0.5", "μ≥0.5"]


def test_clip_by_mu_pools_iterations_by_token_share():
    """An iteration with no token in a bucket does not count as 0% clipped there."""
    rows = [dict(token_frac_by_mu=[0.0, 0.5, 0.5, 0.0], clip_frac_by_mu=[0.0, 0.2, 0.0, 0.0]),
            dict(token_frac_by_mu=[0.1, 0.3, 0.6, 0.0], clip_frac_by_mu=[0.5, 0.4, 0.0, 0.0])]
    st = stats.clip_by_mu({"tv-mc": [rows]})["tv-mc"]
    assert st["clip"][0] == 0.5                                          # only the iteration with tokens
    assert math.isclose(st["clip"][1], (0.2 * 0.5 + 0.4 * 0.3) / 0.8)   # weighted by the token share
    assert st["clip"][3] is None                                         # no token ever: no value
    assert math.isclose(st["token"][0], 0.05)
    assert stats.clip_by_mu({"gspo": [[{"reward_mean": 0.1}]]}) == {}    # runs without the metric


def test_report_of_a_finished_sweep(tmp_path):
    """The sweep on a folder whose runs are all done: no train.py, no eval.py (eval_start.json is
    there), no gppo.py (regions.png is there); it writes the tables, sweep.json, the figures drawn
    from the runs' metrics.jsonl (dynamics.png, clip_by_mu.png) and its log, and publishes them."""
    out = tmp_path / "sweep"
    synthetic_sweep(str(out))
    (out / "eval_start.json").write_text(json.dumps({"avg@8": {"tiny-math": 25.0, "tiny-code": 20.0, "all": 23.0},
                                                     "model": "m"}))
    (out / "regions.png").write_bytes(b"")
    earlier = {"command": "bench/sweep.py --seeds 0-1 --jobs 2", "ran": 5, "failed": 0, "jobs": 2,
               "wall_s": 600.0, "at": "2026-12-04 09:01"}         # the invocation that made the runs
    (out / "invocations.jsonl").write_text(json.dumps(earlier) + "\n")
    pub = tmp_path / "pub"
    proc = subprocess.run([sys.executable, "bench/sweep.py", "--out", str(out), "--model", "m", "--data_dir", "d",
                           "--only", "grpo,tv-atomic", "--seeds", "0-1", "--iters", "2", "--publish",
                           "--publish_dir", str(pub)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "sweep: 0 runs to do of 4" in proc.stdout
    table = (out / "table.md").read_text()
    assert "| **tv-mc (GRPO / PPO)** | 2 | 30.5 ± 0.7 | reference |" in table
    assert "| kl-atomic | 1 | 40.0 | +10.0 [n < 2] (n=1) |" not in table      # n=1 row: its n says it
    assert "| kl-atomic | 1 | 40.0 | +10.0 [n < 2] |" in table
    assert "| atomic above mc | tv-atomic − tv-mc | +8.6 / +2.5 | 2 | +5.0 [+5.0, +5.0] ✱ | reproduced |" in table
    assert "`bench/sweep.py --seeds 0-1 --jobs 2`: 5 runs in 10.0 min" in table
    summary = json.loads((out / "sweep.json").read_text())
    assert summary["warm_start"]["tiny-math"] == 25.0 and summary["rows"]["tv-mc"]["gain_tiny-math"] == 5.5
    assert summary["warm_start_cmd"][-2:] == ["--out", "sweep/eval_start.json"]   # no tmp_path: committed
    assert set(summary["clip_by_mu"]) == {"tv-mc", "tv-atomic", "kl-atomic"} and len(summary["runs"]) == 5
    assert len((out / "invocations.jsonl").read_text().splitlines()) == 1   # this one ran nothing: no line
    assert sorted(os.listdir(pub)) == ["clip_by_mu.png", "dynamics.png", "regions.png", "runs", "sweep.json",
                                       "table.md"]
    for f in ("dynamics.png", "clip_by_mu.png"):
        assert (pub / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each finished run's files are kept in the committed folder (choice 9), with the warm start and the log
    assert sorted(os.listdir(pub / "runs")) == ["eval_start.json", "invocations.jsonl", "kl-atomic-seed0",
                                                "tv-atomic-seed0", "tv-atomic-seed1", "tv-mc-seed0", "tv-mc-seed1"]
    assert sorted(os.listdir(pub / "runs" / "tv-mc-seed1")) == ["metrics.jsonl", "result.json"]


def test_publish_restores_archived_runs_into_a_fresh_out(tmp_path):
    """Choice 9: a checkout without out/ (a new session, another machine) gets back every run archived in
    the committed folder, so the sweep goes on where it stopped: nothing to redo, the same table; a run
    half-finished in out/ is replaced by its archived finished copy, a torn archive copy is not restored."""
    first, pub = tmp_path / "first", tmp_path / "pub"
    synthetic_sweep(str(first))
    (first / "eval_start.json").write_text(json.dumps({"avg@8": {"tiny-math": 25.0, "tiny-code": 20.0,
                                                                  "all": 23.0}, "model": "m"}))
    (first / "regions.png").write_bytes(b"")
    sweep.archive(str(first), str(pub), [(r["name"], r["seed"]) for r in stats.finished(str(first), NAMES)])
    torn = pub / "runs" / "kl-atomic-seed1"
    torn.mkdir()
    (torn / "metrics.jsonl").write_text("")                      # cut before its result.json: not finished
    fresh = tmp_path / "fresh"
    os.makedirs(stats.run_dir(str(fresh), "tv-mc", 1))           # started here, finished in the archive
    (fresh / "regions.png").write_bytes(b"")
    cmd = ["--model", "m", "--data_dir", "d", "--only", "grpo,tv-atomic", "--seeds", "0-1", "--iters", "2",
           "--publish", "--publish_dir", str(pub)]
    tables = []
    for out in (first, fresh):
        proc = subprocess.run([sys.executable, "bench/sweep.py", "--out", str(out), *cmd], cwd=ROOT,
                              capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr
        assert "sweep: 0 runs to do of 4" in proc.stdout
        tables.append((out / "table.md").read_text())
    assert "restored 5 finished run(s)" in proc.stdout
    assert tables[1] == tables[0].replace("first/", "fresh/")   # the warm start names its --out
    assert not os.path.exists(stats.run_dir(str(fresh), "kl-atomic", 1))
    assert sweep.restore(str(fresh), str(pub)) == []              # nothing left to restore


def test_dry_run_lists_every_run_and_writes_nothing(tmp_path):
    out = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "bench/sweep.py", "--dry_run", "--out", str(out), "--seeds", "0-1",
                           "--model", "nowhere", "--iters", "2"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    n = 2 * len(NAMES)
    assert proc.stdout.count("  run  ") == n and f"{n} of {n} runs to do" in proc.stdout
    assert "--iters 2" in proc.stdout and "--eval_data tiny-math,tiny-code" in proc.stdout
    assert "--method gspo" in proc.stdout                                 # the first run: a baseline by name
    assert not out.exists()


def test_task_rare_runs_on_data_tiny_rare(tmp_path):
    """--task rare: every run gets the rare warm start, its data folder and data set (train.py's other
    defaults unchanged), and the table has one eval column."""
    out = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "bench/sweep.py", "--task", "rare", "--dry_run", "--out", str(out),
                           "--seeds", "0", "--only", "grpo", "--iters", "2"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.splitlines()[-1]
    for part in ("--model data/tiny_rare/model", "--data_dir data/tiny_rare", "--eval_data tiny-rare-math",
                 "--train_data tiny-rare-math", "--iters 2"):
        assert part in cmd, (part, cmd)
    try:
        stats.EVAL_SETS = ("tiny-rare-math",)
        rows = stats.aggregate(results_two_budgets(), NAMES, warm={"tiny-rare-math": 5.0})
        table = sweep_report.format_table(rows, 8, warm={"tiny-rare-math": 5.0})
    finally:
        stats.EVAL_SETS = ("tiny-math", "tiny-code")
    head, sep, warm = table.splitlines()[:3]
    assert head.count("|") == sep.count("|") == warm.count("|") == 8 and "tiny-rare-math avg@8" in head


def test_task_smollm2_runs_the_preset_with_the_sweeps_own_folders(tmp_path):
    """--task smollm2: configs/smollm2_cpu.args in every run, less its --model/--out_dir/--eval_data
    (the sweep's own), a pass-through flag after the preset's, and the preset's held-out set."""
    out = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "bench/sweep.py", "--task", "smollm2", "--dry_run", "--out", str(out),
                           "--seeds", "0", "--only", "grpo", "--prompts_per_update", "2"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.splitlines()[-1].split()
    preset = [ln.strip() for ln in open(ROOT / "configs/smollm2_cpu.args") if ln.startswith("--")]
    held_out = next(f.split("=", 1)[1] for f in preset if f.startswith("--eval_data="))
    assert cmd[cmd.index("--model") + 1] == "data/smollm2/model" and cmd.count("--model") == 1
    assert cmd[cmd.index("--out_dir") + 1] == str(out / "tv-mc-seed0") and cmd.count("--out_dir") == 1
    assert cmd[cmd.index("--eval_data") + 1] == held_out and cmd.count("--eval_data") == 1
    assert "--template" in cmd and cmd[-2:] == ["--prompts_per_update", "2"]   # the preset, then ours
    assert stats.TASKS["smollm2"]["eval_sets"] == (held_out,) and not out.exists()


# ----------------------------------------------------------------------------------------------
# learning speed (stats.iters_to_reward, auc): iterations to a train reward, area under the held-out
# avg@k curve

def test_iters_to_reward_first_crossing_and_never_reached():
    hist = [dict(iter=i + 1, reward_mean=r) for i, r in enumerate([0.1, 0.49, 0.5, 0.3, 0.7])]
    assert stats.iters_to_reward(hist) == (3, True)                       # >= 0.5: 0.5 itself counts
    assert stats.iters_to_reward(hist, target=0.6) == (5, True)
    assert stats.iters_to_reward(hist, target=0.8) == (6, False)          # never: last iteration + 1
    assert stats.iters_to_reward(hist[:2]) == (3, False)
    assert stats.iters_to_reward([]) == (1, False)
    assert stats.REWARD_TARGET == 0.5


def test_auc_is_the_trapezoid_mean_over_the_span():
    # 0 -> 10 -> 20 -> 30 at 4, 20, 40, 40: areas 120 + 300 + 400 = 820 over 30 iterations
    pts = [(0, {"a": 4.0}), (10, {"a": 20.0}), (20, {"a": 40.0}), (30, {"a": 40.0, "b": 1.0})]
    assert math.isclose(stats.auc(pts, "a"), 820 / 30)
    assert stats.auc(pts, "b") is None                                    # one point is no curve
    assert stats.auc([(0, {"a": 4.0}), (60, {"a": 64.0})], "a") == 34.0   # a straight line: its midpoint
    assert stats.auc([(10, {"a": 5.0}), (20, {"a": 5.0})], "a") == 5.0    # a flat curve: its value
    assert stats.auc([], "a") is None


def test_eval_points_from_warm_start_rows_and_eval_json():
    rows = [dict(iter=i, reward_mean=0.0) for i in range(1, 26)]
    for i, v in ((10, 20.0), (20, 40.0)):
        rows[i - 1]["eval_avg@8"] = {"x": v}
    pts = stats.eval_points(rows, 8, start={"x": 4.0}, final={"x": 50.0})
    assert pts == [(0, {"x": 4.0}), (10, {"x": 20.0}), (20, {"x": 40.0}), (25, {"x": 50.0})]   # eval.json at 25
    rows[-1]["eval_avg@8"] = {"x": 48.0}                                  # the last row has its own score
    assert stats.eval_points(rows, 8, start={"x": 4.0}, final={"x": 50.0})[-1] == (25, {"x": 48.0})
    assert stats.eval_points(rows, 16, start={"x": 4.0}, final={"x": 50.0}) == []   # other k: no rows
    assert stats.eval_points(rows[:5], 8, start={"x": 4.0}, final={"x": 50.0}) == []  # no --eval_every: no curve


RARE = ("tiny-rare-math",)


def rare_metrics(rewards, evals, k=8):
    """metrics.jsonl rows: one per reward, eval_avg@k every 10 iterations from `evals` (10, 20, ...)."""
    rows = [dict(iter=i + 1, reward_mean=r, entropy=0.1, time_iter_s=2.0, token_frac_by_mu=[0.01, 0.02, 0.07, 0.9],
                 clip_frac_by_mu=[0.5, 0.3, 0.01, 0.0]) for i, r in enumerate(rewards)]
    for j, v in enumerate(evals):
        rows[10 * (j + 1) - 1][f"eval_avg@{k}"] = {"tiny-rare-math": v, "all": v}
    return rows


def rare_sweep(out, settings):
    """tv-mc and kl-atomic at seeds 0-2, 30 iterations, scored at 10, 20, 30; kl-atomic reaches a
    reward of 0.5 at 5, 6, 7 where tv-mc does at 20, 25 and never; warm start 4%."""
    ramp = lambda at: [0.1] * (at - 1) + [0.5] + [0.6] * (30 - at)
    runs = {("tv-mc", 0): (ramp(20), [10.0, 40.0, 70.0]), ("tv-mc", 1): (ramp(25), [10.0, 30.0, 60.0]),
            ("tv-mc", 2): ([0.2] * 30, [8.0, 12.0, 20.0]),
            ("kl-atomic", 0): (ramp(5), [40.0, 70.0, 80.0]), ("kl-atomic", 1): (ramp(6), [30.0, 60.0, 70.0]),
            ("kl-atomic", 2): (ramp(7), [20.0, 50.0, 60.0])}
    for (name, s), (rew, ev) in runs.items():
        res = dict(name=name, seed=s, settings=settings, threads=None, cmd=[],
                   eval={"tiny-rare-math": ev[-1], "all": ev[-1]}, final={"entropy": 0.1, "reward_mean": rew[-1]},
                   iters=30, wall_s=10.0, iter_s_mean=2.0, other_s=6.0)
        write(out, res, rare_metrics(rew, ev))
    return runs


def test_speed_pairs_iterations_and_auc_against_grpo(tmp_path):
    out = str(tmp_path)
    try:
        stats.EVAL_SETS = RARE
        settings = sweep.make_settings("m", "d", ["--train_data", "tiny-rare-math", "--eval_every", "10"])
        rare_sweep(out, settings)
        results = stats.finished(out, NAMES)
        sp = stats.speed(out, results, stats.histories(out, results, by_seed=True), NAMES, 8,
                         warm={"tiny-rare-math": 4.0, "all": 4.0})
        ev = stats.eval_curves(sp, "tiny-rare-math")
    finally:
        stats.EVAL_SETS = ("tiny-math", "tiny-code")
    grpo, kl = sp["tv-mc"], sp["kl-atomic"]
    assert grpo["n"] == kl["n"] == 3 and grpo["not_reached"] == 1 and kl["not_reached"] == 0
    assert grpo["reach"][0] == (20 + 25 + 31) / 3                        # never reached: 30 + 1
    d = kl["vs_ref_reach"]                                               # 5 - 20, 6 - 25, 7 - 31
    assert d["per_seed"] == {0: -15, 1: -19, 2: -24}
    assert (d["n"], d["mean"], d["lo"], d["hi"]) == stats.paired({0: 5, 1: 6, 2: 7}, {0: 20, 1: 25, 2: 31})
    assert d["distinguishable"]
    # AUC of tv-mc seed 0: 0 -> 10 -> 20 -> 30 at 4, 10, 40, 70: (70 + 250 + 550) / 30
    assert math.isclose(stats.auc(grpo["points"][0], "tiny-rare-math"), 870 / 30)
    a = {s: stats.auc(p, "tiny-rare-math") for s, p in kl["points"].items()}
    b = {s: stats.auc(p, "tiny-rare-math") for s, p in grpo["points"].items()}
    assert kl["vs_ref_auc_tiny-rare-math"]["mean"] == pytest.approx(stats.paired(a, b)[1])
    assert kl["auc_n_tiny-rare-math"] == 3 and kl["auc_tiny-rare-math"][0] == pytest.approx(sum(a.values()) / 3)
    assert sp["gspo"]["n"] == 0 and sp["gspo"]["vs_ref_reach"]["mean"] is None
    # the figure's curve: median and min-max over seeds at 0, 10, 20, 30
    assert ev["tv-mc"]["iters"] == [0, 10, 20, 30] and ev["tv-mc"]["median"] == [4.0, 10.0, 30.0, 60.0]
    assert ev["tv-mc"]["min"][3] == 20.0 and ev["kl-atomic"]["max"][1] == 40.0 and ev["kl-atomic"]["n"] == 3
    assert set(ev) == {"tv-mc", "kl-atomic"}
    # the table: the reference first, n not reached, paired intervals
    stats.EVAL_SETS = RARE
    try:
        rows = stats.aggregate(results, NAMES, warm={"tiny-rare-math": 4.0})
        lines = sweep_report.format_speed(sp, rows, 8, "tiny-rare-math").splitlines()
    finally:
        stats.EVAL_SETS = ("tiny-math", "tiny-code")
    assert "iterations to train reward 0.5" in lines[0] and lines[0].count("|") == lines[1].count("|") == 10
    assert lines[2].startswith("| **tv-mc (GRPO / PPO)** | 3 | 25.3 ± 5.5 | 1 of 3 | reference |")
    assert lines[3].startswith("| kl-atomic | 3 | 6.0 ± 1.0 | 0 of 3 | -19.3 [") and "✱" in lines[3].split(" | ")[4]
    assert len(lines) == 4                                               # methods not run are left out


def test_eval_every_and_target_kl_pass_through_and_are_settings(tmp_path):
    flags, threads = sweep.split_passthrough(["--target_kl", "0", "--eval_every=10"])
    assert flags == ["--target_kl", "0", "--eval_every", "10"] and threads is None
    st = sweep.make_settings("m", "d", flags)
    assert st["train_args"]["target_kl"] == 0 and st["train_args"]["eval_every"] == 10
    # runs scored at other iterations (or not at all) are not mixed into the same table
    assert sweep.changed(st, sweep.make_settings("m", "d", ["--target_kl", "0"])) == ["--eval_every 10 (now 0)"]
    assert sweep.changed(st, sweep.make_settings("m", "d", ["--eval_every", "10"])) == ["--target_kl 0.0 (now 0.05)"]
    proc = subprocess.run([sys.executable, "bench/sweep.py", "--task", "rare", "--dry_run",
                           "--out", str(tmp_path / "s"),
                           "--seeds", "0-4", "--only", "grpo,dapo,kl-atomic,dppo,ripo,dgpo", "--target_kl", "0",
                           "--eval_every", "10", "--jobs", "2"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "30 of 30 runs to do, 2 at a time" in proc.stdout
    tail = "--threads 1 --train_data tiny-rare-math --target_kl 0 --eval_every 10"
    assert proc.stdout.splitlines()[-1].endswith(tail)


def test_default_panel_reads_what_exists(tmp_path):
    """answer_prob.png's second panel: the default sweep's eval_avg@k rows, else its train reward
    (run folders first, then the published sweep.json); None when there is neither."""
    assert sweep_report.default_panel(8, folder=str(tmp_path / "none"), summary=str(tmp_path / "none.json")) is None
    summary = tmp_path / "sweep.json"
    summary.write_text(json.dumps({"k": 8, "curves": {"tv-mc": {"reward_mean": {
        "mean": [0.25, 0.5], "min": [0.2, 0.4], "max": [0.3, 0.6]}}}}))
    p = sweep_report.default_panel(8, folder=str(tmp_path / "none"), summary=str(summary))
    assert "TRAIN REWARD" in p["title"] and p["line"] == "mean"
    assert p["curves"]["tv-mc"] == dict(iters=[1, 2], line=[25.0, 50.0], min=[20.0, 40.0], max=[30.0, 60.0])
    folder = tmp_path / "sweep"                                           # run folders win over the summary
    synthetic_sweep(str(folder))                                          # no eval rows: train reward, median
    p = sweep_report.default_panel(8, folder=str(folder), summary=str(summary))
    assert "TRAIN REWARD" in p["title"] and p["line"] == "median"
    assert set(p["curves"]) == {"tv-mc", "tv-atomic", "kl-atomic"}
    assert p["curves"]["tv-mc"]["line"][0] == pytest.approx(35.0)
    rows = rare_metrics([0.3] * 20, [30.0, 50.0])                        # with eval rows: avg@k ("all")
    write(str(folder), fake("tv-mc", 0, 50.0, 50.0), rows)
    (folder / "eval_start.json").write_text(json.dumps({"avg@8": {"all": 10.0}}))
    p = sweep_report.default_panel(8, folder=str(folder), summary=str(summary))
    assert "avg@8" in p["title"] and "TRAIN" not in p["title"]
    assert p["curves"]["tv-mc"]["iters"] == [0, 10, 20] and p["curves"]["tv-mc"]["line"] == [10.0, 30.0, 50.0]
    # a published summary with eval curves wins over run folders without eval rows
    summary.write_text(json.dumps({"k": 8, "eval_curves": {"kl-atomic": dict(iters=[0, 10], n=2, median=[5.0, 9.0],
                                                                              min=[5.0, 8.0], max=[5.0, 10.0])}}))
    p = sweep_report.default_panel(8, folder=str(tmp_path / "sweep2"), summary=str(summary))
    assert "avg@8" in p["title"] and p["curves"]["kl-atomic"]["line"] == [5.0, 9.0]


def test_report_of_a_finished_rare_sweep(tmp_path):
    """--task rare on a finished folder: the learning-speed and clip-by-mu sections in table.md, the
    same numbers in sweep.json, answer_prob.png drawn and published."""
    out = tmp_path / "sweep"
    extra = ["--iters", "30", "--target_kl", "0", "--eval_every", "10"]
    try:
        stats.EVAL_SETS = RARE
        settings = sweep.make_settings("m", "d", ["--train_data", "tiny-rare-math"] + extra)
    finally:
        stats.EVAL_SETS = ("tiny-math", "tiny-code")
    rare_sweep(str(out), settings)
    (out / "eval_start.json").write_text(json.dumps({"avg@8": {"tiny-rare-math": 4.0, "all": 4.0}}))
    (out / "regions.png").write_bytes(b"")
    pub = tmp_path / "pub"
    proc = subprocess.run([sys.executable, "bench/sweep.py", "--task", "rare", "--out", str(out), "--model", "m",
                           "--data_dir", "d", "--only", "grpo,kl-atomic", "--seeds", "0-2", *extra, "--publish",
                           "--publish_dir", str(pub)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    table = (out / "table.md").read_text()
    assert "## Learning speed: tiny-rare-math" in table and "over iterations 0, 10, 20, 30 (0: the warm start" in table
    assert "| **tv-mc (GRPO / PPO)** | 3 | 25.3 ± 5.5 | 1 of 3 | reference |" in table
    assert "| kl-atomic | 3 | 6.0 ± 1.0 | 0 of 3 | -19.3 [" in table
    assert "## Where each region clips, by behaviour probability mu" in table
    assert "| kl-atomic | 3 | 50.00 (1.0) | 30.00 (2.0) | 1.00 (7.0) | 0.00 (90.0) |" in table
    assert "answer_prob.png (held-out tiny-rare-math avg@8" in table
    summary = json.loads((out / "sweep.json").read_text())
    assert summary["reward_target"] == 0.5 and summary["eval_curve_key"] == "tiny-rare-math"
    assert set(summary["speed"]) == {"tv-mc", "kl-atomic"} and summary["speed"]["tv-mc"]["not_reached"] == 1
    assert summary["eval_curves"]["kl-atomic"]["iters"] == [0, 10, 20, 30]
    assert sorted(os.listdir(pub)) == ["answer_prob.png", "clip_by_mu.png", "dynamics.png", "regions.png",
                                       "runs", "sweep.json", "table.md"]
    assert (pub / "answer_prob.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_regions_are_drawn_by_the_tools_that_draw_them(tmp_path):
    # the report's regions.txt and regions.png come from `python bench/regions.py` and bench/plot_regions.py
    # (the report tests pre-create regions.png; here the real commands run)
    sweep_report.draw_regions(str(tmp_path))
    assert "kl" in (tmp_path / "regions.txt").read_text()
    assert (tmp_path / "regions.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
