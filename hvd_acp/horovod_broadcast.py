"""What ``hvd.broadcast_optimizer_state`` needs of an optimizer that is not Horovod's.

Horovod's ``DistributedOptimizer`` is a subclass of the wrapped optimizer's
class, built on the fly; hvd_acp's wraps it by composition (see
docs/algorithm.md). ``horovod.torch.broadcast_optimizer_state`` (Horovod
0.28.1, the version hvd_acp pins) was written for the first kind, and reads
an optimizer in ways only these few tricks meet. Each is here, with the
line of that function it answers in one line;
``tests/test_horovod_broadcast.py`` holds each one against the source of
the Horovod installed, and the resume and swap tests run them for real.
"""
from __future__ import annotations

import sys
import weakref
from typing import Callable

import torch

__all__ = ["STATE_KEY", "BroadcastEntry", "LocalStep", "add_broadcast_entry",
           "called_by_broadcast_optimizer_state", "pass_as_horovod_optimizer"]

#: The compression state's key in a state dict (and its id in a broadcast).
STATE_KEY = "hvd_acp"
#: ``horovod.torch.optimizer``: the module Horovod checks an optimizer against.
HOROVOD_OPTIMIZER_MODULE = "horovod.torch.optimizer"


def pass_as_horovod_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Reason: it initializes state collective-free only where
    ``optimizer.__module__ == DistributedOptimizer.__module__``.

    Set on the instance: the class keeps its real module.
    """
    optimizer.__dict__["__module__"] = HOROVOD_OPTIMIZER_MODULE


def called_by_broadcast_optimizer_state() -> bool:
    """Reason: it calls ``state_dict()`` and ``step()`` with nothing that
    tells them from a user's call but itself on the call stack.

    Call it straight from the method in question: it looks from two frames
    up (past itself and that method) through four more.
    """
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


class LocalStep(torch.optim.Optimizer):
    """Reason: it initializes a fresh optimizer's state with
    ``super(optimizer.__class__, optimizer).step()``, which reaches this class.

    That step, on zero gradients, exists to create the state (on the ranks
    that have none), so it runs the wrapped optimizer without communication
    and leaves the weights as they were: with weight decay it would shrink
    them on those ranks only, and after a resume from rank 0's checkpoint
    (whose weights ``hvd.broadcast_parameters`` had just copied everywhere)
    the replicas would differ for the rest of training.
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


class BroadcastEntry(dict):
    """Reason: it hands the root's non-tensor values back only by assigning
    them into the dicts ``state_dict()`` returned (``state[pid][name] = v``).

    The entry holds one value, ``"state"``: the compression state; the
    assignment hands the root's to ``adopt`` on every rank.
    """

    def __init__(self, value: dict, adopt: Callable[[dict], None]) -> None:
        super().__init__(state=value)
        self._adopt = weakref.WeakMethod(adopt)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        adopt = self._adopt()
        if adopt is not None:
            adopt(value)


def add_broadcast_entry(state_dict: dict, value: dict, adopt: Callable[[dict], None]) -> None:
    """Reason: it broadcasts the state of the ids listed in ``param_groups``
    only, so the entry's id (:data:`STATE_KEY`) joins the last group."""
    state_dict["state"][STATE_KEY] = BroadcastEntry(value, adopt)
    state_dict["param_groups"][-1]["params"].append(STATE_KEY)
