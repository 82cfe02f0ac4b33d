"""One rank of one benchmark job: ``python -m benchmarks.worker --method JOB ...``.

Launched by the driver (:mod:`.driver`) as its job says (:mod:`.jobs`): under
``horovodrun`` or ``torchrun`` (a method of :mod:`hvd_acp.methods`, or an idle
diagnostic), once per rank inside a network namespace when the link is
emulated, or as plain processes (the floor, the local diagnostics). It
trains the model on a fixed synthetic batch for ``--warmup`` untimed steps
and ``--steps`` timed ones and writes ``<result-dir>/<job>.rank<r>.json``
with the step times and the counters accumulated over the timed steps.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch

from hvd_acp.methods.counting import powersgd_ddp_bytes_per_step, torch_hook_rank
from hvd_acp.methods import HOROVOD, TORCHRUN, Distributed, Method, settings_of
from hvd_acp.methods import get as get_method
from hvd_acp.plan.models import OPTIMIZERS, build_model, build_optimizer, model_file
from hvd_acp.plan.units import matrix_rank_type

from .jobs import JOBS, LOCAL, Job
from .jobs import get as get_job

PROGRESS_TAG = "@@benchmarks"

#: Timed tiny all-reduces of the jobs with ``probe`` (the idle diagnostics).
PROBE_CALLS = 20
#: Steps profiled by ``--count-ops`` (2: one P and one Q step of ACP-SGD).
OPS_STEPS = 2
#: The settings of DistributedDataParallel in the DDP methods: the ranks build
#: identical weights (seeded), so the initial broadcast is skipped; buffers
#: are not synchronized either, as with Horovod.
DDP_OPTIONS = {"init_sync": False, "broadcast_buffers": False}
#: The methods that run torch's ``powerSGD_hook``, which takes one int rank
#: for every tensor (:func:`torch_hook_rank`).
TORCH_POWERSGD_HOOKS = ("powersgd-ddp", "powersgd-ddp-batched")


def _parse(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.worker")
    parser.add_argument("--method", required=True, choices=tuple(JOBS),
                        help="the job (benchmarks.jobs)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--matrix-rank", type=matrix_rank_type, default=None,
                        help="omitted: every method's default for the optimizer "
                             "(hvd_acp.Settings.resolve)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--count-ops", action="store_true",
                        help="after the timed steps, count the operator calls of "
                        f"{OPS_STEPS} more steps with torch.profiler")
    parser.add_argument("--rank", type=int, default=0,
                        help="rank of a process launched without a collective library")
    return parser.parse_args(argv)


def _progress(rank: int, done: int, total: int) -> None:
    if rank == 0:
        print(f"{PROGRESS_TAG} progress {done}/{total}", flush=True)


#: Set by the driver on an emulated network: the rank's link interface.
IFACE_ENV = "HVD_ACP_BENCH_IFACE"


def link_tx_bytes(iface: str, proc_net_dev: str = "/proc/net/dev") -> int:
    """Bytes sent so far on ``iface`` of this network namespace (frames, headers included)."""
    with open(proc_net_dev, encoding="ascii") as stats:
        for line in stats:
            name, sep, fields = line.partition(":")
            if sep and name.strip() == iface:
                return int(fields.split()[8])
    raise RuntimeError(f"interface {iface!r} not found in {proc_net_dev}")


# ------------------------------------------------------ model, optimizer
def worker_model(model: str) -> str:
    """``--model`` as the workers get it: a user's file made absolute (from
    the current directory), so that it does not depend on where a launcher
    starts them."""
    path = model_file(model)
    if path is None:
        return model
    return f"{path.resolve()}:{model.rpartition(':')[2]}"


# --------------------------------------------------------------- the loop
def _train(spec, optimizer, steps: int, warmup: int, rank: int,
           on_timed_start: Callable[[], None]) -> Dict[str, Any]:
    model, batch, loss_fn = spec.model, spec.batch, spec.loss_fn
    total = warmup + steps
    times: List[float] = []
    phases: Dict[str, List[float]] = {"forward": [], "backward": [], "optimizer_step": []}
    loss = None
    for index in range(total):
        if index == warmup:
            on_timed_start()
        started = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        forward_done = time.perf_counter()
        loss.backward()
        backward_done = time.perf_counter()
        optimizer.step()
        finished = time.perf_counter()
        if index >= warmup:
            times.append(finished - started)
            phases["forward"].append(forward_done - started)
            phases["backward"].append(backward_done - forward_done)
            phases["optimizer_step"].append(finished - backward_done)
        _progress(rank, index + 1, total)
    return {"step_s": times, "phase_s": phases,
            "last_loss": float(loss.detach()) if loss is not None else None}


#: ``aten::`` operators that run no kernel: views and other metadata, the
#: conjugate-bit checks inside a GEMM, and allocations.
NO_KERNEL_OPS = frozenset("aten::" + name for name in (
    "view", "_reshape_alias", "reshape", "t", "transpose", "permute", "numpy_T", "mT",
    "as_strided", "select", "slice", "unbind", "split", "split_with_sizes", "chunk",
    "narrow", "expand", "expand_as", "squeeze", "unsqueeze", "alias", "detach",
    "lift_fresh", "resolve_conj", "resolve_neg", "_has_compatible_shallow_copy_type",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_",
    "set_"))


def count_calls(events) -> Dict[str, int]:
    """Operator calls among profiler ``events``: ``ops``, every ``aten::``
    event (nested ones included), and ``kernels``, the calls that run a
    kernel themselves: not a view, metadata or allocation
    (:data:`NO_KERNEL_OPS`), and no call inside them does (an ``aten::linear``
    counts as its ``aten::mm``, an ``aten::to`` as its ``aten::copy_``). On
    a GPU, the kernels are the launches."""
    memo: Dict[int, bool] = {}

    def runs_kernels(event) -> bool:
        """Whether ``event`` or a call inside it runs a kernel."""
        key = id(event)
        if key not in memo:
            inner = [child for child in event.cpu_children if child.name.startswith("aten::")]
            memo[key] = (any(runs_kernels(child) for child in inner)
                         or event.name not in NO_KERNEL_OPS)
        return memo[key]

    ops = kernels = 0
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        ops += 1
        inner = [child for child in event.cpu_children if child.name.startswith("aten::")]
        if event.name not in NO_KERNEL_OPS and not any(runs_kernels(c) for c in inner):
            kernels += 1
    return {"ops": ops, "kernels": kernels}


def count_operator_calls(spec, optimizer, steps: int = OPS_STEPS) -> Dict[str, float]:
    """Operator calls per training step: ``aten::`` events that ``torch.profiler``
    records on the CPU during ``steps`` more steps, divided by ``steps``.

    ``ops_per_step``: every call through torch's dispatcher, nested ones
    included (an ``aten::linear`` and the ``aten::addmm`` it calls are two),
    views too; ``kernels_per_step``: the leaves that run a kernel (see
    :func:`count_calls`), which on a GPU are the launches. Every thread is
    profiled (Kineto's ``profile_all_threads``), so the maths a DDP hook
    runs in future callbacks on Gloo's threads counts too. The steps train:
    run them after the timed ones.
    """
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    every_thread = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        for _ in range(steps):
            _step(spec, optimizer)
    calls = count_calls(prof.events())
    return {"ops_per_step": calls["ops"] / steps, "kernels_per_step": calls["kernels"] / steps}


def _step(spec, optimizer):
    """One training step; the loss."""
    optimizer.zero_grad()
    loss = spec.loss_fn(spec.model, spec.batch)
    loss.backward()
    optimizer.step()
    return loss


def _init(job: Job, args: argparse.Namespace) -> tuple:
    """Start the job's collective library; (rank, size)."""
    if job.launcher == HOROVOD:
        import horovod.torch as hvd
        hvd.init()
        return hvd.rank(), hvd.size()
    if job.launcher == TORCHRUN:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size()
    return args.rank, 1


def _build(job: Job, method: Method, spec, optimizer, args) -> Distributed:
    """Set ``method`` up as ``job`` runs it."""
    options: Dict[str, Any] = {}
    if job.launcher == LOCAL:
        import hvd_acp
        options["communicator"] = hvd_acp.LocalCommunicator()
    if method.launcher == TORCHRUN:
        options["ddp_options"] = DDP_OPTIONS
    if method.min_warmup_steps:
        # An implementation that must start with exact steps (torch's
        # powerSGD_hook) gets the whole untimed warm-up for them; the others
        # compress from the first step, as their defaults do.
        options["warmup_steps"] = max(method.min_warmup_steps, args.warmup)
    matrix_rank = args.matrix_rank
    if matrix_rank is None and method.key in TORCH_POWERSGD_HOOKS:
        # torch's hook takes an int rank; hvd_acp's adaptive default is a share.
        matrix_rank = torch_hook_rank(spec.model, optimizer)
    return method.build(spec.model, optimizer, matrix_rank=matrix_rank, **options)


def _counters(job: Job, built: Distributed, result: Dict[str, Any],
              args) -> Dict[str, Callable[[], float]]:
    """The counters of ``job``'s training (the method's own,
    :meth:`hvd_acp.methods.Distributed.counters`), each read at the start and
    the end of the timed steps."""
    if job.launcher == LOCAL:
        # A world of one: compression, nothing sent.
        return {"bytes_sent": lambda: 0, "allreduces": lambda: 0,
                "compression_seconds": lambda: built.counters().compression_seconds}
    if _is_powersgd_hook(built.state):
        # torch's powerSGD_hook, counted at its all-reduces: the bytes its
        # rule gives from the shapes check the count.
        result["bytes_sent_per_step_analytic"] = powersgd_ddp_bytes_per_step(
            built.model.module, built.state.matrix_approximation_rank)
        result["powersgd_start_iter"] = built.state.start_powerSGD_iter
    counters = {"bytes_sent": lambda: built.counters().bytes_sent,
                "allreduces": lambda: built.counters().allreduces,
                "compression_seconds": lambda: built.counters().compression_seconds}
    expected = getattr(built.optimizer, "expected_bytes_per_step", None)
    if expected is not None:
        # hvd_acp.baselines: DiLoCo sends once every H steps, which a few
        # timed steps may not reach; DeMo receives more than it sends; TSR
        # sends more on the steps that refresh its bases.
        result["bytes_sent_per_step_analytic"] = expected()
        counters["bytes_received"] = lambda: built.counters().bytes_received
    return counters


def _is_powersgd_hook(state: Any) -> bool:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
    return isinstance(state, PowerSGDState)


def run(args: argparse.Namespace) -> Dict[str, Any]:
    torch.set_num_threads(args.threads)
    job = get_job(args.method)
    result: Dict[str, Any] = {"method": job.key, "pid": os.getpid()}
    rank, size = _init(job, args)
    result.update(rank=rank, size=size, threads=torch.get_num_threads())
    # Lets the driver kill this rank if it hangs: horovodrun starts each rank
    # in a session of its own, out of reach of a kill of horovodrun's group.
    Path(args.result_dir, f"{job.key}.rank{rank}.pid").write_text(str(os.getpid()))

    spec = build_model(args.model, args.batch_size, image_size=args.image_size,
                       seq_len=args.seq_len, data_seed=rank)
    params = [p for p in spec.model.parameters() if p.requires_grad]
    result["parameters"] = sum(p.numel() for p in params)
    result["gradient_bytes"] = sum(p.numel() * p.element_size() for p in params)
    optimizer = build_optimizer(args.optimizer, spec.model.parameters(), args.lr)
    result["optimizer"] = type(optimizer).__name__
    if job.method is None:
        # The floor and the idle diagnostics: a plain local optimizer (Horovod
        # or the Gloo process group initialized, nothing communicated).
        counters = {"bytes_sent": lambda: 0, "allreduces": lambda: 0,
                    "compression_seconds": lambda: 0.0}
    else:
        built = _build(job, get_method(job.method), spec, optimizer, args)
        spec.model, optimizer = built.model, built.optimizer
        counters = _counters(job, built, result, args)

    iface = os.environ.get(IFACE_ENV)
    if iface:
        # What really crossed this rank's emulated link: the check that the
        # traffic went through the rate-limited interface at all.
        counters["link_tx_bytes"] = lambda: link_tx_bytes(iface)
    start: Dict[str, float] = {}

    def on_timed_start() -> None:
        start.update({key: get() for key, get in counters.items()})

    if args.steps == 0:
        on_timed_start()
    result.update(_train(spec, optimizer, args.steps, args.warmup, rank, on_timed_start))
    if iface:
        # A rank's last chunk may still wait in its rate-limited queue when
        # its own step ends; once every rank has passed a barrier, every peer
        # has received it, so it has left through the interface.
        _barrier(job.launcher)
    for key, get in counters.items():
        result[key] = get() - start[key]
    result["steps"] = args.steps
    chooser = None if job.method is None else (
        getattr(built.optimizer, "chosen_ranks", None) or getattr(built.state, "chosen_ranks",
                                                                  None))
    if chooser is not None:
        result["chosen_ranks"] = chooser()
    # Read after training: the DDP hook's state decides its defaults at its first bucket.
    settings = None if job.method is None else settings_of(built)
    if settings is not None:
        result["settings"] = settings
    if args.count_ops:
        result.update(count_operator_calls(spec, optimizer))
    if job.probe:
        result["tiny_allreduce_s"] = probe_tiny_allreduce(job.launcher)
    return result


def probe_tiny_allreduce(launcher: str, calls: int = PROBE_CALLS) -> List[float]:
    """Seconds of each of ``calls`` all-reduces of one float, on this job's ranks
    (``launcher``: Horovod's, or torch.distributed's process group).

    What a collective costs here beyond its bytes: the ring's per-step
    latency (with more ranks than cores, the next rank must be scheduled),
    and under Horovod its negotiation and the wait for its cycle. Under
    Horovod every call starts after a pause drawn uniformly from one cycle
    (the same draws on every rank), so the cycle's phase is uniform as in a
    training step; the planner subtracts what its timeline predicts for the
    call (the wait for the cycle, the ring) to find the negotiation
    (:func:`hvd_acp.plan.validate.latency`).
    """
    x = torch.zeros(1)
    if launcher == HOROVOD:
        import horovod.torch as hvd
        cycle_s = float(os.environ.get("HOROVOD_CYCLE_TIME", "1")) / 1e3
        allreduce = functools.partial(hvd.allreduce_, x, name="hvd_acp.probe")
    else:
        import torch.distributed as dist
        cycle_s = 0.0
        allreduce = functools.partial(dist.all_reduce, x)
    draws = random.Random(0)
    allreduce()                       # aligns the ranks and warms the path
    times = []
    for _ in range(calls):
        if cycle_s > 0:
            time.sleep(draws.uniform(0.0, cycle_s))
        started = time.perf_counter()
        allreduce()
        times.append(time.perf_counter() - started)
    return times


def _barrier(launcher: str) -> None:
    if launcher == TORCHRUN:
        import torch.distributed as dist
        dist.barrier()
    elif launcher == HOROVOD:
        import horovod.torch as hvd
        hvd.barrier()


def _shutdown(launcher: str) -> None:
    """Leave the collective library cleanly (Gloo threads abort a bare exit).

    The job's model, DDP reducer and hook state are collected first: left to
    interpreter finalization, a Gloo work that still holds their tensors is
    destroyed without the interpreter and aborts the process ("terminate
    called without an active exception", seen once in CI after every result
    was written, and again with the collection: a barrier and
    ``destroy_process_group()`` leave Gloo's thread no moment to free the
    last collective's tensors, so torchrun's ranks leave as the examples do,
    with :func:`hvd_acp.comm.leave_process_group`, which pauses between them).
    """
    gc.collect()
    if launcher == TORCHRUN:
        from hvd_acp.comm import leave_process_group
        leave_process_group()
    elif launcher == HOROVOD:
        import horovod.torch as hvd
        hvd.shutdown()


def main(argv: List[str] = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    result = run(args)
    out = Path(args.result_dir) / f"{args.method}.rank{result['rank']}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)
    _shutdown(get_job(args.method).launcher)
    out.with_suffix(".pid").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
