"""Rebuild the per-run sections of docs/benchmarks.md from bench-results/.

    .venv/bin/python scripts/bench_doc.py

Each run directory written by ``hvd-acp-bench --out DIR`` holds a
``results.md`` and a ``breakdown.png``; this script copies their tables,
command and picture into docs/benchmarks.md between the markers
``<!-- runs -->`` and ``<!-- end runs -->``, in the order of :data:`RUNS`,
so that every number on that page comes from a run that is in the
repository. The hand-written parts around the markers are kept.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parent.parent
START, END = "<!-- runs -->", "<!-- end runs -->"

#: (directory under bench-results/, section title), in page order.
RUNS = (
    ("resnet50_100mbit", "ResNet-50, 100 Mbit/s per node (S-SGD communication-bound)"),
    ("resnet50_10gbit", "ResNet-50, 10 Gbit/s per node (S-SGD compute-bound)"),
    ("bert-base_200mbit", "BERT-Base, 200 Mbit/s per node (S-SGD communication-bound)"),
    ("bert-base_10gbit", "BERT-Base, 10 Gbit/s per node (S-SGD compute-bound)"),
    ("bert-base_b32_75mbit",
     "BERT-Base, the paper's batch of 32 per rank, 75 Mbit/s per node (S-SGD communication-bound)"),
    ("resnet50_100mbit_cycle50", "ResNet-50, 100 Mbit/s per node, 50 ms Horovod cycle"),
    ("bert-base_200mbit_cycle50", "BERT-Base, 200 Mbit/s per node, 50 ms Horovod cycle"),
    ("resnet50_100mbit_default_cycle",
     "ResNet-50, 100 Mbit/s per node, Horovod's default 1 ms cycle"),
)


def run_section(results: Path, run: str, title: str, img: Path, doc: Path) -> List[str]:
    lines = (results / run / "results.md").read_text(encoding="utf-8").splitlines()
    heading = lines[0].lstrip("# ").strip()
    body = []
    for line in lines[1:]:
        if line.startswith("- ") or line.startswith("Topology:"):
            continue        # column notes and topology: once, in the hand-written part
        if line.strip() or (body and body[-1].strip()):
            body.append(line)       # no runs of blank lines where a line was dropped
    while body and not body[-1].strip():
        body.pop()
    picture = img / f"bench_{run.replace('-', '_')}.png"
    picture.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(results / run / "breakdown.png", picture)
    config = json.loads((results / run / "results.json").read_text(encoding="utf-8"))["config"]
    rel = picture.relative_to(doc.parent).as_posix()
    return [f"## {title}", "", f"{heading}; `bench-results/{run}/` ({config['command'].split()[0]} "
            f"outputs: results.json, results.md, breakdown.png, logs, per-rank raw results).",
            *body, "", f"![{title}]({rel})", ""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=REPO / "bench-results")
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    parser.add_argument("--img", type=Path, default=REPO / "docs" / "img")
    args = parser.parse_args(argv)
    text = args.doc.read_text(encoding="utf-8")
    if START not in text or END not in text:
        print(f"{args.doc}: markers {START} and {END} not found", file=sys.stderr)
        return 2
    sections = []
    for run, title in RUNS:
        if not (args.results / run / "results.md").exists():
            print(f"skipping {run}: no results.md", file=sys.stderr)
            continue
        sections += run_section(args.results, run, title, args.img, args.doc)
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    args.doc.write_text(head + START + "\n\n" + "\n".join(sections) + "\n" + END + tail,
                        encoding="utf-8")
    print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
