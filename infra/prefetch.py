"""--async_lag K: the sampler works K iterations ahead of the trainer, in a background thread.

    ahead = Prefetch(lag=K, restore=Samples.restore, acc=accelerator)
    s = ahead.take(it, sample)   # iteration it's batch, sample(it); starts sampling sample(it + K)
    ahead.idle()            # before a weight sync: no generation is using the engine's weights

Choices:
1. One worker thread, so batches are sampled in iteration order, each by the engine's weights at
   the moment its generation starts. take(it) hands over batch it and submits batches up to
   it + K; idle() waits for them before the trainer replaces the engine's weights. Batch it + K is
   therefore sampled by the weights after iteration it - 1 (prime-rl's async_level = K), and the
   first K + 1 batches by the starting weights. K = 0 samples in the caller's thread, as before.
2. A thread, not a process: vLLM runs in this process (rollout.py says why) and its forward passes
   release the GIL, so sampling overlaps the update. On the CPU both share the cores; what the
   overlap gains there is measured in bench/bench_async.py.
3. The in-flight batches are part of the checkpoint (accelerate's register_for_checkpointing: every
   rank's are gathered and saved by the main process), so a resumed run trains on the batches an
   unbroken one would have: they were sampled by weights that no longer exist. A checkpoint is
   taken after the weight sync, when none is being generated. Resuming needs the same process
   count (each rank's batches are its own). The last iteration too samples K batches ahead, so a
   run resumed with more --iters trains on what an unbroken longer run would have.
"""
import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from accelerate.utils import gather_object

from infra.flags import FlagError


class Prefetch:
    def __init__(self, lag, restore, acc):
        """restore(dict) -> a batch (a dataclass) again from its saved fields."""
        self.lag, self.restore, self.acc = lag, restore, acc
        # OpenMP's thread count is per thread, and a new thread starts at the machine's: vLLM's CPU
        # attention then plans with one count and runs with another (seen: a failed check, then a
        # hang). So the worker first takes torch's count, through the binding: vLLM's CPU worker
        # replaces torch.set_num_threads with a no-op once the engine is up.
        self.pool = ThreadPoolExecutor(1, "rollout", initializer=torch._C.set_num_threads,
                                       initargs=(torch.get_num_threads(),)) if lag else None
        self.pending = {}                      # iteration -> Future of its batch
        self.next = None                       # the first iteration not yet submitted
        self.failed = None                     # the first batch whose sampling raised

    def take(self, it, sample):
        """Iteration it's batch, sample(it): at K = 0 sampled now, in the caller's thread; at
        K >= 1 sampled earlier (waits if it still is), and sample(it + 1 .. it + K) then on their
        way."""
        if not self.lag:
            return sample(it)
        self.next = self.next or it             # a fresh run, or a resumed one at K = 0
        while self.next <= it + self.lag:       # at the start: the first K + 1 batches
            self.pending[self.next] = self.pool.submit(self._sample, sample, self.next)
            self.next += 1
        return self.pending.pop(it).result()

    def idle(self):
        """Wait until no generation is under way (the weight sync must not race one)."""
        for f in self.pending.values():
            f.result()

    def _sample(self, sample, it):
        """The worker's job. Once a batch has failed, the batches queued behind it fail at once
        instead of sampling with the engine that failed: the error reaches the loop when it takes
        the failed batch, and the process exits rather than waiting for the queue to drain."""
        if self.failed is not None:
            raise RuntimeError(f"batch {it} not sampled: sampling batch {self.failed} failed")
        try:
            return sample(it)
        except BaseException:
            self.failed = it
            raise

    def state_dict(self):                      # every rank calls it: the gather is collective
        self.idle()
        mine = {it: dataclasses.asdict(f.result()) for it, f in self.pending.items()}
        return {"lag": self.lag, "ranks": gather_object([mine])}

    def load_state_dict(self, state):
        ranks = state["ranks"]
        if len(ranks) != self.acc.num_processes or state["lag"] != self.lag:
            raise FlagError(f"--resume: the checkpoint holds the in-flight batches of "
                             f"--async_lag {state['lag']} over {len(ranks)} process(es); resume "
                             f"with the same (now {self.lag} over {self.acc.num_processes})")
        self.pending = {}
        for it, fields in ranks[self.acc.process_index].items():
            done = Future()
            done.set_result(self.restore(fields))
            self.pending[int(it)] = done
        self.next = max(self.pending) + 1 if self.pending else None
