"""Every job the benchmark runs, declared once: the floor, one job per method of
:mod:`hvd_acp.methods`, and the diagnostics (``--diagnostics``).

A job is what each of its worker processes does (:mod:`.worker`) and how the
driver starts them (:mod:`.driver`): under ``horovodrun``, under ``torchrun``,
or as plain processes with no collective library (:data:`LOCAL`).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from hvd_acp.methods import HOROVOD, REGISTRY, TORCHRUN

__all__ = ["LOCAL", "Job", "FLOOR_JOB", "DIAGNOSTICS", "JOBS", "get"]

#: Plain processes, no collective library, no network.
LOCAL = "local"


@dataclasses.dataclass(frozen=True)
class Job:
    """One job of the benchmark.

    Attributes:
        key: its name in ``--method`` of the worker, in results.json and in
            the names of its log and raw files.
        launcher: ``hvd_acp.methods.HOROVOD``, ``TORCHRUN`` or :data:`LOCAL`.
        label: its name in results.md.
        short: its name in a column header (docs/benchmarks.md).
        method: the key of the method whose factory sets up the training
            (None: a plain local optimizer). A :data:`LOCAL` job runs it on a
            world of one (``hvd_acp.LocalCommunicator``): its compression, no
            communication.
        processes: how many processes: 1, or None for one per rank.
        probe: after its steps, time a tiny all-reduce on its ranks
            (:func:`.worker.probe_tiny_allreduce`).
    """

    key: str
    launcher: str
    label: str
    short: str
    method: Optional[str] = None
    processes: Optional[int] = None
    probe: bool = False


#: The floor: the model's step in one process, no communication.
FLOOR_JOB = Job("compute", LOCAL, "compute only (floor)", "floor (1 process)", processes=1)

#: Where the time over the floor comes from (``--diagnostics``), in run order.
DIAGNOSTICS: Tuple[Job, ...] = (
    Job("compute-concurrent", LOCAL,
        "floor with every rank computing at once (N processes, no communication)",
        "all ranks computing at once"),
    Job("hvd-idle", HOROVOD,
        "same under Horovod: hvd.init(), plain local optimizer, nothing all-reduced",
        "same under Horovod, nothing all-reduced", probe=True),
    Job("ddp-idle", TORCHRUN,
        "same under torch.distributed: Gloo process group, plain local optimizer, "
        "nothing all-reduced", "same under torch.distributed", probe=True),
    Job("acp-local", LOCAL,
        "ACP-SGD on a world of one (LocalCommunicator) in N processes at once: "
        "compression, no communication",
        "ACP-SGD compression, no communication (all ranks)", method="acp"),
)

#: Every job by key: the floor, the methods, the diagnostics.
JOBS: Dict[str, Job] = {job.key: job for job in (
    FLOOR_JOB,
    *(Job(m.key, m.launcher, m.title, m.label, method=m.key) for m in REGISTRY.values()),
    *DIAGNOSTICS)}


def get(key: str) -> Job:
    """The job named ``key``; ``ValueError`` listing the jobs otherwise."""
    try:
        return JOBS[key]
    except KeyError:
        raise ValueError(f"job must be one of {', '.join(JOBS)}, got {key!r}") from None
