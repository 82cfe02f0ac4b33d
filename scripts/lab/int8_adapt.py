"""Run a training script with ``int8_factors``' headroom adapting per column to the ranks'
clipping: a study, not a setting.

Each factor column's headroom (2 at the start; the library fixes it at 2) moves with whether
any rank clipped that column on the step before: times GROW where one did, times SHRINK where
none did, within [LOW, HIGH]. Every rank knows it: the payload carries one more row per factor,
a rank's 0 or 1 per column, summed in the same all-reduce of 8-bit lanes (2 r more elements a
tensor, counted in the bytes), so the headrooms stay identical on every rank. Under
``torchrun`` (the world size is torch.distributed's)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 scripts/lab/int8_adapt.py \\
        scripts/trainer_lm.py --method acp --int8-factors --matrix-rank 0.2 --seed 1 ...
"""
import os

import torch

import hvd_acp.codecs as codecs
import hvd_acp.codecs.int8 as int8
from hvd_acp.compression import compress_both_
from hvd_acp.lanes import quantize_
from run_script import run_script

GROW, SHRINK, LOW, HIGH = (float(x) for x in os.environ.get("ADAPT", "2,0.9,1,16").split(","))
_HEAD = {}


def _headrooms(tensor):
    key = id(tensor)
    if key not in _HEAD:
        r = tensor.layout.r
        _HEAD[key] = (torch.full((1, r), 2.0, dtype=tensor.p.dtype, device=tensor.p.device),
                      torch.full((1, r), 2.0, dtype=tensor.p.dtype, device=tensor.p.device))
    return _HEAD[key]


class AdaptInt8PQCodec(int8.Int8PQCodec):
    def payload_rows(self, n, m):
        return n + m + 2

    def steps(self, tensor):
        hp, hq = _headrooms(tensor)
        return (int8.column_steps(tensor.p, 1.0, self.levels) * hp,
                int8.column_steps(tensor.q, 1.0, self.levels) * hq)

    def encode_(self, tensor, basis, out):
        n, m = tensor.layout.n, tensor.layout.m
        compress_both_(None, tensor.error, basis[0], basis[1], out[:n + m])
        factor = torch.empty_like(out[:n + m])
        for k, (rows, step) in enumerate(zip((slice(0, n), slice(n, n + m)), self.steps(tensor))):
            x = out[rows]
            out[n + m + k] = ((x / step).abs() > self.levels + 0.5).any(dim=0).to(out.dtype)
            quantize_(x, step, self.levels)
            torch.mul(x, step, out=factor[rows])
        return factor

    def commit_(self, tensor, averaged):
        n, m = tensor.layout.n, tensor.layout.m
        step_p, step_q = self.steps(tensor)
        for h, flags in zip(_headrooms(tensor), (averaged[n + m], averaged[n + m + 1])):
            h.mul_(torch.where(flags > 0, GROW, SHRINK)).clamp_(LOW, HIGH)
        averaged[:n].mul_(step_p)
        averaged[n:n + m].mul_(step_q)
        return int8.PQCodec.commit_(self, tensor, averaged[:n + m])


codecs.Int8PQCodec = AdaptInt8PQCodec

run_script()
