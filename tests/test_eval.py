"""eval.py: avg@k and pass@k against a hand computation on the committed tiny model's samples
(through train.py's evaluate(), its JSON file included); pass_at_k against the closed form and
brute-force enumeration; the command line's end-of-run table (run.sh prints it), with and without
pass@k, its comparison of run folders (table and figure) and its refusal of a response budget that
leaves the prompt no room (no model is loaded there). A few seconds, plus the tiny model's samples
(~20 s on 2 cores)."""
import itertools
import json
import math
from fractions import Fraction
from types import SimpleNamespace

import pytest

from conftest import PY, ROOT, run

# a metrics.jsonl row as train.py writes it (a real run's first row: every key it logs)
REAL_ROW = json.loads((ROOT / "bench" / "results" / "smollm2" / "metrics.jsonl").open().readline())


def write_run(folder, rewards, kls, evals, start=None, final=None, k=8, passes=None):
    """A run folder as train.py leaves it: metrics.jsonl (REAL_ROW's keys, these rewards and KLs,
    eval_avg@k on the iterations in `evals`), eval_start.json and eval.json when given. `passes`
    {file name: pass@k entry} adds "pass@k" to those files (eval_iter_N.json: written with it)."""
    folder.mkdir(parents=True)
    rows = []
    for it, (r, kl) in enumerate(zip(rewards, kls), 1):
        rows.append(dict(REAL_ROW, iter=it, reward_mean=r, kl_k3=kl))
        if it in evals:
            rows[-1][f"eval_avg@{k}"] = evals[it]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    passes = passes or {}
    for name, res in (("eval_start.json", start), ("eval.json", final)):
        if res:
            extra = {"pass@k": passes[name]} if name in passes else {}
            (folder / name).write_text(json.dumps({f"avg@{k}": res, **extra, "model": "m"}))
    for name in passes:
        if name.startswith("eval_iter_"):
            it = int(name.removeprefix("eval_iter_").removesuffix(".json"))
            (folder / name).write_text(json.dumps({f"avg@{k}": evals[it], "pass@k": passes[name]}))


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
    assert "pass@" not in proc.stdout and len(lines) == 4, "files older than pass@k: avg@k only"


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
    assert "pass@" not in proc.stdout, "evaluation files older than pass@k: no pass@k block"
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


@pytest.mark.parametrize("argv,says", [
    (["--model", "/nonexistent/x"], "--model='/nonexistent/x': no such folder; accepted: a model folder"),
    (["--k", "0"], "--k=0; accepted: an integer >= 1"),
    (["--data", "nope"], "--data='nope': unknown data set 'nope'; accepted: tiny-math"),
])
def test_a_refused_value_reads_as_argparse_error(argv, says):
    """eval.py's refusals end as argparse's: usage, `eval.py: error: ...`, exit status 2, no traceback."""
    proc, _ = run([PY, "eval.py", *argv], timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"eval.py: error: {says}"), proc.stderr[-500:]


def test_avg_and_pass_at_k_of_k_samples_by_hand(tmp_path):
    """eval.evaluate (train.py's evaluations, through avg_and_pass_at_k, as avg_at_k) on 6 math and
    4 code held-out problems, k = 4 samples each from the committed tiny model (--backend hf,
    seeded): each source's avg@k is the mean of its problems' mean rewards, in % (not the best of
    k); pass@k the mean of the problems' 1 - C(n-c, k)/C(n, k), pass@1 = avg@k, pass@4 = the best
    of 4. Scored here from the same seeded draw. The file it writes keeps "avg@4" as before and
    adds "pass@k"; it returns avg@k (train.py's eval_avg@k column)."""
    import reward
    from conftest import ROOT
    from eval import evaluate, load_rows
    from rollout import make_engine
    model = str(ROOT / "data" / "tiny" / "model")
    engine = make_engine(model, backend="hf", max_model_len=256, seed=0)
    rows = [r for name, n in (("tiny-math", 6), ("tiny-code", 4))
            for r in load_rows(name, "test", None, "plain", engine.tokenizer)[:n]]
    k, tokens, seed = 4, 40, 5
    logs = []
    args = SimpleNamespace(eval_k=k, eval_data="tiny-math,tiny-code", max_new_tokens=tokens,
                           seed=seed, model=model, out_dir=str(tmp_path))
    acc = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True)
    got = evaluate(args, SimpleNamespace(engine=engine, eval_rows=rows, acc=acc, log=logs.append),
                   "eval.json")
    batch = engine.generate([r["prompt_ids"] for r in rows], n=k, max_tokens=tokens, seed=seed)
    scores = reward.score_rows(batch.texts, [rows[i // k] for i in range(len(batch.texts))])
    per_problem = [scores[i * k:(i + 1) * k] for i in range(len(rows))]
    assert set(scores) <= {0.0, 1.0}, "binary rewards"

    def closed(s, j):   # pass@j of one problem, 1 - C(n-c, j) / C(n, j)
        return 1 - math.comb(len(s) - int(sum(s)), j) / math.comb(len(s), j)

    avg, best, two = {}, {}, {}
    for src, mine in [(src, [s for r, s in zip(rows, per_problem) if r["source"] == src])
                      for src in ("tiny-math", "tiny-code")] + [("all", per_problem)]:
        avg[src] = 100 * sum(sum(s) / k for s in mine) / len(mine)
        best[src] = 100 * sum(max(s) for s in mine) / len(mine)
        two[src] = 100 * sum(closed(s, 2) for s in mine) / len(mine)
    assert got == pytest.approx(avg) and list(got) == ["tiny-math", "tiny-code", "all"]
    assert 0 < avg["all"] < two["all"] < best["all"], "want problems with mixed samples"
    res = json.loads((tmp_path / "eval.json").read_text())
    assert list(res) == ["avg@4", "pass@k", "model"] and res["avg@4"] == got
    assert list(res["pass@k"]) == ["1", "2", "4"]
    assert all(list(v) == ["tiny-math", "tiny-code", "all"] for v in res["pass@k"].values())
    assert res["pass@k"]["1"] == pytest.approx(avg), "binary rewards: pass@1 is avg@k"
    assert res["pass@k"]["2"] == pytest.approx(two)
    assert res["pass@k"]["4"] == pytest.approx(best), "n = k samples: pass@n is the best of n"
    assert logs[-1] == "  pass@k (all): " + " | ".join(
        f"pass@{j} {v:.1f}" for j, v in zip((1, 2, 4), (avg["all"], two["all"], best["all"])))


def test_pass_at_k_is_the_closed_form_and_the_enumeration():
    """pass_at_k(n, c, k) (the product form of Chen et al. 2021) against 1 - C(n-c, k)/C(n, k) for
    every 0 <= c <= n <= 10, 1 <= k <= n, against counting all size-k subsets of the n samples that
    hold a correct one (n <= 8), exactly 0 with no correct sample and 1 with every one correct; and
    stable where the binomials overflow a float."""
    from eval import pass_at_k
    for n in range(1, 11):
        for c in range(n + 1):
            for k in range(1, n + 1):
                got = pass_at_k(n, c, k)
                assert got == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
                if n <= 8:
                    subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
                    assert got == pytest.approx(sum(map(any, subsets)) / len(subsets), abs=1e-12)
                if c == 0:
                    assert got == 0.0
                if c == n or n - c < k:
                    assert got == 1.0
    # C(2000, 1000) ~ 2e600 is past a float's range; the product form is not
    exact = 1 - Fraction(math.comb(2000 - 3, 1000), math.comb(2000, 1000))
    assert pass_at_k(2000, 3, 1000) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(2000, 1, 1) == pytest.approx(1 / 2000)
    for bad in ((4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)):
        with pytest.raises(ValueError, match="accepted 0 <= c <= n, 1 <= k <= n"):
            pass_at_k(*bad)


def test_pass_at_k_per_data_set_for_powers_of_two_and_n():
    """pass_of: k = 1, 2, 4, ... up to n and n itself, keyed "1", "2", ...; each data set's mean of
    its problems' pass_at_k and "all" over every problem, in %; pass@1 is avg@k (binary rewards);
    a sample counts as correct only with reward >= 1."""
    from eval import avg_of, pass_at_k, pass_ks, pass_of
    assert [pass_ks(n) for n in (1, 2, 3, 6, 8, 12)] == [
        [1], [1, 2], [1, 2, 3], [1, 2, 4, 6], [1, 2, 4, 8], [1, 2, 4, 8, 12]]
    problems = [("math", [1, 0, 0, 0, 0, 0]), ("math", [1, 1, 1, 0, 0, 0]), ("code", [0] * 6),
                ("code", [1] * 6), ("code", [0, 0, 1, 0, 1, 0])]
    got = pass_of(problems, ["math", "code"])
    assert list(got) == ["1", "2", "4", "6"]
    for k, res in got.items():
        p = [pass_at_k(6, sum(s), int(k)) for _, s in problems]
        assert list(res) == ["math", "code", "all"]
        assert res == pytest.approx({"math": 100 * (p[0] + p[1]) / 2, "code": 100 * sum(p[2:]) / 3,
                                     "all": 100 * sum(p) / 5})
    assert got["1"] == pytest.approx(avg_of(problems, ["math", "code"]))
    assert got["6"] == pytest.approx({"math": 100.0, "code": 200 / 3, "all": 80.0}), "any right"
    assert got["2"]["all"] < got["4"]["all"] < got["6"]["all"]
    # a partial credit (0.5) is not a correct sample; it still counts in avg@k's mean reward
    half = pass_of([("x", [0.5, 0.5, 1.0, 0.0])], ["x"])
    assert half["4"]["x"] == 100.0 and half["1"]["x"] == 25.0 and half["2"]["x"] == 50.0
    assert avg_of([("x", [0.5, 0.5, 1.0, 0.0])], ["x"])["x"] == 50.0


def test_compare_before_after_with_pass_at_k_columns(tmp_path):
    """--compare BEFORE AFTER where the files hold pass@k: one column per k, after training with
    the change from before in brackets, aligned under its header; an older BEFORE without pass@k:
    the values after, no change."""
    from eval import compare_table
    before = {"avg@4": {"tiny-math": 20.0, "tiny-code": 30.0, "all": 24.0},
              "pass@k": {"1": {"tiny-math": 20.0, "tiny-code": 30.0, "all": 24.0},
                         "2": {"tiny-math": 31.0, "tiny-code": 45.0, "all": 36.6},
                         "4": {"tiny-math": 50.0, "tiny-code": 60.0, "all": 54.0}}, "model": "a"}
    after = {"avg@4": {"tiny-math": 60.0, "tiny-code": 35.0, "all": 50.0},
             "pass@k": {"1": {"tiny-math": 60.0, "tiny-code": 35.0, "all": 50.0},
                        "2": {"tiny-math": 72.5, "tiny-code": 45.0, "all": 61.5},
                        "4": {"tiny-math": 83.3, "tiny-code": 50.0, "all": 70.0}}, "model": "b"}
    table = compare_table(before, after)
    print(table)
    lines = table.splitlines()
    assert lines[0].split()[:7] == ["data", "set", "before", "after", "change", "pass@1", "pass@2"]
    assert lines[0].split()[7] == "pass@4" and "(avg@4, %; pass@k: after (change), %)" in lines[0]
    assert lines[1].split() == ["tiny-math", "20.0", "60.0", "+40.0", "60.0", "(+40.0)", "72.5",
                                "(+41.5)", "83.3", "(+33.3)"]
    assert lines[2].split() == ["tiny-code", "30.0", "35.0", "+5.0", "35.0", "(+5.0)", "45.0",
                                "(+0.0)", "50.0", "(-10.0)"]
    assert lines[3].split()[:4] == ["all", "24.0", "50.0", "+26.0"] and len(lines) == 4
    assert {len(line) for line in lines[1:]} == {lines[0].index("pass@4") + len("pass@4")}, table
    # through the command line, BEFORE an older file (avg@k only): pass@k after, without a change
    old = {k: v for k, v in before.items() if k != "pass@k"}
    (tmp_path / "before.json").write_text(json.dumps(old))
    (tmp_path / "after.json").write_text(json.dumps(after))
    proc, _ = run([PY, "eval.py", "--compare", str(tmp_path / "before.json"),
                   str(tmp_path / "after.json")], timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "pass@4" in lines[0]
    assert lines[1].split() == ["tiny-math", "20.0", "60.0", "+40.0", "60.0", "72.5", "83.3"]
    # and the other way round (AFTER older than pass@k): the avg@k table alone
    assert compare_table(after, old).splitlines()[1].split() == ["tiny-math", "60.0", "20.0", "-40.0"]


def test_compare_run_folders_with_pass_at_k(tmp_path):
    """runs_table under the avg@k table: per run and k, each data set's pass@k of its last
    evaluation file that has it (eval.json, else the last eval_iter_N.json), the change from
    eval_start.json in brackets; a run whose files predate pass@k gets a row of "-"."""
    from eval import read_run, runs_table
    def pk(*alls):
        return {str(2 ** j): {"tiny-math": v, "all": v} for j, v in enumerate(alls)}
    start, final = {"tiny-math": 25.0, "all": 25.0}, {"tiny-math": 80.0, "all": 80.0}
    write_run(tmp_path / "done", [0.5] * 4, [0.01] * 4, {2: {"tiny-math": 50.0, "all": 50.0}},
              start=start, final=final, k=4,
              passes={"eval_start.json": pk(25.0, 40.0, 55.0), "eval.json": pk(80.0, 90.0, 95.0),
                      "eval_iter_000002.json": pk(50.0, 60.0, 70.0)})
    write_run(tmp_path / "going", [0.5] * 3, [0.01] * 3, {2: {"tiny-math": 40.0, "all": 40.0}},
              start=start, k=4,
              passes={"eval_start.json": pk(25.0, 40.0, 55.0), "eval_iter_000002.json": pk(40.0, 50.0, 62.5)})
    write_run(tmp_path / "old-run", [0.5] * 2, [0.01] * 2, {}, start=start, final=final, k=4)
    runs = {n: read_run(tmp_path / n) for n in ("done", "going", "old-run")}
    assert [it for it, _ in runs["done"]["passes"]] == [0, 2, 4] and runs["old-run"]["passes"] == []
    table = runs_table(runs)
    print(table)
    lines = table.splitlines()
    assert lines[1].split()[:4] == ["done", "4", "4", "80.0"] and lines[4].startswith("(avg@4 in %")
    assert lines[5].split() == ["pass@k", "k", "eval", "at", "tiny-math", "all"]
    assert [line.split() for line in lines[6:13]] == [
        ["done", "1", "4", "80.0", "(+55.0)", "80.0", "(+55.0)"],
        ["done", "2", "4", "90.0", "(+50.0)", "90.0", "(+50.0)"],
        ["done", "4", "4", "95.0", "(+40.0)", "95.0", "(+40.0)"],
        ["going", "1", "2", "40.0", "(+15.0)", "40.0", "(+15.0)"],
        ["going", "2", "2", "50.0", "(+10.0)", "50.0", "(+10.0)"],
        ["going", "4", "2", "62.5", "(+7.5)", "62.5", "(+7.5)"],
        ["old-run", "-", "-", "-", "-"]]
    assert lines[13].startswith("(pass@k in %") and len(lines) == 14
    # aligned: the pass@k rows' columns end where the avg@k table's do
    assert len(lines[6]) == lines[0].index("all") + len("all") == len(lines[5])
