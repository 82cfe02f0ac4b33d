"""Both factors every step, each on the other's basis of the step before
(``both_factors``, the default under Adam-family optimizers).

One all-reduce of (n + m) r elements: ``P_i = A Qh`` over ``Q_i = A^T Ph``.
The gradient is ``A``'s projection on the tangent space of both bases (up to
2r directions, both refreshed every step)::

    G = P Qh^T + Ph (Q^T - Ph^T P Qh^T)
    E = A - (the same from P_i, Q_i) = (I - Ph Ph^T) A (I - Qh Qh^T)
"""
from __future__ import annotations

import torch

from ..compression import Phase, compress_both_, local_residual_both_, reconstruct_both_
from .base import Codec

__all__ = ["PQCodec"]


class PQCodec(Codec):
    """Both factors, on the bases ``(Ph, Qh)``."""

    name, phase = "PQ", Phase.PQ

    def payload_rows(self, n: int, m: int) -> int:
        return n + m

    def reused(self, tensor):
        return (tensor.p, tensor.q)

    def encode_(self, tensor, basis, out):
        compress_both_(None, tensor.error, basis[0], basis[1], out)
        return out

    def residual_(self, tensor, basis, factor):
        n = tensor.layout.n
        local_residual_both_(tensor.error, factor[:n], factor[n:].transpose(0, 1), *basis)

    def commit_(self, tensor, averaged):
        n = tensor.layout.n
        tensor.p.copy_(averaged[:n])
        tensor.q.copy_(averaged[n:])
        return averaged

    def reconstruct_(self, tensor, factor, basis, target):
        n = tensor.layout.n
        # The two terms are orthogonal: their squared norms add up to ||G||^2.
        return reconstruct_both_(target, factor[:n], factor[n:], *basis)

    def counted_twice(self, tensor, basis, out):
        """``Ph^T P_i``: in ``A Qh`` and in ``A^T Ph`` alike."""
        return torch.mm(basis[0].t(), out[:tensor.layout.n])
