"""Classic Power-SGD's two rounds (Vogels et al., 2019), with warm start.

Round 1 (:class:`PowerSGDFirst`): ``P_i = A Q`` on last step's ``Q`` as it
is, no residual yet (``E`` keeps ``A``), ``P = mean_i P_i`` committed and no
gradient written; the front end orthonormalizes ``P`` between the rounds.
Round 2 is the Q step of :mod:`.alternating` on ``Ph = orth(P)``: ``Q_i =
A^T Ph``, ``E = A - Ph Q_i^T``, ``G = Ph Q^T``.
"""
from __future__ import annotations

from ..compression import Phase, compress_
from .alternating import QCodec
from .base import Codec

__all__ = ["PowerSGDFirst", "PowerSGDSecond"]


class PowerSGDFirst(Codec):
    """Power-SGD's first projection."""

    name, phase = "P", Phase.P
    writes_gradient = False

    def payload_rows(self, n: int, m: int) -> int:
        return n

    def step_numel(self, n: int, m: int, r: int) -> int:
        return (n + m) * r                              # P, then Q in the second round

    def reused(self, tensor):
        return (tensor.q,)

    def bases(self, tensors):
        return [tensor.q for tensor in tensors]        # warm start: Q as it is

    def encode_(self, tensor, basis, out):
        compress_(None, tensor.error, basis, out)
        return out

    def residual_(self, tensor, basis, factor):
        """The second projection computes it."""

    def commit_(self, tensor, averaged):
        return tensor.p.copy_(averaged)

    def reconstruct_(self, tensor, factor, basis, target):
        return None


class PowerSGDSecond(QCodec):
    """Power-SGD's second projection: ACP-SGD's Q step on ``Ph = orth(P)``,
    the P the front end orthonormalized in place between the rounds."""

    def bases(self, tensors):
        return [tensor.p for tensor in tensors]
