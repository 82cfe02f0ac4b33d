"""A byte budget turned into settings: ``Settings(budget=0.077)``.

A budget is the share of S-SGD's bytes (the gradients in their own dtype,
float32 for most models) one rank may send per step. :func:`fit_budget`
picks, for the model's parameter shapes, the settings that send the most
that fits: both factors every step (the adaptive defaults' scheme), the
other tensors in fp16, and

- at least the defaults' bytes: the defaults themselves (share 0.3, fp16);
- down to fp16 at share :data:`FP16_SHARE_FLOOR`: fp16 factors at the
  largest share that fits;
- below: the factors in 8-bit lanes (``int8_factors``) at the largest share
  that fits, at most the default's 0.3. At equal bytes the 8-bit factors at
  twice the share ended closer to S-SGD than fp16 ones on the recipes of
  docs/convergence.md ("Below a tenth of the bytes").

A budget below what rank 1 on every matrix sends raises ``ValueError``
naming that minimum. Pure: the same shapes give the same settings on every
rank, with no communication.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import torch

from .compression import compute_dtype
from .fusion import dense_bytes, make_layouts, sent_bytes

__all__ = ["FP16_SHARE_FLOOR", "SHARE_STEP", "fit_budget", "share_sent"]

#: The smallest share whose factors still go in fp16 under a budget.
FP16_SHARE_FLOOR = 0.2
#: Shares a budget chooses from: multiples of this, up to the default share.
SHARE_STEP = 0.005

Shapes = Sequence[Tuple[str, Tuple[int, ...], torch.dtype]]


def _candidate(share: float, int8: bool, min_compression_rate: float):
    from .settings import Settings
    return Settings(matrix_rank=share, int8_factors=int8, both_factors=True, fp16_wire=True,
                    min_compression_rate=min_compression_rate)


def share_sent(shapes: Shapes, settings) -> float:
    """The share of S-SGD's bytes a compressed step of ``settings`` (resolved,
    a fixed ``matrix_rank``) sends for parameters of ``shapes``."""
    layouts = make_layouts(shapes, settings.matrix_rank, settings.min_compression_rate,
                           payload_dtype=compute_dtype)
    dense = dense_bytes(layouts)
    if not dense:
        raise ValueError("a budget needs parameters to train")
    return sent_bytes(layouts, settings.codecs(), settings.fp16_wire) / dense


def _largest_share(shapes: Shapes, budget: float, int8: bool, rate: float,
                   cap: float) -> Optional[float]:
    """The largest multiple of SHARE_STEP up to ``cap`` whose step fits
    ``budget`` (bisection: the bytes grow with the share), or None."""
    steps = [round(SHARE_STEP * k, 6) for k in range(1, int(round(cap / SHARE_STEP)) + 1)]
    fits = lambda share: share_sent(shapes, _candidate(share, int8, rate)) <= budget
    if not fits(steps[0]):
        return None
    low, high = 0, len(steps) - 1          # steps[low] fits
    while low < high:
        middle = (low + high + 1) // 2
        if fits(steps[middle]):
            low = middle
        else:
            high = middle - 1
    return steps[low]


def fit_budget(settings, shapes: Shapes, default_share: float):
    """``settings`` (with ``budget`` set) with ``matrix_rank``, ``fp16_wire``,
    ``both_factors`` and ``int8_factors`` chosen for parameters of
    ``shapes`` ((name, shape, dtype) triples) and ``budget`` cleared, and
    the share of S-SGD's bytes the chosen settings send.

    Raises:
        ValueError: the budget is below what rank 1 on every matrix sends in
            8-bit lanes, or there are no parameters.
    """
    budget, rate = settings.budget, settings.min_compression_rate
    chosen = None
    if share_sent(shapes, _candidate(default_share, False, rate)) <= budget:
        chosen = (default_share, False)
    else:
        share = _largest_share(shapes, budget, False, rate, default_share)
        if share is not None and share >= FP16_SHARE_FLOOR:
            chosen = (share, False)
        else:
            share = _largest_share(shapes, budget, True, rate, default_share)
            if share is not None:
                chosen = (share, True)
    if chosen is None:
        least = share_sent(shapes, _candidate(1, True, rate))
        raise ValueError(f"budget={budget!r} is below what rank 1 on every matrix sends in 8-bit "
                         f"lanes: {least:.4f} of S-SGD's bytes for this model")
    share, int8 = chosen
    fitted = dataclasses.replace(settings, budget=None, matrix_rank=share, int8_factors=int8,
                                 both_factors=True, fp16_wire=True)
    return fitted, share_sent(shapes, fitted)
