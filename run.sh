#!/usr/bin/env bash
# Train one cell of the GPPO grid (or a known method / baseline) and evaluate it.
#
#   bash run.sh DIVERGENCE ESTIMATOR [--flag=value ...]   e.g. bash run.sh kl atomic --lr=1e-4
#   bash run.sh METHOD [--flag=value ...]                 grpo ppo dapo dppo ripo (cells)
#                                                         gspo gmpo sapo cispo clip_cov (baselines)
#   bash run.sh sweep [--flag=value ...]                  every cell and baseline, 3 seeds (bench/sweep.py)
#   DIVERGENCE: tv chi2 kl hellinger js      ESTIMATOR: mc atomic binary
#
# Embedded default (2-core CPU, no GPU, no hub): builds data/tiny on first use (~3 min), trains
# 60 iterations of 64 prompts x 8 completions with 8 updates each, then scores avg@8 on the
# held-out tiny-math and tiny-code problems, before (warm start) and after. See README for the
# measured time. Extra flags go to train.py (python train.py -h lists them all).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "no $PY: run 'bash setup.sh' first (or set PY=python)"; exit 1; }
usage() { sed -n '2,13p' "$0"; exit 2; }
[ $# -ge 1 ] || usage
[ "$1" = sweep ] && { shift; exec "$PY" bench/sweep.py "$@"; }   # the grid x seeds, resumable
DIVERGENCES="tv chi2 kl hellinger js"; ESTIMATORS="mc atomic binary"
OBJ=(--objective gppo)
case "$1" in
    grpo|ppo) set -- tv mc "${@:2}" ;;     # PPO / GRPO clip [0.8, 1.2]
    dapo)     set -- kl mc "${@:2}" ;;     # clip-higher [e^-delta, e^delta]
    dppo)     set -- tv binary "${@:2}" ;; # |pi - mu| <= delta
    ripo)     set -- chi2 atomic "${@:2}" ;; # 1 +- sqrt(delta / mu)
    gspo|gmpo|sapo|cispo|clip_cov) OBJ=(--objective "$1"); NAME=$1; shift ;;
esac
if [ "${OBJ[1]}" = gppo ]; then
    [ $# -ge 2 ] || usage
    D=$1 E=$2; shift 2
    [[ " $DIVERGENCES " == *" $D "* ]] || { echo "unknown divergence '$D'; accepted: $DIVERGENCES"; exit 2; }
    [[ " $ESTIMATORS " == *" $E "* ]] || { echo "unknown estimator '$E'; accepted: $ESTIMATORS"; exit 2; }
    OBJ+=(--divergence "$D" --estimator "$E"); NAME=$D-$E
fi
OUT=${OUT:-out/$NAME}

[ -f data/tiny/model/config.json ] || "$PY" data/prepare.py
if [ ! -f data/tiny/eval_start.json ]; then    # the warm-start model's score, computed once
    "$PY" eval.py --model data/tiny/model --out data/tiny/eval_start.json
fi

# one process per GPU under Accelerate when several are present, else a single process
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l || true)
if [ "${NGPU:-0}" -gt 1 ]; then
    LAUNCH=("$PY" -m accelerate.commands.launch --num_processes "$NGPU" train.py)
else
    LAUNCH=("$PY" train.py)
fi
mkdir -p "$(dirname "$OUT")"
start=$(date +%s)
"${LAUNCH[@]}" "${OBJ[@]}" --out_dir "$OUT" --eval_data tiny-math,tiny-code "$@" | tee "$OUT.log"
echo "warm start : $(cat data/tiny/eval_start.json)"
echo "trained    : $(grep '"eval"' "$OUT.log" | tail -1)"
echo "done in $(( $(date +%s) - start ))s: policy $OUT/final, metrics $OUT/metrics.jsonl, plot $OUT/dynamics.png, log $OUT.log"
