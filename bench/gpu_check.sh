#!/usr/bin/env bash
# Check a machine with one or more GPUs in one command: at most 8 minutes, no network, only
# committed files (the tiny model in data/tiny, random weights for the 0.5B shape).
#   bash bench/gpu_check.sh                 # verdicts on stdout, JSON in bench/results/gpu_check.json
#   OUT=/some/dir bash bench/gpu_check.sh   # JSON and logs there instead
# One verdict line per part (PASS / FAIL / SKIP, then figures):
#   a) the tiny default on one GPU in bf16 with --backend hf (and --backend vllm when vllm
#      imports): 4 iterations, then --resume to 6
#   b) FSDP2 through accelerate launch: configs/accelerate_fsdp_8gpu.yaml's settings with
#      num_processes = the GPUs present and Qwen2DecoderLayer (a temp copy), 3 iterations, then --resume to 4
#   c) bench/gpu_logprob.py: the log-prob path vs full logits on a Qwen2.5-0.5B-shaped random
#      model (8 x 2048 tokens), time, peak memory and TFLOP/s per head precision
#   d) bench/bench_objective.py --device cuda: gppo_loss forward + backward on 262K tokens, each cell
#   e) the sampler as a service on the trainer's GPU (configs/server_1gpu.args: `rollout.py serve
#      --transfer ipc`, vLLM's CUDA-IPC weight transfer), 3 iterations, then --resume to 4
# Parts run in that order (vLLM last: its engine starts are the slowest) while time is left.
# Without a GPU it says so, runs a CPU smoke of (a) (--backend hf, 2 iterations at 8 prompts,
# then --resume to 3) and exits 0 when that passes. On the 2-core CPU machine: about 1-2 min.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/results}
BUDGET=${BUDGET:-480}                  # seconds for the whole check
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
       VLLM_ENABLE_V1_MULTIPROCESSING=0
START=$SECONDS
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)

verdict() {   # part status figures...
    echo "($1) $2 ${*:3}"
    "$PY" -c 'import json, sys; print(json.dumps(dict(part=sys.argv[1], status=sys.argv[2], figures=" ".join(sys.argv[3:]))))' \
        "$@" >> "$WORK/verdicts.jsonl"
}

limit() {     # a command's timeout: at most $1 s, and never past the budget (0 when it is spent)
    local left=$((BUDGET - (SECONDS - START) - 5))
    echo $(( left < $1 ? (left > 0 ? left : 0) : $1 ))
}

summary() {   # out_dir iterations: checks metrics.jsonl holds exactly iterations 1..N, prints figures
    "$PY" - "$1" "$2" <<'EOF'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
assert [r["iter"] for r in rows] == list(range(1, n + 1)), f"metrics.jsonl has iterations {[r['iter'] for r in rows]}"
med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
print(f"{n} iterations, {med('time_iter_s'):.2f} s/iter (rollout {med('time_rollout_s'):.2f} s, "
      f"update {med('time_update_s'):.2f} s), reward {rows[-1]['reward_mean']:.3f}, logp_gap {rows[-1]['logp_gap_vllm']:.1e}")
EOF
}

figures() {   # c|d json_file: one line of figures from bench/gpu_logprob.py's or bench_objective.py's JSON
    "$PY" - "$1" "$2" <<'EOF'
import json, statistics, sys
d = json.load(open(sys.argv[2]))
if sys.argv[1] == "c":
    print("; ".join(f"{k} {v['s']:.3f} s, {v['tflops']:.0f} TFLOP/s, {v['peak_gb']} GB, max |dlogp| {v['max_abs_diff_vs_fp32']:.1e}"
                    for k, v in d["rows"].items()))
else:
    ms = [v["ms"] for v in d["rows"].values() if v["grid"]]
    print(f"12 cells {min(ms):.2f}-{max(ms):.2f} ms per forward+backward, median {d['summary']['grid']['ratio_median']:.2f}x "
          f"plain PPO clip ({statistics.median(v['ppo_ms'] for v in d['rows'].values()):.2f} ms)")
EOF
}

train_resume() {   # part n1 n2 command...: a run of n1 iterations, then --resume to n2, then its figures
    local part=$1 n1=$2 n2=$3 t
    shift 3
    local out="$WORK/$part" log="$OUT/gpu_check_$part.log"
    t=$(limit 200)
    if [ "$t" -lt 30 ]; then verdict "$part" SKIP "time budget spent"; return; fi
    local t0=$SECONDS
    if timeout "$t" "$@" --out_dir "$out" --iters "$n1" --ckpt_every "$n1" > "$log" 2>&1 &&
       timeout "$(limit 200)" "$@" --out_dir "$out" --iters "$n2" --resume >> "$log" 2>&1 &&
       grep -q "resumed from" "$log" && figures=$(summary "$out" "$n2" 2>>"$log"); then
        case $part in b*) ls "$out"/checkpoints/*/pytorch_model_fsdp_0/*.distcp > /dev/null 2>&1 || figures="$figures; NOT SHARDED";; esac
        [[ $figures == *"NOT SHARDED"* ]] && status=FAIL || status=PASS
        verdict "$part" "$status" "$figures, $((SECONDS - t0)) s in all (log $log)"
    else
        verdict "$part" FAIL "exit or timeout after $((SECONDS - t0)) s: $(tail -n 1 "$log" | cut -c1-200) (log $log)"
    fi
}

finish() {
    local commit
    commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    git diff --quiet HEAD 2>/dev/null || commit="$commit+changes"
    "$PY" - "$WORK/verdicts.jsonl" "$OUT/gpu_check.json" "$commit" "$((SECONDS - START))" <<'EOF'
import datetime, json, platform, sys
import torch
parts = [json.loads(line) for line in open(sys.argv[1])]
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
res = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), commit=sys.argv[3], gpus=gpus,
           cpu=platform.processor() or platform.machine(), torch=torch.__version__, seconds=int(sys.argv[4]), parts=parts)
open(sys.argv[2], "w").write(json.dumps(res, indent=1) + "\n")
EOF
    echo "gpu_check: $((SECONDS - START)) s; results in $OUT/gpu_check.json"
    ! grep -q '"status": "FAIL"' "$WORK/verdicts.jsonl"
}

TINY=(train.py --model data/tiny/model --seed 0)
if [ "$NGPU" -eq 0 ]; then
    echo "gpu_check: no GPU visible to torch: parts a-d need one; running the CPU smoke of (a) instead"
    train_resume a-cpu-hf 2 3 "$PY" "${TINY[@]}" --backend hf --prompts_per_iter 8 --prompts_per_update 4 \
        --threads "${THREADS:-1}"
    for part in a-hf a-vllm b-fsdp c-logprob d-objective e-server; do verdict "$part" SKIP "no GPU"; done
    finish
    exit $?
fi

echo "gpu_check: $NGPU GPU(s): $("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")"
# (a) one GPU, bf16, the transformers rollout on the policy's own weights
CUDA_VISIBLE_DEVICES=0 train_resume a-hf 4 6 "$PY" "${TINY[@]}" --backend hf --mixed_precision bf16

# (b) FSDP2 on every GPU present, the 8-GPU config's settings; mini-batches divisible by the processes
sed -e "s/^num_processes: .*/num_processes: $NGPU/" -e "s/Qwen3DecoderLayer/Qwen2DecoderLayer/" \
    configs/accelerate_fsdp_8gpu.yaml > "$WORK/fsdp.yaml"
if [ $((8 % NGPU)) -eq 0 ]; then M=8; P=64; else M=$NGPU; P=$((8 * NGPU)); fi
train_resume b-fsdp 3 4 "$PY" -m accelerate.commands.launch --config_file "$WORK/fsdp.yaml" "${TINY[@]}" \
    --backend hf --prompts_per_iter "$P" --prompts_per_update "$M"

# (c) the log-prob path at a real vocabulary
t=$(limit 120)
if [ "$t" -lt 30 ]; then verdict c-logprob SKIP "time budget spent"
elif CUDA_VISIBLE_DEVICES=0 timeout "$t" "$PY" bench/gpu_logprob.py --out "$WORK/c.json" > "$OUT/gpu_check_c.log" 2>&1; then
    verdict c-logprob PASS "$(figures c "$WORK/c.json")"
else verdict c-logprob FAIL "$(tail -n 1 "$OUT/gpu_check_c.log" | cut -c1-200)"; fi

# (d) the objective on the GPU: 512 x 512 = 262K tokens per call
t=$(limit 90)
if [ "$t" -lt 20 ]; then verdict d-objective SKIP "time budget spent"
elif CUDA_VISIBLE_DEVICES=0 timeout "$t" "$PY" bench/bench_objective.py --device cuda --shape 512x512 --reps 5 \
        --out "$WORK/d.json" > "$OUT/gpu_check_d.log" 2>&1; then
    verdict d-objective PASS "$(figures d "$WORK/d.json")"
else verdict d-objective FAIL "$(tail -n 1 "$OUT/gpu_check_d.log" | cut -c1-200)"; fi

# (a) again with vLLM, when it is installed
if "$PY" -c "import vllm" > /dev/null 2>&1; then
    CUDA_VISIBLE_DEVICES=0 train_resume a-vllm 4 6 "$PY" "${TINY[@]}" --backend vllm --mixed_precision bf16
else
    verdict a-vllm SKIP "vllm does not import here"
fi

# (e) one GPU shared by the trainer and a vLLM server (CUDA IPC; NCCL refuses two ranks on one GPU)
if "$PY" -c "import vllm" > /dev/null 2>&1 && [ "$(limit 240)" -ge 120 ]; then
    PORT=${PORT:-8170}
    CUDA_VISIBLE_DEVICES=0 setsid "$PY" rollout.py serve data/tiny/model --port "$PORT" --max_model_len 256 \
        --transfer ipc --gpu_memory_utilization 0.25 > "$OUT/gpu_check_e_server.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 120); do
        curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null 2>&1 && break
        kill -0 "$SERVER" 2>/dev/null || break
        sleep 1
    done
    CUDA_VISIBLE_DEVICES=0 train_resume e-server 3 4 "$PY" "${TINY[@]}" --mixed_precision bf16 \
        --max_model_len 256 --vllm_server "http://127.0.0.1:$PORT"
    kill -- -"$SERVER" 2>/dev/null
else
    verdict e-server SKIP "vllm does not import here, or under 120 s of the budget left"
fi
finish
