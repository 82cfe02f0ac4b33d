"""The buffers each method sends, planned as the code plans them today.

Two plans, each from the code that makes it, so that the planner and the
front ends cannot drift:

- hvd_acp's fused buffers (:func:`hvd_acp.fusion.plan_buckets`) for ACP-SGD
  and Power-SGD, from the parameters' shapes, dtypes and ranks;
- DDP's buckets, as DDP rebuilds them after its first iteration: in the
  order the gradients arrived in backward (not the order of registration),
  the first one capped at 1 MiB and the others at ``bucket_cap_mb``, by
  torch's own assignment (``dist._compute_bucket_assignment_by_size``).
  The hook gets each bucket's parameters in that order, so the last
  compressed one (whose residual waits until the bucket is launched) is the
  last of them to arrive.

:func:`current_plans` redoes both for a profile read from a file, so a
profile measured before a change of either plan predicts what the code
sends now.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..codecs import Int8PQCodec
from ..compression import Phase, compute_dtype
from ..fusion import TensorLayout, plan_buckets

__all__ = ["DDP_FIRST_BUCKET_BYTES", "DDP_BUCKET_BYTES", "bucket_plans", "ddp_buckets",
           "arrival_order", "current_plans"]

#: DDP's defaults: the first bucket 1 MiB, the others bucket_cap_mb=25.
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
DDP_BUCKET_BYTES = 25 * 1024 * 1024


def _bucket_dicts(buckets) -> List[dict]:
    return [{"bytes": b.nbytes, "members": [s.name for s in b.slots], "name": b.name,
             **({"lanes": True} if b.lanes else {})}
            for b in buckets]


def bucket_plans(layouts: Sequence[TensorLayout], fusion_threshold_bytes: int,
                 psgd_layouts: Optional[Sequence[TensorLayout]] = None,
                 int8_factors: bool = False) -> Dict[str, list]:
    """hvd_acp's buffers per method and step, as the profile stores them
    (``acp_p``, ``acp_q``: P and Q in turn; ``acp_pq``: both factors, with
    ``int8_factors`` the factors in buffers of 8-bit lanes of their own,
    marked ``lanes``; ``psgd_p``, ``psgd_q``: lists of ``bytes``,
    ``members``, ``name``). The bytes are the buffer's, float32; fp16 on the
    wire halves them, 8-bit lanes send a byte an element and a flag
    (:mod:`.timeline`).

    Args:
        layouts: every parameter's layout, in registration order.
        fusion_threshold_bytes: the S-SGD fusion threshold the plans scale.
        psgd_layouts: Power-SGD's layouts where its rank differs (its own
            share under an adaptive optimizer); default ``layouts``.
    """
    psgd_layouts = layouts if psgd_layouts is None else psgd_layouts
    compressed = [lay for lay in psgd_layouts if lay.compressed]
    return {
        "acp_p": _bucket_dicts(plan_buckets(layouts, Phase.P, fusion_threshold_bytes)),
        "acp_q": _bucket_dicts(plan_buckets(layouts, Phase.Q, fusion_threshold_bytes)),
        "acp_pq": _bucket_dicts(plan_buckets(
            layouts, Int8PQCodec(1) if int8_factors else Phase.PQ, fusion_threshold_bytes)),
        "psgd_p": _bucket_dicts(plan_buckets(psgd_layouts, Phase.P, fusion_threshold_bytes,
                                             prefix="hvd_acp.powersgd")),
        "psgd_q": _bucket_dicts(plan_buckets(compressed, Phase.Q, fusion_threshold_bytes,
                                             prefix="hvd_acp.powersgd")) if compressed else [],
    }


def ddp_buckets(arrived: Sequence[Tuple[str, int, torch.dtype]],
                first_bytes: int = DDP_FIRST_BUCKET_BYTES,
                cap_bytes: int = DDP_BUCKET_BYTES) -> List[List[str]]:
    """DDP's gradient buckets after its rebuild, each in the order the hook gets them.

    Args:
        arrived: (name, number of elements, dtype) of every parameter, in the
            order backward produced their gradients (:func:`arrival_order`).
        first_bytes, cap_bytes: DDP's first bucket and ``bucket_cap_mb``.
    """
    arrived = list(arrived)
    try:
        import torch.distributed as dist
        # Tensors on the meta device: the sizes and dtypes, no memory.
        tensors = [torch.empty(numel, dtype=dtype, device="meta") for _, numel, dtype in arrived]
        indices, _ = dist._compute_bucket_assignment_by_size(
            tensors, [first_bytes, cap_bytes], [False] * len(tensors))
        return [[arrived[i][0] for i in bucket] for bucket in indices]
    except (ImportError, AttributeError, RuntimeError, TypeError):  # pragma: no cover
        buckets, current, size, cap = [], [], 0, first_bytes
        for name, numel, dtype in arrived:
            current.append(name)
            size += numel * dtype.itemsize
            if size >= cap:
                buckets.append(current)
                current, size, cap = [], 0, cap_bytes
        if current:
            buckets.append(current)
        return buckets


def arrival_order(params: Sequence[dict]) -> List[str]:
    """The names of a profile's parameters in the order backward produced their
    gradients: the profile's ``ready_order`` (the order the hooks fired in
    its last timed step) where it has one, else by ``ready_s``, ties in
    reverse registration order; parameters that got no gradient last."""
    ready = [p for p in params if p.get("got_gradient", True)]
    position = {p["name"]: i for i, p in enumerate(params)}
    ready.sort(key=lambda p: (p["ready_s"], -position[p["name"]]))
    names = [p["name"] for p in ready]
    seen = set(names)
    return names + [p["name"] for p in reversed(params) if p["name"] not in seen]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"profile: unknown dtype {name!r}")
    return dtype


def current_plans(profile: dict) -> dict:
    """``profile`` with today's plans (a new dict; the profile is left alone).

    The buffers are planned again from the shapes, dtypes and ranks the
    profile records; a profile without shapes keeps its own. DDP's buckets
    follow the order the gradients arrived (``ready_order``, else
    ``ready_s``).
    """
    params = profile["params"]
    if not all("shape" in p and "dtype" in p and "n" in p for p in params):
        return profile
    dtypes = {p["name"]: _dtype(p["dtype"]) for p in params}
    def layouts_of(rank: str, compressed: str) -> List[TensorLayout]:
        return [TensorLayout(name=p["name"], shape=tuple(p["shape"]),
                             dtype=compute_dtype(dtypes[p["name"]]), grad_dtype=dtypes[p["name"]],
                             n=int(p["n"]), m=int(p["m"]),
                             r=int(p[rank]) if p[compressed] else 0,
                             compressed=bool(p[compressed])) for p in params]
    layouts = layouts_of("r", "compressed")
    # Profiles made before Power-SGD had its own rank: the same layouts.
    psgd_layouts = (layouts_of("psgd_r", "psgd_compressed")
                    if all("psgd_r" in p for p in params) else None)
    by_name = {p["name"]: p for p in params}
    order = list(profile.get("ready_order") or arrival_order(params))
    seen = set(order)
    order += [p["name"] for p in reversed(params) if p["name"] not in seen]
    threshold = profile.get("fusion_threshold_bytes")
    updated = dict(profile)
    if threshold is not None:
        updated["buckets"] = bucket_plans(layouts, int(threshold), psgd_layouts,
                                          bool(profile.get("int8_factors")))
    updated["ddp_buckets"] = ddp_buckets(
        [(name, int(by_name[name].get("numel") or by_name[name]["bytes"] // dtypes[name].itemsize),
          dtypes[name]) for name in order])
    return updated
