"""hvd_acp: ACP-SGD gradient compression as a drop-in Horovod optimizer.

    optimizer = hvd_acp.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters())
"""
from .compression import Phase
from .comm import CommStats, Communicator, HorovodCommunicator, LocalCommunicator
from .optimizer import DistributedOptimizer
from .powersgd import PowerSGDOptimizer

__version__ = "0.1.0"

__all__ = ["DistributedOptimizer", "PowerSGDOptimizer", "Phase", "CommStats", "Communicator",
           "HorovodCommunicator", "LocalCommunicator", "__version__"]
