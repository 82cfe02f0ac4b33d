"""Compare S-SGD, Power-SGD and ACP-SGD on the example tasks; write bench-results/compare/.

    .venv/bin/python scripts/compare.py               # what `make compare` runs
    .venv/bin/python scripts/compare.py --tasks lm-sweep   # the LM's settings sweep

Every method runs the example scripts with the same seeds and the same
hyper-parameters (the scripts' defaults) on ``--np`` ranks under
``horovodrun --gloo``; only ``--optimizer`` and the flags shown change.
Tasks:

- ``digits``: the digits CNN (examples/train.py), once per seed in ``--seeds``;
- ``digits-link``: the same runs with every rank in its own network
  namespace behind an emulated ``--bandwidth`` link (the emulation of the
  repository's benchmark, benchmarks/netem.py; needs root, ``ip`` and
  ``tc``, else skipped with a message):
  accuracy against wall time where the network is the bottleneck;
- ``lm``: the standard-library language model (examples/train_lm.py), once
  per seed in ``--lm-seeds``, plus the ACP-SGD setting that closes the gap
  to S-SGD;
- ``lm-sweep`` (not run by default, about 20 minutes): the learning rates,
  matrix ranks and warm-up lengths behind that setting;
- ``grid`` (not run by default, about an hour: ``make grid``): the
  robustness grid of the digits CNN, every method over np in {2, 4, 8},
  per-rank batch in {32, 128} and momentum in {0, 0.9, Nesterov 0.9}, with
  Horovod's linear learning-rate scaling (0.025 per 32 images of a rank,
  times the number of ranks), for every seed in ``--seeds``: a table and
  heat maps of final accuracy and of ACP-SGD's gap to S-SGD.

Runs are interleaved by seed (all methods for seed 0, then seed 1, ...) so
that a change in the machine's load hits every method alike. Each run writes
its ``--summary`` JSON and its log under ``--results`` (default
``bench-results/compare/``); the report (``--doc``, default ``results.md``
there: tables, the exact commands, pictures beside it) is built from those
files only, with the date and the host it was made on. The section of a task
that is not run keeps its earlier text (each between scripts/docgen.py's
markers, ``<!-- compare:TASK -->``). ``--report-only`` rebuilds the sections
of ``--tasks`` from earlier results.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
RESULTS = REPO / "bench-results" / "compare"

from hvd_acp.methods import HOROVOD, REGISTRY  # noqa: E402


@dataclass(frozen=True)
class Run:
    """One training run: a table row's method, its extra flags and a seed."""

    label: str
    optimizer: str
    seed: int
    args: Tuple[str, ...] = ()
    #: Ranks of this run (None: ``--np``).
    np: Optional[int] = None

    @property
    def key(self) -> str:
        return re.sub(r"[^a-z0-9]+", "_", f"{self.label} seed {self.seed}".lower()).strip("_")

    def flag(self, name: str) -> Optional[str]:
        return self.args[self.args.index(name) + 1] if name in self.args else None


@dataclass
class Task:
    name: str
    script: str
    title: str
    runs: List[Run]
    #: Run over the emulated link of ``--bandwidth`` instead of loopback.
    link: bool = False

    @property
    def stem(self) -> str:
        """Prefix of the task's files under ``--results``."""
        return self.script[:-3] + ("_link" if self.link else "")


#: (row label, ``--optimizer`` of the examples, extra flags): the Horovod methods
#: of hvd_acp.methods, each named by its algorithm; one per algorithm (its
#: variants, such as the ablations that only schedule the same maths
#: differently, are left to the benchmark).
METHODS = tuple((m.algorithm, m.key, ()) for m in REGISTRY.values()
                if m.launcher == HOROVOD and m.variant_of is None)
# Two settings compared with ACP-SGD's defaults on the LM: a higher rank, and
# exact steps before compression starts (see lm-sweep).
# ACP-SGD with its fused buffers in fp16 on the wire (half the bytes), on
# the digits: the fair counterpart of S-SGD with fp16 gradients.
DIGITS_VARIANTS = (("ACP-SGD, fp16 on the wire", "acp-fp16", ()),)
LM_ACP_SETTINGS = (("ACP-SGD, rank 48", "acp", ("--matrix-rank", "48")),
                   ("ACP-SGD, warm-up 300", "acp", ("--warmup-steps", "300")))


LM_SWEEP_SEEDS = (1, 2)


def lm_sweep_runs() -> List[Run]:
    runs = []
    for lr in ("1e-3", "2e-3", "8e-3"):
        runs += [Run(f"S-SGD, lr {lr}", "ssgd", 0, ("--lr", lr)),
                 Run(f"ACP-SGD, lr {lr}", "acp", 0, ("--lr", lr))]
    runs += [Run(f"ACP-SGD, rank {r}", "acp", 0, ("--matrix-rank", r)) for r in ("16", "40")]
    runs.append(Run("ACP-SGD, warm-up 100", "acp", 0, ("--warmup-steps", "100")))
    # More seeds for the methods and the settings of the LM table: a seed
    # changes the gaps by up to 2 points.
    for seed in LM_SWEEP_SEEDS:
        runs += [Run(label, opt, seed, extra)
                 for label, opt, extra in (*METHODS, *LM_ACP_SETTINGS)]
    return runs


#: The robustness grid (task ``grid``): ranks, per-rank batch sizes, momentum settings.
GRID_NP = (2, 4, 8)
GRID_BATCH = (32, 128)
GRID_MOMENTUM = (("momentum 0", ("--momentum", "0")), ("momentum 0.9", ()),
                 ("Nesterov 0.9", ("--nesterov",)))
#: Per-rank learning rate for 32 images; scaled linearly with the batch
#: (the example multiplies it by the number of ranks).
GRID_LR_PER_32 = 0.025


def grid_cell(np: int, batch: int, momentum: str) -> str:
    return f"np {np}, batch {batch}, {momentum}"


def grid_runs(seeds: Sequence[int]) -> List[Run]:
    runs = []
    for np in GRID_NP:
        for batch in GRID_BATCH:
            lr = GRID_LR_PER_32 * batch / 32
            for momentum, flags in GRID_MOMENTUM:
                cell = grid_cell(np, batch, momentum)
                extra = ("--batch-size", str(batch), "--lr", f"{lr:g}", *flags)
                for seed in seeds:
                    runs += [Run(f"{label} | {cell}", opt, seed, extra + more, np)
                             for label, opt, more in METHODS]
    return runs


def make_tasks(args) -> List[Task]:
    tasks = []
    digits_runs = [Run(label, opt, seed, extra) for seed in args.seeds
                   for label, opt, extra in (*METHODS, *DIGITS_VARIANTS)]
    if "digits" in args.tasks:
        tasks.append(Task("digits", "train.py",
                          "Digits CNN (scikit-learn handwritten digits, 8x8)", digits_runs))
    if "digits-link" in args.tasks:
        tasks.append(Task("digits-link", "train.py",
                          f"Digits CNN over an emulated {args.bandwidth_mbit:g} Mbit/s link",
                          digits_runs, link=True))
    if "lm" in args.tasks or "lm-sweep" in args.tasks:
        main_runs = [Run(label, opt, seed, extra) for seed in args.lm_seeds
                     for label, opt, extra in (*METHODS, *LM_ACP_SETTINGS)]
        if "lm" in args.tasks:
            tasks.append(Task("lm", "train_lm.py",
                              "Byte-level transformer LM on the Python standard library",
                              main_runs))
        if "lm-sweep" in args.tasks:
            tasks.append(Task("lm-sweep", "train_lm.py",
                              "The LM across learning rate, matrix rank and "
                              "warm-up", lm_sweep_runs()))
    if "grid" in args.tasks:
        tasks.append(Task("grid", "train.py",
                          "Robustness grid: digits CNN with Horovod's learning-rate scaling",
                          grid_runs(args.seeds)))
    return tasks


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2, help="ranks (default: %(default)s)")
    parser.add_argument("--tasks", nargs="+", choices=("digits", "digits-link", "lm", "lm-sweep", "grid"),
                        default=["digits", "digits-link", "lm"], help="(default: %(default)s)")
    parser.add_argument("--bandwidth", default="100mbit",
                        help="link of each rank in the digits-link task, e.g. 100mbit, 1gbit "
                             "(default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="seeds of the digits runs (default: %(default)s)")
    parser.add_argument("--lm-seeds", type=int, nargs="+", default=[0],
                        help="seeds of the language-model runs (default: %(default)s)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="summaries and logs of every run (default: bench-results/compare)")
    parser.add_argument("--doc", type=Path, default=None,
                        help="the report (default: results.md under --results)")
    parser.add_argument("--img", type=Path, default=None,
                        help="its pictures (default: --results)")
    parser.add_argument("--timeout", type=float, default=1200,
                        help="seconds before a run is killed (default: %(default)s)")
    parser.add_argument("--only", metavar="REGEX",
                        help="run only the runs whose label matches (e.g. a part of the "
                             "grid); the report is built from every summary found")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs whose summary is already in --results (from "
                             "this version of the code) and run only the missing ones")
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild the report from the summaries already in --results")
    args = parser.parse_args(argv)
    from hvd_acp.plan.units import parse_bandwidth
    try:
        args.bandwidth_mbit = parse_bandwidth(args.bandwidth)
    except ValueError as exc:
        parser.error(str(exc))
    if args.bandwidth_mbit is None:
        parser.error("--bandwidth must be a rate such as 100mbit")
    args.doc = args.doc or args.results / "results.md"
    args.img = args.img or args.results
    return args


# --------------------------------------------------------------------- runs
def _rel(path: Path) -> str:
    path = Path(path)
    if not path.is_absolute():
        return str(path)
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def training_argv(task: Task, run: Run, summary: Path) -> List[str]:
    """What every rank runs."""
    return [_rel(Path(sys.executable)), f"examples/{task.script}",
            "--optimizer", run.optimizer, "--seed", str(run.seed), *run.args,
            "--no-progress", "--summary", _rel(summary)]


def command(task: Task, run: Run, np: int, summary: Path) -> List[str]:
    """The loopback command line (``horovodrun``); link tasks start the
    ranks themselves (see :func:`launch_on_link`)."""
    if task.link:
        return training_argv(task, run, summary)
    np = run.np or np
    launcher = Path(sys.executable).with_name("horovodrun")
    return [_rel(launcher), "-np", str(np), "-H", f"localhost:{np}", "--gloo",
            *training_argv(task, run, summary)]


def shell_line(cmd: Sequence[str]) -> str:
    return "OMP_NUM_THREADS=1 " + " ".join(shlex.quote(c) for c in cmd)


def run_env() -> Dict[str, str]:
    """The environment of every training run: one thread per rank, unbuffered output."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def launch(cmd: Sequence[str], log: Path, timeout: float) -> int:
    """Run ``cmd`` from the repository root in its own process group.

    On timeout the whole group (horovodrun and every rank) is killed.
    """
    env = run_env()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\n[compare] killed after {timeout:.0f} s\n")
            return -signal.SIGKILL


def launch_on_link(net, cmd: Sequence[str], log: Path, timeout: float) -> int:
    """Run ``cmd`` on every node of ``net``, a Horovod job over its links.

    What ``horovodrun -np N -H node0:1,...`` does on a cluster: a rendezvous
    server (in the hub namespace) and one rank per node, each with the
    per-slot environment. A rank that fails stops the others; on timeout
    everything is killed.
    """
    from benchmarks.launch import JobError, run_job, stop
    from benchmarks.rendezvous import rank_commands, start_server

    # Ranks started by hand: hvd_acp from this checkout, as horovodrun's would find it.
    env = dict(run_env(), PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    if log.exists():
        log.unlink()
    server = None
    try:
        server, port = start_server(net, sys.executable, env)
        # The command's paths are relative to the repository.
        run_job(rank_commands(net, cmd, env, port, cwd=str(REPO)), log, timeout)
        return 0
    except (JobError, RuntimeError) as exc:
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"\n[compare] {exc}\n")
        return 1
    finally:
        if server is not None:
            server.stdin.close()
            stop([server])


def has_powersgd() -> bool:
    try:
        import hvd_acp
    except ImportError:
        return False
    return hasattr(hvd_acp, "PowerSGDOptimizer")


def run_all(tasks: List[Task], args) -> None:
    args.results.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        if task.link:
            from benchmarks.netem import emulation_problem
            problem = emulation_problem()
            if problem:
                print(f"[compare] skipping {task.name}: {problem}", flush=True)
                continue
            from benchmarks.netem import EmulatedNetwork
            with EmulatedNetwork(args.np, args.bandwidth_mbit) as net:
                print(f"[compare] {task.name}: {net.describe()}", flush=True)
                run_task(task, args, net)
        else:
            run_task(task, args, None)


def run_task(task: Task, args, net) -> None:
    for run in sorted(task.runs, key=lambda r: r.seed):
        if args.only and not re.search(args.only, run.label):
            continue
        if run.optimizer == "powersgd" and not has_powersgd():
            print(f"[compare] skipping {run.label}: hvd_acp.PowerSGDOptimizer does not "
                  "exist in this version of hvd_acp", flush=True)
            continue
        summary = summary_path(task, run, args.results)
        if summary.exists():
            if args.resume:
                print(f"[compare] keeping {_rel(summary)}", flush=True)
                continue
            summary.unlink()
        cmd = command(task, run, args.np, summary)
        print(f"[compare] {shell_line(cmd)}", flush=True)
        start = time.perf_counter()
        log = summary.with_suffix(".log")
        rc = (launch_on_link(net, cmd, log, args.timeout) if net is not None
              else launch(cmd, log, args.timeout))
        status = "ok" if rc == 0 and summary.exists() else f"FAILED (exit {rc})"
        print(f"[compare]   {status} in {time.perf_counter() - start:.0f} s; "
              f"log {_rel(log)}", flush=True)


# ------------------------------------------------------------------- report
def summary_path(task: Task, run: Run, results: Path) -> Path:
    return results / f"{task.stem}_{run.key}.json"


def load(task: Task, results: Path) -> Dict[Run, dict]:
    found = {}
    for run in task.runs:
        path = summary_path(task, run, results)
        if path.exists():
            found[run] = json.loads(path.read_text(encoding="utf-8"))
    return found


def by_label(found: Dict[Run, dict]) -> Dict[str, List[Tuple[Run, dict]]]:
    groups: Dict[str, List[Tuple[Run, dict]]] = {}
    for run, summary in found.items():
        groups.setdefault(run.label, []).append((run, summary))
    return groups


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f}"


def _rank(run: Run, summary: dict) -> str:
    if run.optimizer == "ssgd":
        return "–"
    config = summary["config"]
    return str(config.get("settings", {}).get("matrix_rank", config["matrix_rank"]))


def _bytes_cells(summary: dict) -> str:
    sent, ssgd = summary["bytes_sent_per_rank"], summary["ssgd_bytes_per_rank"]
    return f"{_mb(sent)} | {ssgd / sent:.2f}x"


def digits_section(task: Task, found, args) -> List[str]:
    out = ["| method | matrix rank | final test accuracy (%), mean ± std (min – max) | "
           "per seed | bytes sent per rank (MB) | less than S-SGD | steps | "
           "wall time (s), mean |",
           "|---|---|---|---|---|---|---|---|"]
    means = {}
    for label, rows in by_label(found).items():
        acc = [100 * s["test_accuracy"] for _, s in rows]
        mean = statistics.fmean(acc)
        std = statistics.stdev(acc) if len(acc) > 1 else 0.0
        means[label] = mean
        run, first = rows[0]
        out.append(f"| {label} | {_rank(run, first)} | {mean:.2f} ± {std:.2f} "
                   f"({min(acc):.2f} – {max(acc):.2f}) | "
                   f"{', '.join(f'{a:.2f}' for a in acc)} | {_bytes_cells(first)} | "
                   f"{first['steps']} | {statistics.fmean(s['wall_s'] for _, s in rows):.1f} |")
    out.append("")
    seeds = sorted({r.seed for r in found})
    if "S-SGD" in means and "ACP-SGD" in means:
        gap = means["ACP-SGD"] - means["S-SGD"]
        out.append(f"ACP-SGD minus S-SGD, mean final test accuracy over seeds {seeds}: "
                   f"**{gap:+.2f} points** (target: no worse than -0.5): "
                   f"{'met' if gap >= -0.5 else 'NOT met'}. The test set has "
                   f"{next(iter(found.values()))['config']['test_size']} images: one image "
                   f"is {100 / next(iter(found.values()))['config']['test_size']:.2f} points.\n")
    if task.link:
        out += time_to_accuracy(found, DIGITS_TARGET)
    picture = args.img / f"convergence_{task.name.replace('-', '_')}.png"
    plot(found, "test_accuracy_per_epoch", "test accuracy (%)", 100, picture, task.title)
    out.append(f"![{task.title}]({os.path.relpath(picture, args.doc.parent)})\n")
    return out


#: Test accuracy whose time to reach is reported for runs over a link.
DIGITS_TARGET = 0.95


def time_to_accuracy(found: Dict[Run, dict], target: float) -> List[str]:
    """Per method: training wall time (mean over seeds), and time until the
    test accuracy first reaches ``target`` at an epoch's end."""
    rows = ["| method | training wall time (s), mean | vs S-SGD | time to "
            f"{100 * target:g}% test accuracy (s), mean | vs S-SGD |", "|---|---:|---:|---:|---:|"]
    stats = {}
    for label, runs in by_label(found).items():
        train = statistics.fmean(s["train_s"] for _, s in runs)
        reach = []
        for _, summary in runs:
            hits = [t for acc, t in zip(summary["test_accuracy_per_epoch"],
                                        summary["train_s_per_epoch"]) if acc >= target]
            reach.append(hits[0] if hits else None)
        stats[label] = (train, statistics.fmean(reach) if None not in reach else None,
                        reach.count(None))
    ref = stats.get("S-SGD")
    for label, (train, reach, missed) in stats.items():
        speed = f"{ref[0] / train:.2f}x" if ref else "–"
        if reach is None:
            reach_cell, reach_speed = f"not reached in {missed} run(s)", "–"
        else:
            reach_cell = f"{reach:.1f}"
            reach_speed = f"{ref[1] / reach:.2f}x" if ref and ref[1] else "–"
        rows.append(f"| {label} | {train:.1f} | {speed} | {reach_cell} | {reach_speed} |")
    return rows + [""]


def lm_reference(run: Run, found: Dict[Run, dict]) -> Optional[dict]:
    """The S-SGD run with the same seed and learning rate as ``run``."""
    for other, summary in found.items():
        if (other.optimizer == "ssgd" and other.seed == run.seed
                and other.flag("--lr") == run.flag("--lr")):
            return summary
    return None


def lm_rows(found: Dict[Run, dict], with_seed: bool) -> List[str]:
    out = []
    for run, summary in found.items():
        ref = lm_reference(run, found)
        gap = f"{100 * (summary['val_loss'] / ref['val_loss'] - 1):+.2f}%" if ref else "–"
        flags = " ".join(run.args) if run.args else "defaults"
        seed = f"{run.seed} | " if with_seed else ""
        out.append(f"| {run.label} | {seed}`{flags}` | {_rank(run, summary)} | "
                   f"{summary['config']['effective_lr']:g} | {summary['val_loss']:.4f} | "
                   f"{summary['val_ppl']:.3f} | {gap} | {_bytes_cells(summary)} | "
                   f"{summary['steps']} | {summary['wall_s']:.0f} |")
    return out


LM_HEADER = ("| method | {seed}flags | matrix rank | lr × ranks | final val loss "
             "(nats/byte) | val perplexity | vs S-SGD (same lr, seed) | bytes sent per rank "
             "(MB) | less than S-SGD | steps | wall time (s) |")


def lm_section(task: Task, found, args) -> List[str]:
    out = [LM_HEADER.format(seed=""), "|---" * 11 + "|", *lm_rows(found, False), ""]
    for run, summary in found.items():
        ref = lm_reference(run, found)
        if ref and run.optimizer == "acp":
            rel = 100 * (summary["val_loss"] / ref["val_loss"] - 1)
            out.append(f"- {run.label} (seed {run.seed}): final validation loss "
                       f"**{rel:+.2f}%** relative to S-SGD (target: within 2%): "
                       f"{'met' if rel <= 2 else 'NOT met'}.")
    out.append("")
    picture = args.img / "convergence_lm.png"
    plot(found, "val_loss_per_epoch", "validation loss (nats per byte)", 1, picture,
         task.title)
    out.append(f"![{task.title}]({os.path.relpath(picture, args.doc.parent)})\n")
    return out


def _sweep_order(run: Run, summary: dict) -> tuple:
    """Seed, then learning rates (S-SGD before ACP-SGD), ranks, warm-ups, Power-SGD."""
    if run.optimizer == "powersgd":
        return run.seed, 3, 0.0, ""
    if run.flag("--matrix-rank"):
        return run.seed, 1, float(run.flag("--matrix-rank")), ""
    if run.flag("--warmup-steps"):
        return run.seed, 2, float(run.flag("--warmup-steps")), ""
    return run.seed, 0, summary["config"]["lr"], run.optimizer != "ssgd"


def lm_sweep_section(task: Task, found, args) -> List[str]:
    # The main LM runs (default flags, seed 0) are the sweep's reference points.
    lm_task = next(t for t in make_tasks(argparse.Namespace(
        tasks=["lm"], seeds=[], lm_seeds=[0])) if t.name == "lm")
    everything = {**load(lm_task, args.results), **found}
    ordered = dict(sorted(everything.items(), key=lambda kv: _sweep_order(*kv)))
    out = [LM_HEADER.format(seed="seed | "), "|---" * 12 + "|", *lm_rows(ordered, True), ""]
    extra = [r for r in everything if r not in found]
    if extra:
        out.append("The seed-0 rows of the methods and settings of the table above "
                   "are its runs.\n")
    out += seed_means(everything)
    return out


def seed_means(found: Dict[Run, dict]) -> List[str]:
    """Mean over seeds of every setting run with more than one seed."""
    groups = {label: rows for label, rows in by_label(found).items() if len(rows) > 1}
    ssgd = {run.seed: s["val_loss"] for run, s in found.items()
            if run.optimizer == "ssgd" and not run.args}
    if not groups or not ssgd:
        return []
    out = ["Over seeds (relative gap to S-SGD of the same seed):\n",
           "| method | seeds | mean final val loss | gap per seed | mean gap |",
           "|---|---|---|---|---|"]
    for label, rows in groups.items():
        rows = sorted(rows, key=lambda rs: rs[0].seed)
        gaps = [100 * (s["val_loss"] / ssgd[r.seed] - 1) for r, s in rows if r.seed in ssgd]
        out.append(f"| {label} | {', '.join(str(r.seed) for r, _ in rows)} | "
                   f"{statistics.fmean(s['val_loss'] for _, s in rows):.4f} | "
                   f"{', '.join(f'{g:+.2f}%' for g in gaps)} | "
                   f"{statistics.fmean(gaps):+.2f}% |")
    out.append("")
    return out


def grid_table(found: Dict[Run, dict]) -> Dict[str, Dict[str, List[float]]]:
    """{cell: {method label: final test accuracies (%) over seeds}}."""
    table: Dict[str, Dict[str, List[float]]] = {}
    for run, summary in sorted(found.items(), key=lambda kv: kv[0].seed):
        method, _, cell = run.label.partition(" | ")
        table.setdefault(cell, {}).setdefault(method, []).append(
            100 * summary["test_accuracy"])
    return table


#: Targets of the grid: where S-SGD reaches GRID_ELIGIBLE, ACP-SGD's mean is
#: within GRID_MEAN_GAP points and no seed is more than GRID_SEED_GAP below.
GRID_ELIGIBLE, GRID_MEAN_GAP, GRID_SEED_GAP = 95.0, 1.0, 3.0


def grid_verdict(accs: Dict[str, List[float]]) -> str:
    ssgd, acp = accs.get("S-SGD"), accs.get("ACP-SGD")
    if not ssgd or not acp:
        return "–"
    reference = statistics.fmean(ssgd)
    if reference < GRID_ELIGIBLE:
        return f"exempt (S-SGD < {GRID_ELIGIBLE:g}%)"
    ok = (statistics.fmean(acp) >= reference - GRID_MEAN_GAP
          and min(acp) >= reference - GRID_SEED_GAP)
    return "met" if ok else "**missed**"


def grid_section(task: Task, found, args) -> List[str]:
    table = grid_table(found)
    methods = [label for label, _, _ in METHODS]
    out = []
    if len(found) < len(task.runs):
        out.append(f"**Partial grid: {len(found)} of its {len(task.runs)} runs are in this "
                   "table** (`make grid` runs them all); a cell's verdict counts the seeds "
                   "it has.\n")
    out += ["| cell (ranks, per-rank batch, momentum) | lr × ranks | "
           + " | ".join(f"{m}: mean (per seed)" for m in methods)
           + " | ACP-SGD − S-SGD (points) | worst ACP-SGD seed − S-SGD mean | target |",
           "|---|---:|" + "---|" * len(methods) + "---:|---:|---|"]
    verdicts = []
    for run in task.runs:
        method, _, cell = run.label.partition(" | ")
        if cell not in table or method != methods[0] or run.seed != task.runs[0].seed:
            continue
        accs = table[cell]
        cells = []
        for m in methods:
            values = accs.get(m, [])
            cells.append(f"{statistics.fmean(values):.2f} ({', '.join(f'{v:.1f}' for v in values)})"
                         if values else "–")
        gap = worst = "–"
        if accs.get("S-SGD") and accs.get("ACP-SGD"):
            reference = statistics.fmean(accs["S-SGD"])
            gap = f"{statistics.fmean(accs['ACP-SGD']) - reference:+.2f}"
            worst = f"{min(accs['ACP-SGD']) - reference:+.2f}"
        verdict = grid_verdict(accs)
        verdicts.append(verdict)
        lr = run.np * float(run.flag("--lr"))
        out.append(f"| {cell} | {lr:g} | " + " | ".join(cells) + f" | {gap} | {worst} | {verdict} |")
    eligible = [v for v in verdicts if not v.startswith("exempt") and v != "–"]
    met = sum(v == "met" for v in eligible)
    out += ["", f"Cells where S-SGD reaches {GRID_ELIGIBLE:g}%: {len(eligible)} of "
            f"{len(verdicts)}; ACP-SGD within {GRID_MEAN_GAP:g} point of S-SGD's mean with no "
            f"seed more than {GRID_SEED_GAP:g} points below it: **{met} of {len(eligible)}**.\n"]
    picture = args.img / "robustness_grid.png"
    plot_grid(table, [run.label.partition(" | ")[2] for run in task.runs
                      if run.label.startswith(methods[0] + " | ")
                      and run.seed == task.runs[0].seed], methods, picture)
    out.append(f"![{task.title}]({os.path.relpath(picture, args.doc.parent)})\n")
    return out


def plot_grid(table: Dict[str, Dict[str, List[float]]], cells: List[str],
              methods: List[str], path: Path) -> None:
    """Heat maps: each method's mean final accuracy, and ACP-SGD minus S-SGD."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [c for c in dict.fromkeys(", ".join(c.split(", ")[:2]) for c in cells)]
    cols = [c for c in dict.fromkeys(c.split(", ", 2)[2] for c in cells)]

    def grid_of(fn):
        values = np.full((len(rows), len(cols)), np.nan)
        for i, row in enumerate(rows):
            for j, col in enumerate(cols):
                accs = table.get(f"{row}, {col}", {})
                value = fn(accs)
                if value is not None:
                    values[i, j] = value
        return values

    def mean_of(method):
        return lambda accs: statistics.fmean(accs[method]) if accs.get(method) else None

    def gap(accs):
        if accs.get("S-SGD") and accs.get("ACP-SGD"):
            return statistics.fmean(accs["ACP-SGD"]) - statistics.fmean(accs["S-SGD"])
        return None

    panels = [(f"{m}: mean final test accuracy (%)", grid_of(mean_of(m)), "viridis", (10, 100))
              for m in methods]
    panels.append(("ACP-SGD minus S-SGD (points)", grid_of(gap), "RdBu", (-10, 10)))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 0.6 * len(rows) + 2.2))
    for ax, (title, values, cmap, (low, high)) in zip(axes, panels):
        image = ax.imshow(values, cmap=cmap, vmin=low, vmax=high, aspect="auto")
        ax.set_xticks(range(len(cols)), cols, rotation=20)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_title(title, fontsize=10)
        for i in range(len(rows)):
            for j in range(len(cols)):
                if not np.isnan(values[i, j]):
                    ax.text(j, i, f"{values[i, j]:.1f}", ha="center", va="center", fontsize=8,
                            color=("white" if (abs(values[i, j]) > 6 if cmap == "RdBu"
                                                 else values[i, j] < 60) else "black"))
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


SECTIONS: Dict[str, Callable] = {"digits": digits_section, "digits-link": digits_section,
                                 "lm": lm_section, "lm-sweep": lm_sweep_section,
                                 "grid": grid_section}


def plot(found: Dict[Run, dict], metric: str, ylabel: str, scale: float, path: Path,
         title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    many = False
    for label, rows in by_label(found).items():
        summaries = [s for _, s in rows]
        values = [[scale * v for v in s[metric]] for s in summaries]
        steps = summaries[0]["step_per_epoch"]
        mean = [statistics.fmean(col) for col in zip(*values)]
        seconds = [statistics.fmean(col)
                   for col in zip(*(s["train_s_per_epoch"] for s in summaries))]
        many |= len(summaries) > 1
        name = label + (f" ({len(summaries)} seeds)" if len(summaries) > 1 else "")
        for ax, x in ((axes[0], steps), (axes[1], seconds)):
            line, = ax.plot(x, mean, marker="o", markersize=3, label=name)
            if len(summaries) > 1:
                ax.fill_between(x, [min(c) for c in zip(*values)],
                                [max(c) for c in zip(*values)],
                                color=line.get_color(), alpha=0.15)
    axes[0].set_xlabel("optimizer step")
    axes[1].set_xlabel("training wall time (s), evaluation excluded")
    axes[0].set_ylabel(ylabel)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title + (" (line: mean over seeds, band: min – max)" if many else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def section_text(task: Task, args) -> Optional[str]:
    import horovod
    import torch

    found = load(task, args.results)
    if not found:
        return None
    invocation = f"{_rel(Path(sys.argv[0]))} --tasks {task.name}"
    if task.link:
        from benchmarks.netem import EmulatedNetwork
        invocation += f" --bandwidth {args.bandwidth}"
        where = (f"{args.np} ranks, each started by the script in its own network namespace "
                 f"with Horovod's Gloo rendezvous as `horovodrun` sets it up on a cluster: "
                 f"{EmulatedNetwork(args.np, args.bandwidth_mbit).describe()}")
    else:
        ranks = sorted({run.np or args.np for run in task.runs})
        where = (f"{'/'.join(map(str, ranks))} ranks under `horovodrun --gloo` on localhost")
    lines = [f"## {task.title}\n",
             f"Generated by `{invocation}` on {datetime.date.today().isoformat()}: {where}; "
             f"one thread per rank, {os.cpu_count()} CPU cores "
             f"({platform.machine()}), Python {platform.python_version()}, torch "
             f"{torch.__version__}, Horovod {horovod.__version__}.\n"]
    lines += SECTIONS[task.name](task, found, args)
    if any(r.optimizer == "powersgd" for r in task.runs) and not any(
            r.optimizer == "powersgd" for r in found):
        lines.append("No Power-SGD rows: " + (
            "`hvd_acp.PowerSGDOptimizer` did not exist when these runs were made.\n"
            if not has_powersgd() else "its runs failed; see their logs.\n"))
    lines.append("<details><summary>Exact commands of these runs</summary>\n\n"
                 + ("Every rank runs, in its own namespace:\n\n" if task.link else "")
                 + "```sh")
    for run in found:
        lines.append(shell_line(command(task, run, args.np,
                                        summary_path(task, run, args.results))))
    lines.append("```\n</details>\n")
    return "\n".join(lines)


def _sections_of(text: str) -> Dict[str, str]:
    """The sections of an earlier report, by task."""
    return dict(re.findall(r"<!-- compare:([\w-]+) -->\n\n(.*?)\n\n<!-- end compare:\1 -->",
                           text, flags=re.S))


INTRO = """# S-SGD, Power-SGD and ACP-SGD on the example tasks

Made by `scripts/compare.py`. Each method runs the same example script with
the same seeds and hyper-parameters; only `--optimizer` (and the flags shown)
change. Bytes are what each rank handed to gradient all-reduces: counted by
hvd_acp's `comm_stats` for Power-SGD and ACP-SGD, one full fp32 gradient per
step for S-SGD (`hvd.DistributedOptimizer`). Over loopback, wall times come
from the host named in each section with no network in the way: they are
noisy and say nothing about speed on a real network. The digits runs over an
emulated link (each rank in its own network namespace behind a rate-limited
interface, as in the benchmarks) show accuracy against wall time where the
network is the bottleneck.

Reproduce with `make compare` (digits, digits over a 100 Mbit/s link when
run as root, and the LM) and `.venv/bin/python scripts/compare.py --tasks
lm-sweep` (the LM sweep).
"""


def write_report(tasks: List[Task], args) -> None:
    from docgen import markers
    old = args.doc.read_text(encoding="utf-8") if args.doc.exists() else ""
    sections = _sections_of(old)
    for task in tasks:
        text = section_text(task, args)
        if text is not None:
            sections[task.name] = text.strip("\n")
    parts = [INTRO]
    for name in SECTIONS:
        if name in sections:
            start, end = markers(f"compare:{name}")
            parts.append(f"{start}\n\n{sections[name]}\n\n{end}\n")
    args.doc.parent.mkdir(parents=True, exist_ok=True)
    args.doc.write_text("\n".join(parts), encoding="utf-8")
    print(f"[compare] wrote {_rel(args.doc)}", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    tasks = make_tasks(args)
    if not args.report_only:
        run_all(tasks, args)
    write_report(tasks, args)


if __name__ == "__main__":
    main()
