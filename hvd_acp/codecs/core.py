"""The core on both bases: an r x r payload between two refreshes of one side.

ACP-SGD's P and Q steps each refresh one side's basis from the current
gradient (``P_i = A Qh`` sends n r elements, ``Q_i = A^T Ph`` m r). Between
two refreshes, a core step keeps both bases and sends only the gradient's
coordinates in them, r^2 elements::

    C_i = Ph^T A Qh     (sent: r x r)
    E   = A - Ph C_i Qh^T  (kept, local: what the bases miss)
    G   = Ph C Qh^T     (applied; ||G|| = ||C||, both bases orthonormal)

``Ph`` and ``Qh`` are the orthonormalized factors the last P and Q steps
left; a core step changes neither. A scheme with refresh period K runs P,
then K - 1 core steps, then Q, then K - 1 core steps, and so on: about
``(n r + m r) / (2 K) + r^2 (K - 1) / K`` elements a step instead of the
``n r`` or ``m r`` of P and Q in turn. The residual keeps error feedback's
guarantee (every rank's unsent part is applied later) and step-ahead reads
it as for any step.
"""
from __future__ import annotations

import torch

from ..compression import orthonormal_copies
from .base import Codec

__all__ = ["CoreCodec"]


class CoreCodec(Codec):
    """The r x r core of ``A`` on the bases ``(Ph, Qh)``."""

    name, phase = "core", "core"

    def payload_shape(self, n: int, m: int, r: int):
        return (r, r)

    def reused(self, tensor):
        return (tensor.p, tensor.q)

    def bases(self, tensors):
        groups = orthonormal_copies([t.p for t in tensors] + [t.q for t in tensors])
        return list(zip(groups[:len(tensors)], groups[len(tensors):]))

    def encode_(self, tensor, basis, out):
        p_basis, q_basis = basis
        torch.mm(torch.mm(p_basis.transpose(0, 1), tensor.error), q_basis, out=out)
        return out

    def residual_(self, tensor, basis, factor):
        p_basis, q_basis = basis
        tensor.error.addmm_(torch.mm(p_basis, factor), q_basis.transpose(0, 1), alpha=-1)

    def commit_(self, tensor, averaged):
        return averaged                 # the bases stay; nothing to keep

    def reconstruct_(self, tensor, factor, basis, target):
        p_basis, q_basis = basis
        torch.mm(torch.mm(p_basis, factor), q_basis.transpose(0, 1), out=target)
        return (factor,)
