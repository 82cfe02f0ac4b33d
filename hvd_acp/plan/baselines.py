"""Bytes per step of DiLoCo, the DeMo-style and the TSR-style method, and the
time of their collectives, from a profile's parameters (pure Python).

The planner does not put these methods in its table of step times (see
their ``not_predicted`` in :mod:`hvd_acp.methods`): they are other
algorithms, which a step time cannot rank against the gradient averagers.
What it can say, and writes beside the table:

- **DiLoCo** sends and receives every parameter once per ``H`` inner steps
  (one ring all-reduce): ``bytes(parameters) / H`` per step, amortized;
  its collective takes ``allreduce_s(bytes) / H`` per step.
- **DeMo-style** gathers, per chunk of every tensor of two or more
  dimensions, ``k`` values (at least 4 bytes each) and ``k`` positions
  (:func:`index_bytes`) from every rank, and all-reduces the 1-D
  gradients: a rank sends ``b + e`` and receives ``(N - 1) b + e`` per step
  (``b`` its coefficients, ``e`` the 1-D gradients); its collectives take
  ``allgather_s(b) + allreduce_s(e)``.
- **TSR-style** all-reduces one buffer per step: the r x r core of every
  matrix that gains by it, every ``K`` steps its two sketches, ``(n + m) r``
  elements, and the other tensors' gradients; ``r^2 + (n + m) r / K``
  elements per matrix and step over a period, sent and received, 2 bytes
  each on its default fp16 wire (at least 4 otherwise). Its collective
  takes ``((K - 1) allreduce_s(c) + allreduce_s(c + s)) / K`` per step
  (``c`` the cores and the rest, ``s`` the sketches).

The same sizes as :class:`hvd_acp.DeMoOptimizer`'s packing and
:class:`hvd_acp.TSROptimizer`'s buffer (a test holds them to the optimizers'
counters). TSR's embeddings take its defaults here: a profile does not say
which parameters are embeddings.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Sequence

from ..baselines import maths as baseline_maths
from ..baselines.settings import DeMoSettings, DiLoCoSettings, TSRSettings
from .cost import Network, allreduce_s, ring_allgather_s

__all__ = ["BaselineCost", "index_bytes", "diloco_cost", "demo_cost", "tsr_cost",
           "baseline_costs"]


@dataclasses.dataclass(frozen=True)
class BaselineCost:
    """Per rank and step: bytes sent and received, seconds of collectives.

    ``comm_s`` is the link time alone (latency, payload rate, host and stack
    cost per byte), with no overlap with computation: DiLoCo's all-reduce
    and DeMo's all-gather wait for the step's end.
    """

    bytes_sent: float
    bytes_received: float
    comm_s: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def index_bytes(chunk_size: int) -> int:
    """Bytes of one position in a chunk (:func:`hvd_acp.baselines.maths.index_dtype`)."""
    return 1 if chunk_size <= 256 else 2 if chunk_size <= 2 ** 15 else 4


def _element_bytes(param: dict) -> int:
    return param["bytes"] // max(param["numel"], 1)


def diloco_cost(params: Sequence[dict], ranks: int, net: Network,
                inner_steps: Optional[int] = None) -> BaselineCost:
    """DiLoCo's cost per step, amortized over ``inner_steps`` (default: the library's)."""
    steps = DiLoCoSettings(inner_steps=inner_steps).resolve().inner_steps
    total = sum(p["bytes"] for p in params)
    return BaselineCost(total / steps, total / steps, allreduce_s(total, ranks, net) / steps)


def demo_cost(params: Sequence[dict], ranks: int, net: Network, top_k: Optional[int] = None,
              chunk_size: Optional[int] = None) -> BaselineCost:
    """The DeMo-style method's cost per step (``top_k``, ``chunk_size``: default the library's)."""
    s = DeMoSettings(top_k=top_k, chunk_size=chunk_size).resolve()
    gathered = sum(math.ceil(p["numel"] / s.chunk_size) * s.top_k
                   * (max(_element_bytes(p), 4) + index_bytes(s.chunk_size))
                   for p in params if len(p["shape"]) >= 2)
    exact = sum(p["bytes"] for p in params if len(p["shape"]) < 2)
    return BaselineCost(gathered + exact, (ranks - 1) * gathered + exact,
                        ring_allgather_s(gathered, ranks, net) + allreduce_s(exact, ranks, net))


def tsr_cost(params: Sequence[dict], ranks: int, net: Network,
             core_rank: Optional[int] = None, refresh_period: Optional[int] = None,
             fp16_wire: Optional[bool] = None) -> BaselineCost:
    """The TSR-style method's cost per step over a refresh period
    (``core_rank``, ``refresh_period``, ``fp16_wire``: default the library's)."""
    s = TSRSettings(core_rank=core_rank, refresh_period=refresh_period,
                    fp16_wire=fp16_wire).resolve()
    element = 2 if s.fp16_wire else max([4] + [_element_bytes(p) for p in params])
    cores = sketched = 0.0
    for p in params:
        if len(p["shape"]) < 2:
            cores += p["numel"]
            continue
        n, m = baseline_maths.matrix_view(p["shape"])
        r = baseline_maths.core_rank_of(n, m, s.core_rank)
        if baseline_maths.compresses(n, m, r, s.refresh_period):
            cores += r * r
            sketched += (n + m) * r
        else:
            cores += p["numel"]
    period = s.refresh_period
    sent = (cores + sketched / period) * element
    seconds = ((period - 1) * allreduce_s(cores * element, ranks, net)
               + allreduce_s((cores + sketched) * element, ranks, net)) / period
    return BaselineCost(sent, sent, seconds)


def baseline_costs(params: Sequence[dict], ranks: int, net: Network,
                   settings: Optional[Dict[str, dict]] = None) -> Dict[str, BaselineCost]:
    """``{"diloco": ..., "demo": ..., "tsr": ...}`` with each method's ``settings``
    (keyword arguments of :func:`diloco_cost`, :func:`demo_cost` and
    :func:`tsr_cost`; default the library's). ``demo`` and ``tsr`` only where
    every parameter has its ``shape`` and ``numel`` (a profile may lack them:
    :mod:`.profile_format` does not require them)."""
    settings = settings or {}
    costs = {"diloco": diloco_cost(params, ranks, net, **settings.get("diloco", {}))}
    if all("shape" in p and "numel" in p for p in params):
        costs["demo"] = demo_cost(params, ranks, net, **settings.get("demo", {}))
        costs["tsr"] = tsr_cost(params, ranks, net, **settings.get("tsr", {}))
    return costs
