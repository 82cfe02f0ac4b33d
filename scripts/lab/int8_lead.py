"""Run a training script with ``int8_factors``' float lead lengthened: a study, not a setting.

With ``int8_factors`` the first compressed step sends both factors as floats
(``Settings.lead_codecs``), whose averages give the 8-bit scales; then every
step is 8-bit. This runs SCRIPT with ``LEAD_STEPS`` such float steps first,
under any launcher::

    LEAD_STEPS=20 .venv/bin/torchrun --nproc-per-node 2 scripts/lab/int8_lead.py \\
        scripts/trainer_lm.py --method acp --int8-factors --matrix-rank 0.2 --seed 1 ...
"""
import os

from hvd_acp.settings import Settings
from run_script import run_script

lead = Settings.lead_codecs
steps = int(os.environ["LEAD_STEPS"])
Settings.lead_codecs = lambda self: lead(self) * steps
run_script()
