"""
The checker processes of reward.py: persistent workers that judge answers (math-verify,
reasoning-gym), each killed and replaced when an item runs past its CPU-time limit.

    checkers.start(4)                              # reward.score does this for tasks that use them
    checkers.verdict("math", gold, answer, 5.0)    # 1.0 or 0.0, within 5 s of CPU time
    checkers.close()                               # also at exit; the next start makes new ones

Choices:
1. An item is judged by its CPU time, not the wall clock, so a verdict does not depend on what
   else the machine is doing: the worker's RLIMIT_CPU is set to what it has used plus the item's
   limit before each item, and SIGXCPU ends it past that (in C too: sympy stuck on an exponent
   tower, a reasoning-gym checker on "x**(9**9**9)"). math-verify's own timeouts are off: they are
   wall-clock alarms. The caller reads every reply with a wall-clock guard of
   sandbox.WALL_GUARD x the limit, for a worker that blocks without computing; a worker that died
   or passed the guard scores 0, is killed and a replacement takes its place in the pool.
2. Workers start on first use and are reused; the first item of a kind loads its checker with no
   item limit (importing sympy or reasoning-gym takes seconds). They are closed at exit.
3. One JSON line in, one line out, on private copies of stdin/stdout: a checker that prints or
   reads input (even from C) cannot corrupt the protocol.
4. A worker has an address-space limit (MATH_WORKER_MEM) and no core dumps. It runs in its own
   session: Ctrl-C in the terminal is the trainer's.
"""
import atexit
import functools
import json
import math
import os
import queue
import resource
import select
import subprocess
import sys
import threading
import time

from infra.sandbox import WALL_GUARD

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
MATH_WORKER_MEM = 4 << 30  # address-space limit of a checker worker, math or rg (bytes)


def _checker(kind):
    """In a worker: import `kind`'s checker, a function (gold, answer, limit) -> bool."""
    # The checkers are imported here, in the worker only: they take seconds to import, and the
    # trainer's process never runs them.
    if kind == "math":
        from math_verify import LatexExtractionConfig, parse, verify
        config = [LatexExtractionConfig()]

        def parse_boxed(s):   # no timeout of math-verify's own: its alarms count wall time
            return parse("\\boxed{" + s + "}", config, parsing_timeout=None)
        gold_cache = functools.lru_cache(4096)(parse_boxed)

        def judge(gold, answer, limit):
            return verify(gold_cache(gold), parse_boxed(answer), timeout_seconds=None)
        return judge
    import reasoning_gym  # kind == "rg" (reward.py's rg task: score_answer, binary)
    # one data set object per (name, config); seed and size do not matter to score_answer
    make = functools.lru_cache(64)(
        lambda name, cfg: reasoning_gym.create_dataset(name, **json.loads(cfg)))

    def judge(gold, answer, limit):
        g = json.loads(gold)
        data_set = make(g["dataset"], json.dumps(g["config"], sort_keys=True))
        # full credit only: rewards stay binary though some scores give partial credit
        return data_set.score_answer(answer, g["entry"]) >= 1.0
    return judge


def _worker_main():
    """Worker main loop, one JSON line in, one line out: ["load", kind] -> 'ready' (or 'error ...');
    [kind, gold, answer, limit] -> '1' or '0'."""
    resource.setrlimit(resource.RLIMIT_AS, (MATH_WORKER_MEM, MATH_WORKER_MEM))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # The protocol gets private copies of stdin/stdout: a checker that prints or reads input
    # (even from C) must not corrupt it, so fds 0 and 1 become /dev/null and stderr.
    lines, out = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    judges = {}
    for line in lines:
        msg = json.loads(line)
        if msg[0] == "load":  # import time (sympy, reasoning-gym: seconds) is not an item's limit
            try:
                judges[msg[1]] = _checker(msg[1])
                print("ready", file=out, flush=True)
            except BaseException as e:
                print("error", repr(e)[:500].replace("\n", " "), file=out, flush=True)
            continue
        kind, gold, answer, limit = msg
        # the item's CPU limit (choice 1): SIGXCPU ends the worker past it, even inside C
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(used + limit), resource.RLIM_INFINITY))
        try:
            ok = judges[kind](gold, answer, limit)
        except BaseException:  # math-verify's TimeoutException is one; checkers may raise
            ok = False
        print(int(bool(ok)), file=out, flush=True)


_INSTALL = {"math": "math-verify (pip install -r requirements.txt)",
            "rg": "reasoning-gym (pip install reasoning-gym==0.1.25)"}


class _Worker:
    """A checker worker process and a line protocol with a deadline on every read."""

    def __init__(self):
        # `-m` from the repository root: sys.path[0] is the root, not infra/, whose module names
        # (flags, metrics, ...) would otherwise shadow same-named packages a checker imports
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "infra.checkers", "--worker"], bufsize=0, cwd=_ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True)  # not in the trainer's process group: Ctrl-C is the trainer's
        self.buf, self.loaded = b"", set()

    def _readline(self, timeout):
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                return None  # the worker died
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def _send(self, msg):
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            return True
        except OSError:
            return False

    def ask(self, kind, gold, answer, limit):
        """b'1' / b'0', or None when the worker is stuck or dead (then it must be replaced)."""
        if kind not in self.loaded:  # first item of this kind: import its checker, unhurried
            reply = self._readline(120) if self._send(["load", kind]) else None
            if reply != b"ready":
                got = (reply or b'no reply').decode(errors='replace')
                raise RuntimeError(f"the {kind} checker failed to load in a reward worker ({got}); "
                                   f"is {_INSTALL[kind]} installed? try: cd {_ROOT} && "
                                   f"{sys.executable} -m infra.checkers --worker")
            self.loaded.add(kind)
        sent = self._send([kind, gold, answer, limit])
        return self._readline(WALL_GUARD * limit) if sent else None

    def kill(self):
        self.proc.kill()
        self.proc.wait()


_pool_lock = threading.Lock()
_workers, _idle = [], queue.Queue()


def start(n):
    """Start workers until the pool has `n`."""
    with _pool_lock:  # persistent workers, started on first use
        while len(_workers) < n:
            _workers.append(_Worker())
            _idle.put(_workers[-1])


def verdict(kind, gold, answer, limit):
    """1.0 if `kind`'s checker accepts `answer` for `gold` within `limit` seconds, else 0.0."""
    worker = _idle.get()
    try:
        reply = worker.ask(kind, gold, answer, limit)
        if reply is None:  # stuck or crashed: kill it, start a replacement in its place
            worker.kill()
            with _pool_lock:
                new = _Worker()
                _workers[:] = [new if w is worker else w for w in _workers]
            worker = new
    finally:
        _idle.put(worker)
    return 1.0 if reply == b"1" else 0.0


def close():
    """Stop the checker workers (also done at exit); the next score() starts new ones."""
    global _idle
    with _pool_lock:
        for worker in _workers:
            worker.kill()
        _workers.clear()
        _idle = queue.Queue()


atexit.register(close)

if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker_main()
