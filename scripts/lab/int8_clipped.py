"""Run a training script and print how many of the 8-bit factors' elements are clipped: a
study, not a setting.

Every 100 calls of ``Int8PQCodec.encode_`` (10 steps of a model with 10 compressed
matrices), rank 0 prints the share of the factors' elements whose level would have been
beyond ``L`` (clipped), the share rounded to 0, and the share of columns with at least one
element clipped, over those calls::

    CLIP calls=300 clipped=0.0997 zero=0.099 cols_clipped=0.355

The levels sent are the library's, unchanged; ``MAX_GROWTH=1`` takes the steps from the last
average alone, as the library did before its steps followed the growth. Under ``torchrun``::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 scripts/lab/int8_clipped.py \\
        scripts/trainer_lm.py --method acp --int8-factors --matrix-rank 0.2 --seed 1 ...
"""
import os

import torch
import torch.distributed as dist

import hvd_acp.codecs as codecs
import hvd_acp.codecs.int8 as int8
from hvd_acp.compression import compress_both_
from hvd_acp.lanes import quantize_
from run_script import run_script

_COUNTS = {"elements": 0, "clipped": 0, "zero": 0, "columns": 0, "columns_clipped": 0}
_CALLS = [0]


def counting_encode_(self, tensor, basis, out):
    """``Int8PQCodec.encode_`` (hvd_acp/codecs/int8.py), counting before rounding."""
    compress_both_(None, tensor.error, basis[0], basis[1], out)
    n = tensor.layout.n
    factor = torch.empty_like(out)
    for rows, step in zip((slice(0, n), slice(n, None)), self.steps(tensor)):
        levels = (out[rows] / step).abs()
        _COUNTS["elements"] += levels.numel()
        _COUNTS["clipped"] += int((levels > self.levels + 0.5).sum())
        _COUNTS["zero"] += int((levels < 0.5).sum())
        _COUNTS["columns"] += levels.shape[1]
        _COUNTS["columns_clipped"] += int((levels > self.levels + 0.5).any(dim=0).sum())
        quantize_(out[rows], step, self.levels)
        torch.mul(out[rows], step, out=factor[rows])
    _CALLS[0] += 1
    if _CALLS[0] % 100 == 0:
        if not dist.is_initialized() or dist.get_rank() == 0:
            c = _COUNTS
            print(f"CLIP calls={_CALLS[0]} clipped={c['clipped'] / c['elements']:.4f} "
                  f"zero={c['zero'] / c['elements']:.3f} "
                  f"cols_clipped={c['columns_clipped'] / c['columns']:.3f}", flush=True)
        for key in _COUNTS:
            _COUNTS[key] = 0
    return factor


_GROWTH = {"max_growth": float(os.environ["MAX_GROWTH"])} if "MAX_GROWTH" in os.environ else {}


class CountingInt8PQCodec(int8.Int8PQCodec):
    encode_ = counting_encode_

    def __init__(self, levels):
        super().__init__(levels, **_GROWTH)


codecs.Int8PQCodec = CountingInt8PQCodec        # the settings make the codec by this name

run_script()
