"""What a profile assumes about the ranks of a node, and the defaults a launch implies.

:func:`node_conditions` decides them: one rank per device on CUDA, one per
core on a CPU (the cores divided among the ranks as threads), at most the
smallest number of ranks predicted. :mod:`.node` measures a profile under
them; :mod:`.profile` records them; :mod:`.report` says them.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["NodeConditions", "node_conditions", "describe_conditions", "no_spare_core",
           "horovod_launcher", "usable_cores"]


@dataclasses.dataclass(frozen=True)
class NodeConditions:
    """What a profile assumes about the ranks of a node (see the module docstring)."""

    ranks_per_node: int
    threads_per_rank: int
    cores: int
    device: str
    horovod_thread: bool
    horovod_cycle_time_ms: float = 1.0
    alone: bool = False

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover (not Linux)
        return os.cpu_count() or 1


def horovod_launcher() -> Optional[str]:
    """``horovodrun`` beside this Python, or on ``PATH``, if Horovod's torch
    front end is installed; None otherwise."""
    try:
        if importlib.util.find_spec("horovod.torch") is None:
            return None
    except (ImportError, ValueError):
        return None
    beside = Path(sys.executable).with_name("horovodrun")
    if beside.is_file():
        return str(beside)
    return shutil.which("horovodrun")


def _cuda_devices() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def node_conditions(device: str = "cpu", *, ranks_per_node: Optional[int] = None,
                    threads_per_rank: Optional[int] = None, nps: Optional[Sequence[int]] = None,
                    gpus_per_node: Optional[int] = None, horovod_thread: Optional[bool] = None,
                    cycle_time_ms: Optional[float] = None, alone: bool = False,
                    cores: Optional[int] = None, cuda_devices: Optional[int] = None
                    ) -> NodeConditions:
    """The conditions a profile is measured under, each default what a launch uses.

    Args:
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        ranks_per_node: ranks computing at once on the node. Default: the
            ranks of a node that ``gpus_per_node`` describes; else one per
            device on CUDA; else one per ``threads_per_rank`` cores (one per
            core); never more than the smallest of ``nps``.
        threads_per_rank: torch threads of each rank; default the node's
            cores divided among its ranks (at least 1).
        nps: the numbers of ranks predicted (a launch of 2 puts at most 2 on
            a node).
        gpus_per_node: ranks per node as ``--gpus-per-node`` describes it.
        horovod_thread: Horovod initialized in every rank; default where
            Horovod and ``horovodrun`` are installed (never ``alone``).
        cycle_time_ms: HOROVOD_CYCLE_TIME; default the environment's, else 1.
        alone: measure in this process only, as a rank that has the node to
            itself (its threads still default to its share of the cores).
        cores, cuda_devices: the node's (default: this machine's).
    """
    for arg, value in (("ranks_per_node", ranks_per_node), ("threads_per_rank", threads_per_rank)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{arg} must be a positive int, got {value!r}")
    cores = cores or usable_cores()
    cuda = str(device).startswith("cuda")
    if ranks_per_node is None:
        if gpus_per_node and gpus_per_node > 1:
            ranks_per_node = gpus_per_node
        elif cuda:
            ranks_per_node = max(1, _cuda_devices() if cuda_devices is None else cuda_devices)
        else:
            ranks_per_node = max(1, cores // (threads_per_rank or 1))
        if nps:
            ranks_per_node = max(1, min(ranks_per_node, min(nps)))
    if threads_per_rank is None:
        threads_per_rank = max(1, cores // ranks_per_node)
    if cycle_time_ms is None:
        cycle_time_ms = float(os.environ.get("HOROVOD_CYCLE_TIME") or 1.0)
    if alone:
        horovod_thread = False
    elif horovod_thread is None:
        horovod_thread = horovod_launcher() is not None
    return NodeConditions(ranks_per_node=1 if alone else ranks_per_node,
                          threads_per_rank=threads_per_rank, cores=cores,
                          device="cuda" if cuda else "cpu", horovod_thread=bool(horovod_thread),
                          horovod_cycle_time_ms=float(cycle_time_ms), alone=alone)


def no_spare_core(profile: dict) -> bool:
    """Whether the profile's ranks left no core free on a CPU node: the
    collectives' host work then delays computation (``Settings.host_serial``).
    False for a profile that records no conditions."""
    cond = profile.get("conditions") or {}
    if cond.get("device", "cpu") != "cpu" or not cond.get("cores"):
        return False
    return cond["ranks_per_node"] * cond["threads_per_rank"] >= cond["cores"]


def describe_conditions(profile: dict) -> str:
    """What a profile assumed about the ranks, in one line."""
    cond = profile.get("conditions")
    device = str(profile.get("device", "cpu"))
    if not cond:
        if device.startswith("cuda"):
            return f"profiled in one process alone on {profile.get('device_name') or device}"
        threads = profile.get("torch_threads")
        if threads is None:
            return "profiled in one process alone on the CPU (its torch threads are not recorded)"
        return (f"profiled in one process alone on the CPU with {threads} torch "
                f"thread{'s' if threads != 1 else ''} per rank (a profile that records no "
                "other rank): the prediction holds where each rank computes alone with "
                "that many cores")
    threads = cond["threads_per_rank"]
    each = f"{threads} torch thread{'s' if threads != 1 else ''}"
    if cond.get("alone"):
        return (f"profiled in one process alone (--alone) with {each}: the prediction holds "
                "where each rank has its node to itself")
    ranks = cond["ranks_per_node"]
    where = (f"one per GPU ({profile.get('device_name') or 'cuda'})" if cond["device"] == "cuda"
             else f"on the node's {cond['cores']} core{'s' if cond['cores'] != 1 else ''}")
    text = (f"profiled with {ranks} rank{'s' if ranks != 1 else ''} per node computing at once "
            f"{where}, {each} each")
    if cond.get("horovod_thread"):
        text += (f", Horovod's background thread running in each (cycle "
                 f"{cond.get('horovod_cycle_time_ms', 1.0):g} ms)")
        if cond.get("ddp_compute_scale"):
            text += (f"; the DDP hook's compute from the same ranks without it "
                     f"({cond['ddp_compute_scale']:.2f}x)")
    else:
        text += ", without Horovod's background thread"
    steps = cond.get("per_rank_step_s") or []
    if "profiled_rank" in cond and len(steps) > 1:
        text += (f"; the slowest rank's kernels (rank {cond['profiled_rank']}, "
                 f"{max(steps) / min(steps):.2f}x the fastest's step)")
    return text
