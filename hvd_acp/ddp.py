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
import math
import threading
import time
import weakref
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .comm import CommStats
from .compression import Phase
from .fusion import TensorLayout
from .state import CompressionState, describe_differences, nonfinite_names
from .stepahead import DEFAULT_STEP_AHEAD, StepAhead, check_step_ahead

__all__ = ["ACPState", "acp_hook"]

logger = logging.getLogger(__name__)

#: Names of parameters without ``named_parameters``: by position in the
#: optimizer's param_groups, else in DDP's first backward pass.
_GROUP_NAME = "group.{}.{}"
_AUTO_NAME = "param.{}"


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
    4. ``optimizer`` and ``step_ahead``: step-ahead error feedback, on by
       default as in ``hvd_acp.DistributedOptimizer``. It needs the torch
       optimizer of the DDP model: pass ``optimizer=``, or call
       :meth:`attach_optimizer` once it exists (frameworks build the comm
       state first), before the first backward pass. Each rank then computes
       its next gradient at ``w - step_ahead * lr / (1 - momentum) * E_i``
       (Adam-family: ``w - step_ahead * lr * E_i / (sqrt(v_hat) + eps)``),
       where the residual it still owes will take the weights. That keeps
       ACP-SGD stable at the learning rates plain averaging trains at (scaled
       by the number of ranks, momentum 0.9), where the residual otherwise
       feeds back late and momentum amplifies it (docs/convergence.md). It
       sends nothing more. The parameters hold the true weights, identical
       on every rank, between ``optimizer.step()`` and the next training
       forward pass (the shift is applied by a module forward pre-hook and
       removed by an optimizer step pre-hook); :meth:`true_weights` gives
       them in between. ``step_ahead=0`` runs the published method, without
       it. With ``step_ahead`` on and no optimizer known at the first
       backward pass, every rank raises ``RuntimeError``: silently running
       without it would train the method that diverges at large learning
       rates (38% instead of 97% on the digits recipe at 8 ranks).

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
        compression: the :class:`~hvd_acp.state.CompressionState` (factors,
            residuals, step count) shared with the Horovod front end.
        comm_stats: all-reduces this rank launched and the bytes it sent.
        compression_seconds: wall time of the compression maths (hook and
            callbacks), for benchmarks.
        nonfinite_steps: iterations whose averaged payload held inf or NaN
            (e.g. an fp16 overflow, on any rank): the affected tensors keep
            their factors and restart their residuals from zero on every
            rank, and the non-finite gradient reaches ``p.grad``, where a
            ``GradScaler`` sees it and skips the step.

    One state serves one model: registering it on a second model raises.
    Every rank must pass the same settings and start from the same state
    (checked once, at the first bucket, with one small collective: a
    checkpoint loaded on some ranks only raises on every rank).
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *,
                 matrix_rank: int = 4, min_compression_rate: float = 2.0,
                 warmup_steps: int = 0, seed: int = 0,
                 named_parameters: Optional[Iterable[Tuple[str, Tensor]]] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 step_ahead: float = DEFAULT_STEP_AHEAD) -> None:
        check_step_ahead(step_ahead)
        self.process_group = process_group
        self.step_ahead = float(step_ahead)
        self.compression = CompressionState(matrix_rank=matrix_rank,
                                            min_compression_rate=min_compression_rate,
                                            warmup_steps=warmup_steps, seed=seed)
        self.comm_stats = CommStats()
        self.compression_seconds = 0.0
        self.nonfinite_steps = 0

        self._names: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._params: Dict[str, Tensor] = {}
        #: Whether every parameter of the model is known (named, or one
        #: iteration seen): an unknown one then belongs to another model.
        self._complete = False
        self._named = False
        self._started = False
        self._iteration_open = False
        self._last_nonfinite: Optional[int] = None
        self._lock = threading.Lock()
        #: (bucket index, phase, names, layout version, device) -> (payload, slots).
        self._payloads: Dict[tuple, Tuple[Tensor, List[Tensor]]] = {}
        #: name -> a copy of this rank's P_i, for the residual computed after the launch.
        self._sent: Dict[str, Tensor] = {}
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self._step_ahead: Optional[StepAhead] = None
        self._finalizer = None
        if named_parameters is not None:
            self._name_parameters(named_parameters)
        if optimizer is not None:
            self.attach_optimizer(optimizer)

    # ----------------------------------------------------------- properties
    @property
    def step_count(self) -> int:
        """Iterations completed."""
        return self.compression.step_count

    @property
    def phase(self) -> Phase:
        """Phase of the next iteration, derived from ``step_count``."""
        return self.compression.phase

    def wire_elements(self, phase: Phase) -> int:
        """Elements one rank sends in an iteration of ``phase`` (known parameters)."""
        return self.compression.wire_elements(phase)

    def chosen_ranks(self) -> Dict[str, int]:
        """name -> rank of every compressed parameter (the choices of the last
        probe under ``matrix_rank="auto"``), identical on every rank."""
        return self.compression.ranks()

    # ------------------------------------------------------------- optimizer
    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Give the state the DDP model's optimizer, for step-ahead error feedback.

        For code that builds the comm state before the optimizer exists
        (PyTorch Lightning's ``DDPStrategy(ddp_comm_state=...)``, for
        example): call it before the first backward pass. Without
        ``named_parameters`` the parameters are then named by their position
        in the optimizer's param_groups, as with ``ACPState(optimizer=...)``.

        Raises:
            TypeError: ``optimizer`` is not a torch optimizer.
            RuntimeError: an optimizer is attached already, or the hook has
                already run (the first iterations would have run without
                step-ahead).
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if not hasattr(optimizer, "_optimizer_step_pre_hooks"):
            raise TypeError(
                f"optimizer is a {type(optimizer).__name__}, a wrapper without the step hooks "
                "of torch.optim.Optimizer (Accelerate's AcceleratedOptimizer is one): pass the "
                "torch optimizer it wraps (its .optimizer)")
        if self.optimizer is not None:
            raise RuntimeError("this ACPState has an optimizer already")
        if self._started:
            raise RuntimeError("attach_optimizer() must be called before the first backward "
                               "pass of the DDP model")
        if not self._named:
            self._name_parameters(
                [(_GROUP_NAME.format(i, j), param)
                 for i, group in enumerate(optimizer.param_groups)
                 for j, param in enumerate(group["params"])])
        if self.step_ahead:
            step_ahead = StepAhead(_Residuals(self.compression, self._params), optimizer,
                                   self.step_ahead)
            self._finalizer = weakref.finalize(
                self, _release, step_ahead, _register_step_hooks(optimizer, step_ahead))
            self._step_ahead = step_ahead
        self.optimizer = optimizer

    # ---------------------------------------------------------------- state
    def _name_parameters(self, named_parameters: Iterable[Tuple[str, Tensor]]) -> None:
        seen = set()
        for name, param in named_parameters:
            if name in seen:
                raise ValueError(f"named_parameters: name {name!r} appears twice")
            seen.add(name)
            if param.requires_grad:
                self._add(name, param)
        self._named = self._complete = True
        self.compression.check_loaded()

    def _add(self, name: str, param: Tensor) -> None:
        if not param.is_floating_point():
            raise TypeError(f"parameter {name!r} has dtype {param.dtype}; only "
                            "floating-point parameters can be trained")
        self.compression.add(name, param.shape, param.dtype, param.device)
        self._names[param] = name
        self._params[name] = param

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
            name = _AUTO_NAME.format(len(self.compression.layouts))
            self._add(name, param)
        return name

    def _rank(self) -> Optional[int]:
        return dist.get_rank(self.process_group) if dist.is_initialized() else None

    def state_dict(self, with_error: bool = True) -> dict:
        """Compression state of this rank, keyed by parameter name.

        The format of ``hvd_acp.DistributedOptimizer``'s ``"hvd_acp"``
        section: version, ``step_count``, ``phase``, the saving rank and
        world size, and per compressed parameter its factors ``P``, ``Q``
        and this rank's residual ``error``. Save it next to the model and
        the optimizer.

        Args:
            with_error: include this rank's error-feedback residuals.
        """
        return self.compression.state_dict(
            rank=self._rank(),
            world_size=self._world_size() if dist.is_initialized() else None,
            with_error=with_error)

    def load_state_dict(self, state: dict, reset_error_feedback: bool = False) -> None:
        """Restore :meth:`state_dict` output, on every rank, before training resumes.

        - every rank saves its own file and loads it back: training resumes
          on the uninterrupted trajectory;
        - rank 0 saves, every rank loads rank 0's file: factors and phase
          continue; rank 0 keeps its residual and the other ranks start
          theirs from zero (a residual is one rank's unsent gradient: copied
          to every rank it would be counted ``world_size`` times). The file
          loads at any world size.

        A rank loading alone is caught at the first bucket: every rank
        raises ``ValueError``.

        Parameters not seen yet (a fresh state without ``named_parameters``
        learns them in the first iteration) get their entries when they
        first appear; a parameter missing from ``state`` raises then.

        Args:
            state: as returned by :meth:`state_dict` (possibly another rank's).
            reset_error_feedback: start every residual from zero, this rank's too.
        """
        if self._step_ahead is not None:
            self._step_ahead.restore(warn=False)
        self.compression.load_state_dict(state, rank=self._rank(),
                                         reset_error_feedback=reset_error_feedback,
                                         complete=self._complete)
        if self._step_ahead is not None:
            self._step_ahead.after_step()

    def reset_error_feedback(self) -> None:
        """Set every residual to zero."""
        self.compression.reset_error_feedback()

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
            self.compression.step_count += 1
            self._complete = True

    def _agree(self, device: torch.device) -> None:
        """Check, at the first bucket, that every rank runs with the same
        settings and state, and that step-ahead has its optimizer.

        A rank that loaded another checkpoint or another ``matrix_rank``
        would send payloads of another size or phase: Gloo would abort with
        a size mismatch and NCCL would hang. Every rank gathers every rank's
        settings, so all raise the same error. Done once per state (a check
        after a load on some ranks only would itself be a collective of
        some ranks only).
        """
        self._started = True
        settings = self.compression.settings()
        step_count, factor_sum = self.compression.fingerprint()
        fields = dict(settings, step_ahead=self.step_ahead, step_count=step_count,
                      factor_sum=factor_sum, has_optimizer=self.optimizer is not None)
        mine = torch.tensor([float(v) for v in fields.values()], dtype=torch.float64,
                            device=device)
        gathered = [torch.empty_like(mine) for _ in range(self._world_size())]
        dist.all_gather(gathered, mine, group=self.process_group)
        for rank, other in enumerate(gathered):
            if not torch.equal(other, gathered[0]):
                as_dict = lambda row: {k: _number(type(v), x)  # noqa: E731
                                       for (k, v), x in zip(fields.items(), row.tolist())}
                differing = describe_differences(as_dict(gathered[0]), as_dict(other), rank)
                raise ValueError(f"ACPState differs between ranks: {differing}; pass the "
                                 "same settings and load the same checkpoint on every rank")
        if self.step_ahead and self.optimizer is None:
            raise RuntimeError(
                f"ACPState has step-ahead error feedback on (step_ahead={self.step_ahead:g}) "
                "but no optimizer: pass ACPState(..., optimizer=optimizer) or call "
                "state.attach_optimizer(optimizer) before the first backward pass. "
                "step_ahead=0 runs without it (the published ACP-SGD, which diverges at "
                "large learning rates)")

    def _reduce(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """:func:`acp_hook` for one bucket (see there)."""
        self._begin_bucket(bucket)
        buffer = bucket.buffer()
        if not self._started:
            self._agree(buffer.device)
        grads = bucket.gradients()
        names = [self._name_of(p) for p in bucket.parameters()]
        if bucket.is_last():
            self.compression.check_loaded()
        state = self.compression
        layouts = [state.layouts[n] for n in names]
        phase, iteration = state.phase, state.step_count
        probing = state.probing
        world_size = self._world_size()

        started = time.perf_counter()
        payload, slots = self._payload(bucket.index(), phase, names, layouts, buffer.device)
        compressed = ([n for n in names if n in state.tensors]
                      if phase is not Phase.DENSE else [])
        bases = state.orthonormal_bases(phase, compressed)
        # Each residual right after its projection, while A is in the cache,
        # but the last one's after the launch, which it would delay.
        last = max((i for i, n in enumerate(names) if n in bases), default=None)
        unsettled = None
        for index, (name, grad, slot) in enumerate(zip(names, grads, slots)):
            if name in bases:
                tensor, basis = state.tensors[name], bases[name]
                factor_t = tensor.project_(phase, grad, basis, slot)
                factor = slot if phase is Phase.P else factor_t
                if index != last:
                    tensor.settle_(phase, basis, factor)
                else:
                    # The all-reduce writes the average over the slot.
                    unsettled = (tensor, basis, self._sent_copy(name, slot)
                                 if phase is Phase.P else factor)
            elif probing and name in state.tensors:
                state.probe_payload_(name, grad, slot)      # M + E, residual paid
            else:
                slot.copy_(grad if grad.shape == slot.shape else grad.reshape(slot.shape))
        self._spent(time.perf_counter() - started)

        with self._lock:
            self.comm_stats.allreduces += 1
            self.comm_stats.bytes_sent += payload.numel() * payload.element_size()
        future = dist.all_reduce(payload, group=self.process_group, async_op=True).get_future()
        if unsettled is not None:
            # Before the callback is attached, which may then touch E.
            started = time.perf_counter()
            tensor, basis, factor = unsettled
            tensor.settle_(phase, basis, factor)
            self._spent(time.perf_counter() - started)
        self._end_bucket(bucket)
        tensors = [state.tensors.get(n) for n in names]
        bucket_is_last = bucket.is_last()

        def finish(fut: torch.futures.Future) -> Tensor:
            started = time.perf_counter()
            averaged = fut.value()[0].div_(world_size)
            # One sum: finite unless an entry is inf or NaN (or the sum
            # overflows, when the per-slot test finds nothing to repair).
            bad = (set() if math.isfinite(float(averaged.sum()))
                   else set(nonfinite_names(zip(names, slots))))
            for name, lay, tensor, grad, slot in zip(names, layouts, tensors, grads, slots):
                if name in bases:
                    direct = grad.dtype == lay.dtype
                    target = grad.view(lay.n, lay.m) if direct else torch.empty(
                        lay.n, lay.m, dtype=lay.dtype, device=grad.device)
                    tensor.apply_(phase, slot, bases[name], target, commit=name not in bad)
                    if not direct:
                        grad.copy_(target.view(grad.shape))
                else:
                    grad.copy_(slot if slot.shape == grad.shape else slot.view(grad.shape))
                    if probing and tensor is not None and name not in bad:
                        state.probe_(name, slot, iteration)   # rank chosen from the average
            if probing and bucket_is_last:
                state.end_probe(iteration)
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

    def _payload(self, index: int, phase: Phase, names: List[str], layouts: List[TensorLayout],
                 device: torch.device) -> Tuple[Tensor, List[Tensor]]:
        """The flat buffer one bucket all-reduces in ``phase``, and each member's
        slot of it shaped as its payload; made once per bucket, phase and
        layout (the bucket's previous all-reduce is done before its hook runs
        again: DDP waits for every bucket at the end of backward)."""
        key = (index, phase, tuple(names), self.compression.layout_version, str(device))
        cached = self._payloads.get(key)
        if cached is None:
            if len(self._payloads) > 64:        # buckets rebuilt or ranks changed often
                self._payloads.clear()
            sizes = [lay.payload_numel(phase) for lay in layouts]
            dtype = functools.reduce(torch.promote_types, (lay.dtype for lay in layouts))
            payload = torch.empty(sum(sizes), dtype=dtype, device=device)
            slots = [slot.view(lay.payload_shape(phase))
                     for slot, lay in zip(payload.split(sizes), layouts)]
            cached = self._payloads[key] = (payload, slots)
        return cached

    def _sent_copy(self, name: str, factor: Tensor) -> Tensor:
        """``factor`` copied into a buffer of ``name``'s own (made once per shape)."""
        copy = self._sent.get(name)
        if copy is None or copy.shape != factor.shape or copy.dtype != factor.dtype:
            copy = self._sent[name] = torch.empty_like(factor)
        return copy.copy_(factor)

    def _spent(self, seconds: float) -> None:
        with self._lock:
            self.compression_seconds += seconds


class _Residuals:
    """What :class:`~hvd_acp.stepahead.StepAhead` reads of a state: the
    residuals and parameters by name, and this rank's share of the average.

    Holds the compression state and the parameter dictionary, not the
    ACPState, so that the ACPState's finalizer can still restore the true
    weights.
    """

    def __init__(self, compression: CompressionState, params: Dict[str, Tensor]) -> None:
        self._compression = compression
        self.params = params

    @property
    def errors(self) -> Dict[str, Tensor]:
        return self._compression.errors

    def share(self) -> float:
        return 1.0      # the hook averages: E is in the units of the applied gradient


def _register_step_hooks(optimizer: torch.optim.Optimizer, step_ahead: StepAhead) -> list:
    """Around every ``optimizer.step()``: the update applies to the true
    weights, and the next gradient is taken ahead of them again.

    ``optimizer.step(closure)`` (PyTorch Lightning's automatic optimization,
    L-BFGS) runs the forward and backward passes inside the step: the true
    weights come back once the closure has returned, before the update.
    The hooks hold the step-ahead state weakly: they do not keep it alive.
    """
    ref = weakref.ref(step_ahead)

    def restore_after(closure):
        @functools.wraps(closure)
        def wrapped(*args, **kwargs):
            loss = closure(*args, **kwargs)
            this = ref()
            if this is not None:
                this.restore()
            return loss
        return wrapped

    def before_step(opt, args, kwargs):
        # args are step()'s own: (optimizer, closure?).
        if len(args) > 1 and callable(args[1]):
            return (args[0], restore_after(args[1]), *args[2:]), kwargs
        if callable(kwargs.get("closure")):
            return args, dict(kwargs, closure=restore_after(kwargs["closure"]))
        this = ref()
        if this is not None:
            this.restore()
        return None

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
       the tensors to compress (see ``min_compression_rate`` above) and
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


def _number(kind: type, value: float):
    """A gathered float64 back in the type of the setting it came from."""
    return kind(value) if kind in (int, bool) else value
