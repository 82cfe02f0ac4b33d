"""The planner with default flags against measured benchmark runs.

For each ``results.json`` of the benchmark (``python -m benchmarks``), this
does what a user would: ``hvd-acp-plan --model M --batch-size B --np N
--bandwidth X`` with nothing else but the Horovod cycle time the run used
(``--horovod-cycle-time-ms``, a setting of the run, not a calibration), and
compares each predicted step with the measured median. No link calibration,
no diagnostics floors, no host-serial flag: the defaults. The profile is
measured here once per model and batch, with the planner's default threads
per rank (1, as each benchmark rank runs).

    .venv/bin/python scripts/plan_vs_bench.py bench-results/resnet50_100mbit/results.json ... \\
        --out bench-results/validation/defaults

Writes ``defaults.json`` and ``defaults.md`` (a table: run, method, measured,
predicted, error) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hvd_acp.methods import label  # noqa: E402
from hvd_acp.plan.__main__ import main as plan_main  # noqa: E402

#: A prediction within this fraction of the measurement meets the target.
TARGET = 0.20


def _predict(results: Path, out: Path, profiles: Dict[Tuple, Path]) -> dict:
    bench = json.loads(results.read_text())
    cfg = bench["config"]
    key = (cfg["model"], cfg["batch_size"], cfg["matrix_rank"])
    profile = profiles.get(key)
    flags = ["--np", str(cfg["np"]), "--bandwidth", f"{cfg['bandwidth_mbit']:g}mbit",
             "--no-plot"]
    if cfg.get("horovod_cycle_time_ms"):
        flags += ["--horovod-cycle-time-ms", f"{cfg['horovod_cycle_time_ms']:g}"]
    plan_dir = out / results.parent.name
    if profile is None:
        profile = out / f"profile_{cfg['model']}_b{cfg['batch_size']}.json"
        command = ["--model", cfg["model"], "--batch-size", str(cfg["batch_size"]),
                   "--matrix-rank", str(cfg["matrix_rank"]), "--save-profile", str(profile)]
        profiles[key] = profile
    else:
        command = ["--profile", str(profile)]
    if plan_main(["predict", *command, *flags, "--out", str(plan_dir)]) != 0:
        raise RuntimeError(f"hvd-acp-plan failed on {results}")
    plan = json.loads((plan_dir / "plan.json").read_text())
    predicted = plan["predictions"][0]["methods"]
    rows = {}
    for method, entry in bench["methods"].items():
        measured = entry.get("step_s_median")
        if measured and method in predicted:
            p = predicted[method]["step_s"]
            rows[method] = {"measured_step_s": measured, "predicted_step_s": p,
                            "error": (p - measured) / measured}
    return {"run": str(results.parent.relative_to(REPO) if results.is_relative_to(REPO)
                       else results.parent),
            "model": cfg["model"], "batch_size": cfg["batch_size"], "np": cfg["np"],
            "bandwidth_mbit": cfg["bandwidth_mbit"],
            "command": "hvd-acp-plan " + " ".join(
                ["--model", cfg["model"], "--batch-size", str(cfg["batch_size"]), *flags]),
            "methods": rows}


def markdown(found: List[dict]) -> str:
    lines = ["| run | model, batch | link | method | measured (s) | predicted (s) | error |",
             "|---|---|---|---|---|---|---|"]
    for run in found:
        for method, row in run["methods"].items():
            flag = "" if abs(row["error"]) <= TARGET else " **x**"
            lines.append(f"| {Path(run['run']).name} | {run['model']}, {run['batch_size']} | "
                         f"{run['bandwidth_mbit']:g} Mbit/s | {label(method)} | "
                         f"{row['measured_step_s']:.3f} | {row['predicted_step_s']:.3f} | "
                         f"{row['error'] * 100:+.1f}%{flag} |")
    errors = [abs(r["error"]) for run in found for r in run["methods"].values()]
    within = sum(e <= TARGET for e in errors)
    lines += ["", f"{within} of {len(errors)} predictions within {TARGET:.0%}; worst "
              f"{max(errors) * 100:.1f}%." if errors else "no prediction"]
    return "\n".join(lines)


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="the runs' results.json")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    profiles: Dict[Tuple, Path] = {}
    found = [_predict(path.resolve(), args.out, profiles) for path in args.results]
    text = markdown(found)
    (args.out / "defaults.json").write_text(json.dumps(found, indent=1) + "\n")
    (args.out / "defaults.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
