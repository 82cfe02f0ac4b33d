"""What a compression scheme is to the rest of hvd_acp: a codec per kind of step.

A :class:`Codec` says, for one compressed tensor (a gradient viewed as an
(n, m) matrix ``M``, with its factors ``P`` (n, r) and ``Q`` (m, r) and its
residual ``E`` held by a :class:`~hvd_acp.state.CompressedTensor`), what
one step of its kind sends and what it makes of the average:

1. :meth:`Codec.bases`: the bases the step projects on, from the factors of
   the step before (orthonormalized, same-shaped ones in one batched call);
2. :meth:`Codec.encode_`: this rank's payload of ``A = M + E`` into its slot
   of a fused buffer, of :meth:`Codec.payload_shape`;
3. :meth:`Codec.residual_`: ``E`` becomes what the payload does not carry
   (now, or after the payload's all-reduce was launched);
4. :meth:`Codec.commit_`: the averaged payload's factors kept for the next step;
5. :meth:`Codec.reconstruct_`: the averaged gradient ``G`` written from them.

Everything around that (error feedback's ``A = M + E``, fused buffers,
hooks, non-finite averages, checkpoints, step-ahead) is the same for every
codec, so a new scheme is a new codec: the front ends never look at which
one a step uses. Which codec each step uses is the compression state's
schedule (:attr:`hvd_acp.state.CompressionState.codec`), from the settings.
"""
from __future__ import annotations

import math
from typing import Hashable, List, Sequence, Tuple

from torch import Tensor

from ..compression import orthonormal_copies

__all__ = ["Codec"]


class Codec:
    """One kind of compressed step (abstract).

    Attributes:
        name: the step's kind in all-reduce names and logs (the same on
            every rank).
        phase: what ``optimizer.phase`` reports for such a step (a
            :class:`~hvd_acp.compression.Phase` for hvd_acp's own codecs).
        compressed: False for exact averaging (every gradient whole).
        writes_gradient: whether :meth:`reconstruct_` writes ``G`` (False for
            the first round of a scheme whose gradient comes from a later one).
        copies_payload: whether a residual left for after the launch needs a
            copy of the payload (the all-reduce writes the average over it).
        lanes: whether the payload is integer levels that travel in 8-bit
            lanes (:mod:`hvd_acp.lanes`), in buffers of their own.
    """

    name: str = ""
    phase: Hashable = None
    compressed: bool = True
    writes_gradient: bool = True
    copies_payload: bool = True
    lanes: bool = False

    def payload_rows(self, n: int, m: int) -> int:
        """Rows of the (rows, r) payload of an (n, m) matrix."""
        raise NotImplementedError

    def payload_shape(self, n: int, m: int, r: int) -> Tuple[int, ...]:
        """Shape of the payload of an (n, m) matrix at rank r."""
        return (self.payload_rows(n, m), r)

    def step_numel(self, n: int, m: int, r: int) -> int:
        """Elements a whole step sends for an (n, m) matrix at rank r (every
        round of a scheme of several)."""
        return math.prod(self.payload_shape(n, m, r))

    def reused(self, tensor) -> Sequence[Tensor]:
        """The factors of ``tensor`` the step's bases are made from."""
        raise NotImplementedError

    def bases(self, tensors: Sequence) -> List:
        """Each tensor's basis for this step (see :meth:`reused`), orthonormalized;
        same-shaped factors in one batched QR. A basis of several factors is a tuple."""
        groups = [self.reused(tensor) for tensor in tensors]
        flat = orthonormal_copies(factor for group in groups for factor in group)
        out, index = [], 0
        for group in groups:
            out.append(flat[index] if len(group) == 1 else tuple(flat[index:index + len(group)]))
            index += len(group)
        return out

    def encode_(self, tensor, basis, out: Tensor):
        """This rank's payload of ``A`` (``tensor.error`` holds ``A = M + E``)
        into ``out``; returns what :meth:`residual_` needs of it."""
        raise NotImplementedError

    def residual_(self, tensor, basis, factor) -> None:
        """``tensor.error`` (holding ``A``) becomes what ``factor`` does not carry."""
        raise NotImplementedError

    def commit_(self, tensor, averaged: Tensor) -> Tensor:
        """Keep the averaged payload's factors for the next step; returns the
        factor :meth:`reconstruct_` reads."""
        raise NotImplementedError

    def reconstruct_(self, tensor, factor: Tensor, basis, target: Tensor):
        """``G`` into ``target`` (n, m); returns tensors whose squared norms add
        up to ``||G||^2`` (read only where the user rescaled the gradients)."""
        raise NotImplementedError

    def counted_twice(self, tensor, basis, out: Tensor):
        """The part of the payload ``out`` its squared norm counts twice (the
        diagnostics' share kept), or None."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
