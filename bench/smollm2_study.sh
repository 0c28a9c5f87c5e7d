#!/bin/bash
# The cells on the real model (issue 51): tv-mc (GRPO), kl-atomic (the paper's best) and tv-binary
# (DPPO) on SmolLM2-135M-Instruct, configs/smollm2_cpu.args (bench/stats.py TASKS["smollm2"]), with
# the trust region given room to bind: the paper's 8 AdamW steps per batch (16 prompts, 2 per step)
# and no --target_kl guard; 30 iterations (the preset's reward is past 0.8 by iteration ~7 and
# flat after ~15: bench/results/smollm2/metrics.jsonl). K0: as the preset samples; K2: the sampler
# two iterations behind, coupled (--mu_source vllm: the region bounds pi against the sampler's mu).
#
#   bash bench/smollm2_study.sh            # every run not finished yet, two at a time, one thread each
#   SEEDS=0-1 bash bench/smollm2_study.sh  # only these seeds (each piece ends with its tables,
#                                          # published to bench/results/sweep-smollm2*/)
#
# bench/sweep.py does the rest: paired seeds, a finished run (result.json) is kept, an unfinished
# one is redone, the settings of every run checked against the first's. Seeds go two at a time so
# that each pair of seeds completes all three cells before the next starts.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CELLS=grpo,kl-atomic,dppo
COMMON=(--task smollm2 --only "$CELLS" --target_kl 0 --prompts_per_update 2 --iters 30 --jobs 2)
K0=(--out out/sweep-smollm2 --publish_dir bench/results/sweep-smollm2)
K2=(--out out/sweep-smollm2-k2 --publish_dir bench/results/sweep-smollm2-k2 --async_lag 2 --mu_source vllm)
SEEDS=${SEEDS:-"0-1 2-3"}

arm() { for seeds in $SEEDS; do "$PY" bench/sweep.py "${COMMON[@]}" "$@" --seeds "$seeds" --publish; done; }
arm "${K0[@]}"
arm "${K2[@]}"
