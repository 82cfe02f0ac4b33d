"""What the two baselines share: a wrapper by composition with Horovod's contract.

:class:`BaselineOptimizer` holds the user's torch optimizer (its
``param_groups``, ``state`` and ``defaults`` are forwarded, so LR schedulers
work), checks its arguments with the same error on every rank, checks at its
first step that every rank starts from the same weights and state, and meets
``hvd.broadcast_optimizer_state`` as :class:`hvd_acp.DistributedOptimizer`
does (:mod:`hvd_acp.horovod_broadcast`). A subclass says what it agrees on
and what one step does.

Unlike S-SGD these methods average no gradient: ``synchronize()``
communicates nothing and leaves each rank's own gradient in ``p.grad`` (so
that clipping between ``synchronize()`` and ``step()`` clips the local
gradient, as every worker clips its own in both papers), and all of a
step's communication happens in ``step()``. What every rank must still know
before it steps, whether any rank's gradients overflowed (a ``GradScaler``
then skips the step), the ranks agree on at the end of backward
(:class:`OverflowAgreement`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import weakref
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch.autograd import Variable

from ..agreement import agree, describe_differences
from ..comm import CommStats, Communicator, HorovodCommunicator
from ..horovod_broadcast import LocalStep, called_by_broadcast_optimizer_state
from ..horovod_broadcast import pass_as_horovod_optimizer
from ..optimizer import _named_parameters

__all__ = ["BaselineOptimizer", "OverflowAgreement"]


def _forwarded(name: str) -> property:
    """The wrapped optimizer's attribute ``name``, read and written through."""
    return property(lambda self: getattr(self._optimizer, name),
                    lambda self, value: setattr(self._optimizer, name, value),
                    doc=f"The wrapped optimizer's ``{name}``.")


def weights_fingerprint(tensors: Iterable[torch.Tensor]) -> float:
    """One number that differs between ranks whose ``tensors`` differ (almost
    surely): the sum of every element, in float64, in a fixed order."""
    return float(sum(t.detach().double().sum() for t in tensors))


class OverflowAgreement:
    """Every rank learns of an overflow on any rank before anyone steps.

    ``GradScaler`` skips ``optimizer.step()`` on a rank whose gradients hold
    inf or NaN. The baselines communicate inside ``step()``, so a rank that
    skipped alone would leave the others waiting in a collective it never
    joins (the pattern of pytorch/pytorch#76282). At the end of each backward
    pass that reaches the parameters the ranks agree, in one blocking
    1-element all-reduce, whether any rank's gradients are non-finite; where
    one rank's are, every rank's gradients are made NaN, so every rank's
    scaler skips the step and backs off alike (and without a scaler every
    replica sees the same non-finite update). Every rank must run as many
    backward passes reaching the parameters, as with Horovod's own optimizer.

    Cost per backward pass: a sum over the gradients and a 4-byte all-reduce,
    a control message that ``comm_stats`` does not count.

    Args:
        params: the parameters whose gradients the method steps on.
        comm: the method's communicator.
        name: the all-reduce's name, the same on every rank.

    Attributes:
        overflows: backward passes after which some rank's gradients were
            non-finite.
    """

    def __init__(self, params: List[torch.Tensor], comm: Communicator, name: str) -> None:
        self._params = [p for p in params if p.requires_grad]
        self._comm, self._name = comm, name
        self._queued = False
        self.overflows = 0
        ref = weakref.ref(self)

        def on_gradient(param):
            this = ref()
            if this is not None and not this._queued:
                this._queued = True
                Variable._execution_engine.queue_callback(this._agree)

        self._handles = [p.register_post_accumulate_grad_hook(on_gradient)
                         for p in self._params]

    def _agree(self) -> None:
        """At the end of backward: agree, and poison every gradient if any
        rank's overflowed."""
        self._queued = False
        grads = [p.grad for p in self._params if p.grad is not None]
        values = [g.coalesce().values() if g.is_sparse else g for g in grads]
        total = (float(torch.stack([torch.sum(v, dtype=torch.float64) for v in values]).sum())
                 if values else 0.0)
        if self._comm.any_rank(not math.isfinite(total), self._name):
            self.overflows += 1
            for grad in values:
                grad.fill_(float("nan"))

    def remove(self) -> None:
        """Remove the gradient hooks for good."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class BaselineOptimizer(LocalStep):
    """A torch optimizer wrapped for one of the baselines (subclasses only).

    Args:
        optimizer: the torch optimizer to wrap.
        named_parameters: ``(name, parameter)`` for every parameter of
            ``optimizer``, the same names on every rank (default: Horovod's
            ``allreduce.noname.{group}.{index}``).
        settings: the subclass's resolved settings (a dataclass), or the
            error resolving them raised.
        communicator: a :class:`~hvd_acp.comm.Communicator`; defaults to
            Horovod's. Tests pass a ``LocalCommunicator``.
    """

    #: The method's key in :mod:`hvd_acp.methods`, and the prefix of its
    #: collectives' names and of its section of the state dict.
    key = "baseline"

    param_groups = _forwarded("param_groups")
    state = _forwarded("state")
    defaults = _forwarded("defaults")

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]],
                 settings: Any, communicator: Optional[Communicator]) -> None:
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                      "load_state_dict_pre", "load_state_dict_post"):
            setattr(self, f"_optimizer_{hooks}_hooks", OrderedDict())
        self._optimizer = optimizer
        pass_as_horovod_optimizer(self)
        error = settings if isinstance(settings, Exception) else None
        named: List[Tuple[str, torch.Tensor]] = []
        if error is None:
            try:
                named = _named_parameters(optimizer, named_parameters)
            except (ValueError, TypeError, NotImplementedError) as exc:
                error = exc
        self._comm = HorovodCommunicator() if communicator is None else communicator
        self._agree_on_arguments(error, lambda: {
            "method": self.key, **dataclasses.asdict(settings), **self._comm.wire_settings(),
            "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in named]})
        self.settings = settings
        #: (name, parameter) of every parameter that can have a gradient, in
        #: the optimizer's order: the same on every rank.
        self.named_params: List[Tuple[str, torch.Tensor]] = [
            (n, p) for n, p in named if p.requires_grad and p.is_floating_point()]
        self._parameter_names = {p: n for n, p in named}
        #: Optimizer steps taken (communication rounds for DeMo).
        self.step_count = 0
        #: Agrees on overflows at the end of backward (several ranks only).
        self.overflow = (OverflowAgreement([p for _, p in self.named_params], self._comm,
                                           f"hvd_acp.{self.key}.overflow")
                         if self._comm.size() > 1 else None)
        self._finalizer = (weakref.finalize(self, self.overflow.remove)
                           if self.overflow is not None else None)
        #: Seconds of the method's maths (transforms, selection, outer step).
        self.compression_seconds = 0.0
        self._checked = False

    # -------------------------------------------------------------- agreement
    def _agree_on_arguments(self, error: Optional[Exception], facts) -> None:
        """The same error on every rank, or none: settings, backend and
        parameters must be equal (they decide what is sent and its names)."""
        comm = self._comm
        if comm.size() == 1:
            if error is not None:
                raise error
            return
        agree(lambda obj: comm.allgather_object(obj, name=f"hvd_acp.{self.key}.validate"),
              facts() if error is None else {}, error=error, rank=comm.rank(),
              explain=self._describe_mismatch)

    def _describe_mismatch(self, rank: int, gathered) -> ValueError:
        reference, other = gathered[0]["facts"], gathered[rank]["facts"]
        return ValueError(f"{type(self).__name__}: settings or parameters differ between ranks: "
                          f"{describe_differences(reference, other, rank)}; pass the same "
                          "model and arguments on every rank")

    def _start_facts(self) -> Dict[str, Any]:
        """What every rank must hold equal when it starts training (subclasses)."""
        return {"step_count": self.step_count}

    def _check_start(self) -> None:
        """At the first step (and the first after a checkpoint is loaded):
        every rank starts from the same weights and state, or all raise (a
        rank that skipped ``hvd.broadcast_parameters``, or a checkpoint loaded
        on some ranks only, would never agree again)."""
        self._checked = True
        if self._comm.size() == 1:
            return

        def explain(rank: int, gathered) -> RuntimeError:
            return RuntimeError(
                f"{type(self).__name__}: the ranks start from different weights or state "
                f"({describe_differences(gathered[0]['facts'], gathered[rank]['facts'], rank)}). "
                "Call hvd.broadcast_parameters(model.state_dict(), root_rank=0) on every rank "
                "before training, and load a checkpoint on every rank")
        agree(lambda obj: self._comm.allgather_object(obj, name=f"hvd_acp.{self.key}.start"),
              self._start_facts(), explain=explain, rank=self._comm.rank())

    # ---------------------------------------------------------- the contract
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer."""
        return self._optimizer

    @property
    def comm_stats(self) -> CommStats:
        """Collectives launched and bytes sent and received by this rank."""
        return self._comm.stats

    @property
    def parameter_names(self) -> Dict[torch.Tensor, str]:
        """The name of every parameter of the wrapped optimizer (a copy)."""
        return dict(self._parameter_names)

    def __repr__(self) -> str:
        return f"hvd_acp.{type(self).__name__}({self._optimizer!r})"

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError(
            "add_param_group() after wrapping is not supported: add the group to the "
            f"torch optimizer before creating {type(self).__name__}")

    def close(self) -> None:
        """Remove the gradient hooks (the overflow agreement) for good."""
        if self._finalizer is not None:
            self._finalizer()

    def synchronize(self) -> None:
        """Horovod's ``synchronize()``: nothing to wait for. ``p.grad`` holds
        this rank's own gradient; the method communicates in ``step()``."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Horovod's context; ``step()`` never synchronizes gradients here."""
        yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """One optimizer step of the method (a collective where it communicates)."""
        if called_by_broadcast_optimizer_state():
            return self._initialization_step(closure)
        if closure is not None:
            raise NotImplementedError(f"step(closure) is not supported by {type(self).__name__}")
        if not self._checked:
            self._check_start()
        result = self._step()
        self.step_count += 1
        return result

    def _initialization_step(self, closure):
        """``hvd.broadcast_optimizer_state``'s step that creates the wrapped
        optimizer's state, without communication and without moving the weights."""
        return LocalStep.step(self, closure)

    def _step(self):
        raise NotImplementedError

    def _timed(self, started: float) -> None:
        self.compression_seconds += time.perf_counter() - started

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict plus this method's section
        (``"hvd_acp.<key>"``), which a plain torch optimizer ignores."""
        state = self._optimizer.state_dict()
        if not called_by_broadcast_optimizer_state():
            state[f"hvd_acp.{self.key}"] = dict(self._method_state(), step_count=self.step_count)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this class (or of the plain wrapped optimizer,
        leaving the method's own state as it is). Load on every rank: the
        next step checks that the ranks agree."""
        state_dict = dict(state_dict)
        section = state_dict.pop(f"hvd_acp.{self.key}", None)
        self._optimizer.load_state_dict(state_dict)
        if section is not None:
            section = dict(section)
            self.step_count = int(section.pop("step_count"))
            self._load_method_state(section)
        self._checked = False

    def _method_state(self) -> dict:
        raise NotImplementedError

    def _load_method_state(self, state: dict) -> None:
        raise NotImplementedError
