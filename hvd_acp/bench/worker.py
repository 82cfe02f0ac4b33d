"""One rank of one benchmark job: ``python -m hvd_acp.bench.worker --method ...``.

Launched by the driver (:mod:`hvd_acp.bench.driver`) under ``horovodrun``
(``ssgd``, ``powersgd``, ``acp``), ``torchrun`` (``powersgd-ddp``, ``acp-ddp``), once per
rank inside a network namespace when the link is emulated, or as one plain
process (``compute``, the floor). It trains the model on a fixed synthetic
batch for ``--warmup`` untimed steps and ``--steps`` timed ones and writes
``<result-dir>/<method>.rank<r>.json`` with the step times and the counters
accumulated over the timed steps.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch

from .models import build_model

PROGRESS_TAG = "@@hvd_acp.bench"

HOROVOD_METHODS = ("ssgd", "powersgd", "acp")
#: Diagnostics (``--diagnostics``): where the time over the floor comes from.
#: ``compute-concurrent`` and ``acp-local`` run as ``np`` independent processes
#: at once (``--rank``), ``hvd-idle`` under Horovod like the methods,
#: ``ddp-idle`` under torchrun like the DDP methods. The two idle jobs also
#: time a tiny all-reduce after their steps (:func:`probe_tiny_allreduce`).
DIAGNOSTICS = ("compute-concurrent", "hvd-idle", "ddp-idle", "acp-local")
#: Timed tiny all-reduces of the idle diagnostics.
PROBE_CALLS = 20
#: DDP with a communication hook: torch's ``powerSGD_hook`` or hvd_acp's ``acp_hook``.
DDP_METHODS = ("powersgd-ddp", "acp-ddp")
#: Jobs launched like horovodrun's ranks, and like torchrun's (Gloo process group).
HOROVOD_JOBS = HOROVOD_METHODS + ("hvd-idle",)
GLOO_JOBS = DDP_METHODS + ("ddp-idle",)
WORKER_METHODS = HOROVOD_METHODS + DDP_METHODS + ("compute",) + DIAGNOSTICS


def _parse(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hvd_acp.bench.worker")
    parser.add_argument("--method", required=True, choices=WORKER_METHODS)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--matrix-rank", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--result-dir", required=True)
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


# --------------------------------------------------------------- DDP peer
class _PowerSGDHookProbe:
    """Counts what torch's ``powerSGD_hook`` all-reduces and times its maths.

    The hook module refers to ``dist``, ``torch`` and ``_orthogonalize`` by
    module-level names; the probe swaps in thin proxies for those names in
    that module only:

    * ``dist.all_reduce``: counts calls and the bytes of each tensor, i.e.
      exactly what the hook hands to Gloo (uncompressed tensors, Ps, Qs).
    * ``torch.bmm`` and ``_orthogonalize``: adds the calling thread's CPU
      time (``time.thread_time``) to ``compression_seconds``. The hook runs
      part of its maths in future callbacks on Gloo's threads, interleaved
      with blocking waits, so wall time around the hook would count waiting;
      thread CPU time counts only the maths. The error-feedback copies and
      sums (tensor methods, which cannot be intercepted per module) are not
      included: the count is a lower bound.
    """

    def __init__(self) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as module

        self.module = module
        self.allreduces = 0
        self.bytes_sent = 0
        self.compression_seconds = 0.0
        self._lock = threading.Lock()
        probe = self
        real_dist, real_torch, real_orth = module.dist, module.torch, module._orthogonalize

        class _Dist:
            def __getattr__(self, name: str) -> Any:
                return getattr(real_dist, name)

            @staticmethod
            def all_reduce(tensor, *args, **kwargs):
                with probe._lock:
                    probe.allreduces += 1
                    probe.bytes_sent += tensor.numel() * tensor.element_size()
                return real_dist.all_reduce(tensor, *args, **kwargs)

        class _Torch:
            def __getattr__(self, name: str) -> Any:
                return getattr(real_torch, name)

            @staticmethod
            def bmm(*args, **kwargs):
                return probe._timed(real_torch.bmm, *args, **kwargs)

        def orthogonalize(*args, **kwargs):
            return probe._timed(real_orth, *args, **kwargs)

        module.dist, module.torch, module._orthogonalize = _Dist(), _Torch(), orthogonalize

    def _timed(self, fn: Callable, *args, **kwargs):
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.thread_time() - started
            with self._lock:
                self.compression_seconds += spent


def serialized_hook(hook: Callable) -> Callable:
    """``hook`` (a DDP comm hook) run for one bucket at a time.

    ``powerSGD_hook`` starts its second and third all-reduce (P, then Q)
    from future callbacks on Gloo's threads while backward goes on and hooks
    the next bucket from the autograd thread. With Gloo and more than one
    bucket the ranks can then issue collectives in different orders: the job
    aborts ("Received data size doesn't match expected size") or hangs. Waiting
    for the previous bucket's chain before starting the next one keeps the
    order identical on every rank; a bucket's communication still overlaps
    the backward of the layers before it.
    """
    pending = []

    @functools.wraps(hook)
    def wrapper(state, bucket):
        if pending:
            pending.pop().wait()
        future = hook(state, bucket)
        pending.append(future)
        return future
    return wrapper


def powersgd_ddp_bytes_per_step(model: torch.nn.Module, matrix_rank: int,
                                min_compression_rate: float = 2.0) -> int:
    """Bytes one rank all-reduces per step under ``powerSGD_hook``, from the shapes.

    The hook views each gradient as ``(shape[0], numel / shape[0])``, takes
    ``r = min(n, m, matrix_rank)`` and compresses it when
    ``(n + m) * r * min_compression_rate < n * m``; a compressed tensor sends
    its P (n x r) and its Q (m x r), any other tensor is sent whole.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    total = 0
    for param in model.parameters():
        if not param.requires_grad:
            continue
        n = param.shape[0] if param.dim() else 1
        m = param.numel() // n
        r = min(n, m, matrix_rank)
        compress = _should_compress(n, m, r, min_compression_rate)[0]
        total += ((n + m) * r if compress else param.numel()) * param.element_size()
    return total


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


def run(args: argparse.Namespace) -> Dict[str, Any]:
    torch.set_num_threads(args.threads)
    method = args.method
    result: Dict[str, Any] = {"method": method, "pid": os.getpid()}

    if method in HOROVOD_JOBS:
        import horovod.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    elif method in GLOO_JOBS:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
    else:
        rank, size = args.rank, 1
    result.update(rank=rank, size=size, threads=torch.get_num_threads())
    # Lets the driver kill this rank if it hangs: horovodrun starts each rank
    # in a session of its own, out of reach of a kill of horovodrun's group.
    Path(args.result_dir, f"{method}.rank{rank}.pid").write_text(str(os.getpid()))

    spec = build_model(args.model, args.batch_size, image_size=args.image_size,
                       seq_len=args.seq_len, data_seed=rank)
    model = spec.model
    params = [p for p in model.parameters() if p.requires_grad]
    result["parameters"] = sum(p.numel() for p in params)
    result["gradient_bytes"] = sum(p.numel() * p.element_size() for p in params)
    counters: Dict[str, Callable[[], float]] = {}

    if method == "powersgd-ddp":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        from torch.nn.parallel import DistributedDataParallel
        # Identical weights on every rank already (seeded build): skip the
        # initial broadcast. Buffers are not synchronized either, as with Horovod.
        model = spec.model = DistributedDataParallel(model, init_sync=False,
                                                     broadcast_buffers=False)
        probe = _PowerSGDHookProbe()
        # Compression starts after the untimed warm-up (the hook needs >= 2
        # vanilla steps when error feedback or warm start is on).
        state = psgd.PowerSGDState(process_group=None,
                                   matrix_approximation_rank=args.matrix_rank,
                                   start_powerSGD_iter=max(2, args.warmup),
                                   min_compression_rate=2, use_error_feedback=True,
                                   warm_start=True, random_seed=0)
        model.register_comm_hook(state, serialized_hook(psgd.powerSGD_hook))
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        counters = {"bytes_sent": lambda: probe.bytes_sent,
                    "allreduces": lambda: probe.allreduces,
                    "compression_seconds": lambda: probe.compression_seconds}
        result["bytes_sent_per_step_analytic"] = powersgd_ddp_bytes_per_step(
            spec.model.module, args.matrix_rank)
        result["powersgd_start_iter"] = state.start_powerSGD_iter
    elif method == "acp-ddp":
        import hvd_acp.ddp
        from torch.nn.parallel import DistributedDataParallel
        # The same DDP buckets as powersgd-ddp. One all-reduce per bucket,
        # launched from the hook itself in bucket order, so no serialization
        # is needed; no dense warm-up either (state is keyed by parameter).
        # With the optimizer: step-ahead error feedback, as for acp.
        model = spec.model = DistributedDataParallel(model, init_sync=False,
                                                     broadcast_buffers=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        state = hvd_acp.ddp.ACPState(matrix_rank=args.matrix_rank, optimizer=optimizer)
        model.register_comm_hook(state, hvd_acp.ddp.acp_hook)
        counters = {"bytes_sent": lambda: state.comm_stats.bytes_sent,
                    "allreduces": lambda: state.comm_stats.allreduces,
                    "compression_seconds": lambda: state.compression_seconds}
    elif method in HOROVOD_METHODS:
        import horovod.torch as hvd
        base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        if method == "ssgd":
            optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
            # hvd.DistributedOptimizer keeps no counters: every step it hands
            # each gradient to one named all-reduce (fused by Horovod's
            # background thread up to HOROVOD_FUSION_THRESHOLD).
            steps_done = [0]
            counters = {"bytes_sent": lambda: steps_done[0] * result["gradient_bytes"],
                        "allreduces": lambda: steps_done[0] * len(params),
                        "compression_seconds": lambda: 0.0}
            real_step = optimizer.step

            def counted_step(*a, **k):
                steps_done[0] += 1
                return real_step(*a, **k)
            optimizer.step = counted_step
        else:
            import hvd_acp
            cls = hvd_acp.DistributedOptimizer if method == "acp" else hvd_acp.PowerSGDOptimizer
            optimizer = cls(base, model.named_parameters(), matrix_rank=args.matrix_rank)
            counters = {"bytes_sent": lambda: optimizer.comm_stats.bytes_sent,
                        "allreduces": lambda: optimizer.comm_stats.allreduces,
                        "compression_seconds": lambda: optimizer.reducer.compression_seconds}
    elif method == "acp-local":
        # ACP-SGD's hooks and maths on a world of one: compression without
        # communication.
        import hvd_acp
        base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        optimizer = hvd_acp.DistributedOptimizer(base, model.named_parameters(),
                                                 matrix_rank=args.matrix_rank,
                                                 communicator=hvd_acp.LocalCommunicator())
        counters = {"bytes_sent": lambda: 0, "allreduces": lambda: 0,
                    "compression_seconds": lambda: optimizer.reducer.compression_seconds}
    else:
        # compute, compute-concurrent, hvd-idle (Horovod initialized, its
        # background thread running, but no gradient communicated), ddp-idle
        # (the same with torch.distributed's Gloo process group).
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        counters = {"bytes_sent": lambda: 0, "allreduces": lambda: 0,
                    "compression_seconds": lambda: 0.0}

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
        _barrier(method)
    for key, get in counters.items():
        result[key] = get() - start[key]
    result["steps"] = args.steps
    if method in ("hvd-idle", "ddp-idle"):
        result["tiny_allreduce_s"] = probe_tiny_allreduce(method)
    return result


def probe_tiny_allreduce(method: str, calls: int = PROBE_CALLS) -> List[float]:
    """Seconds of each of ``calls`` all-reduces of one float, on this job's ranks.

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
    if method == "hvd-idle":
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


def _barrier(method: str) -> None:
    if method in GLOO_JOBS:
        import torch.distributed as dist
        dist.barrier()
    elif method in HOROVOD_JOBS:
        import horovod.torch as hvd
        hvd.barrier()


def _shutdown(method: str) -> None:
    """Leave the collective library cleanly (Gloo threads abort a bare exit).

    The job's model, DDP reducer and hook state are collected first: left to
    interpreter finalization, a Gloo work that still holds their tensors is
    destroyed without the interpreter and aborts the process ("terminate
    called without an active exception", seen once in CI after every result
    was written).
    """
    gc.collect()
    if method in GLOO_JOBS:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
    elif method in HOROVOD_JOBS:
        import horovod.torch as hvd
        hvd.shutdown()


def main(argv: List[str] = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    result = run(args)
    out = Path(args.result_dir) / f"{args.method}.rank{result['rank']}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)
    _shutdown(args.method)
    out.with_suffix(".pid").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
