"""ACP-SGD in the Hugging Face ``Trainer``: one call after building it.

::

    from hvd_acp.integrations.transformers import register_acp

    trainer = Trainer(model=model, args=args, train_dataset=train)
    register_acp(trainer, matrix_rank=4)
    trainer.train()                     # under torchrun / accelerate launch

``register_acp`` adds an :class:`ACPCallback` bound to ``trainer``. Why not a
plain ``callbacks=[...]`` entry: a ``TrainerCallback`` is handed the
unwrapped model, while the hook must be registered on the
``DistributedDataParallel`` module the Trainer builds inside ``train()``
(``trainer.model_wrapped``), so the callback needs the Trainer itself.
Binding it in one call keeps every ``Trainer`` subclass (``Seq2SeqTrainer``,
TRL's trainers, your own) usable as it is, where an ``ACPTrainer`` subclass
would not combine with them.

At ``on_train_begin`` (the DDP module and the optimizer exist, before the
first forward pass) the callback registers :func:`hvd_acp.ddp.acp_hook` with
the torch optimizer inside the Trainer's ``AcceleratedOptimizer``, so
step-ahead error feedback is on.

Checkpoints: at every save (``save_steps``, ``save_strategy``) each rank
writes its compression state (step count, phase, factors and its own
residual) as ``checkpoint-<step>/hvd_acp_state_rank<r>.pt``, beside the
Trainer's own per-rank ``rng_state_<r>.pth``. ``train(resume_from_checkpoint=...)``
loads it back from ``<output_dir>/checkpoint-<global step>``, the folder the
Trainer saved (a callback is not told the path ``train()`` was given): a
checkpoint moved out of ``output_dir`` resumes with a fresh compression
state, with a warning.

Needs ``transformers`` and ``accelerate`` (``pip install hvd_acp[transformers]``).
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from accelerate.utils import DistributedType
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback
from transformers.training_args import ParallelMode

from ..ddp import ACPState
from ..settings import Settings
from ._common import load_rank_file, register, save_rank_file, torch_optimizer
from .accelerate import NO_DDP

__all__ = ["ACPCallback", "register_acp"]

logger = logging.getLogger(__name__)

#: The Trainer's name of a checkpoint folder (transformers' PREFIX_CHECKPOINT_DIR).
CHECKPOINT_FOLDER = "checkpoint-{step}"


def register_acp(trainer: Trainer, *, settings: Optional[Settings] = None,
                 **named_settings) -> "ACPCallback":
    """Make ``trainer.train()`` train with ACP-SGD; returns the callback added.

    Args:
        trainer: a ``transformers.Trainer`` (or subclass) whose processes
            train with DDP (launched by ``torchrun`` or ``accelerate launch``).
        settings, **named_settings: ACP-SGD's settings, as every front end takes them
            (:meth:`hvd_acp.Settings.of`).

    Raises:
        ValueError: the Trainer trains without a DDP module (one process,
            ``nn.DataParallel``, FSDP, DeepSpeed, ...).
    """
    settings = Settings.of(settings, **named_settings)
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError("register_acp cannot train with DeepSpeed: "
                         + NO_DDP[DistributedType.DEEPSPEED])
    if getattr(trainer, "is_fsdp_enabled", False):
        raise ValueError("register_acp cannot train with FSDP: " + NO_DDP[DistributedType.FSDP])
    mode = trainer.args.parallel_mode
    if mode is not ParallelMode.DISTRIBUTED:
        hint = {ParallelMode.NOT_PARALLEL: "a single process has no gradient all-reduce to "
                                           "compress; launch one process per device with "
                                           "torchrun or accelerate launch",
                ParallelMode.NOT_DISTRIBUTED: "nn.DataParallel runs one process over several "
                                              "GPUs; launch one process per GPU with torchrun"}
        raise ValueError(f"register_acp needs DistributedDataParallel, the Trainer runs "
                         f"parallel_mode={mode.value}: "
                         + hint.get(mode, "launch one process per device with torchrun"))
    kind = trainer.accelerator.distributed_type
    if kind in NO_DDP:
        raise ValueError(f"register_acp cannot train with distributed_type={kind.value}: "
                         f"{NO_DDP[kind]}")
    callback = ACPCallback(trainer, settings)
    trainer.add_callback(callback)
    return callback


class ACPCallback(TrainerCallback):
    """Registers :func:`hvd_acp.ddp.acp_hook` on ``trainer``'s DDP module and
    keeps its state in the Trainer's checkpoints. Made by :func:`register_acp`.

    Attributes:
        state: the :class:`~hvd_acp.ddp.ACPState` of the current (or last)
            ``train()``, from ``on_train_begin`` on: ``state.comm_stats``
            counts what this rank sent.
        resumed_from: the file the state was loaded from at resume, if any.
    """

    def __init__(self, trainer: Trainer, settings: Settings) -> None:
        self.trainer = trainer
        self.settings = settings
        self.state: Optional[ACPState] = None
        self.resumed_from: Optional[str] = None
        self._model: Optional[DistributedDataParallel] = None

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.model_wrapped
        if not isinstance(model, DistributedDataParallel):
            raise ValueError(f"register_acp needs the Trainer's model wrapped in "
                             f"DistributedDataParallel, got {type(model).__name__}: launch one "
                             "process per device with torchrun or accelerate launch")
        if model is self._model:
            raise RuntimeError("a second train() on the same Trainer reuses the DDP module that "
                               "holds the first train()'s hook: build a new Trainer and resume "
                               "from a checkpoint (register_acp keeps the state there)")
        self.state = register(model, torch_optimizer(self.trainer.optimizer), self.settings,
                              framework="the Trainer")
        self._model = model
        if state.global_step > 0:
            folder = _checkpoint_folder(args, state)
            self.resumed_from = load_rank_file(self.state, folder, args.process_index)
            if self.resumed_from is None:
                logger.warning("hvd_acp: resuming at step %d without an ACP-SGD state (none in "
                               "%s): compression starts afresh", state.global_step, folder)

    def on_save(self, args, state, control, **kwargs):
        if self.state is not None:
            save_rank_file(self.state, _checkpoint_folder(args, state), args.process_index)

    def on_train_end(self, args, state, control, **kwargs):
        # True weights and no step-ahead hooks left behind after train().
        if self.state is not None:
            self.state.close()


def _checkpoint_folder(args, state) -> str:
    """The folder of the Trainer's checkpoint at ``state.global_step``."""
    return os.path.join(args.output_dir, CHECKPOINT_FOLDER.format(step=state.global_step))
