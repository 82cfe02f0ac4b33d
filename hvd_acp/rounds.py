"""Fused buffers, gradient hooks and the bookkeeping of one communication round.

A fusion plan (:func:`.fusion.plan_buckets`) says which slot of which flat
buffer each tensor takes; :class:`BufferCache` makes the buffers of a plan
and each slot's shaped view once, and hands the same ones back every step
of that plan. :class:`GradientHooks` tells when a parameter's gradient of
the step is complete. :class:`Round` is what one step of the Horovod front
end tracks: the slots filled, each buffer's readiness and all-reduce handle,
the gradients sent apart, and the residual that waits for its buffer's
launch.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Hashable, List, Tuple

import torch
from torch import Tensor

from .fusion import Bucket

__all__ = ["Plan", "BufferCache", "GradientHooks", "Round"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The buffers of a fusion plan.

    Attributes:
        buckets: the plan, in launch order.
        buffers: one flat tensor per bucket.
        views: name -> its slot of a buffer, in the slot's shape.
        where: name -> index of its bucket.
        members: per bucket, (name, view) of its slots in slot order.
        fp16: bucket index -> the float16 copy of its buffer that travels
            where the wire is fp16 (:meth:`fp16_copy`).
    """

    buckets: List[Bucket]
    buffers: List[Tensor]
    views: Dict[str, Tensor]
    where: Dict[str, int]
    members: List[List[Tuple[str, Tensor]]]
    fp16: Dict[int, Tensor] = dataclasses.field(default_factory=dict)

    def fp16_copy(self, index: int) -> Tensor:
        """Buffer ``index`` copied into its float16 twin (made once, kept with the plan)."""
        buffer = self.buffers[index]
        copy = self.fp16.get(index)
        if copy is None:
            copy = self.fp16[index] = torch.empty_like(buffer, dtype=torch.float16)
        return copy.copy_(buffer)


class BufferCache:
    """Plans with their buffers and slot views, made once per key.

    A key names everything the buffers depend on (phase, members, layout
    version, device). A buffer is reused as soon as its previous all-reduce
    has been waited for, which every front end does before it fills the
    buffer again.

    Args:
        limit: plans kept; beyond it (ranks or buckets that keep changing)
            every plan is dropped and made again when next used.
    """

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._plans: Dict[Hashable, Plan] = {}

    def get(self, key: Hashable, buckets: Callable[[], List[Bucket]],
            device: torch.device) -> Plan:
        """The plan of ``key``; ``buckets()`` plans it the first time."""
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self.limit:
                self._plans.clear()
            planned = buckets()
            buffers = [torch.empty(b.numel, dtype=b.dtype, device=device) for b in planned]
            views, where = {}, {}
            for index, (bucket, buffer) in enumerate(zip(planned, buffers)):
                for slot in bucket.slots:
                    views[slot.name] = buffer[slot.offset:slot.offset + slot.numel].view(
                        slot.shape)
                    where[slot.name] = index
            members = [[(slot.name, views[slot.name]) for slot in bucket.slots]
                       for bucket in planned]
            plan = self._plans[key] = Plan(planned, buffers, views, where, members)
        return plan


class Round:
    """Bookkeeping of one communication round (one optimizer step).

    Attributes:
        codec: what the round's buffers carry (a :class:`~hvd_acp.codecs.Codec`).
        plan: its buckets, buffers and slot views.
        taken: names whose slot has been filled.
        ready: per bucket, slots filled so far.
        handles: bucket index -> handle of its all-reduce.
        sparse: name -> handle of a gradient reduced apart (sparse).
        densified: name -> ``sparse_dim`` of a sparse gradient sent densely.
        owed: bucket index -> the residual that waits for its launch
            (:meth:`.state.CompressedTensor.compress_` with ``defer``).
    """

    def __init__(self, codec, plan: Plan) -> None:
        self.codec = codec
        self.plan = plan
        self.taken: set = set()
        self.ready = [0] * len(plan.buckets)
        self.handles: Dict[int, object] = {}
        self.sparse: Dict[str, object] = {}
        self.densified: Dict[str, int] = {}
        self.owed: Dict[int, object] = {}

    def completes(self, b_index: int) -> bool:
        """Whether the next slot filled in bucket ``b_index`` is its last."""
        return self.ready[b_index] + 1 == len(self.plan.members[b_index])


class GradientHooks:
    """A hook on every parameter that requires a gradient, counting backward
    passes: the last of ``passes_per_step`` hands the parameter to
    ``on_ready(name, param)``, one more raises.

    Args:
        params: name -> parameter.
        passes_per_step: backward passes accumulated per step.
        on_ready: called with (name, param) once per step and parameter.
    """

    def __init__(self, params: Dict[str, Tensor], passes_per_step: int,
                 on_ready: Callable[[str, Tensor], None]) -> None:
        self.params = params
        self.passes_per_step = passes_per_step
        self.on_ready = on_ready
        self.handles: Dict[str, object] = {}
        self._passes: Dict[str, int] = {name: 0 for name in params}
        self._closed = False

    @property
    def pending(self) -> bool:
        """Whether any backward pass was counted since :meth:`reset`."""
        return any(self._passes.values())

    def register(self) -> None:
        """Hook every parameter that requires a gradient and has no hook yet."""
        if self._closed:
            return
        for name, param in self.params.items():
            if param.requires_grad and name not in self.handles:
                self.handles[name] = param.register_post_accumulate_grad_hook(
                    lambda param, name=name: self._counted(name, param))

    def remove(self) -> None:
        """Remove every hook for good."""
        self._closed = True
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()

    def reset(self) -> None:
        """A new step: no pass counted."""
        for name in self._passes:
            self._passes[name] = 0

    def _counted(self, name: str, param: Tensor) -> None:
        passes = self._passes[name] + 1
        if passes > self.passes_per_step:
            raise RuntimeError(
                f"Gradients were computed more than backward_passes_per_step="
                f"{self.passes_per_step} times before call to step() "
                f"(parameter {name!r}). Increase backward_passes_per_step to "
                "accumulate gradients locally, or call step() after each backward.")
        self._passes[name] = passes
        if passes == self.passes_per_step:
            self.on_ready(name, param)
