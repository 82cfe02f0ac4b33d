"""What transformer users pick instead of compressing gradients, as Horovod optimizers.

- :class:`DiLoCoOptimizer` (:mod:`.diloco`): H local steps of the user's
  optimizer, then an all-reduce of the replicas' moves and one outer
  Nesterov step (arXiv 2311.08105);
- :class:`DeMoOptimizer` (:mod:`.demo`): each rank's error-fed momentum,
  DCT-II per chunk, top-k, one all-gather, a sign update (arXiv 2411.19870);
- :class:`TSROptimizer` (:mod:`.tsr`): each matrix's r x r core on two
  orthonormal bases all-reduced, the bases refreshed every K steps from
  sketches, Adam in the core (arXiv 2602.08007);
- :mod:`.maths`: their maths, pure torch; :mod:`.settings`: their settings
  and defaults; :mod:`.wrapper`: the Horovod contract they share.

All are methods of :mod:`hvd_acp.methods` (``diloco``, ``demo``, ``tsr``),
so the benchmark, ``hvd-acp-ab`` and the examples run them; the planner
gives their bytes per step (:mod:`hvd_acp.plan.baselines`).
"""
from .demo import DeMoOptimizer
from .diloco import DiLoCoOptimizer
from .settings import DeMoSettings, DiLoCoSettings, TSRSettings
from .tsr import TSROptimizer, embedding_parameter_names

__all__ = ["DiLoCoOptimizer", "DeMoOptimizer", "TSROptimizer", "DiLoCoSettings", "DeMoSettings",
           "TSRSettings", "embedding_parameter_names"]
