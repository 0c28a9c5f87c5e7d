"""Data-set loaders and prompt templates: every data set becomes one list of plain rows.

    from data.loaders import load_problems, format_prompt
    rows = load_problems("dapo-math-17k", "train", data_dir="data/hub", limit=128)
    prompt = format_prompt(rows[0], "dapo")            # or "plain", "code", "chat" (+ tokenizer)

Each row is {"id", "task": "math" | "code", "problem", "ground_truth", "source": name}. For math
the ground truth is the answer string; for code it is a JSON test spec {"inputs": [...],
"outputs": [...]} plus "fn_name" for call-based problems (the APPS/TACO/PRIME format).

Fetch a hub set once (asking for a missing one prints the exact command), e.g.
    hf download math-ai/aime25 --repo-type dataset --include test.jsonl --local-dir data/hub/aime25

Choices:
1. Resolution order: `data_dir/<name>/` laid out as in the hub repo (default data_dir: the `hub`
   folder beside this file), else the hub itself, else FileNotFoundError with the fetch command.
   HF_HUB_OFFLINE=1 (or HF_DATASETS_OFFLINE=1) skips the hub try.
2. Hub files are read with the packaged parquet/json/arrow builders on `hf://datasets/...`
   paths rather than `load_dataset(repo)`: APPS and TACO still ship loading scripts, which
   `datasets` >= 4 refuses to run, and one code path serves local copies and the hub alike.
3. DAPO-Math-17k repeats each prompt ~100 times: we keep the first copy of each problem, in
   order, and cut DAPO's instruction off the problem so any template can be applied
   (the "dapo" template puts the same instruction back, word for word).
4. Eurus-2-RL-Data (PRIME) holds math and code: "eurus-code" keeps ability == "code" and cuts
   its "Write Python code ..." suffix off the last user turn (its system prompt is dropped).
5. Code sets are normalised to the one spec; TACO/APPS starter code is appended to the problem.
   CodeContests uses public + private + generated tests. Codeforces (open-r1) keeps stdio,
   non-interactive problems without a custom checker (exact-output judging would be wrong
   there). Rows with no tests, or no problem text, are dropped.
6. The math eval sets have only a "test" split (whatever the hub calls it), so they cannot be
   trained on by accident; an unknown split raises ValueError listing the ones there are.
"""
import json
import os
import re
from glob import glob
from pathlib import Path
from typing import Callable, NamedTuple

HERE = Path(__file__).resolve().parent
TINY_DIR = HERE / "tiny"  # written by data/prepare.py
HUB_DIR = HERE / "hub"    # where the fetch command puts hub copies

# DAPO's instruction, verbatim from the prompts of DAPO-Math-17k (also our "dapo" template).
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response "
               "should be of the form Answer: $Answer (without quotes) where $Answer is the "
               "answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
EURUS_CODE_SUFFIX = re.compile(r"\s*Write Python code to solve the problem\. Present the code in.*\Z", re.S)

# Instructions for base models; the fence is what the code reward extracts.
CODE_STDIN = ("{problem}\n\nWrite a Python 3 program that solves the problem above. It must read "
              "the input from standard input and print the answer to standard output. Give the "
              "complete program in a single ```python code block.")
CODE_CALL = ("{problem}\n\nWrite Python 3 code that solves the problem above by defining `{fn_name}` "
             "(keep the signature of the starter code if one is given); it is called on each test "
             "input and its return value is checked. Give the complete code in a single ```python "
             "code block.")
TEMPLATES = ("plain", "dapo", "code", "chat")


# ----------------------------------------------------------------------------- normalisers
# One small function per hub schema: (raw row, position) -> (id, problem, ground_truth), or None
# to drop the row.

def _spec(tests) -> str | None:
    """APPS/TACO/PRIME tests (dict or its JSON string) -> canonical JSON spec, None if no tests."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests) if tests.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(tests, dict) or not tests.get("inputs"):
        return None
    spec = {"inputs": list(tests["inputs"]), "outputs": list(tests.get("outputs") or [])}
    if tests.get("fn_name"):  # call-based: the model writes a function, not a program
        spec["fn_name"] = tests["fn_name"]
    return json.dumps(spec)


def _math(problem: str, answer: str, ident: str) -> Callable:
    """Plain math columns (AIME, MathArena); answers may be ints there, so everything goes to str."""
    return lambda r, i: (str(r.get(ident, i)), str(r[problem]).strip(), str(r[answer]).strip())


def _dapo(r, i):
    text = r["prompt"][0]["content"]  # one user turn: DAPO_PREFIX + problem + DAPO_SUFFIX
    problem = text.removeprefix(DAPO_PREFIX).removesuffix(DAPO_SUFFIX).strip()
    ident = str((r.get("extra_info") or {}).get("index", i))  # a uuid per problem
    return ident, problem, str(r["reward_model"]["ground_truth"]).strip()


def _eurus(r, i):
    if r["ability"] != "code":
        return None
    user = [m["content"] for m in r["prompt"] if m["role"] == "user"][-1]  # after PRIME's system turn
    ident = f'{r["data_source"]}-{(r.get("extra_info") or {}).get("index", i)}'
    return ident, EURUS_CODE_SUFFIX.sub("", user).strip(), _spec(r["reward_model"]["ground_truth"])


def _taco_apps(r, i):
    problem = r["question"].strip()
    if (r.get("starter_code") or "").strip():  # call-based problems name the function here
        problem += f"\n\nStarter code:\n```python\n{r['starter_code'].rstrip()}\n```"
    return str(r.get("problem_id", r.get("id", i))), problem, _spec(r["input_output"])


def _code_contests(r, i):
    tests = {"inputs": [], "outputs": []}
    for kind in ("public_tests", "private_tests", "generated_tests"):  # each {input: [], output: []}
        tests["inputs"] += (r.get(kind) or {}).get("input") or []
        tests["outputs"] += (r.get(kind) or {}).get("output") or []
    return r["name"], r["description"].strip(), _spec(tests)


def _codeforces(r, i):
    # interactive, file-I/O and checker-judged problems cannot be scored by exact stdout match
    if r.get("interaction_format") or r.get("generated_checker") or (r.get("input_mode") or "stdio") != "stdio":
        return None
    section = lambda head, key: [f"{head}\n{r[key]}"] if r.get(key) else []  # noqa: E731
    parts = [r["title"], r["description"], *section("Input", "input_format"),
             *section("Output", "output_format")]
    parts += [f"Example input:\n{e['input']}\nExample output:\n{e['output']}" for e in r.get("examples") or []]
    tests = r.get("official_tests") or []
    spec = _spec({"inputs": [t["input"] for t in tests], "outputs": [t["output"] for t in tests]})
    return r["id"], "\n\n".join(p.strip() for p in parts + section("Note", "note") if p), spec


# ----------------------------------------------------------------------------- the registry

class Hub(NamedTuple):
    repo: str        # hub data-set repo
    fmt: str         # packaged builder: parquet | json | arrow
    files: dict      # our split -> file glob inside the repo (the same inside data_dir/<name>/)
    task: str        # math | code
    normalise: Callable
    dedup: bool = False  # drop repeated problem texts, keeping the first


HUB = {
    # training sets (GPPO.md section 8)
    "dapo-math-17k": Hub("BytedTsinghua-SIA/DAPO-Math-17k", "parquet", {"train": "data/dapo-math-17k.parquet"},
                         "math", _dapo, dedup=True),
    "eurus-code": Hub("PRIME-RL/Eurus-2-RL-Data", "parquet",
                      {"train": "train.parquet", "validation": "validation.parquet"}, "code", _eurus),
    # math eval sets: problem + answer columns (the MathArena and H4 copies call their split "train")
    "aime24": Hub("HuggingFaceH4/aime_2024", "parquet", {"test": "data/train-*.parquet"}, "math",
                  _math("problem", "answer", "id")),
    "aime25": Hub("math-ai/aime25", "json", {"test": "test.jsonl"}, "math", _math("problem", "answer", "id")),
    "brumo25": Hub("MathArena/brumo_2025", "parquet", {"test": "data/train-*.parquet"}, "math",
                   _math("problem", "answer", "problem_idx")),
    "smt25": Hub("MathArena/smt_2025", "parquet", {"test": "data/train-*.parquet"}, "math",
                 _math("problem", "answer", "problem_idx")),
    # code eval sets, each converted to the spec (PRIME's held-out code rows from these sources are
    # an alternative: eurus-code, split "validation", ids prefixed by their source)
    "codeforces": Hub("open-r1/codeforces", "parquet",
                      {"train": "data/train-*.parquet", "test": "data/test-*.parquet"}, "code", _codeforces),
    "codecontests": Hub("deepmind/code_contests", "parquet", {"train": "data/train-*.parquet",
                        "validation": "data/valid-*.parquet", "test": "data/test-*.parquet"},
                        "code", _code_contests),
    "taco": Hub("BAAI/TACO", "arrow", {"train": "train/data-*.arrow", "test": "test/data-*.arrow"},
                "code", _taco_apps),
    "apps": Hub("codeparrot/apps", "json", {"train": "train.jsonl", "test": "test.jsonl"}, "code", _taco_apps),
}
TINY = {"tiny-math": "math", "tiny-code": "code"}
NAMES = (*TINY, *HUB)


# ----------------------------------------------------------------------------- loading

def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _load_tiny(name: str, split: str, data_dir: str | None) -> list[dict]:
    fname = f"{TINY[name]}_{split}.jsonl"
    # data_dir may be the tiny folder itself or its parent (one --data_dir shared with hub sets)
    dirs = [Path(data_dir), Path(data_dir) / "tiny"] if data_dir else [TINY_DIR]
    for d in dirs:
        if (d / fname).is_file():
            with open(d / fname) as f:
                return [json.loads(line) for line in f if line.strip()]
    raise FileNotFoundError(f"{fname} not found in {', '.join(map(str, dirs))}: run `python data/prepare.py`")


def _read_hub(name: str, split: str, data_dir: str | None):
    import datasets  # imported here so the tiny sets need no `datasets`

    hub = HUB[name]
    if split not in hub.files:
        raise ValueError(f"{name} has splits {list(hub.files)}, not {split!r}")
    pattern, root = hub.files[split], Path(data_dir) if data_dir else HUB_DIR
    local = root / name
    fetch = (f"{name} ({hub.repo}, split {split}) is not available. Fetch it with\n"
             f"  hf download {hub.repo} --repo-type dataset --include '{pattern}' "
             f"--local-dir {os.path.relpath(local)}\nand pass --data_dir {os.path.relpath(root)}")
    if local.is_dir():
        files = sorted(glob(str(local / pattern)))
        if not files:
            raise FileNotFoundError(f"{local} has no files matching {pattern!r}.\n{fetch}")
        return datasets.load_dataset(hub.fmt, data_files=files, split="train")  # "train" = all files given
    if _offline():
        raise FileNotFoundError(f"{fetch}\n(hub not tried: HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set)")
    try:
        return datasets.load_dataset(hub.fmt, data_files=f"hf://datasets/{hub.repo}/{pattern}", split="train")
    except Exception as e:  # offline, DNS, 404, gated...: all mean "fetch it yourself"
        raise FileNotFoundError(f"{fetch}\n(hub load failed: {type(e).__name__}: {e})") from e


def load_problems(name: str, split: str = "train", data_dir: str | None = None,
                  limit: int | None = None) -> list[dict]:
    """Rows {"id", "task", "problem", "ground_truth", "source"} of data set `name`, in file order."""
    if name in TINY:
        return _load_tiny(name, split, data_dir)[:limit]
    if name not in HUB:
        raise ValueError(f"unknown data set {name!r}; accepted: {', '.join(NAMES)}")
    hub, rows, seen = HUB[name], [], set()
    for i, raw in enumerate(_read_hub(name, split, data_dir)):
        if limit is not None and len(rows) >= limit:  # stop early: DAPO has 1.8M raw rows
            break
        out = hub.normalise(raw, i)
        if out is None or not out[1] or not out[2] or (hub.dedup and out[1] in seen):
            continue
        seen.add(out[1])
        rows.append({"id": out[0], "task": hub.task, "problem": out[1], "ground_truth": out[2], "source": name})
    return rows


# ----------------------------------------------------------------------------- prompts

def _instruction(row: dict) -> str:
    """The base-model instruction for a row: DAPO's for math, ours for code."""
    if row["task"] == "math":
        return DAPO_PREFIX + row["problem"] + DAPO_SUFFIX
    if row["task"] == "code":
        try:
            fn_name = json.loads(row["ground_truth"]).get("fn_name")
        except (ValueError, AttributeError):
            fn_name = None
        return (CODE_CALL.format(problem=row["problem"], fn_name=fn_name) if fn_name
                else CODE_STDIN.format(problem=row["problem"]))
    raise ValueError(f"unknown task {row['task']!r} in row {row.get('id')!r}")


def format_prompt(row: dict, template: str, tokenizer=None) -> str:
    """The prompt text for one row under `template` (see TEMPLATES)."""
    if template == "plain":  # the tiny embedded model was trained on bare problems
        return row["problem"]
    if template in ("dapo", "code"):
        want = "math" if template == "dapo" else "code"
        if row["task"] != want:
            raise ValueError(f"template {template!r} is for {want} rows, got a {row['task']} row")
        return _instruction(row)
    if template == "chat":
        if tokenizer is None:
            raise ValueError("template 'chat' needs a tokenizer (with a chat_template)")
        messages = [{"role": "user", "content": _instruction(row)}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    raise ValueError(f"unknown template {template!r}; accepted: {', '.join(TEMPLATES)}")
