"""Launch a worker script under ``horovodrun --gloo`` (or ``torchrun``) from a test,
with a timeout.

A hang fails the test instead of stalling the suite: the whole process group
is killed when ``timeout`` expires.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).resolve().parent.parent


def horovodrun(script: str, *args: str, np: int = 2, timeout: float = 180,
               env: dict | None = None, check: bool = True,
               hosts: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run ``tests/workers/<script>`` on ``np`` local ranks; returns the result.

    With ``check`` the test fails unless every rank exited 0; the output of
    all ranks is shown on failure. ``hosts`` replaces the default
    ``-H localhost:np`` (e.g. elastic options with a discovery script).
    """
    launcher = Path(sys.executable).with_name("horovodrun")
    hosts = hosts if hosts is not None else ["-H", f"localhost:{np}"]
    cmd = [str(launcher), "-np", str(np), *hosts, "--gloo",
           sys.executable, str(WORKERS / script), *args]
    what = f"horovodrun {script} {' '.join(args)}"
    returncode, out = _run(cmd, timeout, what, env)
    if check and returncode != 0:
        pytest.fail(f"{what} exited {returncode}\n{out[-8000:]}")
    return subprocess.CompletedProcess(cmd, returncode, out, "")


def torchrun(script: str | Path, *args: str, np: int = 2, timeout: float = 180,
             env: dict | None = None) -> str:
    """Run ``script`` (a path, or a name in ``tests/workers/``) on ``np`` local
    ranks under ``torchrun --standalone``; returns the output of all ranks.

    A timeout kills the whole process group and fails the test; unlike
    :func:`horovodrun` the exit status is left to the caller's assertions.
    """
    return torchrun_status(script, *args, np=np, timeout=timeout, env=env)[1]


def torchrun_status(script: str | Path, *args: str, np: int = 2, timeout: float = 180,
                    env: dict | None = None) -> tuple[int, str]:
    """:func:`torchrun`, returning ``(exit status of torchrun, output of all ranks)``."""
    launcher = Path(sys.executable).with_name("torchrun")
    path = Path(script) if Path(script).is_absolute() else WORKERS / script
    cmd = [str(launcher), "--standalone", "--nproc-per-node", str(np), str(path), *args]
    return _run(cmd, timeout, f"torchrun {path.name} {' '.join(args)}", env)


def run_with_timeout(cmd: list[str], timeout: float, what: str,
                     env: dict | None = None) -> str:
    """Run ``cmd`` from the repository; its output, or a test failure on timeout."""
    return _run(cmd, timeout, what, env)[1]


def run_status(cmd: list[str], timeout: float, what: str,
               env: dict | None = None) -> tuple[int, str]:
    """Run ``cmd`` from the repository; (exit status, output), or a test failure on timeout."""
    return _run(cmd, timeout, what, env)


def _run(cmd: list[str], timeout: float, what: str, env: dict | None) -> tuple[int, str]:
    """(exit status, output) of ``cmd`` run from the repository with one
    thread per process; on timeout its whole process group is killed and the
    test fails."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                    PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=REPO, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what} timed out after {timeout}s (a hang?)\n{out[-6000:]}")
    return proc.returncode, out


def rank_lines(output: str, tag: str) -> list[str]:
    """Lines a worker printed as ``<tag> ...`` (horovodrun's [r]<stdout>: prefix removed)."""
    lines = []
    for line in output.splitlines():
        _, _, text = line.partition(">:")
        text = text if text else line
        if text.startswith(tag):
            lines.append(text[len(tag):].strip())
    return lines


def _emulation_problem():
    from benchmarks.netem import emulation_problem
    return emulation_problem()


#: Skips a test that needs the emulated network (root, ip, tc), saying why.
requires_emulation = pytest.mark.skipif(_emulation_problem() is not None,
                                        reason=f"network emulation: {_emulation_problem()}")
