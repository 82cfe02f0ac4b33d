"""What ``import hvd_acp`` loads: the library, not the tools beside it."""
import subprocess
import sys

from tests.hvdrun import REPO

#: Loaded where asked for, never by ``import hvd_acp``.
TOOLS = ("hvd_acp.baselines", "hvd_acp.plan", "hvd_acp.ab", "hvd_acp.methods",
         "hvd_acp.integrations", "hvd_acp.ddp", "horovod",
         "torch.distributed.algorithms.ddp_comm_hooks")


def test_import_hvd_acp_loads_the_library_only():
    code = ("import sys, json, hvd_acp; "
            "print(json.dumps(sorted(m for m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout
    import json
    loaded = json.loads(out.splitlines()[-1])
    assert "hvd_acp.optimizer" in loaded and "hvd_acp.codecs" in loaded
    found = [m for m in loaded for tool in TOOLS if m == tool or m.startswith(tool + ".")]
    assert not found, found


def test_the_tools_are_there_when_asked_for():
    import hvd_acp
    assert hvd_acp.DiLoCoOptimizer is hvd_acp.baselines.DiLoCoOptimizer
    assert hvd_acp.DeMoOptimizer.__module__ == "hvd_acp.baselines.demo"
    assert hvd_acp.ddp.ACPState.__module__ == "hvd_acp.ddp"
