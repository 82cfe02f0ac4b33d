"""Profile of one training step on the device where training will run.

Measured in one process, no communication:

- ``forward_s``, ``backward_s``, ``optimizer_s``: medians over the timed steps
  (``timed_steps``: at least ``steps``, more until they add up to
  :data:`MIN_TIMED_S` seconds);
- per parameter, ``ready_s``: when in backward its gradient is accumulated
  (a post-accumulate-grad hook; on CUDA the hook synchronizes the device
  first, so the time is when the kernels are done);
- the defaults the optimizer's family gives (:meth:`hvd_acp.Settings.resolve`):
  ``optimizer``, ``optimizer_family``, ``scheme`` (P and Q in turn, or both
  factors every step), ``fp16_wire``, ``int8_factors`` (and the ``budget``
  they were fitted to, where one was given), ``matrix_rank``, and
  Power-SGD's own ``psgd_matrix_rank`` and ``psgd_fp16_wire``;
- with ``int8_factors``, ``lanes_s_per_element``: packing 8-bit levels into
  int32 words and reading the sums back, per element;
- per compressed parameter, the per-parameter step every front end runs
  (:class:`hvd_acp.state.CompressedTensor`) timed on a tensor of its shape
  and dtype: in turn, ACP-SGD's P and Q step (``acp_p_s``, ``acp_q_s``:
  error feedback, projection, local residual), the residual's own share of
  each (``acp_p_residual_s``, ``acp_q_residual_s``: the part the front ends
  leave until the buffer it completes is launched) and the reconstruction
  (``reconstruct_s``); with both factors, ``acp_pq_s``,
  ``acp_pq_residual_s`` and ``reconstruct_pq_s``; Power-SGD's two
  projections and reconstruction at its own rank (``psgd_r``:
  ``psgd_p_s``, ``psgd_q_s``, ``psgd_reconstruct_s``),
  and the step-ahead shift and restore of the parameter (``step_ahead_s``,
  :mod:`hvd_acp.stepahead`; under an adaptive optimizer with Adam's divisor
  for the residual, which costs several times SGD's shift); the batched
  orthonormalizations of each step;
- ``ready_order``: the order the gradients arrived in the last timed step;
- the fused buffers each method sends (:mod:`.replan`): hvd_acp's from
  :func:`hvd_acp.fusion.plan_buckets` (the optimizer's own plan), and DDP's
  buckets for the DDP hook in the order the gradients arrived;
- ``host_s_per_byte``: a fused all-reduce's own work per byte on this device
  (copy into the fusion buffer, add a peer's chunk, copy out);
- ``fp16_cast_s_per_byte``: a float32 buffer's cast to float16 and back,
  per float32 byte (fp16 on the wire, and fp16 S-SGD);
- ``ddp_hook_compression_s`` (CPU profiles): the compression a step of
  :func:`hvd_acp.ddp.acp_hook` run for real in a one-rank Gloo group, its
  bucket packing and copies included (the timeline scales the hook's
  kernels by it);
- ``fp16_reduce_s_per_byte`` (profiles of two or more ranks at once with
  Horovod, :mod:`.node`): what a float16 all-reduce costs per byte moved
  beyond a float32 one (:func:`fp16_reduce_s_per_byte`), charged to the
  fused buffers Horovod sends in float16;
- ``tcp_stack_s_per_byte`` (CPU profiles): the kernel's TCP work per byte
  sent and received over loopback (:func:`.link.loopback_tcp_s_per_byte`),
  which a Gloo rank's all-reduce pays on a CPU node.

The conditions it ran under (``conditions``: ranks computing at once on the
node, threads per rank, Horovod's background thread) are the caller's to
set: :mod:`.node` runs this in every local rank at once.

The result is a plain dict, saved as JSON; :mod:`.timeline` needs nothing else.
"""
from __future__ import annotations

import logging
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..autorank import parse_matrix_rank
from .. import lanes
from ..codecs import PowerSGDFirst, codec_of
from ..compression import Phase, adaptive_shift_denom, compute_dtype, orthonormalize_
from ..methods.counting import torch_hook_rank
from ..fusion import DEFAULT_FUSION_THRESHOLD_BYTES, make_layouts
from ..settings import Settings, optimizer_family
from ..state import CompressedTensor, CompressionState
from .models import to_device
from .conditions import NodeConditions, usable_cores
from .link import loopback_tcp_s_per_byte
from .replan import bucket_plans, ddp_buckets

logger = logging.getLogger(__name__)

__all__ = ["profile_model", "profile_builtin", "time_training_steps", "fp16_reduce_s_per_byte",
           "PROFILE_FORMAT",
           "DEFAULT_FUSION_THRESHOLD_BYTES"]

PROFILE_FORMAT = 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _ddp_should_compress(n: int, m: int, r: int, rate: float) -> bool:
    # powerSGD_hook's rule: strictly smaller (hvd_acp's should_compress allows equality).
    return (n + m) * r * rate < n * m


def _host_s_per_byte(device: torch.device, repeats: int, nbytes: int = 16 * 1024 * 1024) -> float:
    """Seconds per byte of a fused all-reduce's local work: copy in, add, copy out."""
    numel = nbytes // 4
    a = torch.randn(numel, device=device)
    b = torch.randn(numel, device=device)
    buf = torch.empty(numel, device=device)

    def work():
        buf.copy_(a)
        buf.add_(b)
        a.copy_(buf)
    return _timed(work, device, repeats) / nbytes


POWERSGD_FIRST = PowerSGDFirst()


def _fp16_cast_s_per_byte(device: torch.device, repeats: int,
                          nbytes: int = 16 * 1024 * 1024) -> float:
    """Seconds per float32 byte of a buffer's trip through float16 on the
    wire (``hvd.Compression.fp16``, or the DDP hook's copy): cast to float16
    and back."""
    numel = nbytes // 4
    a = torch.randn(numel, device=device)
    half = torch.empty(numel, dtype=torch.float16, device=device)

    def work():
        half.copy_(a)
        a.copy_(half)
    return _timed(work, device, repeats) / nbytes


def fp16_reduce_s_per_byte(allreduce: Callable[[torch.Tensor], None], ranks: int,
                           device: torch.device, repeats: int = 41,
                           numel: int = 1024 * 1024) -> float:
    """Seconds per byte moved that an all-reduce of float16 costs beyond one
    of float32, the same collective library on the same ranks.

    ``allreduce(tensor)`` all-reduces ``tensor`` in place over ``ranks``
    ranks (Horovod's averaging all-reduce in :mod:`.node_worker`; every
    rank calls this at once). A ring all-reduce moves ``2(N-1)/N`` of its
    buffer through each rank; a float32 buffer of ``numel`` elements costs
    ``t32`` and a float16 one ``t16``, so the float16 collective's own work
    per byte moved, over float32's, is::

        t16 / moved16 - t32 / moved32

    timed in ``repeats`` pairs, one collective of each, and the median of the
    pairs taken (on this project's 2-core hosts one pair varies by half its
    value; 41 pairs of a million elements take about a second).

    On a CPU this is the reduction and the averaging done element by element
    in float16 (Horovod's Gloo path converts each element in software: on
    this project's hosts about 10 ns an element, more than the wire time of
    its two bytes at 1 Gbit/s); on a GPU with NCCL it is about 0. Never
    below 0."""
    if ranks < 2:
        raise ValueError(f"timing a collective needs at least 2 ranks, got {ranks!r}")
    moved = 2 * (ranks - 1) / ranks * numel
    bufs = [torch.ones(numel, dtype=dtype, device=device)
            for dtype in (torch.float32, torch.float16)]

    def seconds(buf: torch.Tensor) -> float:
        _sync(device)
        started = time.perf_counter()
        allreduce(buf)
        _sync(device)
        return time.perf_counter() - started
    for buf in bufs:
        allreduce(buf)
    # In pairs, one after the other, so that a slower moment of the host
    # weighs on both: the median of the pairs' differences.
    extra = []
    for _ in range(repeats):
        t32, t16 = (seconds(buf) for buf in bufs)
        extra.append(t16 / (moved * 2) - t32 / (moved * 4))
    return max(0.0, statistics.median(extra))


def _workspace(tensor: CompressedTensor, device: torch.device, gen: torch.Generator):
    """For timing ``tensor``'s steps: a random gradient (and a residual in
    ``tensor``), random orthonormal bases ``qh`` (m x r) and ``ph`` (n x r),
    a target of the gradient's shape, and ``rand(*shape)`` for more."""
    lay = tensor.layout

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype=lay.dtype,
                                                                        device=device)
    grad = rand(lay.n, lay.m)
    tensor.error.copy_(rand(lay.n, lay.m) * 0.01)
    qh = torch.linalg.qr(rand(lay.m, lay.r))[0]
    ph = torch.linalg.qr(rand(lay.n, lay.r))[0]
    target = torch.empty(lay.n, lay.m, dtype=lay.dtype, device=device)
    return rand, grad, qh, ph, target


def _time_compression(tensor: CompressedTensor, device: torch.device, repeats: int,
                      gen: torch.Generator, scheme: str = "alternating",
                      pq_codec=None, adaptive: bool = False) -> Dict:
    """Seconds of ACP-SGD's steps of ``tensor`` on a random gradient, as the
    front ends run them, for the codecs of ``scheme``
    (:data:`hvd_acp.codecs.SCHEMES`): P and Q in turn (``acp_p_s``,
    ``acp_q_s``, their residuals, ``reconstruct_s``) or both factors
    (``acp_pq_s``, ``acp_pq_residual_s``, ``reconstruct_pq_s``; with
    ``pq_codec``, that codec's: the 8-bit one quantizes the factors); and
    the step-ahead shift and restore (``step_ahead_s``; with ``adaptive``,
    an Adam-family optimizer's, which first computes Adam's divisor for the
    residual, :func:`hvd_acp.compression.adaptive_shift_denom`)."""
    lay = tensor.layout
    n, m, r, dtype = lay.n, lay.m, lay.r, lay.dtype
    rand, grad, qh, ph, target = _workspace(tensor, device, gen)
    weight, anchor = rand(n, m), torch.empty(n, m, dtype=dtype, device=device)

    exp_avg_sq = rand(n, m).abs_() if adaptive else None

    def step_ahead():
        # StepAhead.apply (keep the true weights, shift by the residual) and
        # StepAhead.restore, as the optimizer runs them around each forward.
        anchor.copy_(weight)
        if exp_avg_sq is None:
            weight.sub_(tensor.error, alpha=1e-3)
        else:
            denom = adaptive_shift_denom(tensor.error, exp_avg_sq, 0.999, 10.0, 1e-8)
            torch.addcdiv(weight, tensor.error, denom, value=-1e-3, out=weight)
        weight.copy_(anchor)

    steps = {"step_ahead_s": step_ahead}
    if scheme == "both":
        pq = pq_codec or codec_of(Phase.PQ)
        out_pq = torch.empty(n + m, r, dtype=dtype, device=device)
        steps.update({
            "acp_pq_s": lambda: tensor.compress_(pq, grad, (ph, qh), out_pq),
            "reconstruct_pq_s": lambda: pq.reconstruct_(tensor, out_pq, (ph, qh), target)})
        deferred = ((pq, (ph, qh), out_pq, "acp_pq_residual_s"),)
    else:
        p_step, q_step = codec_of(Phase.P), codec_of(Phase.Q)
        out_p, out_q = torch.empty(n, r, dtype=dtype, device=device), \
            torch.empty(m, r, dtype=dtype, device=device)
        steps.update({
            "acp_p_s": lambda: tensor.compress_(p_step, grad, qh, out_p),
            "acp_q_s": lambda: tensor.compress_(q_step, grad, ph, out_q),
            "reconstruct_s": lambda: q_step.reconstruct_(tensor, out_q, ph, target)})
        deferred = ((p_step, qh, out_p, "acp_p_residual_s"),
                    (q_step, ph, out_q, "acp_q_residual_s"))
    times = {key: _timed(fn, device, repeats) for key, fn in steps.items()}
    # The residual alone, as the front ends compute it after launching the
    # buffer its slot completes (each call subtracts it again: same cost).
    for codec, basis, out, key in deferred:
        owed = tensor.compress_(codec, grad, basis, out, defer=True)
        times[key] = _timed(owed.finish_, device, repeats)
    return times


def _time_powersgd(tensor: CompressedTensor, device: torch.device, repeats: int,
                   gen: torch.Generator) -> Dict:
    """Seconds of Power-SGD's two projections of ``tensor`` (P on the last
    Q, its residual left to the second; Q of the residual on the
    orthonormalized P) and of its reconstruction (``psgd_p_s``,
    ``psgd_q_s``, ``psgd_reconstruct_s``)."""
    lay = tensor.layout
    n, m, r, dtype = lay.n, lay.m, lay.r, lay.dtype
    _, grad, _, ph, target = _workspace(tensor, device, gen)
    out_p, out_q = torch.empty(n, r, dtype=dtype, device=device), \
        torch.empty(m, r, dtype=dtype, device=device)
    q_step = codec_of(Phase.Q)
    steps = {
        "psgd_p_s": lambda: tensor.compress_(POWERSGD_FIRST, grad, tensor.q, out_p),
        "psgd_q_s": lambda: tensor.compress_(q_step, None, ph, out_q),
        "psgd_reconstruct_s": lambda: q_step.reconstruct_(tensor, out_q, ph, target),
    }
    return {key: _timed(fn, device, repeats) for key, fn in steps.items()}


def _lanes_s_per_element(device: torch.device, repeats: int, numel: int = 1 << 20) -> float:
    """Seconds per element to pack 8-bit levels into int32 words and read
    the sums back (:mod:`hvd_acp.lanes`), as ``int8_factors`` does around
    each all-reduce of its factors."""
    levels = torch.randint(-15, 16, (numel,), device=device).float()

    def work():
        lanes.unpack(lanes.pack(levels), numel)
    return _timed(work, device, repeats) / numel


def _ddp_hook_compression_s(model: nn.Module, batch, loss_fn: Callable,
                            optimizer: torch.optim.Optimizer, given: Settings,
                            device: torch.device, steps: int, warmup: int) -> Optional[float]:
    """Seconds of compression a step of :func:`hvd_acp.ddp.acp_hook`, run for
    real: a copy of ``model`` in ``DistributedDataParallel`` over a one-rank
    Gloo group, the hook registered with ``given``'s settings and a fresh
    optimizer of ``optimizer``'s class, ``warmup`` untimed and ``steps``
    timed steps; the median of ``ACPState.compression_seconds`` a step. The
    hook packs and copies each bucket, which the kernels timed above do not
    include. None on a GPU, where this process already belongs to a
    ``torch.distributed`` group (it is left alone), or where the optimizer's
    class cannot be built again as ``Class(params, lr=...)``."""
    import copy
    import tempfile
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from ..ddp import ACPState, acp_hook
    if device.type != "cpu" or not dist.is_available() or dist.is_initialized():
        return None
    twin = copy.deepcopy(model)
    # The same class and hyperparameters (the first group's), on the copy.
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    try:
        twin_optimizer = type(optimizer)(twin.parameters(), lr=hyper.get("lr", 1e-3))
    except TypeError as error:
        logger.info("the DDP hook is not run: %s(params, lr=...) cannot be built (%s); its "
                    "compression is priced from the kernels alone", type(optimizer).__name__,
                    error)
        return None
    for group in twin_optimizer.param_groups:
        group.update({k: v for k, v in hyper.items() if k in group})
    per_step = []
    with tempfile.TemporaryDirectory(prefix="hvd-acp-profile-ddp-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        try:
            ddp = DistributedDataParallel(twin)
            state = ACPState(settings=given, optimizer=twin_optimizer)
            ddp.register_comm_hook(state, acp_hook)
            for step in range(warmup + steps):
                before = state.compression_seconds
                twin_optimizer.zero_grad(set_to_none=True)
                loss_fn(ddp, batch).backward()
                twin_optimizer.step()
                if step >= warmup:
                    per_step.append(state.compression_seconds - before)
        finally:
            dist.destroy_process_group()
    return statistics.median(per_step)


def alone_conditions(device: torch.device) -> dict:
    """The ``conditions`` of a profile measured in this process alone
    (:class:`.conditions.NodeConditions`)."""
    return NodeConditions(ranks_per_node=1, threads_per_rank=torch.get_num_threads(),
                          cores=usable_cores(), device=device.type, horovod_thread=False,
                          alone=True).as_dict()


#: A profile times training steps until they add up to this many seconds
#: (at least ``steps`` of them, at most :data:`MAX_TIMED_STEPS`): three steps
#: of a small model are a fifth of a second, where one burst of another
#: process on a 2-core host moved a rank's median by half.
MIN_TIMED_S = 2.0
MAX_TIMED_STEPS = 50


def time_training_steps(model: nn.Module, batch, loss_fn: Callable,
                        optimizer: torch.optim.Optimizer, device: torch.device, steps: int,
                        warmup: int, named: Optional[Sequence[tuple]] = None,
                        min_timed_s: float = MIN_TIMED_S) -> dict:
    """Time ``warmup + steps`` training steps (the last ``steps`` of them),
    and more until the timed steps add up to ``min_timed_s`` seconds (at
    most :data:`MAX_TIMED_STEPS`, never fewer than ``steps``).

    Returns ``forward_s``, ``backward_s`` and ``optimizer_s`` (a list each,
    seconds per timed step); with ``named`` ((name, parameter) pairs) also
    ``ready`` (name -> seconds into backward its gradient was accumulated,
    per timed step; on CUDA the hook synchronizes first) and ``order`` (the
    names in the order their gradients arrived in the last timed step).
    """
    named = list(named or ())
    ready: Dict[str, List[float]] = {n: [] for n, _ in named}
    clock = {"t": 0.0, "on": False, "order": []}

    def make_hook(name):
        def hook(_param):
            if clock["on"]:
                _sync(device)
                ready[name].append(time.perf_counter() - clock["t"])
                clock["order"].append(name)
        return hook
    handles = [p.register_post_accumulate_grad_hook(make_hook(n)) for n, p in named]
    forward, backward, update, order = [], [], [], []
    timed_s = 0.0
    try:
        step = 0
        while (step < warmup + steps
               or (timed_s < min_timed_s and len(forward) < max(steps, MAX_TIMED_STEPS))):
            timed = step >= warmup
            step += 1
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            t0 = time.perf_counter()
            loss = loss_fn(model, batch)
            _sync(device)
            t1 = time.perf_counter()
            clock.update(t=t1, on=timed, order=[])
            loss.backward()
            _sync(device)
            t2 = time.perf_counter()
            clock["on"] = False
            optimizer.step()
            _sync(device)
            t3 = time.perf_counter()
            if timed:
                forward.append(t1 - t0)
                backward.append(t2 - t1)
                update.append(t3 - t2)
                timed_s += t3 - t0
                order = clock["order"]
    finally:
        for h in handles:
            h.remove()
    return {"forward_s": forward, "backward_s": backward, "optimizer_s": update,
            "ready": ready, "order": order}


def probed_state(named, matrix_rank, min_compression_rate: Optional[float] = None
                 ) -> CompressionState:
    """The compression state of the (name, parameter) pairs ``named`` at
    ``matrix_rank``; under ``"auto"`` each compressed tensor probed on its
    parameter's gradient now (one process: its gradient is the average), so
    that its layout has the rank auto chooses from it."""
    settings = Settings(matrix_rank=matrix_rank, min_compression_rate=min_compression_rate,
                        warmup_steps=0, seed=0).resolve()
    state = CompressionState(settings)
    for name, param in named:
        state.add(name, param.shape, param.dtype, torch.device("cpu"))
        if state.auto is not None and name in state.tensors and param.grad is not None:
            state.probe_(name, param.grad.detach().cpu())
    return state


def profile_model(model: nn.Module, example_batch, loss_fn: Callable, *, matrix_rank=None,
                  device: Optional[str] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                  steps: int = 3, warmup: int = 1, repeats: int = 3,
                  fusion_threshold_bytes: int = DEFAULT_FUSION_THRESHOLD_BYTES,
                  min_compression_rate: Optional[float] = None, description: str = "",
                  conditions: Optional[dict] = None, int8_factors: Optional[bool] = None,
                  budget: Optional[float] = None) -> dict:
    """Profile one training step of ``model`` (see the module docstring).

    Args:
        model: the module (moved to ``device``; trained for a few steps).
        example_batch: a tensor, tuple or dict of tensors (moved to ``device``).
        loss_fn: ``loss_fn(model, batch)`` returns the scalar loss.
        matrix_rank: rank r of the factors (None: the library's default,
            :class:`hvd_acp.Settings`, for ``optimizer``); ``"auto"`` (or an
            :class:`~hvd_acp.AutoRank`): the ranks its probe chooses from the
            last profiled step's gradients (torch's ``powerSGD_hook``, which
            takes one rank, is profiled at ``max_rank``).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; default: the model's.
        optimizer: the optimizer whose update is timed, and whose family
            decides the defaults (:meth:`hvd_acp.Settings.resolve`): under
            Adam, AdamW... ACP-SGD sends both factors every step at a share
            of each matrix, in fp16 on the wire, and Power-SGD takes its own
            share; the profile times that (``scheme``, ``fp16_wire``,
            ``psgd_matrix_rank``). Default ``SGD(lr=1e-3, momentum=0.9)``.
        steps, warmup: timed and untimed training steps.
        repeats: timed calls of each compression kernel.
        fusion_threshold_bytes, min_compression_rate: as for
            :class:`hvd_acp.DistributedOptimizer`.
        conditions: what the measurement ran under, recorded as the
            profile's ``conditions`` (:mod:`.node` sets it for its ranks);
            default: this process alone (:func:`alone_conditions`).
        int8_factors, budget: ACP-SGD's settings of those names
            (:class:`hvd_acp.Settings`; a budget is fitted to the model's
            shapes and needs an adaptive ``optimizer``): the profile times
            and plans ACP-SGD's step with them (``int8_factors``,
            ``lanes_s_per_element``, buffers in 8-bit lanes); Power-SGD keeps
            its own defaults.

    Returns:
        The profile, a JSON-serializable dict.
    """
    given = Settings(matrix_rank=matrix_rank, min_compression_rate=min_compression_rate,
                     int8_factors=int8_factors, budget=budget)
    for arg, value in (("steps", steps), ("repeats", repeats)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg} must be a positive int, got {value!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if device is None:
        first = next(model.parameters(), None)
        device = str(first.device) if first is not None else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
    model = model.to(dev)
    batch = to_device(example_batch, dev)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no parameter that requires a gradient")
    if optimizer is None:
        optimizer = torch.optim.SGD([p for _, p in named], lr=1e-3, momentum=0.9)
    shapes = [(n, tuple(p.shape), p.dtype) for n, p in named]
    settings = given.resolve(optimizer, shapes=shapes)
    # Power-SGD resolves its own defaults (a smaller share under an
    # adaptive optimizer: it sends both factors in two rounds).
    psgd_settings = Settings(matrix_rank=matrix_rank, min_compression_rate=min_compression_rate
                             ).resolve(optimizer, factors_per_step=2)
    scheme = settings.scheme
    min_compression_rate = settings.min_compression_rate
    fixed_rank, auto = parse_matrix_rank(settings.matrix_rank)
    psgd_rank, _ = parse_matrix_rank(psgd_settings.matrix_rank)

    timed = time_training_steps(model, batch, loss_fn, optimizer, dev, steps, warmup,
                                named=named)
    ready = timed["ready"]
    if auto is None:
        layouts = make_layouts(shapes, fixed_rank, min_compression_rate,
                               payload_dtype=compute_dtype)
    else:
        state = probed_state(named, auto, min_compression_rate)
        layouts = [state.layouts[name] for name, _ in named]
    if auto is not None or (psgd_settings.matrix_rank == settings.matrix_rank and
                            psgd_settings.min_compression_rate == min_compression_rate):
        psgd_layouts = layouts
    else:
        psgd_layouts = make_layouts(shapes, psgd_rank, psgd_settings.min_compression_rate,
                                    payload_dtype=compute_dtype)
    optimizer.zero_grad(set_to_none=True)
    # The 8-bit codec's levels do not change its cost: 2 ranks' here.
    pq_codec = settings.codecs(2)[0] if settings.int8_factors else None
    hook_rank = psgd_rank if isinstance(psgd_rank, int) else torch_hook_rank(model, optimizer)
    gen = torch.Generator().manual_seed(0)
    adaptive = optimizer_family(optimizer) == "adaptive"
    params = []
    p_factors, q_factors, psgd_p_factors = [], [], []
    for (name, p), lay, plain in zip(named, layouts, psgd_layouts):
        entry = {"name": name, "shape": list(lay.shape), "dtype": str(p.dtype).replace("torch.", ""),
                 "numel": p.numel(), "bytes": p.numel() * p.element_size(),
                 "ready_s": statistics.median(ready[name]) if ready[name] else 0.0,
                 "got_gradient": bool(ready[name]), "compressed": lay.compressed,
                 "n": lay.n, "m": lay.m, "r": lay.r,
                 "psgd_compressed": plain.compressed, "psgd_r": plain.r}
        if lay.compressed:
            tensor = CompressedTensor(lay, gen, dev)
            entry.update(_time_compression(tensor, dev, repeats, gen, scheme, pq_codec,
                                           adaptive=adaptive))
            p_factors.append(tensor.p)
            q_factors.append(tensor.q)
        if plain.compressed:
            tensor = CompressedTensor(plain, gen, dev)
            entry.update(_time_powersgd(tensor, dev, repeats, gen))
            psgd_p_factors.append(tensor.p)
        # torch's powerSGD_hook takes one int rank: Power-SGD's, or where that
        # is a share, the one the benchmark and hvd-acp-ab give it.
        r_ddp = max(0, min(lay.n, lay.m, hook_rank))
        ddp_compressed = len(lay.shape) >= 2 and r_ddp > 0 and _ddp_should_compress(
            lay.n, lay.m, r_ddp, psgd_settings.min_compression_rate)
        entry.update(ddp_compressed=ddp_compressed,
                     ddp_p_bytes=lay.n * r_ddp * p.element_size() if ddp_compressed else 0,
                     ddp_q_bytes=lay.m * r_ddp * p.element_size() if ddp_compressed else 0)
        params.append(entry)

    def orth_time(factors):
        return _timed(lambda: orthonormalize_(f.clone() for f in factors), dev, repeats) \
            if factors else 0.0
    # A P step orthonormalizes the Q factors, a Q step the P factors, a
    # step of both factors both at once.
    orth = ({"acp_pq": orth_time(p_factors + q_factors)} if scheme == "both"
            else {"acp_p": orth_time(q_factors), "acp_q": orth_time(p_factors)})
    orth["psgd"] = orth_time(psgd_p_factors)

    by_name = dict(named)
    arrived = timed["order"] + [n for n, _ in reversed(named) if not ready[n]]
    hook_s = _ddp_hook_compression_s(model, batch, loss_fn, optimizer, given, dev,
                                     max(steps, 2), max(warmup, 1))
    return {
        "format": PROFILE_FORMAT,
        "description": description or type(model).__name__,
        "device": str(dev),
        "device_name": (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                        else platform.processor() or platform.machine()),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "matrix_rank": settings.matrix_rank if auto is None else "auto",
        "chosen_ranks": {lay.name: lay.r for lay in layouts if lay.compressed},
        "optimizer": type(optimizer).__name__,
        "optimizer_family": optimizer_family(optimizer),
        "scheme": scheme,
        "fp16_wire": bool(settings.fp16_wire),
        "int8_factors": bool(settings.int8_factors),
        **({"budget": budget} if budget is not None else {}),
        **({"lanes_s_per_element": _lanes_s_per_element(dev, repeats)}
           if settings.int8_factors else {}),
        "step_ahead": settings.step_ahead,
        "psgd_matrix_rank": psgd_settings.matrix_rank,
        "psgd_fp16_wire": bool(psgd_settings.fp16_wire),
        "fusion_threshold_bytes": fusion_threshold_bytes,
        "min_compression_rate": min_compression_rate,
        "steps": steps, "timed_steps": len(timed["forward_s"]), "warmup": warmup, "repeats": repeats,
        "forward_s": statistics.median(timed["forward_s"]),
        "backward_s": statistics.median(timed["backward_s"]),
        "optimizer_s": statistics.median(timed["optimizer_s"]),
        "gradient_bytes": sum(e["bytes"] for e in params),
        "host_s_per_byte": _host_s_per_byte(dev, repeats),
        **({"tcp_stack_s_per_byte": loopback_tcp_s_per_byte()} if dev.type == "cpu" else {}),
        "fp16_cast_s_per_byte": _fp16_cast_s_per_byte(dev, repeats),
        "orthonormalize_s": orth,
        "params": params,
        "ready_order": timed["order"],
        "buckets": bucket_plans(layouts, fusion_threshold_bytes, psgd_layouts,
                                bool(settings.int8_factors)),
        "ddp_buckets": ddp_buckets([(n, by_name[n].numel(), by_name[n].dtype) for n in arrived]),
        **({"ddp_hook_compression_s": hook_s} if hook_s is not None else {}),
        "conditions": dict(conditions) if conditions else alone_conditions(dev),
    }


def profile_builtin(model: str, batch_size: int, *, matrix_rank=None,
                    device: str = "cpu", image_size: int = 128, seq_len: int = 64,
                    steps: int = 3, warmup: int = 1, repeats: int = 3, spec=None,
                    conditions: Optional[dict] = None, optimizer: str = "sgd",
                    int8_factors: Optional[bool] = None, budget: Optional[float] = None) -> dict:
    """Profile one of the built-in models or a user's ``module:function``
    (:func:`.models.build_model`; ``spec``: one built already), trained by
    ``optimizer`` (:data:`.models.OPTIMIZERS`), with ACP-SGD's
    ``int8_factors`` and ``budget`` where given (:func:`profile_model`)."""
    from .models import build_model, build_optimizer, default_matrix_rank
    rank = matrix_rank or (None if budget is not None else default_matrix_rank(model, optimizer))
    if spec is None:
        spec = build_model(model, batch_size, image_size=image_size, seq_len=seq_len)
    # profile_model moves the model to the device in place: the optimizer
    # built here holds the same parameters.
    opt = build_optimizer(optimizer, [p for p in spec.model.parameters() if p.requires_grad])
    out = profile_model(spec.model, spec.batch, spec.loss_fn, matrix_rank=rank, device=device,
                        optimizer=opt, steps=steps, warmup=warmup, repeats=repeats,
                        description=spec.description, conditions=conditions,
                        int8_factors=int8_factors, budget=budget)
    out.update(model=model, batch_size=batch_size, image_size=image_size, seq_len=seq_len)
    return out
