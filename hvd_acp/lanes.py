"""Integer lanes: a buffer of small integers summed across ranks by one
all-reduce of int32 words, one byte an integer on the wire.

Horovod all-reduces int32, int64 and floating tensors, not int8, and an
8-bit sum would overflow anyway. A rank's levels ``q`` (integers in
``[-L, L]``) travel four to a word, as the balanced base-256 digits of::

    word = q0 + 256 q1 + 256^2 q2 + 256^3 q3

Summing the words of the ranks sums each digit. While every digit's sum
stays within ``[-127, 127]``, which ``N * L <= 127`` guarantees for any
subset of the ``N`` ranks (so for any order of a ring or a tree), the sum
of words stays within int32 (``|word| <= 127 * 16843009 < 2^31``) and its
balanced digits are the digit sums, exactly: no carry is lost, nothing
overflows. :func:`unpack` reads them back.

One more digit after the levels counts the ranks whose payload was not
finite; where it is not 0 every rank reads NaN, as a float all-reduce
would give.

So each rank has ``L = 127 // N`` levels either side of zero
(:func:`levels_per_rank`: 63 at 2 ranks, 15 at 8, 3 at 32); a codec
quantizes its payload to them on a scale every rank knows, and the error
feedback keeps what rounding and clipping leave out.

Pure torch, any device; the words are int32 tensors a Horovod or
``torch.distributed`` all-reduce (sum) takes as they are.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["LANES_PER_WORD", "DIGIT_MAX", "levels_per_rank", "words_for", "pack", "unpack",
           "quantize_"]

#: Integers per int32 word.
LANES_PER_WORD = 4
#: The largest magnitude a digit's sum over all ranks may reach.
DIGIT_MAX = 127
_BASE = 256


def levels_per_rank(world_size: int) -> int:
    """``L``: the largest level a rank may send so that ``world_size`` ranks'
    sum of any digit stays within ``[-127, 127]``; ``ValueError`` beyond 127
    ranks, where not even one level is left."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    levels = DIGIT_MAX // world_size
    if levels < 1:
        raise ValueError(f"8-bit lanes hold the sum of at most {DIGIT_MAX} ranks' levels; "
                         f"{world_size} ranks need wider lanes (fp16 on the wire)")
    return levels


def words_for(numel: int) -> int:
    """int32 words that carry ``numel`` integers."""
    return math.ceil(numel / LANES_PER_WORD)


def pack(levels: Tensor) -> Tensor:
    """``levels`` (any shape and dtype, integral values in ``[-127, 127]``,
    or NaN) as int32 words, four a word in order, then one more digit: 1
    where any level is NaN (they travel as 0), else 0. The last word is
    padded with zeros. :func:`unpack` turns a sum of such words whose flag
    digit is not 0 into NaN everywhere, so a rank's overflow (a
    ``GradScaler``'s inf) reaches every rank."""
    flat = levels.reshape(-1)
    numel = flat.numel()
    count = words_for(numel + 1)
    digits = torch.zeros(count * LANES_PER_WORD, dtype=torch.int64, device=levels.device)
    bad = torch.isnan(flat)
    digits[:numel] = torch.where(bad, torch.zeros_like(flat), flat).to(torch.int64)
    digits[numel] = bad.any().to(torch.int64)
    digits = digits.view(count, LANES_PER_WORD)
    words = digits[:, LANES_PER_WORD - 1].clone()
    for lane in range(LANES_PER_WORD - 2, -1, -1):
        words.mul_(_BASE).add_(digits[:, lane])
    return words.to(torch.int32)


def unpack(words: Tensor, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The ``numel`` level sums in ``words`` (a sum of :func:`pack` words of
    ``numel`` levels, digit sums in ``[-127, 127]``), as a 1-D tensor of
    ``dtype``: NaN everywhere if any rank's levels held NaN."""
    rest = words.reshape(-1).to(torch.int64)
    digits = torch.empty(rest.numel(), LANES_PER_WORD, dtype=torch.int64, device=words.device)
    half = _BASE // 2
    for lane in range(LANES_PER_WORD):
        digit = torch.remainder(rest + half, _BASE) - half
        digits[:, lane] = digit
        rest = torch.div(rest - digit, _BASE, rounding_mode="floor")
    flat = digits.view(-1)
    sums = flat[:numel].to(dtype)
    return torch.where(flat[numel] != 0, torch.full_like(sums, float("nan")), sums)


def quantize_(values: Tensor, step: Tensor, levels: int) -> Tensor:
    """``values`` in place as integer levels: ``round(values / step)``
    clipped to ``[-levels, levels]`` (``step`` broadcasts, > 0), NaN where a
    value is not finite (so :func:`pack` flags it); returns ``values``. A
    level ``k`` stands for ``k * step``."""
    finite = torch.isfinite(values)
    values.div_(step).round_().clamp_(-levels, levels)
    return values.masked_fill_(~finite, float("nan"))
