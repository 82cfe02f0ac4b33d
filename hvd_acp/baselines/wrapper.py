"""What the baselines share beyond every wrapper's contract
(:class:`hvd_acp.wrapper.WrappedOptimizer`): the first step's check, the
step count, the overflow agreement; and, for those that step the matrices
themselves and leave the 1-D tensors to the wrapped optimizer (DeMo, TSR),
the gradients they read (:func:`dense_grad`), their state's dtype
(:func:`state_dtype`) and the wrapped optimizer's step without the matrices
(:func:`hidden_grads`).

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
import math
import time
import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch.autograd import Variable

from ..agreement import describe_differences
from ..comm import Communicator, HorovodCommunicator
from ..settings import facts_of
from ..wrapper import WrappedOptimizer, named_parameters_of

__all__ = ["BaselineOptimizer", "OverflowAgreement", "dense_grad", "state_dtype",
           "hidden_grads"]


def weights_fingerprint(tensors: Iterable[torch.Tensor]) -> float:
    """One number that differs between ranks whose ``tensors`` differ (almost
    surely): the sum of every element, in float64, in a fixed order."""
    return float(sum(t.detach().double().sum() for t in tensors))


def state_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype of a method's state of ``param``: the parameter's, at least
    float32 (a decay of 0.999 is lost in half precision)."""
    return torch.promote_types(param.dtype, torch.float32)


def dense_grad(param: torch.Tensor, method: str, zeros: bool = False) -> Optional[torch.Tensor]:
    """The parameter's dense gradient; None (or zeros) where backward gave none.

    Raises:
        NotImplementedError: for a sparse gradient, naming ``method``.
    """
    grad = param.grad
    if grad is None:
        return torch.zeros_like(param) if zeros else None
    if grad.is_sparse:
        raise NotImplementedError(f"sparse gradients are not supported by {method}; use "
                                  "a dense embedding (sparse=False)")
    return grad


@contextlib.contextmanager
def hidden_grads(params: Iterable[torch.Tensor]):
    """Within this context ``params`` have no gradient (the wrapped
    optimizer, stepped inside, leaves them alone); their gradients come back
    afterwards, as they were."""
    stashed = [(p, p.grad) for p in params]
    for p, _ in stashed:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in stashed:
            p.grad = grad


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


class BaselineOptimizer(WrappedOptimizer):
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

    #: The method's key in :mod:`hvd_acp.methods`.
    key = "baseline"

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]],
                 settings: Any, communicator: Optional[Communicator]) -> None:
        self._wrap(optimizer, HorovodCommunicator() if communicator is None else communicator)
        error = settings if isinstance(settings, Exception) else None
        named: List[Tuple[str, torch.Tensor]] = []
        if error is None:
            try:
                named = named_parameters_of(optimizer, named_parameters)
            except (ValueError, TypeError, NotImplementedError) as exc:
                error = exc
        self._agree_on_arguments(error, lambda: {
            "method": self.key, **facts_of(settings), **self._comm.wire_settings(),
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
                                           f"{self.section}.overflow")
                         if self._comm.size() > 1 else None)
        if self.overflow is not None:
            self._finalizer = weakref.finalize(self, self.overflow.remove)
        #: Seconds of the method's maths (transforms, selection, outer step).
        self.compression_seconds = 0.0
        self._checked = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.section = f"hvd_acp.{cls.key}"
        cls.label = cls.__name__

    def _start_facts(self) -> Dict[str, Any]:
        """What every rank must hold equal when it starts training (subclasses)."""
        return {"step_count": self.step_count}

    def _check_start(self) -> None:
        """At the first step (and the first after a checkpoint is loaded):
        every rank starts from the same weights and state, or all raise (a
        rank that skipped ``hvd.broadcast_parameters``, or a checkpoint loaded
        on some ranks only, would never agree again)."""
        self._checked = True

        def explain(rank: int, gathered) -> RuntimeError:
            return RuntimeError(
                f"{type(self).__name__}: the ranks start from different weights or state "
                f"({describe_differences(gathered[0]['facts'], gathered[rank]['facts'], rank)}). "
                "Call hvd.broadcast_parameters(model.state_dict(), root_rank=0) on every rank "
                "before training, and load a checkpoint on every rank")
        self._agree_on_start(self._start_facts(), explain)

    def _step(self):
        if not self._checked:
            self._check_start()
        result = self._method_step()
        self.step_count += 1
        return result

    def _method_step(self):
        raise NotImplementedError

    def _timed(self, started: float) -> None:
        self.compression_seconds += time.perf_counter() - started

    # ------------------------------------------------------------ checkpoints
    def _section_state(self, for_broadcast: bool = False) -> dict:
        return dict(self._method_state(), step_count=self.step_count)

    def _load_section(self, section: dict, from_broadcast: bool = False) -> None:
        section = dict(section)
        self.step_count = int(section.pop("step_count"))
        self._load_method_state(section)

    def _after_load(self) -> None:
        self._checked = False

    def _method_state(self) -> dict:
        raise NotImplementedError

    def _load_method_state(self, state: dict) -> None:
        raise NotImplementedError
