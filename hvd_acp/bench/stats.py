"""Pure helpers of the benchmark: argument parsing and statistics."""
from __future__ import annotations

import math
import re
from typing import Dict, List, Optional, Sequence

__all__ = ["METHODS", "parse_bandwidth", "parse_methods", "percentile",
           "summarize_steps", "combine_ranks", "tbf_burst_bytes"]

#: Methods accepted by ``--methods``, in the order they are reported.
METHODS = ("ssgd", "powersgd", "powersgd-ddp", "acp")

_UNITS = {"bit": 1e-6, "kbit": 1e-3, "mbit": 1.0, "gbit": 1e3, "tbit": 1e6}
_BANDWIDTH = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?bit)\s*$",
                        re.IGNORECASE)


def parse_bandwidth(text: Optional[str]) -> Optional[float]:
    """A link rate in tc's notation, in Mbit/s: ``"200mbit"`` -> 200.0.

    Units are tc's bit rates: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit``
    (powers of 1000, case-insensitive). ``None``, ``""`` and ``"none"`` mean
    no emulation and give ``None``.

    Raises:
        ValueError: the text is not a positive rate in one of those units.
    """
    if text is None or text.strip().lower() in ("", "none"):
        return None
    match = _BANDWIDTH.match(text)
    if not match:
        raise ValueError(f"bandwidth must look like 200mbit, 1gbit or 500kbit (units bit, "
                         f"kbit, mbit, gbit, tbit), got {text!r}")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not value > 0 or math.isinf(value):
        raise ValueError(f"bandwidth must be a positive rate, got {text!r}")
    return value


def parse_methods(text: str) -> List[str]:
    """``"ssgd,acp"`` -> ``["ssgd", "acp"]``, checked, duplicates removed, in given order."""
    methods: List[str] = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        if item not in METHODS:
            raise ValueError(f"methods must be a comma-separated list of {', '.join(METHODS)}; "
                             f"got {item!r} in {text!r}")
        if item not in methods:
            methods.append(item)
    if not methods:
        raise ValueError(f"methods must name at least one of {', '.join(METHODS)}, got {text!r}")
    return methods


def tbf_burst_bytes(rate_mbit: float) -> int:
    """Token-bucket size for tc ``tbf`` at ``rate_mbit``.

    It must exceed the largest packet the interface hands to the qdisc (a
    veth with segmentation offload passes 64 KiB super-packets) or such
    packets are dropped and TCP stalls; and it must cover a timer tick at
    high rates or the link cannot reach its rate. 2 ms of traffic, at least
    128 KiB.
    """
    return max(128 * 1024, int(rate_mbit * 1e6 / 8 * 0.002))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q!r}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lower = math.floor(pos)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (pos - lower)


def combine_ranks(per_rank_steps: Sequence[Sequence[float]]) -> List[float]:
    """Per-step time of the job: the slowest rank's time of each step.

    Ranks wait for each other in every all-reduce, so their times differ by
    little; taking the maximum counts a step as done when every rank is.
    """
    if not per_rank_steps:
        raise ValueError("no ranks")
    counts = {len(s) for s in per_rank_steps}
    if len(counts) != 1:
        raise ValueError(f"ranks timed different numbers of steps: {sorted(counts)}")
    return [max(times) for times in zip(*per_rank_steps)]


def summarize_steps(step_s: Sequence[float], samples_per_step: int) -> Dict[str, float]:
    """Median, p10, p90 of step times and throughput at the median.

    Args:
        step_s: seconds of each timed step.
        samples_per_step: samples processed per step over all ranks.
    """
    median = percentile(step_s, 50)
    return {"step_s_median": median,
            "step_s_p10": percentile(step_s, 10),
            "step_s_p90": percentile(step_s, 90),
            "samples_per_s": samples_per_step / median if median > 0 else float("nan")}
