"""Fusion planning: which tensor goes into which flat buffer, at which offset.

Pure and deterministic: the plan depends only on the parameters' names,
shapes and dtypes and on the settings, so every rank computes the same plan
and the same all-reduce names without talking to the others.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .codecs import as_codec
from .compression import factor_rank, matrix_shape, should_compress

__all__ = ["DEFAULT_FUSION_THRESHOLD_BYTES", "TensorLayout", "Slot", "Bucket", "make_layouts",
           "one_bucket", "plan_buckets", "rank_limit", "sent_bytes", "dense_bytes"]

#: The S-SGD fusion threshold the Horovod front end plans its buffers from.
DEFAULT_FUSION_THRESHOLD_BYTES = 25 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """How one parameter's gradient is communicated.

    Attributes:
        name: the parameter's name (unique within an optimizer).
        shape: the parameter's shape.
        dtype: dtype of the payload (see ``compression.compute_dtype``).
        grad_dtype: the parameter's own dtype.
        n, m: the matrix view (n, m) of the gradient.
        r: rank of the factors; 0 when not compressed.
        compressed: whether the gradient travels as factors.
    """

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    grad_dtype: torch.dtype
    n: int
    m: int
    r: int
    compressed: bool

    @property
    def numel(self) -> int:
        return self.n * self.m

    def payload_numel(self, codec) -> int:
        """Elements this tensor puts on the wire in a step of ``codec`` (a
        :class:`~hvd_acp.codecs.Codec`, or the Phase of one of hvd_acp's)."""
        codec = as_codec(codec)
        if not self.compressed or not codec.compressed:
            return self.numel
        return math.prod(codec.payload_shape(self.n, self.m, self.r))

    def step_numel(self, codec) -> int:
        """Elements this tensor puts on the wire in a whole step of ``codec``
        (every round of a scheme of several)."""
        codec = as_codec(codec)
        if not self.compressed or not codec.compressed:
            return self.numel
        return codec.step_numel(self.n, self.m, self.r)

    def wire_itemsize(self, codec, fp16_wire: bool = False) -> int:
        """Bytes an element of this tensor's payload takes on the wire in a
        step of ``codec``: 1 in 8-bit lanes, else 2 in fp16 or its dtype's."""
        codec = as_codec(codec)
        if codec.lanes and codec.compressed and self.compressed:
            return 1
        return 2 if fp16_wire else self.dtype.itemsize

    def payload_shape(self, codec) -> Tuple[int, ...]:
        """Shape of this tensor's slot in a buffer of ``codec``."""
        codec = as_codec(codec)
        if not self.compressed or not codec.compressed:
            return self.shape
        return codec.payload_shape(self.n, self.m, self.r)


@dataclasses.dataclass(frozen=True)
class Slot:
    """A tensor's place in a fused buffer (offset and size in elements)."""

    name: str
    offset: int
    numel: int
    shape: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A flat buffer all-reduced as one Horovod operation.

    Attributes:
        name: the all-reduce's name, identical on every rank and unique for
            the parameters it holds and the codec.
        dtype: dtype of the buffer.
        slots: members, in the order their gradients are expected.
        numel: total elements.
        lanes: whether the buffer holds integer levels that travel in 8-bit
            lanes (:mod:`hvd_acp.lanes`): the factors of a codec with
            ``lanes``, never mixed with whole gradients.
        lanes_numel: in a DDP bucket (:func:`one_bucket`), the elements at
            its start that are levels in lanes (the rest are floats).
    """

    name: str
    dtype: torch.dtype
    slots: Tuple[Slot, ...]
    numel: int
    lanes: bool = False
    lanes_numel: int = 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def rank_limit(n: int, m: int, min_compression_rate: float) -> int:
    """The largest rank at which an (n, m) matrix is still compressed
    (``(n + m) * r * min_compression_rate <= n * m``), at most ``min(n, m)``."""
    if min_compression_rate <= 0:
        return min(n, m)
    return max(0, min(n, m, int(n * m // ((n + m) * min_compression_rate))))


def make_layouts(named_shapes: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]],
                 matrix_rank: int, min_compression_rate: float,
                 payload_dtype=lambda dtype: dtype, any_rank: bool = False) -> List[TensorLayout]:
    """Layouts for parameters given as (name, shape, dtype) triples.

    With ``any_rank`` (auto rank) a matrix is compressed when some rank
    compresses it, and its rank is ``matrix_rank`` capped at
    :func:`rank_limit`; probes change it later.
    """
    layouts = []
    for name, shape, dtype in named_shapes:
        shape = tuple(int(s) for s in shape)
        n, m = matrix_shape(shape)
        if any_rank:
            compressed = should_compress(shape, 1, min_compression_rate)
            rank = min(factor_rank(n, m, matrix_rank), rank_limit(n, m, min_compression_rate))
        else:
            compressed = should_compress(shape, matrix_rank, min_compression_rate)
            rank = factor_rank(n, m, matrix_rank)
        layouts.append(TensorLayout(
            name=name, shape=shape, dtype=payload_dtype(dtype), grad_dtype=dtype,
            n=n, m=m, r=rank if compressed else 0, compressed=compressed))
    return layouts


def sent_bytes(layouts: Sequence[TensorLayout], cycle: Sequence, fp16_wire: bool) -> float:
    """Bytes one rank sends per step, averaged over a cycle of codecs."""
    return sum(sum(lay.step_numel(codec) * lay.wire_itemsize(codec, fp16_wire)
                   for codec in cycle) / len(cycle)
               for lay in layouts)


def dense_bytes(layouts: Sequence[TensorLayout]) -> int:
    """Bytes S-SGD sends per step for these tensors, in their own dtypes."""
    return sum(lay.numel * lay.grad_dtype.itemsize for lay in layouts)


def plan_buckets(layouts: Sequence[TensorLayout], codec,
                 fusion_threshold_bytes: int,
                 groups: Optional[Sequence[Sequence[str]]] = None,
                 prefix: str = "hvd_acp") -> List[Bucket]:
    """Split tensors into fused buffers for one kind of step.

    Tensors are taken in backward order (reverse registration order), which
    is the order their gradients become ready, so the first buffer fills
    first and its all-reduce overlaps the rest of backward.

    The byte target of a buffer is ``fusion_threshold_bytes`` scaled by the
    codec's compression ratio (payload bytes / gradient bytes over all
    tensors): ACP-SGD issues about as many all-reduces as S-SGD would with
    that threshold, each much smaller. A threshold of 0 puts every tensor in
    a buffer of its own. Before a tensor whose payload alone reaches the
    target (BERT's word embeddings, last of backward, in a P step), a buffer
    at least half full of two or more tensors closes early: they are on the
    wire while that gradient is still being computed. Buffers never mix
    dtypes, nor (for a codec with ``lanes``) factors and whole gradients.

    Args:
        layouts: tensors in registration (forward) order.
        codec: the step's :class:`~hvd_acp.codecs.Codec` (or its Phase).
        fusion_threshold_bytes: S-SGD fusion threshold, in bytes.
        groups: optional explicit fusion groups (lists of names); each group
            becomes its own buffer(s), one per dtype, and the remaining
            tensors are planned by threshold.
        prefix: first component of every all-reduce name.

    Returns:
        Buckets in the order they are expected to become ready.
    """
    if fusion_threshold_bytes < 0:
        raise ValueError(f"fusion_threshold_bytes must be >= 0, got {fusion_threshold_bytes}")
    codec = as_codec(codec)
    by_name = {lay.name: lay for lay in layouts}
    backward = list(reversed(layouts))
    position = {lay.name: i for i, lay in enumerate(backward)}

    grad_bytes = sum(lay.numel * lay.grad_dtype.itemsize for lay in layouts)
    payload_bytes = sum(lay.payload_numel(codec) * lay.dtype.itemsize for lay in layouts)
    ratio = payload_bytes / grad_bytes if grad_bytes else 1.0
    target = fusion_threshold_bytes * ratio

    member_lists: List[List[TensorLayout]] = []
    grouped = set()
    for group in groups or ():
        members = sorted((by_name[name] for name in group), key=lambda l: position[l.name])
        grouped.update(l.name for l in members)
        by_dtype: Dict[Tuple[torch.dtype, bool], List[TensorLayout]] = {}
        for lay in members:
            by_dtype.setdefault((lay.dtype, _in_lanes(lay, codec)), []).append(lay)
        member_lists.extend(by_dtype.values())

    open_lists: Dict[Tuple[torch.dtype, bool], List[TensorLayout]] = {}
    open_bytes: Dict[Tuple[torch.dtype, bool], int] = {}
    for lay in backward:
        if lay.name in grouped:
            continue
        key = (lay.dtype, _in_lanes(lay, codec))
        nbytes = lay.payload_numel(codec) * lay.dtype.itemsize
        if (nbytes >= target and len(open_lists.get(key, ())) > 1
                and 2 * open_bytes[key] >= target):
            # A tensor that fills a buffer by itself travels alone, and a
            # buffer already half full launches without waiting for its
            # gradient. A lone tensor before it (its own layer's bias, whose
            # gradient comes with it) rides along instead.
            member_lists.append(open_lists.pop(key))
            del open_bytes[key]
        current = open_lists.setdefault(key, [])
        current.append(lay)
        open_bytes[key] = open_bytes.get(key, 0) + nbytes
        if open_bytes[key] >= target:
            member_lists.append(current)
            del open_lists[key]
            del open_bytes[key]
    member_lists.extend(open_lists.values())

    # Order buckets by when they complete: the position of their last member.
    member_lists.sort(key=lambda ms: max(position[l.name] for l in ms))

    buckets = []
    for index, members in enumerate(member_lists):
        slots, offset = [], 0
        for lay in members:
            numel = lay.payload_numel(codec)
            slots.append(Slot(lay.name, offset, numel, lay.payload_shape(codec)))
            offset += numel
        name = (f"{prefix}.{codec.name}.{index}.{members[0].name}"
                + (f"..{members[-1].name}" if len(members) > 1 else ""))
        buckets.append(Bucket(name=name, dtype=members[0].dtype, slots=tuple(slots),
                              numel=offset, lanes=_in_lanes(members[0], codec)))
    return buckets


def _in_lanes(lay: TensorLayout, codec) -> bool:
    """Whether ``lay``'s payload in a step of ``codec`` is integer levels."""
    return bool(codec.lanes and codec.compressed and lay.compressed)


def one_bucket(layouts: Sequence[TensorLayout], codec, name: str) -> Bucket:
    """All of ``layouts`` in one buffer, in their order, in the dtype they
    promote to (a DDP bucket's payload). For a codec with ``lanes`` the
    factors come first, in their order, then the whole gradients:
    :attr:`Bucket.lanes_numel` elements of levels, then floats."""
    codec = as_codec(codec)
    dtype = functools.reduce(torch.promote_types, (lay.dtype for lay in layouts))
    ordered = sorted(layouts, key=lambda lay: not _in_lanes(lay, codec))   # stable
    slots, offset, lanes_numel = [], 0, 0
    for lay in ordered:
        numel = lay.payload_numel(codec)
        slots.append(Slot(lay.name, offset, numel, lay.payload_shape(codec)))
        offset += numel
        lanes_numel += numel if _in_lanes(lay, codec) else 0
    return Bucket(name=name, dtype=dtype, slots=tuple(slots), numel=offset,
                  lanes_numel=lanes_numel)
