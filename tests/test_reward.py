"""
Tests for reward.py: real math-verify workers, real reasoning-gym checkers, real sandboxes,
real files and sockets.

    python -m pytest tests/test_reward.py -q

Attack programs print exactly what a *successful* attack would print, and that is the expected
output, so a test can only fail (score 1) if the sandbox leaks. After each attack we check that
the host still works and that no sandbox process is left (by scanning /proc cmdlines).
"""
import json, os, shutil, socket, subprocess, sys, tempfile, threading, time
from pathlib import Path

import pytest

import reward
from infra import checkers, sandbox

MARK = "rw-test-leftover-marker"  # put in the argv of processes an attack starts


def stdin_spec(out, inp=""):
    return {"inputs": [inp], "outputs": [out]}


def _under_a_trainer(pid):
    """Whether a live train.py is an ancestor of `pid` (its sandboxes are not this test's: a
    training run beside the tests must not fail them). An orphan's parent is init: counted."""
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
            if b"train.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except (OSError, ValueError, IndexError):
            return False
    return False


def leftovers():
    """Processes of any sandbox (or started by an attack) still alive, after a grace period."""
    for _ in range(40):
        found = []
        for p in os.listdir("/proc"):
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_bytes() if p.isdigit() else b""
            except OSError:
                continue
            if any(m in cmd for m in (b"rwsbx-", b"/sandbox/solution.py", MARK.encode())) and not _under_a_trainer(int(p)):
                found.append(cmd.replace(b"\0", b" ")[:120])
        if not found:
            return []
        time.sleep(0.05)
    return found


def host_ok():
    return subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True,
                          timeout=30).stdout == b"1\n"


# ------------------------------------------------------------------------------------ math
def test_math_equivalent_forms_score_one():
    cases = [("The answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"), ("\\boxed{1/2}", "\\frac{1}{2}"),
             ("\\boxed{0.5}", "\\frac{1}{2}"), ("\\boxed{\\dfrac12}", "1/2"), ("\\boxed{x = 3}", "3"),
             ("Answer: 56", "56"), ("work...\n**Answer:** $56$.", "56"), ("Answer: x=3", "3"),
             ("\\boxed{[1,2)}", "[1, 2)"), ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}"), ("\\boxed{56}", 56),
             ("\\boxed{(-\\infty, 3]}", "(-\\infty,3]"), ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}")]
    assert reward.score("math", [c for c, _ in cases], [g for _, g in cases]) == [1.0] * len(cases)


def test_math_latex_parser_is_installed_and_used():
    # These need math-verify's LaTeX parser (latex2sympy2_extended on the ANTLR 4.13.2 runtime,
    # pinned in requirements.txt): without it the answers do not parse and score 0.
    from importlib.metadata import version
    assert version("antlr4-python3-runtime") == "4.13.2"
    assert reward.math_reward("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert reward.math_reward("so \\boxed{\\sqrt{12}}", "2\\sqrt{3}") == 1.0
    assert reward.math_reward("\\boxed{\\sqrt{12}}", "3\\sqrt{2}") == 0.0


def test_math_wrong_missing_and_last_answer():
    cases = [("\\boxed{57}", "56"), ("\\boxed{[1, 2]}", "[1, 2)"), ("I think it is 56", "56"),
             ("", "56"), ("\\boxed{56} wait, no: \\boxed{57}", "56"), ("Answer: 5\nAnswer: 6", "5"),
             ("\\boxed{56", "56")]
    assert reward.score("math", [c for c, _ in cases], [g for _, g in cases]) == [0.0] * len(cases)
    assert reward.math_reward("\\boxed{57} hmm, actually \\boxed{56}", "56") == 1.0


def math_scores(cases, **kw):
    """reward.score on (completion, ground truth) pairs."""
    return reward.score("math", [c for c, _ in cases], [g for _, g in cases], timeout=10, **kw)


def test_math_several_boxes_in_a_row_are_one_answer():
    # reward.final_boxed: boxes that only punctuation, "and"/"or" or spacing separate are joined
    right = [("So \\boxed{(1,2)}, \\boxed{(2,1)}.", "(1,2), (2,1)"),
             ("the roots are $\\boxed{-2}$ and $\\boxed{1}$.", "1, -2"),
             ("\\[ \\boxed{3} \\quad \\text{or} \\quad \\boxed{\\frac{2}{5}} \\]", "\\frac25, 3"),
             ("\\boxed{7} hmm, no: \\boxed{1}, \\boxed{2}", "1, 2")]  # words end the run
    wrong = [("So \\boxed{(1,2)}, \\boxed{(2,1)}.", "(1,2)"),  # one of two answers
             ("the roots are $\\boxed{-2}$ and $\\boxed{1}$.", "1"),
             ("\\boxed{7} hmm, no: \\boxed{1}, \\boxed{2}", "7, 1, 2")]
    assert math_scores(right + wrong) == [1.0] * len(right) + [0.0] * len(wrong)


def test_math_boxing_every_candidate_scores_zero():
    spam = ", ".join(f"\\boxed{{{k}}}" for k in range(1, 101))
    cases = [(spam, "57"), (spam, "1, 2"), ("\\boxed{1} or \\boxed{2}", "1"),
             ("\\boxed{1}\\boxed{2}\\boxed{3}", "2"), ("$\\boxed{56}$, $\\boxed{57}$", "56"),
             ("The final answer is $55$ or $56$", "56"), ("Answer: 1 000 or 56", "56"),
             ("Answer: 5 6", "56")]
    assert math_scores(cases) == [0.0] * len(cases)


def test_math_final_answer_sentence_wins_over_an_earlier_box():
    minerva = ("Caius has \\boxed{255} more, so $10,200 + 255 = 10,455$.\nFinal Answer: The final "
               "answer is $10,455$. I hope it is correct.")
    right = [(minerva, "10455"), ("... = 120. Final Answer: The final answer is 120.", "120"),
             ("The final answer is \\(\\frac12\\).", "0.5"),
             ("The final answer is 1. Wait, no: the final answer is 56.", "56"),
             # prose after the real answer is not a final-answer sentence
             ("So \\boxed{5}. The final answer is positive, because both factors are.", "5")]
    wrong = [(minerva, "255"), ("The final answer is 7 or 8", "7")]
    assert math_scores(right + wrong) == [1.0] * len(right) + [0.0] * len(wrong)


def test_math_number_forms():
    # reward._number_forms/_LONE_I: thousands separated by a space, mixed numbers, a complex product
    right = [("Answer: 1 000", "1000"), ("Answer: 1\\,000", "1000"), ("Answer: 1{,}000", "1000"),
             ("Answer: 12,\\!000,\\!023", "12000023"), ("Answer: 1 234 567", "1234567"),
             ("Answer: 1 1/2", "\\frac{3}{2}"), ("Answer: 2\\frac{1}{4}", "9/4"),
             ("Answer: i(2-i)", "1+2i"), ("Answer: 1 + 2 i", "1+2i"),
             ("\\boxed{\\frac{7}{5} + \\frac{1}{5} i}", "\\frac{7}{5} + \\frac{1}{5} i.")]
    wrong = [("Answer: 1 000", "1"), ("Answer: 1 1/2", "\\frac{1}{2}"), ("Answer: 1 1/2", "11/2"),
             ("Answer: 2 + i", "1+2i"), ("Answer: i(2+i)", "1+2i"), ("Answer: 10 0000", "100000")]
    assert math_scores(right + wrong) == [1.0] * len(right) + [0.0] * len(wrong)


@pytest.mark.parametrize("policy, right, wrong", [
    # 1. a bare comma list is a set (the roots of an equation); a tuple in brackets is ordered
    ("lists", [("Answer: 2, 1", "1, 2"), ("Answer: 4, 10, -2", "10, 4, -2")],
     [("Answer: (2, 1)", "(1, 2)"), ("Answer: 2, 1", "(1, 2)"), ("Answer: 2, 1, 3", "1, 2")]),
    # 2. a unit after a number is dropped; a letter that is a variable is not, nor a word
    ("units", [("Answer: 10m", "10"), ("Answer: 10\\text{ cm}", "10"), ("Answer: 5", "5\\text{ cm}")],
     [("Answer: 10x", "10"), ("Answer: 2a", "2"), ("Answer: 18 dollars", "18")]),
    # 3. a decimal matches an exact value only to math-verify's 6 decimal places
    ("rounding", [("Answer: 125.663706", "40\\pi"), ("Answer: 0.333333", "\\frac13")],
     [("Answer: 125.663", "40\\pi"), ("Answer: 0.3333", "\\frac13")]),
    # 4. a clock time is a time, not a ratio; a missing a.m./p.m. is not wrong, another one is
    ("clock", [("Answer: 4:30", "\\text{4:30 p.m.}"), ("Answer: 4:30 PM", "\\text{4:30 p.m.}"),
               ("Answer: 6:4", "3:2")],
     [("Answer: 2:15", "4:30"), ("Answer: 4:30 a.m.", "\\text{4:30 p.m.}"), ("Answer: 4", "4:30")]),
    # 5. no decimal commas: a comma between digits separates thousands or list items
    ("decimal comma", [("Answer: 1,000", "1000"), ("Answer: 1,5", "\\{1, 5\\}")],
     [("Answer: 1,5", "1.5"), ("Answer: 1000,99", "1000.99")]),
])
def test_math_policy(policy, right, wrong):
    assert math_scores(right + wrong) == [1.0] * len(right) + [0.0] * len(wrong), policy


def test_math_prompt_echo_and_code_answers_score_zero():
    echo = reward.DAPO_PREFIX + "What is $7 \\cdot 8$?" + reward.DAPO_SUFFIX
    cases = [(echo, "56"), (echo + "\n\\boxed{}", "56"), ("Answer: `print(56)`", "56"),
             ("```python\nprint(56)\n```", "56"), ("Answer: ```python\nprint(56)\n```", "56"),
             ("Answer: import os; os.system('echo 56')", "56")]
    assert math_scores(cases) == [0.0] * len(cases)


def test_final_boxed_skips_nested_and_empty_boxes():
    assert reward.final_boxed("\\boxed{a{b}c} and \\boxed{unclosed") == (0, "a{b}c")
    assert reward.final_boxed("x \\boxed{\\boxed{5}} \\boxed{}") == (2, "\\boxed{5}")
    assert reward.final_boxed("no box") is None


def test_math_pathological_inputs_return_in_time_from_a_thread():
    items = [("\\boxed{9^{9^{9^{9}}}}", "1", 0.0),
             ("\\boxed{\\dfrac{5^{\\left(5^{\\left(5^{\\left(5^5\\right)}\\right)} - 4\\right)} - 5}{16}}",
              "1", 0.0),  # hangs math-verify's parse forever (Math-Verify issue #65)
             ("x" * 200_000 + "\\boxed{56}", "56", 1.0), ("{" * 200_000, "56", 0.0),
             ("\\boxed{" + "1+" * 100_000 + "1}", "100001", 0.0), ("\\boxed{2}", "2", 1.0)]
    result = {}

    def run():  # math-verify's signal.alarm would refuse to run here; the workers do not care
        t = time.monotonic()
        result["scores"] = reward.score("math", [c for c, _, _ in items], [g for _, g, _ in items],
                                        timeout=3.0)
        result["seconds"] = time.monotonic() - t

    reward.score("math", ["\\boxed{1}"], ["1"])  # workers started, so start-up is not timed
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert result["scores"] == [v for _, _, v in items]
    assert result["seconds"] < 3.0 * len(items) / 2, result  # every item within its 3 s limit


def test_math_stuck_worker_is_killed_and_replaced():
    # A hard limit below math-verify's own 1 s alarm: the worker is genuinely busy in sympy
    # when the wall clock runs out, so the caller must kill it and start another.
    reward.score("math", ["\\boxed{1}"], ["1"], workers=1)
    pids = {w.proc.pid for w in checkers._workers}
    t = time.monotonic()
    slow = "\\left(\\frac{3}{2}\\right)^{10^{8}} - 1"
    assert checkers.verdict("math", "1", slow, 0.5) == 0.0
    assert time.monotonic() - t < 1.5
    assert pids != {w.proc.pid for w in checkers._workers}  # one was replaced
    assert reward.score("math", ["\\boxed{7}"] * 4, ["7"] * 4) == [1.0] * 4  # pool still works


# ------------------------------------------------------------------------ reasoning-gym
def rg_rows(spec="rg:chain_sum?min_terms=2&max_terms=2&min_digits=2&max_digits=2&size=20&test_size=5"):
    from data.loaders import load_problems
    return load_problems(spec, "test")


def test_rg_right_wrong_and_partial_credit():
    rows = rg_rows()
    answers = [json.loads(r["ground_truth"])["entry"]["answer"] for r in rows]
    right = [f"Sure.\nAnswer: {a}" for a in answers]
    wrong = [f"Answer: {int(a) + 1}" for a in answers]
    partial = [f"Answer: {a} apples" for a in answers]  # reasoning-gym gives this partial credit
    gts = [r["ground_truth"] for r in rows]
    assert reward.score("rg", right + wrong + partial, gts * 3) == [1.0] * len(rows) + [0.0] * 2 * len(rows)
    assert reward.rg_reward(f"\\boxed{{{answers[0]}}}", gts[0]) == 1.0  # extract_answer, as for math


def test_rg_garbage_never_raises():
    gt = rg_rows()[0]["ground_truth"]
    junk = [None, 3, "\ud800", "", "Answer:", "Answer: \ud800", "\0" * 100, "Answer: " + "9" * 10_000]
    assert reward.score("rg", junk, [gt] * len(junk)) == [0.0] * len(junk)


def test_rg_hanging_checker_is_killed_in_time():
    # intermediate_integration's checker hands the answer to sympy, which computes 9**9**9 in C
    # for minutes: only killing the worker stops it.
    gt = rg_rows("rg:intermediate_integration?size=10&test_size=1")[0]["ground_truth"]
    answer = json.loads(gt)["entry"]["answer"]
    assert reward.rg_reward(f"Answer: {answer}", gt) == 1.0  # worker up, checker imported
    t = time.monotonic()
    got = reward.score("rg", ["Answer: x**(9**9**9)", f"Answer: {answer}"], [gt, gt], timeout=2.0)
    assert got == [0.0, 1.0]
    assert time.monotonic() - t < 8
    assert reward.rg_reward(f"Answer: {answer}", gt) == 1.0  # the replacement works


def test_rg_identical_answers_are_judged_once(monkeypatch):
    gt = rg_rows()[0]["ground_truth"]
    a = int(json.loads(gt)["entry"]["answer"])
    calls = []
    real = checkers.verdict
    monkeypatch.setattr(checkers, "verdict", lambda *args: calls.append(args) or real(*args))
    got = reward.score("rg", [f"Answer: {a}", f"thinking...\nAnswer: {a}", f"Answer: {a + 1}"] * 4, [gt] * 12)
    assert got == [1.0, 1.0, 0.0] * 4 and len(calls) == 2


def test_rg_malformed_ground_truth_raises():
    for bad in ["not json", json.dumps({"dataset": "chain_sum"}), 7, None]:
        with pytest.raises(ValueError, match="malformed reasoning-gym ground truth"):
            reward.score("rg", ["Answer: 1"], [bad])


def test_worker_pool_is_shared_by_the_ranks_of_a_node(monkeypatch):
    # under `accelerate launch` each of LOCAL_WORLD_SIZE ranks scores at once on the same cores
    checkers.close()
    monkeypatch.setattr(reward.os, "sched_getaffinity", lambda pid: set(range(8)))
    for local_world, expected in (("4", 2), ("16", 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
        assert reward.score("math", ["\\boxed{1}"], ["1"]) == [1.0]
        assert len(checkers._workers) == expected
        checkers.close()


# ------------------------------------------------------------------------------------ code
def test_code_correct_programs_pass():
    add = {"fn_name": "add", "inputs": [[1, 2], [3, 4], [0.1, 0.2]], "outputs": [3, [7], 0.3]}
    pair = {"fn_name": "pair", "inputs": [[1]], "outputs": [[[1, 2]]]}
    echo = {"inputs": ["3\n1 2 3\n", "1\n5\n"], "outputs": ["6\n1 2 3", ["5", "5"]]}
    completions = [
        "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\nDone.",
        "```python\nclass Solution:\n    def add(self, a, b):\n        return a + b\n```",
        "```py\ndef pair(x):\n    return (x, x + 1)  # a tuple vs the expected list\n```",
        "```python\nprint('draft')\n```\n```python\nn = int(input())\nxs = input().split()\n"
        "print(sum(map(int, xs)))\nprint(' '.join(xs))\n```",
        "n = int(input())\nx = input()\nprint(x)\nprint(x)   ",  # no fence: the whole completion
    ]
    twice = {"inputs": ["1\nab   cd\n"], "outputs": [["ab cd", "ab cd"]]}  # list of lines
    specs = [add, json.dumps(add), pair, echo, twice]
    assert reward.score("code", completions, specs) == [1.0] * len(completions)
    assert reward.code_reward("print(0.333333333)", stdin_spec("0.3333333333")) == 1.0


def test_code_wrong_programs_fail():
    echo = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n3", "7\n7"]}
    cases = [
        ("a, b = map(int, input().split())\nprint(a + b)\nprint(a + b)\nprint(0)", echo),  # extra
        ("a, b = map(int, input().split())\nprint(a + b)", echo),  # fewer lines than expected
        ("print(3)\nprint(3)", echo),  # passes the first test only
        ("def add(a, b):\n    return a - b", {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}),
        ("def add(a, b):\n    raise ValueError", {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}),
        ("def add(a, b) return", {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}),
        ("def other(a, b):\n    return 3", {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}),
        ("print(1000001)", stdin_spec("1000000")),  # integers compare exactly
    ]
    assert reward.score("code", [c for c, _ in cases], [s for _, s in cases]) == [0.0] * len(cases)


@pytest.fixture
def server():
    """A loopback TCP server outside the sandbox that hands a token to whoever connects."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    state = {"token": "net-token-" + os.urandom(4).hex(), "connections": 0, "stop": False}

    def serve():
        while not state["stop"]:
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            state["connections"] += 1
            conn.sendall(state["token"].encode() + b"\n")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield srv.getsockname()[1], state
    state["stop"] = True
    thread.join()
    srv.close()


@pytest.fixture
def open_dir():
    """A world-writable dir outside pytest's 0700 tree, so only the sandbox's mounts protect it
    (not also its unprivileged uid)."""
    d = Path(tempfile.mkdtemp(prefix="rw-open-"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d)


def attacks(tmp_path, port, token):
    secret = tmp_path / "secret.txt"
    secret.write_text("planted-" + os.urandom(4).hex())
    secret.chmod(0o644)
    project_file = Path(reward.__file__).resolve()
    daemon = (f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', "
              f"'import os, time\\nos.setsid()\\ntime.sleep(600)', '{MARK}'], "
              "start_new_session=True, stdout=subprocess.DEVNULL)\n")
    return {  # name: (program, expected output = what a successful attack prints, tests spec)
        "infinite loop (+ escaped daemon)": (daemon + "print(42, flush=True)\nwhile True:\n    pass",
                                             "42", None),
        "fork bomb": ("import os\nprint(42, flush=True)\nwhile True:\n    try:\n        os.fork()\n"
                      "    except OSError:\n        pass", "42", None),
        "fork past the process limit": (  # at most 200 children, each closes stdout and sleeps
            "import os, time\nn = 0\nwhile n < 200:\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        os.close(1)\n"
            "        time.sleep(3)\n        os._exit(0)\n    n += 1\nprint('unbounded' if n == 200 else n)",
            "unbounded", None),
        "allocate 100 GB": ("x = bytearray(100 * 2**30)\nprint(len(x))", str(100 * 2**30), None),
        "print without end": ("while True:\n    print('y')", "y", None),
        "os._exit(0) first": ("import os\nos._exit(0)", "42", None),
        "sys.exit(0) first": ("import sys\nsys.exit(0)", "42", None),
        "sys.exit(0) call-based": ("import sys\nsys.exit(0)\ndef f(x):\n    return x",
                                   None, {"fn_name": "f", "inputs": [[1]], "outputs": [1]}),
        "os._exit(0) in the call": ("def f(x):\n    import os\n    os._exit(0)",
                                    None, {"fn_name": "f", "inputs": [[1]], "outputs": [1]}),
        "socket to loopback": (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), "
                               "timeout=2)\nprint(s.recv(100).decode().strip())", token, None),
        "read a planted file": (f"print(open({str(secret)!r}).read())", secret.read_text(), None),
        "read the project": (f"print(open({str(project_file)!r}).read())",
                             project_file.read_text(), None),
        "print the environment": (
            "import os\nfound = os.environ.get('REWARD_TEST_SECRET', '')\n"
            "for p in os.listdir('/proc'):\n    try:\n"
            "        for kv in open(f'/proc/{p}/environ').read().split('\\0'):\n"
            "            if kv.startswith('REWARD_TEST_SECRET='):\n"
            "                found = kv.split('=', 1)[1]\n    except Exception:\n        pass\n"
            "print(found)", "env-" + token, None),
        "kill its parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                            "os.kill(-1, signal.SIGKILL)", "42", None),
        "write the caller's cwd": (f"p = {str(tmp_path / 'pwned.txt')!r}\nopen(p, 'w').write('pwned')\n"
                                   "print(open(p).read())", "pwned", None),
    }


def test_attacks_score_zero_and_leave_the_host_alone(open_dir, server, monkeypatch):
    port, state, tmp_path = *server, open_dir
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("REWARD_TEST_SECRET", "env-" + state["token"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # kill -1 bait
    try:
        for name, (code, expected, spec) in attacks(tmp_path, port, state["token"]).items():
            t = time.monotonic()
            got = reward.score("code", ["```python\n" + code + "\n```"], [spec or stdin_spec(expected)],
                               timeout=2.0)
            assert got == [0.0], name
            assert time.monotonic() - t < 10, name
            assert leftovers() == [], name
            assert host_ok() and sleeper.poll() is None, name
        assert state["connections"] == 0
        assert not (tmp_path / "pwned.txt").exists()
        # and a correct program still passes afterwards
        assert reward.code_reward("print(input())", stdin_spec("hi", "hi\n")) == 1.0
    finally:
        sleeper.kill()
        sleeper.wait()


def test_daemon_left_by_a_correct_program_is_killed():
    code = ("import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(600)', '{MARK}'], start_new_session=True, stdout=subprocess.DEVNULL, "
            "stderr=subprocess.DEVNULL)\nprint(42)")
    assert reward.code_reward(code, stdin_spec("42")) == 1.0
    assert leftovers() == []


def test_fallback_without_bwrap_still_isolates_network_and_environment(
        server, monkeypatch, capsys):
    port, state = server
    monkeypatch.setattr(sandbox, "BWRAP", None)
    monkeypatch.setenv("REWARD_TEST_SECRET", "env-secret")
    net = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
           "print(s.recv(100).decode().strip())")
    env = "import os\nprint(os.environ.get('REWARD_TEST_SECRET'))"
    completions = ["print(input()[::-1])", net, env, "import os\nos._exit(0)"]
    specs = [stdin_spec("cba", "abc\n"), stdin_spec(state["token"]), stdin_spec("env-secret"),
             stdin_spec("42")]
    assert reward.score("code", completions, specs, timeout=2.0) == [1.0, 0.0, 0.0, 0.0]
    assert state["connections"] == 0
    assert "NOT isolated" in capsys.readouterr().err
    assert leftovers() == []


# ------------------------------------------------------------------------ configuration
def test_bad_configuration_raises_value_error_naming_the_value():
    with pytest.raises(ValueError, match="'chess'.*'rg'"):
        reward.score("chess", ["x"], ["y"])
    for bad in ["not json {", {"inputs": ["1"]}, {"inputs": ["1"], "outputs": []},
                {"inputs": [], "outputs": []}, {"inputs": [[1]], "outputs": [1], "fn_name": 3}, 7]:
        with pytest.raises(ValueError, match="malformed test spec"):
            reward.score("code", ["print(1)"], [bad])
    with pytest.raises(ValueError, match="not json"):
        reward.code_reward("print(1)", "not json {")
    with pytest.raises(ValueError, match="2 completions but 1"):
        reward.score("math", ["a", "b"], ["1"])
    with pytest.raises(ValueError, match="None"):
        reward.score("math", ["\\boxed{1}"], [None])


def test_bad_model_output_never_raises():
    junk = [None, 3, "\ud800", "\\boxed{\\frac{", "```python\n\ud800\n```", "\0" * 100]
    assert reward.score("math", junk, ["1"] * len(junk)) == [0.0] * len(junk)
    assert reward.score("code", junk, [stdin_spec("1")] * len(junk)) == [0.0] * len(junk)


def test_batch_results_keep_input_order():
    n = 12
    completions = [f"\\boxed{{{i if i % 3 else -1}}}" for i in range(n)]
    assert reward.score("math", completions, [str(i) for i in range(n)], workers=3) == \
        [0.0 if i % 3 == 0 else 1.0 for i in range(n)]
    codes = [f"print({i if i % 2 else -1})" for i in range(n)]
    assert reward.score("code", codes, [stdin_spec(str(i)) for i in range(n)], workers=3) == \
        [0.0 if i % 2 == 0 else 1.0 for i in range(n)]


def test_concurrent_trainers_do_not_kill_each_others_sandboxes():
    # Two processes scoring code at the same time (two sweep jobs, or two GPU ranks on one node).
    # After each run every process of that run's uid is killed, so if both processes drew sandbox
    # uids from one pool, one's clean-up would kill the other's running program (scored 0).
    # Each program sleeps 0.3 s so that runs of the two processes overlap.
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import reward\n"
        "code = '```python\\nimport time\\ndef f(x):\\n    time.sleep(0.3)\\n    return x + 1\\n```'\n"
        "spec = '{\"fn_name\": \"f\", \"inputs\": [[1], [2]], \"outputs\": [2, 3]}'\n"
        "print(sum(reward.score('code', [code] * 16, [spec] * 16, workers=4)))\n")
    root = str(Path(__file__).resolve().parents[1])
    procs = [subprocess.Popen([sys.executable, "-c", script, root], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    got = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert got == ["16.0", "16.0"], f"correct programs scored {got} of 16 each"


@pytest.mark.slow
def test_rewards_do_not_depend_on_the_machines_load():
    """bench/reward_under_load.py's batch at a 1 CPU-s limit: right, wrong and hostile programs
    (a loop, a sleep, a fork bomb, 100 GB) and math answers get the same rewards on a quiet
    machine and under 16 busy processes (each in its own session, as other jobs), the rewards
    wanted, and the hostile ones end within bounded time (the 10 s wall-clock guard). The former
    wall-clock limit of 1 s scored the 0.5 CPU-s right program and a right math answer 0 under
    such load (measured on a 2-core EPYC)."""
    from bench.reward_under_load import MATH, PROGRAMS, busy, score_batch
    want = [r for *_, r in PROGRAMS] + [r for *_, r in MATH]
    quiet, t_quiet = score_batch(1.0)
    with busy(16):
        loaded, t_loaded = score_batch(1.0)
    assert quiet == want and loaded == want, (quiet, loaded)
    assert t_quiet < 30 and t_loaded < 120, (t_quiet, t_loaded)


# ---- reward parts (train.py --reward) ----

def _completion(text, n_tokens=5, task="math", max_tokens=16, buffer=4):
    row = {"task": task, "problem": "1 + 1 = ?", "ground_truth": "2"}
    return reward.Completion(text, n_tokens, n_tokens >= max_tokens, row, max_tokens, buffer)


def test_reward_parts_by_hand():
    """format: 1 where the task's extraction finds an answer; length: -tokens / max_tokens;
    overlong: minus DAPO's soft punishment (0 up to max - buffer, -1 at max)."""
    assert reward.format_part(_completion("so \\boxed{2}")) == 1.0
    assert reward.format_part(_completion("it is two")) == 0.0
    assert reward.format_part(_completion("```python\nprint(2)\n```", task="code")) == 1.0
    assert reward.length_part(_completion("x", n_tokens=4)) == -0.25
    assert [reward.overlong_part(_completion("x", n_tokens=n)) for n in (12, 13, 14, 16)] == \
        [-0.0, -0.25, -0.5, -1.0]
    assert set(reward.PARTS) == {"format", "length", "overlong"}


def test_a_part_that_raises_on_model_output_scores_zero(monkeypatch):
    def picky(c):
        if "boom" in c.text:
            raise RuntimeError("bad output")
        return 1.0
    monkeypatch.setitem(reward.PARTS, "picky", picky)
    assert reward.part_values("picky", [_completion("fine"), _completion("boom")]) == [1.0, 0.0]
