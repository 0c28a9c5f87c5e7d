"""LoRA through peft (--lora_rank R > 0): only the adapters train, the base weights stay frozen.

1. `add_adapters` wraps the policy with peft's LoraConfig (rank, alpha, dropout, target modules;
   default every linear layer of the attention and MLP, peft's "all-linear", which leaves the LM
   head out). A target the model does not have is refused, naming the ones it has.
2. `policy_weights` is the policy as the base model's Hugging Face names, each adapted weight
   merged out of place (W + scale * B @ A): what the weight sync streams into vLLM and what
   final/ holds. peft's merge_adapter/unmerge_adapter would add and subtract in place, which
   rounds the frozen W; out of place it stays bitwise the start model's.
3. The reference of --kl_coef is the same model with its adapters off (`adapters_off`), as TRL
   does: no second copy of the weights.
"""
from contextlib import nullcontext

import peft
import torch
from accelerate.utils import extract_model_from_parallel
from peft.tuners.lora import LoraLayer

from infra.distributed import full_tensor
from infra.flags import FlagError


def add_adapters(model, args):
    """The policy with fresh LoRA adapters (B = 0: the start policy is the base model's); the
    rank, alpha and dropout were checked with the other flags (infra/flags.py)."""
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear)})
    targets = "all-linear" if args.lora_target_modules == "all-linear" else \
        args.lora_target_modules.split(",")
    missing = [t for t in targets if t not in linear] if targets != "all-linear" else []
    if missing:
        raise FlagError(f"--lora_target_modules={args.lora_target_modules!r}: the model has no "
                         f"linear layer named {', '.join(missing)}; it has {', '.join(linear)} "
                         "(or 'all-linear')")
    config = peft.LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, task_type="CAUSAL_LM",
                             lora_dropout=args.lora_dropout, target_modules=targets)
    return peft.get_peft_model(model, config)


def is_lora(model):
    return isinstance(extract_model_from_parallel(model), peft.PeftModel)


def policy_weights(model):
    """(Hugging Face name, tensor) of the policy's weights; with adapters, merged out of place."""
    inner = extract_model_from_parallel(model)
    if not isinstance(inner, peft.PeftModel):
        yield from inner.state_dict().items()
        return
    base = inner.get_base_model()
    adapted = {f"{n}.base_layer.weight": m for n, m in base.named_modules()
               if isinstance(m, LoraLayer)}
    for name, t in base.state_dict().items():
        if ".lora_" in name:
            continue
        t = _full(t)                    # a collective under FSDP2: every rank iterates alike
        if name in adapted:
            t = t + _delta(adapted[name], inner.active_adapter).to(t.dtype)
        yield name.replace(".base_layer.", "."), t


def policy_weight_meta(model):
    """(name, dtype, full shape) of each pair policy_weights(model) yields, in its order, without
    gathering a shard (a DTensor's shape is the whole tensor's): vLLM's trainer engines send the
    names, dtypes and shapes before the bytes."""
    inner = extract_model_from_parallel(model)
    peft_model = isinstance(inner, peft.PeftModel)
    for name, t in (inner.get_base_model() if peft_model else inner).state_dict().items():
        if ".lora_" not in name:
            yield name.replace(".base_layer.", "."), t.dtype, tuple(t.shape)


def _full(t):
    """The whole tensor of an FSDP2 shard (DTensor), else t itself; no gradient."""
    return full_tensor(t).detach()


def _delta(layer, adapter):
    """scale * B @ A of one adapted nn.Linear (peft's get_delta_weight, on whole tensors)."""
    a, b = _full(layer.lora_A[adapter].weight), _full(layer.lora_B[adapter].weight)
    return layer.scaling[adapter] * (b @ a)


def adapters_off(model):
    """Context in which the policy is its base model (the --kl_coef reference under LoRA)."""
    inner = extract_model_from_parallel(model)
    return inner.disable_adapter() if isinstance(inner, peft.PeftModel) else nullcontext()
