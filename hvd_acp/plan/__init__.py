"""Performance planner: profile one device, predict each method's step on a cluster.

- :mod:`.cost`: ring and hierarchical all-reduce cost model, ring all-gather (pure);
- :mod:`.timeline`: one step of each method of :mod:`hvd_acp.methods` it
  can simulate (S-SGD, Power-SGD on hvd_acp and the DDP hook, ACP-SGD),
  from a profile (pure);
- :mod:`.baselines`: bytes per step of DiLoCo, the DeMo-style and the TSR-style
  method and the time of their collectives, beside the table (pure);
- :mod:`.profile`: the measurements (torch), :func:`profile_model` for any model;
- :mod:`.node`: the profile as a node's ranks run: every local rank at once
  (:mod:`.node_worker`), Horovod's thread alive, what was assumed recorded;
- :mod:`.replan`: the buffers each method sends, planned as the code plans them;
- :mod:`.models`: the built-in models of ``--model``;
- :mod:`.link`: link calibration files (a network stack's CPU cost per byte);
- :mod:`.units`: command-line values (link rates, lists);
- :mod:`.report`: plan.json, plan.md, plan.png and the recommendation;
- :mod:`.validate`: a measured benchmark run predicted and compared;
- ``python -m hvd_acp.plan`` / ``hvd-acp-plan``: the command line.

Outside the core: it reads the fusion plans the optimizer sends
(:func:`hvd_acp.fusion.plan_buckets`), never the reverse.
"""
from .cost import Network, allreduce_s, ring_allreduce_s
from .timeline import METHODS, Settings, StepPrediction, predict_methods

__all__ = ["Network", "allreduce_s", "ring_allreduce_s", "METHODS", "Settings",
           "StepPrediction", "predict_methods", "profile_model"]


def __getattr__(name):
    # The profiler imports torch's training machinery; load it on first use.
    if name == "profile_model":
        from .profile import profile_model
        return profile_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
