"""The task registry (reward.TASKS) and your own data (jsonl:PREFIX): one entry defines a task's
instruction, ground-truth check and reward; rows are checked when they are loaded.

Run: .venv/bin/python -m pytest tests/test_tasks.py -q   (CPU, no model run, a few seconds)
"""
import json
import re
from pathlib import Path

import pytest

import reward
from data.loaders import format_prompt, load_problems
from data.loaders import load_rows

ROOT = Path(__file__).resolve().parents[1]
BUILT_IN = ["math", "code", "rg", "exact"]   # the tasks reward.py ships; the README invites more


def registered():
    """The error messages' list of registered tasks, as a regex: whatever TASKS holds now, so a task
    the README's how-to adds to reward.py changes no test."""
    return re.escape(", ".join(map(repr, reward.TASKS)))


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(ROOT / "data" / "tiny" / "model"))


# ----------------------------------------------------------------------------- the registry

def test_registry_holds_the_built_in_tasks_and_score_dispatches_through_it(monkeypatch):
    assert set(BUILT_IN) <= set(reward.TASKS) and all(isinstance(t, reward.Task) for t in reward.TASKS.values())
    row = {"id": "0", "task": "exact", "problem": "Reverse the word: cat", "ground_truth": "tac", "source": "t"}
    assert reward.TASKS["exact"].instruction(row) == row["problem"] + reward.ANSWER_SUFFIX
    # an unknown task is refused naming every registered one, a task added later included
    monkeypatch.setitem(reward.TASKS, "added", reward.TASKS["exact"])
    with pytest.raises(ValueError, match=f"'chess'; registered tasks: {registered()}") as e:
        reward.score("chess", ["Answer: 1"], ["1"])
    assert all(repr(name) in str(e.value) for name in BUILT_IN + ["added"])


def test_a_new_task_is_one_registry_entry(monkeypatch, tmp_path, tok):
    """A task registered only in reward.TASKS is loaded, prompted and scored by its own entry."""
    monkeypatch.setitem(reward.TASKS, "length", reward.Task(
        instruction=lambda row: f"How many letters? {row['problem']}\nAnswer with a number.",
        check=lambda g: int(g),                                  # ValueError for a non-number
        extract=lambda c: c.split()[-1] if c.split() else None,  # the last word
        judge=lambda answer, gold, timeout: float(answer == str(gold))))
    write_jsonl(tmp_path / "len_test.jsonl", [{"problem": "cat", "answer": 3, "task": "length"},
                                              {"problem": "horse", "answer": "5", "task": "length"}])
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    rows = load_rows(f"jsonl:{tmp_path}/len", "test", None, "chat", tok)
    assert rows[0]["prompt"] == "[How many letters? cat\nAnswer with a number.]"
    assert [r["ground_truth"] for r in rows] == [3, "5"]  # each answer as the file has it
    assert reward.score_rows(["it is 3", "it is 4", "", None], rows + rows) == [1.0, 0.0, 0.0, 0.0]
    write_jsonl(tmp_path / "len_test.jsonl", [{"problem": "cat", "answer": "three", "task": "length"}])
    with pytest.raises(ValueError, match=r"len_test.jsonl:1: invalid literal for int\(\)"):
        load_problems(f"jsonl:{tmp_path}/len", "test")


def anagram_gold(answer):
    """A check that needs a dict, the answer as the jsonl file has it: the words that count."""
    if not (isinstance(answer, dict) and isinstance(answer.get("words"), list) and answer["words"]):
        raise ValueError(f'need {{"letters": ..., "words": [...]}}, got {answer!r}')
    return set(answer["words"])   # a set: a gold need not be JSON


def test_a_task_whose_check_needs_a_dict_gets_one_at_load_and_at_scoring(monkeypatch, tmp_path, tok):
    """One type for a ground truth: the check gets the answer as parsed from the file (here a dict)
    when the row is read, when load_rows checks it and when reward.score scores it."""
    seen = []
    monkeypatch.setitem(reward.TASKS, "anagram", reward.Task(
        instruction=lambda row: f"A word made of the letters {row['problem']}?" + reward.ANSWER_SUFFIX,
        check=lambda answer: seen.append(type(answer)) or anagram_gold(answer),
        extract=reward.extract_answer,
        judge=lambda answer, gold, timeout: float(answer in gold)))
    write_jsonl(tmp_path / "ana_test.jsonl", [
        {"problem": "t c a", "answer": {"letters": "tca", "words": ["cat", "act"]}, "task": "anagram"},
        {"problem": "o g d", "answer": {"letters": "ogd", "words": ["dog", "god"]}, "task": "anagram"}])
    rows = load_rows(f"jsonl:{tmp_path}/ana", "test", None, "plain", tok)
    assert rows[0]["ground_truth"] == {"letters": "tca", "words": ["cat", "act"]}
    completions = ["Answer: act", "Answer: cat", "Answer: tac", "Answer: god", "Answer: dog", "Answer: cat"]
    assert reward.score_rows(completions, [rows[0]] * 3 + [rows[1]] * 3) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert reward.score("anagram", ["Answer: god"], [rows[1]["ground_truth"]]) == [1.0]
    assert set(seen) == {dict}, seen   # the file's read, load_rows and every score call
    assert len(seen) == 2 + 2 + 6 + 1
    write_jsonl(tmp_path / "ana_test.jsonl", [{"problem": "t c a", "answer": "cat", "task": "anagram"}])
    with pytest.raises(ValueError, match=r"ana_test.jsonl:1: need \{\"letters\""):
        load_problems(f"jsonl:{tmp_path}/ana", "test")


# ----------------------------------------------------------------------------- math golds

def test_a_word_as_math_ground_truth_is_refused_naming_task_exact():
    # math-verify reads "tac" and "cat" both as the product a*c*t: this scored 1.0
    with pytest.raises(ValueError, match=r"math ground truth 'tac' is not a math expression.*task 'exact'"):
        reward.score("math", ["\\boxed{cat}"], ["tac"])
    for word in ["cat", "yes", "Evelyn", "2xy", "odd or even"]:
        with pytest.raises(ValueError, match="task 'exact'"):
            reward.TASKS["math"].check(word)


def test_real_math_ground_truths_pass_the_check():
    golds = ["56", "-3", 0.5, 34, "\\frac{1}{2}", "\\dfrac{3}{4}", "1/2", "2\\sqrt{2}", "\\sqrt[3]{2}",
             "x^2+2x+1", "(1, 2)", "[1, 2)", "(-\\infty, 3]", "\\{1,2\\}", "\\text{(A)}", "\\textbf{(C)}",
             "(C)", "E", "\\text{Evelyn}", "10\\%", "45^\\circ", "2\\pi", "\\frac{\\pi}{3}", "6 - 5i",
             "x \\in [-2, 7]", "y = 2x + 3", "\\sin x", "\\log_2 3", "$56$", "12\\text{ cm}", "1{,}000",
             "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "3 \\text{ or } 5", "x y", "\\mathbb{R}"]
    for g in golds:
        assert reward.TASKS["math"].check(g) == str(g).strip("$"), g


# ----------------------------------------------------------------------------- exact

def test_exact_scores_the_answer_line_case_sensitively():
    completions = ["Reversed:\nAnswer: tac", "\\boxed{tac}", "**Answer:** tac.", "Answer:  tac ", "Answer: cat",
                   "Answer: Tac", "tac", None, "Answer: t a c"]
    assert reward.score("exact", completions, [" tac "] * len(completions)) == \
        [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert reward.score("exact", ["Answer: New  York"], ["New York"]) == [1.0]  # whitespace runs are one space
    for bad in ["", "  ", None, 2.5, ["tac"]]:
        with pytest.raises(ValueError, match="exact ground truth"):
            reward.score("exact", ["Answer: tac"], [bad])


# ----------------------------------------------------------------------------- jsonl:PREFIX

def test_jsonl_prefix_reads_each_split_into_rows(tmp_path):
    spec = {"inputs": [""], "outputs": ["3"]}
    write_jsonl(tmp_path / "d_train.jsonl", [{"problem": "Reverse the word: cat", "answer": "tac", "task": "exact"},
                                             "",  # blank lines are skipped
                                             {"problem": "1+1?", "answer": "2", "task": "math", "id": "q7", "x": 1},
                                             {"problem": "Print 3.", "answer": spec, "task": "code"}])
    write_jsonl(tmp_path / "d_test.jsonl", [{"problem": "2+2?", "answer": 4, "task": "math"}])
    name = f"jsonl:{tmp_path}/d"
    rows = load_problems(name, "train")
    assert rows[:2] == [
        {"id": "train-1", "task": "exact", "problem": "Reverse the word: cat", "ground_truth": "tac", "source": name},
        {"id": "q7", "task": "math", "problem": "1+1?", "ground_truth": "2", "source": name}]
    assert rows[2]["ground_truth"] == spec and "standard input" in format_prompt(rows[2], "code")
    assert load_problems(name, "train", limit=1) == rows[:1]
    assert load_problems(name, "test") == [{"id": "test-1", "task": "math", "problem": "2+2?", "ground_truth": 4,
                                            "source": name}]


@pytest.mark.parametrize("line, error", [
    ('{"problem": "p", "answer": "a", "task": "exact"', r"bad JSON \(Expecting ',' delimiter, column 48\)"),
    ('["p", "a", "exact"]', r"need a JSON object"),
    ('{"problem": "p", "task": "exact"}', r"missing field 'answer'; each line needs 'problem', 'answer', 'task'"),
    ('{"problem": "p", "answer": "a", "task": "chess"}', f"unknown task 'chess'; registered tasks: {registered()}"),
    ('{"problem": "Reverse: cat", "answer": "tac", "task": "math"}', r"math ground truth 'tac'.*task 'exact'"),
    ('{"problem": "p", "answer": {"inputs": []}, "task": "code"}', r"malformed test spec"),
    ('{"problem": "", "answer": "a", "task": "exact"}', r"'problem' must be non-empty text"),
])
def test_jsonl_refuses_a_bad_line_naming_file_and_line(tmp_path, line, error):
    (tmp_path / "bad_train.jsonl").write_text('{"problem": "p", "answer": "a", "task": "exact"}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"bad_train\.jsonl:2: " + error):
        load_problems(f"jsonl:{tmp_path}/bad", "train")


def test_jsonl_missing_file_names_the_path_tried(tmp_path):
    (tmp_path / "d_train.jsonl").write_text('{"problem": "p", "answer": "a", "task": "exact"}\n')
    with pytest.raises(FileNotFoundError, match=f"no file {tmp_path}/d_test.jsonl"):
        load_problems(f"jsonl:{tmp_path}/d", "test")


def test_load_rows_refuses_an_unknown_task_from_any_source(tmp_path, tok):
    write_jsonl(tmp_path / "math_train.jsonl", [{"id": "m0", "task": "chess", "problem": "e4?", "ground_truth": "e5",
                                                 "source": "tiny-math"}])
    with pytest.raises(ValueError, match=f"tiny-math \\(train\\) row 'm0': unknown task 'chess'; registered tasks: "
                                         f"{registered()}"):
        load_rows("tiny-math", "train", str(tmp_path), "plain", tok)


# ----------------------------------------------------------------------------- the how-to

def test_howto_word_reversal_from_jsonl(tmp_path, monkeypatch, tok):
    """The README's "Add a task from a JSONL file" steps: write the files, load, score."""
    monkeypatch.chdir(tmp_path)  # the how-to's relative path, data/mytask/reverse
    words = {"train": ["cat", "dog", "star"], "test": ["stop", "time"]}
    for split, ws in words.items():
        write_jsonl(Path(f"data/mytask/reverse_{split}.jsonl"),
                    [{"problem": f"Reverse the word: {w}", "answer": w[::-1], "task": "exact"} for w in ws])
    train = load_rows("jsonl:data/mytask/reverse", "train", None, "plain", tok, max_prompt_tokens=208)
    test = load_rows("jsonl:data/mytask/reverse", "test", None, "plain", tok, max_prompt_tokens=208)
    assert [r["problem"] for r in train] == ["Reverse the word: cat", "Reverse the word: dog", "Reverse the word: star"]
    assert [r["ground_truth"] for r in test] == ["pots", "emit"] and train[0]["prompt_ids"]
    assert {r["source"] for r in train + test} == {"jsonl:data/mytask/reverse"}
    completions = ["Answer: tac", "\\boxed{god}", "Answer: star", "Answer: pots", "emit"]
    assert reward.score_rows(completions, train + test) == [1.0, 1.0, 0.0, 1.0, 0.0]
    # its second part: a task with its own reward, one registry entry (the how-to's, verbatim)
    monkeypatch.setitem(reward.TASKS, "exact_ci", reward.Task(
        instruction=lambda row: row["problem"] + reward.ANSWER_SUFFIX, check=reward._exact_gold,
        extract=reward.extract_answer,
        judge=lambda answer, gold, timeout: float(" ".join(answer.split()).lower() == gold.lower())))
    rows = [dict(r, task="exact_ci") for r in test]
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert format_prompt(rows[0], "chat", tok) == "Reverse the word: stop" + reward.ANSWER_SUFFIX
    assert reward.score_rows(["Answer: POTS", "Answer: Emit"], rows) == [1.0, 1.0]
    assert reward.score_rows(["Answer: POTS", "Answer: Emit"], test) == [0.0, 0.0]  # exact is case-sensitive
