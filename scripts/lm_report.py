"""The AdamW study's tables, pages and pictures, from bench-results/lm_adam/.

    .venv/bin/python scripts/docgen.py --only lm_adam

Renders, from the ``--summary`` files of ``scripts/lm_study.py``'s runs
only (its recipes and runs are the registry this reads):

- :func:`section`: the block "lm-adam" of docs/convergence.md: per recipe,
  S-SGD's learning-rate sweep, every method at S-SGD's best rate, the
  frontier of bytes against final loss on the two 4-rank recipes, the time
  to a target loss on the benchmark's emulated links, and the commands;
- :func:`results_page`: the same as ``bench-results/lm_adam/results.md``,
  beside the runs;
- :func:`summary_table`: the block "lm:summary" of README.md and
  docs/guide.md, the defaults against S-SGD per recipe;
- :func:`figures`: the three pictures of the section.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from compare import shell_line  # noqa: E402
from docgen import Figure, relative  # noqa: E402
from lm_study import (ACP, BOTH25, CLOSE, FRONTIER, FRONTIER_RECIPES, PREVIOUS,  # noqa: E402
                      PSGD, RECIPES, RESULTS, SEEDS, SSGD, Recipe, Run, around, best_rate,
                      contenders, frontier_runs, frontier_settings, gap, method_runs,
                      own_best, read, recipe_of, seed_results, sweep_runs, tiebreak_runs)

#: The pictures of the section, under docs/img/.
SWEEP_IMG, FRONTIER_IMG, TIME_IMG = ("convergence_lm_adam.png", "convergence_lm_frontier.png",
                                     "convergence_lm_time.png")
#: The interpreter the commands are shown with: the one `make install` builds.
SHOWN_PYTHON = ".venv/bin/python"
#: The benchmark's runs of examples/train_lm.py's model at 4 ranks under AdamW
#: (``python -m benchmarks --model examples/train_lm.py:benchmark_model
#: --optimizer adamw``) on emulated links: each method's step time there.
LINK_RUNS = (("100 Mbit/s", REPO / "bench-results" / "train_lm_np4_100mbit" / "results.json"),
             ("1 Gbit/s", REPO / "bench-results" / "train_lm_np4_1gbit" / "results.json"))
#: Later runs on the same links, for methods the first ones did not run (a
#: method is timed by the first run of its link that has it).
LINK_EXTRA = {"100 Mbit/s": REPO / "bench-results" / "train_lm_np4_100mbit_int8" / "results.json",
              "1 Gbit/s": REPO / "bench-results" / "train_lm_np4_1gbit_int8" / "results.json"}
#: The recipe whose curves the link runs time.
TIMED_RECIPE = "train_lm_np4"
#: Frontier label -> the benchmark's method that times it. The benchmark's
#: DiLoCo runs H 500 (no outer step among its timed steps; :func:`link_step_s`
#: adds the outer all-reduce at the label's own H) and its DeMo-style k 8.
#: Its ACP-SGD ran P and Q in turn at a share 0.5.
TIMED = {SSGD: "ssgd", "S-SGD (fp16)": "ssgd-fp16", PREVIOUS: "acp", PSGD: "powersgd",
         "DiLoCo, H 10": "diloco", "DiLoCo, H 50": "diloco", "DeMo-style, k 8": "demo",
         "ACP-SGD, 8-bit factors, share 0.2": "acp-int8"}
#: The target of the time to a loss: S-SGD's mean final loss times this.
TARGET_FACTOR = 1.02


# ------------------------------------------------------------------- tables
def sweep_table(recipe: Recipe) -> List[str]:
    out = ["| peak learning rate | S-SGD | ACP-SGD (defaults) | gap | P and Q in turn "
           "(the previous defaults) | gap |", "|---|---|---|---|---|---|"]
    best = best_rate(recipe)
    cell = lambda r: "–" if r is None else f"{r['loss']:.4f}"  # noqa: E731
    for rate in recipe.rates:
        ssgd = read(Run(recipe, SSGD, rate, 0).summary)
        cells = []
        for label in (ACP, PREVIOUS):
            acp = read(Run(recipe, label, rate, 0).summary)
            shown = f"{gap(acp['loss'], ssgd['loss']):+.2f}%" if ssgd and acp else "–"
            cells.append(f"{cell(acp)} | {shown}")
        mark = " (S-SGD's best)" if rate == best else ""
        out.append(f"| {rate}{mark} | {cell(ssgd)} | {' | '.join(cells)} |")
    return out


def method_rows(recipe: Recipe, rate: str) -> List[dict]:
    """Per method at ``rate``: losses by seed, paired gaps to S-SGD, bytes."""
    ssgd = {seed: read(Run(recipe, SSGD, rate, seed).summary) for seed in SEEDS}
    rows = []
    for label in (*recipe.methods, *recipe.extra_methods):
        seeds = recipe.seeds if label in recipe.methods else (0,)
        result = seed_results(recipe, label, rate, seeds, ssgd)
        if result is None:
            continue
        found = result["found"]
        first = next(iter(found.values()))
        rows.append({"label": label, "seeds": list(found),
                     "losses": [value["loss"] for value in found.values()],
                     "gaps": result["gaps"], "bytes": first["bytes"], "dense": first["dense"]})
    return rows


def methods_table(recipe: Recipe, rate: str) -> List[str]:
    out = ["| method | seeds | final validation loss per seed | mean | vs S-SGD per seed | "
           "mean vs S-SGD | bytes per step per rank | share of S-SGD's |",
           "|---|---|---|---|---|---|---|---|"]
    for row in method_rows(recipe, rate):
        mean_gap = f"**{statistics.fmean(row['gaps']):+.2f}%**" if row["gaps"] else "–"
        out.append(
            f"| {row['label']} | {', '.join(map(str, row['seeds']))} | "
            f"{', '.join(f'{x:.4f}' for x in row['losses'])} | "
            f"{statistics.fmean(row['losses']):.4f} | "
            f"{', '.join(f'{g:+.2f}%' for g in row['gaps'])} | {mean_gap} | "
            f"{row['bytes'] / 1e3:,.1f} kB | {row['bytes'] / row['dense']:.3f} |")
    return out


def frontier_recipes() -> List[Recipe]:
    """The frontier's recipes whose sweep is complete."""
    return [r for r in RECIPES if r.key in FRONTIER_RECIPES and best_rate(r)]


def frontier_rows(recipe: Recipe, best: str) -> List[dict]:
    """Every setting of the frontier at its own best rate, with the methods of
    the main table: mean loss, paired gap to S-SGD, bytes sent and received."""
    ssgd = {seed: read(Run(recipe, SSGD, best, seed).summary) for seed in SEEDS}
    settings = [(label, (best,)) for label in recipe.methods]
    settings += [(label, around(recipe, best) if swept else (best,))
                 for label, _, swept in frontier_settings(recipe)]
    rows = []
    for label, rates in settings:
        rate = own_best(recipe, label, rates) if len(rates) > 1 else rates[0]
        if rate is None:
            continue
        result = seed_results(recipe, label, rate, SEEDS, ssgd)
        if result is None:
            continue
        found = list(result["found"].values())
        received = [value["received"] for value in found]
        rows.append({"label": label, "rate": rate, "seeds": list(result["found"]),
                     "loss": statistics.fmean(value["loss"] for value in found),
                     "gaps": result["gaps"],
                     "sent": (statistics.fmean(value["bytes"] for value in found)
                              / found[0]["dense"]),
                     "received": (statistics.fmean(received) / found[0]["dense"]
                                  if all(received) else None)})
    return rows


def frontier_report() -> List[str]:
    recipes = frontier_recipes()
    if not recipes:
        return []
    out = ["## The transformer frontier: bytes against final loss", "",
           "Every method a transformer user weighs, on the two 4-rank recipes above. "
           "DiLoCo and the DeMo-style method, whose updates are not AdamW's, at their own "
           "best of the rates around S-SGD's best (seed 0, then seeds 1 and 2 at that "
           "rate); S-SGD in fp16 and the compressors at S-SGD's best, since they swap in "
           "under the AdamW run a user tuned. "
           "Bytes are per step and rank as shares of S-SGD's fp32 gradient; the DeMo-style "
           "method's all-gather receives more than it sends (\"received\": what a rank "
           "was handed; Horovod's own optimizer does not count it). "
           "\"ACP-SGD, P and Q in turn, sign update\" (examples/train_lm.py only) is ACP-SGD "
           "carrying the DeMo-style method's error-fed momentum: a rank's residual takes "
           "each gradient and gives up what its factors send, which is that momentum with "
           "decay 1, compressed to ACP-SGD's alternating factors in its hooks and fused "
           "all-reduces; the matrices step by the sign of the averaged factors, the 1-D "
           "tensors by AdamW (`--update sign`, step-ahead off), its rate swept like the "
           "baselines'.", "",
           f"![Bytes against final loss](img/{FRONTIER_IMG})", ""]
    timed = []
    for recipe in recipes:
        best = best_rate(recipe)
        rows = frontier_rows(recipe, best)
        if recipe.key == TIMED_RECIPE:
            timed = rows
        out += [f"**{recipe.title}** (S-SGD's best rate {best})", "",
                "| method | rate | seeds | mean final loss | mean vs S-SGD | sent, share of "
                "S-SGD's | received |", "|---|---|---|---|---|---|---|"]
        for row in rows:
            shown = f"{statistics.fmean(row['gaps']):+.2f}%" if row["gaps"] else "–"
            received = "–" if row["received"] is None else f"{row['received']:.3f}"
            out.append(f"| {row['label']} | {row['rate']} | "
                       f"{', '.join(map(str, row['seeds']))} | {row['loss']:.4f} | {shown} | "
                       f"{row['sent']:.3f} | {received} |")
        out.append("")
    return out + time_to_target_report(timed)


# ------------------------------------------------------------ time to a loss
def mean_curve(recipe: Recipe, label: str, rate: str, seeds: Sequence[int]):
    """(steps, mean validation loss) of ``label`` at ``rate`` over ``seeds``,
    step 0 (the initial loss) first; None where a summary lacks the curve."""
    curves = []
    for seed in seeds:
        path = Run(recipe, label, rate, seed).summary
        summary = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        if "val_loss_per_epoch" not in summary or "step_per_epoch" not in summary:
            return None
        curves.append(([0, *summary["step_per_epoch"]],
                       [summary["initial_val_loss"], *summary["val_loss_per_epoch"]]))
    if not curves or any(c[0] != curves[0][0] for c in curves):
        return None
    return curves[0][0], [statistics.fmean(c[1][i] for c in curves)
                          for i in range(len(curves[0][0]))]


def steps_to(curve, target: float) -> Optional[float]:
    """The first step where the (linearly interpolated) curve reaches ``target``."""
    steps, losses = curve
    for i in range(1, len(steps)):
        if losses[i] <= target:
            a, b = losses[i - 1], losses[i]
            return steps[i - 1] + (steps[i] - steps[i - 1]) * (a - target) / (a - b)
    return None


def link_step_s(bench: dict, method: str, inner_steps: Optional[int],
                key: str = "step_s_median") -> Optional[float]:
    """A method's step on a benchmark run's link: its measured median (or the
    ``key`` of its interval, ``step_s_low``/``step_s_high``), plus for DiLoCo
    at ``inner_steps`` its outer all-reduce of every parameter over H
    (hvd_acp.plan's ring model at the link's rate)."""
    measured = bench.get("methods", {}).get(method, {}).get(key)
    if measured is None or inner_steps is None:
        return measured
    from hvd_acp.plan.cost import Network, allreduce_s
    cfg = bench["config"]
    outer = allreduce_s(float(bench["methods"][method]["gradient_bytes"]), cfg["np"],
                        Network(bandwidth_mbit=float(cfg["bandwidth_mbit"])))
    return measured + outer / inner_steps


def _seconds(steps: float, step: float, low: Optional[float], high: Optional[float],
             digits: int = 0) -> str:
    """``steps`` at ``step`` seconds each, with the interval ``[low, high]`` of the step."""
    text = f"{steps * step:.{digits}f} s"
    if low is None or high is None:
        return text
    return text + f" [{steps * low:.{digits}f}, {steps * high:.{digits}f}]"


def link_benches() -> List[tuple]:
    """(link name, results.json) of each of :data:`LINK_RUNS` that exists,
    with the methods of its :data:`LINK_EXTRA` run that it lacks."""
    found = []
    for name, path in LINK_RUNS:
        if not path.exists():
            continue
        bench = json.loads(path.read_text(encoding="utf-8"))
        extra = LINK_EXTRA.get(name)
        if extra is not None and extra.exists():
            later = json.loads(extra.read_text(encoding="utf-8"))["methods"]
            bench["methods"] = {**later, **bench["methods"]}
        found.append((name, bench))
    return found


def timed_curves(frontier: Sequence[dict]) -> List[tuple]:
    """(label, the benchmark's method, DiLoCo's H or None, mean curve) of each
    of :data:`TIMED` among ``frontier``'s rows that has its curves."""
    rows = {row["label"]: row for row in frontier}
    recipe = recipe_of(TIMED_RECIPE)
    flags = {label: flags for label, flags, _ in FRONTIER}
    found = []
    for label, method in TIMED.items():
        given = flags.get(label, ())
        inner = int(given[given.index("--diloco-h") + 1]) if "--diloco-h" in given else None
        row = rows.get(label)
        curve = None if row is None else mean_curve(recipe, label, row["rate"], row["seeds"])
        if curve is not None:
            found.append((label, method, inner, curve))
    return found


def time_to_target_report(frontier: Sequence[dict]) -> List[str]:
    """The curves of :data:`TIMED_RECIPE`'s ``frontier`` rows (:func:`frontier_rows`)
    timed by the link runs: time to :data:`TARGET_FACTOR` times S-SGD's final
    loss and time of the whole run, per link."""
    benches = link_benches()
    rows = {row["label"]: row for row in frontier}
    if not benches or SSGD not in rows:
        return []
    recipe = recipe_of(TIMED_RECIPE)
    target = rows[SSGD]["loss"] * TARGET_FACTOR
    out = ["### Time to a target loss on emulated links", "",
           f"{recipe.title}: each method's mean validation curve (the seeds and rate of "
           f"the table above) against its step time on the benchmark's emulated links "
           f"(`python -m benchmarks --model examples/train_lm.py:benchmark_model "
           f"--optimizer adamw --np 4 --batch-size 16`, the script's model and batch, "
           f"median step of the rounds; commands in each run's results.md). Target: "
           f"{TARGET_FACTOR:g} x S-SGD's mean final loss = {target:.4f}; the curves have a "
           f"point every 100 steps, linear between. DiLoCo's step is the benchmark's inner "
           f"step plus its outer all-reduce of every parameter over H (the planner's ring "
           f"model at the link's rate: the benchmark's DiLoCo reaches no outer step in its "
           f"timed steps); the DeMo-style method is timed at its default k 8 only; "
           f"ACP-SGD as the benchmark ran it, P and Q in turn (the previous defaults; "
           f"the defaults now send 1.2 times those bytes and were not timed here); the "
           f"8-bit factors at share 0.2 by the benchmark's `acp-int8` at `--matrix-rank "
           f"0.1`, in a later run on the same links (`bench-results/train_lm_np4_*_int8/`). In "
           f"brackets: the interval of the median step over the rounds, times the steps. "
           f"4 ranks share this host's 2 cores (the floor is one process alone), so the "
           f"times carry CPU scheduling as well as the link: read only differences whose "
           f"intervals do not overlap.", "",
           f"![Validation loss against time](img/{TIME_IMG})", "",
           "| method | " + " | ".join(f"{name}: step | to {target:.3f} | 1,000 steps"
                                      for name, _ in benches) + " |",
           "|---|" + "---|---|---|" * len(benches)]
    for label, method, inner, curve in timed_curves(frontier):
        steps, _ = curve
        reach = steps_to(curve, target)
        cells = []
        for _, bench in benches:
            step, low, high = (link_step_s(bench, method, inner, key)
                               for key in ("step_s_median", "step_s_low", "step_s_high"))
            if step is None:
                cells.append("– | – | –")
                continue
            cells.append(" | ".join((
                _seconds(1, step, low, high, digits=3),
                "not reached" if reach is None else _seconds(reach, step, low, high),
                _seconds(steps[-1], step, low, high))))
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out + [""]


# ------------------------------------------------------------------ summary
def summary_table(page: Path) -> List[str]:
    """Per recipe at S-SGD's best rate: ACP-SGD's defaults, P and Q in turn,
    both factors at Power-SGD's bytes and Power-SGD against S-SGD (mean of
    the seeds run), each row linking results.md from ``page``."""
    link = relative(RESULTS / "results.md", page)
    out = ["| recipe (AdamW) | S-SGD's best rate | ACP-SGD defaults vs S-SGD | "
           "bytes sent, share of S-SGD's | P and Q in turn (`both_factors=False`) | "
           "both factors at 0.25 | Power-SGD (its defaults) | bytes of these three | seeds |",
           "|---|---|---|---|---|---|---|---|---|"]
    for recipe in RECIPES:
        best = best_rate(recipe)
        if best is None:
            continue
        rows = {row["label"]: row for row in method_rows(recipe, best)}
        acp, previous, psgd = rows.get(ACP), rows.get(PREVIOUS), rows.get(PSGD)
        both25 = rows.get(BOTH25)
        if acp is None or not acp["gaps"]:
            continue
        cell = lambda row: "–" if row is None or not row["gaps"] else \
            f"{statistics.fmean(row['gaps']):+.2f}%"  # noqa: E731
        share = lambda row: "–" if row is None else \
            f"{row['bytes'] / row['dense']:.3f}"  # noqa: E731
        rate = (f"{best} (as at {recipe_of(recipe.rate_from).np} ranks)" if recipe.rate_from
                else best)
        out.append(f"| {recipe.title} ([runs]({link})) | {rate} | "
                   f"{cell(acp)} | {share(acp)} | {cell(previous)} | "
                   f"{cell(both25)} | {cell(psgd)} | "
                   f"{share(previous or both25 or psgd)} | "
                   f"{len(acp['gaps'])} |")
    return out


# ------------------------------------------------------------------- report
def versions_line() -> str:
    """The ranks' setting, and the versions the summaries record (no host's)."""
    versions = set()
    for path in sorted(RESULTS.glob("*/*.json")):
        config = json.loads(path.read_text(encoding="utf-8")).get("config") or {}
        if config.get("torch"):
            versions.add(f"torch {config['torch']}, Horovod {config.get('horovod')}")
    return ("Ranks on localhost, one thread each"
            + (f" ({'; '.join(sorted(versions))}, as the summaries record)" if versions else "")
            + ".")


#: Which step-ahead the runs took under Adam, and where the runs with the
#: earlier one are.
SHIFT_NOTE = (
    "Every ACP-SGD run here takes step-ahead's shift under Adam as the step Adam would take "
    "for the residual (\"Step-ahead under Adam\" above); the runs made with the shift "
    "divided by Adam's sqrt(v_hat) + eps are in bench-results/lm_adam_shift_sqrt_v_hat/. "
    "The frontier's sign update runs with step-ahead 0, which the shift does not touch.")


def report() -> List[str]:
    """The section's lines, its title first; links relative to docs/."""
    out = ["## Transformers trained with AdamW, at S-SGD's best learning rate", "",
           f"Generated by `scripts/docgen.py` from `bench-results/lm_adam/` (the runs: "
           f"`scripts/lm_study.py`). {versions_line()}",
           "", SHIFT_NOTE, "", f"![The LM recipes with AdamW](img/{SWEEP_IMG})", ""]
    commands = []
    for recipe in RECIPES:
        best = best_rate(recipe)
        if recipe.rate_from:
            out += [f"**{recipe.title}**: a check at another world size, at the best rate of "
                    f"{recipe_of(recipe.rate_from).title.split(',')[0].split(':')[0]} at "
                    f"{recipe_of(recipe.rate_from).np} ranks (no sweep of its own)", ""]
        else:
            out += [f"**{recipe.title}**: S-SGD's sweep (seed 0)", "", *sweep_table(recipe), ""]
        runs = sweep_runs(recipe) + tiebreak_runs(recipe)
        close = contenders(recipe) or []
        if len(close) > 1:
            means = []
            for rate in close:
                found = [read(Run(recipe, SSGD, rate, seed).summary) for seed in SEEDS]
                if all(found):
                    means.append(f"{rate}: {statistics.fmean(v['loss'] for v in found):.4f}")
            out += [f"S-SGD's seed-0 losses at {' and '.join(close)} are within {CLOSE:.0%} "
                    f"of each other: S-SGD ran on seeds {', '.join(map(str, SEEDS))} at each "
                    f"(mean {', '.join(means) or 'pending'}), and the lower mean is its best.",
                    ""]
        if best is not None:
            table = methods_table(recipe, best)
            if len(table) > 2:
                where = f"At {best}:" if recipe.rate_from else f"At {best}, S-SGD's best rate:"
                out += [where, "", *table, ""]
            runs += method_runs(recipe, best)
        if best is not None and recipe.key in FRONTIER_RECIPES:
            runs += frontier_runs(recipe, best, 0) + frontier_runs(recipe, best, 1)
        commands += [line for line in (shell_line(run.command(SHOWN_PYTHON)) for run in runs
                                       if run.summary.exists()) if line not in commands]
    out += frontier_report()
    out += ["<details><summary>Exact commands of these runs</summary>", "", "```sh",
            *commands, "```", "</details>"]
    return out


def section(page: Path) -> List[str]:
    """The block "lm-adam" of docs/convergence.md."""
    lines = report()
    if page.parent != REPO / "docs":
        lines = [line.replace("](img/", f"]({relative(REPO / 'docs' / 'img', page)}/")
                 for line in lines]
    return lines


def results_page() -> str:
    """bench-results/lm_adam/results.md: the section, beside the runs."""
    lines = section(RESULTS / "results.md")
    return "# " + lines[0].lstrip("# ") + "\n" + "\n".join(lines[1:]) + "\n"


# ------------------------------------------------------------------ figures
def draw_sweep(path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for recipe in RECIPES:
        for label, style in ((ACP, "-"), (PREVIOUS, ":")):
            rates, gaps = [], []
            for rate in recipe.rates:
                ssgd, acp = (read(Run(recipe, each, rate, 0).summary) for each in (SSGD, label))
                if ssgd and acp:
                    rates.append(float(rate))
                    gaps.append(gap(acp["loss"], ssgd["loss"]))
            if len(rates) > 1:
                drawn = recipe.short in axes[0].get_legend_handles_labels()[1]
                axes[0].plot(rates, gaps, marker="o", linestyle=style,
                             label=None if drawn else recipe.short,
                             color=f"C{RECIPES.index(recipe)}")
        best = best_rate(recipe)
        if best is None:
            continue
        for row in method_rows(recipe, best):
            if row["gaps"]:
                axes[1].scatter(row["bytes"] / row["dense"], statistics.fmean(row["gaps"]),
                                marker={SSGD: "s", ACP: "o"}.get(row["label"], "^"),
                                color=f"C{RECIPES.index(recipe)}",
                                label=recipe.short if row["label"] == ACP
                                else None)
    labels = (("peak learning rate (per rank)", "ACP-SGD vs S-SGD, seed 0 (%)",
               "across the S-SGD sweep (dotted: P and Q in turn)"),
              ("bytes per step, share of S-SGD's", "mean vs S-SGD over the seeds run (%)",
               "at S-SGD's best rate (o: the defaults, ^: other settings)"))
    for axis, (xlabel, ylabel, title) in zip(axes, labels):
        axis.axhline(0, color="grey", lw=0.8)
        axis.axhline(1, color="grey", lw=0.8, ls="--")
        axis.set_xscale("log")
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_frontier(path: Path) -> None:
    recipes = frontier_recipes()
    if not recipes:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(recipes), figsize=(6 * len(recipes), 4.5), squeeze=False)
    for axis, recipe in zip(axes[0], recipes):
        for row in frontier_rows(recipe, best_rate(recipe)):
            axis.scatter(row["sent"], row["loss"], s=30)
            axis.annotate(row["label"], (row["sent"], row["loss"]), fontsize=6,
                          xytext=(3, 3), textcoords="offset points")
        axis.set_xscale("log")
        axis.set_xlabel("bytes sent per step, share of S-SGD's fp32 gradient")
        axis.set_ylabel("final validation loss (mean of the seeds run)")
        axis.set_title(recipe.title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_time(path: Path) -> None:
    recipe = recipe_of(TIMED_RECIPE)
    best = best_rate(recipe)
    benches = link_benches()
    if best is None or not benches:
        return
    frontier = frontier_rows(recipe, best)
    rows = {row["label"]: row for row in frontier}
    if SSGD not in rows:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    target = rows[SSGD]["loss"] * TARGET_FACTOR
    fig, axes = plt.subplots(1, len(benches), figsize=(6 * len(benches), 4.2), squeeze=False)
    for label, method, inner, (steps, losses) in timed_curves(frontier):
        for (_, bench), axis in zip(benches, axes[0]):
            step = link_step_s(bench, method, inner)
            if step is not None:
                axis.plot([x * step for x in steps], losses, marker=".", label=label)
    for (name, _), axis in zip(benches, axes[0]):
        axis.axhline(target, color="grey", linestyle=":", linewidth=1)
        axis.set_ylim(top=min(2.6, axis.get_ylim()[1]))
        axis.set_xlabel(f"seconds at {name} (step time x steps)")
        axis.set_ylabel("validation loss (mean of the seeds)")
        axis.set_title(f"{recipe.title} on {name}", fontsize=9)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figures(img: Path) -> List[Figure]:
    """The section's pictures, for scripts/docgen.py."""
    source = "bench-results/lm_adam/"
    where = Path(img).resolve()
    where = where.relative_to(REPO) if where.is_relative_to(REPO) else where
    return [Figure(str(where / SWEEP_IMG), source, draw_sweep),
            Figure(str(where / FRONTIER_IMG), source, draw_frontier),
            Figure(str(where / TIME_IMG), source + " and bench-results/train_lm_np4_*/",
                   draw_time)]
