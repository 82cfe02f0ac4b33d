"""ACP-SGD in PyTorch Lightning: one callback.

::

    from hvd_acp.integrations.lightning import ACPCallback

    trainer = L.Trainer(strategy="ddp", devices=2, accelerator="cpu",   # or "gpu"
                        callbacks=[ACPCallback(matrix_rank=4)])
    trainer.fit(model, data)

The callback registers :func:`hvd_acp.ddp.acp_hook` on the
``DistributedDataParallel`` module the strategy built, once the optimizer
exists too (``on_fit_start``), on CPU (Gloo) and GPU (NCCL) alike, and hands
the hook the optimizer, so step-ahead error feedback is on. Lightning's own
``DDPStrategy(ddp_comm_hook=...)`` does neither: it registers hooks only on
CUDA, and builds the comm state before the optimizers exist.

Checkpoints: the compression state (step count, phase, factors, rank 0's
residual) is the callback's state in Lightning's checkpoint, which rank 0
writes. ``trainer.fit(..., ckpt_path=...)`` restores it on every rank: the
step count and factors continue, rank 0 gets its residual back and the other
ranks restart theirs from zero (a residual is one rank's unsent gradient).

Needs ``lightning`` (``pip install hvd_acp[lightning]``); also works with
the ``pytorch_lightning`` package of the same version.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import (DDPStrategy, DeepSpeedStrategy, FSDPStrategy,
                                              Strategy)
except ImportError:  # the standalone package
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, Strategy
from torch.nn.parallel import DistributedDataParallel

from ..ddp import ACPState
from ..settings import Settings
from ._common import register, torch_optimizer

__all__ = ["ACPCallback"]

logger = logging.getLogger(__name__)


class ACPCallback(pl.Callback):
    """Trains a ``strategy="ddp"`` Lightning run with ACP-SGD.

    Args:
        settings, **named_settings: ACP-SGD's settings, as every front end takes them
            (:meth:`hvd_acp.Settings.of`); checked here.

    Attributes:
        state: the :class:`~hvd_acp.ddp.ACPState` of the current (or last)
            fit, from ``on_fit_start`` on: ``state.comm_stats.bytes_sent``
            counts what this rank sent, ``state.step_count`` the iterations.

    Raises (at ``trainer.fit``):
        ValueError: a strategy without a DDP module (FSDP, DeepSpeed, one
            device), or a ``DDPStrategy`` that has a ``ddp_comm_hook``.
        NotImplementedError: more than one optimizer.
    """

    def __init__(self, matrix_rank=None, *, settings: Optional[Settings] = None,
                 **named_settings) -> None:
        self.settings = Settings.of(settings, matrix_rank=matrix_rank, **named_settings)
        self.state: Optional[ACPState] = None
        #: A checkpoint's state, loaded into the next fit's ACPState.
        self._to_load: Optional[Dict[str, Any]] = None

    # ------------------------------------------------------------ lifecycle
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            _check_strategy(trainer.strategy)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise ValueError(
                f"ACPCallback needs the model wrapped in DistributedDataParallel; "
                f"{type(trainer.strategy).__name__} gave {type(model).__name__}: train with "
                "strategy='ddp' (or remove ACPCallback)")
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise NotImplementedError(
                f"ACPCallback supports one optimizer, configure_optimizers() returned "
                f"{len(optimizers)}: step-ahead error feedback follows the optimizer that "
                "updates every parameter")
        self.state = register(model, torch_optimizer(optimizers[0]), self.settings,
                              framework="Lightning's DDPStrategy")
        if self._to_load is not None:
            self.state.load_state_dict(self._to_load)
            self._to_load = None
        logger.info("hvd_acp: acp_hook registered (matrix_rank=%r, step %d)",
                    self.state.settings.matrix_rank, self.state.step_count)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                 stage: str) -> None:
        # True weights and no step-ahead hooks left behind after fit.
        if stage == "fit" and self.state is not None:
            self.state.close()

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> Dict[str, Any]:
        if self.state is not None:
            return self.state.state_dict()
        return dict(self._to_load or {})

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Keep a checkpoint's compression state: Lightning restores callbacks
        before the strategy wraps the model, so it is loaded in ``on_fit_start``."""
        if state_dict:
            self._to_load = state_dict


def _check_strategy(strategy: Strategy) -> None:
    """Raise ``ValueError`` naming what to use instead of a strategy that
    trains without a DDP module or has its own comm hook."""
    name = type(strategy).__name__
    if isinstance(strategy, DeepSpeedStrategy):
        raise ValueError("ACPCallback cannot train with DeepSpeedStrategy: DeepSpeed runs its "
                         "own gradient communication, with no DDP communication hook; use "
                         "strategy='ddp' with ACPCallback")
    if isinstance(strategy, FSDPStrategy):
        raise ValueError("ACPCallback cannot train with FSDPStrategy: FSDP reduce-scatters "
                         "sharded gradients, with no DDP communication hook; use "
                         "strategy='ddp' with ACPCallback (the model must fit on one device)")
    if not isinstance(strategy, DDPStrategy):
        raise ValueError(
            f"ACPCallback compresses the gradient all-reduce of DistributedDataParallel, and "
            f"{name} has none" + (" (one process: nothing to all-reduce)"
                                  if "Single" in name else "")
            + ": use strategy='ddp' with devices > 1 or num_nodes > 1, or remove ACPCallback")
    if getattr(strategy, "_ddp_comm_hook", None) is not None:
        raise ValueError("this DDPStrategy has a ddp_comm_hook already; ACPCallback registers "
                         "acp_hook itself (on CPU too, with the optimizer): remove "
                         "ddp_comm_hook/ddp_comm_state from DDPStrategy")
