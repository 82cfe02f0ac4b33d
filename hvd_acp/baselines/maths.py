"""The maths of the baselines: pure torch, no Horovod, testable in one process.

**DiLoCo** (Douillard et al., arXiv 2311.08105). Every ``H`` inner steps the
ranks average how far their replicas moved from the weights of the last outer
step, ``delta = mean_i(theta_global - theta_i)``, and the global weights take
one SGD step with Nesterov momentum on that "outer gradient"
(:func:`outer_step_`, the maths of ``torch.optim.SGD(nesterov=True)``)::

    b = delta                     (first outer step)
    b = mu * b + delta            (later ones)
    theta_global -= lr * (delta + mu * b)     (mu * b without Nesterov: lr * b)

With ``lr = 1`` and ``mu = 0`` that is plain averaging of the replicas.

**DeMo** (Peng, Kingma et al., arXiv 2411.19870), as this library runs it.
Each rank keeps its own momentum of every tensor of two or more dimensions,
cut into chunks of ``c`` consecutive elements (the last one padded with
zeros) and held in the frequency domain of an orthonormal DCT-II per chunk
(``D``, :func:`dct_matrix`; ``X D^T`` transforms the rows of ``X``). The
transform is linear, so accumulating there is the paper's ``m = beta m + g``
with one transform per step instead of two::

    M = beta * M + chunks(g) @ D.T                 (accumulate_)
    S = the k entries of largest |M| in each row   (select_: sent)
    M = M - S                                      (error feedback: exact)
    U = (sum over ranks of S) / N @ D              (decode: time domain)
    w = w * (1 - lr * wd) - lr * sign(U)

What a rank sends per chunk is ``k`` values and their ``k`` positions in the
chunk (one byte each for chunks up to 256 elements: :func:`index_dtype`),
packed with every other tensor's into one byte buffer for one all-gather
(:func:`pack`, :func:`unpack`).

**TSR** (Dang et al., arXiv 2602.08007), as this library runs it. A matrix
``G`` of shape (n, m) (a tensor of two or more dimensions, its rows
``shape[0]``) keeps two orthonormal bases ``U`` (n, r) and ``V`` (m, r),
identical on every rank, and Adam's moments ``M``, ``S`` of its r x r core.
Per step the ranks average only the core of their gradients; every ``K``
steps they also average two sketches of them, from Gaussian draws every rank
makes alike (:func:`sketch_draws`), and take new bases from those::

    C = mean_i(U^T G_i V)                                   (project: sent)
    M = b1 M + (1 - b1) C,   S = b2 S + (1 - b2) C * C       (core_adam_)
    w = w (1 - lr wd) - lr scale U (M^ / (sqrt(S^) + eps)) V^T
    every K steps:
    Y = mean_i(G_i Omega),   Z = mean_i(G_i^T Psi)           (sketches: sent)
    U' = qr(Y).Q,   V' = qr(Z).Q                             (orthonormal_basis)
    R1 = U'^T U,   R2 = V^T V'
    M = R1 M R2,   S = (R1 * R1) S (R2 * R2)                 (rotate_moments)

``M^`` and ``S^`` are the moments over their bias corrections, with the
number of core steps taken. A rank sends ``r^2 + (n + m) r / K`` elements
per step and matrix over a refresh period (:func:`elements_per_step`); a
matrix for which that is no fewer than ``n m`` is averaged exactly instead
(:func:`compresses`).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["outer_step_", "dct_matrix", "index_dtype", "num_chunks", "chunked", "accumulate_",
           "select_", "scatter_selected_", "decode", "sign_step_", "pack", "unpack",
           "payload_layout", "matrix_view", "core_rank_of", "compresses", "elements_per_step",
           "sketch_seed", "sketch_draws", "sketches", "project", "orthonormal_basis",
           "core_adam_", "rotate_moments"]


# ------------------------------------------------------------------- DiLoCo
def outer_step_(weights: Tensor, delta: Tensor, momentum_buffer: Optional[Tensor], *,
                lr: float, momentum: float, nesterov: bool) -> Tensor:
    """One outer SGD step of DiLoCo on ``weights`` (the global weights).

    Args:
        weights: the weights of the last outer step, identical on every rank;
            modified in place.
        delta: the averaged outer gradient ``mean_i(weights - local_i)``,
            same shape.
        momentum_buffer: the buffer of the previous outer steps (modified in
            place), or None at the first one.
        lr: outer learning rate.
        momentum: outer momentum ``mu`` (0: none).
        nesterov: Nesterov's form (the paper's).

    Returns:
        The momentum buffer (a new tensor at the first step), as
        ``torch.optim.SGD`` keeps it (no dampening).
    """
    if momentum:
        if momentum_buffer is None:
            momentum_buffer = delta.detach().clone()
        else:
            momentum_buffer.mul_(momentum).add_(delta)
        update = delta.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    else:
        update = delta
    weights.sub_(update, alpha=lr)
    return momentum_buffer


# --------------------------------------------------------------------- DeMo
def dct_matrix(size: int, dtype: torch.dtype = torch.float32,
               device: Optional[torch.device] = None) -> Tensor:
    """The orthonormal DCT-II matrix ``D`` of shape (size, size).

    Row ``f`` is frequency ``f``: ``D[f, i] = s_f cos(pi (i + 1/2) f / size)``
    with ``s_0 = sqrt(1/size)`` and ``s_f = sqrt(2/size)`` otherwise, so
    ``D @ D.T = I``; ``x @ D.T`` is scipy's ``dct(x, type=2, norm="ortho")``
    of each row and ``c @ D`` its inverse. Built in float64, then cast.
    """
    freq = torch.arange(size, dtype=torch.float64)[:, None]
    index = torch.arange(size, dtype=torch.float64)[None, :]
    matrix = torch.cos(math.pi * (index + 0.5) * freq / size) * math.sqrt(2.0 / size)
    matrix[0] /= math.sqrt(2.0)
    return matrix.to(dtype=dtype, device=device)


def index_dtype(chunk_size: int) -> torch.dtype:
    """The smallest integer type that holds a position in a chunk of ``chunk_size``."""
    if chunk_size <= 256:
        return torch.uint8
    if chunk_size <= 2 ** 15:
        return torch.int16
    return torch.int32


def num_chunks(numel: int, chunk_size: int) -> int:
    """Chunks of ``chunk_size`` elements that hold ``numel`` (the last one padded)."""
    return -(-numel // chunk_size)


def chunked(tensor: Tensor, chunk_size: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``tensor`` flattened into rows of ``chunk_size``, the last row padded with zeros.

    Returns:
        A new tensor of shape (num_chunks(numel, chunk_size), chunk_size), in
        ``dtype`` (default: the tensor's).
    """
    flat = tensor.detach().reshape(-1)
    rows = num_chunks(flat.numel(), chunk_size)
    out = flat.new_zeros(rows * chunk_size, dtype=dtype or flat.dtype)
    out[:flat.numel()] = flat
    return out.view(rows, chunk_size)


def accumulate_(momentum: Tensor, grad: Optional[Tensor], decay: float, dct: Tensor) -> Tensor:
    """``momentum = decay * momentum + chunks(grad) @ dct.T``, in place.

    Args:
        momentum: shape (chunks, c), this rank's momentum in the frequency domain.
        grad: this rank's gradient, any shape with at most ``chunks * c``
            elements; None counts as zero.
        decay: ``beta``.
        dct: :func:`dct_matrix` of size c, in the momentum's dtype and device.
    """
    momentum.mul_(decay)
    if grad is not None:
        momentum.addmm_(chunked(grad, momentum.shape[1], momentum.dtype), dct.t())
    return momentum


def select_(momentum: Tensor, top_k: int) -> Tuple[Tensor, Tensor]:
    """The ``top_k`` coefficients of largest magnitude in each row, taken out
    of ``momentum`` (set to zero there: the error feedback).

    Args:
        momentum: shape (chunks, c); modified in place.
        top_k: coefficients per row, ``1 <= top_k <= c``.

    Returns:
        ``(positions, values)``, each of shape (chunks, top_k): int64 column
        positions and the values they held. ``values`` scattered at
        ``positions`` plus the new ``momentum`` is the old one, bit for bit.
    """
    positions = momentum.abs().topk(top_k, dim=1, sorted=False).indices
    values = momentum.gather(1, positions)
    momentum.scatter_(1, positions, 0.0)
    return positions, values


def scatter_selected_(out: Tensor, positions: Tensor, values: Tensor) -> Tensor:
    """``out[row, positions[row, j]] += values[row, j]``, in place.

    One rank's positions are distinct within a row, so no two additions of a
    call meet and the result does not depend on the order of the additions
    (nor, on a GPU, on the scheduling of its atomics).
    """
    return out.scatter_add_(1, positions, values)


def decode(selections: Sequence[Tuple[Tensor, Tensor]], chunks: int, dct: Tensor) -> Tensor:
    """The mean over ranks of what they sent, back in the time domain.

    Args:
        selections: every rank's ``(positions, values)`` for one tensor, in
            rank order (each (chunks, k); positions any integer type).
        chunks: rows of the tensor's momentum.
        dct: :func:`dct_matrix` of size c, in the values' dtype and device.

    Returns:
        Shape (chunks, c): ``(sum_i S_i / N) @ dct``. The ranks are added in
        rank order, so every rank computes the same bits.
    """
    total = dct.new_zeros(chunks, dct.shape[0])
    for positions, values in selections:
        scatter_selected_(total, positions.long(), values)
    total.div_(len(selections))
    return total @ dct


def sign_step_(weights: Tensor, update: Tensor, *, lr: float, weight_decay: float) -> Tensor:
    """``weights = weights * (1 - lr * weight_decay) - lr * sign(update)``, in place.

    Args:
        weights: the parameter, any shape.
        update: shape (chunks, c) from :func:`decode`; its first
            ``weights.numel()`` elements (row by row) are ``weights``'s.
    """
    if weight_decay:
        weights.mul_(1.0 - lr * weight_decay)
    direction = update.reshape(-1)[:weights.numel()].sign().view_as(weights)
    return weights.add_(direction.to(weights.dtype), alpha=-lr)


# ----------------------------------------------------------------- packing
def pack(parts: Sequence[Tensor]) -> Tensor:
    """``parts`` (any dtypes) as one flat uint8 tensor, their bytes one after the other."""
    return torch.cat([part.contiguous().reshape(-1).view(torch.uint8) for part in parts])


def unpack(buffer: Tensor, layout: Sequence[Tuple[Tuple[int, ...], torch.dtype]]) -> List[Tensor]:
    """The inverse of :func:`pack`: one tensor per ``(shape, dtype)`` of ``layout``.

    Each part is copied out of ``buffer`` (a view could start at an offset
    its dtype's alignment does not allow).
    """
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size()
             for shape, dtype in layout]
    if sum(sizes) != buffer.numel():
        raise ValueError(f"a buffer of {buffer.numel()} bytes does not hold the layout's "
                         f"{sum(sizes)}")
    parts, offset = [], 0
    for (shape, dtype), size in zip(layout, sizes):
        parts.append(buffer[offset:offset + size].clone().view(dtype).view(shape))
        offset += size
    return parts


def payload_layout(shapes: Dict[str, Tuple[int, ...]], value_dtype: Dict[str, torch.dtype],
                   top_k: int, chunk_size: int) -> List[Tuple[Tuple[int, ...], torch.dtype]]:
    """The ``(shape, dtype)`` of every part one rank packs: every tensor's
    values (in the order of ``shapes``), then every tensor's positions."""
    rows = {name: num_chunks(math.prod(shape), chunk_size) for name, shape in shapes.items()}
    return ([((rows[name], top_k), value_dtype[name]) for name in shapes]
            + [((rows[name], top_k), index_dtype(chunk_size)) for name in shapes])


# ---------------------------------------------------------------------- TSR
def matrix_view(shape: Sequence[int]) -> Tuple[int, int]:
    """``(n, m)``: a tensor of ``shape`` (two or more dimensions) as a matrix,
    its rows ``shape[0]``, every other dimension flattened into its columns."""
    return shape[0], math.prod(shape[1:])


def core_rank_of(n: int, m: int, core_rank: int) -> int:
    """``r``, the side of an (n, m) matrix's core: ``core_rank``, at most ``min(n, m)``."""
    return min(core_rank, n, m)


def elements_per_step(n: int, m: int, r: int, refresh_period: int) -> float:
    """Elements a rank sends per step for an (n, m) matrix of core side ``r``,
    over a refresh period: its core every step, its two sketches every
    ``refresh_period`` steps."""
    return r * r + (n + m) * r / refresh_period


def compresses(n: int, m: int, r: int, refresh_period: int) -> bool:
    """Whether the core and the sketches send fewer elements than the matrix."""
    return elements_per_step(n, m, r, refresh_period) < n * m


def sketch_seed(seed: int, step: int, index: int) -> int:
    """The seed of the Gaussian draws of the tensor at ``index`` (its position
    among the parameters) at ``step``, the same on every rank.

    ``7919 step + index`` offset by a multiple of ``seed``: two tensors of one
    step, or one tensor at two steps, draw differently unless the model has
    more than 7,919 parameter tensors.
    """
    return (seed * 0x9E3779B97F4A7C15 + 7919 * step + index) % 2 ** 63


def sketch_draws(n: int, m: int, r: int, seed: int, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None) -> Tuple[Tensor, Tensor]:
    """``(Omega, Psi)`` of shapes (m, r) and (n, r): standard Gaussian, drawn
    in that order in float32 on the CPU from a generator seeded ``seed``
    (:func:`sketch_seed`), then cast: the same bits on every rank and device."""
    generator = torch.Generator().manual_seed(seed)
    omega = torch.randn(m, r, generator=generator)
    psi = torch.randn(n, r, generator=generator)
    return omega.to(dtype=dtype, device=device), psi.to(dtype=dtype, device=device)


def sketches(grad: Tensor, omega: Tensor, psi: Tensor) -> Tuple[Tensor, Tensor]:
    """``(G Omega, G^T Psi)``, shapes (n, r) and (m, r), of ``grad`` (n, m)."""
    return grad @ omega, grad.t() @ psi


def project(grad: Tensor, U: Tensor, V: Tensor) -> Tensor:
    """The core ``U^T G V`` (r, r) of ``grad`` (n, m) on the bases ``U`` (n, r), ``V`` (m, r)."""
    return U.t() @ grad @ V


def orthonormal_basis(sketch: Tensor) -> Tensor:
    """``Q`` of the reduced QR decomposition of ``sketch`` (k, r): orthonormal
    columns that span it (Householder's, orthonormal even where ``sketch``
    has a lower rank)."""
    return torch.linalg.qr(sketch, mode="reduced").Q


def core_adam_(weights: Tensor, core: Tensor, U: Tensor, V: Tensor, exp_avg: Tensor,
               exp_avg_sq: Tensor, core_steps: int, *, lr: float, betas: Tuple[float, float],
               eps: float, weight_decay: float, scale: float) -> Tensor:
    """One Adam step in the core space, in place on ``weights``, ``exp_avg``, ``exp_avg_sq``.

    ``M = b1 M + (1 - b1) C``, ``S = b2 S + (1 - b2) C * C``; then
    ``w = w (1 - lr weight_decay) - lr scale U (M^ / (sqrt(S^) + eps)) V^T``
    with ``M^ = M / (1 - b1^t)``, ``S^ = S / (1 - b2^t)``, ``t = core_steps``.

    Args:
        weights: the parameter, any shape of ``n m`` elements (viewed (n, m)).
        core: the averaged core ``C`` (r, r).
        U, V: the bases the core was taken on, (n, r) and (m, r).
        exp_avg, exp_avg_sq: ``M`` and ``S`` (r, r).
        core_steps: core steps taken with this one (>= 1).
        lr, betas, eps, weight_decay: Adam's (``weight_decay`` decoupled, as AdamW's).
        scale: the update's factor (GaLore's alpha).
    """
    beta1, beta2 = betas
    exp_avg.mul_(beta1).add_(core, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(core, core, value=1 - beta2)
    direction = (exp_avg / (1 - beta1 ** core_steps)) / (
        (exp_avg_sq / (1 - beta2 ** core_steps)).sqrt() + eps)
    update = U @ direction @ V.t()
    if weight_decay:
        weights.mul_(1.0 - lr * weight_decay)
    return weights.sub_((lr * scale * update).view_as(weights).to(weights.dtype))


def rotate_moments(exp_avg: Tensor, exp_avg_sq: Tensor, U_old: Tensor, V_old: Tensor,
                   U_new: Tensor, V_new: Tensor) -> Tuple[Tensor, Tensor]:
    """The core moments moved from the old bases to the new ones.

    ``R1 = U_new^T U_old``, ``R2 = V_old^T V_new``; ``M' = R1 M R2`` and
    ``S' = (R1 * R1) S (R2 * R2)`` (elementwise squares: ``S'`` stays
    non-negative). Identical bases leave both as they are.

    Returns:
        New tensors ``(M', S')``, each (r, r).
    """
    R1, R2 = U_new.t() @ U_old, V_old.t() @ V_new
    return R1 @ exp_avg @ R2, (R1 * R1) @ exp_avg_sq @ (R2 * R2)
