"""hvd_acp: ACP-SGD gradient compression as a drop-in Horovod optimizer.

    optimizer = hvd_acp.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters())
"""
from .autorank import AutoRank
from .baselines import DeMoOptimizer, DiLoCoOptimizer
from .compression import Phase
from .comm import CommStats, Communicator, HorovodCommunicator, LocalCommunicator
from .optimizer import DistributedOptimizer
from .powersgd import PowerSGDOptimizer
from .settings import Settings

__version__ = "0.1.0"

__all__ = ["DistributedOptimizer", "PowerSGDOptimizer", "DiLoCoOptimizer", "DeMoOptimizer",
           "Settings", "AutoRank", "Phase", "CommStats", "Communicator", "HorovodCommunicator",
           "LocalCommunicator", "__version__"]


def __getattr__(name):
    # hvd_acp.ddp (the DDP communication hook) imports torch.distributed:
    # loaded on first use only.
    if name == "ddp":
        import importlib
        return importlib.import_module(f"{__name__}.ddp")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
