"""What an A/B run found: intervals, paired ratios, verdicts and one recommendation.

Pure functions of the measurements (:func:`.runner.measure`), testable in
one process. A method's step is the median of its round figures with a
distribution-free interval; a comparison with ACP-SGD is the median of the
per-round ratios, with its interval and verdict (:mod:`.rounds`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ..methods import get
from ..plan.models import optimizer_name
from .rounds import CONFIDENCE, Interval, median_interval, paired_ratios, verdict
from .runner import ACP_KEYS

__all__ = ["CANDIDATES", "summarize", "recommendation", "markdown"]

#: The method the A/B run is about, by preference: hvd_acp's optimizer, then its DDP hook.
CANDIDATES = ("acp", "acp-ddp")


def _interval(values: Sequence[float], log: bool = False) -> Dict[str, Any]:
    return _as_dict(median_interval(values, log=log))


def _as_dict(found: Interval) -> Dict[str, Any]:
    return {**found.as_dict(), "coverage": found.coverage, "n": found.n}


def _candidate(methods: Sequence[str]) -> Optional[str]:
    return next((key for key in CANDIDATES if key in methods), None)


def summarize(measured: Dict[str, Dict[str, Any]], samples_per_step: int) -> Dict[str, Any]:
    """Per method its step interval, throughput and bytes; per other method its
    ratio to the candidate (ACP-SGD) with a verdict; the recommendation.

    Args:
        measured: :func:`.runner.measure`'s result.
        samples_per_step: samples of one step over all ranks.
    """
    methods: Dict[str, Any] = {}
    for key, entry in measured.items():
        step = _interval(entry["rounds"])
        summary = {"label": get(key).label, "title": get(key).title, "step_s": step,
                   "samples_per_s": samples_per_step / step["median"],
                   "rounds_s": list(entry["rounds"]), "last_loss": entry["loss"][-1]}
        if entry.get("settings"):
            summary["settings"] = entry["settings"]
        for field in ("bytes_per_step", "bytes_received_per_step", "allreduces_per_step",
                      "compression_s_per_step"):
            if entry.get(field):
                summary[field] = sorted(entry[field])[len(entry[field]) // 2]
        methods[key] = summary
    candidate = _candidate(list(measured))
    comparisons: Dict[str, Any] = {}
    if candidate is not None:
        mine = dict(enumerate(measured[candidate]["rounds"]))
        for key, entry in measured.items():
            if key == candidate:
                continue
            ratios = paired_ratios(dict(enumerate(entry["rounds"])), mine)
            if not ratios:
                continue
            # other's step / candidate's step: above 1.0 the candidate is faster.
            speedup = median_interval(ratios, log=True)
            comparisons[key] = {**_as_dict(speedup), "verdict": _verdict_for_candidate(speedup)}
    summary = {"candidate": candidate, "methods": methods, "speedup": comparisons}
    summary["recommendation"] = recommendation(summary)
    return summary


def _verdict_for_candidate(speedup: Interval) -> str:
    """``faster`` when the candidate's step is shorter (the other's step over
    the candidate's is above 1.0 throughout the interval)."""
    reverse = Interval(1 / speedup.median, 1 / speedup.high, 1 / speedup.low,
                       speedup.coverage, speedup.n)
    return verdict(reverse)


def _fmt_interval(entry: Dict[str, Any], digits: int = 2, suffix: str = "x") -> str:
    return (f"{entry['median']:.{digits}f}{suffix} "
            f"[{entry['low']:.{digits}f}, {entry['high']:.{digits}f}]")


def _confidence(entry: Dict[str, Any]) -> str:
    return f"{entry['coverage']:.0%} interval over {entry['n']} rounds"


def recommendation(summary: Dict[str, Any]) -> str:
    """One line: is ACP-SGD faster than the fastest other method measured?

    With fewer rounds than a 95% interval needs (6), the line says that the
    interval is narrower than it looks and that the run decides nothing yet.
    """
    line = _recommendation(summary)
    speedups = list(summary["speedup"].values())
    if speedups and speedups[0]["coverage"] < CONFIDENCE:
        line += (f" Caution: {speedups[0]['n']} rounds give a {speedups[0]['coverage']:.0%} "
                 "interval only; decide on --rounds 6 or more.")
    return line


def _recommendation(summary: Dict[str, Any]) -> str:
    methods, candidate = summary["methods"], summary["candidate"]
    fastest = min(methods, key=lambda key: methods[key]["step_s"]["median"])
    if candidate is None:
        return (f"{methods[fastest]['label']} is the fastest method measured "
                f"({methods[fastest]['step_s']['median']:.4f} s per step); "
                "add acp (or acp-ddp with --ddp) to --methods to compare ACP-SGD.")
    apart = [methods[key]["label"] for key in methods if not get(key).averages_gradients]
    note = (f" Left out of this comparison: {', '.join(apart)}, other algorithms than "
            "averaging each step's gradient, whose step time says nothing about their loss "
            "(and DiLoCo's outer step, once every H steps, may fall outside the timed ones); "
            "compare them on the loss (docs/api.md, the baselines)." if apart else "")
    others = [key for key in methods if key != candidate and key in summary["speedup"]
              and get(key).averages_gradients]
    if not others and not apart:
        return f"Only {methods[candidate]['label']} was measured: nothing to compare with."
    if not others:
        return (f"No other method that averages each step's gradient was measured beside "
                f"{methods[candidate]['label']}." + note)
    rival = min(others, key=lambda key: methods[key]["step_s"]["median"])
    ratio = summary["speedup"][rival]
    me, them = methods[candidate]["label"], methods[rival]["label"]
    if ratio["verdict"] == "faster":
        return (f"{me} is {_fmt_interval(ratio)} faster than {them}, the fastest other method "
                f"here ({_confidence(ratio)}): use it." + note)
    inverse = {"median": 1 / ratio["median"], "low": 1 / ratio["high"],
               "high": 1 / ratio["low"]}
    if ratio["verdict"] == "slower":
        return (f"{them} is {_fmt_interval(inverse)} faster than {me} here "
                f"({_confidence(ratio)}): compression does not pay on this cluster and "
                f"model; keep {them}." + note)
    return (f"{me} and {them} cannot be told apart here: {them}'s step over {me}'s is "
            f"{_fmt_interval(ratio)} ({_confidence(ratio)}). Compression does not clearly "
            "pay; more rounds (--rounds) narrow the interval." + note)


#: A verdict of the candidate against another method, in the table.
_SAY = {"faster": "faster", "slower": "slower", "same": "not separable"}


def _rank(matrix_rank) -> str:
    return "each method's default for the optimizer" if matrix_rank is None else str(matrix_rank)


def describe_settings(key: str, settings: Dict[str, Any],
                      budget: Optional[float] = None) -> str:
    """Method ``key``'s resolved settings in words: the rank (a share of each
    matrix's smaller side where it is a float), what goes per step, the wire,
    and the ``budget`` they were chosen for, if one was."""
    rank = settings.get("matrix_rank")
    words = [f"matrix rank {rank}" + (f" ({rank:g} of each matrix's smaller side)"
                                      if isinstance(rank, float) else "")]
    if get(key).algorithm == "Power-SGD":
        words.append("P then Q every step, two all-reduces")
    elif settings.get("int8_factors"):
        words.append("both factors every step, in 8-bit lanes (an all-reduce of their own "
                     "beside the uncompressed tensors')")
    elif "both_factors" in settings:
        words.append("both factors every step, one all-reduce" if settings["both_factors"]
                     else "P and Q in turn")
    if settings.get("fp16_wire"):
        words.append("the rest in fp16" if settings.get("int8_factors") else "fp16 on the wire")
    if budget is not None:
        words.append(f"chosen for a budget of {budget:g} of S-SGD's fp32 bytes")
    return ", ".join(words)


def _acp_options(config: Dict[str, Any]) -> str:
    """What ``--budget`` or ``--int8-factors`` set for ACP-SGD's methods, in words."""
    options = config.get("acp_options") or {}
    if options.get("budget") is not None:
        return f" (ACP-SGD: budget {options['budget']:g} of S-SGD's bytes instead)"
    if options.get("int8_factors"):
        return " (ACP-SGD's factors in 8-bit lanes)"
    return ""


def _mb(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value / 1e6:.3f}"


def markdown(config: Dict[str, Any], summary: Dict[str, Any]) -> str:
    """The run as a short markdown report: settings, the table, the recommendation."""
    candidate = summary["candidate"]
    cand_label = summary["methods"][candidate]["label"] if candidate else None
    lines: List[str] = [
        f"# A/B: {config['model_description']}",
        "",
        f"{config['ranks']} ranks ({config['launcher']}, {config['device']}), batch "
        f"{config['batch_size']} per rank, {optimizer_name(config.get('optimizer'))}, "
        f"matrix rank {_rank(config['matrix_rank'])}{_acp_options(config)}, "
        f"{config['rounds']} rounds of {config['steps']} timed steps after "
        f"{config['warmup']} untimed, {config['threads']} torch thread"
        f"{'s' if config['threads'] != 1 else ''} per rank.",
        "",
        "| method | step (s), median [interval] | samples/s | MB per step per rank"
        + (f" | {cand_label} faster by |" if candidate else " |"),
        "|---|---|---|---|" + ("---|" if candidate else ""),
    ]
    for key, entry in summary["methods"].items():
        row = (f"| {entry['title']} | {_fmt_interval(entry['step_s'], 4, '')} | "
               f"{entry['samples_per_s']:.1f} | {_mb(entry.get('bytes_per_step'))} |")
        if candidate:
            ratio = summary["speedup"].get(key)
            row += (f" {_fmt_interval(ratio)} ({_SAY[ratio['verdict']]}) |" if ratio
                    else " (itself) |")
        lines.append(row)
    exact = summary["methods"].get("ssgd", summary["methods"].get("ddp", {})).get(
        "bytes_per_step")
    budget = (config.get("acp_options") or {}).get("budget")
    chosen = [f"- {entry['title']}: "
              f"{describe_settings(key, entry['settings'], budget if key in ACP_KEYS else None)}"
              + (f"; sends {entry['bytes_per_step'] / exact:.3f} of S-SGD's bytes"
                 if exact and entry.get("bytes_per_step") else "")
              for key, entry in summary["methods"].items() if entry.get("settings")]
    if chosen:
        lines += ["", "Settings each compressed method trained with, every default decided:",
                  ""] + chosen
    if summary.get("floor_s"):
        lines += ["", f"Compute only, one process, nothing communicated (the profile's "
                      f"forward, backward and update): {summary['floor_s']:.4f} s per step."]
    lines += ["", summary["recommendation"], ""]
    return "\n".join(lines)
