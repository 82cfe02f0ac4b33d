"""Communication: the one module that talks to Horovod.

The optimizer and the reducer only see the small :class:`Communicator`
interface. :class:`HorovodCommunicator` runs named asynchronous Horovod
all-reduces (Gloo, MPI or NCCL, whatever Horovod was built with) and checks
the Horovod arguments ACP-SGD cannot honour; :class:`LocalCommunicator` is
the world-size-1 path used by single-process unit tests and needs no
``hvd.init()``. :func:`gather_objects` is the DDP hook's cross-rank check's
collective, over ``torch.distributed``; :func:`leave_process_group` ends a
``torch.distributed`` script without the abort at exit Gloo can cause.
"""
from __future__ import annotations

import dataclasses
import io
import pickle
import time
from typing import Any, List

import torch
from torch import Tensor

from . import lanes

__all__ = ["CommStats", "Communicator", "HorovodCommunicator", "LocalCommunicator",
           "gather_objects", "leave_process_group"]


@dataclasses.dataclass
class CommStats:
    """Counters of what this rank submitted to all-reduce.

    Attributes:
        allreduces: number of all-reduce operations launched (a sparse
            reduction, two allgathers, counts as one).
        bytes_sent: payload bytes handed to all-reduce and all-gather (after
            wire compression such as fp16), i.e. what this rank contributes.
        allgathers: number of all-gathers launched (:meth:`Communicator.allgather_async`).
        bytes_received: payload bytes the collectives handed back to this
            rank: an all-reduce as many as it was handed, an all-gather every
            other rank's part (N - 1 times this rank's when the parts are equal).
    """

    allreduces: int = 0
    bytes_sent: int = 0
    allgathers: int = 0
    bytes_received: int = 0


class Communicator:
    """Interface between the reducer and a collective-communication backend."""

    def __init__(self) -> None:
        self.stats = CommStats()

    def size(self) -> int:
        raise NotImplementedError

    def rank(self) -> int:
        raise NotImplementedError

    def reduction_weight(self) -> float:
        """``w`` such that an all-reduce leaves ``w * sum over ranks`` (1/size to average)."""
        raise NotImplementedError

    def allreduce_async_(self, tensor: Tensor, name: str) -> Any:
        """Start reducing ``tensor`` in place across ranks; returns a handle."""
        raise NotImplementedError

    def synchronize(self, handle: Any) -> None:
        """Wait for ``handle``; afterwards its tensor holds the result."""
        raise NotImplementedError

    def allreduce_lanes_async_(self, tensor: Tensor, name: str) -> Any:
        """Start reducing ``tensor``, integer levels in ``[-L, L]`` for this
        world (:func:`hvd_acp.lanes.levels_per_rank`) or NaN, in place: they
        travel as 8-bit lanes of int32 words (:mod:`hvd_acp.lanes`), summed;
        after :meth:`synchronize` of the handle ``tensor`` holds
        ``reduction_weight()`` times the levels' sum, or NaN everywhere if
        any rank's held NaN. Counted as the words it sends."""
        raise NotImplementedError(f"{type(self).__name__} cannot reduce 8-bit lanes")

    def included(self) -> bool:
        """Whether this process takes part in the reductions (is in the process set)."""
        return True

    def wire_settings(self) -> dict:
        """What this backend does to a buffer on the wire, by name (every
        rank must have the same): none for a backend without settings."""
        return {}

    def sparse_allreduce_async(self, tensor: Tensor, name: str) -> Any:
        """Start reducing the sparse ``tensor`` across ranks, uncompressed.

        Every rank's indices and values are gathered, as Horovod sends sparse
        gradients; the result is ``reduction_weight()`` times their sum.
        Returns a handle for :meth:`synchronize_sparse`.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot reduce sparse tensors; pass sparse_as_dense=True "
            "to send sparse gradients densely")

    def synchronize_sparse(self, handle: Any) -> Tensor:
        """Wait for a :meth:`sparse_allreduce_async` handle; returns the sparse result."""
        raise NotImplementedError

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every rank's ``obj``, in rank order (a blocking collective)."""
        raise NotImplementedError

    def allgather_async(self, tensor: Tensor, name: str) -> Any:
        """Start gathering every rank's ``tensor`` (the same shape but for
        dimension 0 on every rank); returns a handle for :meth:`synchronize_allgather`."""
        raise NotImplementedError(f"{type(self).__name__} cannot all-gather tensors")

    def synchronize_allgather(self, handle: Any) -> Tensor:
        """Wait for an :meth:`allgather_async` handle; returns every rank's
        tensor concatenated along dimension 0, in rank order."""
        raise NotImplementedError

    def broadcast_object(self, obj: Any, root_rank: int, name: str) -> Any:
        """``obj`` of ``root_rank`` on every rank (a blocking collective)."""
        raise NotImplementedError

    def any_rank(self, flag: bool, name: str) -> bool:
        """Whether ``flag`` is true on any rank: a blocking collective of one
        element, a control message not counted in :attr:`stats`."""
        raise NotImplementedError

    def _count(self, *tensors: Tensor) -> None:
        """Count one operation that sends ``tensors``."""
        self.stats.allreduces += 1
        sent = sum(t.numel() * t.element_size() for t in tensors)
        self.stats.bytes_sent += sent
        self.stats.bytes_received += sent

    def _count_gather(self, sent: Tensor, gathered: Tensor) -> None:
        """Count one all-gather: ``sent`` out, the other ranks' part of ``gathered`` in."""
        self.stats.allgathers += 1
        own = sent.numel() * sent.element_size()
        self.stats.bytes_sent += own
        self.stats.bytes_received += gathered.numel() * gathered.element_size() - own


class LocalCommunicator(Communicator):
    """A world of one process: reductions are the identity (times the scale).

    Args:
        scale: factor applied by every reduction, e.g. ``1.0`` for average
            or sum over one rank.
    """

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale
        self.launched: List[str] = []

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def reduction_weight(self) -> float:
        return self.scale

    def allreduce_async_(self, tensor: Tensor, name: str) -> Any:
        self._count(tensor)
        self.launched.append(name)
        return tensor

    def synchronize(self, handle: Any) -> None:
        if isinstance(handle, _Pending):               # lanes: the words' digits
            _unpack_into(handle.target, handle.sent, self.scale)
        elif self.scale != 1.0:
            handle.mul_(self.scale)

    def allreduce_lanes_async_(self, tensor: Tensor, name: str) -> Any:
        words = lanes.pack(tensor)
        self._count(words)
        self.launched.append(name)
        return _Pending(None, tensor, words, _LANES)

    def sparse_allreduce_async(self, tensor: Tensor, name: str) -> Any:
        tensor = tensor.coalesce()
        self._count(tensor.indices(), tensor.values())
        self.launched.append(name)
        return tensor

    def synchronize_sparse(self, handle: Any) -> Tensor:
        return handle * self.scale if self.scale != 1.0 else handle

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        return [obj]

    def allgather_async(self, tensor: Tensor, name: str) -> Any:
        self.launched.append(name)
        return tensor

    def synchronize_allgather(self, handle: Any) -> Tensor:
        self._count_gather(handle, handle)
        return handle.clone()

    def broadcast_object(self, obj: Any, root_rank: int, name: str) -> Any:
        return obj

    def any_rank(self, flag: bool, name: str) -> bool:
        return bool(flag)


#: A :class:`_Pending`'s ``ctx`` for 8-bit lanes.
_LANES = object()


def _unpack_into(target: Tensor, words: Tensor, weight: float) -> None:
    """``target`` <- ``weight`` times the level sums in ``words``."""
    sums = lanes.unpack(words, target.numel(), target.dtype).view_as(target)
    target.copy_(sums)
    if weight != 1.0:
        target.mul_(weight)


#: Sleep between polls of an unfinished Horovod handle: the first, and the
#: longest it grows to, doubling (seconds).
WAIT_FIRST_SLEEP_S, WAIT_LONGEST_SLEEP_S = 5e-5, 5e-4


def wait_for(hvd, handle: Any) -> Any:
    """``hvd.synchronize(handle)``, without its busy wait.

    Horovod's ``synchronize`` spins on the handle (``std::this_thread::yield``
    in a loop), so a rank waiting for the network keeps one core busy in the
    kernel: on a host with no core to spare (ranks sharing a node's cores,
    or data-loading workers beside each rank) that core is taken from the
    computation and from Horovod's own threads, which run the collective.
    This polls the handle and sleeps in between, from 50 us doubling to at
    most 0.5 ms, so the wait adds at most that to a collective's end.
    """
    sleep_s = WAIT_FIRST_SLEEP_S
    while not hvd.poll(handle):
        time.sleep(sleep_s)
        sleep_s = min(2 * sleep_s, WAIT_LONGEST_SLEEP_S)
    return hvd.synchronize(handle)


@dataclasses.dataclass
class _Pending:
    handle: Any
    target: Tensor
    sent: Tensor
    ctx: Any


class HorovodCommunicator(Communicator):
    """Named asynchronous all-reduces through ``horovod.torch``.

    Args:
        op: ``hvd.Average`` or ``hvd.Sum``.
        gradient_predivide_factor: as in ``hvd.DistributedOptimizer``: with
            ``op=hvd.Average`` the sum is scaled by ``1/f`` before and
            ``f/size`` after the reduction.
        process_set: the Horovod process set to reduce over.
        fp16_wire: each fused buffer travels in float16
            (``hvd.Compression.fp16``), otherwise as it is.
    """

    @staticmethod
    def check_arguments(op, gradient_predivide_factor: float, compression) -> None:
        """Raise ``ValueError``/``NotImplementedError`` for Horovod arguments
        ACP-SGD cannot honour (before any collective: nothing is built)."""
        import horovod.torch as hvd
        if op is not None and op not in (hvd.Average, hvd.Sum):
            if op == hvd.Adasum:
                raise NotImplementedError(
                    "op=hvd.Adasum is not supported by ACP-SGD: Adasum combines full "
                    "gradients pairwise, which low-rank factors cannot reproduce")
            raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")
        if op == hvd.Sum and gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor is only valid with op=hvd.Average")
        if compression is not None and compression not in (hvd.Compression.none,
                                                           hvd.Compression.fp16):
            raise NotImplementedError(f"compression={compression!r} is not supported; use "
                                      "hvd.Compression.none or hvd.Compression.fp16")

    @staticmethod
    def fp16_wire_of(compression):
        """Horovod's ``compression`` argument as :class:`hvd_acp.Settings`'s
        ``fp16_wire``: True for ``hvd.Compression.fp16``, False for
        ``hvd.Compression.none``, None (the default) for None."""
        if compression is None:
            return None
        import horovod.torch as hvd
        return compression is hvd.Compression.fp16

    def __init__(self, op=None, gradient_predivide_factor: float = 1.0,
                 process_set=None, fp16_wire: bool = False) -> None:
        super().__init__()
        import horovod.torch as hvd

        self._hvd = hvd
        self.op = hvd.Average if op is None else op
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self.compression = hvd.Compression.fp16 if fp16_wire else hvd.Compression.none
        if self.op == hvd.Average:
            self.prescale = 1.0 / gradient_predivide_factor
            self.postscale = gradient_predivide_factor
        else:
            self.prescale = self.postscale = 1.0

    def size(self) -> int:
        return self.process_set.size()

    def rank(self) -> int:
        return self.process_set.rank()

    def reduction_weight(self) -> float:
        # The predivide factor's pre- and postscale cancel out.
        return 1.0 / self.size() if self.op == self._hvd.Average else 1.0

    def allreduce_async_(self, tensor: Tensor, name: str) -> Any:
        sent, ctx = self.compression.compress(tensor)
        self._count(sent)
        handle = self._hvd.allreduce_async_(
            sent, name=name, op=self.op, prescale_factor=self.prescale,
            postscale_factor=self.postscale, process_set=self.process_set)
        return _Pending(handle, tensor, sent, ctx)

    def allreduce_lanes_async_(self, tensor: Tensor, name: str) -> Any:
        # Always a sum of the words (digit sums stay exact), then this
        # communicator's weight: the predivide factor's scales cancel out.
        words = lanes.pack(tensor)
        self._count(words)
        handle = self._hvd.allreduce_async_(words, name=name, op=self._hvd.Sum,
                                            process_set=self.process_set)
        return _Pending(handle, tensor, words, _LANES)

    def synchronize(self, handle: _Pending) -> None:
        wait_for(self._hvd, handle.handle)
        if handle.ctx is _LANES:
            _unpack_into(handle.target, handle.sent, self.reduction_weight())
        elif handle.sent is not handle.target:
            handle.target.copy_(self.compression.decompress(handle.sent, handle.ctx))

    def included(self) -> bool:
        # None (a process set not initialized) counts as outside, as in Horovod.
        return bool(self.process_set.included())

    def wire_settings(self) -> dict:
        hvd = self._hvd
        ops = {hvd.Average: "hvd.Average", hvd.Sum: "hvd.Sum", hvd.Adasum: "hvd.Adasum"}
        compressions = {hvd.Compression.none: "hvd.Compression.none",
                        hvd.Compression.fp16: "hvd.Compression.fp16"}
        return {"op": ops.get(self.op, repr(self.op)),
                "compression": compressions.get(self.compression, repr(self.compression)),
                "prescale_factor": self.prescale, "postscale_factor": self.postscale}

    def sparse_allreduce_async(self, tensor: Tensor, name: str) -> Any:
        # Horovod's own sparse reduction (two allgathers), as its optimizer
        # sends sparse gradients: uncompressed, without pre- or postscale.
        tensor = tensor.coalesce()
        self._count(tensor.indices(), tensor.values())
        return self._hvd.sparse_allreduce_async(tensor, name=name, op=self.op,
                                                process_set=self.process_set)

    def synchronize_sparse(self, handle: Any) -> Tensor:
        return handle()

    def allgather_async(self, tensor: Tensor, name: str) -> Any:
        return tensor, self._hvd.allgather_async(tensor, name=name, process_set=self.process_set)

    def synchronize_allgather(self, handle: Any) -> Tensor:
        sent, pending = handle
        gathered = wait_for(self._hvd, pending)
        self._count_gather(sent, gathered)
        return gathered

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        # Like hvd.allgather_object, but over this communicator's process set.
        payload = pickle.dumps(obj)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        sizes = self._hvd.allgather(torch.tensor([data.numel()], dtype=torch.int64),
                                    name=f"{name}.sizes", process_set=self.process_set)
        gathered = self._hvd.allgather(data, name=f"{name}.data",
                                       process_set=self.process_set)
        out, offset = [], 0
        for size in sizes.tolist():
            out.append(pickle.load(io.BytesIO(gathered[offset:offset + size].numpy().tobytes())))
            offset += size
        return out

    def broadcast_object(self, obj: Any, root_rank: int, name: str) -> Any:
        return self._hvd.broadcast_object(obj, root_rank=root_rank, name=name,
                                          process_set=self.process_set)

    def any_rank(self, flag: bool, name: str) -> bool:
        total = self._hvd.allreduce(torch.tensor([1.0 if flag else 0.0]), name=name,
                                    op=self._hvd.Sum, process_set=self.process_set)
        return bool(total.item() > 0)


def gather_objects(obj: Any, device: torch.device, group=None) -> List[Any]:
    """Every rank's ``obj`` in rank order, through ``torch.distributed`` on
    ``device`` (the device of the tensors the group reduces: NCCL needs one
    per rank, which ``dist.all_gather_object`` guesses from the current one).
    A blocking collective of ``group`` (default: the world)."""
    import torch.distributed as dist
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device),
                    group=group)
    longest = max(int(size) for size in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [pickle.loads(chunk[:int(size)].cpu().numpy().tobytes())
            for chunk, size in zip(gathered, sizes)]


def leave_process_group(pause_s: float = 0.2) -> None:
    """End ``torch.distributed`` at the end of a script: a barrier, a pause,
    ``destroy_process_group()``; nothing where no process group is initialized.

    Without it a rank can abort after a run that succeeded ("terminate called
    without an active exception", exit code -6, so ``torchrun`` reports a
    failure): Gloo frees a finished collective's tensors (the last all-gather
    of an evaluation, a barrier's record of it) in its own thread, which needs
    the GIL, and a thread that gets it while the interpreter shuts down aborts
    the process (pytorch/pytorch#190489). ``destroy_process_group()`` alone
    does not stop that thread while a DDP model still holds the group. The
    pause, after every rank reached the barrier, releases the GIL to it.
    Blocking: every rank of the group must call it.
    """
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        time.sleep(pause_s)
        dist.destroy_process_group()
