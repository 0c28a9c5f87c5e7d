#!/usr/bin/env bash
# Every benchmark of README "Performance", one after the other (they time the machine: run
# nothing else meanwhile), each one's printout in bench/results/<name>.txt (the whole log in <name>.log,
# not committed) and its JSON in bench/results/<name>.json.       bash bench/run_all.sh [name ...]   (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p bench/results
declare -A CMD=(
  [trl]="bench/bench_trl.py --threads 1"
  [trl_smollm2]="bench/bench_trl.py --threads 1 --model data/smollm2/model --template fewshot --data rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=1&allow_parentheses=False&allow_negation=False&operators=+-*&size=100 --prompts_per_iter 16 --prompts_per_update 4 --max_new_tokens 32 --lr 1e-5 --bf16 --floor"
  [breakdown]="bench/bench_breakdown.py --threads 1"
  [logprob]="bench/bench_logprob.py"
  [levers]="bench/bench_levers.py"
  [objective]="bench/bench_objective.py"
  [rollout]="bench/bench_rollout.py"
  [scaling]="bench/bench_scaling.py --threads 1"
)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(trl trl_smollm2 breakdown levers logprob objective rollout scaling)
for n in "${names[@]}"; do
  [ -n "${CMD[$n]:-}" ] || { echo "unknown benchmark '$n'; accepted: ${!CMD[*]}" >&2; exit 2; }
  echo "== $n: python ${CMD[$n]} --out bench/results/$n.json  ($(date -u +%FT%TZ))"
  start=$(date +%s)
  rc=0
  # shellcheck disable=SC2086
  "$PY" ${CMD[$n]} --out "bench/results/$n.json" > "bench/results/$n.log" 2>&1 || rc=$?
  grep -v "INFO\|WARNING\|it/s\]" "bench/results/$n.log" > "bench/results/$n.txt" || true   # the figures, not vLLM's log
  tail -40 "bench/results/$n.txt"
  [ "$rc" -eq 0 ] || { echo "$n failed (exit $rc); see bench/results/$n.txt" >&2; exit 1; }
  echo "== $n took $(( $(date +%s) - start ))s"
done
