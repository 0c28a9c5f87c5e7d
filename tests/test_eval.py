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


def test_refuses_a_response_budget_at_or_over_the_context(tmp_path):
    proc, _ = run([PY, "eval.py", "--model", str(tmp_path / "none"), "--max_new_tokens", "256",
                   "--max_model_len", "256"], timeout=120)
    assert proc.returncode == 2
    assert "--max_new_tokens=256" in proc.stderr and "fewer tokens than --max_model_len=256" in proc.stderr
    assert "Traceback" not in proc.stderr, "refused by the argument check, before touching the model"
