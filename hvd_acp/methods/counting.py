"""Counters for the implementations that keep none of their own.

hvd_acp's optimizers and DDP hook count what they hand to all-reduce
(:class:`~hvd_acp.comm.CommStats`). The baselines of :mod:`hvd_acp.methods`
do not, so their factories count them from outside, each as close to the
collective as the implementation lets one reach:

- :class:`CountingCompression`: ``hvd.DistributedOptimizer`` hands every
  gradient to its ``compression.compress`` right before the all-reduce; a
  wrapper there sees each tensor on its way (fp16 ones for
  ``hvd.Compression.fp16``) and times the casts.
- :class:`DDPBucketCounter`: DDP's built-in all-reduce (no hook) reduces
  every bucket once per synchronized backward; the bucket sizes come from
  DDP's own logging data, the rounds from the optimizer's steps.
- :func:`counted_hook`: a DDP comm hook whose payload per bucket is known
  (``fp16_compress_hook``: the bucket in fp16) is counted as it is called.
- :class:`PowerSGDHookProbe`: torch's ``powerSGD_hook`` all-reduces from
  future callbacks; the probe counts at its module's ``dist.all_reduce``.

Each counter gives a :class:`Counters` snapshot: bytes handed to all-reduce
by this rank, all-reduces launched, seconds of compression maths.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable, List, NamedTuple, Optional

import torch

__all__ = ["Counters", "CountingCompression", "DDPBucketCounter", "counted_hook",
           "fp16_hook_payload", "PowerSGDHookProbe", "powersgd_ddp_bytes_per_step",
           "hvd_acp_powersgd_bytes", "torch_hook_rank"]


class Counters(NamedTuple):
    """What one rank has done so far: payload bytes handed to all-reduce,
    all-reduces launched, seconds of compression maths; and payload bytes
    the collectives handed back, where a method has other collectives than
    all-reduces (DeMo's all-gather; None: as many as it sent)."""

    bytes_sent: int
    allreduces: int
    compression_seconds: float
    bytes_received: Optional[int] = None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class CountingCompression:
    """A ``hvd.Compression`` that counts what passes through it to all-reduce.

    ``hvd.DistributedOptimizer`` calls ``compress`` once per tensor it
    all-reduces (every gradient, every step; a zero gradient for a parameter
    backward did not reach) and ``decompress`` on the result. Sparse
    gradients sent apart (``sparse_as_dense=False``) bypass compression and
    are not counted.

    Args:
        inner: the compression to apply (``hvd.Compression.none`` or ``.fp16``).
        timed: add the time of ``compress`` and ``decompress`` to
            ``compression_seconds`` (False for ``none``, whose identity is
            no compression).
    """

    def __init__(self, inner: Any, timed: bool) -> None:
        self.inner = inner
        self.timed = timed
        self.bytes_sent = 0
        self.allreduces = 0
        self.compression_seconds = 0.0

    def compress(self, tensor: torch.Tensor):
        started = time.perf_counter()
        sent, ctx = self.inner.compress(tensor)
        if self.timed:
            self.compression_seconds += time.perf_counter() - started
        self.bytes_sent += _nbytes(sent)
        self.allreduces += 1
        return sent, ctx

    def decompress(self, tensor: torch.Tensor, ctx):
        started = time.perf_counter()
        result = self.inner.decompress(tensor, ctx)
        if self.timed:
            self.compression_seconds += time.perf_counter() - started
        return result

    def counters(self) -> Counters:
        return Counters(self.bytes_sent, self.allreduces, self.compression_seconds)


class DDPBucketCounter:
    """Counts DDP's built-in all-reduce from its buckets, one round per optimizer step.

    Without a comm hook DDP all-reduces each bucket once per synchronized
    backward, in C++, out of Python's reach. After every ``optimizer.step()``
    (a step post-hook) this adds the bytes and the number of the buckets DDP
    reduced. DDP rebuilds its buckets once, in the order the first
    iteration's gradients arrived, before the second iteration; so the
    layout is read from DDP's reducer after the first and the second step
    (each read allocates one zero copy of the buckets) and kept from then on.
    One synchronized backward per step is assumed (``no_sync()`` passes for
    accumulation are local and not counted).

    Args:
        model: the ``DistributedDataParallel`` module.
        optimizer: the torch optimizer stepped after each synchronized backward.
    """

    #: Steps after which the bucket layout is read (then it no longer changes).
    LAYOUT_READS = 2

    def __init__(self, model, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.steps = 0
        self.bytes_sent = 0
        self.allreduces = 0
        self.sizes: List[int] = []
        self.handle = optimizer.register_step_post_hook(self._count)

    def bucket_sizes(self) -> List[int]:
        """Bytes of each bucket of DDP's reducer now."""
        return [_nbytes(bucket.buffer())
                for bucket in self.model.reducer._get_zeros_like_grad_buckets()]

    def _count(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        if self.steps <= self.LAYOUT_READS:
            self.sizes = self.bucket_sizes()
        self.bytes_sent += sum(self.sizes)
        self.allreduces += len(self.sizes)

    def counters(self) -> Counters:
        return Counters(self.bytes_sent, self.allreduces, 0.0)


def fp16_hook_payload(bucket) -> int:
    """Bytes ``fp16_compress_hook`` all-reduces for ``bucket``: its buffer in float16."""
    return bucket.buffer().numel() * torch.empty((), dtype=torch.float16).element_size()


def counted_hook(hook: Callable, payload: Callable[[Any], int]):
    """``hook`` (a DDP comm hook with one all-reduce per bucket) and its counters.

    Args:
        hook: ``hook(state, bucket) -> Future``.
        payload: bytes the hook hands to its all-reduce for a bucket.

    Returns:
        ``(wrapped hook, counters)``: ``counters()`` is a :class:`Counters`
        whose ``compression_seconds`` is the time spent in the hook itself
        (for ``fp16_compress_hook`` the cast to fp16 and the all-reduce's
        launch; the cast back runs in the future's callback, not timed).
    """
    totals = {"bytes": 0, "allreduces": 0, "seconds": 0.0}

    @functools.wraps(hook)
    def wrapper(state, bucket):
        totals["bytes"] += payload(bucket)
        totals["allreduces"] += 1
        started = time.perf_counter()
        future = hook(state, bucket)
        totals["seconds"] += time.perf_counter() - started
        return future

    def counters() -> Counters:
        return Counters(totals["bytes"], totals["allreduces"], totals["seconds"])
    return wrapper, counters


class _PowerSGDRouter:
    """The proxies installed once in torch's ``powerSGD_hook`` module.

    The hook refers to ``dist``, ``torch`` and ``_orthogonalize`` by
    module-level names; the router swaps in thin proxies for those names in
    that module only, and credits what they see to the probe whose hook was
    called last (:attr:`active`). A DDP model's hooks and their callbacks
    are done when its backward returns, so that is right as long as the
    process trains one hooked model at a time (as the benchmark and the A/B
    tool do, one method after the other).
    """

    def __init__(self, module) -> None:
        self.active = None
        self.lock = threading.Lock()
        real_dist, real_torch, real_orth = module.dist, module.torch, module._orthogonalize
        router = self

        class _Dist:
            def __getattr__(self, name: str) -> Any:
                return getattr(real_dist, name)

            @staticmethod
            def all_reduce(tensor, *args, **kwargs):
                with router.lock:
                    probe = router.active
                    if probe is not None:
                        probe.allreduces += 1
                        probe.bytes_sent += _nbytes(tensor)
                return real_dist.all_reduce(tensor, *args, **kwargs)

        class _Torch:
            def __getattr__(self, name: str) -> Any:
                return getattr(real_torch, name)

            @staticmethod
            def bmm(*args, **kwargs):
                return router.timed(real_torch.bmm, *args, **kwargs)

        def orthogonalize(*args, **kwargs):
            return router.timed(real_orth, *args, **kwargs)

        module.dist, module.torch, module._orthogonalize = _Dist(), _Torch(), orthogonalize

    def timed(self, fn: Callable, *args, **kwargs):
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.thread_time() - started
            with self.lock:
                if self.active is not None:
                    self.active.compression_seconds += spent


def _powersgd_router() -> _PowerSGDRouter:
    """The router of torch's ``powerSGD_hook`` module, installed at the first call."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as module
    router = getattr(module, "_hvd_acp_router", None)
    if router is None:
        router = _PowerSGDRouter(module)
        module._hvd_acp_router = router
    return router


class PowerSGDHookProbe:
    """Counts what torch's ``powerSGD_hook`` all-reduces and times its maths.

    * bytes and all-reduces: at the hook module's ``dist.all_reduce``, i.e.
      exactly what the hook hands to Gloo (uncompressed tensors, Ps, Qs);
      during the hook's exact warm-up steps, the whole bucket in one
      all-reduce (``default._allreduce_fut``, which the hook calls then).
    * ``compression_seconds``: the calling thread's CPU time
      (``time.thread_time``) in ``torch.bmm`` and ``_orthogonalize``. The
      hook runs part of its maths in future callbacks on Gloo's threads,
      interleaved with blocking waits, so wall time around the hook would
      count waiting; thread CPU time counts only the maths. The
      error-feedback copies and sums (tensor methods, which cannot be
      intercepted per module) are not included: a lower bound.

    Usage: ``hook = probe.wrap(powerSGD_hook)``, then register ``hook`` with
    the state. See :class:`_PowerSGDRouter` for what "one hooked model at a
    time" means.
    """

    def __init__(self) -> None:
        self.router = _powersgd_router()
        self.allreduces = 0
        self.bytes_sent = 0
        self.compression_seconds = 0.0

    def wrap(self, hook: Callable) -> Callable:
        """``hook`` crediting this probe with what it and its callbacks do."""
        @functools.wraps(hook)
        def wrapper(state, bucket):
            with self.router.lock:
                self.router.active = self
                if state.iter < state.start_powerSGD_iter:
                    # The exact step all-reduces the bucket from another module.
                    self.allreduces += 1
                    self.bytes_sent += _nbytes(bucket.buffer())
            return hook(state, bucket)
        return wrapper

    def counters(self) -> Counters:
        with self.router.lock:
            return Counters(self.bytes_sent, self.allreduces, self.compression_seconds)


def powersgd_ddp_bytes_per_step(model: torch.nn.Module, matrix_rank: int,
                                min_compression_rate: float = 2.0) -> int:
    """Bytes one rank all-reduces per step under ``powerSGD_hook``, from the shapes.

    The hook views each gradient as ``(shape[0], numel / shape[0])``, takes
    ``r = min(n, m, matrix_rank)`` and compresses it when
    ``(n + m) * r * min_compression_rate < n * m``; a compressed tensor sends
    its P (n x r) and its Q (m x r), any other tensor is sent whole. The
    same with ``batch_tensors_with_same_shape``: batching stacks the
    matrices, the factors keep their sizes.
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


def hvd_acp_powersgd_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes one rank sends per step under ``hvd_acp.PowerSGDOptimizer``'s
    defaults for ``optimizer`` (:meth:`hvd_acp.Settings.resolve` with both
    factors per step), from the shapes: a compressed ``(n, m)`` gradient
    sends ``(n + m) r`` elements, any other tensor its ``numel``, in fp16
    where the defaults put the wire in fp16."""
    from ..compression import factor_rank, matrix_shape, should_compress
    from ..settings import Settings
    settings = Settings().resolve(optimizer, factors_per_step=2)
    total = 0
    for param in model.parameters():
        if not param.requires_grad:
            continue
        n, m = matrix_shape(param.shape)
        elements = ((n + m) * factor_rank(n, m, settings.matrix_rank)
                    if should_compress(param.shape, settings.matrix_rank,
                                       settings.min_compression_rate) else param.numel())
        total += elements * (2 if settings.fp16_wire else param.element_size())
    return total


def torch_hook_rank(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The rank of torch's ``powerSGD_hook`` when none is given: hvd_acp's
    default where it is an int (SGD: 4); where it is a share of each matrix
    (adaptive optimizers), the int rank whose bytes per step
    (:func:`hvd_acp.methods.counting.powersgd_ddp_bytes_per_step`, fp32) come closest
    to :func:`hvd_acp_powersgd_bytes` (the smaller one on a tie)."""
    from ..settings import Settings
    default = Settings().resolve(optimizer, factors_per_step=2).matrix_rank
    if isinstance(default, int):
        return default
    target = hvd_acp_powersgd_bytes(model, optimizer)
    largest = max((min(p.shape[0], p.numel() // p.shape[0]) for p in model.parameters()
                   if p.requires_grad and p.dim() >= 2), default=1)
    # The hook's bytes never fall as the rank grows: find the first rank at or
    # above the target, then take it or the one below.
    low, high = 1, largest
    while low < high:
        middle = (low + high) // 2
        if powersgd_ddp_bytes_per_step(model, middle) >= target:
            high = middle
        else:
            low = middle + 1
    return min({max(1, low - 1), low},
               key=lambda r: (abs(powersgd_ddp_bytes_per_step(model, r) - target), r))
