"""The ranks of the user's launch, as the A/B tool needs them.

``hvd-acp-ab`` runs inside a launch the user already has: under
``horovodrun`` (Horovod's ranks) or, with ``--ddp``, under ``torchrun``
(a ``torch.distributed`` process group: NCCL on CUDA devices, Gloo on
CPUs). :class:`World` hides which: rank, size, the local rank that picks the
device, and the three collectives the tool itself needs (gathering each
rank's step times, a barrier between methods, one broadcast of the initial
weights).
"""
from __future__ import annotations

import gc
import os
from typing import Any, List

import torch

from ..comm import leave_process_group
from ..methods import HOROVOD, TORCHRUN

__all__ = ["World", "start"]


class World:
    """This process's place in the launch.

    Attributes:
        launcher: :data:`hvd_acp.methods.HOROVOD` or :data:`~hvd_acp.methods.TORCHRUN`.
        rank, size: this rank and the number of ranks.
        local_rank, local_size: the same within this node.
        device: the device this rank computes on (``cuda:<local_rank>`` or ``cpu``).
    """

    def __init__(self, launcher: str, rank: int, size: int, local_rank: int, local_size: int,
                 device: torch.device) -> None:
        self.launcher = launcher
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = local_rank, local_size
        self.device = device

    def allgather(self, value: Any) -> List[Any]:
        """Every rank's ``value`` (a picklable object), in rank order."""
        if self.launcher == HOROVOD:
            import horovod.torch as hvd
            return list(hvd.allgather_object(value, name="hvd_acp.ab.gather"))
        import torch.distributed as dist
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        if self.launcher == HOROVOD:
            import horovod.torch as hvd
            hvd.barrier()
        else:
            import torch.distributed as dist
            dist.barrier()

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank (done once: the methods
        then start from copies of the same weights)."""
        if self.launcher == HOROVOD:
            import horovod.torch as hvd
            hvd.broadcast_parameters(module.state_dict(), root_rank=0)
            return
        import torch.distributed as dist
        with torch.no_grad():
            for tensor in module.state_dict().values():
                dist.broadcast(tensor, src=0)

    def shutdown(self) -> None:
        """Leave the collective library cleanly.

        What the methods left (DDP reducers, hook states, their futures) is
        collected first: left to interpreter finalization, a Gloo work that
        still holds their tensors is destroyed without the interpreter and
        aborts the process ("terminate called without an active exception";
        :func:`~hvd_acp.comm.leave_process_group`).
        """
        gc.collect()
        if self.launcher == HOROVOD:
            import horovod.torch as hvd
            hvd.shutdown()
        else:
            leave_process_group()


def _device(kind: str, local_rank: int) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device here "
                           f"(torch {torch.__version__}); use --device cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(f"--device cuda: local rank {local_rank} has no device of its own "
                           f"({count} visible); launch at most {count} ranks per node")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def start(launcher: str, device: str) -> World:
    """Join the launch (``hvd.init()``, or ``init_process_group`` from torchrun's
    environment) and pick this rank's device (``"cpu"`` or ``"cuda"``: one
    device per local rank)."""
    if launcher == HOROVOD:
        import horovod.torch as hvd
        hvd.init()
        local_rank, local_size = hvd.local_rank(), hvd.local_size()
        world = World(HOROVOD, hvd.rank(), hvd.size(), local_rank, local_size,
                      _device(device, local_rank))
        return world
    if launcher != TORCHRUN:
        raise ValueError(f"launcher must be {HOROVOD!r} or {TORCHRUN!r}, got {launcher!r}")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("--ddp measures the ranks of a torchrun launch: run it as "
                           "torchrun --nproc-per-node N -m hvd_acp.ab --ddp ... "
                           "(RANK and WORLD_SIZE are not set)")
    import torch.distributed as dist
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch_device = _device(device, local_rank)
    dist.init_process_group("nccl" if torch_device.type == "cuda" else "gloo")
    return World(TORCHRUN, dist.get_rank(), dist.get_world_size(), local_rank,
                 int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch_device)
