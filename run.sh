#!/usr/bin/env bash
# Train one cell of the GPPO grid (or a known method / baseline), then compare avg@8 before/after.
#
#   bash run.sh DIVERGENCE ESTIMATOR [--flag=value ...]   e.g. bash run.sh kl atomic --seed=1
#   bash run.sh METHOD [--flag=value ...]                 grpo ppo dapo dppo ripo (cells), or a
#                                                         baseline: gspo gmpo sapo cispo clip_cov drpo dgpo
#   bash run.sh smollm2 [--flag=value ...]                SmolLM2-135M-Instruct on a reasoning-gym task
#   bash run.sh sweep [--flag=value ...]                  the comparison with statistics (bench/sweep.py)
#   DIVERGENCE: tv chi2 kl hellinger js alpha:A (e.g. alpha:0.5)   ESTIMATOR: mc atomic binary
#   (python train.py -h: all flags)
#   --task rare (any position; also for sweep): the rare-answer task, data/tiny_rare and its data set
#   tiny-rare-math (data/prepare.py --variant rare), about 2 min; its runs go to out/<name>-rare-seed<seed>.
#   Extra flags go to train.py. The run's folder is --out_dir (or OUT=...), by default
#   out/<name>-seed<seed> (e.g. out/kl-atomic-seed7), with its log beside it (out/kl-atomic-seed7.log).
#   A folder that holds a run is never overwritten: add --resume to continue it, --overwrite to
#   start it afresh.
#
# Embedded default (2-core CPU, no GPU, no hub): the committed warm-start model data/tiny/model
# (data/prepare.py --force rebuilds it), 60 iterations of 64 prompts x 8 completions and two
# evaluations. Whole command: 274-421 s on a 2-core Intel Xeon (across days), 254-384 s (4-6 s per
# iteration) on a 2-core AMD EPYC (README "Results"). smollm2 (configs/smollm2_cpu.args, 40
# iterations): about 22 min on the Xeon (29.6 s per iteration), 44 min on the EPYC (57 s: it has
# AVX-512 BF16 but no AMX).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "no $PY: run 'bash setup.sh' first (or set PY=python)"; exit 1; }
usage() { sed -n '2,23p' "$0"; exit 2; }
# a refused value in argparse's form, as train.py's: usage, "run.sh: error: ...", exit status 2
fail() { echo "usage: bash run.sh DIVERGENCE ESTIMATOR | METHOD | smollm2 | sweep [--flag=value ...]" \
              "(bash run.sh alone: the help)" >&2; echo "run.sh: error: $*" >&2; exit 2; }
[ $# -ge 1 ] || usage
[ "$1" = sweep ] && { shift; exec "$PY" bench/sweep.py "$@"; }   # cells x seeds, resumable

# --task NAME / --task=NAME: taken out of the flags; the embedded task's model, data and eval sets
TASK=default; rest=(); prev=
for a in "$@"; do
    if [ "$prev" = --task ]; then TASK=$a; prev=; continue; fi
    case $a in --task) prev=--task; continue ;; --task=*) TASK=${a#*=}; continue ;; esac
    rest+=("$a")
done
[ "$prev" != --task ] || fail "--task needs a value; accepted: default, rare"
set -- ${rest[@]+"${rest[@]}"}
case $TASK in
    default) EVAL=tiny-math,tiny-code; TASK_ARGS=(); SUFFIX=; MODEL_DIR=data/tiny; PREP=() ;;
    rare) EVAL=tiny-rare-math; SUFFIX=-rare; MODEL_DIR=data/tiny_rare; PREP=(--variant rare)
          TASK_ARGS=(--model data/tiny_rare/model --data_dir data/tiny_rare --train_data tiny-rare-math) ;;
    *) fail "--task=$TASK; accepted: default, rare" ;;
esac
[ $# -ge 1 ] || usage

# DIVERGENCE ESTIMATOR, or one name that train.py maps through gppo.METHODS / gppo.BASELINES
if [ "$1" = smollm2 ]; then
    [ "$TASK" = default ] || fail "--task=$TASK; accepted: default with smollm2 (rare is a task of the embedded model)"
    [ -f data/smollm2/model/config.json ] || "$PY" data/smollm2.py       # once: GGUF -> HF folder
    ARGS=(@configs/smollm2_cpu.args); NAME=smollm2; shift
elif [ $# -ge 2 ] && [[ "$2" != --* ]]; then
    ARGS=(--divergence "$1" --estimator "$2" --eval_data "$EVAL" ${TASK_ARGS[@]+"${TASK_ARGS[@]}"}); NAME=$1-$2; shift 2
else
    ARGS=(--method "$1" --eval_data "$EVAL" ${TASK_ARGS[@]+"${TASK_ARGS[@]}"}); NAME=$1; shift
fi
# the run's folder: the user's --out_dir (the last one, as train.py reads it), else $OUT, else one
# per cell and seed, so that a second seed never overwrites the first; the closing table reads it
SEED=0; prev=
for a in "$@"; do
    case $prev in --out_dir) OUT=$a ;; --seed) SEED=$a ;; esac
    case $a in --out_dir=*) OUT=${a#*=} ;; --seed=*) SEED=${a#*=} ;; esac
    prev=$a
done
OUT=${OUT:-out/$NAME$SUFFIX-seed$SEED}; OUT=${OUT%/}
[ -f $MODEL_DIR/model/config.json ] || "$PY" data/prepare.py ${PREP[@]+"${PREP[@]}"}   # committed; rebuilt only if deleted

# one process per GPU under Accelerate when several are present, else a single process
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l || true)
if [ "${NGPU:-0}" -gt 1 ]; then
    LAUNCH=("$PY" -m accelerate.commands.launch --num_processes "$NGPU" train.py)
else
    LAUNCH=("$PY" train.py)
fi
# the log's folder only: train.py makes the run's own, once it has accepted every value (a
# refused run leaves no empty run folder behind)
mkdir -p "$(dirname "$OUT")"
start=$(date +%s)
# the log grows: a --resume continues it, and a run that train.py refuses (the folder already
# holds a run: --resume or --overwrite) adds its message without erasing the earlier run's log
case " $* " in *" --overwrite "*) : > "$OUT.log" ;; esac
"${LAUNCH[@]}" "${ARGS[@]}" --out_dir "$OUT" --eval_before "$@" 2>&1 | tee -a "$OUT.log"
"$PY" eval.py --compare "$OUT/eval_start.json" "$OUT/eval.json"
echo "done in $(( $(date +%s) - start ))s: policy $OUT/final, metrics $OUT/metrics.jsonl, plot $OUT/dynamics.png, log $OUT.log"
