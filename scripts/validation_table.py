"""The validation table of docs/planner.md from ``hvd-acp-plan validate`` outputs.

    .venv/bin/python scripts/validation_table.py bench-results/validation/*/validate.json \
        [--doc docs/planner.md]

Prints one row per validated benchmark run (measured / predicted step and
the error per method), then the worst errors at 2 and at more ranks; with
``--doc``, also writes them between ``<!-- validation -->`` and
``<!-- end validation -->`` of that page.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench_doc import replace_marked  # scripts/, beside this file
from hvd_acp.methods import label as method_label
from hvd_acp.plan.timeline import METHODS

MARKERS = ("<!-- validation -->", "<!-- end validation -->")


def _bw(mbit: float) -> str:
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def _cal(row: dict) -> str:
    cal = row["calibration"]
    source = "diagnostic floors" if cal["source"] == "diagnostics" else "1-process floor"
    extra = []
    if row.get("stack_s_per_byte"):
        extra.append(f"stack {row['stack_s_per_byte'] * 1e9:.2f} ns/B")
    if row.get("latency_s") or row.get("horovod_negotiation_s"):
        extra.append(f"alpha {row['latency_s'] * 1e3:.2f} ms, negotiation "
                     f"{row['horovod_negotiation_s'] * 1e3:.1f} ms")
    return f"{source} (c = {cal['compute_scale']:.3f})" + "".join(f"; {e}" for e in extra)


def table(rows: list) -> list:
    lines = ["| benchmark run | link | cycle | calibration | "
             + " | ".join(method_label(m) for m in METHODS) + " | worst |",
             "|---|---:|---:|---|" + "---:|" * (len(METHODS) + 1)]
    for row in rows:
        digits = 3 if min(m["measured_step_s"] for m in row["methods"].values()) < 0.5 else 2
        cells = []
        for m in METHODS:
            r = row["methods"].get(m)
            cells.append("not run" if r is None else
                         f"{r['measured_step_s']:.{digits}f} / {r['predicted_step_s']:.{digits}f} "
                         f"({r['error'] * 100:+.1f}%)")
        name = Path(row["bench"]).parent.name
        lines.append(f"| `{name}` ({row['model']}, {row['np']} ranks, batch {row['batch_size']}) "
                     f"| {_bw(row['bandwidth_mbit'])} | {row['cycle_time_ms']:g} ms "
                     f"| {_cal(row)} | " + " | ".join(cells)
                     + f" | {row['worst_abs_error'] * 100:.1f}% |")
    return lines


def summary(rows: list) -> list:
    out = []
    for label, keep in (("2 ranks", lambda n: n == 2), ("more than 2 ranks", lambda n: n > 2)):
        errors = [(abs(r["error"]), m, Path(row["bench"]).parent.name)
                  for row in rows if keep(row["np"]) for m, r in row["methods"].items()]
        if not errors:
            continue
        within15 = sum(e <= 0.15 for e, _, _ in errors)
        within25 = sum(e <= 0.25 for e, _, _ in errors)
        worst = max(errors)
        out.append(f"{label}: {len(errors)} predictions, {within15} within 15%, {within25} "
                   f"within 25%; worst {worst[0] * 100:.1f}% ({method_label(worst[1])}, {worst[2]})")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", type=Path, nargs="+", help="validate.json files")
    parser.add_argument("--doc", type=Path, default=None, help="a page with the markers")
    args = parser.parse_args(argv)
    rows = [row for path in args.files for row in json.loads(path.read_text())]
    text = "\n".join(table(rows) + [""] + [f"- {line}" for line in summary(rows)])
    print(text)
    if args.doc is not None:
        page = args.doc.read_text(encoding="utf-8")
        args.doc.write_text(replace_marked(page, MARKERS, [text], args.doc), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
