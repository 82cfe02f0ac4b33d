"""The public optimizer: glue between a torch optimizer and the reducer."""
from __future__ import annotations

import contextlib
import logging
import numbers
import os
import sys
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .comm import CommStats, Communicator, HorovodCommunicator
from .reducer import ACPReducer
from .state import check_compression_settings, describe_differences, is_int
from .stepahead import DEFAULT_STEP_AHEAD, StepAhead, check_step_ahead

logger = logging.getLogger(__name__)

DEFAULT_FUSION_THRESHOLD_BYTES = 25 * 1024 * 1024
STATE_KEY = "hvd_acp"


def _called_by_broadcast_optimizer_state() -> bool:
    """Whether Horovod's ``broadcast_optimizer_state`` is on the call stack, a
    few frames up (it calls ``state_dict()`` and ``step()`` of the optimizer)."""
    functions = sys.modules.get("horovod.torch.functions")
    target = getattr(getattr(functions, "broadcast_optimizer_state", None), "__code__", None)
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None or target is None:
            return False
        if frame.f_code is target:
            return True
        frame = frame.f_back
    return False


class _BroadcastEntry(dict):
    """The compression state as ``hvd.broadcast_optimizer_state`` sees it.

    That function broadcasts the tensors of every parameter's state and
    pickles the rest from the root rank, then assigns each value back into
    the dict it came from. This entry stands in the optimizer state it is
    given (under a parameter id of its own) with one value, the root's
    compression state; the assignment hands it to the optimizer on every
    rank, which adopts it there and then.
    """

    def __init__(self, optimizer: "DistributedOptimizer", value: dict) -> None:
        super().__init__(state=value)
        self._optimizer = weakref.ref(optimizer)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer._adopt_broadcast(value)


class _LocalStep(torch.optim.Optimizer):
    """Base whose ``step`` runs the wrapped optimizer without communication.

    ``hvd.broadcast_optimizer_state`` initializes a fresh optimizer's state
    with ``super(type(opt), opt).step()`` when ``opt`` is a Horovod
    distributed optimizer, so that no rank starts a collective on its own.
    That step, on zero gradients, exists to create the state; it leaves the
    weights as they were. (With weight decay it would shrink them, on the
    ranks that had no state only: after a resume from rank 0's checkpoint,
    whose weights ``hvd.broadcast_parameters`` had just copied everywhere,
    the replicas would differ for the rest of training.)
    """

    def step(self, closure=None):  # pylint: disable=arguments-differ
        self._state_initialized_by_broadcast = True
        params = [p for group in self.param_groups for p in group["params"]
                  if p.grad is not None]
        if isinstance(self._optimizer, torch.optim.SparseAdam):
            # broadcast_optimizer_state makes the zero gradients of that
            # initialization sparse only where ``isinstance`` shows it a
            # SparseAdam, which a wrapper by composition is not.
            for param in params:
                if not param.grad.is_sparse:
                    param.grad = param.grad.to_sparse()
        with torch.no_grad():
            weights = [param.clone() for param in params]
        result = self._optimizer.step(closure)
        with torch.no_grad():
            for param, weight in zip(params, weights):
                param.copy_(weight)
        return result


class DistributedOptimizer(_LocalStep):
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

    ACP-SGD's own settings (keyword only):

    Args:
        matrix_rank: rank r of the factors P (n, r) and Q (m, r). Higher is
            more accurate and sends more. ``"auto"`` (or an
            :class:`~hvd_acp.AutoRank` to set its energy share and budget)
            chooses a rank per tensor from the averaged gradients at probe
            steps (see :mod:`hvd_acp.autorank` and docs/guide.md); an int
            pins one rank for every tensor.
        fusion_threshold_bytes: the S-SGD fusion threshold the buffers are
            planned from; each buffer's payload is about this times the
            phase's compression ratio. 0 gives one buffer per tensor.
        min_compression_rate: a matrix is compressed only if that sends at
            least this many times fewer elements; others go uncompressed.
        warmup_steps: steps of exact averaging before ACP-SGD starts.
        seed: seed of the initial factors (identical on every rank).
        step_ahead: step-ahead error feedback: each rank computes its next
            gradient this fraction of the way to where its residual ``E``
            will eventually move the weights: at ``w - step_ahead * lr /
            (1 - momentum) * E`` for SGD (``w - step_ahead * lr * E /
            (sqrt(v_hat) + eps)`` for Adam-family optimizers). It keeps
            ACP-SGD stable at the learning rates S-SGD trains at (see
            :mod:`hvd_acp.stepahead` and docs/convergence.md). The parameters
            hold the true weights between ``step()`` and the next training
            forward pass. 0 switches it off.
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

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                 compression=None, backward_passes_per_step: int = 1, op=None,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: Optional[Sequence[Sequence[torch.Tensor]]] = None,
                 sparse_as_dense: bool = False, process_set=None, *,
                 matrix_rank: int = 4,
                 fusion_threshold_bytes: int = DEFAULT_FUSION_THRESHOLD_BYTES,
                 min_compression_rate: float = 2.0, warmup_steps: int = 0, seed: int = 0,
                 step_ahead: float = DEFAULT_STEP_AHEAD, overlap: bool = True,
                 diagnostics: bool = False, communicator: Optional[Communicator] = None):
        # Deliberately not calling Optimizer.__init__: param_groups, state and
        # defaults are forwarded to the wrapped optimizer (properties below).
        torch._C._log_api_usage_once("hvd_acp.DistributedOptimizer")
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._optimizer = optimizer
        # Lets hvd.broadcast_optimizer_state take its communication-free path
        # (see _LocalStep); the class itself keeps its real module.
        self.__dict__["__module__"] = "horovod.torch.optimizer"

        error = None
        try:
            named = _validate(optimizer, named_parameters, compression,
                              backward_passes_per_step, op, gradient_predivide_factor,
                              num_groups, groups, sparse_as_dense, matrix_rank,
                              fusion_threshold_bytes, min_compression_rate, warmup_steps,
                              seed, step_ahead, overlap, communicator)
        except (ValueError, TypeError, NotImplementedError) as exc:
            error, named = exc, []

        if communicator is None:
            communicator = HorovodCommunicator(op, gradient_predivide_factor, process_set,
                                               compression)
        self._comm = communicator
        # Every rank must raise, or none: a rank that raises alone leaves the
        # others waiting in their first all-reduce. Elastic jobs skip this
        # collective: a worker that joins later builds its optimizer while the
        # others are inside Horovod's state sync; it is checked against rank
        # 0's state in sync_compression_state() instead. A rank outside the
        # process set communicates with no one, so its errors are its own.
        elastic = (isinstance(communicator, HorovodCommunicator)
                   and os.environ.get("HOROVOD_ELASTIC") == "1")
        local_only = elastic or not communicator.included()
        if local_only and error is not None:
            raise error
        if not local_only:
            _agree(communicator, error, _signature(
                named, matrix_rank=matrix_rank, fusion_threshold_bytes=fusion_threshold_bytes,
                min_compression_rate=min_compression_rate, warmup_steps=warmup_steps,
                seed=seed, backward_passes_per_step=backward_passes_per_step,
                step_ahead=step_ahead))

        # Horovod's attribute, which user code reads to map names to parameters.
        self._parameter_names = {p: n for n, p in sorted(named, key=lambda pair: pair[0])}
        trained = [(n, p) for n, p in named if _can_have_grad(p)]
        names_by_param = {p: n for n, p in named}
        explicit_groups = None
        if groups is not None:
            explicit_groups = [[names_by_param[p] for p in g] for g in groups]
        elif num_groups:
            ordered = [n for n, _ in trained]
            size = -(-len(ordered) // num_groups)
            explicit_groups = [ordered[i:i + size] for i in range(0, len(ordered), size)]

        self._reducer = self.reducer_class(
            trained, communicator, matrix_rank=matrix_rank,
            fusion_threshold_bytes=fusion_threshold_bytes,
            min_compression_rate=min_compression_rate, warmup_steps=warmup_steps, seed=seed,
            backward_passes_per_step=backward_passes_per_step, groups=explicit_groups,
            sparse_as_dense=sparse_as_dense, name_prefix=self.name_prefix,
            diagnostics=bool(diagnostics), agree_at_first_step=not elastic, overlap=overlap)
        self._state_initialized_by_broadcast = False
        self._step_ahead = StepAhead(self._reducer, optimizer, step_ahead)
        self.backward_passes_per_step = backward_passes_per_step
        self._synchronized = False
        self._should_synchronize = True
        # The hooks die with the optimizer, so a model can be wrapped again
        # once the previous optimizer is gone (or closed).
        self._finalizer = weakref.finalize(self, _release, self._reducer, self._step_ahead)
        for _, param in trained:
            param._hvd_acp_owner = weakref.ref(self)
        if isinstance(communicator, HorovodCommunicator):
            from .elastic import register_elastic_handler
            register_elastic_handler()

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
        if _called_by_broadcast_optimizer_state():
            # Its state initialization, run on some ranks only (a subclass
            # is reached here through super(type(opt), opt).step()).
            return _LocalStep.step(self, closure)
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
        # The update applies to the true weights; the next gradient is taken
        # ahead of them again (see hvd_acp.stepahead).
        self._step_ahead.restore()
        unit = self._reducer.applied_scale()
        result = self._optimizer.step()
        self._step_ahead.after_step(unit)
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
        if _called_by_broadcast_optimizer_state():
            # While the wrapped state is empty, Horovod first initializes it
            # with a local step on the ranks that have none, then asks again;
            # the entry joins in once there is state to broadcast, or once
            # that step shows the optimizer keeps none, so that every rank
            # broadcasts the same entries.
            if state["state"] or self._state_initialized_by_broadcast:
                self._state_initialized_by_broadcast = False
                value = {"rank": self._comm.rank(),
                         "state": self._reducer.state_dict(with_error=False)}
                state["state"][STATE_KEY] = _BroadcastEntry(self, value)
                state["param_groups"][-1]["params"].append(STATE_KEY)
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
            self._reducer.reset_error_feedback()
        self._step_ahead.after_step()


def _release(reducer: ACPReducer, step_ahead: StepAhead) -> None:
    """Remove the gradient hooks and the forward pre-hook for good."""
    reducer.remove_hooks()
    step_ahead.close()


# ---------------------------------------------------------------- validation
def _validate(optimizer, named_parameters, compression, backward_passes_per_step, op,
              gradient_predivide_factor, num_groups, groups, sparse_as_dense, matrix_rank,
              fusion_threshold_bytes, min_compression_rate, warmup_steps, seed,
              step_ahead, overlap, communicator) -> List[Tuple[str, torch.Tensor]]:
    """Check the arguments; returns (name, param) for the optimizer's params."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, DistributedOptimizer):
        raise TypeError("optimizer is already an hvd_acp.DistributedOptimizer")
    check_compression_settings(matrix_rank, min_compression_rate, warmup_steps, seed)
    check_step_ahead(step_ahead)
    if not is_int(backward_passes_per_step) or backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be a positive int, got "
                         f"{backward_passes_per_step!r}")
    if not is_int(fusion_threshold_bytes) or fusion_threshold_bytes < 0:
        raise ValueError("fusion_threshold_bytes must be an int >= 0, got "
                         f"{fusion_threshold_bytes!r}")
    if not isinstance(gradient_predivide_factor, numbers.Real) or gradient_predivide_factor <= 0:
        raise ValueError("gradient_predivide_factor must be a number > 0, got "
                         f"{gradient_predivide_factor!r}")
    if not is_int(num_groups) or num_groups < 0:
        raise ValueError(f"num_groups must be an int >= 0, got {num_groups!r}")
    if num_groups and groups is not None:
        raise ValueError("num_groups and groups cannot both be set")
    if not isinstance(sparse_as_dense, bool):
        raise TypeError(f"sparse_as_dense must be a bool, got {sparse_as_dense!r}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {overlap!r}")
    if communicator is None:
        import horovod.torch as hvd
        if op is not None and op not in (hvd.Average, hvd.Sum):
            if op == hvd.Adasum:
                raise NotImplementedError(
                    "op=hvd.Adasum is not supported by ACP-SGD: Adasum combines full "
                    "gradients pairwise, which low-rank factors cannot reproduce")
            raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")
        if op == hvd.Sum and gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor is only valid with op=hvd.Average")
        if compression is not None and compression not in (hvd.Compression.none,
                                                           hvd.Compression.fp16):
            raise NotImplementedError(f"compression={compression!r} is not supported; use "
                                      "hvd.Compression.none or hvd.Compression.fp16")

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
    if groups is not None:
        in_groups = [p for g in groups for p in g]
        foreign = [i for i, p in enumerate(in_groups) if p not in seen]
        if foreign or len(set(in_groups)) != len(in_groups):
            raise ValueError("groups must be disjoint lists of the optimizer's parameters")
    return named


def _can_have_grad(param: torch.Tensor) -> bool:
    """Only floating-point (and complex) tensors can require a gradient in torch."""
    return param.is_floating_point() or param.is_complex()


def _signature(named, **settings) -> Any:
    return ([(n, tuple(p.shape), str(p.dtype)) for n, p in named], settings)


def _agree(comm: Communicator, error: Optional[Exception], signature: Any) -> None:
    """Raise the same error on every rank if any rank's arguments are bad or differ."""
    if comm.size() == 1:
        if error is not None:
            raise error
        return
    local = None if error is None else (type(error).__name__, str(error))
    gathered = comm.allgather_object((local, signature), name="hvd_acp.validate")
    for rank, (err, _) in enumerate(gathered):
        if err is not None:
            kind = {"ValueError": ValueError, "TypeError": TypeError,
                    "NotImplementedError": NotImplementedError}[err[0]]
            if error is not None and rank == comm.rank():
                raise error
            raise kind(f"on rank {rank}: {err[1]}")
    reference = gathered[0][1]
    for rank, (_, sig) in enumerate(gathered):
        if sig != reference:
            raise ValueError(_describe_mismatch(rank, reference, sig))


def _describe_mismatch(rank: int, reference, other) -> str:
    ref_params, ref_settings = reference
    params, settings = other
    if ref_settings != settings:
        differing = describe_differences(ref_settings, settings, rank)
        return (f"hvd_acp settings differ between ranks: {differing}; pass the same "
                "arguments on every rank")
    ref_map, other_map = dict((n, s) for n, *s in ref_params), dict((n, s) for n, *s in params)
    for name in sorted(set(ref_map) | set(other_map)):
        if ref_map.get(name) != other_map.get(name):
            return (f"the model differs between ranks: parameter {name!r} is "
                    f"{ref_map.get(name, 'missing')} on rank 0 and "
                    f"{other_map.get(name, 'missing')} on rank {rank}")
    return f"parameter order differs between rank 0 and rank {rank}"
