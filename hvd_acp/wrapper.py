"""A torch optimizer held by composition, with Horovod's contract: the base of
every hvd_acp optimizer that runs under Horovod.

:class:`WrappedOptimizer` holds once what ``hvd_acp.DistributedOptimizer``,
``hvd_acp.PowerSGDOptimizer`` and the baselines (``DiLoCoOptimizer``,
``DeMoOptimizer``) share with ``hvd.DistributedOptimizer``'s contract:

- the wrapped optimizer's ``param_groups``, ``state`` and ``defaults``
  forwarded (its existing state kept; LR schedulers and ``GradScaler`` work),
  with the step-hook machinery of ``torch.optim.Optimizer``;
- the parameters' names, Horovod's (``named_parameters``, or
  ``allreduce.noname.{group}.{index}``), checked;
- the arguments every rank must share, checked in one collective before
  anything is built (the same error on every rank, or none);
- ``step()`` (Horovod's state initialization, closures refused),
  ``synchronize()``, ``skip_synchronize()``, ``zero_grad()``;
- the state dict: the wrapped optimizer's plus the method's own section
  (``"hvd_acp"``, ``"hvd_acp.diloco"``, ...), which a plain torch optimizer
  ignores; ``hvd.broadcast_optimizer_state`` broadcasts both
  (:mod:`.horovod_broadcast`).

A subclass says what its arguments are, what one step does (:meth:`_step`)
and what its section holds.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import torch

from .agreement import agree, describe_differences
from .comm import CommStats, Communicator
from .horovod_broadcast import broadcast_call, first_state_dict_of, initialize_state_

__all__ = ["WrappedOptimizer", "named_parameters_of"]


def _forwarded(name: str) -> property:
    """The wrapped optimizer's attribute ``name``, read and written through."""
    return property(lambda self: getattr(self._optimizer, name),
                    lambda self, value: setattr(self._optimizer, name, value),
                    doc=f"The wrapped optimizer's ``{name}``.")


class WrappedOptimizer(torch.optim.Optimizer):
    """A torch optimizer wrapped for a method of training under Horovod (subclasses only).

    ``Optimizer.__init__`` is not run: the wrapper holds no state of its
    own in torch's sense; ``param_groups``, ``state`` and ``defaults`` are the
    wrapped optimizer's objects.
    """

    #: The state dict's section and the first component of the collectives' names.
    section = "hvd_acp"
    #: How messages name this method.
    label = "hvd_acp"

    param_groups = _forwarded("param_groups")
    state = _forwarded("state")
    defaults = _forwarded("defaults")

    def _wrap(self, optimizer: torch.optim.Optimizer, communicator: Communicator) -> None:
        """Hold ``optimizer`` and the communicator; the step-hook machinery of
        torch's optimizers (LR schedulers and GradScaler use it)."""
        torch._C._log_api_usage_once(f"hvd_acp.{type(self).__name__}")
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                      "load_state_dict_pre", "load_state_dict_post"):
            setattr(self, f"_optimizer_{hooks}_hooks", OrderedDict())
        self._optimizer = optimizer
        self._comm = communicator
        #: Horovod's attribute, which user code reads to map parameters to names.
        self._parameter_names: Dict[torch.Tensor, str] = {}
        self._finalizer = None

    # ------------------------------------------------------------ agreement
    def _agree_on_arguments(self, error: Optional[Exception], facts, *,
                            alone: bool = False) -> None:
        """Raise on every rank, or on none: a rank that raises alone leaves the
        others waiting in their first collective, and ranks whose settings or
        models differ send other payloads under other names. ``facts()`` is
        what must be equal (every setting that changes what is sent or how it
        is named, and ``parameters``). ``alone``: this rank checks nothing
        with the others (a world of one, a rank outside the process set, a
        worker joining an elastic job), its errors are its own."""
        comm = self._comm
        if alone or comm.size() == 1:
            if error is not None:
                raise error
            return
        agree(lambda obj: comm.allgather_object(obj, name=f"{self.section}.validate"),
              facts() if error is None else {}, error=error, rank=comm.rank(),
              explain=self._describe_mismatch)

    def _describe_mismatch(self, rank: int, gathered) -> ValueError:
        reference, other = gathered[0]["facts"], gathered[rank]["facts"]
        ref_settings = {k: v for k, v in reference.items() if k != "parameters"}
        settings = {k: v for k, v in other.items() if k != "parameters"}
        if ref_settings != settings:
            return ValueError(f"{self.label} settings differ between ranks: "
                              f"{describe_differences(ref_settings, settings, rank)}; pass "
                              "the same model and arguments on every rank")
        ref_map = {n: s for n, *s in reference["parameters"]}
        other_map = {n: s for n, *s in other["parameters"]}
        for name in sorted(set(ref_map) | set(other_map)):
            if ref_map.get(name) != other_map.get(name):
                return ValueError(f"the model differs between ranks: parameter {name!r} is "
                                  f"{ref_map.get(name, 'missing')} on rank 0 and "
                                  f"{other_map.get(name, 'missing')} on rank {rank}")
        return ValueError(f"parameter order differs between rank 0 and rank {rank}")

    def _agree_on_start(self, facts: Dict[str, Any], explain, context: Any = None) -> None:
        """At the first step: every rank starts from the same state (``facts``:
        step counts, fingerprints), or every rank raises ``explain(rank,
        gathered)`` (a checkpoint loaded on some ranks only, a rank that
        skipped ``hvd.broadcast_parameters``, would never agree again)."""
        comm = self._comm
        if comm.size() == 1:
            return
        agree(lambda obj: comm.allgather_object(obj, name=f"{self.section}.first_step"),
              facts, explain=explain, rank=comm.rank(), context=context)

    # --------------------------------------------- forwarding to the wrapped one
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer."""
        return self._optimizer

    @property
    def comm_stats(self) -> CommStats:
        """Counters of the collectives this rank launched and their bytes."""
        return self._comm.stats

    @property
    def parameter_names(self) -> Dict[torch.Tensor, str]:
        """The name of every parameter of the wrapped optimizer, identical on every rank.

        The given ``named_parameters`` or the generated
        ``allreduce.noname.{group}.{index}``; the same mapping as Horovod's
        ``optimizer._parameter_names`` (a copy).
        """
        return dict(self._parameter_names)

    def __getstate__(self):
        raise TypeError(f"hvd_acp.{type(self).__name__} holds gradient hooks and Horovod "
                        "handles and cannot be pickled; save state_dict() instead")

    def __repr__(self) -> str:
        return f"hvd_acp.{type(self).__name__}({self._optimizer!r})"

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError(
            "add_param_group() after wrapping is not supported: add the group to the "
            f"torch optimizer before creating hvd_acp.{type(self).__name__}")

    def close(self) -> None:
        """Remove the wrapper's hooks for good."""
        if self._finalizer is not None:
            self._finalizer()

    # ------------------------------------------------------------ the contract
    def synchronize(self) -> None:
        """Horovod's ``synchronize()``: after it ``p.grad`` holds the gradient
        the update will use (a method that averages none communicates
        nothing here)."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Within this context ``step()`` does not call ``synchronize()``."""
        yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """One optimizer step of the method (a collective where it communicates).

        Called by ``hvd.broadcast_optimizer_state`` to create a fresh
        optimizer's state (on the ranks that have none), it runs the wrapped
        optimizer alone and leaves the weights as they were.
        """
        if broadcast_call() is not None:
            self.initialize_state()
            return None
        if closure is not None:
            raise NotImplementedError(
                f"step(closure) is not supported by hvd_acp.{type(self).__name__}: a closure "
                "re-runs forward and backward inside the step, after this step's "
                "communication began")
        return self._step()

    def _step(self):
        raise NotImplementedError

    def initialize_state(self) -> None:
        """Create the wrapped optimizer's state without communicating or moving
        the weights (:func:`.horovod_broadcast.initialize_state_`)."""
        initialize_state_(self._optimizer)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict plus this method's section
        (:attr:`section`), which a plain torch optimizer ignores.

        Under ``hvd.broadcast_optimizer_state`` the section does not go into
        the state dict: the call's first ``state_dict()`` broadcasts it
        from the call's root rank (:meth:`broadcast_section`), and the
        function broadcasts the wrapped optimizer's state.
        """
        call = broadcast_call()
        if call is not None:
            if first_state_dict_of(call):
                self.broadcast_section(call.f_locals["root_rank"])
            return self._optimizer.state_dict()
        state = self._optimizer.state_dict()
        state[self.section] = self._section_state()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this class, or of the plain wrapped optimizer
        (the method's own state is then left as it is). The section is
        checked before anything is loaded: all or nothing."""
        state_dict = dict(state_dict)
        section = state_dict.pop(self.section, None)
        if section is not None:
            self._check_section(section)
        self._before_load()
        self._optimizer.load_state_dict(state_dict)
        if section is not None:
            self._load_section(section)
        self._after_load()

    def broadcast_section(self, root_rank: int) -> None:
        """Make every rank's section ``root_rank``'s (a collective): the root's
        state without its residuals, which stay each rank's own (the root
        keeps its own, the others start theirs from zero)."""
        comm = self._comm
        if comm.size() == 1:
            return
        section = comm.broadcast_object(self._section_state(for_broadcast=True)
                                        if comm.rank() == root_rank else None, root_rank,
                                        name=f"{self.section}.broadcast")
        if comm.rank() != root_rank:
            self._before_load()
            self._load_section(section, from_broadcast=True)
            self._after_load()

    def _section_state(self, for_broadcast: bool = False) -> dict:
        raise NotImplementedError

    def _check_section(self, section: dict) -> None:
        """Raise ``ValueError`` unless :meth:`_load_section` can load ``section``."""

    def _load_section(self, section: dict, from_broadcast: bool = False) -> None:
        raise NotImplementedError

    def _before_load(self) -> None:
        """Before anything is loaded into the wrapped optimizer or the section."""

    def _after_load(self) -> None:
        """Once the wrapped optimizer and the section are loaded."""


def named_parameters_of(optimizer, named_parameters) -> List[Tuple[str, torch.Tensor]]:
    """(name, param) for every parameter of ``optimizer``, in its order; raises
    for a bad optimizer, names or parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, WrappedOptimizer):
        raise TypeError(f"optimizer is already an hvd_acp.{type(optimizer).__name__}")
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
    devices = {p.device for _, p in named if p.is_floating_point()}
    if len(devices) > 1:
        raise NotImplementedError(
            f"parameters on several devices ({sorted(map(str, devices))}) are not "
            "supported: wrap each device's parameters in its own DistributedOptimizer")
    return named
