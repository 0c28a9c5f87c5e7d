"""Loaders and templates on small local files in each hub data set's real schema and layout.

Run: .venv/bin/python -m pytest tests/test_loaders.py -q   (CPU, no network, a few seconds)
"""
import json
import sys
import time
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import loaders, rg
from data.loaders import DAPO_PREFIX, DAPO_SUFFIX, format_prompt, load_problems


def write_parquet(path: Path, rows: list[dict]):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_jsonl(path: Path, rows: list[dict]):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def verl_row(content, ability, ground_truth, index, system=None, source="x"):
    """A row in the verl/PRIME schema shared by DAPO-Math-17k and Eurus-2-RL-Data."""
    prompt = [{"content": system, "role": "system"}] if system else []
    prompt += [{"content": content, "role": "user"}]
    return {"data_source": source, "prompt": prompt, "ability": ability,
            "reward_model": {"ground_truth": ground_truth, "style": "rule"}, "extra_info": {"index": index}}


# ----------------------------------------------------------------------------- tiny sets

def test_tiny_reads_jsonl_from_data_dir(tmp_path):
    rows = [{"id": str(i), "task": "math", "problem": f"{i}+1=", "ground_truth": str(i + 1),
             "source": "tiny-math"} for i in range(3)]
    write_jsonl(tmp_path / "math_train.jsonl", rows)
    assert load_problems("tiny-math", "train", data_dir=str(tmp_path)) == rows
    assert load_problems("tiny-math", "train", data_dir=str(tmp_path), limit=2) == rows[:2]


def test_tiny_missing_says_run_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match="python data/prepare.py"):
        load_problems("tiny-code", "test", data_dir=str(tmp_path))


# ----------------------------------------------------------------------------- training sets

def test_dapo_dedups_in_order_and_strips_the_instruction(tmp_path):
    raw = [verl_row(DAPO_PREFIX + p + DAPO_SUFFIX, "MATH", a, f"uuid-{k}", source="math_dapo")
           for k, (p, a) in enumerate([("What is $1+1$?", "2"), ("Find $x$.", "34"), ("What is $1+1$?", "2"),
                                       ("Half of one?", "\\frac{1}{2}"), ("Find $x$.", "34")])]
    write_parquet(tmp_path / "dapo-math-17k" / "data" / "dapo-math-17k.parquet", raw)
    rows = load_problems("dapo-math-17k", data_dir=str(tmp_path))
    assert [r["problem"] for r in rows] == ["What is $1+1$?", "Find $x$.", "Half of one?"]
    assert [r["ground_truth"] for r in rows] == ["2", "34", "\\frac{1}{2}"]
    assert rows[0] == {"id": "uuid-0", "task": "math", "problem": "What is $1+1$?", "ground_truth": "2",
                       "source": "dapo-math-17k"}
    assert len(load_problems("dapo-math-17k", data_dir=str(tmp_path), limit=2)) == 2


def test_eurus_keeps_code_rows_and_their_spec(tmp_path):
    suffix = ("\n\nWrite Python code to solve the problem. Present the code in \n```python\nYour code\n```\n"
              "at the end.")
    fn_gt = json.dumps({"fn_name": "minFlips", "inputs": [["001"]], "outputs": [[1]]})
    raw = [verl_row("Find 1+1.\n\nPresent the answer in LaTex format: \\boxed{Your answer}", "math", "2", 0,
                    system="actions...", source="numina_olympiads"),
           verl_row("Flip bits of S." + suffix, "code", fn_gt, 1, system="actions...", source="taco"),
           verl_row("Print a+b." + suffix, "code", json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]}), 2,
                    source="codecontests")]
    write_parquet(tmp_path / "eurus-code" / "train.parquet", raw)
    rows = load_problems("eurus-code", "train", data_dir=str(tmp_path))
    assert [r["problem"] for r in rows] == ["Flip bits of S.", "Print a+b."]
    assert json.loads(rows[0]["ground_truth"]) == {"inputs": [["001"]], "outputs": [[1]], "fn_name": "minFlips"}
    assert json.loads(rows[1]["ground_truth"]) == {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    assert {r["task"] for r in rows} == {"code"} and rows[0]["id"] == "taco-1"


# ----------------------------------------------------------------------------- math eval sets

@pytest.mark.parametrize("name, relpath, raw", [
    ("aime24", "data/train-00000-of-00001.parquet",
     {"id": 60, "problem": " Find $n$. ", "solution": "...", "answer": "204", "url": "u", "year": "2024"}),
    ("aime25", "test.jsonl", {"problem": "Find $n$.", "answer": "70", "id": "0"}),
    ("brumo25", "data/train-00000-of-00001.parquet",
     {"problem_idx": 1, "problem": "Find $n$.", "answer": "\\frac{1}{2}", "problem_type": ["Algebra"]}),
    ("smt25", "data/train-00000-of-00001.parquet", {"problem_idx": 3, "problem": "Find $n$.", "answer": 12}),
])
def test_math_eval_sets(tmp_path, name, relpath, raw):
    (write_jsonl if relpath.endswith(".jsonl") else write_parquet)(tmp_path / name / relpath, [raw])
    [row] = load_problems(name, "test", data_dir=str(tmp_path))
    assert row["task"] == "math" and row["problem"] == "Find $n$." and row["source"] == name
    assert row["ground_truth"] == str(raw["answer"]) and row["id"] == str(raw.get("id", raw.get("problem_idx")))
    with pytest.raises(ValueError, match="splits"):  # no training on the test set by accident
        load_problems(name, "train", data_dir=str(tmp_path))


GSM8K = [{"question": " Natalia sold clips to 48 friends in April, and half as many in May. How many in all? ",
          "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72.\n#### 72"},
         {"question": "A house costs $1,000 and rises 23.4% a year. What is it worth?",
          "answer": "It is worth 1,000 + 234 = <<1000+234=1234>>1,234 dollars.\n#### 1,234"},
         {"question": "No final line here.", "answer": "The worked answer lost its last line."}]


def test_gsm8k_main_config_answer_after_hashes(tmp_path):
    """openai/gsm8k, config main: the number after "####", thousands separators out; the worked
    answer stays out of the row; a row without "####" is dropped; ids are row positions."""
    write_parquet(tmp_path / "gsm8k" / "main" / "train-00000-of-00001.parquet", GSM8K)
    write_parquet(tmp_path / "gsm8k" / "main" / "test-00000-of-00001.parquet", GSM8K[:1])
    rows = load_problems("gsm8k", "train", data_dir=str(tmp_path))
    assert rows == [{"id": "0", "task": "math", "problem": GSM8K[0]["question"].strip(), "ground_truth": "72",
                     "source": "gsm8k"},
                    {"id": "1", "task": "math", "problem": GSM8K[1]["question"], "ground_truth": "1234",
                     "source": "gsm8k"}]
    assert not any("<<" in v or "####" in v for r in rows for v in r.values())
    [test] = load_problems("gsm8k", "test", data_dir=str(tmp_path))
    assert test["ground_truth"] == "72" and test["problem"].startswith("Natalia")
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\]"):
        load_problems("gsm8k", "validation", data_dir=str(tmp_path))


def test_gsm8k_ground_truth_follows_the_last_hashes(tmp_path):
    """A worked answer that writes "####" before its final line: the ground truth is the number
    after the last one (data/loaders.py's _gsm8k), not the text after the first."""
    rows = [{"question": "Tom has 3 boxes of 6 pens. How many pens?",
             "answer": "Boxes #### pens: 3 * 6 = <<3*6=18>>18.\n#### 18"}]
    write_parquet(tmp_path / "gsm8k" / "main" / "train-00000-of-00001.parquet", rows)
    [row] = load_problems("gsm8k", "train", data_dir=str(tmp_path))
    assert row["ground_truth"] == "18", row["ground_truth"]


MATH500 = [{"problem": "Convert the point $(0,3)$ to polar coordinates.",
            "solution": "So $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$",
            "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
            "unique_id": "test/precalculus/807.json"},
           {"problem": "How many positive divisors does 196 have?", "solution": "There are $\\boxed{9}$.",
            "answer": "9", "subject": "Number Theory", "level": 3, "unique_id": "test/number_theory/572.json"}]


def test_math500_jsonl_answer_column(tmp_path):
    write_jsonl(tmp_path / "math-500" / "test.jsonl", MATH500)
    rows = load_problems("math-500", "test", data_dir=str(tmp_path))
    assert [r["id"] for r in rows] == ["test/precalculus/807.json", "test/number_theory/572.json"]
    assert [r["ground_truth"] for r in rows] == [MATH500[0]["answer"], "9"]
    assert rows[1] == {"id": "test/number_theory/572.json", "task": "math", "source": "math-500",
                       "problem": "How many positive divisors does 196 have?", "ground_truth": "9"}
    with pytest.raises(ValueError, match="splits"):  # an eval set: no train split
        load_problems("math-500", "train", data_dir=str(tmp_path))


def hendrycks_row(problem, solution, kind="Algebra"):
    return {"problem": problem, "level": "Level 3", "type": kind, "solution": solution}


def test_hendrycks_math_final_boxed_answer(tmp_path):
    """EleutherAI/hendrycks_math: one folder per subject; the answer is the solution's final boxed
    answer, nested braces kept, boxes in a row joined; rows without one, or with a bare word, are
    dropped."""
    algebra = [hendrycks_row("Simplify.", "First $\\boxed{2}$, then $x = \\boxed{\\frac{1}{\\sqrt{2}}}$."),
               hendrycks_row("No box.", "The answer is 5."),
               hendrycks_row("Odd or even?", "It is $\\boxed{odd}$."),  # math-verify: o*d*d
               hendrycks_row("Name her.", "So $\\boxed{\\text{Evelyn}}$ wins."),
               hendrycks_row("Solve.", "So $x$ is $\\boxed{3}$ or $\\boxed{\\frac{2}{5}}$."),
               hendrycks_row("Primes?", "They are $\\boxed{2}, \\boxed{5}, \\boxed{13}$."),
               hendrycks_row("Enter one focus, not both.", "$\\boxed{(10, 0)}$ and $\\boxed{(0,0)}.$")]
    geometry = [hendrycks_row(" Area? ", "Area $= \\fbox{12\\pi}$", "Geometry")]
    write_parquet(tmp_path / "hendrycks-math" / "algebra" / "train-00000-of-00001.parquet", algebra)
    write_parquet(tmp_path / "hendrycks-math" / "geometry" / "train-00000-of-00001.parquet", geometry)
    write_parquet(tmp_path / "hendrycks-math" / "geometry" / "test-00000-of-00001.parquet", geometry)
    rows = load_problems("hendrycks-math", "train", data_dir=str(tmp_path))
    assert [(r["id"], r["ground_truth"]) for r in rows] == [
        ("0", "\\frac{1}{\\sqrt{2}}"), ("3", "\\text{Evelyn}"), ("4", "3, \\frac{2}{5}"),
        ("5", "2, 5, 13"), ("6", "(0,0)"), ("7", "12\\pi")]
    assert rows[-1]["problem"] == "Area?" and {r["task"] for r in rows} == {"math"}
    assert [r["ground_truth"] for r in load_problems("hendrycks-math", "test", data_dir=str(tmp_path))] == [
        "12\\pi"]
    import reward  # a perfect answer to a several-box problem scores 1, the last box alone 0
    assert reward.score("math", ["Answer: 13, 2, 5", "Answer: 13", "Answer: (0, 0)"],
                        [rows[3]["ground_truth"]] * 2 + [rows[4]["ground_truth"]]) == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("name, relpath, rows", [
    ("gsm8k", "main/test-00000-of-00001.parquet", GSM8K[:1]),
    ("math-500", "test.jsonl", [dict(MATH500[0], answer="72")]),
    ("hendrycks-math", "algebra/test-00000-of-00001.parquet", [hendrycks_row("P.", "$\\boxed{72}$")]),
])
def test_new_math_sets_score_through_the_math_judge(tmp_path, name, relpath, rows):
    """One row of each through reward.py's math task: a right boxed answer 1.0, a wrong one 0.0,
    under the chat template the lora preset uses (the math instruction as one user turn)."""
    import reward
    (write_jsonl if relpath.endswith(".jsonl") else write_parquet)(tmp_path / name / relpath, rows)
    [row] = load_problems(name, "test", data_dir=str(tmp_path))
    assert row["task"] == "math" and row["ground_truth"] == "72"
    assert reward.score("math", ["So \\boxed{72}.", "So \\boxed{71}."], [row["ground_truth"]] * 2) == [1.0, 0.0]
    prompt = format_prompt(row, "chat", chat_tokenizer())
    assert prompt == f"<|user|>{format_prompt(row, 'dapo')}<|end|><|assistant|>"


# ----------------------------------------------------------------------------- code eval sets

def apps_taco_rows():
    return [{"question": "Add two numbers.", "starter_code": "", "difficulty": "EASY",
             "input_output": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})},
            {"question": "Reverse a list.", "starter_code": "class Solution:\n    def rev(self, a):\n",
             "difficulty": "EASY", "input_output": json.dumps({"fn_name": "rev", "inputs": [[[1, 2]]],
                                                               "outputs": [[[2, 1]]]})},
            {"question": "No tests here.", "starter_code": "", "difficulty": "EASY", "input_output": ""}]


def check_apps_taco(rows):
    assert len(rows) == 2  # the row without tests is dropped
    assert json.loads(rows[0]["ground_truth"]) == {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    assert json.loads(rows[1]["ground_truth"]) == {"inputs": [[[1, 2]]], "outputs": [[[2, 1]]],
                                                   "fn_name": "rev"}
    assert rows[0]["problem"] == "Add two numbers."
    assert rows[1]["problem"].startswith("Reverse a list.\n\nStarter code:\n```python\nclass Solution:")


def test_taco_arrow_converts_input_output(tmp_path):
    # the hub copy is `save_to_disk` output: test/data-00000-of-00001.arrow (an Arrow stream)
    datasets.Dataset.from_list(apps_taco_rows()).save_to_disk(str(tmp_path / "taco" / "test"))
    rows = load_problems("taco", "test", data_dir=str(tmp_path))
    check_apps_taco(rows)
    assert rows[0]["id"] == "0"


def test_apps_jsonl_converts_input_output(tmp_path):
    raw = [dict(r, problem_id=4000 + k, solutions="[]", url="u") for k, r in enumerate(apps_taco_rows())]
    write_jsonl(tmp_path / "apps" / "test.jsonl", raw)
    rows = load_problems("apps", "test", data_dir=str(tmp_path))
    check_apps_taco(rows)
    assert rows[1]["id"] == "4001"


def test_code_contests_merges_public_private_generated(tmp_path):
    tests = lambda i, o: {"input": i, "output": o}  # noqa: E731
    raw = [{"name": "1548_E. Painters", "description": "Paint it.", "source": 2, "difficulty": 11,
            "public_tests": tests(["1\n"], ["2\n"]), "private_tests": tests(["2\n"], ["3\n"]),
            "generated_tests": tests(["3\n", "4\n"], ["4\n", "5\n"])},
           {"name": "empty", "description": "No tests.", "source": 2, "difficulty": 7,
            "public_tests": tests([], []), "private_tests": tests([], []), "generated_tests": tests([], [])}]
    write_parquet(tmp_path / "codecontests" / "data" / "test-00000-of-00001-9c49eeff30aacaa8.parquet", raw)
    [row] = load_problems("codecontests", "test", data_dir=str(tmp_path))
    assert row["id"] == "1548_E. Painters" and row["problem"] == "Paint it."
    assert json.loads(row["ground_truth"]) == {"inputs": ["1\n", "2\n", "3\n", "4\n"],
                                               "outputs": ["2\n", "3\n", "4\n", "5\n"]}


def test_codeforces_keeps_judgeable_stdio_problems(tmp_path):
    base = {"title": "A. Sum", "description": "Add.", "input_format": "Two ints.", "output_format": "One int.",
            "interaction_format": None, "note": "Easy.", "examples": [{"input": "1 2\n", "output": "3\n"}],
            "official_tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}],
            "generated_checker": None, "input_mode": "stdio", "executable": True, "rating": 800}
    raw = [dict(base, id="1A"), dict(base, id="2B", interaction_format="Interact."),
           dict(base, id="3C", generated_checker="def check(): ..."), dict(base, id="4D", input_mode="file")]
    write_parquet(tmp_path / "codeforces" / "data" / "test-00000-of-00001.parquet", raw)
    [row] = load_problems("codeforces", "test", data_dir=str(tmp_path))
    assert row["id"] == "1A" and row["problem"].startswith("A. Sum\n\nAdd.\n\nInput\nTwo ints.")
    assert "Example input:\n1 2\n" in row["problem"] and row["problem"].endswith("Note\nEasy.")
    assert json.loads(row["ground_truth"]) == {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}


# ----------------------------------------------------------------------------- failures

def test_missing_set_offline_names_the_fetch_command_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    with pytest.raises(FileNotFoundError) as e:
        load_problems("dapo-math-17k", data_dir=str(tmp_path))
    assert time.time() - t0 < 10
    msg = str(e.value)
    assert "BytedTsinghua-SIA/DAPO-Math-17k" in msg and "dapo-math-17k" in msg
    assert "hf download BytedTsinghua-SIA/DAPO-Math-17k --repo-type dataset" in msg and "--data_dir" in msg


def test_missing_set_hub_failure_becomes_file_not_found(tmp_path, monkeypatch):
    # a failing hub (no network here, or a 404) must surface as the same actionable error
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)

    def no_hub(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub")
    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    with pytest.raises(FileNotFoundError, match="hf download BAAI/TACO --repo-type dataset --include 'test/"):
        load_problems("taco", "test", data_dir=str(tmp_path))


@pytest.mark.parametrize("name, repo, split, pattern", [
    ("gsm8k", "openai/gsm8k", "train", "main/train-*.parquet"),
    ("math-500", "HuggingFaceH4/MATH-500", "test", "test.jsonl"),
    ("hendrycks-math", "EleutherAI/hendrycks_math", "train", "*/train-*.parquet"),
])
def test_missing_new_math_set_prints_its_fetch_command(tmp_path, monkeypatch, name, repo, split, pattern):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as e:
        load_problems(name, split, data_dir=str(tmp_path))
    msg = str(e.value)
    assert f"hf download {repo} --repo-type dataset --include '{pattern}' --local-dir " in msg
    assert f"{tmp_path.name}/{name}" in msg and "--data_dir" in msg and "hub not tried" in msg


def test_local_folder_without_matching_files(tmp_path):
    (tmp_path / "aime25").mkdir()
    with pytest.raises(FileNotFoundError, match="test.jsonl"):
        load_problems("aime25", "test", data_dir=str(tmp_path))


def test_unknown_name_lists_accepted_names():
    with pytest.raises(ValueError, match="dapo-math-17k.*gsm8k.*math-500.*apps"):
        load_problems("gsm8k-platinum")


# ----------------------------------------------------------------------------- templates

MATH = {"id": "0", "task": "math", "problem": "What is $\\{1\\}$?", "ground_truth": "1", "source": "t"}
CODE = {"id": "1", "task": "code", "problem": "Print 3.", "source": "t",
        "ground_truth": json.dumps({"inputs": [""], "outputs": ["3"]})}
CALL = dict(CODE, ground_truth=json.dumps({"inputs": [[1]], "outputs": [2], "fn_name": "inc"}))


def test_plain_and_dapo_templates():
    assert format_prompt(MATH, "plain") == MATH["problem"]
    assert format_prompt(MATH, "dapo") == (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is $\\{1\\}$?\n\n"
        "Remember to put your answer on its own line after \"Answer:\".")
    with pytest.raises(ValueError, match="math"):
        format_prompt(CODE, "dapo")


def test_code_template_stdin_or_function():
    stdin, call = format_prompt(CODE, "code"), format_prompt(CALL, "code")
    assert stdin.startswith("Print 3.\n\n") and "standard input" in stdin and "```python" in stdin
    assert "`inc`" in call and "standard input" not in call
    with pytest.raises(ValueError, match="code"):
        format_prompt(MATH, "code")


def test_unknown_template_and_chat_without_tokenizer():
    with pytest.raises(ValueError, match="'fancy'.*plain, dapo, code, chat, fewshot"):
        format_prompt(MATH, "fancy")
    with pytest.raises(ValueError, match="tokenizer"):
        format_prompt(MATH, "chat")


def chat_tokenizer():
    """A real tokenizer with a small chat template: <|role|>content<|end|> per turn."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tokenizer


def test_chat_template_with_a_real_local_tokenizer():
    tokenizer = chat_tokenizer()
    for row, base in ((MATH, "dapo"), (CALL, "code")):  # the base instruction, wrapped as one user turn
        assert format_prompt(row, "chat", tokenizer) == f"<|user|>{format_prompt(row, base)}<|end|><|assistant|>"


def test_every_registered_set_has_a_split_and_a_known_builder():
    for name, hub in loaders.HUB.items():
        assert hub.files and hub.fmt in ("parquet", "json", "arrow") and hub.task in ("math", "code"), name


# ----------------------------------------------------------------------------- reasoning-gym

RG = "rg:chain_sum?min_terms=2&max_terms=2&min_digits=2&max_digits=2&size=60&test_size=30"


def test_rg_rows_schema_sizes_and_ground_truth():
    train, test = load_problems(RG, "train"), load_problems(RG, "test")
    assert len(test) == 30 and 60 - loaders.RG_SHOTS <= len(train) <= 60  # the shots are withheld
    for split, rows in (("train", train), ("test", test)):
        assert len({r["id"] for r in rows}) == len(rows) and rows[0]["id"] == f"chain_sum-{split}-0"
        for r in rows:
            assert {k: r[k] for k in ("task", "source")} == {"task": "rg", "source": RG}
            gt = json.loads(r["ground_truth"])  # what reward.py's checker needs
            assert gt["dataset"] == "chain_sum" and gt["entry"]["question"] == r["problem"]
            assert gt["config"] == {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}
            assert len(gt["entry"]["metadata"]["expression"].split()) == 3  # "42 - 25": 2 two-digit terms
    assert len(load_problems(RG, "test", limit=7)) == 7


def test_rg_splits_are_disjoint_and_deterministic():
    train, test = load_problems(RG, "train"), load_problems(RG, "test")
    shots = {s["problem"] for s in test[0]["shots"]}
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    assert not shots & ({r["problem"] for r in train} | {r["problem"] for r in test})
    assert len({r["problem"] for r in test}) == len(test)  # no repeats in the held-out set
    rg._splits.cache_clear()  # generated again, not served from the cache
    assert load_problems(RG, "train") == train and load_problems(RG, "test") == test
    other = load_problems(RG + "&seed=1", "test")
    assert [r["problem"] for r in other] != [r["problem"] for r in test]


def test_rg_small_problem_space_keeps_test_disjoint_or_says_so():
    # one-digit sums: 200 distinct problems; the test split takes what train leaves over
    small = "rg:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=1&size=100&test_size=50"
    train, test = load_problems(small, "train"), load_problems(small, "test")
    assert len(test) == 50 and not {r["problem"] for r in train} & {r["problem"] for r in test}
    with pytest.raises(ValueError, match="too few distinct problems"):
        load_problems("rg:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=1&size=5000", "test")


def test_rg_bad_names_and_options_say_what_exists():
    with pytest.raises(ValueError, match="chain_sum.*products"):  # the registry's names, listed
        load_problems("rg:chain_sums", "train")
    with pytest.raises(ValueError, match="'digits=2'.*min_digits"):
        load_problems("rg:chain_sum?digits=2", "train")
    with pytest.raises(ValueError, match="refused config"):  # reasoning-gym's own validation
        load_problems("rg:chain_sum?min_terms=0", "train")
    with pytest.raises(ValueError, match="splits"):
        load_problems(RG, "validation")
    with pytest.raises(ValueError, match="cannot be served"):  # grid answers, tuples lost in JSON
        load_problems("rg:arc_agi?size=20&test_size=2", "train")


def test_rg_missing_package_names_the_install_command(monkeypatch):
    for module in ("reasoning_gym", "reasoning_gym.factory"):  # imports fail as if not installed
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ModuleNotFoundError, match="pip install reasoning-gym==0.1.25"):
        load_problems("rg:chain_sum", "train")


def test_fewshot_template_takes_its_shots_from_train():
    tokenizer, test = chat_tokenizer(), load_problems(RG, "test")
    shots = test[0]["shots"]
    assert len(shots) == loaders.RG_SHOTS and all(s is shots for s in (r["shots"] for r in test))
    turns = "".join(f"<|user|>{s['problem']}<|end|><|assistant|>Answer: {s['answer']}<|end|>"
                    for s in shots[:2])
    want = f"{turns}<|user|>{test[3]['problem']}<|end|><|assistant|>"
    assert format_prompt(test[3], "fewshot", tokenizer) == want
    assert format_prompt(test[3], "fewshot:5", tokenizer).count("Answer: ") == 5
    # the shots are train-split problems: generated by the train seed, withheld from the train rows
    train_seed = rg._parse(RG)[2]
    import reasoning_gym
    made = {e["question"] for e in reasoning_gym.create_dataset(
        "chain_sum", min_terms=2, max_terms=2, min_digits=2, max_digits=2, seed=train_seed, size=60)}
    assert {s["problem"] for s in shots} <= made
    assert not {s["problem"] for s in shots} & {r["problem"] for r in test}
    # the shots' answer line is exactly what reward.py extracts
    import reward
    assert all(reward.extract_answer(f"Answer: {s['answer']}") == s["answer"] for s in shots)


def test_fewshot_template_refuses_rows_without_enough_shots():
    tokenizer, row = chat_tokenizer(), load_problems(RG, "test")[0]
    with pytest.raises(ValueError, match="shots"):
        format_prompt(MATH, "fewshot", tokenizer)
    with pytest.raises(ValueError, match="at least 99 shots"):
        format_prompt(row, "fewshot:99", tokenizer)
    with pytest.raises(ValueError, match="tokenizer"):
        format_prompt(row, "fewshot")
    want = f"<|user|>{row['problem']}{loaders.reward.ANSWER_SUFFIX}<|end|><|assistant|>"  # zero-shot: the instruction
    assert format_prompt(row, "chat", tokenizer) == want


# ----------------------------------------------------------------------------- code tasks from jsonl:

README = Path(__file__).resolve().parents[1] / "README.md"
PROGRAM = "```python\nn = int(input())\nprint(n * n)\n```"     # right for the stdin/stdout row
FUNCTION = "```python\ndef square(x):\n    return x * x\n```"  # right for the call-style row


def readme_heredoc(target):
    """What README.md's `cat > TARGET <<'EOF'` writes: the doc's own rows, so doc and test agree."""
    lines = README.read_text().splitlines()
    start = lines.index(f"cat > {target} <<'EOF'") + 1
    return "\n".join(lines[start:lines.index("EOF", start)]) + "\n"


def test_readme_code_rows_load_and_score(tmp_path, monkeypatch):
    """README's JSONL how-to, "Code tasks": its stdin/stdout row and its call-style row load through
    jsonl: and score a correct program 1.0 and a wrong one 0.0 in the real sandbox; each form's
    right answer scores 0 on the other form's row (what a missing fn_name does to a function)."""
    import reward
    monkeypatch.chdir(tmp_path)
    path = Path("data/mytask/square_train.jsonl")
    path.parent.mkdir(parents=True)
    path.write_text(readme_heredoc(str(path)))
    stdin_row, call_row = load_problems("jsonl:data/mytask/square", "train")
    assert "fn_name" not in stdin_row["ground_truth"]           # the spec as the file has it
    assert call_row["ground_truth"]["fn_name"] == "square"
    assert "standard input" in format_prompt(stdin_row, "code") and "`square`" in format_prompt(call_row, "code")
    wrong_program, wrong_function = "print(int(input()) * 2)", "def square(x):\n    return x + x"
    completions = [PROGRAM, wrong_program, FUNCTION, wrong_function, FUNCTION, PROGRAM]
    rows = [stdin_row, stdin_row, call_row, call_row, stdin_row, call_row]
    assert reward.score_rows(completions, rows) == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("answer, error", [
    ({"inputs": [[3], [-4]], "outputs": [9, 16]},
     r'inputs are lists of arguments \(input 1 is \[3\]\) but no fn_name: add "fn_name": .*or give stdin strings'),
    (json.dumps({"inputs": [["3\n"]], "outputs": ["9\n"]}),           # a spec given as JSON text
     r'inputs are lists of arguments \(input 1 is \["3\\n"\]\) but no fn_name'),
    ({"fn_name": "square", "inputs": ["3", "-4"], "outputs": [9, 16]},
     r'fn_name "square" but input 1 is "3", not a list of arguments: .*\(\["3"\] for one argument\), '
     r"or drop fn_name and give stdin strings"),
    ({"fn_name": "square", "inputs": [[3], -4], "outputs": [9, 16]}, r'fn_name "square" but input 2 is -4, not a list'),
    ({"inputs": [3, -4], "outputs": [9, 16]},
     r'input 1 is 3, not stdin text: give a string \(e.g. "3\\n"\), or add "fn_name"'),
])
def test_jsonl_refuses_a_code_spec_in_neither_form(tmp_path, answer, error):
    """A code spec that is neither stdin/stdout (string inputs) nor call-style (fn_name, list
    inputs) is refused at load time, naming file, line and the fix."""
    ok = {"problem": "Print 3.", "answer": {"inputs": [""], "outputs": ["3"]}, "task": "code"}
    write_jsonl(tmp_path / "sq_train.jsonl", [ok, {"problem": "Square x.", "answer": answer, "task": "code"}])
    with pytest.raises(ValueError, match=rf"sq_train\.jsonl:2: {error}"):
        load_problems(f"jsonl:{tmp_path}/sq", "train")


@pytest.mark.parametrize("stdin, shown", [({"n": 3}, '{"n": 3}'), (None, "null"), (True, "true")])
def test_jsonl_refuses_stdin_that_is_an_object_null_or_a_boolean(tmp_path, stdin, shown):
    """A stdin/stdout spec whose input is a JSON object, null or a boolean is refused at load time,
    naming file, line, the value as written and what is accepted: the judge would feed the program
    Python's text of it ("None", "True"), which no correct program reads."""
    spec = {"inputs": ["3", stdin], "outputs": ["9", "16"]}
    write_jsonl(tmp_path / "sq_train.jsonl", [{"problem": "Square n.", "answer": spec, "task": "code"}])
    with pytest.raises(ValueError) as e:
        load_problems(f"jsonl:{tmp_path}/sq", "train")
    assert str(e.value) == (f"{tmp_path}/sq_train.jsonl:1: input 2 is {shown}, not stdin text: give "
                            "a string (the program's standard input), or add \"fn_name\" and give "
                            "each input as a list of arguments")


def test_a_call_spec_without_fn_name_scores_a_right_function_0():
    """Why the first refusal above: the judge reads such a spec as stdin/stdout and runs the
    function as a program, so a correct function scores 0.0 (and 1.0 once fn_name is there)."""
    import reward
    spec = {"inputs": [[3], [-4]], "outputs": [9, 16]}
    assert reward.score("code", [FUNCTION, FUNCTION], [spec, dict(spec, fn_name="square")]) == [0.0, 1.0]
