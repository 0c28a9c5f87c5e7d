"""
The code sandbox of reward.py: run a model-written Python program once, isolated, and return
its stdout.

    sandbox.check()                                 # once: a trivial program must work
    out = sandbox.run(code, b"3\n", None, 5.0)      # stdout (bytes), or None past a limit / flood
    out = sandbox.run(code, calls_json, (mark, "f"), 5.0)   # call-based: f(*args) per call

Choices:
1. Every program runs in a fresh `python -I -S` inside bubblewrap: no network, read-only /usr
   and Python prefix, a private 16 MiB /tmp as working dir, nothing else of the file system, an
   empty environment; rlimits set by `prlimit` before exec (a preexec_fn is unsafe in the
   multi-threaded trainer); stdout read up to a byte cap; tree killed after.
   A program is judged by its CPU time, not the wall clock, so a reward does not depend on what
   else the machine is doing: past `cpu_limit` seconds of CPU, summed over all its processes
   (a fork bomb's too), it fails. A wall-clock guard of WALL_GUARD x cpu_limit stops programs that
   block without computing (a sleep); load cannot reach it unless a program that computes gets
   under 1/WALL_GUARD of a core. RLIMIT_CPU per process backs the sum up.
2. The kernel skips RLIMIT_NPROC for root, also for root in a user namespace. So as root the
   outer bwrap unshares all but the user namespace, `setpriv` drops to an unused uid of its own
   per concurrent run, and an inner bwrap adds a user namespace with --disable-userns (else the
   program could create one and mount a tmpfs of unbounded size).
3. Expected outputs never enter the sandbox: it returns what the program printed, and the caller
   compares. Call-based problems run all their calls in one interpreter through a small harness
   (_HARNESS) that prints JSON results after the caller's random marker.
4. Without bwrap we fall back to rlimits + `unshare` (network and pid namespaces) + a temp dir,
   and say once, loudly, what is not isolated.
5. `check` runs a trivial program once per mode and raises SandboxError if it fails: a broken
   sandbox is configuration, and would otherwise score every program 0 in silence.
"""
import functools
import math
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

CODE_MAX_OUTPUT = 4 << 20  # stdout bytes read per run; more is a failure, never truncated
CODE_MEMORY = 1 << 30      # RLIMIT_AS per sandboxed process (bytes)
CODE_NPROC = 8             # RLIMIT_NPROC (processes + threads) of a sandbox's uid
CODE_FILE_SIZE = 16 << 20  # RLIMIT_FSIZE and the size of the sandbox's /tmp (bytes)
WALL_GUARD = 10            # wall-clock guard, x the CPU limit (choice 1)
CPU_POLL_S = 0.1           # how often a running program's CPU time is read (after its first 0.2 s)
_TICK = os.sysconf("SC_CLK_TCK")
_KILLED = {128 + signal.SIGXCPU, 128 + signal.SIGKILL, -signal.SIGXCPU, -signal.SIGKILL}
# as root: sandboxes run as uids from here to ~3.17e9 (must be unused)
SANDBOX_UID_BASE = 2_100_000_000
BWRAP = shutil.which("bwrap")     # None selects the weaker fallback (tests flip it)
_TOOLS = {t: shutil.which(t) or f"/usr/bin/{t}" for t in ("prlimit", "setpriv", "unshare")}

_uid_pool, _uid_lock = {}, threading.Lock()


def _uids():
    """This process's own sandbox uids: BASE + (pid mod 2^22) * 256 + k, k < 256 (a FIFO, so a
    just-used uid rests while others run). Living processes have distinct pids (Linux caps them
    at 2^22), so concurrent trainers (sweep jobs, one rank per GPU) never share a uid: they must
    not, since after each run every process of the run's uid is killed, and RLIMIT_NPROC counts
    the tasks of a uid. Made on first use in each process, so a forked child gets its own."""
    with _uid_lock:
        if os.getpid() not in _uid_pool:
            q, base = queue.Queue(), SANDBOX_UID_BASE + (os.getpid() % (1 << 22)) * 256
            for k in range(256):
                q.put(base + k)
            _uid_pool.clear()
            _uid_pool[os.getpid()] = q
        return _uid_pool[os.getpid()]


_checked, _warned = set(), set()
_HARNESS = r"""
import json, os, sys
sys.set_int_max_str_digits(0)
path, mark, fn = sys.argv[1:4]
calls = json.loads(sys.stdin.read())
ns = {"__name__": "solution"}  # not __main__: a solution's own test block must not run
exec(compile(open(path).read(), "solution.py", "exec"), ns)
f = ns.get(fn) or getattr(ns["Solution"](), fn)  # a function, or a LeetCode-style class
enc = lambda o: list(o) if hasattr(o, "__iter__") else repr(o)  # sets, generators, ...
for args in calls:
    try:
        out = json.dumps(f(*args), default=enc)
    except BaseException:
        out = "!"
    os.write(1, ("\n" + mark + out + "\n").encode())  # fd 1: immune to a replaced sys.stdout
"""


class SandboxError(RuntimeError):
    """The sandbox itself does not work (configuration, not model output)."""


def _pids(uid):
    pids = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and os.stat(f"/proc/{p}").st_uid == uid:
                pids.append(int(p))
        except OSError:
            pass
    return pids


def _tree_cpu(root):
    """CPU seconds used so far by process `root` and all its descendants, live ones and those
    already reaped (counted in their parents' cutime/cstime): one pass over /proc."""
    parent, ticks = {}, {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()   # after the command name
        except OSError:
            continue
        parent[int(p)] = int(fields[1])
        ticks[int(p)] = sum(int(x) for x in fields[11:15])    # utime stime cutime cstime
    children = {}
    for p, pp in parent.items():
        children.setdefault(pp, []).append(p)
    total, todo = 0, [root]
    while todo:
        p = todo.pop()
        total += ticks.get(p, 0)
        todo += children.get(p, [])
    return total / _TICK


def _over_cpu(proc, cpu_limit, started):
    return time.monotonic() - started > 0.2 and _tree_cpu(proc.pid) > cpu_limit


@functools.lru_cache(None)
def _view():
    """bwrap arguments for the file system a program sees: system, Python, /tmp."""
    args = ["--die-with-parent", "--new-session", "--clearenv", "--ro-bind", "/usr", "/usr"]
    for p in ("/bin", "/lib", "/lib64", "/sbin"):  # merged-/usr symlinks, or real dirs
        args += ["--symlink", os.readlink(p), p] if os.path.islink(p) else \
                ["--ro-bind", p, p] if os.path.isdir(p) else []
    for prefix in {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}:
        if prefix == "/usr" or prefix.startswith("/usr/"):
            continue
        parts = prefix.strip("/").split("/")  # e.g. /root/.pyenv/versions/3.11.7: make the
        for k in range(1, len(parts)):        # parents traversable (/root itself is 0700)
            args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:k])]
        args += ["--ro-bind", prefix, prefix]
    return args + ["--proc", "/proc", "--dev", "/dev", "--perms", "1777",
                   "--size", str(CODE_FILE_SIZE), "--tmpfs", "/tmp", "--chdir", "/tmp"]


def _sandbox_argv(d, uid, cpu_limit):
    root, nproc = os.geteuid() == 0, CODE_NPROC
    if not root:  # RLIMIT_NPROC counts all tasks of the uid, the trainer's threads included
        for p in _pids(os.geteuid()):
            try:
                nproc += len(os.listdir(f"/proc/{p}/task"))
            except OSError:
                pass
    cpu = math.ceil(cpu_limit) + 1   # per process, backing up the summed limit: SIGXCPU, KILL
    argv = [_TOOLS["prlimit"], f"--as={CODE_MEMORY}", f"--cpu={cpu}:{cpu + 1}",
            f"--nproc={nproc}", f"--fsize={CODE_FILE_SIZE}", "--nofile=64", "--core=0", "--"]
    if BWRAP and root:
        return argv + [BWRAP, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                       "--unshare-cgroup-try", *_view(), "--ro-bind", d, "/sandbox",
                       _TOOLS["setpriv"], f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                       "--bounding-set=-all", "--inh-caps=-all", "--",
                       BWRAP, "--unshare-user", "--disable-userns", "--die-with-parent",
                       "--dev-bind", "/", "/", "--"], "/sandbox/solution.py"
    if BWRAP:
        return argv + [BWRAP, "--unshare-all", "--unshare-user", "--disable-userns", *_view(),
                       "--ro-bind", d, "/sandbox", "--"], "/sandbox/solution.py"
    if "fallback" not in _warned:
        _warned.add("fallback")
        print("reward.py: WARNING bubblewrap (bwrap) not found; programs run with rlimits, no "
              "network and their own pid namespace (unshare) in a temp dir, but NOT isolated "
              "from the file system (they can read and write what this user can)"
              + (" and, as root, with no process-count limit" if root else "")
              + ". Install it: apt-get install -y bubblewrap", file=sys.stderr, flush=True)
    return argv + [_TOOLS["unshare"], "--net", "--pid", "--fork", "--kill-child"] + (
        [] if root else ["--map-root-user"]) + ["--"], os.path.join(d, "solution.py")


def run(code, stdin, call, cpu_limit):
    """Run `code` once in a fresh sandbox; its stdout, or None past its CPU limit (`cpu_limit`
    seconds over all its processes), its wall-clock guard or the output cap (choice 1).
    `call`: None (the program reads `stdin`), or (marker, function name): _HARNESS calls the
    function on each argument list of the JSON in `stdin` (choice 3)."""
    uid = _uids().get()
    try:
        with tempfile.TemporaryDirectory(prefix="rwsbx-") as d:
            for name, data in (("solution.py", code.encode("utf-8", "replace")), ("stdin", stdin)):
                with open(os.path.join(d, name), "wb") as f:
                    f.write(data)
                os.chmod(f.name, 0o644)
            os.chmod(d, 0o755)  # the unprivileged sandbox uid must read the program
            argv, prog = _sandbox_argv(d, uid, cpu_limit)
            argv += [os.path.realpath(sys.executable), "-I", "-S"]
            argv += ["-c", _HARNESS, prog, *call] if call else [prog]
            with open(os.path.join(d, "stdin"), "rb") as fin:
                proc = subprocess.Popen(argv, stdin=fin, stdout=subprocess.PIPE, cwd=d, env={},
                                        stderr=subprocess.DEVNULL, start_new_session=True)
            out, started = bytearray(), time.monotonic()
            guard = started + WALL_GUARD * cpu_limit
            try:
                while True:  # bounded read: never communicate() with a program that prints forever
                    left = guard - time.monotonic()
                    if left <= 0 or _over_cpu(proc, cpu_limit, started):
                        return None
                    if not select.select([proc.stdout], [], [], min(left, CPU_POLL_S))[0]:
                        continue
                    chunk = os.read(proc.stdout.fileno(), 1 << 16)
                    if not chunk:  # EOF: every process holding stdout has ended or closed it
                        break
                    out += chunk
                    if len(out) > CODE_MAX_OUTPUT:
                        return None
                while proc.poll() is None:   # its exit says whether a limit stopped it
                    if time.monotonic() > guard or _over_cpu(proc, cpu_limit, started):
                        return None
                    time.sleep(0.01 if time.monotonic() - started < 0.2 else CPU_POLL_S)
                return None if proc.returncode in _KILLED else bytes(out)
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # unreaped, so the group is still ours
                except ProcessLookupError:
                    pass
                proc.wait()
                proc.stdout.close()
                # Killing bwrap tears its pid namespace down asynchronously; wait until the uid
                # is empty so nothing outlives the call and the uid is clean for reuse.
                end = time.monotonic() + 5
                while BWRAP and os.geteuid() == 0 and _pids(uid) and time.monotonic() < end:
                    for p in _pids(uid):
                        try:
                            os.kill(p, signal.SIGKILL)
                        except OSError:
                            pass
                    time.sleep(0.005)
    finally:
        _uids().put(uid)


def check():
    """Once per mode: a trivial program must work, or every reward would silently be 0."""
    if BWRAP not in _checked:
        if run("print(6 * 7)", b"", None, 30) != b"42\n":
            argv, _ = _sandbox_argv(tempfile.gettempdir(), SANDBOX_UID_BASE, 30)
            raise SandboxError(f"the code sandbox cannot run a trivial program: {argv}")
        _checked.add(BWRAP)

