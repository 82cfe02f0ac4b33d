"""Run a training script with ``int8_factors``' steps taken per block of rows: a study, not
a setting.

The library's step is per factor column, ``headroom * max |P_prev[:, j]| / L`` on the last
average (identical on every rank). Here each column is cut into blocks of BLOCK rows, and a
block's step is ``headroom * max |P_prev[block, j]| / L``, floored at FLOOR (2^-8 by default)
of its column's largest element: still from the last average alone, so nothing more is sent,
and a block of small elements gets steps as fine as its elements. Under any launcher::

    BLOCK=16 HEADROOM=2 .venv/bin/torchrun --nproc-per-node 2 scripts/lab/int8_blocks.py \\
        scripts/trainer_lm.py --method acp --int8-factors --matrix-rank 0.2 --seed 1 ...
"""
import os

import torch

import hvd_acp.codecs as codecs
import hvd_acp.codecs.int8 as int8
from run_script import run_script

BLOCK = int(os.environ.get("BLOCK", "16"))
FLOOR = float(os.environ.get("FLOOR", str(2.0 ** -8)))


def block_steps(factor, headroom, levels):
    n, r = factor.shape
    blocks = -(-n // BLOCK)
    padded = factor.new_zeros(blocks * BLOCK, r)
    padded[:n] = factor.abs()
    largest = padded.view(blocks, BLOCK, r).amax(dim=1)                  # (blocks, r)
    column = largest.amax(dim=0, keepdim=True)
    floor = torch.maximum(column * FLOOR,
                          (column.amax() * 2.0 ** -8).clamp_min(torch.finfo(factor.dtype).tiny))
    steps = torch.maximum(largest, floor).mul_(headroom / levels)
    return steps.repeat_interleave(BLOCK, dim=0)[:n]                       # (n, r)


class BlockInt8PQCodec(int8.Int8PQCodec):
    def __init__(self, levels, headroom=float(os.environ.get("HEADROOM", "2"))):
        super().__init__(levels, headroom)

    def steps(self, tensor):
        return (block_steps(tensor.p, self.headroom, self.levels),
                block_steps(tensor.q, self.headroom, self.levels))


codecs.Int8PQCodec = BlockInt8PQCodec

run_script()
