"""The benchmark's generated blocks of docs/benchmarks.md, README.md and docs/ddp.md,
rendered from bench-results/.

    .venv/bin/python scripts/docgen.py --only bench      # these blocks, through the generator
    .venv/bin/python scripts/bench_doc.py                # the same

Each run directory under bench-results/ holds what ``python -m benchmarks
--out DIR`` wrote: results.json, results.md (the run's full tables),
breakdown.png and logs. The pages link each run's results.md rather than
copying it; their generated blocks (scripts/docgen.py's registry, which
takes them from :func:`blocks`) carry only tables rendered from the runs'
results.json by the benchmark's own report code, so that a number or a
comparison there is the one of a run in the repository, and a method said
to be faster than another is the verdict of that run's interval:

- ``runs`` (docs/benchmarks.md): an index of the runs of :data:`RUNS`, one
  row each (configuration, rounds, ACP-SGD's verdicts against S-SGD and
  Power-SGD (hvd_acp), duration, links to its results.md and breakdown
  picture), and every run's command as it runs from the checkout today
  (:func:`shown_command`); the breakdown pictures are drawn into docs/img/
  as ``bench_<run>.png`` (:func:`figures`);
- ``targets``: the targets, each met, missed, or not separable from noise
  (:data:`TARGETS`), against the communication-bound runs (:data:`TARGET_RUNS`);
- ``time``: the diagnostic jobs of the runs with rounds and ``--diagnostics``
  (:data:`TIME_RUNS`);
- ``baselines``: ACP-SGD against the strongest baselines and its ablations
  (:data:`BASELINE_TARGETS` and :data:`ABLATIONS` against :data:`BASELINE_RUNS`),
  and the operator calls per step of the ``--count-ops`` runs (:data:`OPS_RUNS`);
- ``frontier``: DiLoCo and the DeMo-style method beside ACP-SGD (:data:`FRONTIER_RUNS`);
- ``bench:readme`` (README.md): ACP-SGD against S-SGD and Power-SGD per
  link (:data:`README_RUNS`), and against S-SGD with fp16 gradients;
- ``bench:ddp`` (docs/ddp.md): the DDP hook against ``powerSGD_hook``
  (:data:`DDP_RUNS`).

Each figure there sits beside a link to the results.md it comes from:
tests/test_docs.py checks that every block is what this renders and that
every figure quoted next to such a link is in the file it links.

A run ``DIR`` may have a second invocation of the same command in
``DIR_rerun``: the targets then say whether it passes ``python -m
benchmarks check`` against ``DIR``. A results.json without rounds still
renders (as one round, with no intervals and no verdicts); its targets read
"not assessed".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from benchmarks import check, report  # noqa: E402
from benchmarks.__main__ import PROG  # noqa: E402
from benchmarks.jobs import DIAGNOSTICS, FLOOR_JOB  # noqa: E402
from docgen import NO_RUNS, Block, Figure, relative, replace_between, write  # noqa: E402
from hvd_acp.methods import label  # noqa: E402

RERUN_SUFFIX = "_rerun"
#: How the older results.json files in bench-results/ name the benchmark's
#: command (newer ones record :data:`PROG`); with the same options it runs from
#: the checkout as :data:`SHOWN_PROG`.
RECORDED_PROGRAM = "hvd-acp-bench"
SHOWN_PROG = f".venv/bin/{PROG}"

#: (directory under bench-results/, what the run is for), in page order.
RUNS = (
    ("resnet50_100mbit", "ResNet-50, S-SGD communication-bound"),
    ("resnet50_10gbit", "ResNet-50, S-SGD compute-bound"),
    ("resnet50_1gbit", "ResNet-50, S-SGD and ACP-SGD near the crossover"),
    ("resnet50_50mbit", "ResNet-50, a slower link"),
    ("bert-base_200mbit", "BERT-Base, S-SGD communication-bound"),
    ("bert-base_10gbit", "BERT-Base, S-SGD compute-bound"),
    ("bert-base_1gbit", "BERT-Base, in between"),
    ("bert-base_b32_75mbit", "BERT-Base, the paper's batch of 32 per rank"),
    ("resnet50_100mbit_cycle50", "ResNet-50, 50 ms Horovod cycle"),
    ("bert-base_200mbit_cycle50", "BERT-Base, 50 ms Horovod cycle"),
    ("resnet50_100mbit_default_cycle", "ResNet-50, Horovod's default 1 ms cycle"),
    ("resnet50_100mbit_rerun", "second invocation of `resnet50_100mbit`'s command"),
    ("bert-base_b32_75mbit_rerun", "second invocation of `bert-base_b32_75mbit`'s command"),
    ("small_np4_100mbit", "the small model, 4 ranks on 2 cores (latency-bound)"),
    ("resnet50_100mbit_baselines", "ResNet-50, S-SGD communication-bound, every baseline "
                                   "and ablation"),
    ("bert-base_200mbit_baselines", "BERT-Base, S-SGD communication-bound, every baseline "
                                    "and ablation"),
    ("ops_resnet50", "ResNet-50, operator calls per step (localhost)"),
    ("ops_bert-base", "BERT-Base, operator calls per step (localhost)"),
)

#: Columns of the targets table: the communication-bound runs.
TARGET_RUNS = (
    ("resnet50_100mbit", "ResNet-50, 100 Mbit/s"),
    ("bert-base_200mbit", "BERT-Base, 200 Mbit/s"),
    ("bert-base_b32_75mbit", "BERT-Base, batch 32, 75 Mbit/s"),
    ("resnet50_100mbit_cycle50", "ResNet-50, 100 Mbit/s, 50 ms cycle"),
    ("bert-base_200mbit_cycle50", "BERT-Base, 200 Mbit/s, 50 ms cycle"),
)

#: Rows of "where the time goes": runs with rounds and diagnostics.
TIME_RUNS = (
    ("resnet50_100mbit_default_cycle", "ResNet-50, 100 Mbit/s, Horovod cycle 1 ms (default)"),
    ("resnet50_100mbit_cycle50", "ResNet-50, 100 Mbit/s, Horovod cycle 50 ms"),
    ("small_np4_100mbit", "small model, 4 ranks, 100 Mbit/s, Horovod cycle 10 ms"),
)

MET, MISSED, NOISE, NOT_ASSESSED = ("**met**", "**missed**", "**not separable from noise**",
                                    "not assessed (a run without rounds)")


@dataclasses.dataclass(frozen=True)
class Target:
    """``a``'s figure over ``b``'s (``what``) must be at least or at most ``bound``.

    Met when the whole interval is on the right side of the bound, missed
    when it is wholly on the wrong side, not separable from noise when it
    contains the bound.
    """

    text: str
    a: str
    b: str
    what: str
    bound: float
    at_least: bool
    #: The runs the target applies to (all when empty).
    runs: Tuple[str, ...] = ()

    def judge(self, results: Dict[str, Any], run: Optional[str] = None) -> Optional[str]:
        if self.runs and run not in self.runs:
            return None
        ratio = report.find_ratio(results, self.a, self.b, self.what)
        if ratio is None:
            return None
        value = _ratio_text(ratio)
        if (results.get("rounds") or 1) < 2:
            return f"{value}: {NOT_ASSESSED}"
        low, high = ratio["low"], ratio["high"]
        if self.at_least:
            word = MET if low >= self.bound else MISSED if high < self.bound else NOISE
        else:
            word = MET if high <= self.bound else MISSED if low > self.bound else NOISE
        return f"{value}: {word}"


#: The targets of the earlier issues, on the communication-bound links.
TARGETS = (
    Target("S-SGD communication-bound (S-SGD's step >= 4x the floor)",
           "ssgd", report.FLOOR, "step", 4.0, True),
    Target("ACP-SGD >= 3x faster than S-SGD (S-SGD's step / ACP-SGD's)",
           "ssgd", "acp", "step", 3.0, True),
    Target("ACP-SGD faster than Power-SGD (hvd_acp) (its step / ACP-SGD's > 1)",
           "powersgd", "acp", "step", 1.0, True),
    Target("ACP-SGD faster than Power-SGD (DDP hook) (its step / ACP-SGD's > 1)",
           "powersgd-ddp", "acp", "step", 1.0, True),
    Target("ACP-SGD within 1.15x of the floor", "acp", report.FLOOR, "step", 1.15, False),
    Target("ACP-SGD compression <= 0.75x Power-SGD's (hvd_acp)",
           "acp", "powersgd", "compression", 0.75, False),
    Target("ACP-SGD (DDP hook) faster than Power-SGD (DDP hook), same buckets (its step / "
           "ACP-SGD (DDP hook)'s > 1)", "powersgd-ddp", "acp-ddp", "step", 1.0, True),
    Target("ACP-SGD (DDP hook) bytes about half of Power-SGD (DDP hook)'s (<= 0.6x)",
           "acp-ddp", "powersgd-ddp", "bytes", 0.6, False),
)
#: Columns of the baselines table: the communication-bound links, every
#: baseline and ablation in the same rounds.
BASELINE_RUNS = (
    ("resnet50_100mbit_baselines", "ResNet-50, 100 Mbit/s"),
    ("bert-base_200mbit_baselines", "BERT-Base, 200 Mbit/s"),
)
#: The baselines ACP-SGD must beat where S-SGD is communication-bound.
BASELINES = ("ssgd", "ssgd-fp16", "ddp", "ddp-fp16", "powersgd", "powersgd-ddp",
             "powersgd-ddp-batched")
BASELINE_TARGETS = (
    Target("S-SGD communication-bound (S-SGD's step >= 4x the floor)",
           "ssgd", report.FLOOR, "step", 4.0, True),
    Target("ACP-SGD within 1.10x of the floor (ResNet-50's target)", "acp", report.FLOOR,
           "step", 1.10, False, runs=("resnet50_100mbit_baselines",)),
    Target("ACP-SGD within 1.20x of the floor (BERT-Base's target)", "acp", report.FLOOR,
           "step", 1.20, False, runs=("bert-base_200mbit_baselines",)),
    Target("ACP-SGD compression <= 0.6x Power-SGD's (hvd_acp)",
           "acp", "powersgd", "compression", 0.6, False),
    *(Target(f"ACP-SGD faster than {label(m)} (its step / ACP-SGD's > 1)",
             m, "acp", "step", 1.0, True) for m in BASELINES),
    Target("ACP-SGD (fp16) within 1.20x of the floor (BERT-Base's target)", "acp-fp16",
           report.FLOOR, "step", 1.20, False, runs=("bert-base_200mbit_baselines",)),
    Target("ACP-SGD (fp16) faster than S-SGD (fp16) (its step / ACP-SGD (fp16)'s > 1)",
           "ssgd-fp16", "acp-fp16", "step", 1.0, True),
)
#: What each ablation of ACP-SGD is worth: the ablation's step over ACP-SGD's.
ABLATIONS = (
    ("acp-nooverlap", "overlap with backward: the same compression and buffers, "
                      "all-reduced after backward (alternating Power-SGD as epfml's "
                      "`powersgd` runs it)"),
    ("acp-nofusion", "fusion: one all-reduce per tensor, still launched from the hooks"),
    ("acp-fp16", "fp32 on the wire: the same buffers sent in fp16, half the bytes"),
)
#: The transformer user's alternatives (DiLoCo, the DeMo-style method) timed
#: beside ACP-SGD and every Power-SGD in the same rounds.
FRONTIER_RUNS = (
    ("bert-base_200mbit_frontier", "BERT-Base, batch 8, 200 Mbit/s"),
    ("resnet50_100mbit_frontier", "ResNet-50, batch 16, 100 Mbit/s"),
)

#: Operator calls per step: (``--count-ops`` run, what it is).
OPS_RUNS = (
    ("ops_resnet50", "ResNet-50"),
    ("ops_bert-base", "BERT-Base"),
)

#: Rows of the README's table: (run, model and link).
README_RUNS = (
    ("resnet50_100mbit_baselines", "ResNet-50, 100 Mbit/s"),
    ("bert-base_200mbit_baselines", "BERT-Base, 200 Mbit/s"),
    ("resnet50_10gbit", "ResNet-50, 10 Gbit/s"),
)
#: The runs docs/ddp.md quotes for the DDP hook's speed.
DDP_RUNS = (
    ("resnet50_100mbit_baselines", "ResNet-50 at 100 Mbit/s per node"),
    ("bert-base_200mbit_baselines", "BERT-Base at 200 Mbit/s per node"),
)

#: Half-width of ACP-SGD's interval against Power-SGD's step, as a share of its median.
PRECISION = 0.05
#: Minutes a documented run may take.
MAX_MINUTES = 20.0


def _ratio_text(ratio: Dict[str, Any], digits: int = 2) -> str:
    if ratio["low"] == ratio["high"]:
        return f"{ratio['median']:.{digits}f}x"
    return f"{ratio['median']:.{digits}f}x [{ratio['low']:.{digits}f}, {ratio['high']:.{digits}f}]"


def shown_command(recorded: str) -> str:
    """A run's recorded command line, as it runs from the checkout today."""
    for program in (RECORDED_PROGRAM, PROG):
        if recorded == program or recorded.startswith(program + " "):
            return (SHOWN_PROG + recorded[len(program):]).rstrip()
    return recorded


def load(results_dir: Path, run: str) -> Optional[Dict[str, Any]]:
    """A run's results.json with its comparisons derived; ``None`` if absent."""
    path = results_dir / run / "results.json"
    if not path.exists():
        return None
    results = json.loads(path.read_text(encoding="utf-8"))
    if "ratios" not in results:
        report.derive(results)      # one block of steps per job: one round, no intervals
    return results


def _precision(results: Dict[str, Any]) -> Optional[str]:
    ratio = report.find_ratio(results, "powersgd", "acp", "step")
    if ratio is None:
        return None
    if (results.get("rounds") or 1) < 2:
        return f"{_ratio_text(ratio)}: {NOT_ASSESSED}"
    half = max(ratio["high"] - ratio["median"], ratio["median"] - ratio["low"]) / ratio["median"]
    return (f"+-{100 * half:.1f}%: " + (MET if half <= PRECISION else MISSED))


def _floor_below_one(results: Dict[str, Any]) -> Optional[str]:
    if (results.get("rounds") or 1) < 2:
        return NOT_ASSESSED
    below = [r for r in results.get("ratios", []) if r["b"] == report.FLOOR
             and r["what"] == "step" and r["high"] < 1.0]
    if not below:
        return MET
    return ", ".join(f"{r['a']} {_ratio_text(r)}" for r in below) + f": {MISSED}"


def _duration(results: Dict[str, Any]) -> Optional[str]:
    seconds = results.get("duration_s")
    if seconds is None:
        return "not recorded (a run without rounds)"
    minutes = seconds / 60
    return f"{minutes:.1f} min: " + (MET if minutes <= MAX_MINUTES else MISSED)


def _rerun(results_dir: Path, run: str) -> Optional[str]:
    path = results_dir / f"{run}{RERUN_SUFFIX}" / "results.json"
    if not path.exists():
        return f"no second invocation in bench-results/{run}{RERUN_SUFFIX}/: {NOT_ASSESSED}"
    try:
        old, new = check.load(results_dir / run), check.load(path)
    except check.CheckError as exc:
        return f"cannot check: {exc}"
    if check.config_differences(old, new):
        return "cannot check: not the same configuration"
    outcome = check.compare(old, new)
    if not outcome["differ"]:
        return f"{outcome['compared']} ratios, all overlap: {MET}"
    moved = ", ".join(f"{w} {a}/{b}" for (a, b, w), _, _ in outcome["differ"])
    return f"{len(outcome['differ'])} of {outcome['compared']} moved ({moved}): {MISSED}"


def targets_table(results_dir: Path) -> List[str]:
    """The targets against the communication-bound runs that exist."""
    runs = [(run, title, load(results_dir, run)) for run, title in TARGET_RUNS]
    runs = [(run, title, results) for run, title, results in runs if results is not None]
    if not runs:
        return [NO_RUNS]
    rows: List[Tuple[str, List[Optional[str]]]] = [
        (t.text, [t.judge(results) for _, _, results in runs]) for t in TARGETS]
    rows += [
        (f"interval of ACP-SGD against Power-SGD (hvd_acp), step, within +-{100 * PRECISION:g}% "
         "of its median", [_precision(results) for _, _, results in runs]),
        ("no ratio to the floor below 1.0 unless its interval includes 1.0",
         [_floor_below_one(results) for _, _, results in runs]),
        (f"whole run (all rounds, all jobs) <= {MAX_MINUTES:g} min",
         [_duration(results) for _, _, results in runs]),
        (f"a second invocation passes `{PROG} check` against the committed run "
         f"(bench-results/RUN{RERUN_SUFFIX}/)",
         [_rerun(results_dir, run) for run, _, _ in runs]),
    ]
    lines = ["| target | " + " | ".join(title for _, title, _ in runs) + " |",
             "|---|" + "---|" * len(runs)]
    for text, cells in rows:
        if all(c is None for c in cells):
            continue
        lines.append(f"| {text} | " + " | ".join(c or "n/a" for c in cells) + " |")
    rounds = sorted({results.get("rounds") or 1 for _, _, results in runs})
    lines += ["", "Met: the whole interval is on the target's side; missed: wholly on the "
              "other side; not separable from noise: the interval contains the target's "
              "bound. Rounds per run: " + ", ".join(str(r) for r in rounds) + "."]
    return lines


def baselines_section(results_dir: Path) -> List[str]:
    """ACP-SGD against every baseline and its ablations, and the operator calls."""
    runs = [(run, title, load(results_dir, run)) for run, title in BASELINE_RUNS]
    runs = [(run, title, results) for run, title, results in runs if results is not None]
    lines: List[str] = []
    if runs:
        lines += ["| target | " + " | ".join(f"{title} (`{run}`)" for run, title, _ in runs)
                  + " |", "|---|" + "---|" * len(runs)]
        for target in BASELINE_TARGETS:
            cells = [target.judge(results, run) for run, _, results in runs]
            if any(c is not None for c in cells):
                lines.append(f"| {target.text} | " + " | ".join(c or "n/a" for c in cells)
                             + " |")
        lines += ["", "| ablation: ACP-SGD without ... (its step / ACP-SGD's) | "
                  + " | ".join(title for _, title, _ in runs) + " |",
                  "|---|" + "---|" * len(runs)]
        for method, what in ABLATIONS:
            cells = [report.find_ratio(results, method, "acp", "step") for _, _, results in runs]
            lines.append(f"| {what} (`{method}`) | " + " | ".join(
                f"{_ratio_text(c)}, {_verdict_word(c)}" if c else "n/a" for c in cells) + " |")
        lines += ["", "Each figure is the median over the rounds of the ratio paired inside "
                  "each round, [its interval]; met, missed and not separable as in the "
                  "targets above. The step times, bytes and all-reduces of every method are "
                  "in each run's results.md."]
    ops = [(run, title, load(results_dir, run)) for run, title in OPS_RUNS]
    ops = [(run, title, results) for run, title, results in ops if results is not None]
    if ops:
        methods = [m for m in report.KEYS if any(
            (results["methods"].get(m) or {}).get("ops_over_floor_per_step") is not None
            for _, _, results in ops)]
        lines += ["", "| operator calls over the floor per step (kernels among them) | "
                  + " | ".join(f"{title} (`{run}`)" for run, title, _ in ops) + " |",
                  "|---|" + "---:|" * len(ops)]
        for method in methods:
            cells = [results["methods"].get(method) or {} for _, _, results in ops]
            lines.append(f"| {label(method)} | " + " | ".join(_ops_cell(c) for c in cells) + " |")
    return lines or [NO_RUNS]


def frontier_section(results_dir: Path, page: Path) -> List[str]:
    """Step time and bytes of DiLoCo and the DeMo-style method beside ACP-SGD
    and every Power-SGD, one table per run of :data:`FRONTIER_RUNS`."""
    lines: List[str] = []
    for run, title in FRONTIER_RUNS:
        results = load(results_dir, run)
        if results is None:
            continue
        lines += [f"{title} ({_run_link(results_dir, run, page)}, "
                  f"{results.get('rounds') or 1} rounds):", "",
                  "| method | step (s) [interval] | sent per step per rank (MB) "
                  "| received per step (MB) | its step / ACP-SGD's |",
                  "|---|---:|---:|---:|---|"]
        for method, entry in results["methods"].items():
            analytic = entry.get("bytes_sent_per_step_analytic")
            sent = analytic or entry.get("bytes_sent_per_step")
            received = entry.get("bytes_received_per_step")
            if analytic and not received and method == "diloco":
                received = analytic         # its all-reduce, every H steps: what it sends
            ratio = report.find_ratio(results, method, "acp", "step")
            lines.append(
                f"| {label(method)} | {entry['step_s_median']:.3f} "
                f"[{entry['step_s_low']:.3f}, {entry['step_s_high']:.3f}] "
                f"| {sent / 1e6:.3f} | "
                + ("n/a" if received is None else f"{received / 1e6:.3f}") + " | "
                + ("1" if method == "acp" else
                   f"{_ratio_text(ratio)}, {_verdict_word(ratio)}" if ratio else "n/a") + " |")
        lines.append("")
    if not lines:
        return [NO_RUNS]
    return lines + [
        "DiLoCo sends every parameter once every H steps (500 here, its paper's): "
        "the timed steps are inner steps, and its bytes are that all-reduce over H "
        "(sent and received). "
        "The DeMo-style method all-gathers its coefficients: each rank receives the "
        "other ranks' parts. Which one trains a transformer to a lower loss per byte "
        "is in docs/convergence.md, \"The transformer frontier\"."]


def _ops_cell(entry: Dict[str, Any]) -> str:
    """``2,718 (730)``: operator calls over the floor, and the kernels among them
    where the run counted them."""
    calls, kernels = entry.get("ops_over_floor_per_step"), entry.get("kernels_over_floor_per_step")
    if calls is None:
        return "n/a"
    return f"{calls:,.0f}" + ("" if kernels is None else f" ({kernels:,.0f})")


def _verdict_word(ratio: Dict[str, Any]) -> str:
    """``a`` over ``b`` > 1 means ACP-SGD is the faster: say it from ACP-SGD's side."""
    if ratio["low"] > 1.0:
        return "ACP-SGD faster"
    if ratio["high"] < 1.0:
        return "ACP-SGD slower"
    return "not separable from noise"


def _link(mbit: Optional[float]) -> str:
    if not mbit:
        return "localhost, no emulation"
    if mbit >= 1000:
        return f"{mbit / 1000:g} Gbit/s"
    return f"{mbit:g} Mbit/s"


def acp_against(results: Dict[str, Any], other: str) -> str:
    """``other``'s step over ACP-SGD's with the verdict for ACP-SGD; n/a without ``other``."""
    ratio = report.find_ratio(results, other, "acp", "step")
    if ratio is None:
        return "n/a"
    if (results.get("rounds") or 1) < 2:
        return f"{_ratio_text(ratio)}, one round: no verdict"
    # ``other`` slower than ACP-SGD is ACP-SGD faster.
    word = {"slower": "faster", "faster": "slower",
            "same": "no measurable difference"}[ratio["verdict"]]
    return f"{_ratio_text(ratio)}, {word}"


def picture_of(img: Path, run: str) -> Path:
    """Where :func:`figures` draws ``run``'s breakdown."""
    return img / f"bench_{run.replace('-', '_')}.png"


def runs_index(results_dir: Path, img: Path, doc: Path) -> List[str]:
    """One row per run of :data:`RUNS`, then every run's command."""
    lines = ["| run | model, batch per rank, ranks, link | rounds "
             "| ACP-SGD against S-SGD | ACP-SGD against Power-SGD (hvd_acp) | run took "
             "| outputs |",
             "|---|---|---:|---|---|---:|---|"]
    commands = []
    for run, title in RUNS:
        results = load(results_dir, run)
        if results is None:
            continue
        config = results["config"]
        table = relative(results_dir / run / "results.md", doc)
        plot = relative(picture_of(img, run), doc)
        seconds = results.get("duration_s")
        took = "not recorded" if seconds is None else f"{seconds / 60:.1f} min"
        lines.append(
            f"| `{run}`: {title} | {config['model']}, {config['batch_size']}, {config['np']}, "
            f"{_link(config.get('bandwidth_mbit'))} | {results.get('rounds') or 1} "
            f"| {acp_against(results, 'ssgd')} | {acp_against(results, 'powersgd')} | {took} "
            f"| [results]({table}), [breakdown]({plot}) |")
        commands.append(shown_command(config.get("command", "")))
    if not commands:
        return [NO_RUNS]
    return lines + [
        "", "ACP-SGD against another method: that method's step over ACP-SGD's, paired "
        "inside each round, median [interval of the median over the rounds], and the "
        "verdict of the interval: faster or slower only where it excludes 1.0. A run of "
        "one round has no interval and no verdict. Every other comparison, the bytes, "
        "compression times and the per-phase split are in the run's results.md.",
        "", "<details><summary>The commands of these runs</summary>", "", "```sh",
        *commands, "```", "", "</details>"]


def time_table(results_dir: Path) -> List[str]:
    """Where the time goes: floor, diagnostics and Horovod's methods, with intervals."""
    columns = (("compute_only", FLOOR_JOB.short), *((d.key, d.short) for d in DIAGNOSTICS),
               *((m, label(m)) for m in ("powersgd", "acp")))
    lines = ["| run | " + " | ".join(label for _, label in columns)
             + " | tiny all-reduce, Horovod / Gloo (ms) |",
             "|---|" + "---:|" * (len(columns) + 1)]
    for run, title in TIME_RUNS:
        results = load(results_dir, run)
        if results is None or not results.get("diagnostics"):
            continue
        jobs = dict(results["methods"], **results["diagnostics"],
                    compute_only=results["compute_only"])
        digits = 3 if results["compute_only"]["step_s_median"] > 0.1 else 4
        cells = []
        for key, _ in columns:
            e = jobs.get(key) or {}
            cells.append(report.fmt_range(e.get("step_s_median"), e.get("step_s_low"),
                                          e.get("step_s_high"), digits))
        tiny = [(jobs.get(k) or {}).get("tiny_allreduce_s") for k in ("hvd-idle", "ddp-idle")]
        cells.append(" / ".join("n/a" if t is None else f"{t * 1e3:.1f}" for t in tiny))
        rounds = results.get("rounds") or 1
        lines.append(f"| {title} (`{run}`, {rounds} round{'s' if rounds > 1 else ''}) | "
                     + " | ".join(cells) + " |")
    return lines + ["", "Seconds per step: medians over the rounds [interval]."]


def _run_link(results_dir: Path, run: str, page: Path, text: str = "run") -> str:
    target = relative(results_dir / run / "results.md", page)
    return f"[{text}]({target})"


def _step(results: Dict[str, Any], method: str) -> str:
    return f"{results['methods'][method]['step_s_median']:.3f} s"


def _megabytes(results: Dict[str, Any], method: str) -> str:
    return f"{results['methods'][method]['bytes_sent_per_step'] / 1e6:.3f} MB"


def readme_section(results_dir: Path, page: Path) -> List[str]:
    """ACP-SGD against S-SGD and Power-SGD on each link of :data:`README_RUNS`,
    and against S-SGD with fp16 gradients where the run has it."""
    lines = ["| model, link per rank | S-SGD step | ACP-SGD step | ACP-SGD vs S-SGD "
             "| vs Power-SGD (hvd_acp) | bytes per step per rank |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    fp16 = []
    for run, title in README_RUNS:
        results = load(results_dir, run)
        if results is None:
            continue
        lines.append(
            f"| {title} ({_run_link(results_dir, run, page)}) | {_step(results, 'ssgd')} "
            f"| {_step(results, 'acp')} | {acp_against(results, 'ssgd')} "
            f"| {acp_against(results, 'powersgd')} "
            f"| {_megabytes(results, 'ssgd')} -> {_megabytes(results, 'acp')} |")
        if report.find_ratio(results, "ssgd-fp16", "acp", "step") is not None:
            fp16.append(f"{acp_against(results, 'ssgd-fp16')}, on {title} "
                        f"({_run_link(results_dir, run, page)})")
    if len(lines) == 2:
        return [NO_RUNS]
    lines += ["", "ACP-SGD against another method: that method's step over ACP-SGD's, the "
              "median over the rounds of the ratio paired inside each round [its interval]; "
              "faster or slower only where the interval excludes 1.0."]
    if fp16:
        lines += ["", "ACP-SGD against S-SGD with fp16 gradients "
                  "(`compression=hvd.Compression.fp16`, the benchmark's `ssgd-fp16`), in the "
                  "same rounds: " + "; ".join(fp16) + "."]
    return lines


def ddp_section(results_dir: Path, page: Path) -> List[str]:
    """The DDP hook against ``powerSGD_hook`` and against the Horovod front end."""
    sentences = []
    for run, title in DDP_RUNS:
        results = load(results_dir, run)
        if results is None or "acp-ddp" not in results["methods"]:
            continue
        step = report.find_ratio(results, "powersgd-ddp", "acp-ddp", "step")
        compression = report.find_ratio(results, "acp-ddp", "powersgd-ddp", "compression")
        bytes_ratio = report.find_ratio(results, "acp-ddp", "powersgd-ddp", "bytes")
        if step is None or compression is None or bytes_ratio is None:
            continue
        word = {"slower": "`acp_hook` faster", "faster": "`acp_hook` slower",
                "same": "no measurable difference"}[step["verdict"]]
        sentences.append(
            f"{title} ({_run_link(results_dir, run, page)}): `acp_hook` "
            f"{_step(results, 'acp-ddp')} per step against `powerSGD_hook`'s "
            f"{_step(results, 'powersgd-ddp')}, its step over ours {_ratio_text(step)} "
            f"({word}), with {bytes_ratio['median']:.3f}x its bytes "
            f"({_megabytes(results, 'acp-ddp')} per step, as `hvd_acp.DistributedOptimizer`, "
            f"whose step in the same rounds is {_step(results, 'acp')}) and "
            f"{_ratio_text(compression)} its measured compression time.")
    if not sentences:
        return [NO_RUNS]
    lines = []
    for sentence in sentences:
        lines += ["", sentence] if lines else [sentence]
    return lines


def replace_marked(text: str, markers: Tuple[str, str], lines: List[str], path: Path) -> str:
    """scripts/docgen.py's :func:`~docgen.replace_between` (the planner's table
    scripts import it from here)."""
    return replace_between(text, markers, lines, path)


def blocks(results_dir: Path, doc: Optional[Path] = None, readme: Optional[Path] = None,
           ddp_doc: Optional[Path] = None, img: Optional[Path] = None) -> List[Block]:
    """The benchmark's generated blocks for scripts/docgen.py: each page given
    (all three by default) with its blocks, rendered from ``results_dir``."""
    if doc is readme is ddp_doc is None:
        doc, readme, ddp_doc = (REPO / "docs" / "benchmarks.md", REPO / "README.md",
                                REPO / "docs" / "ddp.md")
    img = img or REPO / "docs" / "img"
    found: List[Block] = []
    if readme is not None:
        found.append(Block(_page(readme), "bench:readme", _source(results_dir, README_RUNS),
                           lambda page: readme_section(results_dir, page)))
    if ddp_doc is not None:
        found.append(Block(_page(ddp_doc), "bench:ddp", _source(results_dir, DDP_RUNS),
                           lambda page: ddp_section(results_dir, page)))
    if doc is not None:
        found += [
            Block(_page(doc), "runs", _source(results_dir, RUNS),
                  lambda page: runs_index(results_dir, img, page)),
            Block(_page(doc), "targets", _source(results_dir, TARGET_RUNS),
                  lambda page: targets_table(results_dir)),
            Block(_page(doc), "time", _source(results_dir, TIME_RUNS),
                  lambda page: time_table(results_dir)),
            Block(_page(doc), "baselines", _source(results_dir, BASELINE_RUNS + OPS_RUNS),
                  lambda page: baselines_section(results_dir)),
        ]
        # A page may leave the frontier out.
        if doc.exists() and "<!-- frontier -->" in doc.read_text(encoding="utf-8"):
            found.append(Block(_page(doc), "frontier", _source(results_dir, FRONTIER_RUNS),
                               lambda page: frontier_section(results_dir, page)))
    return found


def figures(results_dir: Path, img: Path) -> List[Figure]:
    """The breakdown picture of every run of :data:`RUNS` that exists."""
    found = []
    for run, _ in RUNS:
        results = load(results_dir, run)
        if results is not None:
            found.append(Figure(_page(picture_of(img, run)), _source(results_dir, ((run, ""),)),
                                lambda path, results=results: report.plot_breakdown(results,
                                                                                    path)))
    return found


def _page(path: Path) -> str:
    """``path`` as the registry names it: relative to the repository where it is inside."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _source(results_dir: Path, runs: Tuple[Tuple[str, str], ...]) -> str:
    """The run directories a block is rendered from, as the registry lists them."""
    names = [run for run, _ in runs]
    return (_page(results_dir).rstrip("/") + "/"
            + (names[0] if len(names) == 1 else "{" + ",".join(names) + "}") + "/")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=REPO / "bench-results")
    parser.add_argument("--doc", type=Path, default=None,
                        help="the benchmarks page (default docs/benchmarks.md; given, only "
                             "the pages named are written)")
    parser.add_argument("--readme", type=Path, default=None, help="default README.md")
    parser.add_argument("--ddp-doc", type=Path, default=None, help="default docs/ddp.md")
    parser.add_argument("--img", type=Path, default=REPO / "docs" / "img")
    args = parser.parse_args(argv)
    if args.doc is None:
        args.doc = REPO / "docs" / "benchmarks.md"
        args.readme = args.readme or REPO / "README.md"
        args.ddp_doc = args.ddp_doc or REPO / "docs" / "ddp.md"
    found = blocks(args.results, args.doc, args.readme, args.ddp_doc, args.img)
    for path in write(found, (), figures(args.results, args.img)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
