"""A profile measured as the ranks of one node will run: every local rank at once.

A rank does not train alone. The other ranks of its node compute at the same
time on the node's other cores (or devices), each with its share of the
cores as torch threads, and under Horovod every rank has Horovod's
background thread waking once per cycle. A profile of one process alone
misses all of it: on a 2-core host with 2 ranks, ACP-SGD's step sat 0.43 s
above the single-process floor where a profile of one process predicted
0.05 s.

:func:`profile_on_node` starts ``ranks_per_node`` processes
(:mod:`.node_worker`) that profile the model at the same moment, under
``horovodrun`` with Horovod initialized in each one unless told otherwise;
a rank that is done keeps training until the last one is, so that no rank
is measured on an emptier node. Rank 0's profile is returned, with what it
assumed in ``conditions``:

- ``ranks_per_node``, ``threads_per_rank``, ``cores`` (the node's usable
  cores), ``device`` (``cpu`` or ``cuda``), ``alone`` (one process only);
- ``horovod_thread``, ``horovod_cycle_time_ms``: Horovod's methods were
  timed with its background thread alive, at that cycle;
- ``ddp_compute_scale``: the DDP hook runs under ``torch.distributed``,
  without Horovod's thread: the same ranks' training step after they shut
  Horovod down (timed again, all at once) over the step with it;
  :mod:`.report` scales the DDP hook's compute and compression by it;
- ``per_rank_step_s`` (and ``ddp_per_rank_step_s``): each rank's forward +
  backward + update, medians, with Horovod's thread (and without it);
  ``per_rank_window``: when each rank profiled (seconds since the epoch).

:func:`node_conditions` decides the defaults: one rank per device on CUDA,
one per core on a CPU (the cores divided among the ranks as threads), at
most the smallest number of ranks predicted.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

__all__ = ["NodeConditions", "node_conditions", "profile_on_node", "describe_conditions",
           "no_spare_core", "horovod_launcher", "usable_cores"]

#: Seconds a node's profile may take before its ranks are stopped.
DEFAULT_TIMEOUT_S = 3600.0


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
    return text


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run_ranks(directory: Path, cond: NodeConditions, model_args: List[str],
               timeout_s: float) -> List[dict]:
    """Run the node's ranks (:mod:`.node_worker`); their results by rank."""
    directory.mkdir(parents=True, exist_ok=True)
    n, horovod = cond.ranks_per_node, cond.horovod_thread
    worker = [sys.executable, "-m", "hvd_acp.plan.node_worker", "--dir", str(directory),
              "--threads", str(cond.threads_per_rank), *model_args]
    threads = str(cond.threads_per_rank)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
               PYTHONUNBUFFERED="1")
    if horovod:
        launcher = horovod_launcher()
        if launcher is None:
            raise RuntimeError("Horovod's background thread was asked for, but horovod.torch "
                               "or horovodrun is not installed: pass --no-horovod-thread")
        env["HOROVOD_CYCLE_TIME"] = f"{cond.horovod_cycle_time_ms:g}"
        commands = [[launcher, "-np", str(n), "-H", f"localhost:{n}", *worker, "--horovod"]]
    else:
        commands = [[*worker, "--rank", str(i), "--size", str(n)] for i in range(n)]
    log_path = directory / "ranks.log"
    deadline = time.monotonic() + timeout_s
    with open(log_path, "w") as log:
        procs = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True) for cmd in commands]
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for proc in procs:
                _kill(proc)
            raise RuntimeError(f"the node's profile took over {timeout_s:g} s; "
                               f"stopped. Its ranks' output:\n{_tail(log_path)}") from None
        except BaseException:
            for proc in procs:
                _kill(proc)
            raise
    failed = [p.returncode for p in procs if p.returncode != 0]
    results = []
    for rank in range(n):
        path = directory / f"rank{rank}.json"
        if path.is_file():
            results.append(json.loads(path.read_text()))
    if failed or len(results) != n:
        raise RuntimeError(f"the node's profile ({n} ranks) failed (exit status "
                           f"{failed or 0}, {len(results)} of {n} results). Its ranks' output:\n"
                           f"{_tail(log_path)}")
    return sorted(results, key=lambda r: r["rank"])


def _tail(path: Path, chars: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return text[-chars:]


def profile_on_node(model: str, batch_size: int, conditions: NodeConditions, *,
                    matrix_rank=None, device: str = "cpu", image_size: int = 128,
                    seq_len: int = 64, steps: int = 3, warmup: int = 1, repeats: int = 3,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Profile ``model`` (a built-in name or ``module:function``) as
    ``conditions`` say the ranks run (see the module docstring)."""
    from .profile import profile_builtin
    cond = conditions
    if cond.alone:
        import torch
        torch.set_num_threads(cond.threads_per_rank)
        return profile_builtin(model, batch_size, matrix_rank=matrix_rank, device=device,
                               image_size=image_size, seq_len=seq_len, steps=steps,
                               warmup=warmup, repeats=repeats, conditions=cond.as_dict())
    model_args = ["--model", model, "--batch-size", str(batch_size), "--device", device,
                  "--image-size", str(image_size), "--seq-len", str(seq_len),
                  "--steps", str(steps), "--warmup", str(warmup), "--repeats", str(repeats)]
    if matrix_rank is not None:
        model_args += ["--matrix-rank", str(matrix_rank)]
    with tempfile.TemporaryDirectory(prefix="hvd-acp-plan-node-") as tmp:
        ranks = _run_ranks(Path(tmp), cond, model_args, timeout_s)
    recorded: Dict = dict(cond.as_dict(), per_rank_step_s=[r["step_s"] for r in ranks],
                          per_rank_window=[r["window"] for r in ranks])
    if cond.horovod_thread:
        recorded["ddp_per_rank_step_s"] = [r["plain_step_s"] for r in ranks]
        recorded["ddp_compute_scale"] = (statistics.median(recorded["ddp_per_rank_step_s"])
                                         / statistics.median(recorded["per_rank_step_s"]))
    profile = ranks[0]["profile"]
    profile["conditions"] = recorded
    return profile
