#!/usr/bin/env bash
# Train one cell of the GPPO grid (or a known method / baseline), then compare avg@8 before/after.
#
#   bash run.sh DIVERGENCE ESTIMATOR [--flag=value ...]   e.g. bash run.sh kl atomic --seed=1
#   bash run.sh METHOD [--flag=value ...]                 grpo ppo dapo dppo ripo (cells), or a
#                                                         baseline: gspo gmpo sapo cispo clip_cov drpo dgpo
#   bash run.sh smollm2 [--flag=value ...]                SmolLM2-135M-Instruct on a reasoning-gym task
#   bash run.sh sweep [--flag=value ...]                  the comparison with statistics (bench/sweep.py)
#   DIVERGENCE: tv chi2 kl hellinger js      ESTIMATOR: mc atomic binary   (python train.py -h: all flags)
#
# Embedded default (2-core CPU, no GPU, no hub): the committed warm-start model data/tiny/model
# (data/prepare.py --force rebuilds it), 60 iterations of 64 prompts x 8 completions; 5-7 min
# on a 2-core Xeon (README "Results"). smollm2: configs/smollm2_cpu.args, about 22 min. Extra flags go to train.py.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "no $PY: run 'bash setup.sh' first (or set PY=python)"; exit 1; }
usage() { sed -n '2,13p' "$0"; exit 2; }
[ $# -ge 1 ] || usage
[ "$1" = sweep ] && { shift; exec "$PY" bench/sweep.py "$@"; }   # cells x seeds, resumable

# DIVERGENCE ESTIMATOR, or one name that train.py maps through gppo.METHODS / gppo.BASELINES
if [ "$1" = smollm2 ]; then
    [ -f data/smollm2/model/config.json ] || "$PY" data/smollm2.py       # once: GGUF -> HF folder
    ARGS=(@configs/smollm2_cpu.args); NAME=smollm2; shift
elif [ $# -ge 2 ] && [[ "$2" != --* ]]; then
    ARGS=(--divergence "$1" --estimator "$2" --eval_data tiny-math,tiny-code); NAME=$1-$2; shift 2
else
    ARGS=(--method "$1" --eval_data tiny-math,tiny-code); NAME=$1; shift
fi
OUT=${OUT:-out/$NAME}
[ -f data/tiny/model/config.json ] || "$PY" data/prepare.py            # committed; rebuilt only if deleted

# one process per GPU under Accelerate when several are present, else a single process
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l || true)
if [ "${NGPU:-0}" -gt 1 ]; then
    LAUNCH=("$PY" -m accelerate.commands.launch --num_processes "$NGPU" train.py)
else
    LAUNCH=("$PY" train.py)
fi
mkdir -p "$OUT"
start=$(date +%s)
"${LAUNCH[@]}" "${ARGS[@]}" --out_dir "$OUT" --eval_before "$@" 2>&1 | tee "$OUT.log"
"$PY" eval.py --compare "$OUT/eval_start.json" "$OUT/eval.json"
echo "done in $(( $(date +%s) - start ))s: policy $OUT/final, metrics $OUT/metrics.jsonl, plot $OUT/dynamics.png, log $OUT.log"
