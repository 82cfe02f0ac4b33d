"""Performance planner: profile one device, predict each method's step on a cluster.

- :mod:`.cost`: ring and hierarchical all-reduce cost model (pure);
- :mod:`.timeline`: one step of S-SGD, Power-SGD (hvd_acp and the DDP hook)
  and ACP-SGD simulated from a profile (pure);
- :mod:`.profile`: the measurements (torch), :func:`profile_model` for any model;
- :mod:`.report`: plan.json, plan.md, plan.png and the recommendation;
- :mod:`.validate`: a measured benchmark run predicted and compared;
- ``python -m hvd_acp.plan`` / ``hvd-acp-plan``: the command line.

Outside the core, like the benchmark: it reads the fusion plans the
optimizer sends (:func:`hvd_acp.fusion.plan_buckets`), never the reverse.
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
