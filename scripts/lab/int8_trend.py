"""Run a training script with ``int8_factors``' steps following their columns' growth: a
study, not a setting.

The library's step for a factor column is ``headroom * max |P_prev[:, j]| / L``, from the
last average alone; while the gradients grow (the learning rate's warm-up) this step's
factors outgrow it and are clipped (up to a tenth of the elements a step on the Trainer's
GPT-2 at 2 ranks). Here the step is multiplied by ``g = max |P_prev[:, j]| / max
|P_prev2[:, j]|``, the column's growth from the average before, clamped to [1, GMAX] (4 by
default): every rank knows both averages, so the steps stay identical and nothing more is
sent. The library's ``int8_factors`` has since done the same (``max_growth`` 4): its run of
seed 1 below ends at the same validation loss, 2.355452537536621, bit for bit. Under any
launcher::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 scripts/lab/int8_trend.py \\
        scripts/trainer_lm.py --method acp --int8-factors --matrix-rank 0.2 --seed 1 ...
"""
import os

import hvd_acp.codecs as codecs
import hvd_acp.codecs.int8 as int8
from run_script import run_script

GMAX = float(os.environ.get("GMAX", "4"))
_BEFORE = {}


def _growth(factor, before):
    if before is None:
        return 1.0
    return (factor.abs().amax(dim=0, keepdim=True) / before.clamp_min(1e-30)).clamp_(1.0, GMAX)


class TrendInt8PQCodec(int8.Int8PQCodec):
    def steps(self, tensor):
        before_p, before_q = _BEFORE.get(id(tensor), (None, None))
        return (int8.column_steps(tensor.p, self.headroom, self.levels)
                * _growth(tensor.p, before_p),
                int8.column_steps(tensor.q, self.headroom, self.levels)
                * _growth(tensor.q, before_q))

    def commit_(self, tensor, averaged):
        before = (tensor.p.abs().amax(dim=0, keepdim=True),
                  tensor.q.abs().amax(dim=0, keepdim=True))
        out = super().commit_(tensor, averaged)
        _BEFORE[id(tensor)] = before
        return out


codecs.Int8PQCodec = TrendInt8PQCodec

run_script()
