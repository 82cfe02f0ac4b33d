"""Tables of the matrix-rank study (docs/convergence.md, "Choosing the rank").

    .venv/bin/python scripts/rank_report.py bench-results/autorank

Reads the ``--summary`` JSON files of the runs (``scripts/user_lm.py``,
``examples/train.py``, ``examples/train_lm.py``) named ``<setting>_s<seed>.json``
under the given folder and prints, per study, each setting's final metric
per seed, its gap to S-SGD of the same seed, its mean gap and its bytes per
step. The commands that produced the files are in docs/convergence.md.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

#: (prefix of the files, title, the metric, lower is better, S-SGD reference key)
STUDIES = (
    ("ulm", "user LM, AdamW, 4 ranks, 400 steps: final validation loss", "val_loss", True,
     "S-SGD"),
    ("ulm_sgd", "user LM, SGD (lr 0.3, momentum 0.9), 4 ranks, 400 steps: final validation "
     "loss", "val_loss", True, "S-SGD"),
    ("cnn", "digits CNN, 8 ranks: final test accuracy (%)", "test_accuracy", False, "S-SGD"),
    ("resnet", "digits BatchNorm ResNet, 8 ranks: final test accuracy (%)", "test_accuracy",
     False, "S-SGD"),
    ("lm2", "examples/train_lm.py, 2 ranks: final validation loss", "val_loss", True, "S-SGD"),
    ("lm4", "examples/train_lm.py, 4 ranks: final validation loss", "val_loss", True, "S-SGD"),
)


def load(folder: Path) -> dict:
    """{study: {setting: {seed: summary}}} from ``<study>__<setting>_s<seed>.json``."""
    found: dict = defaultdict(lambda: defaultdict(dict))
    for path in sorted(folder.glob("*.json")):
        match = re.fullmatch(r"(?P<study>[a-z0-9_]+?)__(?P<setting>.+)_s(?P<seed>\d+)", path.stem)
        if match:
            found[match["study"]][match["setting"]][int(match["seed"])] = json.loads(
                path.read_text())
    return found


def bytes_per_step(summary: dict) -> float:
    if "bytes_per_step" in summary:
        return summary["bytes_per_step"]
    return summary["bytes_sent_per_rank"] / summary["steps"]


def table(title: str, runs: dict, metric: str, lower: bool, reference: str) -> str:
    lines = [f"**{title}**", "",
             "| setting | seeds | per seed | vs S-SGD per seed | mean vs S-SGD | "
             "bytes per step per rank |", "|---|---|---|---|---|---|"]
    ref = runs.get(reference, {})
    order = sorted(runs, key=lambda k: (k != reference, -statistics.mean(
        bytes_per_step(summary) for summary in runs[k].values())))
    for setting in order:
        by_seed = runs[setting]
        seeds = sorted(by_seed)
        scale = 100.0 if metric == "test_accuracy" else 1.0      # a fraction, shown in %
        values = [scale * by_seed[s][metric] for s in seeds]
        if metric == "val_loss":
            gaps = [100 * (v / ref[s][metric] - 1) if s in ref else None
                    for s, v in zip(seeds, values)]
            unit = "%"
        else:
            gaps = [v - scale * ref[s][metric] if s in ref else None
                    for s, v in zip(seeds, values)]
            unit = " pt"
        shown = [g for g in gaps if g is not None]
        mean = f"{statistics.mean(shown):+.2f}{unit}" if shown else "–"
        per_bytes = statistics.mean(bytes_per_step(by_seed[s]) for s in seeds)
        lines.append(
            f"| {setting} | {', '.join(map(str, seeds))} | "
            + ", ".join(f"{v:.4f}" if metric == "val_loss" else f"{v:.2f}" for v in values)
            + " | " + ", ".join("–" if g is None else f"{g:+.2f}{unit}" for g in gaps)
            + f" | {mean} | {per_bytes / 1e3:,.1f} kB |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    found = load(args.folder)
    for study, title, metric, lower, reference in STUDIES:
        if study in found:
            print(table(title, found[study], metric, lower, reference))
            print()


if __name__ == "__main__":
    main()
