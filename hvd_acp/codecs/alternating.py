"""ACP-SGD's alternating steps: P on even steps, Q on odd ones (the paper's scheme).

P step (``Qh``: the orthonormalized ``Q`` of the step before)::

    P_i = A Qh          (sent: n r elements)
    E   = A - P_i Qh^T  (kept, local)
    P   = mean_i P_i    (committed)
    G   = P Qh^T        (applied; ||G|| = ||P||, the basis is orthonormal)

Q step: the mirror image on ``Ph``, ``Q_i = A^T Ph``, written for the
row-major matrices as ``Q_i^T = Ph^T A`` (see :func:`.compression.compress_columns_`).
"""
from __future__ import annotations

from ..compression import (Phase, compress_, compress_columns_, local_residual_,
                           local_residual_columns_, reconstruct_)
from .base import Codec

__all__ = ["PCodec", "QCodec"]


class PCodec(Codec):
    """The P step: ``P_i = A Qh`` on the previous step's ``Q``."""

    name, phase = "P", Phase.P

    def payload_rows(self, n: int, m: int) -> int:
        return n

    def reused(self, tensor):
        return (tensor.q,)

    def encode_(self, tensor, basis, out):
        compress_(None, tensor.error, basis, out)
        return out

    def residual_(self, tensor, basis, factor):
        local_residual_(tensor.error, factor, basis, tensor.transpose(basis))

    def commit_(self, tensor, averaged):
        return tensor.p.copy_(averaged)

    def reconstruct_(self, tensor, factor, basis, target):
        reconstruct_(target, factor, basis, tensor.transpose(basis))
        return (factor,)


class QCodec(Codec):
    """The Q step: ``Q_i = A^T Ph`` on the previous step's ``P``."""

    name, phase = "Q", Phase.Q
    #: The residual reads ``Q_i^T``, a tensor of its own, not the payload.
    copies_payload = False

    def payload_rows(self, n: int, m: int) -> int:
        return m

    def reused(self, tensor):
        return (tensor.p,)

    def encode_(self, tensor, basis, out):
        return compress_columns_(None, tensor.error, basis, out)      # Q_i^T

    def residual_(self, tensor, basis, factor):
        local_residual_columns_(tensor.error, basis, factor)

    def commit_(self, tensor, averaged):
        return tensor.q.copy_(averaged)

    def reconstruct_(self, tensor, factor, basis, target):
        reconstruct_(target, basis, factor)                          # G = Ph Q^T
        return (factor,)
