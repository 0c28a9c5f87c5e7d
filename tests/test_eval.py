"""eval.py: avg@k against a hand computation on the committed tiny model's samples; the command
line's end-of-run table (run.sh prints it), its comparison of run folders (table and figure) and
its refusal of a response budget that leaves the prompt no room (no model is loaded there). A few
seconds."""
import json

import pytest

from conftest import PY, ROOT, run

# a metrics.jsonl row as train.py writes it (a real run's first row: every key it logs)
REAL_ROW = json.loads((ROOT / "bench" / "results" / "smollm2" / "metrics.jsonl").open().readline())


def write_run(folder, rewards, kls, evals, start=None, final=None, k=8):
    """A run folder as train.py leaves it: metrics.jsonl (REAL_ROW's keys, these rewards and KLs,
    eval_avg@k on the iterations in `evals`), eval_start.json and eval.json when given."""
    folder.mkdir(parents=True)
    rows = []
    for it, (r, kl) in enumerate(zip(rewards, kls), 1):
        rows.append(dict(REAL_ROW, iter=it, reward_mean=r, kl_k3=kl))
        if it in evals:
            rows[-1][f"eval_avg@{k}"] = evals[it]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for name, res in (("eval_start.json", start), ("eval.json", final)):
        if res:
            (folder / name).write_text(json.dumps({f"avg@{k}": res, "model": "m"}))


def test_compare_prints_before_after_and_change(tmp_path):
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(json.dumps({"avg@8": {"tiny-math": 24.125, "tiny-code": 31.25, "all": 25.16}, "model": "a"}))
    after.write_text(json.dumps({"avg@8": {"tiny-math": 71.5, "tiny-code": 90.44, "all": 74.2}, "model": "b"}))
    proc, _ = run([PY, "eval.py", "--compare", str(before), str(after)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split()[:4] == ["data", "set", "before", "after"] and "avg@8" in lines[0]
    assert lines[1].split() == ["tiny-math", "24.1", "71.5", "+47.4"]
    assert lines[2].split() == ["tiny-code", "31.2", "90.4", "+59.2"]     # 31.25 rounds to 31.2, 90.44 to 90.4
    assert lines[3].split() == ["all", "25.2", "74.2", "+49.0"]
    assert "{" not in proc.stdout, "the table replaces the raw JSON lines"


def test_compare_run_folders_table_and_figure(tmp_path):
    """eval.py --compare RUN_DIR RUN_DIR RUN_DIR: a finished run, an unfinished one (no eval.json)
    and a second folder named like the first; one table line per run named by its folder, the
    figure written."""
    start = {"tiny-math": 25.0, "tiny-code": 30.0, "all": 26.0}
    write_run(tmp_path / "a" / "kl-atomic-seed0", [i / 10 for i in range(1, 11)],
              [i / 1000 for i in range(1, 11)], {5: {"tiny-math": 50.0, "tiny-code": 40.0, "all": 47.0}},
              start=start, final={"tiny-math": 80.0, "tiny-code": 90.5, "all": 82.3})
    write_run(tmp_path / "b" / "grpo-seed0", [0.2] * 6, [0.004] * 6,
              {5: {"tiny-math": 61.0, "tiny-code": 35.5, "all": 58.0}})
    write_run(tmp_path / "c" / "kl-atomic-seed0", [0.5, 0.7], [0.02, 0.03], {}, start=start,
              final={"tiny-math": 30.0, "tiny-code": 31.0, "all": 30.4})
    figure = tmp_path / "figs" / "cmp.png"
    folders = [str(tmp_path / d) for d in ("a/kl-atomic-seed0", "b/grpo-seed0", "c/kl-atomic-seed0")]
    proc, _ = run([PY, "eval.py", "--compare", *folders, "--plot", str(figure)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["run", "iters", "eval", "at", "tiny-math", "tiny-code", "all", "reward", "kl_k3"]
    # last evaluation (eval.json at the last iteration), its change from eval_start.json, the train
    # reward and kl_k3 over the last 5 iterations (0.6 ... 1.0, 0.006 ... 0.010)
    assert lines[1].split() == ["a/kl-atomic-seed0", "10", "10", "80.0", "(+55.0)", "90.5", "(+60.5)",
                                "82.3", "(+56.3)", "0.800", "8.0e-03"]
    assert lines[2].split() == ["b/grpo-seed0", "6", "5", "61.0", "35.5", "58.0", "0.200", "4.0e-03"]
    assert lines[3].split() == ["c/kl-atomic-seed0", "2", "2", "30.0", "(+5.0)", "31.0", "(+1.0)",
                                "30.4", "(+4.4)", "0.600", "2.5e-02"]
    assert lines[4].startswith("(avg@8 in %") and lines[-1] == f"curves: {figure}"
    assert "before" not in proc.stdout and "after" not in proc.stdout
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 20_000


def test_compare_refuses_a_folder_that_holds_no_run(tmp_path):
    write_run(tmp_path / "run", [0.5], [0.01], {})
    (tmp_path / "empty").mkdir()
    proc, _ = run([PY, "eval.py", "--compare", str(tmp_path / "run"), str(tmp_path / "empty"),
                   "--plot", str(tmp_path / "x.png")], timeout=120)
    assert proc.returncode != 0 and "empty is not a run folder (no metrics.jsonl)" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "x.png").exists()


def test_compare_names_reasoning_gym_sets_readably_and_stays_aligned():
    from eval import compare_table
    opts = "min_terms=2&max_terms=2&min_digits=1&max_digits=1&allow_parentheses=False&allow_negation=False"
    sets = [f"rg:basic_arithmetic?{opts}&size=100", f"rg:basic_arithmetic?{opts}&size=50", "tiny-math"]
    table = compare_table({"avg@8": {sets[0]: 37.7, sets[1]: 40.0, sets[2]: 5.0, "all": 30.0}},
                          {"avg@8": {sets[0]: 76.7, sets[1]: 100.0, sets[2]: 50.0, "all": 70.0}})
    lines = table.splitlines()
    names = [line.split()[0] for line in lines[1:5]]
    # the set and a short hash of its options: two configurations of one set stay apart
    assert names[0].startswith("rg:basic_arithmetic#") and names[1].startswith("rg:basic_arithmetic#")
    assert names[0] != names[1] and len(names[0]) == len("rg:basic_arithmetic#") + 4
    assert names[2:] == ["tiny-math", "all"]
    assert lines[1].split()[1:] == ["37.7", "76.7", "+39.0"]
    # aligned: every row's last column ends under the header's "change"
    assert {len(line) for line in lines[1:5]} == {lines[0].index("change") + len("change")}, table
    # under the table, each shortened name with the full one
    assert lines[5:] == [f"  {names[0]} = {sets[0]}", f"  {names[1]} = {sets[1]}"]


def test_refuses_a_response_budget_at_or_over_the_context(tmp_path):
    proc, _ = run([PY, "eval.py", "--model", str(tmp_path / "none"), "--max_new_tokens", "256",
                   "--max_model_len", "256"], timeout=120)
    assert proc.returncode == 2
    assert "--max_new_tokens=256" in proc.stderr and "fewer tokens than --max_model_len=256" in proc.stderr
    assert "Traceback" not in proc.stderr, "refused by the argument check, before touching the model"


def test_avg_at_k_is_the_mean_of_k_samples_by_hand():
    """eval.avg_at_k on 6 math and 4 code held-out problems, k = 4 samples each from the committed
    tiny model (--backend hf, seeded): each source's value is the mean of its problems' mean
    rewards, in % (not the best of k: pass@k differs on these samples). Scored here from the same
    seeded draw."""
    import reward
    from conftest import ROOT
    from eval import avg_at_k, load_rows
    from rollout import make_engine
    model = str(ROOT / "data" / "tiny" / "model")
    engine = make_engine(model, backend="hf", max_model_len=256, seed=0)
    rows = [r for name, n in (("tiny-math", 6), ("tiny-code", 4))
            for r in load_rows(name, "test", None, "plain", engine.tokenizer)[:n]]
    k, tokens, seed = 4, 40, 5
    got = avg_at_k(engine, rows, k, tokens, seed=seed)
    batch = engine.generate([r["prompt_ids"] for r in rows], n=k, max_tokens=tokens, seed=seed)
    scores = reward.score_rows(batch.texts, [rows[i // k] for i in range(len(batch.texts))])
    per_problem = [scores[i * k:(i + 1) * k] for i in range(len(rows))]
    avg, best = {}, {}
    for src in ("tiny-math", "tiny-code"):
        mine = [s for r, s in zip(rows, per_problem) if r["source"] == src]
        avg[src] = 100 * sum(sum(s) / k for s in mine) / len(mine)
        best[src] = 100 * sum(max(s) for s in mine) / len(mine)
    avg["all"] = 100 * sum(sum(s) / k for s in per_problem) / len(rows)
    best["all"] = 100 * sum(max(s) for s in per_problem) / len(rows)
    assert got == pytest.approx(avg) and list(got) == ["tiny-math", "tiny-code", "all"]
    assert 0 < avg["all"] < best["all"], "want problems with mixed samples: avg@k and pass@k differ"
