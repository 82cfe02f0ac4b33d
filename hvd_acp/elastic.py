"""Elastic Horovod: keep the compression state consistent across resets.

``hvd.elastic.TorchState(model=model, optimizer=opt)`` picks a state handler
for each value from Horovod's handler registry. The handler registered here
does what Horovod's optimizer handler does (save, restore and broadcast the
wrapped optimizer's state) and, on every sync, also broadcasts the factors
and step count from rank 0 and resets the error feedback, so that a worker
that joined later starts from the same factors and phase as the others.
"""
from __future__ import annotations

from horovod.torch.elastic.state import (OptimizerStateHandler, get_handler_registry,
                                         set_handler_registry)

__all__ = ["CompressedOptimizerStateHandler", "register_elastic_handler"]


class CompressedOptimizerStateHandler(OptimizerStateHandler):
    """Horovod elastic state handler for :class:`hvd_acp.DistributedOptimizer`."""

    def sync(self) -> None:
        super().sync()
        self.value.sync_compression_state(root_rank=0)


def register_elastic_handler(optimizer_class: type) -> None:
    """Put the handler first in Horovod's registry for ``optimizer_class``
    (``hvd_acp.DistributedOptimizer``); idempotent."""
    registry = list(get_handler_registry())
    if any(handler is CompressedOptimizerStateHandler for _, handler in registry):
        return
    set_handler_registry([(optimizer_class, CompressedOptimizerStateHandler)] + registry)
