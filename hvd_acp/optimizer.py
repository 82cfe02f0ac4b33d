"""The public optimizer: glue between a torch optimizer and the reducer.

:class:`DistributedOptimizer` checks its arguments (the same error on every
rank), builds the :class:`~hvd_acp.reducer.ACPReducer` and the step-ahead
shift, forwards the torch optimizer's attributes, and keeps Horovod's
contract: ``step``, ``synchronize``, ``skip_synchronize``, checkpoints, and
``hvd.broadcast_optimizer_state`` (whose needs are met in
:mod:`.horovod_broadcast`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import numbers
import os
import warnings
import weakref
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .agreement import agree, describe_differences
from .comm import CommStats, Communicator, HorovodCommunicator
from .fusion import DEFAULT_FUSION_THRESHOLD_BYTES
from .horovod_broadcast import (STATE_KEY, LocalStep, add_broadcast_entry,
                                called_by_broadcast_optimizer_state, pass_as_horovod_optimizer)
from .reducer import ACPReducer
from .settings import Settings, is_int
from .stepahead import StepAhead

logger = logging.getLogger(__name__)


class DistributedOptimizer(LocalStep):
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

    ACP-SGD's own settings (keyword only; ``None`` takes the library's
    default, see :class:`hvd_acp.Settings`, which says what to tune), by
    name or as one ``settings=hvd_acp.Settings(...)`` (the names given win):

    Args:
        settings: an :class:`hvd_acp.Settings` (its ``fp16_wire`` is
            Horovod's ``compression`` here).
        matrix_rank: rank r of the factors P (n, r) and Q (m, r); or
            ``"auto"`` (an :class:`~hvd_acp.AutoRank`) for a rank per tensor.
        min_compression_rate: a matrix is compressed only if that sends at
            least this many times fewer elements.
        warmup_steps: steps of exact averaging before ACP-SGD starts.
        seed: seed of the initial factors, identical on every rank.
        step_ahead: step-ahead error feedback (0 switches it off). The
            parameters hold the true weights between ``step()`` and the next
            training forward pass (:meth:`true_weights` in between).
        both_factors: send both factors every step, each on the other's
            previous basis, in one all-reduce (default: for adaptive
            optimizers); see :class:`hvd_acp.Settings`.
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
    #: Factors on the wire per step (one: P or Q), for the default rank.
    factors_per_step = 1

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                 compression=None, backward_passes_per_step: int = 1, op=None,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: Optional[Sequence[Sequence[torch.Tensor]]] = None,
                 sparse_as_dense: bool = False, process_set=None, *,
                 settings: Optional[Settings] = None,
                 matrix_rank=None, min_compression_rate: Optional[float] = None,
                 warmup_steps: Optional[int] = None, seed: Optional[int] = None,
                 step_ahead: Optional[float] = None, both_factors: Optional[bool] = None,
                 fusion_threshold_bytes: int = DEFAULT_FUSION_THRESHOLD_BYTES,
                 overlap: bool = True, diagnostics: bool = False,
                 communicator: Optional[Communicator] = None):
        self._wrap(optimizer)
        args = _Arguments(backward_passes_per_step, fusion_threshold_bytes,
                          gradient_predivide_factor, num_groups, groups, sparse_as_dense, overlap)
        error, settings, named, fusion_groups = None, None, [], None
        try:
            if communicator is None:
                HorovodCommunicator.check_arguments(op, gradient_predivide_factor, compression)
            settings = Settings.of(
                settings, matrix_rank=matrix_rank, min_compression_rate=min_compression_rate,
                warmup_steps=warmup_steps, seed=seed, step_ahead=step_ahead,
                fp16_wire=HorovodCommunicator.fp16_wire_of(compression), both_factors=both_factors,
            ).resolve(optimizer, factors_per_step=self.factors_per_step)
            args.check()
            named = _named_parameters(optimizer, named_parameters)
            fusion_groups = args.fusion_groups(named)
        except (ValueError, TypeError, NotImplementedError) as exc:
            error = exc
        if communicator is None:
            communicator = HorovodCommunicator(op, gradient_predivide_factor, process_set,
                                               fp16_wire=bool(settings and settings.fp16_wire))
        self._comm = communicator
        # Elastic jobs skip the collectives: a worker that joins later builds
        # its optimizer while the others are inside Horovod's state sync, and
        # is checked against rank 0's state in sync_compression_state().
        elastic = (isinstance(communicator, HorovodCommunicator)
                   and os.environ.get("HOROVOD_ELASTIC") == "1")
        self._agree_on_arguments(error, elastic, lambda: args.facts(
            settings, named, fusion_groups, communicator))
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
            on_first_round=None if elastic else functools.partial(
                _agree_on_state, self._comm, self.name_prefix))
        self._settings = settings
        self._step_ahead = StepAhead(self._reducer.state, self._reducer.params, self._optimizer,
                                     settings.step_ahead, share=self._reducer.share,
                                     included=self._reducer.included)
        self.backward_passes_per_step = args.backward_passes_per_step
        self._synchronized = False
        self._should_synchronize = True
        self._state_initialized_by_broadcast = False
        # The hooks die with the optimizer, so a model can be wrapped again
        # once the previous optimizer is gone (or closed).
        self._finalizer = weakref.finalize(self, _release, self._reducer, self._step_ahead)
        for _, param in trained:
            param._hvd_acp_owner = weakref.ref(self)
        if isinstance(self._comm, HorovodCommunicator):
            from .elastic import register_elastic_handler
            register_elastic_handler(DistributedOptimizer)

    def _wrap(self, optimizer: torch.optim.Optimizer) -> None:
        """Hold ``optimizer``, whose ``param_groups``, ``state`` and ``defaults``
        are forwarded (properties below): Optimizer.__init__ is not run."""
        torch._C._log_api_usage_once("hvd_acp.DistributedOptimizer")
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                      "load_state_dict_pre", "load_state_dict_post"):
            setattr(self, f"_optimizer_{hooks}_hooks", OrderedDict())
        self._optimizer = optimizer
        pass_as_horovod_optimizer(self)

    # ------------------------------------------------------------ agreement
    def _agree_on_arguments(self, error: Optional[Exception], elastic: bool, facts) -> None:
        """Raise on every rank, or on none: a rank that raises alone leaves the
        others waiting in their first all-reduce, and ranks whose settings or
        models differ send other payloads under other names. ``facts()`` is
        what must be equal (every setting that changes what is sent or how it
        is named, and the parameters). A rank outside the process set
        communicates with no one: its errors are its own."""
        comm = self._comm
        if elastic or not comm.included() or comm.size() == 1:
            if error is not None:
                raise error
            return
        agree(lambda obj: comm.allgather_object(obj, name="hvd_acp.validate"),
              facts() if error is None else {}, error=error, rank=comm.rank(),
              explain=_describe_mismatch)

    # --------------------------------------------- forwarding to the wrapped one
    @property
    def param_groups(self) -> List[dict]:
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self):
        return self._optimizer.state

    @state.setter
    def state(self, value) -> None:
        self._optimizer.state = value

    @property
    def defaults(self) -> dict:
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value) -> None:
        self._optimizer.defaults = value

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer."""
        return self._optimizer

    def __getstate__(self):
        raise TypeError("hvd_acp.DistributedOptimizer holds gradient hooks and Horovod "
                        "handles and cannot be pickled; save state_dict() instead")

    def __repr__(self) -> str:
        return f"hvd_acp.DistributedOptimizer({self._optimizer!r})"

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError(
            "add_param_group() after wrapping is not supported: add the group to the "
            "torch optimizer before creating hvd_acp.DistributedOptimizer")

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
    def comm_stats(self) -> CommStats:
        """Counters of all-reduces and bytes this rank has submitted."""
        return self._comm.stats

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

    @property
    def parameter_names(self) -> Dict[torch.Tensor, str]:
        """The name of every parameter of the wrapped optimizer, identical on every rank.

        The given ``named_parameters`` or the generated
        ``allreduce.noname.{group}.{index}``; the same mapping as Horovod's
        ``optimizer._parameter_names`` (a copy).
        """
        return dict(self._parameter_names)

    def close(self) -> None:
        """Remove the gradient hooks; the parameters may then be wrapped again."""
        self._finalizer()
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

    def step(self, closure=None):
        """Synchronize (unless already done or skipped), update, next phase."""
        if called_by_broadcast_optimizer_state():
            # Its state initialization, run on some ranks only (a subclass
            # is reached here through super(type(opt), opt).step()).
            return LocalStep.step(self, closure)
        if closure is not None:
            raise NotImplementedError(
                "step(closure) is not supported: a closure re-runs backward, which would "
                "start a second compressed all-reduce in the same step")
        if self._should_synchronize:
            if self._synchronized:
                # Horovod's warning, which tests in the wild look for: the
                # pattern usually means skip_synchronize() was forgotten.
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). hvd.DistributedOptimizer "
                              "would all-reduce again here; use `with "
                              "optimizer.skip_synchronize(): optimizer.step()` after "
                              "optimizer.synchronize().", UserWarning, stacklevel=2)
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

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict plus an ``"hvd_acp"`` section.

        The extra section (phase, step count, factors and this rank's error
        feedback, keyed by parameter name, with the saving rank) is ignored
        by a plain torch optimizer's ``load_state_dict``.

        ``hvd.broadcast_optimizer_state`` gets a view that carries the
        compression state among the optimizer state it broadcasts, so that
        every rank leaves it with the root's step count, phase and factors
        (see :meth:`_adopt_broadcast`).
        """
        state = self._optimizer.state_dict()
        if called_by_broadcast_optimizer_state():
            # While the wrapped state is empty, Horovod first initializes it
            # with a local step on the ranks that have none, then asks again;
            # the entry joins in once there is state to broadcast, or once
            # that step shows the optimizer keeps none, so that every rank
            # broadcasts the same entries.
            if state["state"] or self._state_initialized_by_broadcast:
                self._state_initialized_by_broadcast = False
                add_broadcast_entry(state, {"rank": self._comm.rank(),
                                            "state": self._reducer.state_dict(with_error=False)},
                                    self._adopt_broadcast)
            return state
        state[STATE_KEY] = self._reducer.state_dict()
        return state

    def _adopt_broadcast(self, value: dict) -> None:
        """Take the root's compression state from ``hvd.broadcast_optimizer_state``.

        Every rank leaves with the root's step count (hence phase and warm-up
        position) and factors. The root keeps its residual; the other ranks
        start theirs from zero: a residual is one rank's unsent gradient, and
        the others' were not in the root's checkpoint.
        """
        if not self._comm.included() or value["rank"] == self._comm.rank():
            return
        self._step_ahead.restore(warn=False)
        self._reducer.load_state_dict(value["state"], reset_error_feedback=True)
        self._step_ahead.after_step()

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
        state_dict = dict(state_dict)
        acp_state = state_dict.pop(STATE_KEY, None)
        if acp_state is not None:       # before anything is loaded: all or nothing
            self._reducer.state.check_state_dict(acp_state)
        self._step_ahead.restore(warn=False)
        self._optimizer.load_state_dict(state_dict)
        if acp_state is not None:
            self._reducer.load_state_dict(acp_state, reset_error_feedback)
        elif reset_error_feedback:
            self._reducer.state.reset_error_feedback()
        self._step_ahead.after_step()


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


def _named_parameters(optimizer, named_parameters) -> List[Tuple[str, torch.Tensor]]:
    """(name, param) for every parameter of ``optimizer``, in its order; raises
    for a bad optimizer, names or parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, DistributedOptimizer):
        raise TypeError("optimizer is already an hvd_acp.DistributedOptimizer")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        named = [(f"allreduce.noname.{i}.{j}", p)
                 for i, group in enumerate(optimizer.param_groups)
                 for j, p in enumerate(group["params"])]
    else:
        named = list(named_parameters)
        if any(not isinstance(t, tuple) or len(t) != 2 for t in named):
            raise ValueError("named_parameters should be a sequence of (name, parameter) "
                             "tuples, usually model.named_parameters()")
        names = [n for n, _ in named]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"Parameter names in named_parameters must be unique; "
                             f"duplicated: {duplicates}")
        by_param = {p: n for n, p in named}
        unnamed = [i for i, p in enumerate(params) if p not in by_param]
        if unnamed:
            raise ValueError(
                "named_parameters was specified, but one or more model parameters were "
                f"not named (positions {unnamed} in the optimizer's param_groups)")
        named = [(by_param[p], p) for p in params]
    seen = set()
    for name, p in named:
        owner = getattr(p, "_hvd_acp_owner", lambda: None)()
        if owner is not None:
            raise ValueError(
                f"parameter {name!r} is already handled by another hvd_acp optimizer; "
                "a parameter can belong to one DistributedOptimizer only (close() the "
                "previous one before wrapping the parameters again)")
        if p in seen:
            raise ValueError(f"parameter {name!r} appears twice in the optimizer's param_groups")
        seen.add(p)
        if p.is_complex():
            raise TypeError(f"parameter {name!r} has dtype {p.dtype}; only floating-point "
                            "parameters can be trained")
    devices = {p.device for _, p in named if _can_have_grad(p)}
    if len(devices) > 1:
        raise NotImplementedError(
            f"parameters on several devices ({sorted(map(str, devices))}) are not "
            "supported: wrap each device's parameters in its own DistributedOptimizer")
    return named


def _can_have_grad(param: torch.Tensor) -> bool:
    """Only floating-point (and complex) tensors can require a gradient in torch."""
    return param.is_floating_point() or param.is_complex()


def _describe_mismatch(rank: int, gathered) -> ValueError:
    reference, other = gathered[0]["facts"], gathered[rank]["facts"]
    ref_settings = {k: v for k, v in reference.items() if k != "parameters"}
    settings = {k: v for k, v in other.items() if k != "parameters"}
    if ref_settings != settings:
        return ValueError("hvd_acp settings differ between ranks: "
                          f"{describe_differences(ref_settings, settings, rank)}; pass the same "
                          "arguments on every rank")
    ref_map = {n: s for n, *s in reference["parameters"]}
    other_map = {n: s for n, *s in other["parameters"]}
    for name in sorted(set(ref_map) | set(other_map)):
        if ref_map.get(name) != other_map.get(name):
            return ValueError(f"the model differs between ranks: parameter {name!r} is "
                              f"{ref_map.get(name, 'missing')} on rank 0 and "
                              f"{other_map.get(name, 'missing')} on rank {rank}")
    return ValueError(f"parameter order differs between rank 0 and rank {rank}")


def _agree_on_state(comm: Communicator, prefix: str, reducer: ACPReducer) -> None:
    """At the first step: every rank starts from the same compression state,
    or all raise (a checkpoint loaded on some ranks only would leave them in
    phases whose all-reduces never match)."""
    step_count, factor_sum = reducer.state.fingerprint()
    agree(lambda obj: comm.allgather_object(obj, name=f"{prefix}.first_step"),
          {"step_count": step_count, "factor_sum": factor_sum}, context=reducer.origin,
          explain=_different_states)


def _different_states(rank: int, gathered) -> RuntimeError:
    described = "; ".join(f"rank {r} at step {entry['facts']['step_count']} ({entry['context']})"
                          for r, entry in enumerate(gathered))
    return RuntimeError(
        "hvd_acp: the ranks start training from different compression states: "
        f"{described}. A checkpoint was loaded on some ranks only. Load it on every "
        "rank, or load it on the root rank and then call "
        "hvd.broadcast_optimizer_state(optimizer, root_rank=0) on every rank, as "
        "Horovod's examples do")
