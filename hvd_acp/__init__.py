"""hvd_acp: ACP-SGD gradient compression as a drop-in Horovod optimizer.

    optimizer = hvd_acp.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters())

``import hvd_acp`` loads the library only: the DDP hook (``hvd_acp.ddp``),
the baselines (``hvd_acp.baselines``: DiLoCo, a DeMo-style and a TSR-style method), the
integrations, the planner (``hvd_acp.plan``), the A/B tool (``hvd_acp.ab``)
and the registry of methods they compare (``hvd_acp.methods``) are imported
where asked for.
"""
from .autorank import AutoRank
from .compression import Phase
from .comm import CommStats, Communicator, HorovodCommunicator, LocalCommunicator
from .horovod_broadcast import broadcast_optimizer_state
from .optimizer import DistributedOptimizer
from .powersgd import PowerSGDOptimizer
from .settings import Settings

__version__ = "0.1.0"

__all__ = ["DistributedOptimizer", "PowerSGDOptimizer", "DiLoCoOptimizer", "DeMoOptimizer",
           "TSROptimizer", "Settings", "AutoRank", "Phase", "CommStats", "Communicator",
           "HorovodCommunicator", "LocalCommunicator", "broadcast_optimizer_state", "__version__"]

#: Names loaded on first use, from the module that holds them.
_LAZY = {"ddp": "hvd_acp.ddp", "baselines": "hvd_acp.baselines",
         "DiLoCoOptimizer": "hvd_acp.baselines", "DeMoOptimizer": "hvd_acp.baselines",
         "TSROptimizer": "hvd_acp.baselines"}


def __getattr__(name):
    # The DDP hook imports torch.distributed, the baselines their own
    # machinery: neither is loaded by ``import hvd_acp``.
    if name in _LAZY:
        import importlib
        module = importlib.import_module(_LAZY[name])
        return module if module.__name__.endswith(name) else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
