"""Shared by the test files that run train.py: the tiny model fixture and subprocess helpers.

The tiny model (data/prepare.py into a tmp folder, ~15-25 s) is built once per pytest session.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # repo root, so `rollout` imports

PY = sys.executable  # the venv's interpreter when run as the docstring says
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}
ENV.pop("PY", None)  # run.sh reads PY; use its default (.venv/bin/python)


def run(cmd, timeout=240, **kw):
    """Run a command from the repo root; returns (CompletedProcess, seconds)."""
    t = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout, **kw)
    return proc, time.time() - t


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def load_params(model_dir):
    from safetensors.torch import load_file
    return load_file(str(Path(model_dir) / "model.safetensors"))


def metrics(out):
    """Every row of a run's metrics.jsonl."""
    return [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]


def update_of(out, tiny):
    """The whole change of a run's final weights from the tiny start model, flattened (float64)."""
    start, final = load_params(tiny / "model"), load_params(Path(out) / "final")
    return torch.cat([(final[k].double() - start[k].double()).flatten() for k in sorted(start)])


def max_param_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# ----------------------------------------------------------------------------------------------
# the tiny model, once per session

@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny model and data sets: TMP/model, TMP/{math,code}_{train,test}.jsonl."""
    d = tmp_path_factory.mktemp("tiny")
    # --threads 1: with 2 threads on a busy 2-core machine the warm start is ~20x slower
    ok(run([PY, "data/prepare.py", "--out", str(d), "--n_math_train", "40", "--n_math_test", "20",
            "--hidden", "64", "--heads", "2", "--layers", "2", "--steps", "200", "--batch_size", "32",
            "--lr", "1e-2", "--warmup", "5", "--threads", "1", "--n_val", "10", "--target", "1.01",
            "--q_math", "1", "--q_code", "1"], timeout=300)[0])
    assert (d / "model" / "config.json").is_file() and (d / "math_train.jsonl").is_file()
    return d
