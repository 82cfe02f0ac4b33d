"""What the framework integrations share: the optimizer behind a framework's
wrapper, registering the hook, per-rank checkpoint files. Their settings are
every front end's (:class:`hvd_acp.Settings`), checked when given.

Imports no framework.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from ..ddp import ACPState, acp_hook
from ..settings import Settings

logger = logging.getLogger(__name__)

#: Per-rank file of the compression state in a framework's checkpoint folder.
RANK_FILE = "hvd_acp_state_rank{rank}.pt"


def torch_optimizer(optimizer, argument: str = "optimizer") -> torch.optim.Optimizer:
    """The torch optimizer whose ``step()`` updates the weights, behind a
    framework's wrapper (Accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``).

    Step-ahead error feedback hooks into that optimizer's ``step()``: a
    wrapper's own ``step()`` is not a torch optimizer step (Accelerate's
    derives from ``torch.optim.Optimizer`` without its hook machinery).

    Raises:
        TypeError: no torch optimizer inside ``optimizer``.
    """
    seen = optimizer
    for _ in range(8):
        inner = getattr(seen, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(seen, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        seen = inner
    # A torch optimizer proper has the step-hook machinery of Optimizer.__init__.
    if not (isinstance(seen, torch.optim.Optimizer)
            and hasattr(seen, "_optimizer_step_pre_hooks")):
        raise TypeError(f"{argument} must be a torch.optim.Optimizer or a framework's wrapper "
                        f"of one, got {type(optimizer).__name__}")
    return seen


def register(model: DistributedDataParallel, optimizer: torch.optim.Optimizer,
             settings: Settings, *, framework: str) -> ACPState:
    """Register :func:`~hvd_acp.ddp.acp_hook` on ``model`` with a new state.

    The state is keyed by the parameter names of ``model.module`` (so that
    checkpoints name parameters) and holds ``optimizer`` (step-ahead).

    Raises:
        RuntimeError: ``model`` has a communication hook already.
    """
    state = ACPState(named_parameters=model.module.named_parameters(), optimizer=optimizer,
                     settings=settings)
    try:
        model.register_comm_hook(state, acp_hook)
    except RuntimeError as exc:
        state.close()
        if "once" not in str(exc):
            raise
        raise RuntimeError(
            f"the DistributedDataParallel module built by {framework} has a communication "
            f"hook already ({exc}); remove the other hook (e.g. a comm_hook in the "
            "framework's DDP settings) to train with ACP-SGD") from None
    return state


def save_rank_file(state: ACPState, directory: str, rank: int,
                   name: str = RANK_FILE) -> str:
    """Write this rank's compression state (with its residual) into ``directory``."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name.format(rank=rank))
    torch.save(state.state_dict(), path)
    return path


def load_rank_file(state: ACPState, directory: str, rank: int,
                   name: str = RANK_FILE) -> Optional[str]:
    """Load this rank's file from ``directory``, else rank 0's (a resume at
    another world size: factors and step count, this rank's residual from
    zero); returns the path loaded, or None when ``directory`` has neither.
    """
    for candidate in (rank, 0):
        path = os.path.join(directory, name.format(rank=candidate))
        if os.path.isfile(path):
            state.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            if candidate != rank:
                logger.info("hvd_acp: no %s in %s: loaded rank 0's file (factors and step "
                            "count; this rank's residual starts from zero)",
                            name.format(rank=rank), directory)
            return path
    return None
