"""Multi-process bookkeeping (DDP, FSDP2): padding, sums and stops over ranks, FSDP on the CPU.

1. Every rank runs the same number of forward/backward passes (`pad_with_fillers` pads with
   zero-weight filler passes), so DDP/FSDP's collectives always pair up; `sum_over_ranks` adds up
   what train.py's loss denominator counts on each rank.
2. DDP all-reduces gradients only at a step's last pass; FSDP at every pass (`gradient_sync`).
3. `fsdp_on_the_cpu`: an FSDP launch config really shards on the CPU (accelerate 1.16 would run
   it as plain data parallel).
4. Ranks agree on a stop request (`agree_to_stop`), so every rank checkpoints together.
"""
import os
import random
from contextlib import nullcontext

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from infra.flags import FlagError


def make_accelerator(args):
    """The run's Accelerator, with what depends on the launch set once: FSDP on the CPU, the
    head's float32 matmul precision on CUDA, the process count's checks, threads and seeds."""
    acc = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=args.mixed_precision)
    fsdp_on_the_cpu(acc)
    if torch.cuda.is_available():
        # --head_precision tf32 (the CUDA default): float32 matmuls on TF32 tensor cores for the
        # run. Under bf16 autocast (the GPU presets) the LM head of the log-probs is the only
        # float32 matmul, so it is the one this speeds up; fp32 keeps IEEE float32 everywhere.
        args.head_precision = args.head_precision or "tf32"
        precision = "tf32" if args.head_precision == "tf32" else "ieee"
        torch.backends.cuda.matmul.fp32_precision = precision
    check_world(args, acc.num_processes)
    if args.threads:   # before the engine starts: vLLM's CPU worker then refuses set_num_threads
        torch.set_num_threads(args.threads)
    elif args.async_lag and not torch.cuda.is_available():
        # the background sampler's parallel regions run beside the trainer's, each with torch's
        # thread count: half the cores each, not twice the cores (bench/bench_async.py)
        torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    seed_everything(args.seed, acc.process_index)
    return acc


def check_world(args, world):
    """The flags that depend on the process count, checked once the launch is known."""
    if args.tensor_parallel_size > 1 and world > 1:   # each rank samples with its own engine
        raise FlagError(f"--tensor_parallel_size={args.tensor_parallel_size}; accepted: 1 when "
                         f"{world} training processes each run an engine")
    if args.prompts_per_update % world:
        raise FlagError(f"--prompts_per_update={args.prompts_per_update}; accepted: a multiple "
                         f"of the {world} processes")


def seed_everything(seed, rank):
    """Python's and numpy's streams differ per rank (nothing shared is drawn from them); torch's is
    the same on every rank, so what is initialised from it (LoRA's A matrices) is the same
    everywhere, and the same as in a one-process run."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed)


def full_tensor(t):
    """The whole tensor of an FSDP2 shard (a DTensor, gathered; differentiable), else t itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def pad_with_fillers(acc, passes):
    """This rank's passes (lists of sample indices) padded with None, a filler pass, up to the
    most passes any rank has: every rank then runs as many forward/backward passes, so DDP's and
    FSDP's collectives pair up (train.pass_tensors runs a filler on one sample with weight 0)."""
    most = acc.gather(torch.tensor([len(passes)], device=acc.device)).max().item()
    return passes + [None] * (most - len(passes))


def sum_over_ranks(acc, x):
    """A number summed over every rank (float64)."""
    return acc.reduce(torch.tensor(float(x), dtype=torch.float64, device=acc.device), "sum").item()


def gradient_sync(acc, model, last):
    """DDP all-reduces gradients at every backward unless told not to: only at the step's last pass.
    FSDP reduce-scatters at every pass on purpose: deferring it would keep whole unsharded
    gradients between passes (~33 GB per GPU at 8B in fp32), the memory sharding exists to save."""
    ddp = acc.distributed_type.name in ("MULTI_CPU", "MULTI_GPU")
    return acc.no_sync(model) if ddp and not last else nullcontext()


def agree_to_stop(acc, stop):
    """True on every rank when any rank was asked to stop (Ctrl-C, SIGTERM)."""
    asked = torch.tensor(float(stop.requested), device=acc.device)
    return acc.reduce(asked, "sum").item() > 0


def fsdp_on_the_cpu(acc):
    """An FSDP launch config on the CPU (configs/accelerate_fsdp_cpu.yaml) really shards.
    accelerate 1.16 makes a launch FSDP only on accelerators and silently trains plain data parallel
    on the CPU (state.py skips MULTI_CPU; the checkpoints come out unsharded), though torch's
    fully_shard runs over gloo. So the FSDP path is switched on by hand, as accelerate itself would
    on a GPU: the shared state's distributed type (read by prepare, save_state, load_state) and the
    plugin, built from the launch's FSDP_* variables."""
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if acc.distributed_type != DistributedType.MULTI_CPU or not fsdp:
        return
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    if acc.mixed_precision != "no":
        acc.state.fsdp_plugin.set_mixed_precision(acc.mixed_precision)
