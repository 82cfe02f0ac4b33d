"""Every generated part of the docs, from the runs under bench-results/.

    .venv/bin/python scripts/docgen.py            # write every block, page and picture
    .venv/bin/python scripts/docgen.py --check    # fail if a page is not what it would write
    .venv/bin/python scripts/docgen.py --list     # which block comes from which results

A generated block of a page sits between ``<!-- NAME -->`` and
``<!-- end NAME -->`` (:func:`markers`); :func:`replace_section` puts the
rendered lines there, with a blank line on either side, and keeps the
hand-written text around the markers. :data:`BLOCKS` names every block: the
page, the marker's name, the results it is rendered from and the function
that renders it. :data:`PAGES` names the pages generated whole (the
``results.md`` beside a folder of training summaries), and :data:`FIGURES`
the pictures, which only the write mode draws. Every renderer reads files
under bench-results/ and nothing else (no clock, no host), so ``--check``
renders every block and page in memory and compares: a page differs when
its results changed and the page was not regenerated, or when the page was
edited between its markers. ``tests/test_docs.py`` runs the check.

The scripts that run the studies (``scripts/lm_study.py``,
``scripts/amp_convergence.py``) and the benchmark's ``scripts/bench_doc.py``
call :func:`write` with their own blocks when they are done.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
for _path in (str(REPO), str(SCRIPTS)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
RESULTS = REPO / "bench-results"
IMG = REPO / "docs" / "img"
#: What a renderer that found no results writes in its block.
NO_RUNS = "No runs in bench-results/ yet."


def markers(name: str) -> Tuple[str, str]:
    """The two comments around the generated block ``name``."""
    return f"<!-- {name} -->", f"<!-- end {name} -->"


def replace_between(text: str, pair: Tuple[str, str], lines: Sequence[str],
                    where: object = "the page") -> str:
    """``text`` with what lies between the comments ``pair`` replaced by ``lines``.

    Raises:
        SystemExit: a marker is missing (the page names ``where``).
    """
    start, end = pair
    if start not in text or end not in text:
        raise SystemExit(f"{where}: markers {start} and {end} not found")
    head, rest = text.split(start, 1)
    tail = rest.split(end, 1)[1]
    return head + start + "\n\n" + "\n".join(lines) + "\n\n" + end + tail


def replace_section(text: str, name: str, lines: Sequence[str],
                    where: object = "the page") -> str:
    """``text`` with the generated block ``name`` replaced by ``lines``."""
    return replace_between(text, markers(name), lines, where)


def relative(path: Path, page: Path) -> str:
    """``path`` as a link from ``page``."""
    return Path(os.path.relpath(path, page.parent)).as_posix()


@dataclasses.dataclass(frozen=True)
class Block:
    """A generated block: ``render(page)`` gives its lines, read from ``source``.

    Attributes:
        page: the page, relative to the repository.
        name: the marker's name (:func:`markers`).
        source: the results it is rendered from, relative to the repository.
        render: the page's absolute path -> the block's lines (links made
            relative to that page).
    """

    page: str
    name: str
    source: str
    render: Callable[[Path], List[str]]


@dataclasses.dataclass(frozen=True)
class Page:
    """A file generated whole: ``render()`` gives its text, read from ``source``."""

    path: str
    source: str
    render: Callable[[], str]


@dataclasses.dataclass(frozen=True)
class Figure:
    """A picture ``draw(path)`` draws from ``source`` (written, never checked)."""

    path: str
    source: str
    draw: Callable[[Path], None]


def _registry():
    # The renderers import the benchmark's report code, the studies' recipes
    # and matplotlib: only when a block is rendered.
    import amp_convergence
    import bench_doc
    import cnn_report
    import lm_int8_table
    import lm_report
    import planner_report

    bench = bench_doc.blocks(RESULTS)
    blocks = (
        Block("README.md", "cnn:summary", "bench-results/autorank/", cnn_report.summary_table),
        Block("README.md", "lm:summary", "bench-results/lm_adam/", lm_report.summary_table),
        *(b for b in bench if b.page == "README.md"),
        Block("docs/guide.md", "cnn:summary", "bench-results/autorank/",
              cnn_report.summary_table),
        Block("docs/guide.md", "lm:summary", "bench-results/lm_adam/", lm_report.summary_table),
        *(b for b in bench if b.page != "README.md"),
        Block("docs/convergence.md", "cnn:summary", "bench-results/autorank/",
              cnn_report.summary_table),
        Block("docs/convergence.md", "autorank", "bench-results/autorank/",
              cnn_report.autorank_tables),
        Block("docs/convergence.md", "lm-adam", "bench-results/lm_adam/", lm_report.section),
        Block("docs/convergence.md", "lm-int8", "bench-results/lm_int8/",
              lm_int8_table.section),
        Block("docs/convergence.md", "lm-int8-seeds", "bench-results/lm_int8_seeds/",
              lm_int8_table.seeds_section),
        Block("docs/convergence.md", "amp", "bench-results/amp/", amp_convergence.section),
        *planner_report.blocks(),
    )
    pages = (
        Page("bench-results/autorank/results.md", "bench-results/autorank/",
             cnn_report.results_page),
        Page("bench-results/lm_adam/results.md", "bench-results/lm_adam/",
             lm_report.results_page),
        Page("bench-results/amp/results.md", "bench-results/amp/", amp_convergence.results_page),
        Page("bench-results/lm_int8/results.md", "bench-results/lm_int8/",
             lm_int8_table.results_page),
        Page("bench-results/lm_int8_seeds/results.md", "bench-results/lm_int8_seeds/",
             lm_int8_table.seeds_page),
    )
    figures = (*bench_doc.figures(RESULTS, IMG), *lm_report.figures(IMG))
    return blocks, pages, figures


_CACHE: Dict[str, tuple] = {}


def registry() -> Tuple[Tuple[Block, ...], Tuple[Page, ...], Tuple[Figure, ...]]:
    """(:data:`BLOCKS`, :data:`PAGES`, :data:`FIGURES`), built once."""
    if "all" not in _CACHE:
        _CACHE["all"] = _registry()
    return _CACHE["all"]


def render(blocks: Iterable[Block] = (), pages: Iterable[Page] = (),
           root: Path = REPO) -> Dict[Path, str]:
    """The new text of every page ``blocks`` and ``pages`` touch, in memory."""
    out: Dict[Path, str] = {}
    for block in blocks:
        path = root / block.page
        text = out.get(path)
        if text is None:
            text = path.read_text(encoding="utf-8")
        out[path] = replace_section(text, block.name, block.render(path), path)
    for page in pages:
        out[root / page.path] = page.render()
    return out


def differences(rendered: Dict[Path, str]) -> List[str]:
    """A unified diff (a few lines) per page whose file is not ``rendered``."""
    found = []
    for path, text in rendered.items():
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        if old != text:
            diff = difflib.unified_diff(old.splitlines(), text.splitlines(), "on disk",
                                        "generated", n=0, lineterm="")
            found.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:\n"
                         + "\n".join(list(diff)[2:14]))
    return found


def write(blocks: Iterable[Block] = (), pages: Iterable[Page] = (),
          figures: Iterable[Figure] = ()) -> List[Path]:
    """Write the blocks, pages and pictures; the paths whose text changed."""
    changed = []
    for path, text in render(blocks, pages).items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    for figure in figures:
        target = REPO / figure.path
        target.parent.mkdir(parents=True, exist_ok=True)
        figure.draw(target)
    return changed


def check() -> List[str]:
    """What :func:`differences` finds for every block and page of the registry."""
    blocks, pages, _ = registry()
    return differences(render(blocks, pages))


def select(names: Optional[Sequence[str]]):
    """The registry's entries whose page, marker name or source contains one of
    ``names`` (all of it without names)."""
    blocks, pages, figures = registry()
    if not names:
        return blocks, pages, figures
    hit = lambda *fields: any(n in f for n in names for f in fields)  # noqa: E731
    return (tuple(b for b in blocks if hit(b.page, b.name, b.source)),
            tuple(p for p in pages if hit(p.path, p.source)),
            tuple(f for f in figures if hit(f.path, f.source)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="render in memory and exit 1 if any page differs")
    parser.add_argument("--list", action="store_true", help="print the registry")
    parser.add_argument("--only", nargs="+", metavar="TEXT",
                        help="only the entries whose page, block or source contains TEXT "
                             "(e.g. lm_adam, docs/benchmarks.md)")
    parser.add_argument("--no-figures", action="store_true", help="write no pictures")
    args = parser.parse_args(argv)
    blocks, pages, figures = select(args.only)
    if args.list:
        for b in blocks:
            print(f"{b.page}  <!-- {b.name} -->  from {b.source}")
        for p in pages:
            print(f"{p.path}  (whole page)  from {p.source}")
        for f in figures:
            print(f"{f.path}  (picture)  from {f.source}")
        return 0
    if args.check:
        found = differences(render(blocks, pages))
        for text in found:
            print(text, file=sys.stderr)
        if found:
            print(f"{len(found)} page(s) differ from what scripts/docgen.py writes: run it",
                  file=sys.stderr)
            return 1
        print(f"{len(blocks)} blocks and {len(pages)} pages are current")
        return 0
    for path in write(blocks, pages, () if args.no_figures else figures):
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    # One module, whether run or imported (the renderers import it by name).
    import docgen
    sys.exit(docgen.main())
