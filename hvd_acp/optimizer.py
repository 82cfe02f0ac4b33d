"""The public optimizer: glue between a torch optimizer and the reducer.

:class:`DistributedOptimizer` checks its arguments (the same error on every
rank), builds the :class:`~hvd_acp.reducer.ACPReducer` and the step-ahead
shift, and keeps Horovod's contract on :class:`~hvd_acp.wrapper.WrappedOptimizer`,
the base every hvd_acp optimizer under Horovod shares: ``step``,
``synchronize``, ``skip_synchronize``, checkpoints with a compression
section, and ``hvd.broadcast_optimizer_state``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
import os
import warnings
import weakref
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .comm import Communicator, HorovodCommunicator
from .fusion import DEFAULT_FUSION_THRESHOLD_BYTES
from .horovod_broadcast import STATE_KEY
from .reducer import ACPReducer
from .settings import Settings, is_int
from .stepahead import StepAhead
from .wrapper import WrappedOptimizer, named_parameters_of

logger = logging.getLogger(__name__)


def _fp16_wire(compression, fp16_wire: Optional[bool]) -> Optional[bool]:
    """``fp16_wire`` from Horovod's ``compression`` and the setting by name:
    either one, or both where they agree; ``ValueError`` where they do not."""
    from_compression = HorovodCommunicator.fp16_wire_of(compression)
    if from_compression is None:
        return fp16_wire
    if fp16_wire is not None and fp16_wire != from_compression:
        raise ValueError(f"fp16_wire={fp16_wire!r} and compression={compression!r} disagree: "
                         "give one of them (hvd.Compression.fp16 is fp16_wire=True)")
    return from_compression


class DistributedOptimizer(WrappedOptimizer):
    """Drop-in replacement for ``hvd.DistributedOptimizer`` training with ACP-SGD.

    Wraps a torch optimizer by composition: ``param_groups``, ``state`` and
    ``defaults`` are the wrapped optimizer's own objects, so its existing
    state is kept and LR schedulers and ``GradScaler`` work unchanged.

    Horovod's arguments keep Horovod's meaning:

    Args:
        optimizer: the torch optimizer to wrap.
        named_parameters: (name, parameter) pairs naming every parameter of
            ``optimizer``; names must be unique and identical on all ranks.
            Defaults to ``allreduce.noname.{group}.{index}`` like Horovod.
            A parameter that can never have a gradient (an integer or bool
            tensor) is carried along, never hooked or sent.
        compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16``,
            applied to each fused buffer on the wire.
        backward_passes_per_step: backward passes accumulated locally
            before one compressed all-reduce.
        op: ``hvd.Average`` or ``hvd.Sum``.
        gradient_predivide_factor: split the averaging before and after the
            sum, as in Horovod (``op=hvd.Average`` only).
        num_groups: split the parameters into this many explicit fusion
            groups (0: plan buffers by ``fusion_threshold_bytes``).
        groups: explicit fusion groups: a list of lists of parameters.
        sparse_as_dense: densify sparse gradients into the fused buffers and
            hand the optimizer a sparse gradient again; otherwise they are
            sent apart, uncompressed, as Horovod sends them.
        process_set: the Horovod process set to average over. On a rank
            outside it nothing is hooked or communicated, and ``step()``
            updates with the local gradients, as in Horovod.

    ACP-SGD's own settings (keyword only) are every front end's
    (:meth:`hvd_acp.Settings.of`): one ``settings=hvd_acp.Settings(...)``, or
    its fields by name, ``None`` for the library's default
    (:class:`hvd_acp.Settings` says what each does and what to tune):
    ``matrix_rank`` (r of the factors, a share of each matrix, or
    ``"auto"``), ``min_compression_rate``, ``warmup_steps``, ``seed``,
    ``step_ahead`` (the parameters hold the true weights except between a
    training forward pass and the end of its backward pass;
    :meth:`true_weights` in between), ``both_factors``.
    ``fp16_wire`` is also Horovod's ``compression`` here
    (``hvd.Compression.fp16``); both may be given if they agree. Then the
    front end's own:

    Args:
        fusion_threshold_bytes: the S-SGD fusion threshold the buffers are
            planned from; each buffer's payload is about this times the
            phase's compression ratio. 0 gives one buffer per tensor.
        overlap: compress each gradient and launch its fused buffer's
            all-reduce from the gradient hooks, while backward computes the
            earlier layers (the default). False leaves all of it to
            ``synchronize()`` (``step()``), after backward: the same maths,
            buffers and results, without the overlap; a measure of what the
            overlap is worth.
        diagnostics: record the per-step health of the error feedback
            (residual against gradient, share the projection keeps, turn of
            the subspace) in ``optimizer.reducer.diagnostics``; see
            :mod:`hvd_acp.diagnostics`. Off by default (it costs a few
            passes over every gradient).
        communicator: a :class:`~hvd_acp.comm.Communicator`; defaults to
            Horovod. Tests pass a ``LocalCommunicator``.
    """

    reducer_class = ACPReducer
    name_prefix = "hvd_acp"
    section = STATE_KEY
    #: Factors on the wire per step (one: P or Q), for the default rank.
    factors_per_step = 1

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                 compression=None, backward_passes_per_step: int = 1, op=None,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: Optional[Sequence[Sequence[torch.Tensor]]] = None,
                 sparse_as_dense: bool = False, process_set=None, *,
                 settings: Optional[Settings] = None,
                 fusion_threshold_bytes: int = DEFAULT_FUSION_THRESHOLD_BYTES,
                 overlap: bool = True, diagnostics: bool = False,
                 communicator: Optional[Communicator] = None, **named_settings):
        args = _Arguments(backward_passes_per_step, fusion_threshold_bytes,
                          gradient_predivide_factor, num_groups, groups, sparse_as_dense, overlap)
        error, named, fusion_groups = None, [], None
        try:
            if communicator is None:
                HorovodCommunicator.check_arguments(op, gradient_predivide_factor, compression)
            named = named_parameters_of(optimizer, named_parameters)
            settings = Settings.of(
                settings, fp16_wire=_fp16_wire(compression, named_settings.pop("fp16_wire", None)),
                **named_settings,
            ).resolve(optimizer, factors_per_step=self.factors_per_step,
                      shapes=[(n, p.shape, p.dtype) for n, p in named if _can_have_grad(p)])
            args.check()
            fusion_groups = args.fusion_groups(named)
        except (ValueError, TypeError, NotImplementedError) as exc:
            error, settings = exc, None
        if communicator is None:
            communicator = HorovodCommunicator(op, gradient_predivide_factor, process_set,
                                               fp16_wire=bool(settings and settings.fp16_wire))
        self._wrap(optimizer, communicator)
        # Elastic jobs skip the collectives: a worker that joins later builds
        # its optimizer while the others are inside Horovod's state sync, and
        # is checked against rank 0's state in sync_compression_state().
        elastic = (isinstance(communicator, HorovodCommunicator)
                   and os.environ.get("HOROVOD_ELASTIC") == "1")
        self._agree_on_arguments(error, lambda: args.facts(settings, named, fusion_groups,
                                                           communicator),
                                 alone=elastic or not communicator.included())
        self._build(named, settings, args, fusion_groups, bool(diagnostics), elastic)

    def _build(self, named, settings: Settings, args: "_Arguments", fusion_groups,
               diagnostics: bool, elastic: bool) -> None:
        """The reducer and the step-ahead shift over the checked arguments."""
        # Horovod's attribute, which user code reads to map names to parameters.
        self._parameter_names = {p: n for n, p in sorted(named, key=lambda pair: pair[0])}
        trained = [(n, p) for n, p in named if _can_have_grad(p)]
        self._reducer = self.reducer_class(
            trained, self._comm, settings, fusion_threshold_bytes=args.fusion_threshold_bytes,
            backward_passes_per_step=args.backward_passes_per_step, groups=fusion_groups,
            sparse_as_dense=args.sparse_as_dense, name_prefix=self.name_prefix,
            diagnostics=diagnostics, overlap=args.overlap,
            on_first_round=None if elastic else self._agree_on_state)
        self._settings = settings
        self._step_ahead = StepAhead(self._reducer.state, self._reducer.params, self._optimizer,
                                     settings.step_ahead, share=self._reducer.share,
                                     included=self._reducer.included)
        self.backward_passes_per_step = args.backward_passes_per_step
        self._synchronized = False
        self._should_synchronize = True
        # The hooks die with the optimizer, so a model can be wrapped again
        # once the previous optimizer is gone (or closed).
        self._finalizer = weakref.finalize(self, _release, self._reducer, self._step_ahead)
        for _, param in trained:
            param._hvd_acp_owner = weakref.ref(self)
        if isinstance(self._comm, HorovodCommunicator):
            from .elastic import register_elastic_handler
            register_elastic_handler(DistributedOptimizer)

    # ------------------------------------------------------------- the contract
    @property
    def step_count(self) -> int:
        """Number of communication rounds completed (optimizer steps)."""
        return self._reducer.step_count

    @property
    def phase(self):
        """The :class:`~hvd_acp.compression.Phase` of the next step."""
        return self._reducer.phase

    @property
    def reducer(self) -> ACPReducer:
        return self._reducer

    @property
    def settings(self) -> Settings:
        """The :class:`~hvd_acp.Settings` this optimizer trains with, every
        default decided (by the wrapped optimizer's family)."""
        return self._settings

    def chosen_ranks(self) -> Dict[str, int]:
        """name -> rank of every compressed parameter (the choices of the last
        probe under ``matrix_rank="auto"``), identical on every rank."""
        return self._reducer.state.ranks()

    def close(self) -> None:
        """Remove the gradient hooks; the parameters may then be wrapped again."""
        super().close()
        for param in self._reducer.params.values():
            if getattr(param, "_hvd_acp_owner", lambda: None)() is self:
                del param._hvd_acp_owner

    @contextlib.contextmanager
    def true_weights(self):
        """Within this context the parameters hold the true weights.

        Only needed between a training forward pass and ``step()``, when
        step-ahead error feedback has shifted the compressed parameters
        (elsewhere they hold the true weights already); use it to evaluate,
        save or modify the weights in that window. No communication.
        """
        with self._step_ahead.true_weights():
            yield

    def synchronize(self) -> None:
        """Wait for all-reduces and write the averaged gradients into ``p.grad``.

        After it returns, ``p.grad`` holds the gradient the update will use:
        clip or unscale it here, then call ``step()`` inside
        :meth:`skip_synchronize`.
        """
        self._reducer.synchronize()
        self._synchronized = True
        # Backward is over: the true weights back, whether or not the user
        # steps (a GradScaler skips the step after an overflow).
        self._step_ahead.after_backward()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Within this context ``step()`` does not call ``synchronize()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _step(self):
        """Synchronize (unless already done or skipped), update, next phase."""
        if self._should_synchronize:
            if self._synchronized:
                # Horovod's warning, which tests in the wild look for: the
                # pattern usually means skip_synchronize() was forgotten.
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). hvd.DistributedOptimizer "
                              "would all-reduce again here; use `with "
                              "optimizer.skip_synchronize(): optimizer.step()` after "
                              "optimizer.synchronize().", UserWarning, stacklevel=3)
            if self._synchronized and not self._reducer.pending:
                logger.debug("step() after synchronize(): nothing left to communicate")
            else:
                self.synchronize()
        self._synchronized = False
        # The update applies to the true weights, with the user's rescaling of
        # the written gradients measured; the next gradient is taken ahead of
        # them again (see hvd_acp.stepahead).
        self._step_ahead.before_update()
        result = self._optimizer.step()
        self._step_ahead.after_step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._reducer.round_open:
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): the compressed gradients are "
                "already in flight. Call zero_grad() before backward() or after step().")
        self._optimizer.zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict plus an ``"hvd_acp"`` section.

        The extra section (phase, step count, factors and this rank's error
        feedback, keyed by parameter name, with the saving rank) is ignored
        by a plain torch optimizer's ``load_state_dict``.
        ``hvd.broadcast_optimizer_state`` carries it to every rank (the
        root's step count, phase and factors; see :meth:`broadcast_section`).
        """
        return super().state_dict()

    def load_state_dict(self, state_dict: dict, reset_error_feedback: bool = False) -> None:
        """Load a state dict of this class or of the plain wrapped optimizer.

        Any rank may load any rank's file: factors, step count and phase are
        loaded as saved, and a residual only on the rank that saved it (the
        others start theirs from zero). Load on every rank, or on the root
        rank followed by ``hvd.broadcast_optimizer_state`` on every rank.

        Args:
            state_dict: from :meth:`state_dict`, or from a torch optimizer (then
                the compression state is left as it is).
            reset_error_feedback: start every residual from zero, this
                rank's own included.

        Raises:
            ValueError: the compression section does not match this
                optimizer (format, parameters, shapes); nothing is loaded.
        """
        self._reset_error_feedback = reset_error_feedback
        try:
            super().load_state_dict(state_dict)
        finally:
            self._reset_error_feedback = False

    def sync_compression_state(self, root_rank: int = 0) -> None:
        """Make every rank's compression state equal to ``root_rank``'s.

        Broadcasts the step count (hence the phase) and the factors P and Q,
        and resets every rank's error feedback to zero, which is the one
        choice valid for any set of ranks: residuals are rank-local and
        meaningless on a rank that joined later. A collective: call it on
        every rank (a rank outside the process set returns at once).
        Elastic training calls it on every (re)start.
        """
        if not self._comm.included():
            return
        state = self._reducer.state_dict(with_error=False)
        state = self._comm.broadcast_object(state, root_rank, name="hvd_acp.sync_state")
        self._step_ahead.restore(warn=False)
        self._reducer.load_state_dict(state, reset_error_feedback=True)

    def broadcast_section(self, root_rank: int) -> None:
        if self._comm.included():
            super().broadcast_section(root_rank)

    def _section_state(self, for_broadcast: bool = False) -> dict:
        return self._reducer.state_dict(with_error=not for_broadcast)

    def _check_section(self, section: dict) -> None:
        self._reducer.state.check_state_dict(section)

    def _load_section(self, section: dict, from_broadcast: bool = False) -> None:
        # A broadcast carries no residual: the other ranks start theirs from zero.
        self._reducer.load_state_dict(section, reset_error_feedback=from_broadcast
                                      or self._reset_error_feedback)

    def _before_load(self) -> None:
        self._step_ahead.restore(warn=False)

    def _after_load(self) -> None:
        if self._reset_error_feedback:
            self._reducer.state.reset_error_feedback()
        self._step_ahead.after_step()

    _reset_error_feedback = False

    def _agree_on_state(self, reducer: ACPReducer) -> None:
        """At the first step: every rank starts from the same compression state,
        or all raise (a checkpoint loaded on some ranks only would leave them in
        phases whose all-reduces never match)."""
        step_count, factor_sum = reducer.state.fingerprint()
        self._agree_on_start({"step_count": step_count, "factor_sum": factor_sum},
                             _different_states, context=reducer.origin)


def _release(reducer: ACPReducer, step_ahead: StepAhead) -> None:
    """Remove the gradient hooks and the forward pre-hook for good."""
    reducer.remove_hooks()
    step_ahead.close()


# ---------------------------------------------------------------- arguments
@dataclasses.dataclass(frozen=True)
class _Arguments:
    """The arguments, Horovod's and the front end's own, that shape the fused
    buffers and what goes into them."""

    backward_passes_per_step: int
    fusion_threshold_bytes: int
    gradient_predivide_factor: float
    num_groups: int
    groups: Optional[Sequence[Sequence[torch.Tensor]]]
    sparse_as_dense: bool
    overlap: bool

    def check(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the first bad one."""
        if not is_int(self.backward_passes_per_step) or self.backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be a positive int, got "
                             f"{self.backward_passes_per_step!r}")
        if not is_int(self.fusion_threshold_bytes) or self.fusion_threshold_bytes < 0:
            raise ValueError("fusion_threshold_bytes must be an int >= 0, got "
                             f"{self.fusion_threshold_bytes!r}")
        factor = self.gradient_predivide_factor
        if not isinstance(factor, numbers.Real) or factor <= 0:
            raise ValueError(f"gradient_predivide_factor must be a number > 0, got {factor!r}")
        if not is_int(self.num_groups) or self.num_groups < 0:
            raise ValueError(f"num_groups must be an int >= 0, got {self.num_groups!r}")
        if self.num_groups and self.groups is not None:
            raise ValueError("num_groups and groups cannot both be set")
        for name in ("sparse_as_dense", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def fusion_groups(self, named) -> Optional[List[List[str]]]:
        """The explicit fusion groups as lists of names (None: plan by threshold)."""
        if self.groups is not None:
            by_param = {p: n for n, p in named}
            in_groups = [p for g in self.groups for p in g]
            if (any(p not in by_param for p in in_groups)
                    or len(set(in_groups)) != len(in_groups)):
                raise ValueError("groups must be disjoint lists of the optimizer's parameters")
            return [[by_param[p] for p in g] for g in self.groups]
        if self.num_groups:
            ordered = [n for n, p in named if _can_have_grad(p)]
            size = -(-len(ordered) // self.num_groups)
            return [ordered[i:i + size] for i in range(0, len(ordered), size)]
        return None

    def facts(self, settings: Settings, named, fusion_groups, comm: Communicator) -> dict:
        """What every rank must have equal: every setting that changes what is
        sent or how it is named (``overlap`` only changes when), the
        backend's wire settings, and the parameters."""
        return dict(settings.facts(),
                    fusion_threshold_bytes=self.fusion_threshold_bytes,
                    backward_passes_per_step=self.backward_passes_per_step,
                    num_groups=self.num_groups, groups=fusion_groups,
                    sparse_as_dense=self.sparse_as_dense,
                    gradient_predivide_factor=self.gradient_predivide_factor,
                    **comm.wire_settings(),
                    parameters=[(n, tuple(p.shape), str(p.dtype)) for n, p in named])


def _can_have_grad(param: torch.Tensor) -> bool:
    """Only floating-point (and complex) tensors can require a gradient in torch."""
    return param.is_floating_point() or param.is_complex()


def _different_states(rank: int, gathered) -> RuntimeError:
    described = "; ".join(f"rank {r} at step {entry['facts']['step_count']} ({entry['context']})"
                          for r, entry in enumerate(gathered))
    return RuntimeError(
        "hvd_acp: the ranks start training from different compression states: "
        f"{described}. A checkpoint was loaded on some ranks only. Load it on every "
        "rank, or load it on the root rank and then call "
        "hvd.broadcast_optimizer_state(optimizer, root_rank=0) on every rank, as "
        "Horovod's examples do")
