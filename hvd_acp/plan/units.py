"""Command-line values of the planner (and of the repository's benchmark): link
rates in tc's units, lists, checked numbers. Pure, no torch."""
from __future__ import annotations

import argparse
import math
import re
from typing import Any, Callable, List, Optional

__all__ = ["parse_bandwidth", "parse_bandwidth_list", "parse_int_list", "number_type",
           "positive_int", "matrix_rank_type", "add_count"]

_UNITS = {"bit": 1e-6, "kbit": 1e-3, "mbit": 1.0, "gbit": 1e3, "tbit": 1e6}
_BANDWIDTH = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?bit)\s*$",
                        re.IGNORECASE)


def parse_bandwidth(text: Optional[str]) -> Optional[float]:
    """A link rate in tc's notation, in Mbit/s: ``"200mbit"`` -> 200.0.

    Units are tc's bit rates: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit``
    (powers of 1000, case-insensitive). ``None``, ``""`` and ``"none"`` mean
    no rate (the benchmark: no emulation) and give ``None``.

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


def parse_bandwidth_list(text: str) -> List[float]:
    """``"1gbit,10gbit"`` -> ``[1000.0, 10000.0]`` (Mbit/s), each as :func:`parse_bandwidth`."""
    values = []
    for item in text.split(","):
        if not item.strip():
            continue
        value = parse_bandwidth(item)
        if value is None:
            raise ValueError(f"bandwidth must be a rate such as 1gbit, got {item!r}")
        values.append(value)
    if not values:
        raise ValueError(f"bandwidth must list at least one rate, got {text!r}")
    return values


def parse_int_list(text: str, what: str = "np") -> List[int]:
    """``"2,8,32"`` -> ``[2, 8, 32]``; every value a positive int."""
    values = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"{what} must be a comma-separated list of positive ints, got "
                             f"{item!r} in {text!r}") from None
        if value < 1:
            raise ValueError(f"{what} must be positive ints, got {value} in {text!r}")
        values.append(value)
    if not values:
        raise ValueError(f"{what} must list at least one value, got {text!r}")
    return values


def number_type(convert: Callable[[str], Any], ok: Callable[[Any], bool], what: str):
    """An argparse ``type=``: ``convert(text)``, refused unless ``ok(value)``,
    with "must be <what>" as the message."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    return parse


#: An argparse ``type=`` for a positive int.
positive_int = number_type(int, lambda v: v >= 1, "a positive int")


def matrix_rank_type(text: str):
    """An argparse ``type=`` for ``--matrix-rank``: a positive int, a share of
    each matrix's smaller side in (0, 1) such as ``0.5``, or ``auto`` (a rank
    per tensor, see :mod:`hvd_acp.autorank`)."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        pass
    try:
        share = float(text)
    except ValueError:
        share = None
    if share is not None and 0.0 < share < 1.0:
        return share
    raise argparse.ArgumentTypeError(
        f"must be a positive int, a share in (0, 1) or 'auto', got {text!r}")


def add_count(parser, flag: str, default: int, what: str, minimum: int = 1) -> None:
    """A count flag of the command-line tools: ``flag`` (an int >= ``minimum``,
    default ``default``), its help ``what`` with the default said once."""
    kind = positive_int if minimum >= 1 else int
    parser.add_argument(flag, type=kind, default=default, help=f"{what} (default {default})")
