"""Output of the multi-process workers. Imported as ``worker_io`` (the worker's
folder is first on ``sys.path`` when it runs as a script)."""
import os
import sys


def report(text: str) -> None:
    """One write per line: the ranks share the launcher's pipe (torchrun's), and
    lines written in pieces (the text, then the newline, as unbuffered
    ``print`` does) interleave."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{text}\n".encode())
