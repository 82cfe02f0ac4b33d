"""Both factors every step in 8-bit lanes (``int8_factors``): the payload of
:class:`~.both.PQCodec`, each element an integer level on a scale every rank
knows, four to an int32 word (:mod:`hvd_acp.lanes`): a quarter of float32's
bytes on the wire, half of fp16's.

A factor column's scale is the same column of the factor averaged in the
step before (identical on every rank) times ``headroom``, over the levels a
rank has, ``L = 127 // N`` for N ranks::

    step_j = headroom * max_i |P_prev[i, j]| / L
    sent:    clamp(round(P_i / step), -L, L)          (Q_i alike)
    average: (the levels' sum / N) * step

What rounding and clipping leave out stays in this rank's residual, which
is ``A`` less the projection rebuilt from its own dequantized ``P_i`` and
``Q_i``: error feedback carries it into the next step, so nothing is lost,
and every rank decodes the same sums on the same scales, so the replicas
stay identical. A column whose factor was zero takes a floor of the
tensor's largest column (2^-8 of it), or the smallest normal float; its
scale then grows by ``headroom`` a step while its levels are clipped.

The first compressed step has no averaged factors to scale by: it is a
:class:`~.both.PQCodec` step (:meth:`hvd_acp.Settings.codecs`).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..compression import compress_both_
from ..lanes import quantize_
from .both import PQCodec

__all__ = ["Int8PQCodec", "column_steps"]

#: A zero column's floor, as a share of the tensor's largest column.
_FLOOR_SHARE = 2.0 ** -8


def column_steps(factor: Tensor, headroom: float, levels: int) -> Tensor:
    """The quantization step of each column of a factor (n, r) averaged in
    the step before: ``headroom * max |column| / levels``, floored (see the
    module's text); shape (1, r), > 0."""
    largest = factor.abs().amax(dim=0, keepdim=True)
    floor = (largest.amax() * _FLOOR_SHARE).clamp_min(torch.finfo(factor.dtype).tiny)
    return torch.maximum(largest, floor).mul_(headroom / levels)


class Int8PQCodec(PQCodec):
    """Both factors as 8-bit levels, on the bases ``(Ph, Qh)``.

    Args:
        levels: the levels a rank has either side of zero
            (:func:`hvd_acp.lanes.levels_per_rank` of the world size).
        headroom: the scale over the last average's largest element (2).
    """

    name = "PQ8"
    lanes = True
    copies_payload = False

    def __init__(self, levels: int, headroom: float = 2.0) -> None:
        self.levels, self.headroom = levels, headroom

    def steps(self, tensor) -> Tuple[Tensor, Tensor]:
        """The steps of ``P``'s and ``Q``'s columns, from the factors kept."""
        return (column_steps(tensor.p, self.headroom, self.levels),
                column_steps(tensor.q, self.headroom, self.levels))

    def encode_(self, tensor, basis, out):
        compress_both_(None, tensor.error, basis[0], basis[1], out)
        n = tensor.layout.n
        factor = torch.empty_like(out)
        for rows, step in zip((slice(0, n), slice(n, None)), self.steps(tensor)):
            quantize_(out[rows], step, self.levels)
            torch.mul(out[rows], step, out=factor[rows])
        return factor

    def commit_(self, tensor, averaged):
        n = tensor.layout.n
        step_p, step_q = self.steps(tensor)          # before the factors change
        averaged[:n].mul_(step_p)
        averaged[n:].mul_(step_q)
        return super().commit_(tensor, averaged)

    def counted_twice(self, tensor, basis, out):
        return None

    def __repr__(self) -> str:
        return f"Int8PQCodec(levels={self.levels}, headroom={self.headroom:g})"
