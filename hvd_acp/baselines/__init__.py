"""What transformer users pick instead of compressing gradients, as Horovod optimizers.

- :class:`DiLoCoOptimizer` (:mod:`.diloco`): H local steps of the user's
  optimizer, then an all-reduce of the replicas' moves and one outer
  Nesterov step (arXiv 2311.08105);
- :class:`DeMoOptimizer` (:mod:`.demo`): each rank's error-fed momentum,
  DCT-II per chunk, top-k, one all-gather, a sign update (arXiv 2411.19870);
- :mod:`.maths`: their maths, pure torch; :mod:`.settings`: their settings
  and defaults; :mod:`.wrapper`: the Horovod contract they share.

Both are methods of :mod:`hvd_acp.methods` (``diloco``, ``demo``), so the
benchmark, ``hvd-acp-ab`` and the examples run them; the planner gives their
bytes per step (:mod:`hvd_acp.plan.baselines`).
"""
from .demo import DeMoOptimizer
from .diloco import DiLoCoOptimizer
from .settings import DeMoSettings, DiLoCoSettings

__all__ = ["DiLoCoOptimizer", "DeMoOptimizer", "DiLoCoSettings", "DeMoSettings"]
