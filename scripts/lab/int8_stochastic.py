"""Run a training script with ``int8_factors``' levels rounded stochastically: a study, not a
setting.

The library rounds each factor element to the nearest level, ``round(x / step)``; an element
smaller than half a step sends 0 and waits in the rank's residual until it has grown past
half a step, then goes out at once. Here it is rounded up or down at random,
``floor(x / step + u)`` with ``u`` uniform in [0, 1) and drawn on each rank from its own
generator (seeded by the rank and ``SR_SEED``, 0 by default): the level sent is the element
on average, so a small element goes out now and then instead of late and in one piece; the
residual keeps what the draw left out, as before. Every rank still decodes the same sums on
the same steps, so the replicas stay identical. Under any launcher::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 scripts/lab/int8_stochastic.py \\
        scripts/trainer_lm.py --method acp --int8-factors --matrix-rank 0.2 --seed 1 ...
"""
import os

import torch

import hvd_acp.codecs.int8 as int8
from run_script import run_script

_RANK = int(os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "0")))
_DRAWS = torch.Generator().manual_seed(1_000_003 * (_RANK + 1) + int(os.environ.get("SR_SEED", "0")))


def quantize_stochastic_(values, step, levels):
    """``floor(values / step + u)`` in place, clipped to ``[-levels, levels]``; NaN kept."""
    finite = torch.isfinite(values)
    noise = torch.rand(values.shape, generator=_DRAWS, dtype=values.dtype)
    values.div_(step).add_(noise).floor_().clamp_(-levels, levels)
    return values.masked_fill_(~finite, float("nan"))


int8.quantize_ = quantize_stochastic_       # what Int8PQCodec.encode_ rounds with
run_script()
