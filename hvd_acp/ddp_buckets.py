"""One DDP bucket through the compression state: the body of :func:`hvd_acp.ddp.acp_hook`.

Per bucket and iteration, :class:`BucketReducer` fills the bucket's payload
(:meth:`.CompressionState.encode_`), launches one asynchronous
``all_reduce``, finishes the residual it deferred while the payload is on
the wire, and in the future's callback writes the average back into the
bucket (:meth:`.CompressionState.decode_`). It knows nothing of parameter
names, settings or optimizers: :class:`hvd_acp.ddp.ACPState` does.
"""
import threading
import time
from typing import List

import torch
import torch.distributed as dist
from torch import Tensor

from . import lanes
from .agreement import agree, describe_differences
from .comm import CommStats, gather_objects
from .fusion import one_bucket
from .rounds import BufferCache
from .state import CompressionState

__all__ = ["BucketReducer"]


class BucketReducer:
    """The payloads, counters and iteration bookkeeping of one DDP model.

    Args:
        process_group: the group to average over (None: the world).

    Attributes:
        comm_stats: all-reduces this rank launched and the bytes it sent.
        compression_seconds: wall time of the compression maths (hook and
            callbacks, which run on a communication thread).
    """

    def __init__(self, process_group=None) -> None:
        self.process_group = process_group
        self.comm_stats = CommStats()
        self.compression_seconds = 0.0
        self._iteration_open = False
        self._lock = threading.Lock()
        #: One payload per bucket, phase and layout: the bucket's previous
        #: all-reduce is done before its hook runs again (DDP waits for every
        #: bucket at the end of backward).
        self._buffers = BufferCache()

    def agree(self, device: torch.device, facts: dict) -> None:
        """Raise the same ``ValueError`` on every rank unless ``facts`` (settings
        and state) are equal: a rank that loaded another checkpoint or another
        ``matrix_rank`` would send payloads of another size or phase (Gloo
        aborts, NCCL hangs). One small collective on ``device``."""
        agree(lambda obj: gather_objects(obj, device, self.process_group), facts,
              explain=lambda rank, gathered: ValueError(
                  "ACPState differs between ranks: " + describe_differences(
                      gathered[0]["facts"], gathered[rank]["facts"], rank)
                  + "; pass the same settings and load the same checkpoint on every rank"))

    def begin(self, bucket: dist.GradBucket) -> None:
        """Raise if bucket 0 comes while an iteration is open (two models)."""
        if bucket.index() == 0 and self._iteration_open:
            raise RuntimeError(
                "acp_hook got bucket 0 of a new iteration before the last bucket of the "
                "previous one: this ACPState is registered on two DDP models; create one "
                "ACPState per DDP model")
        self._iteration_open = True

    def reduce(self, bucket: dist.GradBucket, state: CompressionState,
               names: List[str], fp16_wire: bool = False) -> torch.futures.Future:
        """Send ``bucket`` (its parameters named ``names``); the last bucket
        of an iteration moves ``state`` to the next step. With ``fp16_wire``
        the payload travels as float16 (a copy, averaged back into it)."""
        buffer, grads, last = bucket.buffer(), bucket.gradients(), bucket.is_last()
        codec = state.begin_step() if bucket.index() == 0 else state.codec
        iteration = state.step_count

        started = time.perf_counter()
        plan = self._buffers.get(
            (bucket.index(), codec, tuple(names), state.layout_version, str(buffer.device)),
            lambda: [one_bucket([state.layouts[n] for n in names], codec,
                                f"bucket.{bucket.index()}")], buffer.device)
        members = plan.members[0]
        if plan.buckets[0].lanes_numel:            # the slots in their own order
            grad_of = dict(zip(names, grads))
            grads = [grad_of[name] for name, _ in members]
        compressed = [n for n, _ in members if n in state.tensors] if codec.compressed else []
        bases = state.bases(compressed, codec)
        # Each residual right after its projection, while A is in the cache,
        # but the last one's after the launch, which it would delay.
        owed, deferred = None, compressed[-1] if compressed else None
        for (name, slot), grad in zip(members, grads):
            owed = state.encode_(name, grad, slot, codec, basis=bases.get(name),
                                 defer=name == deferred) or owed
        self._spent(time.perf_counter() - started)

        payload = plan.buffers[0]
        future, unpack = self._launch(payload, plan, fp16_wire)
        if owed is not None:
            # Before the callback is attached, which may then touch E.
            started = time.perf_counter()
            owed.finish_()
            self._spent(time.perf_counter() - started)
        if last:
            self._iteration_open = False
        world_size = dist.get_world_size(self.process_group)

        def finish(fut: torch.futures.Future) -> Tensor:
            started = time.perf_counter()
            averaged = unpack(fut).div_(world_size)
            state.decode_(codec, averaged, members, grads, bases, step=iteration)
            if last:
                state.end_step(iteration)
            self._spent(time.perf_counter() - started)
            return buffer

        return future.then(finish)

    def _launch(self, payload: Tensor, plan, fp16_wire: bool):
        """Start the payload's all-reduce(s): the levels at its start
        (``lanes_numel``) as int32 words of 8-bit lanes, the rest as it is
        (float16 with ``fp16_wire``). Returns the future of their sums and
        the function that writes them back into ``payload``."""
        split = plan.buckets[0].lanes_numel
        floats = payload[split:] if split else payload
        sent = []
        if split:
            sent.append(lanes.pack(payload[:split]))
        if floats.numel() and fp16_wire and payload.dtype != torch.float16:
            # The plan's reused copy of a whole payload; a new one of a part.
            sent.append(floats.to(torch.float16) if split else plan.fp16_copy(0))
        elif floats.numel():
            sent.append(floats)
        with self._lock:
            for tensor in sent:
                self.comm_stats.allreduces += 1
                self.comm_stats.bytes_sent += tensor.numel() * tensor.element_size()
                self.comm_stats.bytes_received += tensor.numel() * tensor.element_size()
        futures = [dist.all_reduce(tensor, group=self.process_group, async_op=True).get_future()
                   for tensor in sent]

        def unpack(fut) -> Tensor:
            results = [f.value()[0] for f in fut.value()] if split else [fut.value()[0]]
            if split:
                payload[:split].copy_(lanes.unpack(results.pop(0), split, payload.dtype))
            if results and results[0].data_ptr() != floats.data_ptr():
                floats.copy_(results[0])                # from the fp16 copy
            return payload

        future = torch.futures.collect_all(futures) if split else futures[0]
        return future, unpack

    def _spent(self, seconds: float) -> None:
        with self._lock:
            self.compression_seconds += seconds
