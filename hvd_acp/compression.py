"""Compression maths of ACP-SGD: pure torch, no Horovod, no CUDA.

A gradient of shape ``shape`` is viewed as a matrix ``M`` of shape (n, m)
with ``n = shape[0]`` and ``m = numel / n``. ACP-SGD keeps two factors,
``P`` (n, r) and ``Q`` (m, r), identical on every rank, and a local
error-feedback residual ``E`` (n, m).

P step (``Q`` from the previous step is orthonormalized into ``Qh``)::

    A   = M + E
    P_i = A @ Qh                      # sent: n * r elements
    E   = A - P_i @ Qh.T              # this rank's residual (local_residual_)
    G   = mean_i(P_i) @ Qh.T          # gradient handed to the optimizer

The Q step is the same computation on the transposed matrices with the roles
of the factors swapped, which is why the same functions serve both: the
caller passes ``M.T`` / ``E.T`` views and ``Ph`` for a Q step.

A step of both factors (``Phase.PQ``, the default for adaptive optimizers)
sends ``P_i = A @ Qh`` and ``Q_i = A.T @ Ph``, each on the other factor's
basis from the previous step, in one all-reduce of (n + m) r elements: the
projection of ``A`` on the tangent space of both bases, which takes up to
2r directions of the current gradient and refreshes both bases every step::

    G = P @ Qh.T + Ph @ (Q.T - (Ph.T @ P) @ Qh.T)
    E = A - (the same from P_i, Q_i) = (I - Ph Ph.T) A (I - Qh Qh.T)

The residual is this rank's own unsent part (the paper's form), computed in
the backward hook without waiting for the all-reduce. It is what the rank
still owes the model, which step-ahead error feedback
(:func:`step_ahead_shift`) relies on; at full rank it is zero, so ACP-SGD
is then exactly S-SGD.
"""
from __future__ import annotations

import enum
import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "Phase",
    "matrix_shape",
    "factor_rank",
    "should_compress",
    "compute_dtype",
    "orthonormalize_",
    "orthonormal_copies",
    "project_",
    "compress_",
    "local_residual_",
    "compress_columns_",
    "local_residual_columns_",
    "reconstruct_",
    "compress_both_",
    "local_residual_both_",
    "reconstruct_both_",
    "init_factor",
    "step_ahead_shift",
    "adaptive_shift_denom",
    "phase_of",
]


class Phase(enum.Enum):
    """Which payload a step all-reduces.

    ``P`` and ``Q`` alternate after every optimizer step; ``PQ`` sends both
    factors every step (``both_factors``). ``DENSE`` is the exact averaging
    of full gradients used during warm-up steps.
    """

    P = "P"
    Q = "Q"
    PQ = "PQ"
    DENSE = "dense"

    def flipped(self) -> "Phase":
        """The phase of the next compressed step (``DENSE`` and ``PQ`` are not flipped)."""
        if self is Phase.P:
            return Phase.Q
        if self is Phase.Q:
            return Phase.P
        return self


def phase_of(step_count: int, warmup_steps: int, both_factors: bool = False) -> Phase:
    """The phase of step ``step_count``: DENSE during warm-up, then P, Q, P,
    ... (or PQ, PQ, ... with ``both_factors``)."""
    compressed_steps = step_count - warmup_steps
    if compressed_steps < 0:
        return Phase.DENSE
    if both_factors:
        return Phase.PQ
    return Phase.P if compressed_steps % 2 == 0 else Phase.Q


def matrix_shape(shape: Sequence[int]) -> Tuple[int, int]:
    """(n, m) of the matrix view of a tensor of ``shape``: n = shape[0]."""
    if len(shape) == 0:
        return 1, 1
    n = int(shape[0])
    numel = 1
    for s in shape:
        numel *= int(s)
    return n, (numel // n if n else 0)


def factor_rank(n: int, m: int, matrix_rank: Union[int, float]) -> int:
    """The rank r of the factors: ``min(matrix_rank, n, m)``; a float
    ``matrix_rank`` in (0, 1) is a share of ``min(n, m)``, rounded up."""
    if isinstance(matrix_rank, float):
        # Rounded first: 0.3 * 10 is 3.0000000000000004 in binary, rank 3 not 4.
        return math.ceil(round(matrix_rank * min(n, m), 9))
    return max(0, min(matrix_rank, n, m))


def should_compress(shape: Sequence[int], matrix_rank: int,
                    min_compression_rate: float) -> bool:
    """Whether a tensor of ``shape`` is sent as factors.

    Tensors of fewer than two dimensions are never compressed. A matrix is
    compressed when ``(n + m) * r * min_compression_rate <= n * m``, i.e. when
    sending both factors is at least ``min_compression_rate`` times smaller
    than sending the matrix.
    """
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    r = factor_rank(n, m, matrix_rank)
    if r == 0:
        return False
    return (n + m) * r * min_compression_rate <= n * m


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype in which factors and error feedback of a parameter are kept.

    fp16 and bf16 gradients are compressed in float32: the QR factorization
    has no half-precision CPU kernel and the error-feedback sum would lose
    most of its bits in half precision. Other floating dtypes are kept.
    """
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def init_factor(rows: int, cols: int, generator: torch.Generator,
                dtype: torch.dtype, device: torch.device) -> Tensor:
    """A random (rows, cols) factor drawn from ``generator``.

    Drawn on the CPU in float64 so that every rank (and every device type)
    gets the same values from the same seed, then cast.
    """
    out = torch.randn(rows, cols, generator=generator, dtype=torch.float64)
    return out.to(dtype=dtype, device=device)


def orthonormalize_(matrices: Iterable[Tensor]) -> None:
    """Orthonormalize the columns of each matrix in place.

    Matrices of the same shape, dtype and device are stacked and factorized
    with one batched reduced QR call, which is much cheaper than one call per
    matrix for the many same-shaped layers of real models.

    Args:
        matrices: tensors of shape (k, r) with k >= r; modified in place so
            that ``M.T @ M == I`` (up to rounding) when ``M`` has full column
            rank. A zero matrix becomes a fixed orthonormal basis, never NaN.
    """
    matrices = list(matrices)
    for mat, ortho in zip(matrices, orthonormal_copies(matrices)):
        if ortho is not mat:
            mat.copy_(ortho)


def orthonormal_copies(matrices: Iterable[Tensor]) -> List[Tensor]:
    """Matrices with the orthonormalized columns of each of ``matrices``, in order.

    The inputs are left alone. Matrices of the same shape, dtype and device
    are stacked and factorized with one batched reduced QR call; each result
    is a view of its batch's output (an empty matrix is returned as it is).
    """
    matrices = list(matrices)
    result: List[Optional[Tensor]] = list(matrices)
    groups: Dict[tuple, List[int]] = {}
    for index, mat in enumerate(matrices):
        if mat.numel():
            groups.setdefault((tuple(mat.shape), mat.dtype, mat.device), []).append(index)
    for indices in groups.values():
        q, _ = torch.linalg.qr(torch.stack([matrices[i] for i in indices]), mode="reduced")
        for index, ortho in zip(indices, q.unbind(0)):
            result[index] = ortho
    return result


def project_(matrix: Tensor, basis: Tensor, out: Tensor) -> None:
    """Write ``matrix @ basis`` (shape (a, r)) into ``out``.

    Two layouts, by what the CPU GEMM does fastest with a thin ``basis``: a
    row-major ``matrix`` (a P step) and a column-major ``basis`` (the views
    :func:`orthonormal_copies` returns) go straight into ``out``, one call;
    otherwise (a transposed view, or a row-major ``basis``) it is
    ``(basis.T @ matrix.T).T``, two to five times faster there than
    ``matrix @ basis``, and copied into ``out``. The layouts are read from
    the strides, which costs no operator call.
    """
    if matrix.is_contiguous() and _column_major(basis) and out.is_contiguous():
        torch.mm(matrix, basis, out=out)
    else:
        out.copy_(_transposed(torch.mm(_transposed(basis), _transposed(matrix))))


def compress_(grad: Optional[Tensor], error: Tensor, basis: Tensor, out: Tensor) -> None:
    """This rank's factor for one step of ACP-SGD, with error feedback.

    Args:
        grad: shape (a, b), this rank's gradient matrix (``M`` for a P step,
            ``M.T`` for a Q step); ``None`` for a zero gradient.
        error: shape (a, b), the residual ``E`` (or ``E.T``); modified in
            place to hold ``A = grad + error``, until :func:`local_residual_`
            subtracts what this rank sends.
        basis: shape (b, r), orthonormal columns (``Qh`` or ``Ph``).
        out: shape (a, r), receives ``A @ basis``.
    """
    if grad is not None:
        error.add_(grad)
    project_(error, basis, out)


def local_residual_(error: Tensor, factor: Tensor, basis: Tensor,
                    basis_t: Optional[Tensor] = None) -> None:
    """``E = A - factor @ basis.T``: what this rank's factor does not carry.

    Args:
        error: shape (a, b), holds ``A`` (see :func:`compress_`); modified
            in place.
        factor: shape (a, r), this rank's factor ``A @ basis`` before the
            all-reduce (``P_i``, or ``Q_i`` for a Q step on ``E.T``).
        basis: shape (b, r), the basis it was projected on.
        basis_t: ``basis.T``, if the caller has that view already.

    Each rank keeps its own unsent part, whatever the reduction (average or
    sum): the identity ``M + E_before == factor @ basis.T + E_after`` holds
    per rank. The sum over ranks is what later factors see, and what a
    residual taken against the averaged gradient would give too; the rank's
    own part is what step-ahead error feedback needs, and it is bounded by
    the projection (zero at full rank), where a residual against the
    average also accumulates the rank's deviation from the mean.
    """
    error.addmm_(factor, _transposed(basis) if basis_t is None else basis_t, alpha=-1)


def compress_columns_(grad: Optional[Tensor], error: Tensor, basis: Tensor,
                      out: Tensor) -> Tensor:
    """A Q step on the untransposed matrices: ``out = A.T @ basis``.

    The same maths as :func:`compress_` on ``grad.T`` / ``error.T``
    (``A = M + E``, ``Q_i = A^T Ph``), written for the row-major (a, b)
    matrices: ``Q_i^T = Ph^T A`` is one GEMM in the layout the CPU computes
    fastest, and :func:`local_residual_columns_` reuses it as it is, so
    nothing is transposed but two views.

    Args:
        grad: shape (a, b), this rank's gradient matrix ``M``; ``None`` for zero.
        error: shape (a, b), the residual ``E``; modified in place to hold ``A``.
        basis: shape (a, r), ``Ph``.
        out: shape (b, r), receives ``A.T @ basis``.

    Returns:
        ``Q_i^T``, shape (r, b), for :func:`local_residual_columns_`.
    """
    if grad is not None:
        error.add_(grad)
    factor_t = torch.mm(_transposed(basis), error)
    out.copy_(_transposed(factor_t))
    return factor_t


def local_residual_columns_(error: Tensor, basis: Tensor, factor_t: Tensor) -> None:
    """``E = A - basis @ factor_t``: :func:`local_residual_` of a Q step on the
    untransposed residual (``error`` (a, b) holds ``A``, ``basis`` (a, r) is
    ``Ph``, ``factor_t`` (r, b) is ``Q_i^T`` from :func:`compress_columns_`)."""
    error.addmm_(basis, factor_t, alpha=-1)


def reconstruct_(target: Tensor, left: Tensor, right: Tensor,
                 right_t: Optional[Tensor] = None) -> None:
    """Write ``left @ right.T`` into ``target`` (shape (a, b)), in place.

    P step: ``G = P @ Qh.T``; Q step: ``G = Ph @ Q.T``. One GEMM writing
    ``target`` (one pass over it; as fast on the CPU as zeroing it and
    accumulating, which takes two). ``right_t`` is ``right.T`` if the caller
    has that view already.
    """
    torch.mm(left, _transposed(right) if right_t is None else right_t, out=target)


def compress_both_(grad: Optional[Tensor], error: Tensor, p_basis: Tensor, q_basis: Tensor,
                   out: Tensor) -> None:
    """This rank's two factors for a step of both factors, with error feedback.

    Args:
        grad: shape (n, m), this rank's gradient matrix ``M``; ``None`` for zero.
        error: shape (n, m), the residual ``E``; modified in place to hold
            ``A = M + E`` until :func:`local_residual_both_`.
        p_basis: shape (n, r), ``Ph``; q_basis: shape (m, r), ``Qh``.
        out: shape (n + m, r): rows ``:n`` receive ``P_i = A @ Qh``, rows
            ``n:`` receive ``Q_i = A.T @ Ph``.
    """
    if grad is not None:
        error.add_(grad)
    n = error.shape[0]
    project_(error, q_basis, out[:n])
    out[n:].copy_(_transposed(torch.mm(_transposed(p_basis), error)))


def _tangent_rest(p: Tensor, q_t: Tensor, p_basis: Tensor, q_basis: Tensor) -> Tensor:
    """``Q^T - (Ph^T P) Qh^T``, shape (r, m): the Q side's part outside ``Qh``."""
    core = torch.mm(_transposed(p_basis), p)
    return torch.addmm(q_t, core, _transposed(q_basis), alpha=-1)


def local_residual_both_(error: Tensor, p: Tensor, q_t: Tensor, p_basis: Tensor,
                         q_basis: Tensor) -> None:
    """``E = A - P_i Qh^T - Ph (Q_i^T - Ph^T P_i Qh^T)``, which is
    ``(I - Ph Ph^T) A (I - Qh Qh^T)``: what neither factor carries.

    Args:
        error: shape (n, m), holds ``A`` (see :func:`compress_both_`); modified in place.
        p: shape (n, r), ``P_i``; q_t: shape (r, m), ``Q_i^T``.
        p_basis, q_basis: ``Ph`` (n, r) and ``Qh`` (m, r).
    """
    rest = _tangent_rest(p, q_t, p_basis, q_basis)
    error.addmm_(p, _transposed(q_basis), alpha=-1)
    error.addmm_(p_basis, rest, alpha=-1)


def reconstruct_both_(target: Tensor, p: Tensor, q: Tensor, p_basis: Tensor,
                      q_basis: Tensor) -> Tuple[Tensor, Tensor]:
    """``G = P Qh^T + Ph (Q^T - Ph^T P Qh^T)`` into ``target`` (n, m), from the
    averaged ``P`` (n, r) and ``Q`` (m, r).

    Returns:
        ``(P, Q^T - Ph^T P Qh^T)``: the two terms are orthogonal (the second
        vanishes on ``Qh``, up to the rounding of the average), so their
        squared norms add up to ``||G||^2`` without reading ``G``.
    """
    rest = _tangent_rest(p, _transposed(q), p_basis, q_basis)
    torch.mm(p, _transposed(q_basis), out=target)
    target.addmm_(p_basis, rest)
    return p, rest


def _transposed(matrix: Tensor) -> Tensor:
    """``matrix.T`` as one ``transpose`` call (``Tensor.t`` dispatches one more)."""
    return matrix.transpose(0, 1)


def _column_major(matrix: Tensor) -> bool:
    """Whether ``matrix.T`` is contiguous, read from the strides (no operator call)."""
    rows, cols = matrix.shape
    return ((rows <= 1 or matrix.stride(0) == 1)
            and (cols <= 1 or matrix.stride(1) == rows))


def step_ahead_shift(error: Tensor, lr: float, step_ahead: float, share: float = 1.0,
                     denom: Optional[Tensor] = None) -> Tensor:
    """How far ahead of the weights this rank computes its next gradient.

    The residual ``E`` is gradient this rank still owes the model: later
    steps apply it, amplified by momentum. Computing the next gradient at
    ``w - shift`` instead of ``w`` (step-ahead error feedback, Xu, Huo and
    Huang) makes it see the weights the owed part will lead to, so the
    residual no longer feeds back one step late. ACP-SGD projects each
    gradient onto a basis found from the previous step; without the shift,
    the part it misses waits in ``E`` and momentum turns its late release
    into an oscillation at a large learning rate.

    Args:
        error: shape (n, m), this rank's residual ``E`` (see
            :func:`local_residual_`).
        lr: the learning rate of the parameter's group.
        step_ahead: ``a``, the multiple of one step's worth of ``E``.
        share: this rank's part of an all-reduced result (1 when it
            averages, ``1 / N`` when it sums over N ranks): ``E / share`` is
            the residual in the units of the applied gradient.
        denom: optional, shape (n, m): an adaptive optimizer's per-element
            divisor (:func:`adaptive_shift_denom`), so that the shift is the
            step the optimizer would take for ``E``.

    Returns:
        A new tensor of shape (n, m): ``lr * a * E / share`` (divided by
        ``denom`` if given).
    """
    shift = error.mul(lr * step_ahead / share)
    if denom is not None:
        shift.div_(denom)
    return shift


def adaptive_shift_denom(error: Tensor, exp_avg_sq: Tensor, beta2: float, step: float,
                         eps: float, share: float = 1.0) -> Tensor:
    """Adam's divisor for the step it would take if handed the residual.

    After ``step`` updates Adam holds ``v``; given ``E / share`` as its next
    gradient it would divide by ``sqrt(v_hat') + eps`` with ``v' = beta2 v +
    (1 - beta2) (E / share)^2`` and ``v_hat' = v' / (1 - beta2^(step + 1))``.
    Where ``E`` is small against the gradients so far this is, a few hundred
    steps in, Adam's ``sqrt(v_hat) + eps``; where the gradient so far was
    tiny (an element the first compressed steps sent little of) it grows
    with ``E``, so the
    shift ``E / (share * denom)`` stays within ``sqrt((1 - beta2^(step + 1))
    / (1 - beta2))``: 1.4 after one step, 32 in the long run at beta2 0.999.

    Args:
        error: this rank's residual ``E``, in the shape of ``exp_avg_sq``.
        exp_avg_sq: Adam's second moment ``v`` of the parameter.
        beta2, step, eps: Adam's ``betas[1]``, its step count (> 0) and ``eps``.
        share: as in :func:`step_ahead_shift`.

    Returns:
        A new tensor of ``exp_avg_sq``'s shape.
    """
    v = error.square().mul_((1.0 - beta2) / (share * share))
    v.add_(exp_avg_sq, alpha=beta2)
    return v.div_(1.0 - beta2 ** (step + 1)).sqrt_().add_(eps)
