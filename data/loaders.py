"""Data-set loaders and prompt templates: every data set becomes one list of plain rows.

    from data.loaders import load_problems, format_prompt
    rows = load_problems("dapo-math-17k", "train", data_dir="data/hub", limit=128)
    prompt = format_prompt(rows[0], "dapo")            # or "plain", "code", "chat" (+ tokenizer)
    rows = load_problems("rg:chain_sum?min_digits=2&max_digits=2", "test")   # reasoning-gym
    prompt = format_prompt(rows[0], "fewshot", tokenizer)                    # or "fewshot:4"
    rows = load_problems("jsonl:data/mytask/reverse", "train")  # your own: data/mytask/reverse_train.jsonl

Each row is {"id", "task", "problem", "ground_truth", "source": name}, "task" a name in reward.TASKS
("math", "code", "rg", "exact"), which defines the task's instruction and reward. For math the
ground truth is the answer string; for code it is a JSON test spec {"inputs": [...],
"outputs": [...]} plus "fn_name" for call-based problems (the APPS/TACO/PRIME format); for
reasoning-gym it is JSON {"dataset", "config", "entry"}, what reward.py needs to run the data
set's own checker. reasoning-gym rows also carry "shots" for the "fewshot" template.

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
7. reasoning-gym sets are generated, not fetched, by data/rg.py: `rg:<name>[?key=value&...]`, the
   keys the data set's config fields plus `seed`, `size` and `test_size`; its docstring says how
   the train and test splits are kept disjoint and when it returns fewer test problems.
8. Few-shot ("fewshot", "fewshot:k", default k = 2): ChatML turns, each shot a train problem as
   the user turn and "Answer: <answer>" as the assistant turn (exactly the line reward.py
   extracts), then the real problem. The shots are the pool of RG_SHOTS train problems that every
   rg: row, train or test, carries in row["shots"], withheld from the train rows (data/rg.py's
   RG_SHOTS: a training problem never has its answer in its own prompt). SmolLM2's chat template
   adds its default system prompt ("You are a helpful AI assistant named SmolLM, trained by
   Hugging Face") when none is given; we keep it: the model was tuned with it.
9. Your own data: `jsonl:PREFIX` reads split S from the file PREFIX_S.jsonl (relative to the working
   directory; --data_dir does not apply), one JSON object a line with "problem", "answer" and
   "task" (and optionally "id"; other fields are ignored). Each answer passes its task's check
   (reward.TASKS) as it is read, and a code spec must be one of the two forms reward.py judges
   (_check_code_form); a missing file, bad JSON, a missing field, an unknown task or a bad answer is
   refused naming the file and line. The answer is kept as JSON parsed it (a str, number, list or
   dict) in row["ground_truth"]: the task's check gets that same value here, in load_rows and in
   reward.score (reward.Task). The tiny sets stay a case of their own: data/prepare.py writes them
   already in the row schema, and --data_dir finds them beside the tiny model.
10. Answers inside a worked solution: GSM8K's answer text ends with a line "#### 72"; the ground
   truth is what follows the last "####", thousands separators out ("1,234" -> "1234"), and the
   worked solution stays out of the row. MATH (hendrycks-math) has no answer column: the ground
   truth is the final boxed answer of the solution (_hendrycks_math says which). MATH-500 is a
   subset of MATH's test split, never of its train.
"""
import json
import os
import random
import re
from glob import glob
from pathlib import Path
from typing import Callable, NamedTuple

import reward  # the task registry (the repo root is on sys.path: the scripts run from it)
from data.rg import RG_SHOTS, load_rg  # reasoning-gym sets (rg:NAME), generated there
from reward import DAPO_PREFIX, DAPO_SUFFIX  # a task's prompt text lives with its reward

HERE = Path(__file__).resolve().parent
TINY_DIR = HERE / "tiny"  # written by data/prepare.py
TINY_RARE_DIR = HERE / "tiny_rare"  # written by data/prepare.py --variant rare
HUB_DIR = HERE / "hub"    # where the fetch command puts hub copies

EURUS_CODE_SUFFIX = re.compile(r"\s*Write Python code to solve the problem\. Present the code in.*\Z", re.S)
TEMPLATES = ("plain", "dapo", "code", "chat", "fewshot[:k]")
JSONL_FIELDS = ("problem", "answer", "task")  # what each line of a jsonl:PREFIX file needs (choice 9)


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


def _gsm8k(r, i):
    """GSM8K: the number after the answer's last "####", commas out; None if there is none."""
    _, sep, final = r["answer"].rpartition("####")
    return (str(i), r["question"].strip(), final.strip().replace(",", "")) if sep else None


def _hendrycks_math(r, i):
    """MATH (choice 10): the answer is the solution's final boxed answer (reward.final_boxed, the
    parser that reads completions): its last \\boxed{...} (or \\fbox{...}), braces balanced, with
    the boxes just before it that only punctuation, "and"/"or" or spacing separate from it, joined
    by ", " ("\\boxed{2}, \\boxed{5}, \\boxed{13}" is "2, 5, 13"; the MATH authors' grader took the
    last box alone, which no answer can match). A problem that asks for one of two ("Enter only one
    of the foci, not both") keeps the last box: its solution boxes both and either is right. On
    MATH-500, where H4 ships both, it equals the "answer" column on 499 of 500 rows; the 500th
    (number_theory/459) boxes one value in two forms, "15\\frac{39}{40}, \\frac{639}{40}", which
    either form matches. A solution without one, or whose answer the math task refuses (a bare
    word, which math-verify would read as a product of variables: reward._math_gold), is dropped."""
    found = reward.final_boxed(r["solution"])
    if found and re.search(r"\bnot both\b", r["problem"]):
        # "Enter only one of the foci, not both": the solution boxes both and either is right;
        # joined, neither alone would match, so the last box is the answer (as it was before)
        found = found[0], reward.boxed_answers(r["solution"])[-1][2]
    try:
        reward.get_task("math").check(found and found[1])
    except ValueError:
        return None
    return str(i), r["problem"].strip(), found[1]


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
    # training sets (the paper (arXiv 2610.13015) section 4.1)
    "dapo-math-17k": Hub("BytedTsinghua-SIA/DAPO-Math-17k", "parquet", {"train": "data/dapo-math-17k.parquet"},
                         "math", _dapo, dedup=True),
    "eurus-code": Hub("PRIME-RL/Eurus-2-RL-Data", "parquet",
                      {"train": "train.parquet", "validation": "validation.parquet"}, "code", _eurus),
    # GSM8K ("main" config) and MATH (all seven subjects; its test split holds MATH-500): choice 10
    "gsm8k": Hub("openai/gsm8k", "parquet",
                 {"train": "main/train-*.parquet", "test": "main/test-*.parquet"}, "math", _gsm8k),
    "hendrycks-math": Hub("EleutherAI/hendrycks_math", "parquet",
                          {"train": "*/train-*.parquet", "test": "*/test-*.parquet"}, "math",
                          _hendrycks_math),
    # math eval sets: problem + answer columns (the MathArena and H4 copies call their split "train")
    "aime24": Hub("HuggingFaceH4/aime_2024", "parquet", {"test": "data/train-*.parquet"}, "math",
                  _math("problem", "answer", "id")),
    "aime25": Hub("math-ai/aime25", "json", {"test": "test.jsonl"}, "math", _math("problem", "answer", "id")),
    "math-500": Hub("HuggingFaceH4/MATH-500", "json", {"test": "test.jsonl"}, "math",
                    _math("problem", "answer", "unique_id")),
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
# the embedded sets -> their file prefix (data/prepare.py; tiny-rare-math: --variant rare, in data/tiny_rare)
TINY = {"tiny-math": "math", "tiny-code": "code", "tiny-rare-math": "rare_math"}
NAMES = (*TINY, *HUB)


# ----------------------------------------------------------------------------- loading

def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line; ValueError naming file and line otherwise."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line.rstrip("\n"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: bad JSON ({e.msg}, column {e.colno}): "
                                 f"{line.strip()[:100]!r}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: need a JSON object, got {line.strip()[:100]!r}")
            out.append((n, obj))
    return out


def _load_tiny(name: str, split: str, data_dir: str | None) -> list[dict]:
    fname = f"{TINY[name]}_{split}.jsonl"
    # data_dir may be the tiny folder itself or its parent (one --data_dir shared with hub sets)
    dirs = [Path(data_dir), Path(data_dir) / "tiny", Path(data_dir) / "tiny_rare"] if data_dir else \
        [TINY_DIR, TINY_RARE_DIR]
    for d in dirs:
        if (d / fname).is_file():
            return [row for _, row in _read_jsonl(d / fname)]
    build = "python data/prepare.py" + (" --variant rare" if fname.startswith("rare_") else "")
    raise FileNotFoundError(f"{fname} not found in {', '.join(map(str, dirs))}: run `{build}`")


def _check_code_form(spec: dict):
    """A jsonl: code spec (choice 9) must be one of the two forms reward.py judges: stdin/stdout
    (no fn_name, every input a string) or call-style (fn_name, every input a list of arguments).
    Anything else (list inputs without fn_name, fn_name with inputs that are not lists, numbers,
    objects, null or booleans as stdin) would load and score a correct program 0, so it is refused
    with the fix."""
    fn_name, js = spec.get("fn_name"), lambda v: json.dumps(v, default=str)  # as written in the file
    for i, x in enumerate(spec["inputs"], 1):
        if fn_name and not isinstance(x, list):
            raise ValueError(f"fn_name {js(fn_name)} but input {i} is {js(x)}, not a list of "
                             f"arguments: write each call's arguments as a list ({js([x])} for one "
                             f"argument), or drop fn_name and give stdin strings")
        if not fn_name and isinstance(x, list):
            raise ValueError(f"inputs are lists of arguments (input {i} is {js(x)}) but no fn_name: "
                             f'add "fn_name": "<the function\'s name>", or give stdin strings')
        if not fn_name and not isinstance(x, str):
            # a number's text is the obvious fix (3 -> "3\n"); a dict, null or boolean has none:
            # Python's str() of it ("None", "{'a': 1}") is no stdin a program expects
            number = isinstance(x, (int, float)) and not isinstance(x, bool)
            text = f"e.g. {js(str(x) + chr(10))}" if number else "the program's standard input"
            raise ValueError(f"input {i} is {js(x)}, not stdin text: give a string ({text}), "
                             f'or add "fn_name" and give each input as a list of arguments')


def _load_jsonl(name: str, split: str) -> list[dict]:
    """Rows of `jsonl:PREFIX`, split `split`: the file PREFIX_<split>.jsonl (choice 9)."""
    path = Path(f"{name.removeprefix('jsonl:')}_{split}.jsonl")
    if not path.is_file():
        raise FileNotFoundError(f"{name} (split {split!r}): no file {path} (jsonl:PREFIX reads "
                                f"PREFIX_{split}.jsonl, relative to {os.getcwd()})")
    rows = []
    for n, raw in _read_jsonl(path):
        missing = [k for k in JSONL_FIELDS if k not in raw]
        if missing:
            raise ValueError(f"{path}:{n}: missing field {missing[0]!r}; each line needs "
                             f"{', '.join(map(repr, JSONL_FIELDS))}")
        try:
            if not isinstance(raw["problem"], str) or not raw["problem"].strip():
                raise ValueError(f"'problem' must be non-empty text, got {raw['problem']!r}")
            gold = reward.get_task(raw["task"]).check(raw["answer"])
            if raw["task"] == "code":
                _check_code_form(gold)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
        # the answer as parsed, not re-encoded: the check gets one type, here and when scored
        rows.append({"id": str(raw.get("id", f"{split}-{n}")), "task": raw["task"], "problem": raw["problem"],
                     "ground_truth": raw["answer"], "source": name})
    return rows


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
    if name.startswith("rg:"):
        return load_rg(name, split)[:limit]
    if name.startswith("jsonl:"):
        return _load_jsonl(name, split)[:limit]
    if name not in HUB:
        raise ValueError(f"unknown data set {name!r}; accepted: {', '.join(NAMES)}, rg:<reasoning-gym name>, "
                         f"jsonl:PREFIX (your PREFIX_train.jsonl / PREFIX_test.jsonl)")
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
    """The base-model instruction for a row: its task's (reward.TASKS; DAPO's for math)."""
    return reward.get_task(row["task"]).instruction(row)


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
    if template.split(":")[0] == "fewshot":  # choice 8
        k = template.partition(":")[2] or "2"
        have = len(row.get("shots") or [])
        if not (k.isdigit() and 0 < int(k) <= have):
            raise ValueError(f"template {template!r} needs rows with at least {k} shots in row['shots'] "
                             f"(the rg: data sets attach {RG_SHOTS}); this row has {have}")
        if tokenizer is None:
            raise ValueError(f"template {template!r} needs a tokenizer (with a chat_template)")
        messages = []
        for shot in row["shots"][:int(k)]:
            messages += [{"role": "user", "content": shot["problem"]},
                         {"role": "assistant", "content": f"Answer: {shot['answer']}"}]
        messages.append({"role": "user", "content": row["problem"]})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    raise ValueError(f"unknown template {template!r}; accepted: {', '.join(TEMPLATES)}")


# ----------------------------------------------------------------------------- sampling for training

class PromptSampler:
    """Which prompts each iteration trains on: shuffled epochs without replacement over each data
    set (`--train_mix balanced`: every iteration takes an equal share of each) or over their union
    (`proportional`). Deterministic in (seed, iteration), identical on every rank, and its state
    (epoch and position per data set) is saved in checkpoints."""

    def __init__(self, rows, mix, seed):
        keys = [r["source"] for r in rows] if mix == "balanced" else ["all"] * len(rows)
        self.pools = [[i for i, k in enumerate(keys) if k == key] for key in dict.fromkeys(keys)]
        self.seed, self.epoch, self.pos = seed, [0] * len(self.pools), [0] * len(self.pools)
        self.order = [self._shuffled(p) for p in range(len(self.pools))]

    def _shuffled(self, p):
        return random.Random(self.seed * 1009 + p * 101 + self.epoch[p]).sample(self.pools[p], len(self.pools[p]))

    def take(self, n, it):
        shares = [n // len(self.pools) + (p < n % len(self.pools)) for p in range(len(self.pools))]
        out = []
        for p, k in enumerate(shares):
            if k > len(self.pools[p]):
                raise ValueError(f"--prompts_per_iter={n} asks {k} prompts of a data set with {len(self.pools[p])}")
            if self.pos[p] + k > len(self.pools[p]):     # next epoch, reshuffled
                self.epoch[p], self.pos[p] = self.epoch[p] + 1, 0
                self.order[p] = self._shuffled(p)
            out += self.order[p][self.pos[p]:self.pos[p] + k]
            self.pos[p] += k
        return random.Random(self.seed * 7 + it).sample(out, len(out))   # mix the data sets

    def state_dict(self):                             # for checkpoints: two small lists
        return {"epoch": list(self.epoch), "pos": list(self.pos)}

    def load_state_dict(self, state):
        self.epoch, self.pos = list(state["epoch"]), list(state["pos"])
        self.order = [self._shuffled(p) for p in range(len(self.pools))]


def load_rows(names, split, data_dir, template, tokenizer, max_prompt_tokens=None):
    """Problems of the comma-separated data sets `names`, each with its prompt text and ids, checked
    as they load: a row of an unknown task, a ground truth its task cannot use (reward.TASKS'
    check) or a prompt longer than `max_prompt_tokens` (the room the response leaves) is refused
    here, naming the row, not in the middle of a run."""
    rows = []
    for name in [n for n in names.split(",") if n]:
        for row in load_problems(name, split=split, data_dir=data_dir):
            where = f"{name} ({split}) row {row['id']!r}"
            try:  # the row's task is registered and its ground truth is one the reward can use
                reward.get_task(row["task"]).check(row["ground_truth"])
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            row["prompt"] = format_prompt(row, template, tokenizer)
            row["prompt_ids"] = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
            if max_prompt_tokens is not None and len(row["prompt_ids"]) > max_prompt_tokens:
                raise ValueError(f"{where}: its prompt is {len(row['prompt_ids'])} tokens; "
                                 f"accepted: at most {max_prompt_tokens} (--max_model_len minus "
                                 "--max_new_tokens)")
            rows.append(row)
    if not rows:
        raise ValueError(f"no problems in data sets {names!r} (split {split!r})")
    return rows
