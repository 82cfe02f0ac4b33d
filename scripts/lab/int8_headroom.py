"""Run a training script with ``int8_factors``' headroom changed: a study, not a setting.

``Int8PQCodec`` scales each factor column by ``headroom`` times its last
average (hvd_acp/codecs/int8.py); the library fixes it. This runs SCRIPT
with the codec's default headroom replaced and its growth off (the study
ran before the steps followed their columns' growth; ``MAX_GROWTH=2`` for
the library's, 4 for the library's before it), under any launcher::

    HEADROOM=4 .venv/bin/torchrun --nproc-per-node 2 scripts/lab/int8_headroom.py \\
        scripts/trainer_lm.py --method acp --int8-factors --matrix-rank 0.2 --seed 1 ...
    HEADROOM=4 .venv/bin/horovodrun -np 4 -H localhost:4 --gloo .venv/bin/python \\
        scripts/lab/int8_headroom.py examples/train_lm.py --optimizer acp --int8-factors ...
"""
import os

import hvd_acp.codecs as codecs
import hvd_acp.codecs.int8 as int8
from run_script import run_script


class HeadroomInt8PQCodec(int8.Int8PQCodec):
    def __init__(self, levels):
        super().__init__(levels, float(os.environ["HEADROOM"]),
                         float(os.environ.get("MAX_GROWTH", "1")))


codecs.Int8PQCodec = HeadroomInt8PQCodec        # the settings make the codec by this name
run_script()
