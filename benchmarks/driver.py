"""The benchmark driver: one job per method and round, side by side, on one link.

In every round (``--rounds``) it runs the compute-only floor, every method
and the diagnostics once each, in an order that rotates from round to round
(:func:`.stats.round_order`). For every job it launches ``horovodrun``,
``torchrun``, or the ranks by hand inside the emulated network, waits with a
timeout and reads the per-rank result files; at the end it summarizes each
job over the rounds and writes ``results.json``, ``results.md`` and
``breakdown.png`` (paired ratios and their intervals: :func:`.report.derive`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from hvd_acp.methods import HOROVOD

from . import report
from .jobs import DIAGNOSTICS, FLOOR_JOB, LOCAL
from .jobs import get as get_job
from .launch import (Command, JobError, kill_worker_pids, new_session_dying_with_parent,
                     run_job, stop)
from .netem import EmulatedNetwork
from .rendezvous import rank_commands, start_server
from .stats import (combine_ranks, machine_busy_s, median_interval, percentile, round_order,
                    summarize_steps)
from .worker import IFACE_ENV, worker_model

logger = logging.getLogger(__name__)

__all__ = ["BenchConfig", "run_benchmark"]

DDP_MASTER_PORT = 29577
#: Above this share of the machine used outside a job, its times are flagged.
DISTURBED_SHARE = 0.10
#: Before a re-run, wait at most this long for the machine to be idle.
QUIET_WAIT_S = 300.0
#: The checkout: the parent of this package, put on the workers' PYTHONPATH.
REPO_ROOT = Path(__file__).resolve().parents[1]
#: The module every job's processes run.
WORKER = "benchmarks.worker"


@dataclasses.dataclass
class BenchConfig:
    """Everything one invocation measures (see ``python -m benchmarks -h``)."""

    methods: List[str]
    #: A built-in model or a user's ``module:function`` / ``file.py:function``, as given.
    model: str
    np: int
    batch_size: int
    #: None: every method's default for the optimizer (hvd_acp.Settings.resolve).
    matrix_rank: Any
    steps: int
    warmup: int
    bandwidth_mbit: Optional[float]
    out: Path
    rounds: int = 1
    image_size: int = 128
    seq_len: int = 64
    threads: int = 1
    timeout_s: float = 1800.0
    progress: bool = True
    reruns: int = 0
    diagnostics: bool = False
    horovod_cycle_time_ms: Optional[float] = None
    count_ops: bool = False
    command: str = ""
    #: The torch optimizer of every job: ``sgd`` (momentum 0.9) or ``adamw``.
    optimizer: str = "sgd"


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived: unwind through the cleanup code, then exit."""


def _raise_interrupted(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def _versions() -> Dict[str, str]:
    import torch
    import hvd_acp
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import horovod
        versions["horovod"] = horovod.__version__
    except ImportError:
        versions["horovod"] = None
    versions["hvd_acp"] = hvd_acp.__version__
    try:
        import transformers
        versions["transformers"] = transformers.__version__
    except ImportError:
        pass
    return versions


def _own_cpu_s() -> float:
    """CPU-seconds of this process and of its children that have been reaped."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class _Interference:
    """Share of the machine used by everything outside a job, while it ran.

    (machine busy time - this driver's and its reaped children's CPU time)
    / (wall time * CPUs). Other users' processes show up here, and so does
    kernel work not charged to any process (e.g. packet processing). On a
    shared machine a high share means the job's times are disturbed.
    """

    def __enter__(self):
        self.busy, self.own, self.wall = machine_busy_s(), _own_cpu_s(), time.monotonic()
        self.share: Optional[float] = None
        return self

    def __exit__(self, *exc):
        wall = time.monotonic() - self.wall
        outside = (machine_busy_s() - self.busy) - (_own_cpu_s() - self.own)
        self.share = max(0.0, outside) / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0


class _Runner:
    def __init__(self, cfg: BenchConfig, net: Optional[EmulatedNetwork], bar):
        self.cfg = cfg
        self.net = net
        self.bar = bar
        self.raw = cfg.out / "raw"
        self.logs = cfg.out / "logs"
        self.python = sys.executable
        self.bin = Path(sys.executable).parent
        self._started: set = set()

    # ------------------------------------------------------------ commands
    def _env(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        env = dict(os.environ)
        threads = str(self.cfg.threads)
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(
                       p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p),
                   # A fused S-SGD all-reduce over a slow link can take longer
                   # than Horovod's default 30 s Gloo timeout.
                   HOROVOD_GLOO_TIMEOUT_SECONDS="600")
        if self.cfg.horovod_cycle_time_ms is not None:
            env["HOROVOD_CYCLE_TIME"] = f"{self.cfg.horovod_cycle_time_ms:g}"
        env.update(extra or {})
        return env

    def _worker_args(self, method: str, result_dir: Path) -> List[str]:
        c = self.cfg
        return ["-m", WORKER, "--method", method, "--model", worker_model(c.model),
                "--batch-size", str(c.batch_size),
                *(["--matrix-rank", str(c.matrix_rank)] if c.matrix_rank is not None else []),
                "--optimizer", c.optimizer, "--steps", str(c.steps), "--warmup", str(c.warmup),
                "--image-size", str(c.image_size), "--seq-len", str(c.seq_len),
                "--threads", str(c.threads), "--result-dir", str(result_dir),
                *(["--count-ops"] if c.count_ops else [])]

    def _tool(self, name: str) -> str:
        path = self.bin / name
        return str(path) if path.exists() else name

    def _commands(self, method: str, rendezvous_port: Optional[int],
                  result_dir: Path) -> List[Command]:
        c, net, job = self.cfg, self.net, get_job(method)
        worker = [self.python] + self._worker_args(method, result_dir)
        if job.processes == 1:
            return [Command(worker, self._env(), method)]
        if job.launcher == LOCAL:
            # Independent processes at once, no collective library, no network.
            return [Command(worker + ["--rank", str(rank)], self._env(), f"rank{rank}")
                    for rank in range(c.np)]
        if net is None:
            if job.launcher == HOROVOD:
                argv = [self._tool("horovodrun"), "-np", str(c.np), "-H",
                        f"localhost:{c.np}", "--gloo"] + worker
                return [Command(argv, self._env(), "horovodrun")]
            argv = [self._tool("torchrun"), "--standalone", "--nproc-per-node",
                    str(c.np)] + worker[1:]
            return [Command(argv, self._env(), "torchrun")]
        if job.launcher == HOROVOD:
            # What horovodrun --gloo sets for each rank (gloo_run.py).
            return rank_commands(net, worker, self._env(), rendezvous_port,
                                 {IFACE_ENV: net.iface})
        # What torchrun sets, with a fixed master on rank 0's node.
        return [Command(net.exec_prefix(rank) + worker, self._env({
                    "RANK": str(rank), "WORLD_SIZE": str(c.np), "LOCAL_RANK": "0",
                    "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank),
                    "MASTER_ADDR": net.address(0), "MASTER_PORT": str(DDP_MASTER_PORT),
                    "GLOO_SOCKET_IFNAME": net.iface, IFACE_ENV: net.iface}), f"rank{rank}")
                for rank in range(c.np)]

    # ------------------------------------------------------------- running
    def _start_rendezvous(self) -> tuple:
        try:
            return start_server(self.net, self.python, self._env(),
                                preexec_fn=new_session_dying_with_parent)
        except RuntimeError as exc:
            raise JobError(str(exc)) from None

    def run_method(self, method: str, round_index: int = 0) -> List[Dict[str, Any]]:
        """Run one job of round ``round_index`` (0-based); returns the per-rank result dicts.

        Its per-rank results go to ``raw/round<i>/``, its log to
        ``logs/round<i>/<method>.log`` (``i`` counted from 1).
        """
        raw = self.raw / f"round{round_index + 1}"
        raw.mkdir(parents=True, exist_ok=True)
        for path in list(raw.glob(f"{method}.rank*")):
            path.unlink()
        log_path = self.logs / f"round{round_index + 1}" / f"{method}.log"
        if log_path.exists():
            log_path.unlink()
        rendezvous = port = None
        if self.net is not None and get_job(method).launcher == HOROVOD:
            rendezvous, port = self._start_rendezvous()
        last = [0]

        def on_progress(done: int) -> None:
            if self.bar is not None and done > last[0]:
                self.bar.update(done - last[0])
                last[0] = done

        if self.bar is not None:
            self.bar.set_description(method)
            if (method, round_index) in self._started:      # a re-run (--reruns)
                self.bar.total += self.cfg.warmup + self.cfg.steps
                self.bar.refresh()
            self._started.add((method, round_index))
        try:
            run_job(self._commands(method, port, raw), log_path, self.cfg.timeout_s,
                    on_progress,
                    on_cleanup=lambda: kill_worker_pids(raw, WORKER))
        finally:
            if rendezvous is not None:
                rendezvous.stdin.close()
                stop([rendezvous])
            if self.bar is not None:
                self.bar.update(self.cfg.warmup + self.cfg.steps - last[0])
        ranks = get_job(method).processes or self.cfg.np
        results = []
        for rank in range(ranks):
            path = raw / f"{method}.rank{rank}.json"
            if not path.exists():
                raise JobError(f"rank {rank} wrote no result ({path}); see {log_path}")
            results.append(json.loads(path.read_text()))
        return results


def _summarize(cfg: BenchConfig, method: str, ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    steps = ranks[0]["steps"]
    step_s = combine_ranks([r["step_s"] for r in ranks])
    samples = cfg.batch_size * len(ranks)
    entry: Dict[str, Any] = summarize_steps(step_s, samples)
    per_rank = len(ranks) * steps
    entry.update(
        bytes_sent_per_step=sum(r["bytes_sent"] for r in ranks) / per_rank,
        allreduces_per_step=sum(r["allreduces"] for r in ranks) / per_rank,
        compression_s_per_step=sum(r["compression_seconds"] for r in ranks) / per_rank,
        steps=steps, step_s=step_s, last_loss=[r["last_loss"] for r in ranks],
        samples_per_step=samples, gradient_bytes=ranks[0]["gradient_bytes"],
        optimizer=ranks[0].get("optimizer"))
    # Where a step's time goes on rank 0: forward, backward (hvd_acp's hooks
    # compress and launch all-reduces in it), optimizer step (waits, then
    # reconstructs and updates; DDP waits at the end of backward instead).
    entry["phase_s_median"] = {name: percentile(values, 50)
                               for name, values in ranks[0]["phase_s"].items() if values}
    if all("tiny_allreduce_s" in r for r in ranks):
        # The idle diagnostics' probe: a call is done when every rank is.
        entry["tiny_allreduce_s"] = percentile(
            combine_ranks([r["tiny_allreduce_s"] for r in ranks]), 50)
    if all("link_tx_bytes" in r for r in ranks):
        entry["link_tx_bytes_per_step"] = sum(r["link_tx_bytes"] for r in ranks) / per_rank
    for key in ("ops_per_step", "kernels_per_step"):      # --count-ops: rank 0's
        if key in ranks[0]:
            entry[key] = ranks[0][key]
    if "bytes_sent_per_step_analytic" in ranks[0]:      # powerSGD_hook, hvd_acp.baselines
        entry["bytes_sent_per_step_analytic"] = ranks[0]["bytes_sent_per_step_analytic"]
    if all("bytes_received" in r for r in ranks):          # hvd_acp.baselines
        entry["bytes_received_per_step"] = sum(r["bytes_received"] for r in ranks) / per_rank
    if "settings" in ranks[0]:        # every default decided (worker.method_settings)
        entry["settings"] = ranks[0]["settings"]
    return entry


#: Per-round fields that are kept only under ``per_round``, not summarized.
_ROUND_ONLY = ("round", "position", "step_s", "wall_s", "attempts", "last_loss",
               "phase_s_median", "cpu_share_outside_job", "step_s_p10", "step_s_p90",
               "samples_per_s", "error")


def summarize_rounds(per_round: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One job's entry in results.json from its per-round entries.

    The step figure is the median over rounds of each round's median step,
    with its interval (:func:`.stats.median_interval`); p10/p90 are over all
    timed steps of all rounds; counters (bytes, all-reduces, compression,
    link bytes) are medians over rounds; ``cpu_share_outside_job`` is the
    worst round's. Rounds whose job failed are listed in ``errors`` and left
    out; if every round failed the entry has ``error`` and no figures.
    """
    ok = [r for r in per_round if not r.get("error")]
    failed = [f"round {r['round']}: {r['error']}" for r in per_round if r.get("error")]
    if not ok:
        return {"step_s_median": None, "error": "; ".join(failed), "per_round": per_round}
    step = median_interval([r["step_s_median"] for r in ok])
    pooled = [t for r in ok for t in r["step_s"]]
    entry: Dict[str, Any] = {
        "step_s_median": step.median, "step_s_low": step.low, "step_s_high": step.high,
        "step_s_p10": percentile(pooled, 10), "step_s_p90": percentile(pooled, 90)}
    samples = ok[0].get("samples_per_step")
    if samples is not None:
        entry["samples_per_s"] = samples / step.median if step.median > 0 else float("nan")
    for key, value in ok[0].items():
        if key in entry or key in _ROUND_ONLY:
            continue
        values = [r.get(key) for r in ok]
        if all(v == value for v in values):
            entry[key] = value
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            entry[key] = percentile(values, 50)
        else:
            entry[key] = value
    compression = median_interval([r["compression_s_per_step"] for r in ok])
    entry.update(compression_s_low=compression.low, compression_s_high=compression.high)
    entry["phase_s_median"] = {
        name: percentile([r["phase_s_median"][name] for r in ok
                          if name in r.get("phase_s_median", {})], 50)
        for name in ok[0].get("phase_s_median", {})}
    entry.update(step_s=pooled, last_loss=ok[-1].get("last_loss"),
                 cpu_share_outside_job=max(r.get("cpu_share_outside_job") or 0.0 for r in ok),
                 attempts=sum(r.get("attempts", 1) for r in per_round),
                 rounds_measured=len(ok), per_round=per_round)
    if failed:
        entry["errors"] = failed
    return entry


def _wait_for_quiet(max_s: float, window_s: float = 3.0) -> bool:
    """Wait until the machine is idle for ``window_s`` (busy share below the
    disturbance threshold), at most ``max_s``; returns whether it was."""
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        with _Interference() as idle:
            time.sleep(window_s)
        if idle.share <= DISTURBED_SHARE:
            return True
    logger.warning("the machine stayed busy for %.0f s; measuring anyway", max_s)
    return False


def _measure(cfg: BenchConfig, runner: _Runner, method: str,
             round_index: int = 0) -> Dict[str, Any]:
    """Run ``method`` in round ``round_index``, again (up to ``cfg.reruns``
    times) while others disturb it.

    Keeps the attempt during which the least CPU was used outside the job.
    """
    best: Optional[Dict[str, Any]] = None
    for attempt in range(1 + cfg.reruns):
        if attempt:
            _wait_for_quiet(QUIET_WAIT_S)
        started = time.monotonic()
        try:
            with _Interference() as interference:
                ranks = runner.run_method(method, round_index)
        except JobError as exc:
            logger.error("%s (round %d): %s", method, round_index + 1, exc)
            return {"step_s_median": None, "error": str(exc)}
        entry = _summarize(cfg, method, ranks)
        entry["cpu_share_outside_job"] = interference.share
        entry["wall_s"] = time.monotonic() - started
        entry["attempts"] = attempt + 1
        if best is None or interference.share < best["cpu_share_outside_job"]:
            best = entry
        if interference.share <= DISTURBED_SHARE:
            break
        logger.warning("%s: %.0f%% of the machine's CPU was used outside the job while it "
                       "ran: its times are likely disturbed%s", method,
                       100 * interference.share,
                       "; running it again" if attempt < cfg.reruns else "")
    best["attempts"] = attempt + 1
    return best


NOTES = [
    "bytes_sent_per_step is per rank: the payload each rank hands to all-reduce per step, "
    "from each method's counters (hvd_acp.methods, hvd_acp.methods.counting): hvd_acp's "
    "`optimizer.comm_stats` (ACP-SGD, its ablations, Power-SGD) and `ACPState.comm_stats` "
    "(DDP acp_hook); S-SGD under Horovod: each tensor as it leaves its "
    "`hvd.Compression` (fp16 for ssgd-fp16); DDP without a hook: its bucket sizes once "
    "per optimizer step; DDP fp16_compress_hook: each bucket in fp16; DDP powerSGD_hook "
    "(batched or not): counted at `dist.all_reduce`, equal to the analytic sum over "
    "parameters of (n + m) r for compressed and numel for other tensors, times 4 bytes. "
    "A ring all-reduce puts 2(N-1)/N times that on each rank's link. DiLoCo (diloco) "
    "all-reduces every parameter once every H steps: over fewer timed steps the count can be "
    "0, and bytes_sent_per_step_analytic gives the bytes over H; the DeMo-style method "
    "(demo) all-gathers its coefficients, and bytes_received_per_step counts the other "
    "ranks' parts it receives (N-1 times its own) plus its averaged 1-D gradients; the "
    "TSR-style method (tsr) all-reduces each matrix's core every step and its sketches every "
    "K steps, so the count of a few timed steps depends on where the refreshes fall, and "
    "bytes_sent_per_step_analytic gives the average over K.",
    "allreduces_per_step: all-reduce operations started per step (hvd_acp: fused buffers, "
    "one per tensor for acp-nofusion; S-SGD under Horovod: tensors handed to Horovod, "
    "which fuses them in its background thread; DDP and DDP fp16: 1 per bucket; DDP "
    "powerSGD_hook: 3 per bucket: uncompressed tensors, Ps, Qs; DDP acp_hook: 1 per "
    "bucket).",
    "compression_s_per_step: hvd_acp's `reducer.compression_seconds` (wall time of the "
    "compression maths in hooks and step); DDP powerSGD_hook: thread CPU time of its bmm "
    "and orthogonalization calls (error-feedback copies not included, a lower bound); "
    "DDP acp_hook: `ACPState.compression_seconds` (wall time of its maths in the hook and "
    "the callbacks); S-SGD fp16 under Horovod: wall time of the casts to fp16 and back; "
    "DDP fp16_compress_hook: wall time of the hook (the cast to fp16; the cast back, in "
    "its callback, not counted); S-SGD and DDP: 0.",
    "link_tx_bytes_per_step (emulated network only): bytes each rank's interface really "
    "sent per timed step, Ethernet/IP/TCP headers included (from /proc/net/dev inside "
    "the rank's namespace): the proof that the traffic crossed the rate-limited link.",
    "cpu_share_outside_job: share of the machine's CPU time (all cores) used outside "
    "the job's processes while it ran (the worst round's): other users, and kernel work "
    "charged to no process (such as the emulated network's packet processing). Above 0.10 "
    "a job's times are flagged as likely disturbed (and, with --reruns, measured again once "
    "the machine has been idle for 3 s; the least disturbed attempt is kept; `attempts` "
    "counts them over all rounds).",
    "rounds: every job ran once per round, in an order rotated by one job per round "
    "(`order` in results.json); step_s_median is the median over rounds of each round's "
    "median step, step_s_low/high its interval; p10/p90 are over all timed steps of all "
    "rounds; per-step counters are medians over rounds; `per_round` keeps each round's "
    "figures. `ratios`: a's figure over b's (step, compression, bytes) computed inside "
    "each round, median over rounds (geometric mean of the middle two for an even count) "
    "and interval; verdict `faster` when the whole interval is below 1.0 (a needs less "
    "time, or fewer bytes), `slower` when above, `same` otherwise.",
    "exposed communication in breakdown.png = step - floor - compression, floored at 0.",
    "settings: the settings each method trained with, every default decided (hvd_acp's "
    "Settings, a baseline's settings, or torch's powerSGD_hook state), read from rank 0 "
    "after its steps. Without --matrix-rank under --optimizer adamw (config matrix_rank "
    "null) each method resolved its own default for the optimizer; torch's powerSGD_hook "
    "takes one int rank for every tensor: the one whose bytes per step come closest to "
    "what hvd_acp's Power-SGD sends under its defaults.",
    "ops_per_step (--count-ops): operator calls (`aten::` events of torch.profiler on the "
    "CPU, every thread, nested calls included) per step on rank 0, over 2 steps run after "
    "the timed ones and not timed; ops_over_floor_per_step subtracts the floor's (the "
    "plain local step): the calls the method adds, its compression path and its "
    "communication's tensor work. kernels_per_step and kernels_over_floor_per_step count "
    "only the leaf calls that run a kernel (not views, metadata or allocations): on a GPU, "
    "the launches.",
]


def run_benchmark(cfg: BenchConfig) -> Dict[str, Any]:
    """Run every job of ``cfg`` once per round and write the outputs into ``cfg.out``.

    ``cfg.out/raw`` and ``cfg.out/logs`` are emptied first: they hold this
    run's jobs only.
    """
    if cfg.rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {cfg.rounds!r}")
    cfg.out.mkdir(parents=True, exist_ok=True)
    for sub in ("raw", "logs"):
        shutil.rmtree(cfg.out / sub, ignore_errors=True)
    (cfg.out / "raw").mkdir()
    net = (EmulatedNetwork(cfg.np, cfg.bandwidth_mbit) if cfg.bandwidth_mbit is not None
           else None)
    diagnostic_keys = [d.key for d in DIAGNOSTICS] if cfg.diagnostics else []
    jobs = [FLOOR_JOB.key] + list(cfg.methods) + diagnostic_keys
    bar = None
    if cfg.progress:
        from tqdm import tqdm
        # A re-run (--reruns) adds its steps to the total as it starts.
        bar = tqdm(total=(cfg.warmup + cfg.steps) * len(jobs) * cfg.rounds, unit="step",
                   dynamic_ncols=True, file=sys.stderr)
    previous = {sig: signal.signal(sig, _raise_interrupted)
                for sig in (signal.SIGTERM, signal.SIGHUP)}
    per_round: Dict[str, List[Dict[str, Any]]] = {job: [] for job in jobs}
    order: List[List[str]] = []
    topology = "localhost (loopback, no emulation): horovodrun -H localhost:N / torchrun --standalone"
    started = time.monotonic()
    try:
        if net is not None:
            net.setup()
            topology = net.describe()
        runner = _Runner(cfg, net, bar)
        for round_index in range(cfg.rounds):
            sequence = round_order(jobs, round_index)
            order.append(sequence)
            for position, job in enumerate(sequence):
                entry = _measure(cfg, runner, job, round_index)
                entry.update(round=round_index + 1, position=position + 1)
                per_round[job].append(entry)
            elapsed = time.monotonic() - started
            logger.info("round %d of %d done, %.0f s so far, about %.0f s to go",
                        round_index + 1, cfg.rounds, elapsed,
                        elapsed / (round_index + 1) * (cfg.rounds - round_index - 1))
    finally:
        if bar is not None:
            bar.close()
        if net is not None:
            net.teardown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    duration_s = time.monotonic() - started

    compute_only = dict(summarize_rounds(per_round[FLOOR_JOB.key]), processes=1)
    methods = {m: summarize_rounds(per_round[m]) for m in cfg.methods}
    for counted, over in (("ops_per_step", "ops_over_floor_per_step"),
                          ("kernels_per_step", "kernels_over_floor_per_step")):
        if compute_only.get(counted) is not None:
            for entry in methods.values():
                if entry.get(counted) is not None:
                    entry[over] = entry[counted] - compute_only[counted]
    diagnostics = {d: summarize_rounds(per_round[d]) for d in diagnostic_keys}
    gradient_bytes = compute_only.get("gradient_bytes")
    ratio = {"gradient_mb": gradient_bytes / 1e6 if gradient_bytes else None,
             "ssgd_comm_s_at_line_rate": None}
    if gradient_bytes and cfg.bandwidth_mbit:
        ratio["ssgd_comm_s_at_line_rate"] = (2 * (cfg.np - 1) / cfg.np * gradient_bytes * 8
                                             / (cfg.bandwidth_mbit * 1e6))
    results: Dict[str, Any] = {
        "config": {
            "model": cfg.model, "np": cfg.np, "batch_size": cfg.batch_size,
            "matrix_rank": cfg.matrix_rank, "optimizer": cfg.optimizer,
            "bandwidth_mbit": cfg.bandwidth_mbit,
            "topology": topology, "versions": _versions(), "steps": cfg.steps,
            "warmup": cfg.warmup, "image_size": cfg.image_size if cfg.model == "resnet50"
            else None, "seq_len": cfg.seq_len if cfg.model == "bert-base" else None,
            "threads_per_rank": cfg.threads, "cpus": os.cpu_count(),
            "horovod_cycle_time_ms": cfg.horovod_cycle_time_ms,
            "methods": cfg.methods, "command": cfg.command, "count_ops": cfg.count_ops,
            "compute_vs_communication": ratio, "rounds": cfg.rounds,
        },
        "rounds": cfg.rounds,
        "order": order,
        "duration_s": duration_s,
        "methods": methods,
        "compute_only": compute_only,
        "notes": NOTES,
    }
    if cfg.diagnostics:
        results["diagnostics"] = diagnostics
    report.derive(results)
    (cfg.out / "results.json").write_text(json.dumps(results, indent=2))
    (cfg.out / "results.md").write_text(report.markdown(results))
    report.plot_breakdown(results, cfg.out / "breakdown.png")
    return results
