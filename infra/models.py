"""Loading what setup() trains and compares against: the tokenizer, the policy, the reference.

1. The policy trains in float32 (the paper's AdamW states; vLLM samples in its own dtype,
   bfloat16 on GPUs: vllm_engine.engine_dtype) with the KV cache off (every forward pass is a
   full sequence).
2. Under --lora_rank only peft's adapters train (infra/lora.py); the caller's optimizer takes the
   parameters that require a gradient.
3. --kl_coef's reference: under LoRA without --ref_model, the policy itself with its adapters off
   (no second copy, as TRL); otherwise --ref_model (default --model) loaded frozen.
4. A --model that is a folder without a model, or a hub name that does not load, is refused when
   its tokenizer loads, naming the flag and the command that fetches a hub name (infra/flags.py
   check_model; train.py refuses a path that is no folder before its heavy imports).
"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infra.flags import FlagError, check_model
from infra.logprobs import SHARED_PROMPT_ATTENTION
from infra.lora import add_adapters

def load_tokenizer(model_dir, flag="model"):
    """(tokenizer, pad id): the pad token, or EOS where there is none (Llama's tokenizers)."""
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:   # not a folder with a tokenizer, nor a reachable hub name
        check_model(flag, model_dir, e)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad_id is None:
        raise FlagError(f"--{flag}={model_dir!r}: its tokenizer has neither a pad nor EOS token")
    return tok, pad_id


def load_policy(args):
    """--model in float32, with fresh LoRA adapters under --lora_rank (choices 1, 2); its
    attention checked against --share_prompts."""
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.config.use_cache = False
    attention = model.config._attn_implementation
    if args.share_prompts and attention not in SHARED_PROMPT_ATTENTION:
        raise FlagError(f"--share_prompts={args.share_prompts}: packs a group's completions behind "
                        f"one prompt with a 4D attention mask, which {attention!r} attention does "
                        f"not take (accepted: {', '.join(SHARED_PROMPT_ATTENTION)}); "
                        "--share_prompts 0 turns it off")
    return add_adapters(model, args) if args.lora_rank else model


def load_reference(args, acc, policy):
    """--kl_coef's reference model, prepared by `acc` for evaluation; None when off (choice 3)."""
    if args.kl_coef <= 0:
        return None
    if args.lora_rank and not args.ref_model:
        return acc.unwrap_model(policy)
    try:
        ref = AutoModelForCausalLM.from_pretrained(args.ref_model or args.model,
                                                   dtype=torch.float32)
    except (OSError, ValueError) as e:
        check_model("ref_model" if args.ref_model else "model", args.ref_model or args.model, e)
    return acc.prepare_model(ref.eval().requires_grad_(False), evaluation_mode=True)
