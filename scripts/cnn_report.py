"""CNNs trained with SGD at the defaults, and the matrix-rank study, from bench-results/autorank/.

The folder holds the ``--summary`` files of the matrix-rank study
(``<study>__<setting>_s<seed>.json``; the commands are in
docs/convergence.md, "Choosing the rank"), among them the digits CNN and a
BatchNorm ResNet at 8 ranks with Horovod's learning-rate scaling, S-SGD and
ACP-SGD at the defaults for SGD (rank 4), on 3 seeds. Renders, for
scripts/docgen.py:

- :func:`summary_table`: the block "cnn:summary" of README.md, docs/guide.md
  and docs/convergence.md, the defaults against S-SGD per CNN;
- :func:`autorank_tables`: the block "autorank" of docs/convergence.md,
  ``scripts/rank_report.py``'s tables of every study;
- :func:`results_page`: both, as ``bench-results/autorank/results.md``.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import rank_report  # noqa: E402
from docgen import relative  # noqa: E402

RESULTS = REPO / "bench-results" / "autorank"
SSGD, DEFAULTS = "S-SGD", "ACP-SGD, rank 4 (default)"
#: (study, the recipe as the table names it): the CNNs trained with SGD.
CNNS = (("cnn", "examples/train.py: the digits CNN, 8 ranks"),
        ("resnet", "examples/train.py --arch resnet: a BatchNorm ResNet on the digits, "
                   "8 ranks"))


def summary_table(page: Path) -> List[str]:
    """Per CNN: S-SGD's and the defaults' mean final test accuracy over the
    seeds both ran, their paired difference and the share of S-SGD's bytes."""
    link = relative(RESULTS / "results.md", page)
    found = rank_report.load(RESULTS)
    out = ["| recipe (SGD, momentum 0.9, learning rate scaled by the ranks) | steps "
           "| S-SGD: final test accuracy | ACP-SGD defaults | ACP-SGD vs S-SGD "
           "| bytes sent, share of S-SGD's | seeds |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for study, title in CNNS:
        runs = found.get(study, {})
        ssgd, acp = runs.get(SSGD, {}), runs.get(DEFAULTS, {})
        seeds = sorted(set(ssgd) & set(acp))
        if not seeds:
            continue
        ref = [100 * ssgd[s]["test_accuracy"] for s in seeds]
        ours = [100 * acp[s]["test_accuracy"] for s in seeds]
        share = (statistics.fmean(rank_report.bytes_per_step(acp[s]) for s in seeds)
                 / statistics.fmean(rank_report.bytes_per_step(ssgd[s]) for s in seeds))
        out.append(f"| {title} ([runs]({link})) | {acp[seeds[0]]['steps']} "
                   f"| {statistics.fmean(ref):.2f}% | {statistics.fmean(ours):.2f}% "
                   f"| {statistics.fmean(o - r for o, r in zip(ours, ref)):+.2f} points "
                   f"| {share:.3f} | {len(seeds)} |")
    if len(out) == 2:
        return ["No runs in bench-results/autorank/ yet."]
    return out


def autorank_tables(page: Path) -> List[str]:
    """Every study of :data:`rank_report.STUDIES` found, as rank_report prints it."""
    found = rank_report.load(RESULTS)
    out = []
    for study, title, metric, lower, reference in rank_report.STUDIES:
        if study in found:
            out += [rank_report.table(title, found[study], metric, lower, reference), ""]
    return out[:-1] or ["No runs in bench-results/autorank/ yet."]


def results_page() -> str:
    """bench-results/autorank/results.md."""
    page = RESULTS / "results.md"
    return "\n".join([
        "# The CNNs at the SGD defaults, and the matrix-rank study", "",
        "Made by `scripts/docgen.py` from the summaries in this folder "
        "(`<study>__<setting>_s<seed>.json`); the commands that made them are in "
        "docs/convergence.md, \"Choosing the rank\".", "",
        *summary_table(page), "", *autorank_tables(page)]) + "\n"
