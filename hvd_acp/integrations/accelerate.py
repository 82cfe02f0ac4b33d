"""ACP-SGD in Hugging Face Accelerate: one call after ``accelerator.prepare``.

::

    from hvd_acp.integrations.accelerate import register_acp

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = register_acp(accelerator, model, optimizer, matrix_rank=4)

``DistributedDataParallelKwargs(comm_hook=...)`` only takes Accelerate's own
enum of built-in hooks; the supported route is to register on the
``DistributedDataParallel`` module ``prepare()`` returns, which this does,
with the torch optimizer inside the ``AcceleratedOptimizer`` (the one whose
``step()`` updates the weights), so step-ahead error feedback is on.

Checkpoints: ``accelerator.save_state(dir)`` also writes each rank's
compression state (step count, phase, factors and that rank's residual) as
``dir/hvd_acp_state_rank<r>.pt``, and ``accelerator.load_state(dir)`` loads
it back on every rank: training continues as if never stopped. At another
world size a rank without its own file loads rank 0's (factors and step
count; its residual starts from zero).

Needs ``accelerate`` (``pip install hvd_acp[accelerate]``).
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Optional

from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.nn.parallel import DistributedDataParallel

from ..ddp import ACPState
from ..settings import Settings
from ._common import RANK_FILE, load_rank_file, register, save_rank_file, torch_optimizer

__all__ = ["NO_DDP", "register_acp"]

logger = logging.getLogger(__name__)

#: What each distributed type uses instead of a DDP module.
NO_DDP = {
    DistributedType.NO: "a single process has no gradient all-reduce to compress; launch "
                        "several processes (accelerate launch --num_processes N, or torchrun)",
    DistributedType.FSDP: "FSDP reduce-scatters sharded gradients, with no DDP communication "
                          "hook; use plain DDP (no FSDP plugin) if the model fits on one device",
    DistributedType.DEEPSPEED: "DeepSpeed runs its own gradient communication, with no DDP "
                               "communication hook; use plain DDP (no DeepSpeed plugin)",
    DistributedType.MEGATRON_LM: "Megatron-LM runs its own gradient communication; use plain DDP",
    DistributedType.XLA: "XLA reduces gradients in the compiled graph, with no DDP "
                         "communication hook",
}


def register_acp(accelerator: Accelerator, model: DistributedDataParallel, optimizer, *,
                 settings: Optional[Settings] = None, **named_settings) -> ACPState:
    """Train ``model`` with ACP-SGD: register :func:`hvd_acp.ddp.acp_hook` on it.

    Call it on every process, after ``accelerator.prepare(...)`` and before
    the first backward pass.

    Args:
        accelerator: the ``Accelerator`` that prepared ``model``.
        model: the ``DistributedDataParallel`` module ``prepare()`` returned.
        optimizer: the prepared optimizer (or the torch optimizer inside it)
            that updates ``model``'s parameters.
        settings, **named_settings: ACP-SGD's settings, as every front end takes them
            (:meth:`hvd_acp.Settings.of`).

    Returns:
        The hook's :class:`~hvd_acp.ddp.ACPState`: ``comm_stats.bytes_sent``
        counts what this rank sent; ``close()`` ends step-ahead for good.

    Raises:
        ValueError: the accelerator trains without a DDP module (one process,
            FSDP, DeepSpeed, ...), or ``model`` is not the DDP module.
        TypeError: ``optimizer`` holds no torch optimizer.
        RuntimeError: ``model`` has a communication hook already.
    """
    settings = Settings.of(settings, **named_settings)
    kind = accelerator.distributed_type
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if kind is DistributedType.NO and launched > 1:
        # Accelerate on a machine without GPUs leaves each launched process alone
        # unless told to use the CPU.
        raise ValueError(f"register_acp: this process is one of WORLD_SIZE={launched}, but "
                         "Accelerate trains it alone (distributed_type=NO): on CPUs create "
                         "Accelerator(cpu=True) to train them together with DDP over Gloo")
    if kind in NO_DDP:
        raise ValueError(f"register_acp cannot train with distributed_type={kind.value}: "
                         f"{NO_DDP[kind]}")
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"model must be the DistributedDataParallel module that "
                         f"accelerator.prepare() returned, got {type(model).__name__}")
    torch_opt = torch_optimizer(optimizer)
    owned = {id(p) for p in model.parameters()}
    if not any(id(p) in owned for group in torch_opt.param_groups for p in group["params"]):
        raise ValueError("optimizer does not update any parameter of model: pass the "
                         "optimizer that prepare() returned with this model")
    state = register(model, torch_opt, settings, framework="Accelerate")

    state_ref, model_ref = weakref.ref(state), weakref.ref(model)
    rank = accelerator.process_index

    def file_name(models):
        index = next((i for i, m in enumerate(models) if m is model_ref()), 0)
        return RANK_FILE if index == 0 else f"hvd_acp_state_model{index}_rank{{rank}}.pt"

    def save(models, weights, output_dir):
        if state_ref() is not None:
            save_rank_file(state_ref(), output_dir, rank, file_name(models))

    def load(models, input_dir):
        if state_ref() is None:
            return
        if load_rank_file(state_ref(), input_dir, rank, file_name(models)) is None:
            logger.warning("hvd_acp: %s has no ACP-SGD state (a checkpoint saved without "
                           "register_acp?): compression starts afresh", input_dir)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    return state
