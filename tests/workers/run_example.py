"""Run a script of ``examples/`` as a Horovod worker: ``run_example.py SCRIPT ARGS...``.

Lets tests launch the examples through :func:`tests.hvdrun.horovodrun`
(which runs workers from this directory), exactly as ``python
examples/SCRIPT ARGS...`` would run them.
"""
import runpy
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

if __name__ == "__main__":
    script = EXAMPLES / sys.argv[1]
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path.insert(0, str(EXAMPLES))
    runpy.run_path(str(script), run_name="__main__")
