"""ACP-SGD as a communication hook of PyTorch's ``DistributedDataParallel``.

The DDP counterpart of ``hvd_acp.DistributedOptimizer``, a sibling of torch's
``powerSGD_hook`` with the same shape of API::

    import hvd_acp.ddp

    model = DDP(model)
    model.register_comm_hook(hvd_acp.ddp.ACPState(matrix_rank=4), hvd_acp.ddp.acp_hook)

It runs the maths of :mod:`hvd_acp.compression` (the same functions as the
Horovod optimizer) on DDP's buckets, through ``torch.distributed``: Gloo on
CPU, NCCL on GPU, any backend with an asynchronous ``all_reduce``. Horovod
is not imported.
"""
# No ``from __future__ import annotations``: DDP compares the hook's
# annotations with the real ``dist.GradBucket`` and ``Future[Tensor]`` types.
import contextlib
import functools
import logging
import threading
import time
import weakref
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .comm import CommStats
from .compression import (Phase, compress_, compute_dtype, init_factor, local_residual_,
                          orthonormalize_, phase_of, reconstruct_)
from .fusion import TensorLayout, make_layouts
from .optimizer import DEFAULT_STEP_AHEAD, check_compression_settings
from .reducer import STATE_FORMAT_VERSION, check_state_version, load_entry
from .stepahead import StepAhead

__all__ = ["ACPState", "acp_hook"]

logger = logging.getLogger(__name__)

#: Names of parameters without ``named_parameters``: by position in the
#: optimizer's param_groups, else in DDP's first backward pass.
_GROUP_NAME = "group.{}.{}"
_AUTO_NAME = "param.{}"


class _Factors:
    """Factors and error-feedback residual of one compressed parameter.

    The two methods below are the only places where the hook calls the
    compression maths for a tensor: a change of the error feedback goes here.

    Attributes:
        layout: the parameter's matrix view (n, m), rank r and compute dtype.
        p: shape (n, r), the last averaged P (identical on every rank).
        q: shape (m, r), the last averaged Q (identical on every rank).
        error: shape (n, m), this rank's residual E.
    """

    __slots__ = ("layout", "p", "q", "error")

    def __init__(self, layout: TensorLayout, generator: torch.Generator,
                 device: torch.device) -> None:
        lay = self.layout = layout
        self.q = init_factor(lay.m, lay.r, generator, lay.dtype, device)
        self.p = init_factor(lay.n, lay.r, generator, lay.dtype, device)
        self.error = torch.zeros(lay.n, lay.m, dtype=lay.dtype, device=device)

    def reused(self, phase: Phase) -> Tensor:
        """The factor a step of ``phase`` reuses: Q for a P step, P for a Q step."""
        return self.q if phase is Phase.P else self.p

    def compress(self, phase: Phase, grad: Tensor, basis: Tensor, out: Tensor) -> None:
        """This rank's factor of ``grad`` into ``out``, with error feedback.

        Args:
            phase: P or Q.
            grad: this rank's gradient, any shape with ``numel == n * m``.
            basis: shape (m, r) ``Qh`` for a P step, (n, r) ``Ph`` for a Q step.
            out: shape (n, r) for P, (m, r) for Q; a view into the bucket's payload.

        Modifies ``error`` in place: afterwards it holds this rank's unsent
        part, ``E = A - out @ basis.T`` with ``A = M + E``.
        """
        lay = self.layout
        matrix, error = grad.reshape(lay.n, lay.m).to(lay.dtype), self.error
        if phase is Phase.Q:
            matrix, error = matrix.t(), error.t()
        compress_(matrix, error, basis, out)          # A = M + E, out = A B
        local_residual_(error, out, basis)            # E = A - out B^T

    def apply(self, phase: Phase, averaged: Tensor, basis: Tensor, target: Tensor,
              commit: bool) -> None:
        """The averaged gradient ``G`` into ``target`` (n, m), from the averaged factor.

        With ``commit`` the averaged factor becomes the one reused by the next
        step; without (a non-finite payload) the factor is kept and the
        residual restarts from zero.
        """
        factor = averaged.to(self.layout.dtype)
        if commit:
            factor = self.p if phase is Phase.P else self.q
            factor.copy_(averaged)
        if phase is Phase.P:
            reconstruct_(target, factor, basis)            # G = P Qh^T
        else:
            reconstruct_(target, basis, factor)            # G = Ph Q^T
        if not commit:
            self.error.zero_()


class ACPState:
    r"""Settings and state of :func:`acp_hook` for one DDP model.

    ACP-SGD (alternate compressed Power-SGD) views each gradient of shape
    ``(n, ...)`` as an ``n x m`` matrix and sends one thin factor per step:
    ``P = A Qh`` (n x r) on even steps, ``Q = A^T Ph`` (m x r) on odd steps,
    where ``Qh`` and ``Ph`` are the orthonormalized factors of the previous
    step and ``A`` is the gradient plus this rank's error-feedback residual.
    One ``all_reduce`` per DDP bucket and step, launched as soon as DDP hands
    the bucket over, with no second round trip: where ``powerSGD_hook``
    sends ``(n + m) r`` elements per matrix in two dependent all-reduces,
    ACP-SGD sends ``n r`` or ``m r`` in one.

    What to tune:

    1. ``matrix_rank`` (r): the compression. Higher is more accurate and
       sends more; 4 suits CNNs, 32 transformers (the paper's settings). As
       for ``powerSGD_hook``, search 1, 2, 4, ... until the accuracy holds.
    2. ``warmup_steps``: iterations of exact averaging (every gradient sent
       whole) before compression starts. The first steps of training are
       the most sensitive to compression error; 0 is fine for most CNNs,
       transformers gain from a few hundred. Unlike ``powerSGD_hook``'s
       ``start_powerSGD_iter`` it may be 0: state is keyed by parameter, so
       DDP's rebuild of its buckets after the first iteration changes nothing.
    3. ``min_compression_rate``: a matrix is compressed only if its two
       factors are at least this many times smaller than the matrix,
       ``(n + m) r * rate <= n m``; other tensors, and every 1-D tensor
       (biases, norms), are averaged exactly in the same all-reduce.
       0 compresses every matrix.

    4. ``optimizer`` and ``step_ahead``: step-ahead error feedback, the
       default of ``hvd_acp.DistributedOptimizer``. With the torch optimizer
       of the DDP model, each rank computes its next gradient at
       ``w - step_ahead * lr / (1 - momentum) * E_i`` (Adam-family:
       ``w - step_ahead * lr * E_i / (sqrt(v_hat) + eps)``), where the
       residual it still owes will take the weights. That keeps ACP-SGD
       stable at the learning rates plain averaging trains at (scaled by the
       number of ranks, momentum 0.9), where the residual otherwise feeds
       back late and momentum amplifies it (docs/convergence.md). It sends
       nothing more. The parameters hold the true weights, identical on
       every rank, between ``optimizer.step()`` and the next training
       forward pass (the shift is applied by a module forward pre-hook and
       removed by an optimizer step pre-hook); :meth:`true_weights` gives
       them in between. Without ``optimizer``, or with ``step_ahead=0``,
       gradients are taken at the true weights.

    Other arguments:

    Args:
        process_group: the group to average over (default: the world).
        seed: seed of the dedicated generator that draws the initial
            factors: identical on every rank, the global RNG untouched.
        named_parameters: ``model.named_parameters()`` of the DDP model, to
            key the state (and checkpoints) by parameter name. Without it,
            parameters are named by position in ``optimizer``'s
            param_groups (``group.0.0``, ``group.0.1``, ...), or without
            an optimizer ``param.0``, ``param.1``, ... in the order of DDP's
            first backward pass (stable for the same model and DDP
            settings). With it, errors name the parameter.

    Attributes:
        step_count: iterations completed (backward passes that communicated;
            passes under ``no_sync()`` do not count).
        comm_stats: all-reduces this rank launched and the bytes it sent.
        compression_seconds: wall time of the compression maths (hook and
            callbacks), for benchmarks.
        nonfinite_steps: iterations whose averaged payload held inf or NaN
            (e.g. an fp16 overflow, on any rank): the affected tensors keep
            their factors and restart their residuals from zero on every
            rank, and the non-finite gradient reaches ``p.grad``, where a
            ``GradScaler`` sees it and skips the step.

    One state serves one model: registering it on a second model raises.
    Every rank must pass the same settings (checked once, on the first
    bucket, with one small collective).
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *,
                 matrix_rank: int = 4, min_compression_rate: float = 2.0,
                 warmup_steps: int = 0, seed: int = 0,
                 named_parameters: Optional[Iterable[Tuple[str, Tensor]]] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 step_ahead: float = DEFAULT_STEP_AHEAD) -> None:
        _validate(matrix_rank, min_compression_rate, warmup_steps, seed, optimizer,
                  step_ahead)
        self.process_group = process_group
        self.matrix_rank = matrix_rank
        self.min_compression_rate = min_compression_rate
        self.warmup_steps = warmup_steps
        self.seed = seed
        self.step_count = 0
        self.comm_stats = CommStats()
        self.compression_seconds = 0.0
        self.nonfinite_steps = 0

        self._generator = torch.Generator().manual_seed(seed)
        self._names: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._params: Dict[str, Tensor] = {}
        self._layouts: Dict[str, TensorLayout] = {}
        self._factors: Dict[str, _Factors] = {}
        #: Loaded state of parameters not seen yet (see load_state_dict).
        self._pending: Optional[Dict[str, dict]] = None
        self._reset_on_load = False
        if named_parameters is None and optimizer is not None:
            named_parameters = [(_GROUP_NAME.format(i, j), param)
                                for i, group in enumerate(optimizer.param_groups)
                                for j, param in enumerate(group["params"])]
        self._named = named_parameters is not None
        #: Whether every parameter of the model is known (named, or one
        #: iteration seen): an unknown one then belongs to another model.
        self._complete = self._named
        self._iteration_open = False
        self._agreed = False
        self._last_nonfinite: Optional[int] = None
        self._lock = threading.Lock()
        if named_parameters is not None:
            seen = set()
            for name, param in named_parameters:
                if name in seen:
                    raise ValueError(f"named_parameters: name {name!r} appears twice")
                seen.add(name)
                if param.requires_grad:
                    self._add(name, param)

        self.step_ahead = float(step_ahead) if optimizer is not None else 0.0
        self._step_ahead: Optional[StepAhead] = None
        self._finalizer = None
        if self.step_ahead:
            self._step_ahead = StepAhead(_Residuals(self._factors, self._params), optimizer,
                                         self.step_ahead)
            self._finalizer = weakref.finalize(
                self, _release, self._step_ahead, _register_step_hooks(optimizer,
                                                                       self._step_ahead))

    # ----------------------------------------------------------- properties
    @property
    def phase(self) -> Phase:
        """Phase of the next iteration, derived from ``step_count``."""
        return phase_of(self.step_count, self.warmup_steps)

    def wire_elements(self, phase: Phase) -> int:
        """Elements one rank sends in an iteration of ``phase`` (known parameters)."""
        return sum(lay.payload_numel(phase) for lay in self._layouts.values())

    # ---------------------------------------------------------------- state
    def _add(self, name: str, param: Tensor) -> None:
        if name in self._layouts:
            raise ValueError(f"two parameters are named {name!r}")
        if not param.is_floating_point():
            raise TypeError(f"parameter {name!r} has dtype {param.dtype}; only "
                            "floating-point parameters can be trained")
        lay, = make_layouts([(name, tuple(param.shape), param.dtype)], self.matrix_rank,
                            self.min_compression_rate, payload_dtype=compute_dtype)
        self._names[param] = name
        self._params[name] = param
        self._layouts[name] = lay
        if lay.compressed:
            self._factors[name] = _Factors(lay, self._generator, param.device)
        if self._pending is not None:
            self._load_entry(name, self._pending.pop(name, None), self._reset_on_load)

    def _name_of(self, param: Tensor) -> str:
        name = self._names.get(param)
        if name is None:
            if self._complete:
                raise RuntimeError(
                    f"acp_hook got a parameter of shape {tuple(param.shape)} that "
                    + ("is not among this ACPState's parameters (named_parameters or the "
                       "optimizer's)" if self._named else "was not in the model of this "
                       "ACPState's first iteration")
                    + ": an ACPState holds the factors and residuals of one model; create "
                    "one ACPState per DDP model")
            name = _AUTO_NAME.format(len(self._layouts))
            self._add(name, param)
        return name

    def state_dict(self, with_error: bool = True) -> dict:
        """Compression state of this rank, keyed by parameter name.

        The format of ``hvd_acp.DistributedOptimizer``'s ``"hvd_acp"``
        section: version, ``step_count``, ``phase`` and per compressed
        parameter its factors ``P``, ``Q`` and this rank's residual
        ``error``. Save it next to the model and the optimizer.

        Args:
            with_error: include this rank's error-feedback residuals.
        """
        params = {name: dict({"P": f.p.clone(), "Q": f.q.clone()},
                             **({"error": f.error.clone()} if with_error else {}))
                  for name, f in self._factors.items()}
        if self._pending:
            params.update(self._pending)
        return {
            "version": STATE_FORMAT_VERSION,
            "step_count": self.step_count,
            "phase": self.phase.value,
            "warmup_steps": self.warmup_steps,
            "matrix_rank": self.matrix_rank,
            "world_size": self._world_size() if dist.is_initialized() else None,
            "rank": dist.get_rank(self.process_group) if dist.is_initialized() else None,
            "params": params,
        }

    def load_state_dict(self, state: dict, reset_error_feedback: bool = False) -> None:
        """Restore :meth:`state_dict` output.

        Two policies, as with ``hvd_acp.DistributedOptimizer``:

        - every rank saves its own file and loads it back: training resumes
          on the uninterrupted trajectory;
        - rank 0 saves, every rank loads rank 0's file with
          ``reset_error_feedback=True``: residuals are rank-local (rank 0's
          copied to every rank would be counted ``world_size`` times), so
          they restart from zero; factors and phase continue, and the file
          loads at any world size.

        Parameters not seen yet (a fresh state without ``named_parameters``
        learns them in the first iteration) get their entries when they
        first appear; a parameter missing from ``state`` raises then.

        Args:
            state: as returned by :meth:`state_dict` (possibly another rank's).
            reset_error_feedback: zero the residuals instead of loading them.
        """
        check_state_version(state, reset_error_feedback)
        if self._step_ahead is not None:
            self._step_ahead.restore(warn=False)
        saved = dict(state["params"])
        if self._complete:
            missing = sorted(set(self._factors) - set(saved))
            unexpected = sorted(set(saved) - set(self._factors))
            if missing or unexpected:
                raise ValueError(f"hvd_acp state does not match the parameters: missing "
                                 f"{missing}, unexpected {unexpected}")
        for name in list(saved):
            if name in self._layouts:
                self._load_entry(name, saved.pop(name), reset_error_feedback)
        if reset_error_feedback:
            saved = {name: {k: v for k, v in entry.items() if k != "error"}
                     for name, entry in saved.items()}
        self._pending = saved if not self._complete else None
        self._reset_on_load = reset_error_feedback
        self.step_count = int(state["step_count"])
        self._agreed = False
        if self._step_ahead is not None:
            self._step_ahead.after_step()

    def _load_entry(self, name: str, entry: Optional[dict], reset_error: bool) -> None:
        factors = self._factors.get(name)
        if factors is None:
            if entry is not None:
                raise ValueError(f"hvd_acp state has factors for {name!r}, which is not "
                                 "compressed here (different matrix_rank or model?)")
            return
        if entry is None:
            raise ValueError(f"hvd_acp state has no entry for the compressed parameter "
                             f"{name!r} (a checkpoint of another model?)")
        load_entry(name, entry, {"P": factors.p, "Q": factors.q, "error": factors.error},
                   reset_error)

    def reset_error_feedback(self) -> None:
        """Set every residual to zero."""
        for factors in self._factors.values():
            factors.error.zero_()

    @contextlib.contextmanager
    def true_weights(self):
        """Within this context the parameters hold the true weights.

        Only needed between a training forward pass and ``optimizer.step()``
        when step-ahead error feedback has shifted them (elsewhere they hold
        the true weights already): to evaluate, save or modify the weights
        in that window. No communication.
        """
        if self._step_ahead is None:
            yield
            return
        with self._step_ahead.true_weights():
            yield

    def close(self) -> None:
        """Restore the true weights and remove the step-ahead hooks for good."""
        if self._finalizer is not None:
            self._finalizer()
        self._step_ahead = None

    # ----------------------------------------------------------------- hook
    def _world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def _begin_bucket(self, bucket: dist.GradBucket) -> None:
        """Iteration bookkeeping; raises when two models share this state."""
        if bucket.index() == 0 and self._iteration_open:
            raise RuntimeError(
                "acp_hook got bucket 0 of a new iteration before the last bucket of the "
                "previous one: this ACPState is registered on two DDP models; create one "
                "ACPState per DDP model")
        self._iteration_open = True

    def _end_bucket(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self._iteration_open = False
            self.step_count += 1
            self._complete = True
            self._pending = None

    def _agree(self, device: torch.device) -> None:
        """Check once that every rank runs with the same settings and step.

        A rank that loaded another checkpoint or another ``matrix_rank``
        would send payloads of another size or phase: Gloo would abort with
        a size mismatch and NCCL would hang. Every rank gathers every rank's
        settings, so all raise the same error.
        """
        mine = torch.tensor([self.matrix_rank, self.min_compression_rate, self.warmup_steps,
                             self.seed, self.step_ahead, self.step_count],
                            dtype=torch.float64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self._world_size())]
        dist.all_gather(gathered, mine, group=self.process_group)
        self._agreed = True
        fields = ("matrix_rank", "min_compression_rate", "warmup_steps", "seed", "step_ahead",
                  "step_count")
        for rank, other in enumerate(gathered):
            if not torch.equal(other, gathered[0]):
                differing = "; ".join(
                    f"{key}={a:g} on rank 0 but {b:g} on rank {rank}"
                    for key, a, b in zip(fields, gathered[0].tolist(), other.tolist()) if a != b)
                raise ValueError(f"ACPState differs between ranks: {differing}; pass the "
                                 "same settings and load the same checkpoint step everywhere")

    def _reduce(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """:func:`acp_hook` for one bucket (see there)."""
        self._begin_bucket(bucket)
        buffer = bucket.buffer()
        if not self._agreed:
            self._agree(buffer.device)
        grads = bucket.gradients()
        names = [self._name_of(p) for p in bucket.parameters()]
        if bucket.is_last() and self._pending:
            raise ValueError("hvd_acp state has entries for parameters this model does not "
                             f"have: {sorted(self._pending)}")
        layouts = [self._layouts[n] for n in names]
        phase, iteration = self.phase, self.step_count
        world_size = self._world_size()

        started = time.perf_counter()
        sizes = [lay.payload_numel(phase) for lay in layouts]
        dtype = functools.reduce(torch.promote_types, (lay.dtype for lay in layouts))
        payload = torch.empty(sum(sizes), dtype=dtype, device=buffer.device)
        slots = payload.split(sizes)
        compressed = [i for i, lay in enumerate(layouts)
                      if lay.compressed and phase is not Phase.DENSE]
        bases = {i: self._factors[names[i]].reused(phase).clone() for i in compressed}
        orthonormalize_(bases.values())
        for i, (lay, grad, slot) in enumerate(zip(layouts, grads, slots)):
            if i in bases:
                self._factors[names[i]].compress(phase, grad, bases[i],
                                                 slot.view(lay.payload_shape(phase)))
            else:
                slot.copy_(grad.reshape(-1))
        self._spent(time.perf_counter() - started)

        with self._lock:
            self.comm_stats.allreduces += 1
            self.comm_stats.bytes_sent += payload.numel() * payload.element_size()
        future = dist.all_reduce(payload, group=self.process_group, async_op=True).get_future()
        self._end_bucket(bucket)
        factors = [self._factors.get(n) for n in names]

        def finish(fut: torch.futures.Future) -> Tensor:
            started = time.perf_counter()
            averaged = fut.value()[0].div_(world_size)
            bad = set() if bool(torch.isfinite(averaged).all()) else _nonfinite(slots)
            for i, (lay, grad, slot) in enumerate(zip(layouts, grads, slots)):
                if i in bases:
                    direct = grad.dtype == lay.dtype
                    target = grad.view(lay.n, lay.m) if direct else torch.empty(
                        lay.n, lay.m, dtype=lay.dtype, device=grad.device)
                    factors[i].apply(phase, slot.view(lay.payload_shape(phase)), bases[i],
                                     target, commit=i not in bad)
                    if not direct:
                        grad.copy_(target.view(grad.shape))
                else:
                    grad.copy_(slot.view(grad.shape))
            if bad:
                with self._lock:
                    if self._last_nonfinite != iteration:
                        self._last_nonfinite = iteration
                        self.nonfinite_steps += 1
                logger.info("non-finite averaged gradient for %d tensor(s) of bucket %d: "
                            "factors kept, error feedback reset", len(bad), bucket.index())
            self._spent(time.perf_counter() - started)
            return buffer

        return future.then(finish)

    def _spent(self, seconds: float) -> None:
        with self._lock:
            self.compression_seconds += seconds


class _Residuals:
    """What :class:`~hvd_acp.stepahead.StepAhead` reads of a state: the
    residuals and parameters by name, and this rank's share of the average.

    Holds the state's dictionaries, not the state, so that the state's
    finalizer can still restore the true weights.
    """

    def __init__(self, factors: Dict[str, _Factors], params: Dict[str, Tensor]) -> None:
        self._factors = factors
        self.params = params

    @property
    def errors(self) -> Dict[str, Tensor]:
        return {name: f.error for name, f in self._factors.items()}

    def share(self) -> float:
        return 1.0      # the hook averages: E is in the units of the applied gradient


def _register_step_hooks(optimizer: torch.optim.Optimizer, step_ahead: StepAhead) -> list:
    """Around every ``optimizer.step()``: the update applies to the true
    weights, and the next gradient is taken ahead of them again.

    The hooks hold the step-ahead state weakly: they do not keep it alive.
    """
    ref = weakref.ref(step_ahead)

    def before_step(opt, args, kwargs):
        this = ref()
        if this is not None:
            this.restore()

    def after_step(opt, args, kwargs):
        this = ref()
        if this is not None:
            this.after_step()

    return [optimizer.register_step_pre_hook(before_step),
            optimizer.register_step_post_hook(after_step)]


def _release(step_ahead: StepAhead, handles: list) -> None:
    """Restore the true weights, remove the forward and step hooks."""
    step_ahead.close()
    for handle in handles:
        handle.remove()


def acp_hook(state: ACPState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""DDP communication hook running ACP-SGD on each bucket.

    Register it with ``model.register_comm_hook(ACPState(...), acp_hook)``.
    For every bucket of every iteration:

    1. Views each gradient of the bucket as a matrix and splits them into
       the tensors to compress (see ``ACPState.min_compression_rate``) and
       the others (1-D tensors, small matrices), as ``powerSGD_hook`` does.
    2. Orthonormalizes the factor each compressed tensor reuses from the
       previous iteration (``Qh = orth(Q)`` in a P step, ``Ph = orth(P)``
       in a Q step; same-shaped factors in one batched QR call).
    3. Adds each compressed gradient to this rank's residual,
       ``A = M + E``, writes this rank's factor ``P_i = A Qh`` (P step) or
       ``Q_i = A^T Ph`` (Q step) into one flat payload, next to the
       uncompressed tensors of the bucket, and keeps what the factor does
       not carry, ``E = A - P_i Qh^T`` (or ``A - Ph Q_i^T``).
    4. Starts one asynchronous ``all_reduce`` of the payload: the only
       communication of the bucket in this iteration.
    5. In the future's callback, averages, rebuilds each compressed
       gradient ``G = P Qh^T`` (or ``Ph Q^T``) into the bucket, keeps the
       averaged factor for the next iteration and copies the averaged
       uncompressed tensors back.

    The phase flips once per iteration, after the last bucket. Iterations
    under ``no_sync()`` do not reach the hook: the accumulated gradient is
    compressed once, at the next synchronized backward. A parameter unused
    on this rank (``find_unused_parameters=True``) has a zero gradient in
    its bucket and goes through the same maths.

    Args:
        state (ACPState): one per DDP model.
        bucket (dist.GradBucket): DDP's flattened gradients of some parameters.

    Returns:
        Future of the bucket's buffer, holding the averaged gradients.
    """
    if not isinstance(state, ACPState):
        raise TypeError(f"acp_hook needs an hvd_acp.ddp.ACPState as its state, got "
                        f"{type(state).__name__}")
    return state._reduce(bucket)


def _nonfinite(slots: Sequence[Tensor]) -> set:
    """Indices of the slots holding inf or NaN.

    The averaged payload is identical on every rank, so every rank finds the
    same slots and repairs the same state.
    """
    return {i for i, slot in enumerate(slots) if not bool(torch.isfinite(slot).all())}


def _validate(matrix_rank, min_compression_rate, warmup_steps, seed, optimizer,
              step_ahead) -> None:
    check_compression_settings(matrix_rank, min_compression_rate, warmup_steps, seed,
                               step_ahead)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
