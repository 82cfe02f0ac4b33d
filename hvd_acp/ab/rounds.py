"""Rounds, paired ratios and their intervals: the statistics of every timing comparison.

A comparison of methods measures every method once per round, in an order
that rotates from round to round (:func:`round_order`). A method's figure
for a round is its median step; a ratio between two methods is computed
inside each round (:func:`paired_ratios`), so that a slow drift of the
machine, common to the methods of one round, cancels. Over the rounds a
figure is reported as its median with a distribution-free confidence
interval for the median (:func:`median_interval`), and a comparison gets a
verdict from whether that interval excludes 1.0 (:func:`verdict`).

Used by the A/B tool (:mod:`hvd_acp.ab`) and by the repository's emulated
benchmark alike. Pure Python: no torch, no collective library.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, TypeVar

__all__ = ["percentile", "combine_ranks", "summarize_steps", "round_order", "Interval",
           "order_statistic_rank", "median_interval", "paired_ratios", "verdict",
           "CONFIDENCE", "VERDICTS"]


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


# ------------------------------------------------------------------ rounds
T = TypeVar("T")

#: Confidence of every interval the benchmark reports.
CONFIDENCE = 0.95
#: A ratio a/b: ``faster`` when its interval lies below 1.0 (a needs less
#: time, or fewer bytes, than b), ``slower`` when above, ``same`` otherwise.
VERDICTS = ("faster", "slower", "same")


def round_order(jobs: Sequence[T], round_index: int) -> List[T]:
    """The order in which ``jobs`` run in round ``round_index`` (0-based).

    A cyclic rotation: round ``i`` starts with job ``i mod n`` and keeps the
    others in their order. Over ``n`` rounds every job runs once in every
    position, so none always runs first or last, next to a cold start or to
    the end of the run.
    """
    if round_index < 0:
        raise ValueError(f"round_index must be >= 0, got {round_index!r}")
    if not jobs:
        return []
    shift = round_index % len(jobs)
    return list(jobs[shift:]) + list(jobs[:shift])


def _binomial_tail(n: int, k: int) -> float:
    """P(B <= k) for B ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n


def order_statistic_rank(n: int, confidence: float = CONFIDENCE) -> tuple:
    """Which order statistics bound the median's interval, and its coverage.

    For ``n`` independent values from one continuous distribution, the
    interval between the ``j``-th smallest and the ``j``-th largest value
    contains the distribution's median with probability
    ``1 - 2 P(B <= j - 1)``, ``B ~ Binomial(n, 1/2)`` (the sign test,
    inverted), whatever the distribution. Returns the largest ``j`` whose
    coverage reaches ``confidence`` and that coverage. Below 6 values no
    interval reaches 95%: ``j`` is then 1 (minimum to maximum) and the
    coverage returned is the lower one it really has (5 values: 93.75%,
    2 values: 50%, 1 value: 0).

    Returns:
        (j, coverage): 1-based rank from each end, and the exact coverage.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    best = 1
    for j in range(2, (n + 1) // 2 + 1):
        if 1 - 2 * _binomial_tail(n, j - 1) >= confidence:
            best = j
        else:
            break
    coverage = 1 - 2 * _binomial_tail(n, best - 1) if n > 1 else 0.0
    return best, coverage


@dataclasses.dataclass(frozen=True)
class Interval:
    """A median over rounds with its confidence interval.

    Attributes:
        median: the median of the values (for ratios: in log space, so the
            median of b/a is exactly 1 / the median of a/b).
        low, high: the interval's ends, order statistics of the values.
        coverage: the probability that such an interval contains the true
            median (exact, from the binomial distribution; below
            :data:`CONFIDENCE` only when there are fewer than 6 values).
        n: how many values (rounds) it is computed from.
    """

    median: float
    low: float
    high: float
    coverage: float
    n: int

    def overlaps(self, other: "Interval") -> bool:
        return self.low <= other.high and other.low <= self.high

    def as_dict(self) -> Dict[str, float]:
        return {"median": self.median, "low": self.low, "high": self.high}


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE,
                    log: bool = False) -> Interval:
    """The median of ``values`` with a distribution-free interval (see
    :func:`order_statistic_rank`).

    Args:
        values: one value per round.
        confidence: the coverage asked for.
        log: take the median in log space (for ratios, which must be
            positive): with an even number of values the median is then the
            geometric mean of the middle two, and a ratio and its reciprocal
            get reciprocal medians and intervals.
    """
    if not values:
        raise ValueError("median_interval of an empty sequence")
    ordered = sorted(float(v) for v in values)
    if log and ordered[0] <= 0:
        raise ValueError(f"log=True needs positive values, got {ordered[0]!r}")
    n = len(ordered)
    j, coverage = order_statistic_rank(n, confidence)
    if log and n % 2 == 0:
        median = math.sqrt(ordered[n // 2 - 1] * ordered[n // 2])
    else:
        median = percentile(ordered, 50)
    return Interval(median=median, low=ordered[j - 1], high=ordered[n - j],
                    coverage=coverage, n=n)


def paired_ratios(a: Dict[int, Optional[float]],
                  b: Dict[int, Optional[float]]) -> List[float]:
    """``a[i] / b[i]`` for every round ``i`` in which both have a positive figure.

    Args:
        a, b: a job's figure (median step, compression or bytes per step)
            by round number; ``None`` for a round whose job failed.
    """
    return [a[i] / b[i] for i in sorted(a)
            if a[i] is not None and b.get(i) is not None and a[i] > 0 and b[i] > 0]


def verdict(interval: Interval, threshold: float = 1.0) -> str:
    """``faster`` / ``slower`` / ``same`` for a ratio a/b (see :data:`VERDICTS`).

    With a single round there is no interval and nothing is measurable:
    ``same``.
    """
    if interval.n < 2:
        return "same"
    if interval.high < threshold:
        return "faster"
    if interval.low > threshold:
        return "slower"
    return "same"
