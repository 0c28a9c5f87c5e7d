"""
A gloo backend for vLLM 0.32's weight-transfer API: the trainer broadcasts its weights to vLLM
servers on the CPU, where vLLM's own NCCL and CUDA-IPC backends cannot run.

    # in the server's worker process (rollout.py serve imports this module there through
    # --worker-extension-cls, which registers the backend before the model loads):
    WeightTransferEngineFactory.register_engine("gloo", GlooWeightTransferEngine)
    # in the trainer (infra/vllm_server.py):
    sender = GlooTrainerWeightTransferEngine.trainer_init(
        GlooTrainerInitInfo(master_address, master_port, world_size, rank=0),
        client=servers, source=weights)
    sender.send_weights(version)

The only code of ours that runs inside vLLM's process (infra/VLLM.md lists what it rests on).
It follows vLLM's dense NCCL engine (vllm/distributed/weight_transfer/nccl_engine.py): rank 0 is
the trainer, each server's workers come after it (`rank_offset`); a round is start_weight_update
(vLLM's layerwise reload: each layer is processed once all its weights have arrived),
update_weights (the names, dtypes and shapes over HTTP, the bytes by broadcast), then
finish_weight_update with the iteration as the weight version.

Choices:
1. A torch ProcessGroupGloo over its own TCPStore, not the default process group: the trainer's
   default group is Accelerate's (its ranks are the trainer's), and a server is no member of it.
2. One update_weights call and one broadcast per bucket, its tensors packed into one flat byte
   buffer (rollout.weight_buckets cuts buckets between decoder layers), not one per tensor:
   SmolLM2 has 272 tensors; and one bucket at a time in memory, as the in-process sync.
3. Tied embeddings: the model's named_parameters() as they are (the embedding once). vLLM's
   tied LM head shares the embedding's storage through the reload: with every weight changed,
   the embedding included, the server's log-probs equal the trainer's after a sync (2.9e-6 on
   the tiny Qwen2, 8.9e-6 on SmolLM2's Llama; tests/test_vllm_server.py). Sending
   `lm_head.weight` as well is refused by vLLM's Llama loader when the embedding is not in the
   same update_weights call.
"""
import datetime
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore
from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine,
                                                   WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import (WeightTransferEngineFactory,
                                                      WeightTransferTrainerFactory)

BACKEND = "gloo"
TIMEOUT = datetime.timedelta(minutes=10)   # a collective that waits longer is a dead peer


def open_group(address, port, rank, world_size, is_master):
    """The transfer group: rank 0 (the trainer) hosts the store, every server worker joins it."""
    store = TCPStore(address, port, world_size, is_master=is_master, timeout=TIMEOUT,
                     wait_for_workers=False)
    return ProcessGroupGloo(PrefixStore("gppo_weights", store), rank, world_size, TIMEOUT)


def pack(tensors):
    """One flat uint8 buffer of the tensors' bytes, in order (choice 2)."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def nbytes(dtype, shape):
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def unpack(buffer, dtypes, shapes):
    out, start = [], 0
    for dtype, shape in zip(dtypes, shapes):
        n = nbytes(dtype, shape)
        out.append(buffer[start:start + n].view(dtype).view(shape))
        start += n
    return out


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """What a server's workers need to join: the store's address and their first rank."""
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update_weights call: its buckets' names, dtypes and shapes, in broadcast order."""
    buckets: list          # list[list[str]] of names
    dtype_names: list      # list[list[str]]
    shapes: list           # list[list[list[int]]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The server side, one per vLLM worker."""
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None

    def init_transfer_engine(self, init_info):
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = open_group(init_info.master_address, init_info.master_port, rank,
                                init_info.world_size, is_master=False)

    def start_weight_update(self):
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self):
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, info):
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call "
                               "/init_weight_transfer_engine first")
        for names, dtype_names, shapes in zip(info.buckets, info.dtype_names, info.shapes):
            dtypes = [getattr(torch, d) for d in dtype_names]
            buffer = torch.empty(sum(map(nbytes, dtypes, shapes)), dtype=torch.uint8)
            self.group.broadcast(buffer, 0).wait()
            self.model.load_weights(list(zip(names, unpack(buffer, dtypes, shapes))))

    def shutdown(self):
        self.group = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    master_address: str
    master_port: int
    world_size: int        # 1 (the trainer) + every server's workers


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer side. `client` is a list of per-server clients, each with
    `.workers` (its world size) and the four weight-sync calls of vLLM's HTTP client; `source`
    is a callable returning the round's buckets of (name, tensor) (rollout.weight_buckets)."""
    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.group = None
        if not engine.is_sender:
            return engine
        offsets = [1 + sum(s.workers for s in client[:i]) for i in range(len(client))]
        with ThreadPoolExecutor(len(client)) as pool:   # every rank must join at once
            joined = [pool.submit(s.init_weight_transfer_engine, asdict(GlooInitInfo(
                init_info.master_address, init_info.master_port, offset, init_info.world_size)))
                for s, offset in zip(client, offsets)]
            engine.group = open_group(init_info.master_address, init_info.master_port, 0,
                                      init_info.world_size, is_master=True)
            for j in joined:
                j.result()
        return engine

    def send_weights(self, version=None):
        """One round: start, then per bucket its update_weights call (the names, dtypes and
        shapes) with the bytes broadcast beside it, then finish with the version. Lazy: a bucket
        is gathered (FSDP) and sent before the next is made, so memory holds one bucket."""
        if not self.is_sender:        # other ranks only join the gathers (FSDP full_tensor)
            for _ in self.source():
                pass
            return
        with ThreadPoolExecutor(len(self.client)) as pool:
            list(pool.map(lambda s: s.start_weight_update(), self.client))
            for bucket in self.source():
                tensors = [t.detach().cpu() for _, t in bucket]
                info = asdict(GlooUpdateInfo([[n for n, _ in bucket]],
                                             [[str(t.dtype).removeprefix("torch.")
                                               for t in tensors]],
                                             [[list(t.shape) for t in tensors]]))
                # each server's update_weights blocks in the broadcast until it has the bytes
                receiving = [pool.submit(s.update_weights, info) for s in self.client]
                self.group.broadcast(pack(tensors), 0).wait()
                for r in receiving:
                    r.result()
            list(pool.map(lambda s: s.finish_weight_update(version), self.client))

    def shutdown(self):
        self.group = None


def register():
    """Both sides' registries (idempotent: the trainer may build several senders)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)


class ServerExtension:
    """--worker-extension-cls: vLLM mixes this class into each server worker; importing this
    module there is what registers the backend (register() below runs at import)."""


register()
