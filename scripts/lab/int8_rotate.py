"""Run a training script with ``int8_factors``' levels taken on rotated factors: a study,
not a setting.

Each rank's factor ``P_i`` (n, r) is quantized as ``R_n P_i``, where ``R_n`` is a fixed
orthogonal n x n matrix (the Kronecker product of two random orthogonal matrices of about
sqrt(n) each, drawn from a generator seeded by n: the same on every rank). The sum of the
ranks' rotated levels is the rotation of their sum, so the average is rotated back after
the all-reduce. A column's step is ``headroom * max |R_n P_prev[:, j]| / L``, as the library's
on the unrotated factor. Spiky columns (an embedding's rows for frequent tokens) spread over
all n rows, so a column's largest element is nearer its root mean square and the same
levels resolve it more finely. Under any launcher::

    HEADROOM=2 .venv/bin/torchrun --nproc-per-node 2 scripts/lab/int8_rotate.py \\
        scripts/trainer_lm.py --method acp --int8-factors --matrix-rank 0.2 --seed 1 ...
"""
import math
import os

import torch

import hvd_acp.codecs as codecs
import hvd_acp.codecs.int8 as int8
from hvd_acp.compression import compress_both_
from hvd_acp.lanes import quantize_
from run_script import run_script

_ROT = {}


def _factors(n):
    a = max(d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0)
    return a, n // a


def _orthogonal(k, gen):
    q, r = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def rotation(n, like):
    key = (n, like.dtype, like.device)
    if key not in _ROT:
        gen = torch.Generator().manual_seed(1000003 + n)
        a, b = _factors(n)
        _ROT[key] = (_orthogonal(a, gen).to(like), _orthogonal(b, gen).to(like))
    return _ROT[key]


def rotate(x, inverse=False):
    """R x for x (n, r): x viewed (a, b, r), A on the first index, B on the second."""
    n, r = x.shape
    A, B = rotation(n, x)
    if inverse:
        A, B = A.t(), B.t()
    y = x.reshape(A.shape[0], B.shape[0], r)
    y = torch.einsum("ij,jkr->ikr", A, y)
    y = torch.einsum("kl,ilr->ikr", B, y)
    return y.reshape(n, r)


class RotatedInt8PQCodec(int8.Int8PQCodec):
    def __init__(self, levels, headroom=float(os.environ.get("HEADROOM", "2"))):
        super().__init__(levels, headroom)

    def steps(self, tensor):
        return (int8.column_steps(rotate(tensor.p), self.headroom, self.levels),
                int8.column_steps(rotate(tensor.q), self.headroom, self.levels))

    def encode_(self, tensor, basis, out):
        compress_both_(None, tensor.error, basis[0], basis[1], out)
        n = tensor.layout.n
        factor = torch.empty_like(out)
        for rows, step in zip((slice(0, n), slice(n, None)), self.steps(tensor)):
            out[rows] = rotate(out[rows])
            quantize_(out[rows], step, self.levels)
            factor[rows] = rotate(out[rows] * step, inverse=True)
        return factor

    def commit_(self, tensor, averaged):
        n = tensor.layout.n
        step_p, step_q = self.steps(tensor)
        averaged[:n] = rotate(averaged[:n] * step_p, inverse=True)
        averaged[n:] = rotate(averaged[n:] * step_q, inverse=True)
        return int8.PQCodec.commit_(self, tensor, averaged)


codecs.Int8PQCodec = RotatedInt8PQCodec        # the settings make the codec by this name

run_script()
