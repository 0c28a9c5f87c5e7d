"""
Tasks and their binary rewards for RL on model-written text: 1.0 for a correct response, else 0.0.

    score("math", completions, ground_truths)  # gold answers such as "56", "\\frac{1}{2}", "[1, 2)"
    score("code", completions, test_specs)     # APPS/TACO/PRIME {"inputs": [...], "outputs": [...]}
    score("rg", completions, ground_truths)    # reasoning-gym rows of data/loaders.py ("rg:<name>")
    score("exact", completions, ground_truths) # words: "tac" (the answer line, exactly)

A task is one entry of TASKS: its instruction (the prompt templates of data/loaders.py), its
ground-truth check (run on every row when it is loaded) and its reward. `score` is what the
trainer calls once per iteration: the whole batch, in parallel, results in input order. Bad model
output never raises (it scores 0); bad configuration (unknown task, malformed test spec or ground
truth) raises ValueError. The model is optimised to get 1.0 by any means, so nothing it writes
runs or is parsed in the trainer's process: math and rg answers go to worker processes
(infra/checkers.py), programs to sandboxes (infra/sandbox.py). Each policy is stated beside the
code that implements it. Tests: `python -m pytest tests/test_reward.py tests/test_tasks.py`.
"""
import concurrent.futures
import dataclasses
import json
import math
import os
import re
import secrets
from typing import Callable

from infra import checkers, sandbox

# --- configuration (defaults; timeouts can also be passed per call) ---
# Limits are CPU time, not wall time, so a reward is a function of the completion and not of the
# machine's load: a math item that needs more than its limit of the worker's CPU (sympy stuck in C
# on an exponent tower) ends the worker (SIGXCPU), which is replaced. A wall-clock guard of 10x
# the limit (sandbox.WALL_GUARD, also read by infra/checkers.py) only stops what blocks without
# computing.
MATH_TIMEOUT_S = 5.0       # CPU seconds per math item; the worker is killed past it
MATH_TAIL_CHARS = 4000     # only the tail of a completion is searched for the final answer
MATH_MAX_ANSWER = 400      # longer extracted answers score 0 without reaching sympy
RG_TIMEOUT_S = 5.0         # CPU seconds per reasoning-gym item, as for math
CODE_TIMEOUT_S = 5.0       # CPU seconds per sandboxed program, all its processes
CODE_MAX_TESTS = 10        # tests run per problem (the first ones)
CODE_MAX_CHARS = 64_000    # longer extracted programs score 0

# ------------------------------------------------------------------------------------ math
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# What may stand between the boxes of one answer (final_boxed): "\boxed{1}, \boxed{2}",
# "$\boxed{1}$ and $\boxed{2}$", "\boxed{1} \quad \text{or} \quad \boxed{2}"; any other word
# ("wait, no:") ends the run, so only the last box counts.
_BETWEEN_BOXES = re.compile(r"(?:\s|[,;~&$]|\\[()\[\],;! ]|\\q?quad\b|\\\\|\b(?:and|or)\b"
                            r"|\\(?:text|mbox|textrm|mathrm)\s*\{\s*(?:and|or|,)?\s*\})*")
_ANSWER_LINE = re.compile(r"(?im)^[ \t>*#]*(?:final[ \t]+)?answer[ \t]*:(.*)$")
# Minerva's closing sentence, the last one in a line (extract_answer): "Final Answer: The final
# answer is $10,455$. I hope it is correct." Only where math follows: "The final answer is
# positive, because ..." is prose after the real (boxed) answer.
_FINAL_SENTENCE = re.compile(r"(?im)^.*\b(?:final[ \t]+answer[ \t]*:|the[ \t]+final[ \t]+answer"
                             r"[ \t]+is\b[ \t]*:?)[ \t]*(?=[-+$\\\d(\[{.]|the[ \t]+final)(.*)$")
_SENTENCE_WORDS = re.compile(r"(?i)^\s*the final answer is\b\s*:?|[.\s]*\bI hope it is correct.*$")


def _group(s, i):
    """Text inside the bracket opening at s[i] up to its match, or None if unbalanced."""
    close, depth = {"{": "}", "(": ")"}[s[i]], 0
    for j in range(i, len(s)):
        depth += (s[j] == s[i]) - (s[j] == close)
        if depth == 0:
            return s[i + 1:j]
    return None


def boxed_answers(text):
    """Every non-empty \\boxed{...} (or \\fbox{...}) of text with balanced braces, in order, as
    (start, end, inside); a box inside a box is part of the outer one."""
    close, opened = {}, []  # the matching "}" of every "{" that has one, in one pass
    for j, c in enumerate(text):  # (boxes one by one would be quadratic in "\\boxed{" spam)
        if c == "{":
            opened.append(j)
        elif c == "}" and opened:
            close[opened.pop()] = j
    found = []
    for m in _BOXED.finditer(text):
        end = close.get(m.end() - 1)
        if end is None or found and m.start() < found[-1][1]:
            continue
        if text[m.end():end].strip():
            found.append((m.start(), end + 1, text[m.end():end].strip()))
    return found


def final_boxed(text):
    """The final boxed answer of text, (start, answer) or None. Several boxes in a row are one
    answer: the last box and the boxes just before it that only spacing, punctuation, "and"/"or"
    or math delimiters separate from it, joined by ", " ("\\boxed{(1,2)}, \\boxed{(2,1)}" is
    "(1,2), (2,1)"); any other word ends the run ("\\boxed{56} wait, no: \\boxed{57}" is 57).
    data/loaders.py reads MATH ground truths with it too. A completion that boxes every
    candidate gives a list, which matches no single gold: it scores 0."""
    boxes = boxed_answers(text)
    if not boxes:
        return None
    run = boxes[-1:]
    for box in reversed(boxes[:-1]):
        if not _BETWEEN_BOXES.fullmatch(text, box[1], run[0][0]):
            break
        run.insert(0, box)
    return run[0][0], ", ".join(inner for _, _, inner in run)


def extract_answer(completion):
    """The final answer in the tail (MATH_TAIL_CHARS) of a completion, or None: whichever comes
    last of its final boxed answer (final_boxed), a DAPO-style `Answer: ...` line, or a
    final-answer sentence anywhere in a line where math follows (Minerva's "Final Answer: The
    final answer is $X$. I hope it is correct."), so the sentence wins over an earlier
    intermediate \\boxed{}. Math, rg and exact all read their answer with it."""
    text = completion[-MATH_TAIL_CHARS:]
    found = [final_boxed(text)]
    found += [(m.start(), m.group(1)) for m in _ANSWER_LINE.finditer(text)]
    found += [(m.start(1), m.group(1)) for m in _FINAL_SENTENCE.finditer(text)]
    # the latest wins; "Answer: \boxed{5}" is boxed (its box starts later)
    _, answer = max((f for f in found if f), default=(-1, None))
    return (_clean(_SENTENCE_WORDS.sub("", answer)) or None) if answer else None


def _clean(answer):
    """Emphasis, $..$, \\(..\\) and a final full stop off an answer (**56**, $56$, 56.); "" if
    nothing is left."""
    answer = answer.strip(" \t*$").rstrip(".").strip(" \t*$")
    math = re.fullmatch(r"\\[(\[](.*)\\[)\]]", answer, re.S)
    return math[1].strip() if math and not re.search(r"\\[()\[\]]", math[1]) else answer


def _pathological(answer):
    """Expressions on which sympy may spend unbounded time in C (no alarm can stop it; the CPU
    limit ends the worker): obvious towers and huge exponents are rejected before sympy sees
    them."""
    if len(answer) > MATH_MAX_ANSWER or re.search(r"\d{5,}\s*!|!\s*!", answer):
        return True  # absurd length, factorials of huge numbers, (n!)!
    for m in re.finditer(r"\^|\*\*", answer):
        i = m.end() + len(answer[m.end():]) - len(answer[m.end():].lstrip())
        if i < len(answer) and answer[i] in "{(":
            exponent = _group(answer, i) or answer[i:]
        else:
            exponent = re.match(r"[\w.\\]*", answer[i:]).group()
        if re.search(r"\^|\*\*|\d{5,}|!", exponent):
            return True  # a tower (power in an exponent) or an exponent >= 10^4
    return False


# A math ground truth must be a math expression: math-verify reads a bare word as a product of
# variables ("tac" is a*c*t), so "\boxed{cat}" would score 1 against it. So a math ground truth is
# refused if, once text arguments (\text{...}) and LaTeX commands are taken out, it still has a
# run of 2+ letters that is not a function name (sin, log, ...); the error names task "exact" for
# answers that are words. Single letters (x, A, i) are variables or choices, as math-verify reads
# them.
_TEXT_ARG = re.compile(r"\\(?:text\w*|mbox|math(?:rm|bf|it|sf|tt)|operatorname|begin|end)"
                       r"\s*\{[^{}]*\}")
_COMMAND = re.compile(r"\\[A-Za-z]+")
_LETTERS = re.compile(r"[^\W\d_]{2,}")
_MATH_NAMES = {"sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh",
               "cosh", "tanh", "log", "ln", "exp", "sqrt", "pi", "max", "min", "gcd", "lcm", "mod"}


def _math_gold(ground_truth):
    """A math ground truth as math-verify gets it; ValueError if it is not a math expression."""
    g = ground_truth
    if not isinstance(g, (str, int, float)) or isinstance(g, bool):
        raise ValueError(f"math ground truth must be a string, got {g!r}")
    gold = str(g).strip().strip("$")
    if not gold:
        raise ValueError(f"math ground truth {g!r} is empty")
    bare = _COMMAND.sub(" ", _TEXT_ARG.sub(" ", gold))
    words = [w for w in _LETTERS.findall(bare) if w.lower() not in _MATH_NAMES]
    if words:
        w = words[0]
        raise ValueError(
            f"math ground truth {g!r} is not a math expression: math-verify reads {w!r} as the "
            f"product {'*'.join(w)}, so any answer with these letters in any order would score 1. "
            f"For answers that are words use task 'exact'; in a math answer write text as "
            f"\\text{{{w}}} and a product of variables with spaces ({' '.join(w)})")
    return gold


# Answer forms are decided one way each (tests/test_reward.py tests each both ways; measured in
# bench/verifier_agreement.py). False positives (a wrong answer rewarded) are worse than false
# negatives, so where a reading is ambiguous it is the stricter one. Each policy is stated where it
# is applied: _number_forms, _LONE_I, _clock, _math_judge.
# Number forms math-verify misreads, rewritten before math-verify, in answer and gold alike.
_MIXED = re.compile(r"(?<![\d.,])(\d+)[ \t]+(\d+)[ \t]*/[ \t]*(\d+)(?![\d.])")  # 1 1/2
_GROUPED = re.compile(  # 1 000, 1\,000, 1{,}000, 12,\!000: thousands separated by a space
    r"(?<![\d.,])[1-9]\d{0,2}(?:(?:[ \t\u2009\u202f~]|\\[,;: !]|\{,\}|,\\!)\d{3})+(?![\d])")
# The imaginary unit, not \pi, \sin, \infty: where the gold has a lone i, i is the imaginary unit
# on both sides ("i(2-i)" is 1+2i; math-verify reads i as a variable).
_LONE_I = re.compile(r"(?<![\\A-Za-z])i(?![A-Za-z])")
# A clock time (_clock): 4:30, 12:05 p.m., \text{4:30 p.m.}
_CLOCK = re.compile(r"(\d{1,2}):(\d\d)\s*(?:([ap])\.?\s*m\.?)?")
_TEXT_WRAP = re.compile(r"\\(?:text|mbox|textrm|mathrm)\s*\{([^{}]*)\}")


def _number_forms(s):
    """s with the number forms math-verify misreads rewritten (in answer and gold alike).
    Thousands separated by a space or thin space ("1 000", "1\\,000", "12,\\!000") are one
    number; "1 1/2" is the mixed number 3/2. No decimal commas: a comma between digits separates
    thousands ("1,000") or list items ("1,5" is the set {1, 5}, not 1.5)."""
    s = _MIXED.sub(lambda m: f"{m[1]}\\frac{{{m[2]}}}{{{m[3]}}}" if int(m[2]) < int(m[3])
                   else m[0], s)
    return _GROUPED.sub(lambda m: re.sub(r"\D", "", m[0]), s)


def _clock(s):
    """(hours, minutes, 'a' | 'p' | None) if s is a clock time and nothing else, else None.
    A gold that is a clock time ("\\text{4:30 p.m.}") is compared as a time, not by math-verify
    (which reads 4:30 as the ratio 2:15), in _math_judge: hours and minutes equal, a.m./p.m.
    equal or missing in the answer."""
    m = _CLOCK.fullmatch(_TEXT_WRAP.sub(r"\1", s).strip(" $").lower())
    return m and (int(m[1]), int(m[2]), m[3])


def _math_judge(answer, gold, timeout):
    """math-verify's verdict (parse + verify, gold first), from a killable checker worker (its
    CPU-time limit: MATH_TIMEOUT_S), on the answer and gold in the forms it reads (_number_forms,
    _LONE_I; a clock-time gold by _clock instead). Forms left to math-verify, decided one way:
    - a bare comma list is a set ("2, 1" is "1, 2": the roots of an equation, as MATH asks for
      them); a tuple in brackets is ordered. hendrycks/math's own test wants "10, 4, -2" and
      "4, 10, -2" unequal, but MATH writes ordered answers as tuples: of its test split's bare
      lists, 3 ask for the values in an order ("least to greatest"), where the right values in
      another order score 1;
    - a unit after a number is dropped (math-verify's list: "10m", "10\\text{ cm}" are 10); a
      letter that is a variable is not ("10x" is not 10), nor a bare word ("18 dollars" scores
      0: dropping words would also drop "18 thousand"; the prompt asks for the answer alone);
    - no rounding tolerance of our own: a decimal matches an exact value only to math-verify's
      6 decimal places (125.663706 is 40\\pi, 125.663 is not)."""
    if _pathological(answer):
        return 0.0
    clock = _clock(gold)
    if clock:  # a time is not a ratio: 2:15 is not 4:30; a missing a.m./p.m. is not wrong
        got = _clock(answer)
        return float(bool(got) and got[:2] == clock[:2] and got[2] in (None, clock[2]))
    answer, gold = _number_forms(answer), _number_forms(_clean(gold))  # MATH boxes "1 + i."
    if _LONE_I.search(gold):  # a complex gold: i is sympy's I in both (math-verify: a symbol)
        answer, gold = _LONE_I.sub("I", answer), _LONE_I.sub("I", gold)
    return checkers.verdict("math", gold, answer, timeout)


def math_reward(completion, ground_truth, *, timeout=MATH_TIMEOUT_S):
    return score("math", [completion], [ground_truth], workers=1, timeout=timeout)[0]


# ------------------------------------------------------------------------ reasoning-gym
# reasoning-gym ("rg") answers are the last `Answer: ...` line (or \boxed{}), read by
# extract_answer as for math, and judged by the data set's own `score_answer(answer, entry)` in
# the same killable checker workers as math (a checker can hang too: sympy on "x**(9**9**9)").
# Its scores lie in [0, 1], some with partial credit (e.g. the right number inside extra words);
# we keep rewards binary: 1.0 only for full credit (score >= 1), else 0.0 (infra/checkers.py
# applies the threshold; TASKS["rg"] asks it).
def _rg_gold(ground_truth):
    """A reasoning-gym ground truth (JSON text or dict) as canonical JSON; ValueError if
    malformed. It is the JSON that data/loaders.py writes: {"dataset", "config", "entry"}; the
    worker rebuilds the data set object from name + config."""
    g = ground_truth
    if isinstance(g, str):
        try:
            g = json.loads(g)
        except ValueError:
            g = None
    if not (isinstance(g, dict) and isinstance(g.get("dataset"), str)
            and isinstance(g.get("config"), dict) and isinstance(g.get("entry"), dict)):
        raise ValueError("malformed reasoning-gym ground truth (need JSON with 'dataset' (str), "
                         "'config' (dict), 'entry' (dict), as data/loaders.py writes): "
                         f"{str(ground_truth)[:200]!r}")
    return json.dumps(g, sort_keys=True)


def rg_reward(completion, ground_truth, *, timeout=RG_TIMEOUT_S):
    return score("rg", [completion], [ground_truth], workers=1, timeout=timeout)[0]


# ------------------------------------------------------------------------------------ code
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)\b[^\n]*\n(.*?)(?:```|\Z)", re.S | re.I)


def extract_code(completion):
    """The last ```python block (an unclosed final one counts), else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _parse_tests(tests):
    spec = tests
    if isinstance(tests, str):
        try:
            spec = json.loads(tests)
        except ValueError:
            raise ValueError(f"malformed test spec (not JSON): {tests[:200]!r}") from None
    if not (isinstance(spec, dict) and isinstance(spec.get("inputs"), list) and spec["inputs"]
            and isinstance(spec.get("outputs"), list)
            and len(spec["inputs"]) == len(spec["outputs"])
            and isinstance(spec.get("fn_name", ""), str)):
        raise ValueError("malformed test spec (need non-empty 'inputs' and 'outputs' lists of "
                         f"equal length, optional string 'fn_name'): {str(tests)[:200]!r}")
    return spec


def _same_text(got, expected):
    """Line by line, whitespace-normalised; numbers with a '.' within 1e-6."""
    a = [line.split() for line in got.strip().splitlines()]
    b = [line.split() for line in expected.strip().splitlines()]
    return len(a) == len(b) and all(len(x) == len(y) and all(map(_same_token, x, y))
                                    for x, y in zip(a, b))


def _same_token(s, t):
    if s == t or "." not in s + t:
        return s == t
    try:
        return math.isclose(float(s), float(t), rel_tol=1e-6, abs_tol=1e-6)
    except ValueError:
        return False


def _same_value(got, exp):
    """Return values after a JSON round trip (tuples are lists); floats within 1e-6."""
    if isinstance(got, bool) or isinstance(exp, bool):
        return got is exp
    if isinstance(got, (int, float)) and isinstance(exp, (int, float)):
        if float in (type(got), type(exp)):
            return math.isclose(got, exp, rel_tol=1e-6, abs_tol=1e-6)
        return got == exp
    if isinstance(got, list) and isinstance(exp, list):
        return len(got) == len(exp) and all(map(_same_value, got, exp))
    if isinstance(got, dict) and isinstance(exp, dict):
        return got.keys() == exp.keys() and all(_same_value(got[k], exp[k]) for k in got)
    return got == exp


def _code_score(code, spec, timeout, max_tests):
    """1.0 if the program passes the first `max_tests` tests, else 0.0. Every program runs in a
    fresh `python -I -S` inside bubblewrap (sandbox.run): no network, no file system but
    read-only system files and a private /tmp, an empty environment, rlimits, a CPU-time limit
    (`timeout`, CODE_TIMEOUT_S by default) over all its processes and the wall-clock guard, the
    process tree killed after; without bwrap a weaker fallback, warned once (sandbox.BWRAP).
    Expected outputs never enter the sandbox: pass/fail is decided here by comparing outputs
    (never by exit code). Call-based problems run all their calls in one interpreter through a
    small harness that prints JSON results after a random marker."""
    if len(code) > CODE_MAX_CHARS:
        return 0.0
    sandbox.check()
    tests = list(zip(spec["inputs"], spec["outputs"]))[:max_tests]
    if spec.get("fn_name"):  # call-based: all calls in one interpreter, compared out here
        mark = "@@" + secrets.token_hex(8) + "@@"
        calls = [args if isinstance(args, list) else [args] for args, _ in tests]
        out = sandbox.run(code, json.dumps(calls).encode(), (mark, spec["fn_name"]), timeout)
        if out is None:
            return 0.0
        lines = out.decode("utf-8", "replace").split("\n")
        results = [line[len(mark):] for line in lines if line.startswith(mark)]
        if len(results) != len(tests):
            return 0.0
        for result, (_, exp) in zip(results, tests):
            got = json.loads(result)  # "!" (the call raised) fails here, scoring 0
            if not (_same_value(got, exp) or  # APPS wraps return values in a list: [x]
                    isinstance(exp, list) and len(exp) == 1 and _same_value(got, exp[0])):
                return 0.0
        return 1.0

    def text(x):  # APPS sometimes stores lists of lines
        if isinstance(x, list):
            return "\n".join(map(str, x))
        return x if isinstance(x, str) else str(x)
    for inp, exp in tests:  # stdin/stdout: one fresh interpreter per test, stop at a failure
        out = sandbox.run(code, text(inp).encode("utf-8", "replace"), None, timeout)
        if out is None or not _same_text(out.decode("utf-8", "replace"), text(exp)):
            return 0.0
    return 1.0


def _code_judge(code, spec, timeout, max_tests=CODE_MAX_TESTS):
    try:
        return _code_score(code, spec, timeout, max_tests)
    except sandbox.SandboxError:  # a broken sandbox is configuration too
        raise
    except Exception:  # anything the model's output provokes (bad JSON, str, ...) scores 0
        return 0.0


def code_reward(completion, tests, *, timeout=CODE_TIMEOUT_S, max_tests=CODE_MAX_TESTS):
    spec = _parse_tests(tests)
    if not isinstance(completion, str):
        return 0.0
    return _code_judge(extract_code(completion), spec, timeout, max_tests)


# ----------------------------------------------------------------------------------- tasks
# Instructions for base models (data/loaders.py's "chat" template; "dapo" and "code" are the math
# and code ones alone): each asks for the answer in the form its task's `extract` reads.
# DAPO's is verbatim from the prompts of DAPO-Math-17k.
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response "
               "should be of the form Answer: $Answer (without quotes) where $Answer is the "
               "answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
CODE_STDIN = ("{problem}\n\nWrite a Python 3 program that solves the problem above. It must read "
              "the input from standard input and print the answer to standard output. Give the "
              "complete program in a single ```python code block.")
CODE_CALL = ("{problem}\n\nWrite Python 3 code that solves the problem above by defining "
             "`{fn_name}` (keep the signature of the starter code if one is given); it is called "
             "on each test input and its return value is checked. Give the complete code in a "
             "single ```python code block.")
ANSWER_SUFFIX = '\n\nEnd your response with a line of the form "Answer: <answer>".'


@dataclasses.dataclass(frozen=True)
class Task:
    """One kind of problem: how to ask for it, what a valid ground truth is, how to score a
    response. `check` runs on every row at load time and again on every item `score` gets, on the
    same value both times: the row's "ground_truth" as the row holds it (a jsonl: row's answer as
    JSON parsed it, a str, number, list or dict; the hub and rg loaders' rows hold text, code and
    rg specs as JSON text, which their checks also take as dicts). `judge` gets what `check`
    returned and raises only on configuration."""
    instruction: Callable    # row -> the prompt text for a base model
    check: Callable          # ground truth (as the row holds it) -> the gold `judge` gets;
                             # ValueError if malformed
    extract: Callable        # completion -> the answer `judge` gets (a str), or None (scores 0)
    judge: Callable          # (answer, gold, timeout) -> reward in [0, 1]
    timeout: float = 5.0     # default limit per item (CPU seconds), passed to judge
    uses_pool: bool = False  # judge asks the checker workers (infra/checkers.py): start them first


def _code_instruction(row):
    fn_name = _parse_tests(row["ground_truth"]).get("fn_name")
    template = CODE_CALL if fn_name else CODE_STDIN
    return template.format(problem=row["problem"], fn_name=fn_name)


def _exact_gold(ground_truth):
    """The "exact" task's gold; ValueError if it is not a non-empty string (or int). "exact"
    compares the answer line (extract_answer, as for math) with the ground truth after the same
    clean-up (_clean) and with runs of whitespace made one space. It is case-sensitive:
    exactness is the point (the reverse of "Cat" is "taC"); a task where case does not matter is
    one more entry of TASKS."""
    if not isinstance(ground_truth, (str, int)) or isinstance(ground_truth, bool):
        raise ValueError(f"exact ground truth must be a string, got {ground_truth!r}")
    gold = " ".join(_clean(str(ground_truth)).split())  # as the answer is cleaned
    if not gold:
        raise ValueError(f"exact ground truth {ground_truth!r} is empty")
    return gold


# One registry: adding a task is one Task entry, and a row's "task" field picks it.
TASKS = {
    "math": Task(instruction=lambda row: DAPO_PREFIX + row["problem"] + DAPO_SUFFIX,
                 check=_math_gold, extract=extract_answer, judge=_math_judge,
                 timeout=MATH_TIMEOUT_S, uses_pool=True),
    "code": Task(instruction=_code_instruction, check=_parse_tests, extract=extract_code,
                 judge=_code_judge, timeout=CODE_TIMEOUT_S),
    "rg": Task(instruction=lambda row: row["problem"] + ANSWER_SUFFIX, check=_rg_gold,
               extract=extract_answer, timeout=RG_TIMEOUT_S, uses_pool=True,
               judge=lambda a, gold, t: checkers.verdict("rg", gold, a, t)),
    "exact": Task(instruction=lambda row: row["problem"] + ANSWER_SUFFIX, check=_exact_gold,
                  extract=extract_answer,
                  judge=lambda a, gold, t: float(" ".join(a.split()) == gold)),
}


def get_task(name):
    """The registered Task `name`; ValueError naming the registered ones."""
    if not isinstance(name, str) or name not in TASKS:
        raise ValueError(f"unknown task {name!r}; registered tasks: {', '.join(map(repr, TASKS))} "
                         f"(reward.TASKS)")
    return TASKS[name]


# ----------------------------------------------------------------------------------- batch
def score(task, completions, ground_truths, workers=None, timeout=None):
    """Rewards for a batch, in input order, `workers` items at a time (default: this process's
    cores / LOCAL_WORLD_SIZE)."""
    t = get_task(task)
    if len(completions) != len(ground_truths):
        raise ValueError(f"{len(completions)} completions but {len(ground_truths)} ground truths")
    golds = [t.check(g) for g in ground_truths]  # fail fast, before running anything
    # The pool of checker workers (and of concurrent sandboxes: one per thread) defaults to this
    # process's cores divided by LOCAL_WORLD_SIZE: under `accelerate launch` every rank on a node
    # scores at once, and the ranks of one node share its cores.
    workers = workers or max(1, len(os.sched_getaffinity(0))
                             // int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    if t.uses_pool:
        checkers.start(workers)
    answers = [t.extract(c) if isinstance(c, str) else None for c in completions]

    def run(a, g):
        return 0.0 if a is None else t.judge(a, g, timeout or t.timeout)
    # Identical (answer, ground truth) pairs are judged once: a converging policy repeats itself
    # (most of a group's 8 programs are often the same text), and each distinct program is still
    # run in a fresh sandbox. Keys are the extracted program / answer, so prose around them is free.
    items = list(zip(answers, golds))
    keys = [(a, json.dumps(g, sort_keys=True, default=repr)) for a, g in items]  # any gold type
    first = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    unique = list(first.values())
    with concurrent.futures.ThreadPoolExecutor(workers) as threads:  # threads drive processes
        verdicts = dict(zip(unique, threads.map(lambda i: run(*items[i]), unique)))
    return [verdicts[first[k]] for k in keys]


def overlong_penalty(lengths, max_tokens, buffer):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), the amount taken off each reward:
    0 up to max_tokens - buffer tokens, then (excess / buffer), reaching 1 at max_tokens."""
    return [min(max(0, n - (max_tokens - buffer)) / buffer, 1.0) for n in lengths]


# ----------------------------------------------------------------------------- reward parts
# A run's reward may be a weighted sum of named parts (train.py --reward correct=1,format=0.1):
# "correct" is the task's judge (score_rows); every other part is a function of one Completion
# in PARTS. A part that raises on model output scores 0 there, as a judge does.
@dataclasses.dataclass
class Completion:
    text: str
    n_tokens: int           # its tokens (EOS included when emitted)
    truncated: bool         # max_tokens reached before EOS
    row: dict               # its data-set row ("task", "problem", "ground_truth", ...)
    max_tokens: int         # the response budget (--max_new_tokens)
    overlong_buffer: int    # --overlong_buffer


def format_part(c):
    """1 when the completion states its answer in the form its task reads (a final boxed answer
    or `Answer:` line, a code block), else 0: a format reward, as in DeepSeek-R1's recipe."""
    return float(get_task(c.row["task"]).extract(c.text) is not None)


def length_part(c):
    """-(tokens / max_tokens), in [-1, 0]: a cost per token (weight it 0.1 for a mild one)."""
    return -c.n_tokens / c.max_tokens


def overlong_part(c):
    """-(DAPO's soft overlong punishment): 0 up to max_tokens - buffer tokens, then down to -1 at
    max_tokens (what --overlong punish adds at weight 1)."""
    return -overlong_penalty([c.n_tokens], c.max_tokens, c.overlong_buffer)[0]


PARTS = {"format": format_part, "length": length_part, "overlong": overlong_part}


def part_values(name, completions):
    """PARTS[name] of each completion, 0.0 where it raised on the model's output."""
    values = []
    for c in completions:
        try:
            values.append(float(PARTS[name](c)))
        except Exception:   # noqa: BLE001  bad model output scores 0, as judges do
            values.append(0.0)
    return values


def score_rows(completions, rows, **kw):
    """Rewards for completions of data-set rows ({"task", "ground_truth", ...}; one row per
    completion, tasks mixed): one `score` call per task, results in input order."""
    out = [0.0] * len(completions)
    for task in sorted({r["task"] for r in rows}):
        idx = [i for i, r in enumerate(rows) if r["task"] == task]
        got = score(task, [completions[i] for i in idx], [rows[i]["ground_truth"] for i in idx],
                    **kw)
        for i, s in zip(idx, got):
            out[i] = s
    return out
