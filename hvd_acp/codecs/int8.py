"""Both factors every step in 8-bit lanes (``int8_factors``): the payload of
:class:`~.both.PQCodec`, each element an integer level on a scale every rank
knows, four to an int32 word (:mod:`hvd_acp.lanes`): a quarter of float32's
bytes on the wire, half of fp16's.

A factor column's scale is the same column of the factor averaged in the
step before (identical on every rank) times ``headroom``, over the levels a
rank has, ``L = 127 // N`` for N ranks, times the column's growth between
the two averages before, ``g_j`` (1 where there is no average before that
one; at most ``max_growth``)::

    g_j    = clamp(max_i |P_prev[i, j]| / max_i |P_prev2[i, j]|, 1, max_growth)
    step_j = headroom * g_j * max_i |P_prev[i, j]| / L
    sent:    clamp(round(P_i / step), -L, L)          (Q_i alike)
    average: (the levels' sum / N) * step

The growth keeps the levels ahead of gradients that grow from step to step
(a learning rate's warm-up): from the last average alone, up to a tenth of
the elements a step were clipped there on the Trainer's GPT-2 at 2 ranks,
and a run fell behind S-SGD for good on one seed in three
(docs/convergence.md, "Below a tenth of the bytes"). Both averages are
identical on every rank, so the steps are too, and nothing more is sent;
the column maxima of the one before are the tensor's ``previous_maxima``,
saved in checkpoints.

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

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..compression import compress_both_
from ..lanes import quantize_
from .both import PQCodec

__all__ = ["Int8PQCodec", "column_maxima", "column_steps"]

#: A zero column's floor, as a share of the tensor's largest column.
_FLOOR_SHARE = 2.0 ** -8


def column_maxima(factor: Tensor) -> Tensor:
    """``max |column|`` of each column of a factor (n, r); shape (1, r)."""
    return factor.abs().amax(dim=0, keepdim=True)


def column_steps(factor: Tensor, headroom: float, levels: int,
                 before: Optional[Tensor] = None, max_growth: float = 1.0) -> Tensor:
    """The quantization step of each column of a factor (n, r) averaged in
    the step before: ``headroom * max |column| / levels``, floored (see the
    module's text), times the column's growth from ``before`` (the column
    maxima of the average before that one, shape (1, r)) within
    ``[1, max_growth]``; shape (1, r), > 0."""
    return _steps_and_maxima(factor, headroom, levels, before, max_growth)[0]


def _steps_and_maxima(factor, headroom, levels, before, max_growth) -> Tuple[Tensor, Tensor]:
    """:func:`column_steps` and the :func:`column_maxima` it read."""
    largest = column_maxima(factor)
    floor = (largest.amax() * _FLOOR_SHARE).clamp_min(torch.finfo(factor.dtype).tiny)
    steps = torch.maximum(largest, floor).mul_(headroom / levels)
    if before is not None and max_growth > 1:
        steps.mul_((largest / before.clamp_min(torch.finfo(factor.dtype).tiny))
                   .clamp_(1.0, max_growth))
    return steps, largest


class Int8PQCodec(PQCodec):
    """Both factors as 8-bit levels, on the bases ``(Ph, Qh)``.

    Args:
        levels: the levels a rank has either side of zero
            (:func:`hvd_acp.lanes.levels_per_rank` of the world size).
        headroom: the scale over the last average's largest element (2).
        max_growth: the most a column's step grows with its average's
            growth (2: on the four AdamW recipes of docs/convergence.md
            no worse than 4 and better on the Trainer's ten seeds; 1 for
            the last average alone).
    """

    name = "PQ8"
    lanes = True
    copies_payload = False

    def __init__(self, levels: int, headroom: float = 2.0, max_growth: float = 2.0) -> None:
        if not max_growth >= 1:
            raise ValueError(f"max_growth must be >= 1, got {max_growth!r}")
        self.levels, self.headroom, self.max_growth = levels, headroom, max_growth

    def steps(self, tensor) -> Tuple[Tensor, Tensor]:
        """The steps of ``P``'s and ``Q``'s columns, from the factors kept
        and the column maxima of the averages before them."""
        return self._steps_and_maxima(tensor)[0]

    def _steps_and_maxima(self, tensor):
        """``(steps, column maxima)`` of ``(P, Q)``, worked out once a step:
        the encode's are the commit's while the factors are unchanged
        (``tensor.codec_scratch`` keeps them with the factors' versions)."""
        key = (self, tensor.p, tensor.q, tensor.p._version, tensor.q._version,
               tensor.previous_maxima)
        scratch = tensor.codec_scratch
        if scratch is not None and all(a is b or (type(a) is int and a == b)
                                       for a, b in zip(scratch[0], key)):
            return scratch[1]
        before = tensor.previous_maxima or (None, None)
        (step_p, max_p), (step_q, max_q) = (
            _steps_and_maxima(factor, self.headroom, self.levels, prior, self.max_growth)
            for factor, prior in zip((tensor.p, tensor.q), before))
        result = ((step_p, step_q), (max_p, max_q))
        tensor.codec_scratch = (key, result)
        return result

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
        tensor.previous_maxima = self._steps_and_maxima(tensor)[1]
        tensor.codec_scratch = None
        return super().commit_(tensor, averaged)

    def counted_twice(self, tensor, basis, out):
        return None

    def __repr__(self) -> str:
        return (f"Int8PQCodec(levels={self.levels}, headroom={self.headroom:g}, "
                f"max_growth={self.max_growth:g})")
