"""Running one benchmark job: its processes, their output, a timeout.

A job is one or more processes started together (``horovodrun``, or one
process per rank when the driver launches the ranks itself). Each process
gets its own session, so a hang or an interruption kills it and everything
it started with one ``killpg``. Output goes to a log file, and rank 0's
progress lines move a callback.
"""
from __future__ import annotations

import dataclasses
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .worker import PROGRESS_TAG

__all__ = ["Command", "JobError", "run_job", "kill_worker_pids", "stop",
           "new_session_dying_with_parent"]

GRACE_S = 5.0


class JobError(RuntimeError):
    """A job failed, timed out or was interrupted; the message says which."""


@dataclasses.dataclass
class Command:
    """One process of a job."""

    argv: List[str]
    env: Dict[str, str]
    label: str
    #: Working directory (None: the caller's).
    cwd: Optional[str] = None


def new_session_dying_with_parent() -> None:
    """preexec_fn: own session, and SIGKILL when the parent dies.

    A driver killed with SIGKILL cannot clean up; its ranks then die with
    it instead of waiting in a collective until Gloo's timeout. The setting
    survives ``exec`` (``ip netns exec`` execs the worker itself).
    """
    os.setsid()
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


_PR_SET_PDEATHSIG = 1


def _reader(proc: subprocess.Popen, label: str, log, lock: threading.Lock,
            events: "queue.Queue") -> None:
    for line in proc.stdout:
        with lock:
            log.write(f"[{label}] {line}")
            log.flush()
        tag = line.find(PROGRESS_TAG)
        if tag >= 0:
            fields = line[tag + len(PROGRESS_TAG):].split()
            if len(fields) == 2 and fields[0] == "progress":
                done, _, total = fields[1].partition("/")
                if done.isdigit():
                    events.put(int(done))
    proc.stdout.close()


def _killpg(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_worker_pids(pid_dir: Path, pattern: str) -> None:
    """SIGKILL the worker processes recorded as ``*.pid`` files in ``pid_dir``.

    ``horovodrun`` starts each rank in a session of its own, out of reach of
    a ``killpg`` of horovodrun; the workers record their pids so that a hung
    rank can still be killed. A pid is killed only if its command line
    still contains ``pattern`` (pids are reused).
    """
    for path in pid_dir.glob("*.pid"):
        try:
            pid = int(path.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError):
            continue
        if pattern.encode() in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM each process group, then SIGKILL what is left after a grace period."""
    for proc in procs:
        if proc.poll() is None:
            _killpg(proc, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        _killpg(proc, signal.SIGKILL)     # also reaps children left in the group
        if proc.poll() is None:
            proc.wait()


def run_job(commands: Sequence[Command], log_path: Path, timeout_s: float,
            on_progress: Callable[[int], None] = lambda done: None,
            on_cleanup: Optional[Callable[[], None]] = None) -> None:
    """Run ``commands`` together until all exit; raise :class:`JobError` on failure.

    A process that exits non-zero stops the others (they would wait for it
    forever in a collective). On timeout, failure or interruption every
    process group is killed and ``on_cleanup`` runs (e.g. to kill recorded
    worker pids).

    Args:
        commands: the processes to start.
        log_path: file receiving every process's output, line-prefixed.
        timeout_s: wall-clock limit of the whole job.
        on_progress: called with the number of steps rank 0 has finished.
    """
    events: "queue.Queue[int]" = queue.Queue()
    lock = threading.Lock()
    procs: List[subprocess.Popen] = []
    readers: List[threading.Thread] = []
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        try:
            for cmd in commands:
                with lock:
                    log.write(f"[driver] {cmd.label}: {' '.join(cmd.argv)}\n")
                    log.flush()
                proc = subprocess.Popen(cmd.argv, env=cmd.env, cwd=cmd.cwd,
                                        stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1,
                                        preexec_fn=new_session_dying_with_parent)
                procs.append(proc)
                reader = threading.Thread(target=_reader, daemon=True,
                                          args=(proc, cmd.label, log, lock, events))
                reader.start()
                readers.append(reader)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    on_progress(events.get(timeout=0.2))
                    continue
                except queue.Empty:
                    pass
                codes = [proc.poll() for proc in procs]
                failed = [(c.label, code) for c, code in zip(commands, codes)
                          if code not in (None, 0)]
                if failed:
                    raise JobError(f"{failed[0][0]} exited with status {failed[0][1]}; "
                                   f"see {log_path}")
                if all(code == 0 for code in codes):
                    break
                if time.monotonic() > deadline:
                    raise JobError(f"timed out after {timeout_s:.0f} s (a hang?); "
                                   f"killed; see {log_path}")
        finally:
            stop(procs)
            if on_cleanup is not None:
                on_cleanup()
            for reader in readers:
                reader.join(timeout=2)
            while not events.empty():
                on_progress(events.get())
