"""Run a training script with ``int8_factors``' float lead lengthened: a study, not a setting.

With ``int8_factors`` the first compressed step sends both factors as floats
(``Settings.lead_codecs``), whose averages give the 8-bit scales; then every
step is 8-bit. This runs SCRIPT with ``LEAD_STEPS`` such float steps first,
under any launcher::

    LEAD_STEPS=20 .venv/bin/torchrun --nproc-per-node 2 scripts/lab/int8_lead.py \\
        scripts/trainer_lm.py --method acp --int8-factors --matrix-rank 0.2 --seed 1 ...
"""
import os
import runpy
import sys
from pathlib import Path

from hvd_acp.settings import Settings

script = Path(sys.argv[1]).resolve()
lead = Settings.lead_codecs
steps = int(os.environ["LEAD_STEPS"])
Settings.lead_codecs = lambda self: lead(self) * steps
sys.path.insert(0, str(script.parent))
sys.argv = [str(script), *sys.argv[2:]]
runpy.run_path(str(script), run_name="__main__")
