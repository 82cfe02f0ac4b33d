"""Docs that cannot drift from the runs and the code they describe.

- Every generated block and page is what scripts/docgen.py writes from
  bench-results/ today (its --check, in process).
- Every figure of README.md and docs/*.md (docs/archive/ excepted) is in a
  generated block or beside a link to the run it comes from
  (:data:`FIGURE_IN_PROSE` says what a figure is, :func:`prose_units`
  where "beside" ends).
- Every figure quoted beside a link to a run's file in bench-results/ is in
  that file (README.md, docs/ddp.md); a figure with an interval cites one.
- docs/algorithm.md's layout table names every module of the package.
- One advice on the rank everywhere, matching the default.
"""
import re
import sys
from pathlib import Path

import pytest
import torch

from hvd_acp.settings import RANK_ADVICE, Settings

REPO = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/ddp.md")
#: A link to a run's page: ``[run](bench-results/<run>/results.md)``.
RUN_LINK = re.compile(r"\]\(((?:\.\./)?bench-results/[^)\s]+\.md)\)")
#: A ratio with its interval: ``3.19x [2.79, 3.28]``.
RATIO = re.compile(r"\d+\.\d+x \[\d+\.\d+, \d+\.\d+\]")
#: A decimal figure, not part of a version or a path.
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+(?!\d|\.\d)")


@pytest.fixture(scope="module")
def scripts():
    """scripts/ importable: the generator and the studies' registries."""
    sys.path.insert(0, str(REPO / "scripts"))
    import docgen
    import lm_report
    import lm_study
    yield type("Scripts", (), {"docgen": docgen, "lm_report": lm_report, "lm_study": lm_study})
    sys.path.remove(str(REPO / "scripts"))


def units(text: str):
    """Each paragraph, and each table row on its own (a row cites its own run)."""
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if line.strip()]
        if lines and all(line.lstrip().startswith("|") for line in lines):
            yield from lines
        else:
            yield " ".join(lines)


def unbacked_figures(page: Path):
    """(figure, where) for every figure a page quotes that the run it cites lacks."""
    problems = []
    for unit in units(page.read_text(encoding="utf-8")):
        cited = RUN_LINK.findall(unit)
        if not cited:
            problems += [(ratio, unit) for ratio in RATIO.findall(unit)]
            continue
        sources = "\n".join((page.parent / link).read_text(encoding="utf-8") for link in cited)
        problems += [(figure, unit) for figure in FIGURE.findall(unit)
                     if figure not in sources]
    return problems


#: A figure: a number with a unit of measurement after it (``%``, ``x`` for
#: a ratio, ``s``, ``ms``, ``min``, ``B``, ``kB``, ``MB``, ``GB``, ``points``,
#: ``pt``), or a decimal with three digits or more after the point (a loss,
#: a share of bytes, seconds). Not part of a word, a version or a path.
#: Settings are written without a unit (rank 4, share 0.3, momentum 0.9,
#: a 100 Mbit/s link) or as code, and are not figures.
FIGURE_IN_PROSE = re.compile(
    r"(?<![\w.,:/-])(?:\d[\d,]*(?:\.\d+)?(?:%|x\b|\s?(?:s|ms|min|B|kB|MB|GB|points|pt)\b)"
    r"|\d+\.\d{3,}(?![\d.]))")
#: A Markdown link's target.
LINK_TARGET = re.compile(r"\]\(([^)\s]+)\)")
#: What is no prose: fenced code, HTML comments, inline code, arXiv numbers.
NOT_PROSE = (re.compile(r"^(```|~~~).*?^\1", re.S | re.M), re.compile(r"<!--.*?-->", re.S),
             re.compile(r"`[^`\n]*`"), re.compile(r"arXiv[: ]\d{4}\.\d{4,5}"))
LIST_ITEM = re.compile(r"^ ?(?:[-*+]|\d+\.) ")


def without_blocks(text: str, names) -> str:
    """``text`` with the generated blocks ``names`` emptied (markers kept)."""
    for name in names:
        start, end = f"<!-- {name} -->", f"<!-- end {name} -->"
        if start in text:
            head, rest = text.split(start, 1)
            text = head + "\n\n" + rest.split(end, 1)[1]
    return text


def prose_units(text: str):
    """(unit, caption) for each unit of a page's prose: a paragraph, a list item
    with its nested items, a heading, a table row (whose caption is the
    paragraph just above its table; for anything else the caption is empty).
    A unit's figures are backed by a run link in the unit or its caption."""
    for pattern in NOT_PROSE[:2]:
        text = pattern.sub("\n", text)
    caption = ""
    for block in re.split(r"\n[ \t]*\n", text):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines:
            continue
        if all(line.lstrip().startswith("|") for line in lines):
            yield from ((line, caption) for line in lines)
            caption = ""
            continue
        if all(line.startswith("    ") for line in lines) and not LIST_ITEM.match(
                lines[0].lstrip()):
            continue                                        # an indented code block
        units, current = [], []
        for line in lines:
            if (LIST_ITEM.match(line) or line.startswith("#")) and current:
                units.append(current)
                current = []
            current.append(line.strip())
        units.append(current)
        yield from ((" ".join(unit), "") for unit in units)
        caption = " ".join(lines)


def run_links(page: Path, unit: str, root: Path = REPO):
    """The links of ``unit`` that lead to a file or folder under ``root``'s bench-results/."""
    results = (root / "bench-results").resolve()
    found = []
    for target in LINK_TARGET.findall(unit):
        path = (page.parent / target.split("#")[0]).resolve()
        if path.is_relative_to(results) and path.exists():
            found.append(target)
    return found


def figures_without_a_run(page: Path, generated=(), root: Path = REPO):
    """(figure, unit) for every figure of ``page`` outside the generated blocks
    ``generated`` that neither its unit nor its table's caption links a run of
    ``root`` for."""
    problems = []
    for unit, caption in prose_units(without_blocks(page.read_text(encoding="utf-8"),
                                                    generated)):
        bare = LINK_TARGET.sub("]", unit)
        for pattern in NOT_PROSE[2:]:
            bare = pattern.sub(" ", bare)
        found = FIGURE_IN_PROSE.findall(bare)
        if found and not run_links(page, unit, root) and not run_links(page, caption, root):
            problems += [(figure, unit[:120]) for figure in found]
    return problems


FIGURE_PAGES = ("README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")))


@pytest.mark.parametrize("page", FIGURE_PAGES)
def test_every_figure_is_generated_or_links_its_run(scripts, page):
    blocks, _, _ = scripts.docgen.registry()
    mine = [b for b in blocks if b.page == page]
    # The blocks skipped below are those the generator renders as they are now.
    assert scripts.docgen.differences(scripts.docgen.render(mine)) == [], \
        f"{page}: run scripts/docgen.py"
    problems = figures_without_a_run(REPO / page, [b.name for b in mine])
    assert problems == [], "\n".join(f"{figure}: {unit}" for figure, unit in problems)


def test_a_figure_without_its_run_is_caught(tmp_path):
    run = tmp_path / "bench-results" / "some_run"
    run.mkdir(parents=True)
    (run / "results.md").write_text("| 3.19x |\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "page.md"
    page.write_text(
        "# Title, 2 ranks at 100 Mbit/s\n\n"
        "Rank 4, share 0.3, momentum 0.9 and `step_ahead=0.25`: settings, no figure.\n\n"
        "ACP-SGD is 3.19x faster ([run](../bench-results/some_run/results.md)).\n\n"
        "ACP-SGD is 3.19x faster ([run](../bench-results/no_such_run/results.md)).\n\n"
        "- a list item: 1.5123 nats,\n  continued\n- the next: 12.5 MB a step\n\n"
        "Measured ([runs](../bench-results/some_run/)):\n\n| a | 98.22% |\n| b | 0.210 |\n\n"
        "| no caption | 4 s |\n\n"
        "```sh\nrun --lr 0.025 # 2.5x\n```\n\n"
        "<!-- made -->\n\n| generated | 9.99% |\n\n<!-- end made -->\n\n"
        "Version 2.13.0, arXiv:2306.08881, `0.125 s`; within 1% of S-SGD.\n")
    found = [figure for figure, _ in figures_without_a_run(page, ["made"], tmp_path)]
    assert found == ["3.19x", "1.5123", "12.5 MB", "4 s", "1%"]
    assert "9.99%" in [f for f, _ in figures_without_a_run(page, (), tmp_path)]


@pytest.mark.parametrize("page", PAGES)
def test_every_quoted_figure_is_in_the_run_it_cites(page):
    assert unbacked_figures(REPO / page) == []


def test_a_figure_missing_from_its_run_is_caught(tmp_path):
    run = tmp_path / "bench-results" / "some_run"
    run.mkdir(parents=True)
    (run / "results.md").write_text("| ACP-SGD against S-SGD | 3.19x [2.79, 3.28] | faster |\n")
    page = tmp_path / "README.md"
    page.write_text("| net ([run](bench-results/some_run/results.md)) | 3.19x [2.79, 3.28] |\n\n"
                    "| net ([run](bench-results/some_run/results.md)) | 4.79x [4.54, 4.99] |\n\n"
                    "ACP-SGD is 6.83x [6.62, 7.08] faster, says no run.\n")
    found = [figure for figure, _ in unbacked_figures(page)]
    assert found == ["4.79", "4.54", "4.99", "6.83x [6.62, 7.08]"]


def test_every_generated_block_is_current(scripts):
    """scripts/docgen.py --check, in process: every block of every page and
    every generated results.md is what the generator renders today."""
    blocks, pages, _ = scripts.docgen.registry()
    assert {b.page for b in blocks} >= {"README.md", "docs/guide.md", "docs/ddp.md",
                                        "docs/benchmarks.md", "docs/convergence.md",
                                        "docs/planner.md"}
    rendered = scripts.docgen.render(blocks, pages)
    assert not any(scripts.docgen.NO_RUNS in text for text in rendered.values())
    assert scripts.docgen.differences(rendered) == [], "run scripts/docgen.py"


def test_the_check_catches_a_block_edited_by_hand(scripts, tmp_path):
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- demo -->\n\n| a | 1.50 |\n\n<!-- end demo -->\nend\n")
    block = scripts.docgen.Block(str(page), "demo", "nowhere", lambda path: ["| a | 1.50 |"])
    assert scripts.docgen.differences(scripts.docgen.render([block])) == []
    page.write_text(page.read_text().replace("1.50", "1.55"))
    assert len(scripts.docgen.differences(scripts.docgen.render([block]))) == 1
    with pytest.raises(SystemExit, match="<!-- other -->"):
        scripts.docgen.replace_section(page.read_text(), "other", [], page)


def test_time_to_a_target_interpolates_and_adds_dilocos_outer_step(scripts):
    from hvd_acp.plan.cost import Network, allreduce_s
    report = scripts.lm_report
    curve = ([0, 100, 200], [5.0, 2.0, 1.0])
    assert report.steps_to(curve, 1.5) == pytest.approx(150.0)
    assert report.steps_to(curve, 2.0) == pytest.approx(100.0)
    assert report.steps_to(curve, 0.5) is None
    bench = {"config": {"np": 4, "bandwidth_mbit": 100.0},
             "methods": {"diloco": {"step_s_median": 0.2, "gradient_bytes": 1e6},
                         "acp": {"step_s_median": 0.1, "gradient_bytes": 1e6}}}
    assert report.link_step_s(bench, "acp", None) == 0.1
    assert report.link_step_s(bench, "ssgd", None) is None
    outer = allreduce_s(1e6, 4, Network(bandwidth_mbit=100.0))
    assert outer > 0.1          # 1 MB over a 100 Mbit/s ring of 4
    assert report.link_step_s(bench, "diloco", 10) == pytest.approx(0.2 + outer / 10)


def test_the_layout_table_names_every_module():
    table = (REPO / "docs" / "algorithm.md").read_text(encoding="utf-8").split("## Layout", 1)[1]
    package = REPO / "hvd_acp"
    modules = [f"hvd_acp/{p.name}" for p in package.glob("*.py") if p.name != "__init__.py"]
    modules += [f"hvd_acp/{p.name}/" for p in package.iterdir()
                if p.is_dir() and (p / "__init__.py").exists()]
    missing = [m for m in sorted(modules) if f"`{m}`" not in table]
    assert not missing, missing


def normalized(path):
    return " ".join(path.read_text(encoding="utf-8").split())


@pytest.mark.parametrize("path", ["README.md", "docs/guide.md", "docs/api.md", "docs/ddp.md"])
def test_one_rank_advice_everywhere(path):
    text = normalized(REPO / path)
    assert RANK_ADVICE in text, path
    # No other advice on the rank (the paper's settings quoted as advice).
    assert not re.search(r"\d+ suits CNNs|search 1, 2, 4", text), path


def test_the_rank_advice_matches_the_defaults():
    weight = torch.zeros(2, 2, requires_grad=True)
    sgd = Settings().resolve(torch.optim.SGD([weight], lr=0.1, momentum=0.9))
    adam = Settings().resolve(torch.optim.AdamW([weight], lr=1e-3))
    assert f"rank {sgd.matrix_rank} for SGD-like optimizers" in RANK_ADVICE
    assert adam.matrix_rank == 0.3 and "0.3 of each matrix's smaller side" in RANK_ADVICE
    assert adam.both_factors and not sgd.both_factors and "both factors" in RANK_ADVICE
    assert adam.fp16_wire and not sgd.fp16_wire and "fp16 on the wire" in RANK_ADVICE
    assert RANK_ADVICE in " ".join(Settings.__doc__.split())


def test_every_recipe_runs_its_own_flags(scripts):
    """A label both a recipe and the frontier name (such as "ACP-SGD, rank 4")
    runs with the recipe's flags: scripts/trainer_lm.py takes --method, the
    frontier's Horovod scripts --optimizer."""
    lm_study = scripts.lm_study
    for recipe in lm_study.RECIPES:
        for label, flags in {**recipe.extra_methods, **recipe.methods}.items():
            run = lm_study.Run(recipe, label, "1e-3", 0)
            assert run.flags == flags, (recipe.key, label)
            assert set(run.command()) >= set(flags)
    trainer = lm_study.recipe_of("trainer_lm_np2")
    assert all("--optimizer" not in lm_study.Run(trainer, label, "1e-3", 0).command()
               for label in {**trainer.extra_methods, **trainer.methods})
