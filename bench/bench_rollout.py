"""
Rollout time of `--backend hf` (transformers.generate) against vLLM, on the tiny default's shape.

    python bench/bench_rollout.py                     # data/tiny, 64 prompts x 8 samples, 48 tokens, 2 threads
    python bench/bench_rollout.py --reps 7 --threads 1

What it measures: seconds for one engine.generate(prompts, n=G, max_tokens) call, the call train.py's
rollout phase makes, for each engine: VLLMRollout (in this process, as train.py runs it) and
HFRollout (its own copy of the model here; in train.py it samples from the policy itself).
1. One process, both engines built first, then called alternately rep by rep after one untimed call
   each: a machine that is busier in one moment than the next slows both sides of a pair alike. The
   ratio is of the two medians; issue 25's goal is hf within ~2x of vLLM.
2. The same prompts (P training prompts spread evenly over --train_data's rows, the trainer's template) and the
   same seed per rep for both. Their samples differ (two samplers), so the tokens generated differ
   too: both counts are printed, and tokens per second beside the seconds.
3. torch's thread count is set once (`--threads`) before vLLM starts, as train.py does.
"""
import argparse, json, os, statistics, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")     # the engine in this process, as train.py

p = argparse.ArgumentParser(description="--backend hf vs vLLM: one rollout call each, alternately",
                            allow_abbrev=False)
p.add_argument("--model", default=str(ROOT / "data/tiny/model"))
p.add_argument("--data_dir", default=None, help="folder of the tiny data sets (default data/tiny)")
p.add_argument("--train_data", default="tiny-math,tiny-code")
p.add_argument("--prompts", type=int, default=64, help="P prompts per call (train.py --prompts_per_iter)")
p.add_argument("--group_size", type=int, default=8, help="G samples per prompt")
p.add_argument("--max_new_tokens", type=int, default=48)
p.add_argument("--max_model_len", type=int, default=256)
p.add_argument("--reps", type=int, default=5, help="timed calls per engine")
p.add_argument("--threads", type=int, default=2, help="torch threads (train.py --threads)")
p.add_argument("--out", default="", help="also write the JSON result here")
args = p.parse_args()


def main():
    import torch
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer
    from data.loaders import load_rows
    from infra.hf_engine import HFRollout
    from rollout import make_engine
    tok = AutoTokenizer.from_pretrained(args.model)
    rows = load_rows(args.train_data, "train", args.data_dir, "plain", tok,
                     max_prompt_tokens=args.max_model_len - args.max_new_tokens)
    prompts = [r["prompt_ids"] for r in rows[::max(1, len(rows) // args.prompts)][:args.prompts]]   # spread over the tasks
    engines = {"vllm": make_engine(args.model, backend="vllm", max_model_len=args.max_model_len, seed=0,
                                   kv_cache_sequences=len(prompts) * args.group_size,
                                   kv_cache_tokens=max(map(len, prompts)) + args.max_new_tokens),
               "hf": HFRollout(args.model, args.max_model_len, seed=0)}
    model = os.path.relpath(args.model, ROOT) if Path(args.model).resolve().is_relative_to(ROOT) \
        else args.model   # results name no machine's absolute path
    config = dict(model=model, prompts=len(prompts), group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                  reps=args.reps, threads=torch.get_num_threads(), cores=len(os.sched_getaffinity(0)),
                  load_avg_start=os.getloadavg()[0], torch=torch.__version__)
    print("config:", json.dumps(config), flush=True)
    secs, tokens = {k: [] for k in engines}, {k: [] for k in engines}
    for rep in range(args.reps + 1):                                  # rep 0: untimed warm-up
        for name, engine in engines.items():
            t = time.perf_counter()
            batch = engine.generate(prompts, n=args.group_size, max_tokens=args.max_new_tokens, seed=1000 + rep)
            dt = time.perf_counter() - t
            if rep:
                secs[name].append(dt)
                tokens[name].append(sum(map(len, batch.completion_ids)))
        if rep:
            print(f"rep {rep}: " + " | ".join(f"{k} {secs[k][-1]:.2f} s ({tokens[k][-1]} tokens)" for k in engines),
                  flush=True)
    med = {k: statistics.median(v) for k, v in secs.items()}
    rows_out = {k: dict(median_s=med[k], seconds=secs[k], tokens=tokens[k],
                        tokens_per_s=statistics.median(n / s for n, s in zip(tokens[k], secs[k]))) for k in engines}
    ratio = med["hf"] / med["vllm"]
    print(f"\nmedian seconds per rollout call: vLLM {med['vllm']:.2f}, hf {med['hf']:.2f}; hf / vLLM = {ratio:.2f} "
          f"(tokens/s: vLLM {rows_out['vllm']['tokens_per_s']:.0f}, hf {rows_out['hf']['tokens_per_s']:.0f})")
    line = json.dumps(dict(bench="rollout", config=config, rows=rows_out, ratio_hf_over_vllm=ratio,
                           load_avg_end=os.getloadavg()[0]))
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
