"""
Rollouts: groups of completions sampled from the policy, the log-prob of every sampled token under
the distribution that sampled it (mu), and the sampler's weights kept equal to the policy's.

    from rollout import make_engine, weight_buckets
    engine = make_engine("data/tiny/model", backend="vllm", max_model_len=256, seed=0)
    batch = engine.generate(prompt_ids, n=8, max_tokens=32, seed=1)   # a RolloutBatch
    engine.sync_weights(weight_buckets(model))                 # after every iteration's updates
    engine.sleep()                                             # --sleep_mode: free the KV cache

The engines are machinery (infra/vllm_engine.py, infra/hf_engine.py; the vLLM 0.32 internals they
rest on: infra/VLLM.md); what they sample, and how, is this list.

Choices:
1. By default vLLM's `LLM` lives in the training process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so
   weights move by reference, not through a socket, and a reader has no server to start
   (choice 8: a server of its own instead).
2. Sampling is the paper's: temperature 1, top_p 1, top_k off (the policy's own distribution),
   `n` samples per prompt, group-major (sample j of prompt i is index i * n + j). The sampled
   token's log-prob is the engine's *after* temperature (vLLM's `processed_logprobs`, the hf
   engine's log-softmax of the scores it samples from): mu's, the behaviour policy that sampled
   it. A call with a seed samples a function of that seed and the weights alone.
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
8. `--vllm_server URL[,URL...]` (`ServerRollout`, infra/vllm_server.py): vLLM's own server on
   devices or machines of its own (`python rollout.py serve MODEL`), sampled over HTTP, weights
   pushed through vLLM's weight-transfer API (a gloo backend of ours), the iteration as
   the weight version. The same RolloutBatch; each sample's `versions` entry names its weights.
"""
from infra.hf_engine import HFRollout
# RolloutBatch: one call's samples, group-major, as lists with one entry per sample: prompt_ids,
# completion_ids (EOS included when emitted), logprobs (mu's, one per completion token), truncated
# (max_tokens reached before EOS), texts (the decoded completions).
# weight_buckets(model, bucket_mb): the policy's (name, full tensor) pairs, in buckets for the sync.
from infra.vllm_engine import RolloutBatch, VLLMRollout, weight_buckets

__all__ = ["RolloutBatch", "make_engine", "weight_buckets"]


def make_engine(model_dir, backend="vllm", policy=None, servers=(), **kwargs):
    """backend: "vllm" (default; a separate engine, synced after every iteration), "hf"
    (transformers.generate on `policy`, the training model, or on a model loaded from model_dir),
    or "server" (vLLM servers at the URLs `servers`, choice 8)."""
    if backend == "server":
        from infra.vllm_server import ServerRollout
        return ServerRollout(list(servers), model_dir, **kwargs)
    if backend == "vllm":
        return VLLMRollout(model_dir, **kwargs)
    if backend == "hf":
        return HFRollout(model_dir, policy=policy, **kwargs)
    raise ValueError(f"unknown rollout backend {backend!r}; accepted: 'vllm', 'hf', "
                     "'server'")


if __name__ == "__main__":
    # python rollout.py serve MODEL --port 8000: the sampler as a service (--vllm_server)
    import sys
    if sys.argv[1:2] != ["serve"]:
        sys.exit("usage: python rollout.py serve MODEL [--port 8000] [--max_model_len 1024]")
    from infra.vllm_server import main
    main(sys.argv[2:])
