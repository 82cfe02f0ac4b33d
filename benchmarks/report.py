"""results.json -> paired ratios, results.md (tables) and breakdown.png (stacked bars).

:func:`derive` computes every comparison the report makes inside each round
and summarizes it over the rounds (median, interval, verdict); a results
file with one block of steps per job and no ``per_round`` entries reads as
a run of one round, whose comparisons have no interval and no verdict.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hvd_acp.methods import KEYS, REGISTRY
from hvd_acp.plan.models import optimizer_name

from .jobs import FLOOR_JOB, JOBS
from .stats import median_interval, order_statistic_rank, paired_ratios, verdict

__all__ = ["name", "FLOOR", "WHATS", "comparison_pairs", "derive", "find_ratio",
           "fmt_range", "breakdown", "markdown", "plot_breakdown"]

#: The ``b`` of a comparison against the compute-only floor.
FLOOR = "floor"
#: What a ratio compares, and the per-round figure it is computed from.
WHATS = {"step": "step_s_median", "compression": "compression_s_per_step",
         "bytes": "bytes_sent_per_step"}


def _named(job: str, attr: str) -> str:
    """Attribute ``attr`` of method ``job`` of :mod:`hvd_acp.methods`; the key
    itself for a job the registry does not know."""
    return getattr(REGISTRY[job], attr) if job in REGISTRY else job


def name(job: str) -> str:
    """A job's short name, for sentences: a method's label, the floor's, or its key."""
    return FLOOR_JOB.label if job == FLOOR else _named(job, "label")


def _ordered(methods: Dict[str, Any]) -> List[str]:
    return [m for m in KEYS if m in methods] + [m for m in methods if m not in KEYS]


def comparison_pairs(methods: Sequence[str]) -> List[Tuple[str, str]]:
    """Every comparison ``(a, b)`` the report makes among ``methods`` (run order
    irrelevant): each method against each one before it in report order
    (S-SGD, Power-SGD, the DDP hook, ACP-SGD, then any other), then each
    method against the floor. A method added to the benchmark is compared
    with every other without a change here.
    """
    ordered = _ordered({m: None for m in methods})
    return ([(a, b) for i, a in enumerate(ordered) for b in ordered[:i]]
            + [(a, FLOOR) for a in ordered])


def _by_round(entry: Dict[str, Any], key: str) -> Dict[int, Optional[float]]:
    """A job's figure ``key`` by round number (``None`` where its job failed).

    An entry without ``per_round`` (one block of steps) is one round.
    """
    rounds = entry.get("per_round") or [dict(entry, round=1)]
    return {r.get("round", 1): (None if r.get("error") else r.get(key)) for r in rounds}


def _ratio(a: str, b: str, what: str, a_entry: Dict[str, Any],
           b_entry: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    key = WHATS[what]
    values = paired_ratios(_by_round(a_entry, key), _by_round(b_entry, key))
    if not values:
        return None     # nothing to compare (S-SGD's compression, the floor's bytes)
    interval = median_interval(values, log=True)
    return {"a": a, "b": b, "what": what, **interval.as_dict(), "verdict": verdict(interval),
            "rounds": interval.n, "coverage": interval.coverage}


def _measured(entries: Dict[str, Any]) -> List[str]:
    return [m for m in _ordered(entries) if entries[m].get("step_s_median") is not None]


def derive(results: Dict[str, Any]) -> None:
    """Add the paired comparisons to ``results``, in place.

    ``results["ratios"]``: for every pair of :func:`comparison_pairs` and
    every figure of :data:`WHATS` both jobs have, ``a``'s figure over ``b``'s,
    computed inside each round in which both ran, as the median over those
    rounds with its interval and verdict (:func:`.stats.verdict`: ``faster``
    when the whole interval is below 1.0, i.e. ``a`` takes less time, or
    sends fewer bytes, than ``b``), the number of rounds used and the
    interval's coverage. ``results["diagnostic_ratios"]``: each diagnostic's
    step against the floor, the same way. Every method also gets
    ``speedup_vs_ssgd`` and ``ratio_to_floor`` (the medians of those
    comparisons) with ``_low`` and ``_high`` ends.
    """
    methods = results["methods"]
    floor = results.get("compute_only") or {}
    entries = dict(methods, **({FLOOR: floor} if floor.get("step_s_median") is not None
                              else {}))
    ratios = []
    for a, b in comparison_pairs(_measured(methods)):
        if b not in entries:
            continue
        for what in WHATS:
            ratio = _ratio(a, b, what, entries[a], entries[b])
            if ratio is not None:
                ratios.append(ratio)
    results["ratios"] = ratios
    results.setdefault("rounds", max((len(e.get("per_round") or [None])
                                      for e in entries.values()), default=1))
    diagnostics = results.get("diagnostics") or {}
    if diagnostics and FLOOR in entries:
        results["diagnostic_ratios"] = [
            r for r in (_ratio(d, FLOOR, "step", diagnostics[d], floor)
                        for d in diagnostics if diagnostics[d].get("step_s_median") is not None)
            if r is not None]
    for method in _measured(methods):
        entry = methods[method]
        speedup = find_ratio(results, "ssgd", method, "step")
        to_floor = find_ratio(results, method, FLOOR, "step")
        for field, ratio in (("speedup_vs_ssgd", speedup), ("ratio_to_floor", to_floor)):
            entry[field] = ratio["median"] if ratio else None
            entry[f"{field}_low"] = ratio["low"] if ratio else None
            entry[f"{field}_high"] = ratio["high"] if ratio else None
    if "ssgd" in methods and methods["ssgd"].get("step_s_median") is not None:
        methods["ssgd"].update(speedup_vs_ssgd=1.0, speedup_vs_ssgd_low=1.0,
                               speedup_vs_ssgd_high=1.0)


_FLIP = {"faster": "slower", "slower": "faster", "same": "same"}


def find_ratio(results: Dict[str, Any], a: str, b: str, what: str = "step",
               key: str = "ratios") -> Optional[Dict[str, Any]]:
    """The comparison of ``a`` against ``b`` in ``results[key]``, in either direction.

    Stored the other way round (``b`` against ``a``), it is returned
    inverted: median, ends and verdict of ``a``'s figure over ``b``'s (exact,
    medians are taken in log space). ``None`` if it was not computed.
    """
    for ratio in results.get(key) or []:
        if ratio["what"] != what:
            continue
        if (ratio["a"], ratio["b"]) == (a, b):
            return dict(ratio)
        if (ratio["a"], ratio["b"]) == (b, a):
            return dict(ratio, a=a, b=b, median=1 / ratio["median"], low=1 / ratio["high"],
                        high=1 / ratio["low"], verdict=_FLIP[ratio["verdict"]])
    return None


def breakdown(entry: Dict[str, Any], floor: float) -> Dict[str, float]:
    """Split a method's median step into compute, compression and exposed communication.

    compute is the floor (the same step with no communication); exposed
    communication is what remains of the step, floored at zero.
    """
    compression = entry.get("compression_s_per_step") or 0.0
    exposed = max(0.0, entry["step_s_median"] - floor - compression)
    return {"compute": floor, "compression": compression, "exposed_comm": exposed}


def _fmt_ops(value: Optional[float], kernels: Optional[float] = None) -> str:
    """Operator calls, and the kernels among them where counted: ``1622 (612)``."""
    if value is None:
        return "n/a"
    return f"{value:g}" if kernels is None else f"{value:g} ({kernels:g})"


def _fmt(value: Optional[float], digits: int = 3, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}{suffix}"


def fmt_range(median: Optional[float], low: Optional[float], high: Optional[float],
               digits: int = 3, suffix: str = "") -> str:
    """``1.160x [1.120, 1.200]``; the median alone where there is no interval."""
    if median is None:
        return "n/a"
    text = f"{median:.{digits}f}{suffix}"
    if low is None or high is None or low == high:
        return text
    return f"{text} [{low:.{digits}f}, {high:.{digits}f}]"


def _step_range(entry: Dict[str, Any]) -> str:
    return fmt_range(entry.get("step_s_median"), entry.get("step_s_low"), entry.get("step_s_high"))


def _fmt_ratio(ratio: Optional[Dict[str, Any]], digits: int = 2, invert: bool = False) -> str:
    if ratio is None:
        return "n/a"
    if invert:
        return fmt_range(1 / ratio["median"], 1 / ratio["high"], 1 / ratio["low"], digits, "x")
    return fmt_range(ratio["median"], ratio["low"], ratio["high"], digits, "x")


_SAY = {
    "step": {"faster": "{a} faster", "slower": "{a} slower"},
    "compression": {"faster": "{a} less", "slower": "{a} more"},
    "bytes": {"faster": "{a} fewer", "slower": "{a} more"},
}
_SAY_FLOOR = {"faster": "faster than the floor (the floor was disturbed)",
              "slower": "slower than the floor", "same": "not separable from the floor"}


def _say(ratio: Optional[Dict[str, Any]], rounds: int) -> str:
    """A comparison's verdict in words, from the interval only."""
    if ratio is None:
        return ""
    if rounds < 2:
        return "n/a (1 round)"
    if ratio["b"] == FLOOR:
        return _SAY_FLOOR[ratio["verdict"]]
    if ratio["verdict"] == "same":
        return "no measurable difference"
    return _SAY[ratio["what"]][ratio["verdict"]].format(a=name(ratio["a"]))



def _rounds_paragraph(results: Dict[str, Any]) -> List[str]:
    cfg = results["config"]
    rounds = results.get("rounds") or 1
    if rounds < 2:
        return ["One block of steps per job, one job after the other (no `--rounds`): no "
                "intervals and no verdicts; such figures can move by 10-20% on a rerun.", ""]
    j, coverage = order_statistic_rank(rounds)
    ends = "smallest to largest" if j == 1 else f"{j}th smallest to {j}th largest"
    text = (f"Rounds: {rounds}. Every job (the floor, each method"
            + (", each diagnostic" if results.get("diagnostics") else "")
            + f") ran once per round, {cfg['warmup']} warm-up + {cfg['steps']} timed steps, "
            "in an order rotated by one job per round; a job's figure for a round is its "
            "median step. Each figure below is the median over the rounds, and each ratio "
            "is computed inside every round first, then summarized the same way; "
            f"[brackets] give a {100 * coverage:.1f}% interval for the median: the {ends} "
            f"of the {rounds} values, a distribution-free interval (the sign test "
            "inverted; it assumes only that rounds are independent draws). A comparison "
            "says faster or slower only where its interval excludes 1.0.")
    if coverage < 0.95:
        text += (f" With fewer than 6 rounds no such interval reaches 95%: these cover the "
                 f"median with probability {100 * coverage:.1f}% only.")
    if results.get("duration_s") is not None:
        text += f" The whole run took {results['duration_s'] / 60:.1f} min."
    return [text, ""]


def _optimizer(cfg: Dict[str, Any]) -> str:
    """``config.optimizer`` (``--optimizer``) in words; a run without it trained SGD."""
    return optimizer_name(cfg.get("optimizer"))


def _matrix_rank(cfg: Dict[str, Any]) -> str:
    """``config.matrix_rank``; None: each method took its default for the optimizer."""
    rank = cfg.get("matrix_rank")
    return "each method's default" if rank is None else str(rank)


def _defaults_paragraph(results: Dict[str, Any]) -> List[str]:
    """With no ``--matrix-rank`` (config ``matrix_rank`` None): the rank and
    wire each compressing method resolved (its ``settings``)."""
    if results["config"].get("matrix_rank") is not None:
        return []
    parts = []
    for method in _ordered(results["methods"]):
        settings = results["methods"][method].get("settings") or {}
        if settings.get("matrix_rank") is None:
            continue
        wire = ("" if "fp16_wire" not in settings else
                ", fp16 on the wire" if settings["fp16_wire"] else ", fp32 on the wire")
        both = ", both factors every step" if settings.get("both_factors") else ""
        parts.append(f"{name(method)} matrix_rank {settings['matrix_rank']}{both}{wire}")
    if not parts:
        return []
    return [f"No --matrix-rank: each method resolved its default for "
            f"{_optimizer(results['config'])} ({'; '.join(parts)}).", ""]


def markdown(results: Dict[str, Any]) -> str:
    """The results tables: per method, paired comparisons, phases, diagnostics."""
    cfg = results["config"]
    rounds = results.get("rounds") or 1
    floor_entry = results.get("compute_only") or {}
    floor = floor_entry.get("step_s_median")
    link = (f"{cfg['bandwidth_mbit']:g} Mbit/s" if cfg.get("bandwidth_mbit") is not None
            else "no emulation (localhost)")
    ops = floor_entry.get("ops_per_step") is not None
    lines = [
        f"# {cfg['model']}: {cfg['np']} ranks, batch {cfg['batch_size']} per rank, "
        f"optimizer {_optimizer(cfg)}, matrix_rank {_matrix_rank(cfg)}, link {link}",
        "",
        *_defaults_paragraph(results),
        *_rounds_paragraph(results),
        "| method | step median (s) [interval] | p10-p90 of all steps (s) | samples/s "
        "| speedup vs S-SGD | x floor | MB sent/step/rank | all-reduces/step "
        "| compression s/step |" + (" operator calls/step over the floor's "
                                     "(kernels among them) |" if ops else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if ops else ""),
    ]
    for method in _ordered(results["methods"]):
        entry = results["methods"][method]
        label = _named(method, "title")
        if entry.get("error"):
            lines.append(f"| {label} | failed: {entry['error']} ||||||||")
            continue
        mb = entry["bytes_sent_per_step"] / 1e6
        speedup = ("1.00x" if method == "ssgd"
                   else _fmt_ratio(find_ratio(results, method, "ssgd"), invert=True))
        compression = fmt_range(entry.get("compression_s_per_step"),
                                entry.get("compression_s_low"), entry.get("compression_s_high"), 4)
        kernels = entry.get("kernels_over_floor_per_step")
        lines.append(
            f"| {label} | {_step_range(entry)} "
            f"| {_fmt(entry['step_s_p10'])}-{_fmt(entry['step_s_p90'])} "
            f"| {_fmt(entry['samples_per_s'], 1)} | {speedup} "
            f"| {_fmt_ratio(find_ratio(results, method, FLOOR))} | {mb:.3f} "
            f"| {entry['allreduces_per_step']:g} | {compression} |"
            + (f" {_fmt_ops(entry.get('ops_over_floor_per_step'), kernels)} |" if ops else ""))
    if floor is not None:
        lines.append(
            f"| compute only (floor, 1 process, no communication) "
            f"| {_step_range(floor_entry)} "
            f"| {_fmt(floor_entry.get('step_s_p10'))}-{_fmt(floor_entry.get('step_s_p90'))} "
            f"| {_fmt(floor_entry.get('samples_per_s'), 1)} | | 1.00x | 0 | 0 | 0 |"
            + (f" 0 ({_fmt_ops(floor_entry['ops_per_step'], floor_entry.get('kernels_per_step'))}"
               " in all) |" if ops else ""))
    lines.append("")
    lines += _comparison_table(results)
    lines += _phase_table(results)
    lines += _diagnostics_table(results)
    ratio = cfg.get("compute_vs_communication") or {}
    if ratio.get("ssgd_comm_s_at_line_rate") is not None and floor is not None:
        lines.append(
            f"Compute vs communication: the floor is {floor:.3f} s per step; S-SGD's "
            f"{ratio['gradient_mb']:.1f} MB of gradients take "
            f"{ratio['ssgd_comm_s_at_line_rate']:.3f} s per step at line rate (ring "
            f"all-reduce, each rank sends 2(N-1)/N of them), "
            f"{ratio['ssgd_comm_s_at_line_rate'] / floor:.2f}x the floor.")
        lines.append("")
    per = "per job and round" if rounds > 1 else "per method"
    lines += [
        f"Topology: {cfg['topology']}.",
        "",
        f"Steps: {cfg['warmup']} warm-up + {cfg['steps']} timed {per}; a step's time "
        f"is the slowest rank's; {cfg.get('threads_per_rank', 1)} thread(s) per rank on "
        f"{cfg.get('cpus')} CPUs; Horovod cycle time "
        + (f"{cfg['horovod_cycle_time_ms']:g} ms" if cfg.get("horovod_cycle_time_ms")
           is not None else "Horovod's default (1 ms)")
        + ". Versions: "
        + ", ".join(f"{k} {v}" for k, v in cfg["versions"].items()) + ".",
        "",
        f"Command: `{cfg.get('command', '')}`",
        "",
    ]
    notes = results.get("notes") or []
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def _comparison_table(results: Dict[str, Any]) -> List[str]:
    """Every pair of methods, then every method against the floor, with verdicts."""
    rounds = results.get("rounds") or 1
    measured = _measured(results["methods"])
    pairs = [(a, b) for a, b in comparison_pairs(measured) if b != FLOOR]
    lines: List[str] = []
    if pairs:
        paired = ", paired inside each round" if rounds > 1 else ""
        lines += [f"| A against B{paired} | speedup of A (B's step / A's) "
                  "| verdict | compression time, A's / B's | verdict | bytes/step, A's / B's |",
                  "|---|---:|---|---:|---|---:|"]
        for a, b in pairs:
            step = find_ratio(results, a, b, "step")
            compression = find_ratio(results, a, b, "compression")
            sent = find_ratio(results, a, b, "bytes")
            lines.append(
                f"| {name(a)} against {name(b)} "
                f"| {_fmt_ratio(step, invert=True)} | {_say(step, rounds)} "
                f"| {_fmt_ratio(compression) if compression else ''} "
                f"| {_say(compression, rounds)} | {_fmt_ratio(sent, 3) if sent else ''} |")
        lines.append("")
    floor_rows = [find_ratio(results, m, FLOOR) for m in measured]
    floor_rows = [r for r in floor_rows if r is not None]
    if floor_rows:
        lines += ["| against the floor | step / floor's step | verdict |", "|---|---:|---|"]
        lines += [f"| {name(r['a'])} | {_fmt_ratio(r)} | {_say(r, rounds)} |"
                  for r in floor_rows]
        lines.append("")
        faster = [name(r["a"]) for r in floor_rows
                  if rounds > 1 and r["verdict"] == "faster"]
        if faster:
            lines += [f"**Disturbed run**: {', '.join(faster)} ran faster than the compute-only "
                      "floor, which no method can beat: the floor's measurement was disturbed; "
                      "do not use this run's ratios to the floor.", ""]
    return lines


def _phase_table(results: Dict[str, Any]) -> List[str]:
    """Where the time goes: medians of rank 0's phases, traffic, interference."""
    rows = [("compute only", results.get("compute_only") or {})]
    rows += [(_named(m, "title"), results["methods"][m]) for m in _ordered(results["methods"])]
    rows = [(label, e) for label, e in rows if e.get("phase_s_median")]
    if not rows:
        return []
    lines = ["| where the time goes (rank 0, medians) | forward (s) | backward (s) "
             "| optimizer step (s) | link MB/step/rank | CPU share used outside the job |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, entry in rows:
        phases = entry["phase_s_median"]
        link = entry.get("link_tx_bytes_per_step")
        share = entry.get("cpu_share_outside_job")
        flag = " (disturbed?)" if share is not None and share > 0.10 else ""
        lines.append(f"| {label} | {_fmt(phases.get('forward'))} | {_fmt(phases.get('backward'))} "
                     f"| {_fmt(phases.get('optimizer_step'))} "
                     f"| {'n/a' if link is None else f'{link / 1e6:.3f}'} "
                     f"| {_fmt(share, 2)}{flag} |")
    lines.append("")
    return lines


def _diagnostics_table(results: Dict[str, Any]) -> List[str]:
    """Steps of the diagnostic runs, against the floor."""
    diagnostics = results.get("diagnostics")
    floor = (results.get("compute_only") or {}).get("step_s_median")
    if not diagnostics or not floor:
        return []
    rounds = results.get("rounds") or 1
    lines = ["| diagnostic | step median (s) [interval] | x floor, paired | verdict "
             "| compression s/step | tiny all-reduce (ms) | CPU share used outside the job |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for job, entry in diagnostics.items():
        label = JOBS[job].label if job in JOBS else job
        if entry.get("step_s_median") is None:
            lines.append(f"| {label} | failed ||||||")
            continue
        tiny = entry.get("tiny_allreduce_s")
        to_floor = find_ratio(results, job, FLOOR, key="diagnostic_ratios")
        lines.append(f"| {label} | {_step_range(entry)} "
                     f"| {_fmt_ratio(to_floor)} | {_say(to_floor, rounds)} "
                     f"| {_fmt(entry.get('compression_s_per_step'), 4)} "
                     f"| {'' if tiny is None else _fmt(tiny * 1e3, 2)} "
                     f"| {_fmt(entry.get('cpu_share_outside_job'), 2)} |")
    lines.append("")
    return lines


def _bars(ax, names, parts, steps, lows, highs) -> None:
    xs = list(range(len(names)))
    bottoms = [0.0] * len(names)
    for key, label, color in (("compute", "compute (floor)", "#4c72b0"),
                              ("compression", "compression", "#dd8452"),
                              ("exposed_comm", "exposed communication (step - floor - compression)", "#c44e52")):
        values = [p[key] for p in parts]
        ax.bar(xs, values, bottom=bottoms, label=label, color=color, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.scatter(xs, steps, marker="_", s=900, color="black", zorder=3, label="measured step")
    if any(h > l for l, h in zip(lows, highs)):
        ax.errorbar(xs, steps, yerr=[[s - l for s, l in zip(steps, lows)],
                                     [h - s for s, h in zip(steps, highs)]],
                    fmt="none", ecolor="black", elinewidth=1, capsize=5, zorder=4,
                    label="interval of the median over rounds")
    for x, step in zip(xs, steps):
        ax.annotate(f"{step:.3g} s", (x, max(highs[x], bottoms[x])),
                    textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    ax.set_xticks(xs)
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylim(0, max(max(highs), max(bottoms)) * 1.15)


def plot_breakdown(results: Dict[str, Any], path: Path) -> None:
    """Stacked bars per method: compute (floor), compression, exposed communication.

    When a method is far slower than the others (S-SGD on a slow link), a
    second panel zooms on the rest so their compression is visible.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = results["config"]
    floor_entry = results.get("compute_only") or {}
    floor = floor_entry.get("step_s_median")
    methods = _measured(results["methods"])

    def ends(entry):
        step = entry["step_s_median"]
        low, high = entry.get("step_s_low"), entry.get("step_s_high")
        return (step, step) if low is None or high is None else (low, high)

    rows = []
    if floor is not None:
        rows.append(("compute only\n(floor)",
                     {"compute": floor, "compression": 0.0, "exposed_comm": 0.0}, floor,
                     *ends(floor_entry)))
    for method in methods:
        entry = results["methods"][method]
        rows.append((_named(method, "plot_label"), breakdown(entry, floor or 0.0),
                     entry["step_s_median"], *ends(entry)))
    zoom = [r for r in rows if floor is None or r[2] <= 3 * floor]
    panels = [rows] + ([zoom] if 1 < len(zoom) < len(rows) else [])
    fig, axes = plt.subplots(1, len(panels), squeeze=False,
                             figsize=(1.7 * sum(len(p) for p in panels) + 2.5, 4.6),
                             gridspec_kw={"width_ratios": [len(p) for p in panels]})
    for ax, panel in zip(axes[0], panels):
        _bars(ax, *([r[i] for r in panel] for i in range(5)))
    rounds = results.get("rounds") or 1
    axes[0][0].set_ylabel("seconds per step (median)" if rounds < 2 else
                          f"seconds per step (median of {rounds} rounds)")
    if len(panels) > 1:
        axes[0][1].set_title("zoom: methods within 3x the floor", fontsize=8)
    link = (f"{cfg['bandwidth_mbit']:g} Mbit/s per node" if cfg.get("bandwidth_mbit")
            is not None else "localhost, no emulation")
    fig.suptitle(f"{cfg['model']}, {cfg['np']} ranks, batch {cfg['batch_size']}/rank, "
                 f"{_optimizer(cfg)}, rank {_matrix_rank(cfg)}, {link}", fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
