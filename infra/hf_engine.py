"""
The transformers engine behind rollout.py's `--backend hf`: transformers.generate on the
training model itself, with the same sampling and the same RolloutBatch as the vLLM engine.

    engine = HFRollout("data/tiny/model", max_model_len=256, policy=model)   # rollout.make_engine
    batch = engine.generate(prompt_ids, n=8, max_tokens=32)   # sync_weights, sleep: nothing to do
"""
from contextlib import nullcontext

import torch
from accelerate.utils import extract_model_from_parallel
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel as FSDP

from infra.vllm_engine import RolloutBatch, engine_dtype   # the same batch, the same dtype rule


class HFRollout:
    """transformers.generate on the policy itself (`--backend hf`): for machines without vLLM
    (a laptop GPU, ROCm, Apple silicon, a locked-down cluster image). vLLM is the fast path.

    `policy`: the training model (as accelerate prepared it), shared, so there is no second copy
    and nothing to sync; or None, and the model is loaded from `model_dir` (eval.py on its own).
    One generate call per batch, all prompts x n samples at once, left-padded. (Not a static KV
    cache, ~8% faster here: under accelerate's bf16 autocast the keys, float32 after the rotary
    embedding, and the bf16 values differ in dtype, which its one-dtype buffers refuse.)
    The sampled tokens' log-probs come from _SampledLogprobs, which holds one step's (N, V) row at
    a time; generate's own output_scores would hold one per step (2K steps x 150K vocabulary x 4
    bytes = 1.2 GB per sample)."""

    def __init__(self, model_dir, max_model_len, seed=0, dtype="auto", policy=None, **_):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        print("rollout: transformers.generate on the policy's weights (--backend hf; vLLM is the "
              "fast path)", flush=True)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if policy is None:
            on_gpu = torch.cuda.is_available()
            dtype = getattr(torch, engine_dtype(dtype))
            policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
            policy = policy.eval()
            policy = policy.to("cuda" if on_gpu else "cpu")
        self.policy, self.max_model_len = policy, max_model_len
        # stop tokens as vLLM takes them: the tokenizer's EOS plus generation_config.json's
        # eos_token_id(s) (vllm/sampling_params.py SamplingParams.update_from_generation_config)
        gen_config = getattr(_generation_model(policy), "generation_config", None)
        extra = getattr(gen_config, "eos_token_id", None)
        extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
        self.stop_ids = list(dict.fromkeys([self.tokenizer.eos_token_id] + extra))
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_ids[0]

    @torch.no_grad()
    def generate(self, prompt_ids, n, max_tokens, temperature=1.0, seed=None):
        """Like VLLMRollout.generate: group-major samples; a completion ends with its stop token
        when the model emitted one, else it is `truncated` at max_tokens (or at max_model_len);
        `logprobs` are the sampled tokens' log-probs under the distribution sampled from (float32
        log-softmax of generate's scores: at temperature 1, top-p 1, top-k off, the model's own)."""
        batch = RolloutBatch([], [], [], [], [])
        if not prompt_ids:  # an evaluation rank with no rows: under FSDP it steps with the others
            if _sharded(self.policy):
                self.generate([[self.pad_id]], 1, max_tokens, temperature, seed)
            return batch
        model = _generation_model(self.policy)
        device = next(model.parameters()).device
        rows = [list(p) for p in prompt_ids for _ in range(n)]                # group-major
        L = max(len(p) for p in rows)
        ids = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), L), dtype=torch.long)
        for i, p in enumerate(rows):                                          # left padding
            ids[i, L - len(p):], attn[i, L - len(p):] = torch.tensor(p), 1
        # a seeded call draws from its own copy of torch's generator: its samples are a function of
        # `seed` and the weights alone, and the trainer's random stream is left as it was
        gpus = [device] if device.type == "cuda" else []
        from transformers import LogitsProcessorList
        recorder = _SampledLogprobs()
        rng = torch.random.fork_rng(devices=gpus, enabled=seed is not None)
        with rng, _full_params(self.policy):
            if seed is not None:
                torch.manual_seed(seed)
            out = model.generate(ids.to(device), attention_mask=attn.to(device), do_sample=True,
                                 temperature=temperature, top_p=1.0, top_k=0,
                                 max_new_tokens=max_tokens, eos_token_id=self.stop_ids,
                                 pad_token_id=self.pad_id, use_cache=True,
                                 logits_processor=LogitsProcessorList([recorder]),
                                 synced_gpus=_sharded(self.policy))
        gen = out[:, L:]                                                # (N, T), T <= max_tokens
        lp = recorder.logprobs(gen)                                     # (N, T)
        gen, lp, stops = gen.tolist(), lp.tolist(), set(self.stop_ids)
        for p, g, g_lp in zip(rows, gen, lp):
            limit = min(max_tokens, self.max_model_len - len(p))  # vLLM stops at max_model_len too
            end = next((t + 1 for t, x in enumerate(g[:limit]) if x in stops), None)
            batch.prompt_ids.append(p)
            batch.completion_ids.append(g[:end or limit])
            batch.logprobs.append(g_lp[:end or limit])
            batch.truncated.append(end is None)
            batch.texts.append(self.tokenizer.decode(g[:end or limit], skip_special_tokens=True))
        return batch

    def sync_weights(self, buckets, one_call=None, version=None):
        pass  # the engine samples from the policy's own weights: nothing to copy

    def sleep(self):
        pass


class _SampledLogprobs:
    """A logits processor that records the sampled tokens' log-probs. Called with each step's
    scores, it keeps their float32 log-softmax and, at the next call, takes from it the log-prob of
    the token sampled at that step (input_ids' newest column); `logprobs` takes the last one.
    generate adds its sampling warpers after the processors it is given, and at temperature 1,
    top-p 1, top-k off it adds none, so these are the log-probs of the distribution sampled from
    (tests/test_hf_rollout.py checks them against the trainer's). Under FSDP a rank whose samples
    are all done stops being called (synced_gpus), and its output stops growing with it."""

    def __init__(self):
        self.last, self.columns = None, []

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.columns.append(self.last.gather(-1, input_ids[:, -1:]))
        self.last = scores.float().log_softmax(-1)                           # (N, V), one step's
        return scores

    def logprobs(self, generated):
        """(N, T) log-probs of the T generated tokens, once generate has returned them."""
        if generated.shape[1] == 0:
            return generated.float()
        return torch.cat(self.columns + [self.last.gather(-1, generated[:, -1:])], 1)


def _generation_model(model):
    """The module to call generate() on, as TRL's unwrap_model_for_generation finds it
    (trl/models/utils.py): DDP's wrapper removed (sampling needs no gradient sync), accelerate's
    autocast forward kept (bf16 sampling under --mixed_precision bf16). Under FSDP2 this is the
    sharded model itself: fully_shard's forward hooks gather each layer's parameters as it runs."""
    return extract_model_from_parallel(model)


def _sharded(model):
    """FSDP (1 or 2) over several processes: each forward gathers parameters collectively, so every
    rank must run as many as the others; generate then steps until all ranks are done (synced_gpus;
    transformers detects FSDP2 only when it applied it itself)."""
    dist = torch.distributed
    return isinstance(model, (FSDP, FSDPModule)) and dist.is_initialized() and \
        dist.get_world_size() > 1


def _full_params(model):
    """FSDP1 only, as TRL does (trl/distributed.py summon_full_params, recurse=False): the root's
    flat parameters gathered for generate; the inner FSDP units gather their own in forward.
    FSDP2 and unsharded models need nothing."""
    if isinstance(model, FSDP):
        return FSDP.summon_full_params(model, recurse=False, writeback=False)
    return nullcontext()
