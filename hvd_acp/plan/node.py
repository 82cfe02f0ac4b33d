"""A profile measured as the ranks of one node will run: every local rank at once.

A rank does not train alone. The other ranks of its node compute at the same
time on the node's other cores (or devices), each with its share of the
cores as torch threads, and under Horovod every rank has Horovod's
background thread waking once per cycle. A profile of one process alone
misses all of it: on a 2-core host with 2 ranks, ACP-SGD's step sat 0.43 s
above the single-process floor where a profile of one process predicted
0.05 s.

:func:`profile_on_node` starts ``ranks_per_node`` processes
(:mod:`.node_worker`) that profile the model at the same moment, under
``horovodrun`` with Horovod initialized in each one unless told otherwise;
a rank that is done keeps training until the last one is, so that no rank
is measured on an emptier node. The slowest rank's profile is returned (the
largest forward + backward + update): a synchronous step waits for the
slowest rank at every collective, so its kernels, not the fastest rank's,
set the step. On the 2-core benchmark host three profiles of BERT-Base
batch 8 under AdamW found its two ranks 7% to 41% apart, and rank 0 (the
one profile kept before) the faster each time. What the profile assumed is
in ``conditions``:

- ``ranks_per_node``, ``threads_per_rank``, ``cores`` (the node's usable
  cores), ``device`` (``cpu`` or ``cuda``), ``alone`` (one process only);
- ``horovod_thread``, ``horovod_cycle_time_ms``: Horovod's methods were
  timed with its background thread alive, at that cycle;
- ``ddp_compute_scale``: the DDP hook runs under ``torch.distributed``,
  without Horovod's thread: the slowest rank's training step after the
  ranks shut Horovod down (timed again, all at once) over the slowest
  rank's step with it; :mod:`.report` scales the DDP hook's compute by it;
- ``per_rank_step_s`` (and ``ddp_per_rank_step_s``): each rank's forward +
  backward + update, medians, with Horovod's thread (and without it);
  ``per_rank_window``: when each rank profiled (seconds since the epoch);
  ``profiled_rank``: the rank whose profile this is (the slowest).

:func:`.conditions.node_conditions` decides the defaults: one rank per device on CUDA,
one per core on a CPU (the cores divided among the ranks as threads), at
most the smallest number of ranks predicted.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from .conditions import NodeConditions, horovod_launcher, node_conditions

__all__ = ["profile_on_node", "node_conditions", "NodeConditions"]

#: Seconds a node's profile may take before its ranks are stopped.
DEFAULT_TIMEOUT_S = 3600.0


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run_ranks(directory: Path, cond: NodeConditions, model_args: List[str],
               timeout_s: float) -> List[dict]:
    """Run the node's ranks (:mod:`.node_worker`); their results by rank."""
    directory.mkdir(parents=True, exist_ok=True)
    n, horovod = cond.ranks_per_node, cond.horovod_thread
    worker = [sys.executable, "-m", "hvd_acp.plan.node_worker", "--dir", str(directory),
              "--threads", str(cond.threads_per_rank), *model_args]
    threads = str(cond.threads_per_rank)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
               PYTHONUNBUFFERED="1")
    if horovod:
        launcher = horovod_launcher()
        if launcher is None:
            raise RuntimeError("Horovod's background thread was asked for, but horovod.torch "
                               "or horovodrun is not installed: pass --no-horovod-thread")
        env["HOROVOD_CYCLE_TIME"] = f"{cond.horovod_cycle_time_ms:g}"
        commands = [[launcher, "-np", str(n), "-H", f"localhost:{n}", *worker, "--horovod"]]
    else:
        commands = [[*worker, "--rank", str(i), "--size", str(n)] for i in range(n)]
    log_path = directory / "ranks.log"
    deadline = time.monotonic() + timeout_s
    with open(log_path, "w") as log:
        procs = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True) for cmd in commands]
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for proc in procs:
                _kill(proc)
            raise RuntimeError(f"the node's profile took over {timeout_s:g} s; "
                               f"stopped. Its ranks' output:\n{_tail(log_path)}") from None
        except BaseException:
            for proc in procs:
                _kill(proc)
            raise
    failed = [p.returncode for p in procs if p.returncode != 0]
    results = []
    for rank in range(n):
        path = directory / f"rank{rank}.json"
        if path.is_file():
            results.append(json.loads(path.read_text()))
    if failed or len(results) != n:
        raise RuntimeError(f"the node's profile ({n} ranks) failed (exit status "
                           f"{failed or 0}, {len(results)} of {n} results). Its ranks' output:\n"
                           f"{_tail(log_path)}")
    return sorted(results, key=lambda r: r["rank"])


def _tail(path: Path, chars: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return text[-chars:]


def profile_on_node(model: str, batch_size: int, conditions: NodeConditions, *,
                    matrix_rank=None, device: str = "cpu", image_size: int = 128,
                    seq_len: int = 64, steps: int = 3, warmup: int = 1, repeats: int = 3,
                    timeout_s: float = DEFAULT_TIMEOUT_S, optimizer: str = "sgd",
                    int8_factors: Optional[bool] = None, budget: Optional[float] = None) -> dict:
    """Profile ``model`` (a built-in name or ``module:function``) as
    ``conditions`` say the ranks run (see the module docstring), with
    ACP-SGD's ``int8_factors`` and ``budget`` where given."""
    from .profile import profile_builtin
    cond = conditions
    if cond.alone:
        import torch
        torch.set_num_threads(cond.threads_per_rank)
        return profile_builtin(model, batch_size, matrix_rank=matrix_rank, device=device,
                               image_size=image_size, seq_len=seq_len, steps=steps,
                               warmup=warmup, repeats=repeats, conditions=cond.as_dict(),
                               optimizer=optimizer, int8_factors=int8_factors, budget=budget)
    model_args = ["--model", model, "--batch-size", str(batch_size), "--device", device,
                  "--image-size", str(image_size), "--seq-len", str(seq_len),
                  "--steps", str(steps), "--warmup", str(warmup), "--repeats", str(repeats),
                  "--optimizer", optimizer]
    if matrix_rank is not None:
        model_args += ["--matrix-rank", str(matrix_rank)]
    if int8_factors:
        model_args += ["--int8-factors"]
    if budget is not None:
        model_args += ["--budget", repr(budget)]
    with tempfile.TemporaryDirectory(prefix="hvd-acp-plan-node-") as tmp:
        ranks = _run_ranks(Path(tmp), cond, model_args, timeout_s)
    slowest = max(ranks, key=lambda r: r["step_s"])
    recorded: Dict = dict(cond.as_dict(), per_rank_step_s=[r["step_s"] for r in ranks],
                          per_rank_window=[r["window"] for r in ranks],
                          profiled_rank=slowest["rank"])
    if cond.horovod_thread:
        recorded["ddp_per_rank_step_s"] = [r["plain_step_s"] for r in ranks]
        # Each front end is paced by its own slowest rank.
        recorded["ddp_compute_scale"] = (max(recorded["ddp_per_rank_step_s"])
                                         / slowest["step_s"])
    profile = slowest["profile"]
    fp16 = [r["fp16_reduce_s_per_byte"] for r in ranks if "fp16_reduce_s_per_byte" in r]
    if fp16:
        profile["fp16_reduce_s_per_byte"] = statistics.median(fp16)
    profile["conditions"] = recorded
    return profile
