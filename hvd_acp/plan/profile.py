"""Profile of one training step on the device where training will run.

Measured in one process, no communication:

- ``forward_s``, ``backward_s``, ``optimizer_s``: medians over the timed steps;
- per parameter, ``ready_s``: when in backward its gradient is accumulated
  (a post-accumulate-grad hook; on CUDA the hook synchronizes the device
  first, so the time is when the kernels are done);
- per compressed parameter, the per-parameter step every front end runs
  (:class:`hvd_acp.state.CompressedTensor`) timed on a tensor of its shape
  and dtype: ACP-SGD's P and Q step (``acp_p_s``, ``acp_q_s``: error
  feedback, projection, local residual), the residual's own share of each
  (``acp_p_residual_s``, ``acp_q_residual_s``: the part the front ends
  leave until the buffer it completes is launched), Power-SGD's two
  projections (``psgd_p_s``, ``psgd_q_s``) and the reconstruction
  (``reconstruct_s``),
  and ACP-SGD's step-ahead shift and restore of the parameter
  (``step_ahead_s``, :mod:`hvd_acp.stepahead`); the batched
  orthonormalizations of each step;
- ``ready_order``: the order the gradients arrived in the last timed step;
- the fused buffers each method sends (:mod:`.replan`): hvd_acp's from
  :func:`hvd_acp.fusion.plan_buckets` (the optimizer's own plan), and DDP's
  buckets for the DDP hook in the order the gradients arrived;
- ``host_s_per_byte``: a fused all-reduce's own work per byte on this device
  (copy into the fusion buffer, add a peer's chunk, copy out);
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
from ..codecs import PowerSGDFirst, codec_of
from ..compression import Phase, compute_dtype, orthonormalize_
from ..fusion import DEFAULT_FUSION_THRESHOLD_BYTES, make_layouts
from ..settings import Settings
from ..state import CompressedTensor, CompressionState
from .models import to_device
from .conditions import NodeConditions, usable_cores
from .link import loopback_tcp_s_per_byte
from .replan import bucket_plans, ddp_buckets

logger = logging.getLogger(__name__)

__all__ = ["profile_model", "profile_builtin", "time_training_steps", "PROFILE_FORMAT",
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


def _time_compression(tensor: CompressedTensor, device: torch.device, repeats: int,
                      gen: torch.Generator) -> Dict:
    """Seconds of each step of ``tensor`` on a random gradient, as the front ends run them."""
    lay = tensor.layout
    n, m, r, dtype = lay.n, lay.m, lay.r, lay.dtype

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype=dtype,
                                                                        device=device)
    grad = rand(n, m)
    tensor.error.copy_(rand(n, m) * 0.01)
    qh = torch.linalg.qr(rand(m, r))[0]
    ph = torch.linalg.qr(rand(n, r))[0]
    out_p, out_q = torch.empty(n, r, dtype=dtype, device=device), \
        torch.empty(m, r, dtype=dtype, device=device)
    target = torch.empty(n, m, dtype=dtype, device=device)
    weight, anchor = rand(n, m), torch.empty(n, m, dtype=dtype, device=device)

    def step_ahead():
        # StepAhead.apply (keep the true weights, shift by the residual) and
        # StepAhead.restore, as the optimizer runs them around each forward.
        anchor.copy_(weight)
        weight.sub_(tensor.error, alpha=1e-3)
        weight.copy_(anchor)

    p_step, q_step = codec_of(Phase.P), codec_of(Phase.Q)
    steps = {
        "acp_p_s": lambda: tensor.compress_(p_step, grad, qh, out_p),
        "acp_q_s": lambda: tensor.compress_(q_step, grad, ph, out_q),
        # Power-SGD: P on the last Q (its residual left to the second
        # projection), then Q of the residual on the orthonormalized P.
        "psgd_p_s": lambda: tensor.compress_(POWERSGD_FIRST, grad, tensor.q, out_p),
        "psgd_q_s": lambda: tensor.compress_(q_step, None, ph, out_q),
        "reconstruct_s": lambda: q_step.reconstruct_(tensor, out_q, ph, target),
        "step_ahead_s": step_ahead,
    }
    times = {key: _timed(fn, device, repeats) for key, fn in steps.items()}
    # The residual alone, as the front ends compute it after launching the
    # buffer its slot completes (each call subtracts it again: same cost).
    for codec, basis, out, key in ((p_step, qh, out_p, "acp_p_residual_s"),
                                   (q_step, ph, out_q, "acp_q_residual_s")):
        owed = tensor.compress_(codec, grad, basis, out, defer=True)
        times[key] = _timed(owed.finish_, device, repeats)
    return times


def alone_conditions(device: torch.device) -> dict:
    """The ``conditions`` of a profile measured in this process alone
    (:class:`.conditions.NodeConditions`)."""
    return NodeConditions(ranks_per_node=1, threads_per_rank=torch.get_num_threads(),
                          cores=usable_cores(), device=device.type, horovod_thread=False,
                          alone=True).as_dict()


def time_training_steps(model: nn.Module, batch, loss_fn: Callable,
                        optimizer: torch.optim.Optimizer, device: torch.device, steps: int,
                        warmup: int, named: Optional[Sequence[tuple]] = None) -> dict:
    """Time ``warmup + steps`` training steps (the last ``steps`` of them).

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
    try:
        for step in range(warmup + steps):
            timed = step >= warmup
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
                  conditions: Optional[dict] = None) -> dict:
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
        optimizer: the optimizer whose update is timed; default
            ``SGD(lr=1e-3, momentum=0.9)``. An adaptive one (Adam, AdamW...)
            raises ``ValueError``: its defaults send both factors every
            step, which the planner does not model.
        steps, warmup: timed and untimed training steps.
        repeats: timed calls of each compression kernel.
        fusion_threshold_bytes, min_compression_rate: as for
            :class:`hvd_acp.DistributedOptimizer`.
        conditions: what the measurement ran under, recorded as the
            profile's ``conditions`` (:mod:`.node` sets it for its ranks);
            default: this process alone (:func:`alone_conditions`).

    Returns:
        The profile, a JSON-serializable dict.
    """
    given = Settings(matrix_rank=matrix_rank, min_compression_rate=min_compression_rate)
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
    settings = given.resolve(optimizer)
    if settings.both_factors:
        raise ValueError(
            f"{type(optimizer).__name__} gets ACP-SGD's defaults for adaptive optimizers, both "
            "factors every step, and the planner models only P and Q in turn (the SGD "
            "defaults): its figures would not be that run's. Time an AdamW run with "
            "`python -m benchmarks --optimizer adamw`, or profile with an SGD optimizer to "
            "compare the methods at P and Q in turn")
    matrix_rank, min_compression_rate = settings.matrix_rank, settings.min_compression_rate
    fixed_rank, auto = parse_matrix_rank(matrix_rank)

    timed = time_training_steps(model, batch, loss_fn, optimizer, dev, steps, warmup,
                                named=named)
    ready = timed["ready"]
    if auto is None:
        layouts = make_layouts([(n, tuple(p.shape), p.dtype) for n, p in named], fixed_rank,
                               min_compression_rate, payload_dtype=compute_dtype)
    else:
        state = probed_state(named, auto, min_compression_rate)
        layouts = [state.layouts[name] for name, _ in named]
    optimizer.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(0)
    params = []
    p_factors, q_factors = [], []
    for (name, p), lay in zip(named, layouts):
        entry = {"name": name, "shape": list(lay.shape), "dtype": str(p.dtype).replace("torch.", ""),
                 "numel": p.numel(), "bytes": p.numel() * p.element_size(),
                 "ready_s": statistics.median(ready[name]) if ready[name] else 0.0,
                 "got_gradient": bool(ready[name]), "compressed": lay.compressed,
                 "n": lay.n, "m": lay.m, "r": lay.r}
        if lay.compressed:
            tensor = CompressedTensor(lay, gen, dev)
            entry.update(_time_compression(tensor, dev, repeats, gen))
            p_factors.append(tensor.p)
            q_factors.append(tensor.q)
        r_ddp = max(0, min(lay.n, lay.m, fixed_rank))
        ddp_compressed = len(lay.shape) >= 2 and r_ddp > 0 and _ddp_should_compress(
            lay.n, lay.m, r_ddp, min_compression_rate)
        entry.update(ddp_compressed=ddp_compressed,
                     ddp_p_bytes=lay.n * r_ddp * p.element_size() if ddp_compressed else 0,
                     ddp_q_bytes=lay.m * r_ddp * p.element_size() if ddp_compressed else 0)
        params.append(entry)
    orth_q = _timed(lambda: orthonormalize_(f.clone() for f in q_factors), dev, repeats) \
        if q_factors else 0.0
    orth_p = _timed(lambda: orthonormalize_(f.clone() for f in p_factors), dev, repeats) \
        if p_factors else 0.0

    by_name = dict(named)
    arrived = timed["order"] + [n for n, _ in reversed(named) if not ready[n]]
    return {
        "format": PROFILE_FORMAT,
        "description": description or type(model).__name__,
        "device": str(dev),
        "device_name": (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                        else platform.processor() or platform.machine()),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "matrix_rank": matrix_rank if auto is None else "auto",
        "chosen_ranks": {lay.name: lay.r for lay in layouts if lay.compressed},
        "fusion_threshold_bytes": fusion_threshold_bytes,
        "min_compression_rate": min_compression_rate,
        "steps": steps, "warmup": warmup, "repeats": repeats,
        "forward_s": statistics.median(timed["forward_s"]),
        "backward_s": statistics.median(timed["backward_s"]),
        "optimizer_s": statistics.median(timed["optimizer_s"]),
        "gradient_bytes": sum(e["bytes"] for e in params),
        "host_s_per_byte": _host_s_per_byte(dev, repeats),
        **({"tcp_stack_s_per_byte": loopback_tcp_s_per_byte()} if dev.type == "cpu" else {}),
        "orthonormalize_s": {"acp_p": orth_q, "acp_q": orth_p, "psgd": orth_p},
        "params": params,
        "ready_order": timed["order"],
        "buckets": bucket_plans(layouts, fusion_threshold_bytes),
        "ddp_buckets": ddp_buckets([(n, by_name[n].numel(), by_name[n].dtype) for n in arrived]),
        "conditions": dict(conditions) if conditions else alone_conditions(dev),
    }


def profile_builtin(model: str, batch_size: int, *, matrix_rank: Optional[int] = None,
                    device: str = "cpu", image_size: int = 128, seq_len: int = 64,
                    steps: int = 3, warmup: int = 1, repeats: int = 3, spec=None,
                    conditions: Optional[dict] = None) -> dict:
    """Profile one of the built-in models or a user's ``module:function``
    (:func:`.models.build_model`; ``spec``: one built already)."""
    from .models import build_model, default_matrix_rank
    rank = matrix_rank or default_matrix_rank(model)
    if spec is None:
        spec = build_model(model, batch_size, image_size=image_size, seq_len=seq_len)
    out = profile_model(spec.model, spec.batch, spec.loss_fn, matrix_rank=rank, device=device,
                        steps=steps, warmup=warmup, repeats=repeats,
                        description=spec.description, conditions=conditions)
    out.update(model=model, batch_size=batch_size, image_size=image_size, seq_len=seq_len)
    return out
