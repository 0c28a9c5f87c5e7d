"""The run's flags (where files go, memory and chunk sizes, checkpoints, logging) and the range
checks of every flag. train.py declares the algorithm's flags and resolves what they mean (the
method's cell, the aggregation, delta, the bounds, --loss_kwargs); this module adds the rest and
checks every value's range at parse time, before anything is loaded.

1. Every bad value fails here with the value and what is accepted (`bad`), not mid-run, as a
   FlagError: train.py and eval.py answer it in argparse's form (usage, "error: ...", exit
   status 2) without a traceback; a value only the launch or the loaded files can refuse (the
   process count, a model folder, a data set) raises it too, at load time.
2. `RUN_NEUTRAL`: the flags that do not change what a run computes, so --resume may continue with
   other values of them (every other flag must match the checkpoint's).
3. Declaring the flags imports nothing heavy: the names a flag accepts from gppo.py's tables are
   read only when argparse needs them (`Names`), so train.py refuses a mistyped flag in a fraction
   of a second, before its imports. The tables are named by the caller ("gppo.METHODS"): this
   module imports neither gppo.py nor data/.
"""
import argparse
import ast
import importlib
import os
import re

# Flags that do not change what a run computes: --resume may continue with other values. --iters
# extends a run (unless a decaying --lr_schedule spans it: `run_neutral`); the eval_* flags score
# held-out sets with seeded sampling calls that leave the training's random streams as they were
# (the next rollout reseeds); the rest are files and speed.
RUN_NEUTRAL = {"iters", "eval_data", "eval_k", "eval_before", "eval_every", "out_dir", "overwrite",
               "ckpt_every", "keep_last", "resume", "resume_with_changes", "save_rollouts",
               "threads", "sample_every", "samples_every", "wandb", "answer_probe", "probe_every"}


def run_neutral(saved):
    """RUN_NEUTRAL for a checkpoint made with the flags `saved` (a dict): a cosine or linear lr
    decays over the run's --iters, so another value would reshape the rest of the schedule."""
    decays = saved.get("lr_schedule", "constant") != "constant"
    return RUN_NEUTRAL - {"iters"} if decays else RUN_NEUTRAL


def adamw_steps(args):
    """The run's AdamW steps: iters x P/M x epochs (what --lr_schedule spans)."""
    return args.iters * (args.prompts_per_iter // args.prompts_per_update) * args.epochs


class Names:
    """argparse `choices` read from tables ("gppo.ESTIMATORS": a module's dict or tuple) only when
    argparse needs them, to check a value or print -h. Give the flag a `metavar`:
    argparse formats the choices of a flag without one as soon as it is declared."""

    def __init__(self, *tables, extra=()):
        self.tables, self.extra = tables, extra

    def __iter__(self):
        yield from self.extra
        for table in self.tables:
            module, name = table.rsplit(".", 1)
            yield from getattr(importlib.import_module(module), name)

    def __contains__(self, name):
        return name in list(self)


def add_run_flags(p, probes):
    """The flags that say where and how fast a run goes, not what it computes. probes: the names
    --answer_probe accepts ("" = off; train.py: data/probes.py's PROBES, read when needed)."""
    g = p.add_argument_group("run: files, checkpoints, logging")
    g.add_argument("--out_dir", default="", help="run folder (default out/<cell>-seed<seed>)")
    g.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --out_dir holding an earlier run (deletes its files)")
    g.add_argument("--ckpt_every", type=int, default=20,
                   help="save a resumable checkpoint every N iterations (and at exit); 0 = at exit")
    g.add_argument("--keep_last", type=int, default=2, help="checkpoints kept (older ones deleted)")
    g.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from out_dir's latest complete checkpoint, or the folder given")
    g.add_argument("--resume_with_changes", action="store_true",
                   help="let --resume continue with other run flags")
    g.add_argument("--save_rollouts", default="",
                   help="debug: write every iteration's rollouts to this folder")
    g.add_argument("--replay_rollouts", default="", help="debug: train on the rollouts a "
                   "--save_rollouts run wrote (any process count)")
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's "
                   "default; half of it with --async_lag on the CPU)")
    g.add_argument("--sample_every", type=int, default=10,
                   help="print a few completions every N iterations")
    g.add_argument("--samples_every", type=int, default=10, help="write every completion (prompt, "
                   "text, reward and its parts, advantage, ...) to samples.jsonl every N "
                   "iterations and at the last; 0 = never")
    g.add_argument("--eval_k", type=int, default=8, help="k of avg@k for --eval_data")
    g.add_argument("--eval_before", action="store_true",
                   help="also score the start model (eval_start.json)")
    g.add_argument("--eval_every", type=int, default=0, help="also score --eval_data every N "
                   "iterations, into that row (eval_avg@k) and eval_iter_N.json; 0 = at the end")
    g.add_argument("--wandb", default="", help="wandb project name (off when empty)")
    g.add_argument("--answer_probe", default="", metavar="PROBE",
                   choices=probes,
                   help="log answer_prob: the held-out probability of each rule's one-token "
                   "answer, per kind of problem (data/probes.py; letters: tiny-rare-math)")
    g.add_argument("--probe_every", type=int, default=1, help="--answer_probe every N iterations")
    g = p.add_argument_group("run: engines, memory and precision")
    g.add_argument("--backend", default="vllm", choices=("vllm", "hf"), help="vllm (fast), or "
                   "transformers.generate on the policy's own weights (no vLLM needed)")
    g.add_argument("--vllm_server", default="", metavar="URL[,URL...]",
                   help="sample from vLLM servers (python rollout.py serve MODEL) instead of an "
                   "engine in this process; weights go by vLLM's weight-transfer API")
    g.add_argument("--max_model_len", type=int, default=256,
                   help="vLLM context length (prompt + response), tokens")
    g.add_argument("--vllm_dtype", default="auto",
                   choices=("auto", "float32", "bfloat16", "float16"),
                   help="vLLM's dtype; auto: bfloat16 on GPU, the trainer's float32 on the CPU")
    g.add_argument("--gpu_memory_utilization", type=float, default=0.4,
                   help="vLLM share of GPU memory")
    g.add_argument("--tensor_parallel_size", type=int, default=1, help="vLLM tensor parallel size")
    g.add_argument("--sleep_mode", action=argparse.BooleanOptionalAction, default=False,
                   help="free vLLM's KV cache while training (GPU); --no-sleep_mode undoes a "
                   "preset's (configs/server_*.args)")
    g.add_argument("--sync_bucket_mb", type=int, default=256,
                   help="weight sync into vLLM in buckets of this size")
    g.add_argument("--micro_batch_size", type=int, default=64,
                   help="sequences per forward/backward")
    g.add_argument("--share_prompts", type=int, default=4096, metavar="MAX_LEN", help="a group's "
                   "prompt once per pass, its completions behind it (infra/logprobs.py 4.), in "
                   "packed rows of at most MAX_LEN tokens (longer passes run plain); 0: off")
    g.add_argument("--logp_chunk_mb", type=int, default=None, help="float32 logits per "
                   "log-softmax chunk, MB (default: 1/32 of free GPU memory, 256 on the CPU)")
    g.add_argument("--head_precision", default=None, choices=("fp32", "tf32", "bf16"),
                   help="LM head matmul of the log-probs; log-softmax always fp32 "
                   "(default: tf32 on CUDA, fp32 on CPU)")
    g.add_argument("--mixed_precision", default=None, choices=("no", "bf16", "fp16"),
                   help="autocast of the policy's forward/backward (default: accelerate's config)")


def numbers_or_none(n):
    """An argparse `type`: 'none' -> None, else n comma-separated numbers (a float when n = 1,
    else a tuple); anything else is argparse's error, naming the flag."""
    def parse(text):
        if text == "none":
            return None
        try:
            values = tuple(float(x) for x in text.split(","))
        except ValueError:
            values = ()
        if len(values) != n:
            raise argparse.ArgumentTypeError(
                f"{text!r}; accepted: {'a number' if n == 1 else f'{n} numbers, comma-separated'}"
                " or 'none'")
        return values[0] if n == 1 else values
    return parse


class FlagError(ValueError):
    """A flag's value refused: the message names the flag, the value and what is accepted."""


HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")    # namespace/name, as the hub spells a repo
FETCH = "hf download {name} --local-dir {folder}"


def check_model(flag, name, error=None):
    """Refuse `name` (the value of --flag): a path that is no folder, or a folder or hub name that
    did not load (`error`: what transformers raised), with what is accepted and how to fetch."""
    accepted = ("accepted: a model folder (config.json, weights, tokenizer) or a hub name such as "
                f"HuggingFaceTB/SmolLM2-135M-Instruct (`{FETCH.format(name='NAME', folder='DIR')}`"
                " fetches one where there is a network)")
    if os.path.isdir(name):
        if error is None:
            return
        raise FlagError(f"--{flag}={name!r}: a folder without a loadable model ({error}); "
                        f"{accepted}")
    if HUB_NAME.fullmatch(name):
        if error is None:
            return   # transformers fetches it, or finds it in its cache
        folder = os.path.join("models", name.split("/")[1])
        raise FlagError(f"--{flag}={name!r}: no such folder here, and the hub name could not be "
                        f"loaded ({type(error).__name__}); fetch it where there is a network with "
                        f"`{FETCH.format(name=name, folder=folder)}` and pass --{flag} {folder}")
    raise FlagError(f"--{flag}={name!r}: no such folder; {accepted}")


def bad(args, flag, accepted):
    raise FlagError(f"--{flag}={getattr(args, flag)!r}; accepted: {accepted}")


def check(args):
    """Every flag's range checked (the algorithm's meaning is train.algorithm_settings')."""
    for flag in ("prompts_per_iter", "prompts_per_update", "max_new_tokens", "iters", "epochs",
                 "micro_batch_size", "keep_last", "overlong_buffer", "sync_bucket_mb"):
        if getattr(args, flag) < 1:
            bad(args, flag, "an integer >= 1")
    if args.share_prompts < 0:
        bad(args, "share_prompts", "an integer >= 0 (the longest packed row, tokens; 0: off)")
    if args.logp_chunk_mb is not None and args.logp_chunk_mb < 1:
        bad(args, "logp_chunk_mb", "an integer >= 1, or unset (sized from free GPU memory)")
    if args.group_size < 2:
        bad(args, "group_size", "2 or more (group-relative advantages need a group)")
    if args.prompts_per_iter % args.prompts_per_update:
        bad(args, "prompts_per_iter",
            f"a multiple of --prompts_per_update={args.prompts_per_update}")
    if args.max_new_tokens >= args.max_model_len:
        bad(args, "max_new_tokens",
            f"fewer tokens than --max_model_len={args.max_model_len} (the prompt needs room)")
    if args.overlong_buffer >= args.max_new_tokens:
        bad(args, "overlong_buffer", f"fewer tokens than --max_new_tokens={args.max_new_tokens}")
    if args.probe_every < 1:
        bad(args, "probe_every", "an integer >= 1")
    if args.answer_probe and not args.eval_data:
        bad(args, "answer_probe", "a probe with --eval_data set (it reads the held-out problems)")
    for flag in ("ckpt_every", "eval_every", "samples_every", "sample_every"):
        if getattr(args, flag) < 0:
            bad(args, flag, "an integer >= 0")
    if args.tis_cap is not None and args.tis_cap <= 0:
        bad(args, "tis_cap", "a positive number")
    if args.tis_cap is not None and args.mu_source == "vllm":   # mu is vLLM's: corrected twice
        bad(args, "tis_cap", "unset with --mu_source vllm (TIS reweights from vLLM's mu to the "
            "trainer's)")
    for flag in ("kl_coef", "target_kl", "entropy_coef"):
        if getattr(args, flag) < 0:
            bad(args, flag, "a number >= 0")
    steps = adamw_steps(args)
    if not 0 <= args.warmup_steps <= steps:
        bad(args, "warmup_steps", f"0 to the run's {steps} AdamW steps (iters x P/M x epochs)")
    if not 0 <= args.min_lr_ratio <= 1:
        bad(args, "min_lr_ratio", "a fraction of --lr in [0, 1]")
    if args.lora_rank < 0:
        bad(args, "lora_rank", "0 (off) or a positive rank")
    if not 0 <= args.lora_dropout < 1:
        bad(args, "lora_dropout", "a probability in [0, 1)")
    if args.vllm_server:   # the servers sample; this process only trains (infra/vllm_server.py)
        for url in args.vllm_server.split(","):
            if not url.startswith(("http://", "https://")):
                bad(args, "vllm_server", "http://HOST:PORT URLs, comma-separated")
        for flag, fine, why in (("backend", "vllm", "'vllm'"),
                                ("sleep_mode", False, "unset (a server frees its own)"),
                                ("tensor_parallel_size", 1, "1 (a server's own flag)")):
            if getattr(args, flag) != fine:
                bad(args, flag, f"{why} with --vllm_server")
    if args.async_lag < 0:
        bad(args, "async_lag", "an integer >= 0 (0: sample with the newest weights)")
    if args.async_lag:   # what cannot sample ahead (infra/prefetch.py)
        for flag, why in (("backend", "'vllm' (hf samples with the weights being trained)"),
                          ("sleep_mode", "unset (the engine samples while the trainer trains)"),
                          ("lora_dropout", "0 (dropout would share torch's generator with the "
                           "background sampler, and runs would not repeat)")):
            if getattr(args, flag) not in (False, None, "", 0.0, "vllm"):
                bad(args, flag, f"{why} with --async_lag {args.async_lag}")
    if args.resume and args.overwrite:
        bad(args, "overwrite", "unset with --resume (one continues the run, the other deletes it)")
    return args


def keyword_values(flag, text, owner, settable, own):
    """--flag 'k=v,k=v' as a dict of Python literals (a tuple keeps its commas), each key one of
    `settable` (the keywords of the function `owner`); own: {key: the flag that sets it}."""
    values = {}
    for item in filter(None, re.split(r",(?=\s*\w+\s*=)", text)):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or key not in settable:
            hint = f" (it has its own flag, {own[key]})" if key in own else ""
            raise FlagError(f"--{flag}: {item!r}{hint}; accepted keys of {owner}: "
                             f"{', '.join(settable) or 'none'}, as key=value")
        try:
            values[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise FlagError(f"--{flag}: {key}={value!r} is not a Python literal "
                             "(number, None, tuple)") from None
    return values
