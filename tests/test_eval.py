"""eval.py's command line: the end-of-run table run.sh prints, and the refusal of a response
budget that leaves the prompt no room. No model is loaded (a few seconds)."""
import json

from conftest import PY, run


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
