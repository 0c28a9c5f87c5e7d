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
  [breakdown]="bench/bench_breakdown.py --threads 1"
  [logprob]="bench/bench_logprob.py"
  [objective]="bench/bench_objective.py"
  [scaling]="bench/bench_scaling.py --threads 1"
)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(trl breakdown logprob objective scaling)
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
