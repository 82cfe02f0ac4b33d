"""ACP-SGD as a communication hook of PyTorch's ``DistributedDataParallel``.

The DDP counterpart of ``hvd_acp.DistributedOptimizer``, a sibling of torch's
``powerSGD_hook`` with the same shape of API::

    import hvd_acp.ddp

    model = DDP(model)
    model.register_comm_hook(hvd_acp.ddp.ACPState(matrix_rank=4, optimizer=optimizer),
                             hvd_acp.ddp.acp_hook)

:class:`ACPState` holds the settings, the parameters' names, the optimizer
and the checkpoints; each bucket goes through :mod:`hvd_acp.ddp_buckets` and
the compression state every front end shares (:mod:`hvd_acp.state`), over
``torch.distributed``: Gloo on CPU, NCCL on GPU, any backend with an
asynchronous ``all_reduce``. Horovod is not imported.
"""
# No ``from __future__ import annotations``: DDP compares the hook's
# annotations with the real ``dist.GradBucket`` and ``Future[Tensor]`` types.
import contextlib
import logging
import weakref
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import Variable
from torch.utils.weak import WeakIdKeyDictionary

from .compression import Phase
from .ddp_buckets import BucketReducer
from .settings import Settings
from .state import CompressionState
from .stepahead import StepAhead, check_step_hooks, hook_optimizer_steps, release

logger = logging.getLogger(__name__)

__all__ = ["ACPState", "acp_hook"]

#: Names of parameters without ``named_parameters``: by position in the
#: optimizer's param_groups, else in DDP's first backward pass.
_GROUP_NAME = "group.{}.{}"
_AUTO_NAME = "param.{}"


class ACPState:
    r"""Settings and state of :func:`acp_hook` for one DDP model.

    ACP-SGD's settings are every front end's (:meth:`hvd_acp.Settings.of`:
    ``settings=hvd_acp.Settings(...)``, or its fields by name, such as
    ``matrix_rank=4``; :class:`hvd_acp.Settings` says what each does and
    how to tune it); ``None`` takes the library's default, decided when the
    state is first used, with the optimizer if one is attached by then. ``warmup_steps`` may be 0, unlike
    ``powerSGD_hook``'s ``start_powerSGD_iter``: state is keyed by
    parameter, so DDP's rebuild of its buckets changes nothing.

    Step-ahead error feedback (on by default) needs the DDP model's torch
    optimizer: pass ``optimizer=``, or call :meth:`attach_optimizer` before
    the first backward pass. The parameters hold the true weights
    everywhere but between a training forward pass and the end of its
    backward pass (:meth:`true_weights` gives them in between), a step
    skipped by a ``GradScaler`` included; the user's rescaling of the
    averaged gradients before ``optimizer.step()`` (``GradScaler.unscale_``,
    clipping) is measured at the step and applied to the shift. With step-ahead on and no
    optimizer at the first backward pass every rank raises ``RuntimeError``:
    without it the method diverges at large learning rates (38% instead of
    97% on the digits recipe at 8 ranks). ``step_ahead=0`` runs the
    published method.

    Args:
        process_group: the group to average over (default: the world).
        named_parameters: ``model.named_parameters()`` of the DDP model, to
            key the state, checkpoints and errors by name. Without it,
            parameters are named by position in ``optimizer``'s param_groups
            (``group.0.0``, ...), or without an optimizer ``param.0``, ... in
            the order of DDP's first backward pass.
        optimizer: the torch optimizer of the DDP model.

    Attributes:
        settings: the :class:`~hvd_acp.settings.Settings` (resolved once used).
        compression: the :class:`~hvd_acp.state.CompressionState` (factors,
            residuals, step count) shared with the Horovod front end.
        step_count: iterations that communicated (not those under ``no_sync()``).
        nonfinite_steps: iterations whose average held inf or NaN (an fp16
            overflow on any rank): those tensors keep their factors and
            restart their residuals, and ``p.grad`` shows it to ``GradScaler``.

    One state serves one model. Every rank must pass the same settings and
    start from the same state (checked at the first bucket, in one small
    collective: a checkpoint loaded on some ranks only raises on every rank).
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *,
                 settings: Optional[Settings] = None,
                 named_parameters: Optional[Iterable[Tuple[str, Tensor]]] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, **named_settings) -> None:
        self.settings = Settings.of(settings, **named_settings)
        self.process_group = process_group
        self._buckets = BucketReducer(process_group)
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self._compression: Optional[CompressionState] = None
        self._names: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._params: Dict[str, Tensor] = {}
        #: Whether every parameter of the model is known (named, or one
        #: iteration seen): an unknown one then belongs to another model.
        self._complete = self._named = self._started = self._described = False
        self._step_ahead: Optional[StepAhead] = None
        self._finalizer = None
        if named_parameters is not None:
            self._name_parameters(named_parameters)
        if optimizer is not None:
            self.attach_optimizer(optimizer)

    # ----------------------------------------------------------- properties
    @property
    def compression(self) -> CompressionState:
        if self._compression is None:
            # The defaults decided here, once: with the optimizer if attached.
            shapes = ([(name, p.shape, p.dtype) for name, p in self._params.items()]
                      if self._complete else None)
            self.settings = self.settings.resolve(self.optimizer, shapes=shapes)
            world_size = (dist.get_world_size(self.process_group) if dist.is_initialized()
                          else 1)
            self._compression = CompressionState(self.settings, world_size=world_size)
            for name, param in self._params.items():
                self._compression.add(name, param.shape, param.dtype, param.device)
        return self._compression

    step_count = property(lambda self: self.compression.step_count, doc="Iterations completed.")
    phase = property(lambda self: self.compression.phase, doc="Phase of the next iteration.")
    nonfinite_steps = property(lambda self: self.compression.nonfinite_steps,
                               doc="Iterations whose averaged payload was not finite.")
    comm_stats = property(lambda self: self._buckets.comm_stats,
                          doc="All-reduces this rank launched and the bytes it sent.")
    compression_seconds = property(lambda self: self._buckets.compression_seconds,
                                   doc="Wall time of the compression maths.")

    @property
    def step_ahead(self) -> float:
        """``a`` of step-ahead error feedback (0: off)."""
        self.compression                # the settings are resolved with it
        return self.settings.step_ahead

    def wire_elements(self, phase: Phase) -> int:
        """Elements one rank sends in an iteration of ``phase`` (known parameters)."""
        return self.compression.wire_elements(phase)

    def chosen_ranks(self) -> Dict[str, int]:
        """name -> rank of every compressed parameter (the choices of the last
        probe under ``matrix_rank="auto"``), identical on every rank."""
        return self.compression.ranks()

    # ------------------------------------------------------------- optimizer
    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Give the state the DDP model's optimizer, for step-ahead error
        feedback, before the first backward pass (for code that builds the comm
        state first, e.g. Lightning's ``DDPStrategy(ddp_comm_state=...)``).
        Without ``named_parameters`` the parameters are named by their
        position in its param_groups, as with ``ACPState(optimizer=...)``.

        Raises:
            TypeError: ``optimizer`` is not a torch optimizer.
            RuntimeError: an optimizer is attached already, or the hook has
                already run (its first iterations ran without step-ahead).
        """
        check_step_hooks(optimizer)
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
        self.optimizer = optimizer
        if self.step_ahead:
            # Holds the compression state and the parameters, not this
            # ACPState, so that its finalizer can still restore the weights.
            self._step_ahead = StepAhead(self.compression, self._params, optimizer,
                                         self.step_ahead)
            self._finalizer = weakref.finalize(self, release, self._step_ahead,
                                               hook_optimizer_steps(optimizer, self._step_ahead))

    # ---------------------------------------------------------------- names
    def _name_parameters(self, named_parameters: Iterable[Tuple[str, Tensor]]) -> None:
        seen = set()
        for name, param in named_parameters:
            if name in seen:
                raise ValueError(f"named_parameters: name {name!r} appears twice")
            seen.add(name)
            if param.requires_grad:
                self._add(name, param)
        self._named = self._complete = True
        if self._compression is not None:
            self._compression.check_loaded()

    def _add(self, name: str, param: Tensor) -> None:
        if not param.is_floating_point():
            raise TypeError(f"parameter {name!r} has dtype {param.dtype}; only "
                            "floating-point parameters can be trained")
        if self._compression is not None:
            self._compression.add(name, param.shape, param.dtype, param.device)
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
            name = _AUTO_NAME.format(len(self._params))
            self._add(name, param)
        return name

    # ---------------------------------------------------------- checkpoints
    def _rank(self) -> Optional[int]:
        return dist.get_rank(self.process_group) if dist.is_initialized() else None

    def state_dict(self, with_error: bool = True) -> dict:
        """This rank's compression state, keyed by parameter name, in the
        format of ``hvd_acp.DistributedOptimizer``'s ``"hvd_acp"`` section."""
        world = dist.get_world_size(self.process_group) if dist.is_initialized() else None
        return self.compression.state_dict(rank=self._rank(), world_size=world,
                                           with_error=with_error)

    def load_state_dict(self, state: dict, reset_error_feedback: bool = False) -> None:
        """Restore :meth:`state_dict` output (possibly another rank's) on every
        rank: factors and phase continue, a residual only on the rank that
        saved it, at any world size. A rank loading alone is caught at the
        first bucket: every rank raises ``ValueError``."""
        if self._step_ahead is not None:
            self._step_ahead.restore(warn=False)
        self.compression.load_state_dict(state, rank=self._rank(), complete=self._complete,
                                         reset_error_feedback=reset_error_feedback)
        if self._step_ahead is not None:
            self._step_ahead.after_step()

    def reset_error_feedback(self) -> None:
        """Set every residual to zero."""
        self.compression.reset_error_feedback()

    @contextlib.contextmanager
    def true_weights(self):
        """Within this context the parameters hold the true weights (needed
        only between a training forward pass and ``optimizer.step()``). No
        communication."""
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
    def _agree(self, device: torch.device) -> None:
        """At the first bucket: every rank runs with the same settings and
        state (or all raise), and step-ahead has its optimizer."""
        self._started = True
        step_count, factor_sum = self.compression.fingerprint()
        self._buckets.agree(device, dict(
            self.settings.facts(), step_count=step_count, factor_sum=factor_sum,
            has_optimizer=self.optimizer is not None))
        if self.settings.step_ahead and self.optimizer is None:
            raise RuntimeError(
                f"ACPState has step-ahead error feedback on (step_ahead="
                f"{self.settings.step_ahead:g}) but no optimizer: pass ACPState(..., "
                "optimizer=optimizer) or call state.attach_optimizer(optimizer) before the "
                "first backward pass. step_ahead=0 runs without it (the published ACP-SGD, "
                "which diverges at large learning rates)")

    def _reduce(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """:func:`acp_hook` for one bucket (see there)."""
        self._buckets.begin(bucket)
        if not self._started:
            self._agree(bucket.buffer().device)
        if bucket.index() == 0 and self._step_ahead is not None:
            _at_end_of_backward(self._step_ahead.after_backward)
        names = [self._name_of(p) for p in bucket.parameters()]
        if bucket.is_last() and not self._described:
            self.compression.check_loaded()
            self._complete = self._described = True
            logger.info("hvd_acp: %s", self.compression.describe(self.settings.fp16_wire))
        return self._buckets.reduce(bucket, self.compression, names,
                                    fp16_wire=self.settings.fp16_wire)


def _at_end_of_backward(callback) -> None:
    """Run ``callback`` once the backward pass in progress is over (autograd's
    final callbacks, as DDP's own reducer uses them). A hook called outside
    a backward pass (there is none) leaves it to the optimizer's step."""
    try:
        Variable._execution_engine.queue_callback(callback)
    except RuntimeError:
        pass


def acp_hook(state: ACPState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""DDP communication hook running ACP-SGD on each bucket.

    Register it with ``model.register_comm_hook(ACPState(...), acp_hook)``.
    Each gradient of shape ``(n, ...)`` is viewed as an ``n x m`` matrix.
    For every bucket of every iteration:

    1. Orthonormalizes the factor each compressed tensor reuses from the
       previous iteration (``Qh = orth(Q)`` in a P step, ``Ph = orth(P)`` in
       a Q step; same-shaped factors in one batched QR call).
    2. Writes this rank's factor of ``A = M + E`` (gradient plus residual),
       ``P_i = A Qh`` or ``Q_i = A^T Ph``, into one flat payload next to the
       bucket's uncompressed tensors, and keeps the residual
       ``E = A - P_i Qh^T`` (or ``A - Ph Q_i^T``).
    3. Starts one asynchronous ``all_reduce`` of the payload, the bucket's
       only communication (``powerSGD_hook`` sends two dependent ones).
    4. In the future's callback, averages, rebuilds ``G = P Qh^T`` (or
       ``Ph Q^T``) into the bucket and keeps the averaged factor.

    The phase flips after the last bucket. Iterations under ``no_sync()``
    do not reach the hook: the accumulated gradient is compressed once, at
    the next synchronized backward. A parameter unused on this rank
    (``find_unused_parameters=True``) has a zero gradient, the same maths.

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
