"""Run a command and measure it: wall time, the peak summed RSS of its process tree (the trainer
and vLLM's engine process, sampled every 0.2 s with psutil) and the largest single process's peak
RSS (ru_maxrss from wait4). Shared by bench_trl.py and bench_lora.py."""
import os
import subprocess
import threading
import time

import psutil


def run_measured(cmd, log_path, cwd=None):
    """Run cmd; return (returncode, wall s, peak summed RSS of the tree GB, largest single GB)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        peak, done, t0 = [0], threading.Event(), time.time()

        def sample():
            root = psutil.Process(proc.pid)
            while not done.is_set():
                try:
                    rss = sum(q.memory_info().rss for q in [root] + root.children(recursive=True))
                    peak[0] = max(peak[0], rss)
                except psutil.Error:
                    pass
                done.wait(0.2)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        _, status, usage = os.wait4(proc.pid, 0)   # ru_maxrss: max over the child and its children
        proc.returncode = os.waitstatus_to_exitcode(status)
        done.set()
        th.join()
    return proc.returncode, time.time() - t0, peak[0] / 1e9, usage.ru_maxrss * 1024 / 1e9
