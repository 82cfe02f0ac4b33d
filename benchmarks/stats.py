"""Pure helpers of the benchmark: ``--methods``, the token bucket, the machine's load.

The statistics of rounds (rotation, paired ratios, intervals, verdicts) are
the package's, shared with the A/B tool: :mod:`hvd_acp.ab.rounds`,
re-exported here.
"""
from __future__ import annotations

import os
from typing import List

from hvd_acp.ab.rounds import (CONFIDENCE, VERDICTS, Interval, combine_ranks, median_interval,
                               order_statistic_rank, paired_ratios, percentile, round_order,
                               summarize_steps, verdict)
from hvd_acp.methods import KEYS

__all__ = ["machine_busy_s", "parse_methods", "percentile", "summarize_steps",
           "combine_ranks", "tbf_burst_bytes", "round_order", "Interval",
           "order_statistic_rank", "median_interval", "paired_ratios", "verdict",
           "CONFIDENCE", "VERDICTS"]


def parse_methods(text: str) -> List[str]:
    """``"ssgd,acp"`` -> ``["ssgd", "acp"]``: keys of :mod:`hvd_acp.methods`, checked,
    duplicates removed, in given order."""
    methods: List[str] = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        if item not in KEYS:
            raise ValueError(f"methods must be a comma-separated list of {', '.join(KEYS)}; "
                             f"got {item!r} in {text!r}")
        if item not in methods:
            methods.append(item)
    if not methods:
        raise ValueError(f"methods must name at least one of {', '.join(KEYS)}, got {text!r}")
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


def machine_busy_s() -> float:
    """CPU-seconds the whole machine has been busy (all CPUs, /proc/stat)."""
    with open("/proc/stat", encoding="ascii") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
