"""A matrix rank per tensor, chosen from the gradients: ``matrix_rank="auto"``.

One rank for a whole model is a rule of thumb the user must know (4 for a
CNN, 32 for a transformer) and it is wrong inside each model: a gradient's
energy is spread over few directions in one layer and many in the next, and
the spread changes as training goes on (a transformer's gradients are
nearly rank one at initialization and spread out over the first hundreds of
steps). With :class:`AutoRank` hvd_acp measures it instead.

Until the first probe every compressed tensor has rank ``max_rank`` (the
budget): a gradient at initialization says little about training (a
transformer's is nearly rank one there). At *probe steps* (``first_interval``
steps after warm-up, then 50, 100, 200, 400, ... steps later, every
``max_interval`` steps at most) the step is exact: every rank sends its
gradient plus its residual ``M + E`` in full and the residual restarts from
zero. The averaged gradient is then identical
on every rank, so every rank computes the same thing from it, without
further communication:

1. the share of the averaged gradient's energy ``||G||^2`` that its best
   rank-``r`` approximation keeps, for ``r = 1 .. max_rank``
   (:func:`energy_curve`: a randomized range finder with one power
   iteration, a few small GEMMs per matrix);
2. the rank of each tensor: the smallest that keeps ``energy`` of it,
   between ``min_rank`` and ``max_rank`` (:func:`choose_rank`);
3. the factors of the next steps, started from that approximation
   (``Q`` its right singular vectors, ``P`` the left ones times the singular
   values), so that the first P step after a probe projects on the best
   basis there is.

Bytes: a probe step sends what S-SGD sends; between probes a tensor of
rank ``r`` sends ``n * r`` (P steps) or ``m * r`` (Q steps) elements, never
more than ``matrix_rank=max_rank`` would (the budget a user reads and sets;
:meth:`AutoRank.bytes_bound`). Everything here is pure torch, deterministic
on identical inputs, and testable in one process.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Dict, Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = ["AutoRank", "energy_curve", "choose_rank", "spectral_factors", "parse_matrix_rank"]

#: Default share of each probed gradient's energy that its factors keep.
DEFAULT_ENERGY = 0.9


@dataclasses.dataclass(frozen=True)
class AutoRank:
    """How ``matrix_rank="auto"`` chooses a rank per tensor.

    Attributes:
        energy: share of each probed gradient's energy (squared Frobenius
            norm) the chosen rank keeps, in (0, 1].
        max_rank: the largest rank of any tensor: the byte budget (never more
            than ``matrix_rank=max_rank`` sends between probes).
        min_rank: the smallest rank of any compressed tensor.
        first_interval: steps between the first probe and the second; the
            interval doubles after each probe ...
        max_interval: ... up to this many steps.
        oversample: extra columns of the randomized range finder.
        pay_residual: a probe step sends each rank's residual along with its
            gradient (``M + E``) and restarts the residual from zero; False
            sends ``M`` alone and keeps ``E`` for the compressed steps.
    """

    energy: float = DEFAULT_ENERGY
    max_rank: int = 32
    min_rank: int = 1
    first_interval: int = 25
    max_interval: int = 400
    oversample: int = 8
    pay_residual: bool = True

    def __post_init__(self) -> None:
        if (not isinstance(self.energy, numbers.Real) or isinstance(self.energy, bool)
                or not 0.0 < self.energy <= 1.0):
            raise ValueError(f"AutoRank energy must be a number in (0, 1], got {self.energy!r}")
        for key in ("max_rank", "min_rank", "first_interval", "max_interval"):
            value = getattr(self, key)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AutoRank {key} must be a positive int, got {value!r}")
        if self.min_rank > self.max_rank:
            raise ValueError(f"AutoRank min_rank ({self.min_rank}) exceeds max_rank "
                             f"({self.max_rank})")
        if self.max_interval < self.first_interval:
            raise ValueError(f"AutoRank max_interval ({self.max_interval}) is below "
                             f"first_interval ({self.first_interval})")
        if not isinstance(self.pay_residual, bool):
            raise ValueError(f"AutoRank pay_residual must be a bool, got {self.pay_residual!r}")
        if not isinstance(self.oversample, numbers.Integral) or self.oversample < 0:
            raise ValueError(f"AutoRank oversample must be an int >= 0, got "
                             f"{self.oversample!r}")

    # ------------------------------------------------------------ schedule
    def is_probe(self, since_warmup: int) -> bool:
        """Whether the step ``since_warmup`` steps after warm-up is a probe."""
        return since_warmup > 0 and self.last_probe(since_warmup) == since_warmup

    def last_probe(self, since_warmup: int) -> int:
        """The latest probe at or before step ``since_warmup`` (counted from
        warm-up's end), or -1 before the first one."""
        probe, gap = 0, self.first_interval
        while probe + gap <= since_warmup:
            probe += gap
            gap = min(2 * gap, self.max_interval)
        return probe if probe > 0 else -1

    def settings(self) -> Dict[str, float]:
        return dataclasses.asdict(self)

    def bytes_bound(self, shapes) -> int:
        """Elements per compressed step at most (P or Q, the larger), for
        matrices of ``shapes`` (n, m): what ``matrix_rank=max_rank`` sends."""
        return max(sum(n * min(self.max_rank, n, m) for n, m in shapes),
                   sum(m * min(self.max_rank, n, m) for n, m in shapes))


def parse_matrix_rank(matrix_rank) -> Tuple[Union[int, float], Optional[AutoRank]]:
    """``(fixed rank, None)`` for an int, ``(share, None)`` for a float in
    (0, 1) (a share of each matrix's smaller side), ``(max_rank, AutoRank)``
    for ``"auto"`` or an :class:`AutoRank`; ``ValueError`` for anything else."""
    if isinstance(matrix_rank, AutoRank):
        return matrix_rank.max_rank, matrix_rank
    if isinstance(matrix_rank, str) and matrix_rank == "auto":
        auto = AutoRank()
        return auto.max_rank, auto
    if isinstance(matrix_rank, numbers.Integral) and not isinstance(matrix_rank, bool) \
            and matrix_rank >= 1:
        return int(matrix_rank), None
    if isinstance(matrix_rank, float) and 0.0 < matrix_rank < 1.0:
        return matrix_rank, None
    raise ValueError(f"matrix_rank must be a positive int, got {matrix_rank!r}; or a float in "
                     "(0, 1), a share of each matrix's smaller side; or 'auto' (or an "
                     "hvd_acp.AutoRank) for a rank per tensor")


def _range_finder(matrix: Tensor, k: int, seed: int) -> Tensor:
    """An orthonormal (n, k) basis of ``matrix``'s dominant column space
    (Halko, Martinsson and Tropp, 2011: Gaussian test matrix, one power iteration)."""
    generator = torch.Generator().manual_seed(seed)
    omega = torch.randn(matrix.shape[1], k, generator=generator, dtype=torch.float64)
    y = matrix @ omega.to(matrix.dtype)
    y, _ = torch.linalg.qr(y.double())
    y = matrix @ (matrix.t() @ y.to(matrix.dtype))
    basis, _ = torch.linalg.qr(y.double())
    return basis.to(matrix.dtype)


def _svd_top(matrix: Tensor, k: int, seed: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Approximate top-``k`` singular triplets (U (n, k), S (k,), V (m, k)) in float64."""
    n, m = matrix.shape
    k = min(k, n, m)
    if min(n, m) <= k:
        u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
        return u, s, vh.t()
    basis = _range_finder(matrix, k, seed)                # (n, k)
    small = basis.t() @ matrix                            # (k, m)
    u_small, s, vh = torch.linalg.svd(small.double(), full_matrices=False)
    return basis.double() @ u_small, s, vh.t()


def energy_curve(matrix: Tensor, max_rank: int, *, oversample: int = 8,
                 seed: int = 0) -> Tensor:
    """Share of ``||matrix||^2`` kept by its best rank-r approximation, r = 1..max_rank.

    Args:
        matrix: shape (n, m).
        max_rank: the largest rank of interest (capped at ``min(n, m)``).
        oversample: extra columns of the randomized range finder.
        seed: seed of its Gaussian test matrix (same seed, same result).

    Returns:
        shape (min(max_rank, n, m),), float64, non-decreasing, in [0, 1]
        (all ones for a zero matrix: any rank keeps all of nothing).
    """
    k = min(max_rank, *matrix.shape)
    total = float(matrix.double().pow(2).sum())
    if k == 0:
        return torch.ones(0, dtype=torch.float64)
    if total == 0.0:
        return torch.ones(k, dtype=torch.float64)
    _, s, _ = _svd_top(matrix, k + oversample, seed)
    return (s[:k].pow(2).cumsum(0) / total).clamp_(0.0, 1.0)


def choose_rank(curve: Tensor, energy: float, min_rank: int, max_rank: int) -> int:
    """The smallest rank in [min_rank, max_rank] whose share in ``curve`` reaches ``energy``."""
    reached = (curve >= energy - 1e-12).nonzero()
    rank = int(reached[0]) + 1 if len(reached) else len(curve)
    return max(min_rank, min(rank, max_rank, max(len(curve), 1)))


def spectral_factors(matrix: Tensor, rank: int, *, oversample: int = 8,
                     seed: int = 0) -> Tuple[Tensor, Tensor]:
    """``(P, Q)`` with ``P @ Q.T`` the best rank-``rank`` approximation of ``matrix``.

    ``Q`` (m, rank) has orthonormal columns (right singular vectors), ``P``
    (n, rank) the left ones times the singular values: the warm start of
    ACP-SGD's factors after a probe. Columns beyond the matrix's own rank are
    zero in ``P``.
    """
    n, m = matrix.shape
    u, s, v = _svd_top(matrix, rank + oversample, seed)
    p = torch.zeros(n, rank, dtype=torch.float64)
    q = torch.zeros(m, rank, dtype=torch.float64)
    k = min(rank, s.shape[0])
    p[:, :k] = u[:, :k] * s[:k]
    q[:, :k] = v[:, :k]
    return p.to(matrix.dtype), q.to(matrix.dtype)
