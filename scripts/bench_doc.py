"""Rebuild the generated parts of docs/benchmarks.md and README.md from bench-results/.

    .venv/bin/python scripts/bench_doc.py

Every table, verdict and picture between the markers below is rendered from
a run directory's ``results.json`` (written by ``python -m benchmarks --out DIR``)
by the benchmark's own report code, so that every number and every
comparison on those pages comes from a run that is in the repository, and a
sentence saying that one method is faster than another is the verdict of
that run's interval:

- docs/benchmarks.md, ``<!-- targets -->`` ... ``<!-- end targets -->``: the
  targets, each met, missed, or not separable from noise (:data:`TARGETS`);
- docs/benchmarks.md, ``<!-- runs -->`` ... ``<!-- end runs -->``: one section
  per run of :data:`RUNS`: its verdicts in words, its tables, command and
  breakdown picture (plotted again into docs/img/);
- docs/benchmarks.md, ``<!-- time -->`` ... ``<!-- end time -->``: the
  diagnostic jobs of the runs with rounds and ``--diagnostics``
  (:data:`TIME_RUNS`);
- README.md, ``<!-- results in brief -->`` ... ``<!-- end results in brief -->``.

The hand-written parts around the markers are kept. A run ``DIR`` may have a
second invocation of the same command in ``DIR_rerun``: the targets then say
whether it passes ``python -m benchmarks check`` against ``DIR``. A results.json
written before ``--rounds`` existed still renders (as one round, with no
intervals and no verdicts); its targets read "not assessed". Each run's
command is shown as it runs from the checkout today (:func:`shown_command`).
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

from benchmarks import check, report  # noqa: E402
from benchmarks.__main__ import PROG  # noqa: E402
from benchmarks.jobs import DIAGNOSTICS, FLOOR_JOB  # noqa: E402
from hvd_acp.methods import label  # noqa: E402

RUNS_MARKERS = ("<!-- runs -->", "<!-- end runs -->")
TARGETS_MARKERS = ("<!-- targets -->", "<!-- end targets -->")
BRIEF_MARKERS = ("<!-- results in brief -->", "<!-- end results in brief -->")
TIME_MARKERS = ("<!-- time -->", "<!-- end time -->")
RERUN_SUFFIX = "_rerun"
#: How the results.json files in bench-results/ name the benchmark's command;
#: with the same options it runs today as ``python -m benchmarks``.
RECORDED_PROGRAM = "hvd-acp-bench"

#: (directory under bench-results/, section title), in page order.
RUNS = (
    ("resnet50_100mbit", "ResNet-50, 100 Mbit/s per node (S-SGD communication-bound)"),
    ("resnet50_10gbit", "ResNet-50, 10 Gbit/s per node (S-SGD compute-bound)"),
    ("resnet50_1gbit", "ResNet-50, 1 Gbit/s per node (S-SGD and ACP-SGD near the crossover)"),
    ("resnet50_50mbit", "ResNet-50, 50 Mbit/s per node (S-SGD, Power-SGD, ACP-SGD)"),
    ("bert-base_200mbit", "BERT-Base, 200 Mbit/s per node (S-SGD communication-bound)"),
    ("bert-base_10gbit", "BERT-Base, 10 Gbit/s per node (S-SGD compute-bound)"),
    ("bert-base_1gbit", "BERT-Base, 1 Gbit/s per node"),
    ("bert-base_b32_75mbit",
     "BERT-Base, the paper's batch of 32 per rank, 75 Mbit/s per node (Power-SGD and ACP-SGD)"),
    ("resnet50_100mbit_cycle50", "ResNet-50, 100 Mbit/s per node, 50 ms Horovod cycle"),
    ("bert-base_200mbit_cycle50", "BERT-Base, 200 Mbit/s per node, 50 ms Horovod cycle"),
    ("resnet50_100mbit_default_cycle",
     "ResNet-50, 100 Mbit/s per node, Horovod's default 1 ms cycle"),
    ("resnet50_100mbit_rerun",
     "ResNet-50, 100 Mbit/s per node: the second invocation of the first run's command"),
    ("bert-base_b32_75mbit_rerun",
     "BERT-Base, batch 32, 75 Mbit/s per node: the second invocation of its command"),
    ("small_np4_100mbit",
     "The small model at 4 ranks (2 per core), 100 Mbit/s per node (latency-bound)"),
)

#: Columns of the targets table: the communication-bound runs.
TARGET_RUNS = (
    ("resnet50_100mbit", "ResNet-50, 100 Mbit/s"),
    ("bert-base_200mbit", "BERT-Base, 200 Mbit/s"),
    ("bert-base_b32_75mbit", "BERT-Base, batch 32, 75 Mbit/s"),
    ("resnet50_100mbit_cycle50", "ResNet-50, 100 Mbit/s, 50 ms cycle"),
    ("bert-base_200mbit_cycle50", "BERT-Base, 200 Mbit/s, 50 ms cycle"),
)

#: Rows of README's results in brief.
BRIEF_RUNS = (
    ("resnet50_100mbit", "ResNet-50, 100 Mbit/s, rank 4"),
    ("bert-base_200mbit", "BERT-Base, 200 Mbit/s, rank 32"),
    ("bert-base_b32_75mbit", "BERT-Base, batch 32, 75 Mbit/s, rank 32"),
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

    def judge(self, results: Dict[str, Any]) -> Optional[str]:
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
    program, _, options = recorded.partition(" ")
    return f"{PROG} {options}".rstrip() if program == RECORDED_PROGRAM else recorded


def load(results_dir: Path, run: str) -> Optional[Dict[str, Any]]:
    """A run's results.json with its comparisons derived; ``None`` if absent."""
    path = results_dir / run / "results.json"
    if not path.exists():
        return None
    results = json.loads(path.read_text(encoding="utf-8"))
    if "ratios" not in results:
        report.derive(results)      # written before rounds: one round, no intervals
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
        return ["No runs in bench-results/ yet."]
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


def verdict_sentences(results: Dict[str, Any]) -> List[str]:
    """Every step comparison of the run in words, straight from its verdicts."""
    if (results.get("rounds") or 1) < 2:
        return []       # the run's own text says it has no intervals
    said = []
    for ratio in results.get("ratios", []):
        if ratio["what"] != "step":
            continue
        a, b = report.name(ratio["a"]), report.name(ratio["b"])
        if ratio["b"] == report.FLOOR:
            words = {"slower": "is slower than the floor",
                     "same": "is not separable from the floor",
                     "faster": "ran faster than the floor (the floor's measurement was disturbed)"}
            said.append(f"{a} {words[ratio['verdict']]} ({_ratio_text(ratio)} of it)")
            continue
        # As the tables print it: the other method's step over this one's.
        speed = report.find_ratio(results, ratio["b"], ratio["a"], "step")
        if ratio["verdict"] == "same":
            said.append(f"{a} and {b}: no measurable difference ({b}'s step is "
                        f"{_ratio_text(speed)} {a}'s)")
        elif ratio["verdict"] == "faster":
            said.append(f"{a} is faster than {b} ({b}'s step is {_ratio_text(speed)} {a}'s)")
        else:
            said.append(f"{a} is slower than {b} (its step is {_ratio_text(ratio)} {b}'s)")
    return ["Verdicts (step times, paired inside each round): " + "; ".join(said) + "."]


def run_section(results_dir: Path, run: str, title: str, img: Path, doc: Path) -> List[str]:
    results = load(results_dir, run)
    results["config"]["command"] = shown_command(results["config"].get("command", ""))
    lines = report.markdown(results).splitlines()
    heading = lines[0].lstrip("# ").strip()
    body = []
    for line in lines[1:]:
        if line.startswith("- ") or line.startswith("Topology:"):
            continue        # column notes and topology: once, in the hand-written part
        if line.strip() or (body and body[-1].strip()):
            body.append(line)       # no runs of blank lines where a line was dropped
    while body and not body[-1].strip():
        body.pop()
    picture = img / f"bench_{run.replace('-', '_')}.png"
    picture.parent.mkdir(parents=True, exist_ok=True)
    report.plot_breakdown(results, picture)
    rel = picture.relative_to(doc.parent).as_posix()
    return [f"## {title}", "",
            f"{heading}; `bench-results/{run}/` (`{PROG}` outputs: results.json, "
            "results.md, breakdown.png, logs, per-rank raw results).",
            "", *(line for sentence in verdict_sentences(results) for line in (sentence, "")),
            *body, "", f"![{title}]({rel})", ""]


def brief_table(results_dir: Path) -> List[str]:
    """README's results in brief: steps with intervals, ACP-SGD's verdicts."""
    lines = ["| model, link | rounds | S-SGD step | Power-SGD step (hvd_acp / DDP hook) "
             "| ACP-SGD step (hvd_acp / DDP hook) "
             "| ACP-SGD against S-SGD / Power-SGD (hvd_acp) / DDP hook "
             "| DDP: acp_hook against powerSGD_hook | bytes/step/rank S-SGD -> ACP |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: |"]
    for run, title in BRIEF_RUNS:
        results = load(results_dir, run)
        if results is None:
            continue
        methods, rounds = results["methods"], results.get("rounds") or 1

        def step(m):
            e = methods.get(m) or {}
            if e.get("step_s_median") is None:
                return "n/a"
            return report.fmt_range(e["step_s_median"], e.get("step_s_low"),
                                     e.get("step_s_high"), 2) + " s"

        def speedup(other, of):
            """``other``'s step over ``of``'s, with ``of``'s verdict."""
            ratio = report.find_ratio(results, other, of, "step")
            if ratio is None:
                return None
            word = ("" if rounds < 2 else {"slower": ", faster", "faster": ", slower",
                                           "same": ", no measurable difference"}[ratio["verdict"]])
            return f"{_ratio_text(ratio)}{word}"

        # Every position kept (a run without a method says n/a there).
        against = [speedup(o, "acp") or "n/a" for o in ("ssgd", "powersgd", "powersgd-ddp")]
        if all(t == "n/a" for t in against):
            against = []
        ddp = speedup("powersgd-ddp", "acp-ddp") or "n/a"
        sent = lambda m: (methods.get(m) or {}).get("bytes_sent_per_step")  # noqa: E731
        data = (f"{sent('ssgd') / 1e6:.1f} MB -> {sent('acp') / 1e6:.2f} MB"
                if sent("ssgd") and sent("acp") else "n/a")
        lines.append(f"| {title} | {rounds} | {step('ssgd')} "
                     f"| {step('powersgd')} / {step('powersgd-ddp')} "
                     f"| {step('acp')} / {step('acp-ddp')} | {' / '.join(against) or 'n/a'} "
                     f"| {ddp} | {data} |")
    lines += ["", "Steps: medians over the rounds [interval of the median, 96.9% with 6 "
              "rounds]. ACP-SGD's comparisons: the other method's step over ACP-SGD's, paired "
              "inside each round, with the verdict of its interval (faster, slower, or no "
              "measurable difference). A run of 1 round (one block of steps per method) has "
              "no interval and no verdict."]
    return lines


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


def replace_marked(text: str, markers: Tuple[str, str], lines: List[str], path: Path) -> str:
    start, end = markers
    if start not in text or end not in text:
        raise SystemExit(f"{path}: markers {start} and {end} not found")
    head, rest = text.split(start, 1)
    tail = rest.split(end, 1)[1]
    return head + start + "\n\n" + "\n".join(lines) + "\n\n" + end + tail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=REPO / "bench-results")
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    parser.add_argument("--readme", type=Path, default=REPO / "README.md")
    parser.add_argument("--img", type=Path, default=REPO / "docs" / "img")
    args = parser.parse_args(argv)
    sections: List[str] = []
    for run, title in RUNS:
        if not (args.results / run / "results.json").exists():
            print(f"skipping {run}: no results.json", file=sys.stderr)
            continue
        sections += run_section(args.results, run, title, args.img, args.doc)
    text = args.doc.read_text(encoding="utf-8")
    text = replace_marked(text, RUNS_MARKERS, sections, args.doc)
    text = replace_marked(text, TARGETS_MARKERS, targets_table(args.results), args.doc)
    text = replace_marked(text, TIME_MARKERS, time_table(args.results), args.doc)
    args.doc.write_text(text, encoding="utf-8")
    print(f"wrote {args.doc}")
    readme = args.readme.read_text(encoding="utf-8")
    args.readme.write_text(replace_marked(readme, BRIEF_MARKERS, brief_table(args.results),
                                    args.readme), encoding="utf-8")
    print(f"wrote {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
