"""``python -m benchmarks check OLD/results.json NEW/results.json``: did a rerun move?

Compares two runs of one configuration ratio by ratio (every entry of
``ratios`` and ``diagnostic_ratios`` in results.json, keyed by ``a``, ``b``
and ``what``): a ratio whose two intervals do not overlap has changed
beyond the noise either run measured. The regression check for a change
(rerun the documented command on the new code, check against the committed
run) and for a user's own rerun.

Exit status: 0 when every ratio measured in both runs overlaps its
counterpart, 1 when one does not (each is listed), 2 when a file is
missing or not a results file with rounds, or the configurations differ.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .stats import Interval

__all__ = ["CheckError", "IDENTITY", "load", "config_differences", "compare", "main"]

PROG = "python -m benchmarks check"

#: Config fields that make two runs the same configuration: what is measured.
IDENTITY = ("model", "optimizer", "np", "batch_size", "matrix_rank", "bandwidth_mbit",
            "image_size", "seq_len", "threads_per_rank", "horovod_cycle_time_ms")
#: The value of a config field that runs from before it was recorded had.
RECORDED_LATER = {"optimizer": "sgd"}
#: Config fields that may differ (how long, on which code): shown, not refused.
NOTED = ("rounds", "steps", "warmup", "versions")
_KEYS = ("ratios", "diagnostic_ratios")

Key = Tuple[str, str, str]


class CheckError(Exception):
    """The two files cannot be compared (exit status 2)."""


def load(path: Path) -> Dict[str, Any]:
    """A results.json (or the one in directory ``path``), checked to be comparable.

    Raises:
        CheckError: missing, not JSON, not written by the benchmark, or
            written without rounds (no intervals to compare).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise CheckError(f"{path}: no such file")
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckError(f"{path}: not a results file of the benchmark ({exc})") from None
    if not isinstance(results, dict) or not isinstance(results.get("config"), dict) \
            or not isinstance(results.get("methods"), dict):
        raise CheckError(f"{path}: not a results file of the benchmark (no config and methods)")
    if "ratios" not in results or (results.get("rounds") or 1) < 2:
        raise CheckError(f"{path}: a run without rounds (no intervals to compare); "
                         "run it again with --rounds 2 or more (6 for 95% intervals)")
    return results


def config_differences(old: Dict[str, Any], new: Dict[str, Any],
                       fields: Sequence[str] = IDENTITY) -> List[str]:
    """``field: old value != new value`` for each of ``fields`` that differs."""
    a, b = old["config"], new["config"]
    values = [(field, a.get(field, RECORDED_LATER.get(field)),
               b.get(field, RECORDED_LATER.get(field))) for field in fields]
    return [f"{field}: {x!r} != {y!r}" for field, x, y in values if x != y]


def _ratios(results: Dict[str, Any]) -> Dict[Key, Dict[str, Any]]:
    return {(r["a"], r["b"], r["what"]): r for key in _KEYS for r in results.get(key) or []}


def _interval(ratio: Dict[str, Any]) -> Interval:
    return Interval(median=ratio["median"], low=ratio["low"], high=ratio["high"],
                    coverage=ratio.get("coverage", float("nan")), n=ratio.get("rounds", 0))


def compare(old: Dict[str, Any], new: Dict[str, Any]) -> Dict[str, Any]:
    """Every ratio of both runs, matched by ``(a, b, what)``.

    Returns:
        ``{"compared": n, "differ": [(key, old_ratio, new_ratio), ...],
        "only_old": [key, ...], "only_new": [key, ...]}``; a ratio differs
        when its two intervals do not overlap.
    """
    a, b = _ratios(old), _ratios(new)
    common = [key for key in a if key in b]
    differ = [(key, a[key], b[key]) for key in common
              if not _interval(a[key]).overlaps(_interval(b[key]))]
    return {"compared": len(common), "differ": differ,
            "only_old": [k for k in a if k not in b], "only_new": [k for k in b if k not in a]}


def _name(key: Key) -> str:
    a, b, what = key
    return f"{what} {a}/{b}"


def _show(ratio: Dict[str, Any]) -> str:
    return (f"{ratio['median']:.3f} [{ratio['low']:.3f}, {ratio['high']:.3f}] "
            f"({ratio['verdict']}, {ratio.get('rounds', '?')} rounds)")


def _describe(path: str, results: Dict[str, Any]) -> str:
    cfg = results["config"]
    return (f"{path}: {results.get('rounds')} rounds of {cfg.get('warmup')} warm-up + "
            f"{cfg.get('steps')} timed steps, hvd_acp {cfg.get('versions', {}).get('hvd_acp')}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Compare two runs of one configuration: list every ratio whose "
                    "intervals do not overlap. Exit 0: none; 1: at least one; 2: a file is "
                    "missing or not a results file with rounds, or the configurations differ.")
    parser.add_argument("old", help="results.json of the reference run (or its directory)")
    parser.add_argument("new", help="results.json of the run to check (or its directory)")
    args = parser.parse_args(argv)
    try:
        old, new = load(Path(args.old)), load(Path(args.new))
    except CheckError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    mismatch = config_differences(old, new)
    if mismatch:
        print(f"{PROG}: error: not the same configuration, nothing compared:\n  "
              + "\n  ".join(mismatch), file=sys.stderr)
        return 2
    print(f"old {_describe(args.old, old)}\nnew {_describe(args.new, new)}")
    for line in config_differences(old, new, NOTED):
        print(f"  differs, compared anyway: {line}")
    result = compare(old, new)
    if result["compared"] == 0:
        print(f"{PROG}: error: the two runs have no ratio in common",
              file=sys.stderr)
        return 2
    for side in ("only_old", "only_new"):
        if result[side]:
            print(f"  {side.replace('_', ' in ')} run, not compared: "
                  + ", ".join(_name(k) for k in result[side]))
    if not result["differ"]:
        print(f"{result['compared']} ratios compared: every interval overlaps its counterpart")
        return 0
    print(f"{result['compared']} ratios compared; {len(result['differ'])} moved beyond the "
          "noise (intervals do not overlap):")
    for key, a, b in result["differ"]:
        print(f"  {_name(key)}: old {_show(a)}, new {_show(b)}")
    return 1
