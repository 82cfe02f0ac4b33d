"""Transformers trained with AdamW, compared where S-SGD trains best.

    .venv/bin/python scripts/lm_study.py                  # run what is missing, write the doc
    .venv/bin/python scripts/lm_study.py --report-only    # the doc from bench-results/lm_adam

Four recipes, each a transformer language model trained with AdamW, linear
warm-up and cosine decay, as its users train it:

- ``examples/train_lm.py`` at 2 and at 4 ranks (``horovodrun``);
- ``scripts/user_lm.py`` at 4 ranks (``horovodrun``, 400 steps): a GPT
  written the way such scripts are, with clipping through ``synchronize()``;
- ``scripts/trainer_lm.py`` at 2 ranks (``torchrun``): GPT-2 from a config,
  trained by the Hugging Face ``Trainer``, ACP-SGD through ``register_acp``.

First, S-SGD at each learning rate of the recipe's sweep (seed 0), with
ACP-SGD at its defaults beside it at the same rates; then, at the rate
where S-SGD's loss is lowest, every method on seeds 0, 1 and 2. The runs
are interleaved by seed so that a change in the machine's load hits every
method alike. Each run's ``--summary`` JSON is kept under
``bench-results/lm_adam/<recipe>/``; the section "lm-adam" of
docs/convergence.md (tables, figures, commands) and its copy
``bench-results/lm_adam/results.md`` are built from those files only.
``--frontier`` adds, on the two 4-rank recipes, S-SGD in fp16, more ranks of
ACP-SGD, DiLoCo and the DeMo-style method, each at its best rate.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from compare import END_MARKER, launch, shell_line  # noqa: E402

RESULTS = REPO / "bench-results" / "lm_adam"
DOC = REPO / "docs" / "convergence.md"
SECTION = "lm-adam"
SEEDS = (0, 1, 2)
SSGD = "S-SGD"
ACP = "ACP-SGD (defaults)"
PSGD = "Power-SGD (defaults)"
#: Both factors at Power-SGD's default share: the same bytes as it.
BOTH25 = "ACP-SGD, both factors, share 0.25 (Power-SGD's bytes)"
#: ACP-SGD's defaults for adaptive optimizers before both factors: P and Q in
#: turn at a share 0.5 of each matrix (the same bytes).
PREVIOUS = "ACP-SGD, P and Q in turn (the previous defaults)"
IN_TURN = ("--both-factors", "off")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One training script at one world size, with its S-SGD learning-rate sweep.

    Attributes:
        methods: row label -> the flags that select the method (the same
            script, the same flags otherwise).
        extra_methods: row label -> flags, run at the best rate on seed 0
            only: settings shown beside the defaults.
        rate_from: a check at another world size: no sweep of its own, the
            methods run at the best rate of the recipe with this key.
        seeds: the seeds of the methods at the best rate.
    """

    key: str
    title: str
    script: str
    np: int
    launcher: str
    rates: Tuple[str, ...]
    methods: Dict[str, Tuple[str, ...]]
    extra_methods: Dict[str, Tuple[str, ...]] = dataclasses.field(default_factory=dict)
    args: Tuple[str, ...] = ()
    rate_from: Optional[str] = None
    seeds: Tuple[int, ...] = SEEDS

    @property
    def short(self) -> str:
        """The script and its world size, for a figure's legend."""
        return f"{Path(self.script).name}, {self.np} ranks"

    def command(self, flags: Sequence[str], rate: str, seed: int, summary: Path) -> List[str]:
        python = str(Path(sys.executable).relative_to(REPO)) \
            if Path(sys.executable).is_relative_to(REPO) else sys.executable
        train = [self.script, *flags, *self.args, "--lr", rate, "--seed", str(seed),
                 "--summary", str(summary.relative_to(REPO))]
        if self.launcher == "torchrun":
            return [str(Path(python).with_name("torchrun")), "--nproc-per-node", str(self.np),
                    *train]
        return [str(Path(python).with_name("horovodrun")), "-np", str(self.np), "-H",
                f"localhost:{self.np}", "--gloo", python, *train]


def horovod_methods(**extra) -> Dict[str, Tuple[str, ...]]:
    return {SSGD: ("--optimizer", "ssgd"), ACP: ("--optimizer", "acp"),
            PREVIOUS: ("--optimizer", "acp", *IN_TURN),
            BOTH25: ("--optimizer", "acp", "--matrix-rank", "0.25"),
            PSGD: ("--optimizer", "powersgd"), **extra}


#: The settings that were the advice before the defaults depended on the optimizer.
EARLIER = {"ACP-SGD, rank 4 (the SGD default)": ("--optimizer", "acp", "--matrix-rank", "4",
                                                 *IN_TURN),
           "ACP-SGD, rank 32": ("--optimizer", "acp", "--matrix-rank", "32", *IN_TURN)}
#: The previous defaults less one of their parts (seed 0 at the best rate).
ABLATION = {"ACP-SGD, P and Q in turn, fp32 on the wire": ("--optimizer", "acp", "--fp16-wire",
                                                           "off", *IN_TURN),
            "ACP-SGD, P and Q in turn, step-ahead 0": ("--optimizer", "acp", "--step-ahead", "0",
                                                       *IN_TURN)}

RECIPES = (
    Recipe("train_lm_np2", "examples/train_lm.py, 2 ranks (1,000 steps)",
           "examples/train_lm.py", 2, "horovodrun", ("1e-3", "2e-3", "4e-3", "8e-3"),
           horovod_methods(), EARLIER, ("--no-progress",)),
    Recipe("train_lm_np4", "examples/train_lm.py, 4 ranks (1,000 steps)",
           "examples/train_lm.py", 4, "horovodrun", ("1e-3", "2e-3", "4e-3"),
           horovod_methods(), EARLIER, ("--no-progress",)),
    Recipe("user_lm_np4", "scripts/user_lm.py, 4 ranks (400 steps)",
           "scripts/user_lm.py", 4, "horovodrun", ("3e-3", "6e-3", "1e-2", "1.5e-2"),
           horovod_methods(), {**EARLIER, **ABLATION}, ("--steps", "400")),
    Recipe("trainer_lm_np2", "scripts/trainer_lm.py: the Trainer's GPT-2, 2 ranks (300 steps)",
           "scripts/trainer_lm.py", 2, "torchrun", ("1e-3", "2e-3", "4e-3", "8e-3"),
           {SSGD: ("--method", "ddp"), ACP: ("--method", "acp"),
            PREVIOUS: ("--method", "acp", *IN_TURN),
            BOTH25: ("--method", "acp", "--matrix-rank", "0.25")},
           {"ACP-SGD, rank 4 (the SGD default)": ("--method", "acp", "--matrix-rank", "4",
                                                  *IN_TURN),
            "ACP-SGD, P and Q in turn, fp32 on the wire": ("--method", "acp", "--fp16-wire",
                                                           "off", *IN_TURN),
            "ACP-SGD, P and Q in turn, step-ahead 0": ("--method", "acp", "--step-ahead", "0",
                                                       *IN_TURN),
            "ACP-SGD, P and Q in turn, step-ahead 0.5": ("--method", "acp", "--step-ahead",
                                                         "0.5", *IN_TURN),
            "ACP-SGD, P and Q in turn, 30 exact steps first": ("--method", "acp",
                                                               "--warmup-steps", "30", *IN_TURN),
            "ACP-SGD, P and Q in turn, share 0.75": ("--method", "acp", "--matrix-rank", "0.75",
                                                     *IN_TURN)}),
    # Checks at other world sizes, at the rate swept above: the held-out
    # Trainer recipe at 4 ranks, the user's script at 8.
    Recipe("trainer_lm_np4", "scripts/trainer_lm.py: the Trainer's GPT-2, 4 ranks (300 steps)",
           "scripts/trainer_lm.py", 4, "torchrun", (),
           {SSGD: ("--method", "ddp"), ACP: ("--method", "acp"),
            PREVIOUS: ("--method", "acp", *IN_TURN),
            BOTH25: ("--method", "acp", "--matrix-rank", "0.25")}, rate_from="trainer_lm_np2"),
    Recipe("user_lm_np8", "scripts/user_lm.py, 8 ranks (400 steps)",
           "scripts/user_lm.py", 8, "horovodrun", (),
           {SSGD: ("--optimizer", "ssgd"), ACP: ("--optimizer", "acp"),
            PREVIOUS: ("--optimizer", "acp", *IN_TURN),
            BOTH25: ("--optimizer", "acp", "--matrix-rank", "0.25")}, {},
           ("--steps", "400"), rate_from="user_lm_np4"),
)


#: The frontier (every method a transformer user weighs) on the two 4-rank
#: recipes: (label, flags, swept). A swept method runs at the swept rates
#: around S-SGD's best (seed 0) and on seeds 1, 2 at its own best; the others
#: at S-SGD's best.
FRONTIER_RECIPES = ("train_lm_np4", "user_lm_np4")
FRONTIER = (
    ("S-SGD (fp16)", ("--optimizer", "ssgd-fp16"), False),
    *((label, flags, False) for label, flags in EARLIER.items()),
    ("ACP-SGD, P and Q in turn, share 0.25", ("--optimizer", "acp", "--matrix-rank", "0.25",
                                              *IN_TURN), False),
    ("DiLoCo, H 10", ("--optimizer", "diloco", "--diloco-h", "10"), True),
    ("DiLoCo, H 50", ("--optimizer", "diloco", "--diloco-h", "50"), True),
    ("DeMo-style, k 1", ("--optimizer", "demo", "--demo-k", "1"), True),
    ("DeMo-style, k 8", ("--optimizer", "demo", "--demo-k", "8"), True),
    # Issue 36's item 4: ACP-SGD carrying DeMo's error-fed momentum with its
    # sign update (examples/common.SignAdamW; step-ahead models Adam's step).
    ("ACP-SGD, P and Q in turn, sign update",
     ("--optimizer", "acp", "--update", "sign", "--step-ahead", "0", *IN_TURN), True),
)
#: Settings of the frontier that only some recipes' scripts have.
FRONTIER_ONLY = {"ACP-SGD, P and Q in turn, sign update": ("train_lm_np4",)}


def frontier_settings(recipe: Recipe):
    """The (label, flags, swept) of :data:`FRONTIER` that ``recipe`` runs."""
    return [entry for entry in FRONTIER
            if recipe.key in FRONTIER_ONLY.get(entry[0], (recipe.key,))]


@dataclasses.dataclass(frozen=True)
class Run:
    recipe: Recipe
    label: str
    rate: str
    seed: int

    @property
    def flags(self) -> Tuple[str, ...]:
        # The recipe's own flags win: the frontier's are the Horovod scripts'
        # (a label such as "ACP-SGD, rank 4" is in both, and scripts/trainer_lm.py
        # takes --method, not --optimizer).
        known = {**{label: flags for label, flags, _ in FRONTIER},
                 **self.recipe.extra_methods, **self.recipe.methods}
        return known[self.label]

    @property
    def summary(self) -> Path:
        slug = re.sub(r"[^a-z0-9]+", "_", self.label.lower()).strip("_")
        return RESULTS / self.recipe.key / f"{slug}_lr{self.rate}_s{self.seed}.json"

    def command(self) -> List[str]:
        return self.recipe.command(self.flags, self.rate, self.seed, self.summary)


def read(path: Path) -> Optional[dict]:
    """val_loss, bytes sent and received per step (received: None where the
    script does not count it) and S-SGD's bytes per step of a summary, any
    script's format."""
    if not path.exists():
        return None
    summary = json.loads(path.read_text(encoding="utf-8"))
    steps = max(summary.get("steps", 1), 1)
    if "bytes_per_step" in summary:
        sent, dense = summary["bytes_per_step"], summary["ssgd_bytes_per_step"]
    else:
        sent = summary["bytes_sent_per_rank"] / steps
        dense = summary["ssgd_bytes_per_rank"] / steps
    received = summary.get("bytes_received_per_step",
                           summary.get("bytes_received_per_rank", 0) / steps)
    return {"loss": summary["val_loss"], "bytes": sent, "dense": dense,
            "received": received or None, "wall_s": summary.get("wall_s")}


def seed_results(recipe: Recipe, label: str, rate: str, seeds: Sequence[int],
                 ssgd: Dict[int, Optional[dict]]) -> Optional[dict]:
    """The summaries of ``label`` at ``rate`` on those of ``seeds`` that ran
    (``found``, by seed) and their paired gaps to S-SGD's; None if none ran."""
    found = {seed: read(Run(recipe, label, rate, seed).summary) for seed in seeds}
    found = {seed: value for seed, value in sorted(found.items()) if value is not None}
    if not found:
        return None
    return {"found": found, "gaps": [_gap(value["loss"], ssgd[seed]["loss"])
                                     for seed, value in found.items() if ssgd.get(seed)]}


def sweep_runs(recipe: Recipe) -> List[Run]:
    return [Run(recipe, label, rate, 0) for rate in recipe.rates for label in (SSGD, ACP)]


def recipe_of(key: str) -> Recipe:
    return next(recipe for recipe in RECIPES if recipe.key == key)


#: Swept rates whose seed-0 loss is within this share of the lowest are close
#: enough for one seed to misjudge: S-SGD runs on every seed at each of them.
CLOSE = 0.01


def contenders(recipe: Recipe) -> Optional[List[str]]:
    """The swept rates where S-SGD's seed-0 loss is within :data:`CLOSE` of
    the lowest (None until the sweep is complete)."""
    losses = {run.rate: read(run.summary) for run in sweep_runs(recipe) if run.label == SSGD}
    if not losses or any(value is None for value in losses.values()):
        return None
    finite = {rate: value["loss"] for rate, value in losses.items()
              if math.isfinite(value["loss"])}
    lowest = min(finite.values())
    return [rate for rate, loss in finite.items() if loss <= lowest * (1 + CLOSE)]


def tiebreak_runs(recipe: Recipe) -> List[Run]:
    """S-SGD on every seed at each contender, when there are several."""
    if recipe.rate_from:
        return []
    rates = contenders(recipe) or []
    return [Run(recipe, SSGD, rate, seed) for rate in rates if len(rates) > 1
            for seed in SEEDS[1:]]


def best_rate(recipe: Recipe) -> Optional[str]:
    """S-SGD's best swept rate: the lowest seed-0 loss, or among rates within
    :data:`CLOSE` of it the lowest mean over every seed (None until known);
    for a check at another world size, that of the recipe it takes it from."""
    if recipe.rate_from:
        return best_rate(recipe_of(recipe.rate_from))
    rates = contenders(recipe)
    if not rates:
        return None
    if len(rates) == 1:
        return rates[0]
    means = {}
    for rate in rates:
        found = [read(Run(recipe, SSGD, rate, seed).summary) for seed in SEEDS]
        if any(value is None for value in found):
            return None
        means[rate] = statistics.fmean(value["loss"] for value in found)
    return min(means, key=means.get)


def method_runs(recipe: Recipe, rate: str) -> List[Run]:
    runs = [Run(recipe, label, rate, seed) for seed in recipe.seeds for label in recipe.methods]
    return runs + [Run(recipe, label, rate, 0) for label in recipe.extra_methods]


def around(recipe: Recipe, rate: str) -> Tuple[str, ...]:
    """``rate`` and its neighbours in the recipe's sweep."""
    index = recipe.rates.index(rate)
    return recipe.rates[max(0, index - 1):index + 2]


def own_best(recipe: Recipe, label: str, rates: Sequence[str]) -> Optional[str]:
    """The rate of ``label``'s lowest seed-0 loss among ``rates`` (None until all ran)."""
    found = {rate: read(Run(recipe, label, rate, 0).summary) for rate in rates}
    if any(value is None for value in found.values()):
        return None
    finite = {rate: v["loss"] for rate, v in found.items() if math.isfinite(v["loss"])}
    return min(finite, key=finite.get) if finite else rates[0]


def frontier_runs(recipe: Recipe, best: str, stage: int) -> List[Run]:
    """Stage 0: seed 0 of every setting (swept ones at each rate around S-SGD's
    best); stage 1: seeds 1 and 2 at each setting's best rate."""
    runs = []
    for label, _, swept in frontier_settings(recipe):
        rates = around(recipe, best) if swept else (best,)
        if stage == 0:
            runs += [Run(recipe, label, rate, 0) for rate in rates]
        else:
            rate = own_best(recipe, label, rates)
            if rate is not None:
                runs += [Run(recipe, label, rate, seed) for seed in SEEDS[1:]]
    return runs


def run_missing(runs: Sequence[Run], timeout: float) -> None:
    for run in runs:
        if run.summary.exists():
            continue
        run.summary.parent.mkdir(parents=True, exist_ok=True)
        cmd = run.command()
        print(f"[lm_study] {shell_line(cmd)}", flush=True)
        started = time.perf_counter()
        rc = launch(cmd, run.summary.with_suffix(".log"), timeout)
        status = "ok" if rc == 0 and run.summary.exists() else f"FAILED (exit {rc})"
        print(f"[lm_study]   {status} in {time.perf_counter() - started:.0f} s", flush=True)
        if status == "ok":
            run.summary.with_suffix(".log").unlink()


# ------------------------------------------------------------------- report
def _gap(loss: float, reference: float) -> float:
    return 100.0 * (loss / reference - 1.0)


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
            gap = f"{_gap(acp['loss'], ssgd['loss']):+.2f}%" if ssgd and acp else "–"
            cells.append(f"{cell(acp)} | {gap}")
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


def figure(path: Path) -> None:
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
                    gaps.append(_gap(acp["loss"], ssgd["loss"]))
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
                     "sent": statistics.fmean(value["bytes"] for value in found) / found[0]["dense"],
                     "received": (statistics.fmean(received) / found[0]["dense"]
                                  if all(received) else None)})
    return rows


def frontier_report() -> List[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recipes = [r for r in RECIPES if r.key in FRONTIER_RECIPES and best_rate(r)]
    if not recipes:
        return []
    img = REPO / "docs" / "img" / "convergence_lm_frontier.png"
    fig, axes = plt.subplots(1, len(recipes), figsize=(6 * len(recipes), 4.5), squeeze=False)
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
           f"![Bytes against final loss](img/{img.name})", ""]
    timed = []
    for axis, recipe in zip(axes[0], recipes):
        best = best_rate(recipe)
        rows = frontier_rows(recipe, best)
        if recipe.key == TIMED_RECIPE:
            timed = rows
        out += [f"**{recipe.title}** (S-SGD's best rate {best})", "",
                "| method | rate | seeds | mean final loss | mean vs S-SGD | sent, share of "
                "S-SGD's | received |", "|---|---|---|---|---|---|---|"]
        for row in rows:
            gap = f"{statistics.fmean(row['gaps']):+.2f}%" if row["gaps"] else "–"
            received = "–" if row["received"] is None else f"{row['received']:.3f}"
            out.append(f"| {row['label']} | {row['rate']} | "
                       f"{', '.join(map(str, row['seeds']))} | {row['loss']:.4f} | {gap} | "
                       f"{row['sent']:.3f} | {received} |")
            axis.scatter(row["sent"], row["loss"], s=30)
            axis.annotate(row["label"], (row["sent"], row["loss"]), fontsize=6,
                          xytext=(3, 3), textcoords="offset points")
        out.append("")
        axis.set_xscale("log")
        axis.set_xlabel("bytes sent per step, share of S-SGD's fp32 gradient")
        axis.set_ylabel("final validation loss (mean of the seeds run)")
        axis.set_title(recipe.title, fontsize=9)
    fig.tight_layout()
    fig.savefig(img, dpi=110)
    plt.close(fig)
    return out + time_to_target_report(timed)


#: The benchmark's runs of examples/train_lm.py's model at 4 ranks under AdamW
#: (``python -m benchmarks --model examples/train_lm.py:benchmark_model
#: --optimizer adamw``) on emulated links: each method's step time there.
LINK_RUNS = (("100 Mbit/s", REPO / "bench-results" / "train_lm_np4_100mbit" / "results.json"),
             ("1 Gbit/s", REPO / "bench-results" / "train_lm_np4_1gbit" / "results.json"))
#: The recipe whose curves the link runs time.
TIMED_RECIPE = "train_lm_np4"
#: Frontier label -> the benchmark's method that times it. The benchmark's
#: DiLoCo runs H 500 (no outer step among its timed steps; :func:`link_step_s`
#: adds the outer all-reduce at the label's own H) and its DeMo-style k 8.
#: Its ACP-SGD ran the defaults of its day, P and Q in turn at a share 0.5.
TIMED = {SSGD: "ssgd", "S-SGD (fp16)": "ssgd-fp16", PREVIOUS: "acp", PSGD: "powersgd",
         "DiLoCo, H 10": "diloco", "DiLoCo, H 50": "diloco", "DeMo-style, k 8": "demo"}
#: The target of the time to a loss: S-SGD's mean final loss times this.
TARGET_FACTOR = 1.02


def mean_curve(recipe: "Recipe", label: str, rate: str, seeds: Sequence[int]):
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


def time_to_target_report(frontier: Sequence[dict]) -> List[str]:
    """The curves of :data:`TIMED_RECIPE`'s ``frontier`` rows (:func:`frontier_rows`)
    timed by the link runs: time to :data:`TARGET_FACTOR` times S-SGD's final
    loss and time of the whole run, per link, with a figure of loss against time."""
    benches = [(name, json.loads(path.read_text(encoding="utf-8")))
               for name, path in LINK_RUNS if path.exists()]
    rows = {row["label"]: row for row in frontier}
    if not benches or SSGD not in rows:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recipe = recipe_of(TIMED_RECIPE)
    target = rows[SSGD]["loss"] * TARGET_FACTOR
    img = REPO / "docs" / "img" / "convergence_lm_time.png"
    fig, axes = plt.subplots(1, len(benches), figsize=(6 * len(benches), 4.2), squeeze=False)
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
           f"the defaults now send 1.2 times those bytes and were not timed here). In "
           f"brackets: the interval of the median step over the rounds, times the steps. "
           f"4 ranks share this host's 2 cores (the floor is one process alone), so the "
           f"times carry CPU scheduling as well as the link: read only differences whose "
           f"intervals do not overlap.", "",
           f"![Validation loss against time](img/{img.name})", "",
           "| method | " + " | ".join(f"{name}: step | to {target:.3f} | 1,000 steps"
                                      for name, _ in benches) + " |",
           "|---|" + "---|---|---|" * len(benches)]
    flags = {label: flags for label, flags, _ in FRONTIER}
    for label, method in TIMED.items():
        given = flags.get(label, ())
        inner = int(given[given.index("--diloco-h") + 1]) if "--diloco-h" in given else None
        row = rows.get(label)
        curve = None if row is None else mean_curve(recipe, label, row["rate"], row["seeds"])
        if curve is None:
            continue
        steps, losses = curve
        reach = steps_to(curve, target)
        cells = []
        for (name, bench), axis in zip(benches, axes[0]):
            step, low, high = (link_step_s(bench, method, inner, key)
                               for key in ("step_s_median", "step_s_low", "step_s_high"))
            if step is None:
                cells.append("– | – | –")
                continue
            cells.append(" | ".join((
                _seconds(1, step, low, high, digits=3),
                "not reached" if reach is None else _seconds(reach, step, low, high),
                _seconds(steps[-1], step, low, high))))
            axis.plot([x * step for x in steps], losses, marker=".", label=label)
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    for (name, bench), axis in zip(benches, axes[0]):
        axis.axhline(target, color="grey", linestyle=":", linewidth=1)
        axis.set_ylim(top=min(2.6, axis.get_ylim()[1]))
        axis.set_xlabel(f"seconds at {name} (step time x steps)")
        axis.set_ylabel("validation loss (mean of the seeds)")
        axis.set_title(f"{recipe.title} on {name}", fontsize=9)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(img, dpi=110)
    plt.close(fig)
    return out + [""]


#: The generated part of README.md (and docs/guide.md): the defaults on each recipe.
SUMMARY_MARKERS = ("<!-- lm:summary -->", "<!-- end lm:summary -->")


def summary_table() -> List[str]:
    """Per recipe at S-SGD's best rate: ACP-SGD's defaults, the previous
    defaults, both factors at Power-SGD's bytes and Power-SGD against S-SGD
    (mean of the seeds run), citing results.md."""
    out = ["| recipe (AdamW) | S-SGD's best rate | ACP-SGD defaults vs S-SGD | "
           "bytes sent, share of S-SGD's | P and Q in turn (the previous defaults) | "
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
        out.append(f"| {recipe.title} ([runs](bench-results/lm_adam/results.md)) | {rate} | "
                   f"{cell(acp)} | {share(acp)} | {cell(previous)} | "
                   f"{cell(both25)} | {cell(psgd)} | "
                   f"{share(previous or both25 or psgd)} | "
                   f"{len(acp['gaps'])} |")
    return out


def write_summary(page: Path, prefix: str = "") -> None:
    """The summary table between :data:`SUMMARY_MARKERS` of ``page`` (links
    made relative to it with ``prefix``)."""
    start, end = SUMMARY_MARKERS
    text = page.read_text(encoding="utf-8")
    if start not in text:
        return
    lines = [line.replace("](bench-results/", f"]({prefix}bench-results/")
             for line in summary_table()]
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    page.write_text(head + start + "\n" + "\n".join(lines) + "\n" + end + tail,
                    encoding="utf-8")


def host_line() -> str:
    import os
    import platform

    import horovod
    import torch
    return (f"Ranks on localhost, one thread each, {os.cpu_count()} CPU cores "
            f"({platform.machine()}), Python {platform.python_version()}, torch "
            f"{torch.__version__}, Horovod {horovod.__version__}.")


def replace_section(doc: Path, name: str, text: str) -> None:
    """Put ``text`` between the markers of section ``name`` of ``doc``, where
    they are, or at the end (after scripts/compare.py's generated part, which
    compare.py keeps as written)."""
    old = doc.read_text(encoding="utf-8")
    block = f"<!-- section: {name} -->\n{text}<!-- end section: {name} -->\n"
    pattern = re.compile(rf"<!-- section: {re.escape(name)} -->\n.*?"
                         rf"<!-- end section: {re.escape(name)} -->\n", re.S)
    if pattern.search(old):
        new = pattern.sub(lambda _: block, old, count=1)
    else:
        if END_MARKER not in old:
            old += f"\n{END_MARKER}\n"
        new = old.rstrip("\n") + "\n\n" + block
    doc.write_text(new, encoding="utf-8")


#: Where the runs made before the step-ahead shift under Adam of commit fd972b8 went.
SHIFT_NOTE = (
    "Step-ahead under Adam changed in commit fd972b8 (the shift is now the step Adam would "
    "take for the residual; \"Step-ahead under Adam\" above). Every ACP-SGD run on this "
    "page ran with it. The runs it replaced, made with the shift divided by Adam's "
    "sqrt(v_hat) + eps, are kept in bench-results/lm_adam_shift_sqrt_v_hat/. The "
    "frontier's sign update runs with step-ahead 0, which the change does not touch.")


def report() -> str:
    img = REPO / "docs" / "img" / "convergence_lm_adam.png"
    figure(img)
    out = ["## Transformers trained with AdamW, at S-SGD's best learning rate", "",
           f"Generated by `scripts/lm_study.py` from `bench-results/lm_adam/`. {host_line()}",
           "", SHIFT_NOTE, "", f"![The LM recipes with AdamW](img/{img.name})", ""]
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
        commands += [line for line in (shell_line(run.command()) for run in runs
                                       if run.summary.exists()) if line not in commands]
    out += frontier_report()
    out += ["<details><summary>Exact commands of these runs</summary>", "", "```sh",
            *commands, "```", "</details>", ""]
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--frontier", action="store_true",
                        help="also run the frontier (DiLoCo, DeMo, S-SGD fp16, more ranks) on "
                             "the 4-rank recipes")
    parser.add_argument("--recipes", nargs="+", default=[r.key for r in RECIPES],
                        choices=[r.key for r in RECIPES])
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--doc", type=Path, default=DOC,
                        help="the page of the section; README.md, docs/guide.md and "
                             "bench-results/lm_adam/results.md are written only with the default")
    args = parser.parse_args(argv)
    chosen = [r for r in RECIPES if r.key in args.recipes]
    if not args.report_only:
        for recipe in chosen:
            run_missing(sweep_runs(recipe), args.timeout)
        for recipe in chosen:
            run_missing(tiebreak_runs(recipe), args.timeout)
        for recipe in chosen:
            best = best_rate(recipe)
            if best is None:
                print(f"[lm_study] {recipe.key}: the sweep is incomplete", flush=True)
                continue
            runs = sorted(method_runs(recipe, best), key=lambda run: run.seed)
            run_missing(runs, args.timeout)
        if args.frontier:
            for stage in (0, 1):
                for recipe in chosen:
                    best = best_rate(recipe)
                    if recipe.key in FRONTIER_RECIPES and best is not None:
                        run_missing(frontier_runs(recipe, best, stage), args.timeout)
    text = report()
    replace_section(args.doc, SECTION, text)
    if args.doc == DOC:
        # The same tables beside the runs, and the summary of the pages that quote them.
        (RESULTS / "results.md").write_text(
            "# " + text.split("\n", 1)[0].lstrip("# ") + "\n" + text.split("\n", 1)[1]
            .replace("](img/", "](../../docs/img/"), encoding="utf-8")
        write_summary(REPO / "README.md")
        write_summary(REPO / "docs" / "guide.md", prefix="../")
    print(f"[lm_study] wrote the section {SECTION} of {args.doc}", flush=True)


if __name__ == "__main__":
    main()
