"""docs/planner.md's generated blocks, for scripts/docgen.py.

The tables come from the planner's own scripts, as they print them:

- ``planval``, ``planval-adamw``: ``scripts/plan_vs_bench.py``, the
  planner's defaults against the benchmark runs under SGD and AdamW, from
  ``bench-results/planval/defaults/defaults.json`` and
  ``bench-results/planval_adamw_polled/predicted/defaults.json`` (the
  AdamW runs with the polled wait, predicted from profiles of the slowest
  rank, the planner as shipped);
- ``validation``: ``scripts/validation_table.py``, the calibrated
  predictions against the runs, from ``bench-results/validation/*/validate.json``;
- ``paper``, ``paper-adamw``: ``scripts/paper_projection.py``, the paper's
  settings, and the transformers under AdamW, projected from the committed
  profiles in ``bench-results/profiles/``, at that script's default GPU
  (:data:`PAPER_GPU`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from docgen import Block  # noqa: E402

PAGE = "docs/planner.md"
#: The AdamW validation docs/planner.md publishes.
ADAMW_VALIDATION = "bench-results/planval_adamw_polled/predicted"
#: ``scripts/paper_projection.py``'s defaults: ``--gpu-tflops``, ``--utilisation``.
PAPER_GPU = (15.7, 0.4)


def _planval(folder: str) -> List[str]:
    import plan_vs_bench
    found = json.loads((REPO / folder / "defaults.json").read_text())
    return plan_vs_bench.markdown(found).split("\n")


def planval(page: Path) -> List[str]:
    return _planval("bench-results/planval/defaults")


def planval_adamw(page: Path) -> List[str]:
    return _planval(ADAMW_VALIDATION)


def validation(page: Path) -> List[str]:
    import validation_table
    rows = [row for path in sorted((REPO / "bench-results" / "validation").glob("*/validate.json"))
            for row in json.loads(path.read_text())]
    return ["\n".join(validation_table.table(rows) + [""]
                      + [f"- {line}" for line in validation_table.summary(rows)])]


def paper(page: Path) -> List[str]:
    import paper_projection
    return paper_projection.markdown(paper_projection.project(*PAPER_GPU), *PAPER_GPU)


def paper_adamw(page: Path) -> List[str]:
    import paper_projection
    return paper_projection.markdown_adamw(paper_projection.project_adamw(*PAPER_GPU),
                                           *PAPER_GPU)


def blocks() -> List[Block]:
    return [Block(PAGE, "planval", "bench-results/planval/defaults/", planval),
            Block(PAGE, "planval-adamw", ADAMW_VALIDATION + "/", planval_adamw),
            Block(PAGE, "validation", "bench-results/validation/", validation),
            Block(PAGE, "paper", "bench-results/profiles/", paper),
            Block(PAGE, "paper-adamw", "bench-results/profiles/", paper_adamw)]
