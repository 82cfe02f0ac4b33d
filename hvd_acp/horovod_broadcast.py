"""Broadcasting an hvd_acp optimizer's state: Horovod's function, and hvd_acp's own.

``hvd.broadcast_optimizer_state(optimizer, root_rank)`` (Horovod 0.28.1, the
version hvd_acp pins) is the resume pattern of Horovod's examples: the root
loads a checkpoint, then every rank calls it. It was written for Horovod's
own optimizer, and an hvd_acp wrapper meets it in one place
(:class:`hvd_acp.wrapper.WrappedOptimizer`), through one fact it can read:

- it is called from that function (:func:`broadcast_call`, the call's
  frame on the stack). Nothing else tells its ``state_dict()`` and
  ``step()`` calls from a user's: there, the wrapper's first
  ``state_dict()`` of the call broadcasts its own section (the compression
  state, a baseline's state) from the call's ``root_rank`` and returns the
  wrapped optimizer's state dict for Horovod to broadcast; its ``step()``,
  which Horovod calls on zero gradients to create the state of a fresh
  optimizer, runs the wrapped optimizer alone and leaves the weights as
  they were.

:func:`broadcast_optimizer_state` does the same without reading the stack:
the explicit call, for code that wants no such coupling.
``tests/test_horovod_broadcast.py`` holds what :func:`broadcast_call` reads
against the source of the Horovod installed.
"""
from __future__ import annotations

import sys
from types import FrameType
from typing import Iterable, Optional

import torch

__all__ = ["STATE_KEY", "broadcast_call", "broadcast_optimizer_state", "first_state_dict_of",
           "initialize_state_"]

#: The compression state's key in a state dict.
STATE_KEY = "hvd_acp"
#: Frames looked through, past the method that asks.
_DEPTH = 4


def broadcast_call(depth: int = 2) -> Optional[FrameType]:
    """The frame of ``hvd.broadcast_optimizer_state`` if it is on the stack
    within :data:`_DEPTH` frames of the caller's caller (``depth`` 2: past
    this function and the method asking), else None.

    Its locals say which call it is: ``root_rank``, and no ``state_dict``
    yet before its first ``state_dict()`` call has returned.
    """
    functions = sys.modules.get("horovod.torch.functions")
    target = getattr(getattr(functions, "broadcast_optimizer_state", None), "__code__", None)
    if target is None:
        return None
    frame = sys._getframe(depth)
    for _ in range(_DEPTH):
        if frame is None:
            return None
        if frame.f_code is target:
            return frame
        frame = frame.f_back
    return None


def first_state_dict_of(call: FrameType) -> bool:
    """Whether the ``state_dict()`` being made is ``call``'s first (Horovod
    asks again after creating a fresh optimizer's state)."""
    return "state_dict" not in call.f_locals


def initialize_state_(optimizer: torch.optim.Optimizer,
                      params: Optional[Iterable[torch.Tensor]] = None) -> None:
    """Create the state of the parameters of a torch optimizer that have none,
    without moving the weights or communicating: one step on zero gradients
    (what Horovod's function does for a fresh optimizer), the weights put
    back after it (with weight decay the step would shrink them on the ranks
    that had no state only).

    Args:
        optimizer: the torch optimizer.
        params: the parameters it steps (default: all of its own); the
            others have no gradient during that step.
    """
    everyone = [p for group in optimizer.param_groups for p in group["params"]]
    params = everyone if params is None else list(params)
    fresh = [p for p in params if p.requires_grad and not optimizer.state.get(p)]
    if not fresh:
        return
    saved = [(p, p.grad) for p in everyone]
    with torch.no_grad():
        weights = [p.clone() for p in fresh]
        for p in everyone:
            p.grad = None
        for p in fresh:
            grad = torch.zeros_like(p)
            p.grad = grad.to_sparse() if isinstance(optimizer, torch.optim.SparseAdam) else grad
    try:
        optimizer.step()
    finally:
        with torch.no_grad():
            for p, weight in zip(fresh, weights):
                p.copy_(weight)
            for p, grad in saved:
                p.grad = grad


def broadcast_optimizer_state(optimizer, root_rank: int = 0, model=None) -> None:
    """``hvd.broadcast_optimizer_state`` for any optimizer, explicitly.

    For an hvd_acp optimizer (``hvd_acp.DistributedOptimizer``,
    ``PowerSGDOptimizer``, the baselines): its own section (the compression
    state: step count, phase and factors; a baseline's state) from
    ``root_rank`` (the root keeps its residual, the others start theirs from
    zero), and the wrapped torch optimizer's state and options through
    Horovod's function, after creating it where a rank has none, without
    moving the weights. Anything else goes to Horovod's function as it is.
    A collective: call it on every rank.
    """
    import horovod.torch as hvd
    from .wrapper import WrappedOptimizer

    if not isinstance(optimizer, WrappedOptimizer):
        hvd.broadcast_optimizer_state(optimizer, root_rank, model=model)
        return
    optimizer.broadcast_section(root_rank)
    inner = optimizer.optimizer
    if not inner.state_dict()["state"]:
        optimizer.initialize_state()
    if inner.state_dict()["state"]:
        hvd.broadcast_optimizer_state(inner, root_rank, model=model)
