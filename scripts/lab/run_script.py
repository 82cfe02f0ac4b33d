"""What every study wrapper of scripts/lab does last: run the training script it was given
(``sys.argv[1]``) as ``__main__``, with the rest of the command line as its arguments and
its own folder first on ``sys.path``, in this process, after the wrapper's change."""
import runpy
import sys
from pathlib import Path


def run_script() -> None:
    script = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(script.parent))
    sys.argv = [str(script), *sys.argv[2:]]
    runpy.run_path(str(script), run_name="__main__")
