"""Transformers trained with AdamW: the recipes, and the runs that are missing.

    .venv/bin/python scripts/lm_study.py                  # run what is missing, then the docs
    .venv/bin/python scripts/lm_study.py --report-only    # the docs from bench-results/lm_adam
    .venv/bin/python scripts/docgen.py --only lm_adam     # the same docs, through the generator

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
``bench-results/lm_adam/<recipe>/``. ``--frontier`` adds, on the two 4-rank
recipes, S-SGD in fp16, more ranks of ACP-SGD, DiLoCo and the DeMo-style
method, each at its best rate.

This module is the registry of the recipes and the runs (:data:`RECIPES`,
:data:`FRONTIER`, :class:`Run`) and the choice of what runs next (the best
rate of a sweep); ``scripts/lm_report.py`` renders the section "lm-adam"
of docs/convergence.md, its copy ``bench-results/lm_adam/results.md`` and
the summary tables of README.md and docs/guide.md from the summaries, and
``scripts/docgen.py`` writes them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from compare import launch, shell_line  # noqa: E402

RESULTS = REPO / "bench-results" / "lm_adam"
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

    def command(self, flags: Sequence[str], rate: str, seed: int, summary: Path,
                python: Optional[str] = None) -> List[str]:
        """The run's command line, with ``python`` (default: this interpreter,
        relative to the repository where it is inside)."""
        if python is None:
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
    # The held-out Trainer recipe at 4 ranks, with its own sweep: S-SGD trains
    # best there at twice the rate of 2 ranks, not at 2 ranks' rate.
    Recipe("trainer_lm_np4", "scripts/trainer_lm.py: the Trainer's GPT-2, 4 ranks (300 steps)",
           "scripts/trainer_lm.py", 4, "torchrun", ("1e-3", "2e-3", "3e-3", "4e-3", "6e-3", "8e-3"),
           {SSGD: ("--method", "ddp"), ACP: ("--method", "acp"),
            PREVIOUS: ("--method", "acp", *IN_TURN),
            BOTH25: ("--method", "acp", "--matrix-rank", "0.25")}),
    # A check at another world size, at the rate swept above.
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
    # sign update (scripts/sign_adamw.py; step-ahead models Adam's step).
    ("ACP-SGD, P and Q in turn, sign update",
     ("--optimizer", "acp", "--update", "sign", "--step-ahead", "0", *IN_TURN), True),
    # Issue 46: the factors in 8-bit lanes, and the budget setting at 1/40.
    ("ACP-SGD, 8-bit factors, share 0.2", ("--optimizer", "acp", "--int8-factors",
                                           "--matrix-rank", "0.2"), False),
    ("ACP-SGD, budget 1/40", ("--optimizer", "acp", "--budget", "0.025"), False),
)
#: Settings of the frontier that only some recipes' scripts have.
FRONTIER_ONLY = {"ACP-SGD, P and Q in turn, sign update": ("train_lm_np4",)}
#: Settings whose runs live in another study's folder, by the name of their
#: summaries there (bench-results/lm_int8/, scripts/lm_int8_table.py).
ELSEWHERE = {"ACP-SGD, 8-bit factors, share 0.2": ("lm_int8", "acp_int8_growth2_share_0_2"),
             "ACP-SGD, budget 1/40": ("lm_int8", "acp_budget_1_40_growth2")}


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
        folder, slug = ELSEWHERE.get(self.label, (None, None))
        slug = slug or re.sub(r"[^a-z0-9]+", "_", self.label.lower()).strip("_")
        results = RESULTS if folder is None else RESULTS.parent / folder
        return results / self.recipe.key / f"{slug}_lr{self.rate}_s{self.seed}.json"

    def command(self, python: Optional[str] = None) -> List[str]:
        return self.recipe.command(self.flags, self.rate, self.seed, self.summary, python)


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
    return {"found": found, "gaps": [gap(value["loss"], ssgd[seed]["loss"])
                                     for seed, value in found.items() if ssgd.get(seed)]}


def gap(loss: float, reference: float) -> float:
    """``loss`` against ``reference``, in percent."""
    return 100.0 * (loss / reference - 1.0)


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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: write the docs from the summaries there are")
    parser.add_argument("--frontier", action="store_true",
                        help="also run the frontier (DiLoCo, DeMo, S-SGD fp16, more ranks) on "
                             "the 4-rank recipes")
    parser.add_argument("--recipes", nargs="+", default=[r.key for r in RECIPES],
                        choices=[r.key for r in RECIPES])
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
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
    import docgen
    for path in docgen.write(*docgen.select(["bench-results/lm_adam/"])):
        print(f"[lm_study] wrote {path.relative_to(REPO)}", flush=True)


if __name__ == "__main__":
    main()
