"""The 8-bit factors' runs (bench-results/lm_int8/) against S-SGD at its best rate:
the block ``lm-int8`` of docs/convergence.md and bench-results/lm_int8/results.md,
and the runs on more seeds (bench-results/lm_int8_seeds/): the block ``lm-int8-seeds``
and bench-results/lm_int8_seeds/results.md (all written by ``scripts/docgen.py``).

Reads every run summary under ``bench-results/lm_int8/<recipe>/`` (written by
``--summary`` of examples/train_lm.py, scripts/user_lm.py and
scripts/trainer_lm.py; the commands are in the section of docs/convergence.md
this table goes into) and S-SGD's runs of the same recipe, rate and seed in
``bench-results/lm_adam/<recipe>/`` (scripts/lm_study.py), and prints one
markdown table per recipe: each setting's final validation loss per seed,
its gap to S-SGD's run of that seed, the mean of the paired gaps, and the
bytes a rank sent as a share of S-SGD's fp32 bytes (sent = received: one
all-reduce per buffer).

    .venv/bin/python scripts/docgen.py
"""
from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "bench-results" / "lm_int8"
REFERENCE = REPO / "bench-results" / "lm_adam"
#: More seeds of a recipe: S-SGD and the settings side by side, beyond seeds 0-2.
MORE_SEEDS = REPO / "bench-results" / "lm_int8_seeds"
TITLES = {"train_lm_np2": "examples/train_lm.py, 2 ranks (1,000 steps)",
          "train_lm_np4": "examples/train_lm.py, 4 ranks (1,000 steps)",
          "user_lm_np4": "scripts/user_lm.py, 4 ranks (400 steps)",
          "user_lm_np8": "scripts/user_lm.py, 8 ranks (400 steps)",
          "trainer_lm_np2": "scripts/trainer_lm.py: the Trainer's GPT-2, 2 ranks (300 steps)",
          "trainer_lm_np4": "scripts/trainer_lm.py: the Trainer's GPT-2, 4 ranks (300 steps)"}
NAME = re.compile(r"(?P<setting>.+)_lr(?P<rate>[0-9.e-]+)_s(?P<seed>\d+)\.json")
LABELS = {"acp_int8_share_0_2":
          "ACP-SGD, int8 factors, share 0.2, steps from the last average alone (before the growth)",
          "acp_int8_trend_share_0_2":
          "ACP-SGD, int8 factors, share 0.2, steps follow the growth up to 4x (the library's before 2x)",
          "acp_int8_growth2_share_0_2":
          "ACP-SGD, int8 factors, share 0.2 (the library's: steps follow the growth, up to 2x)",
          "acp_int8_sa0_share_0_2":
          "ACP-SGD, int8 factors, share 0.2, step-ahead 0 (before the growth)",
          "acp_int8_sa0_1_share_0_2":
          "ACP-SGD, int8 factors, share 0.2, step-ahead 0.1 (before the growth)",
          "acp_budget_1_40_growth": "ACP-SGD, budget=0.025 (1/40), growth up to 4x",
          "acp_budget_1_40_growth2": "ACP-SGD, budget=0.025 (1/40) (the library's: growth up to 2x)",
          "acp_int8_k4_share_0_2": "ACP-SGD, int8 factors, share 0.2, headroom 4 (before the growth)",
          "acp_int8_k8_share_0_2": "ACP-SGD, int8 factors, share 0.2, headroom 8 (before the growth)",
          "acp_int8_lead20_share_0_2": "ACP-SGD, int8 factors, share 0.2, 20 float steps first (before the growth)",
          "acp_fp16_share_0_2": "ACP-SGD, fp16 factors, share 0.2 (the control)",
          "acp_int8_rot_share_0_2":
          "ACP-SGD, int8 factors, share 0.2, levels on rotated factors (study, before the growth)",
          "acp_int8_block16_share_0_2":
          "ACP-SGD, int8 factors, share 0.2, a step per 16 rows (study, before the growth)",
          "acp_int8_adapt_share_0_2":
          "ACP-SGD, int8 factors, share 0.2, headroom following the clipping (study, before the growth)",
          "acp_lanes6_share_0_25": "ACP-SGD, 6-bit lanes, share 0.25 (study, before the growth)",
          "acp_lanes6_growth2_share_0_25":
          "ACP-SGD, 6-bit lanes, share 0.25, steps follow the growth up to 2x (study)",
          "acp_radix84_growth2_share_0_25":
          "ACP-SGD, 5 digits of base 84 a word (6.4 bits), share 0.25, steps follow the growth up to 2x (study)",
          "acp_int8_stochastic_share_0_2":
          "ACP-SGD, int8 factors, share 0.2, levels rounded at random, steps up to 2x (study)",
          "acp_int8_k1_5_growth2_share_0_2":
          "ACP-SGD, int8 factors, share 0.2, headroom 1.5, steps up to 2x (study)",
          "acp_lanes5_share_0_3": "ACP-SGD, 5-bit lanes, share 0.3 (study, before the growth)",
          "acp_fp16_share_0_1": "ACP-SGD, fp16 factors, share 0.1 (the 8-bit factors' bytes)",
          "acp_int8_share_0_25": "ACP-SGD, int8 factors, share 0.25 (before the growth)",
          "acp_int8_share_0_06": "ACP-SGD, int8 factors, share 0.06 (before the growth)",
          "acp_budget_1_40": "ACP-SGD, budget=0.025 (1/40), before the growth",
          "acp_budget_1_13": "ACP-SGD, budget=0.077 (1/13): share 0.21 (the library's)",
          "acp_sgd_defaults": "ACP-SGD, the defaults (share 0.3, fp16 factors: 0.21 of the bytes)",
          "demo_style_k_1": "DeMo-style, k 1 (receives more than it sends)",
          "tsr_r32_k10_scale8": "TSR-style, r 32, K 10, scale 8",
          "tsr_r32_k10_scale1": "TSR-style, r 32, K 10, scale 1"}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def table(recipe: str) -> str:
    runs = defaultdict(dict)
    for path in sorted((RUNS / recipe).glob("*.json")):
        match = NAME.fullmatch(path.name)
        if match:
            runs[(match["setting"], match["rate"])][int(match["seed"])] = load(path)
    lines = [f"**{TITLES.get(recipe, recipe)}**", "",
             "| setting | rate | seeds | final validation loss per seed | S-SGD, same seeds "
             "| gap per seed | mean gap | sent, share of S-SGD's |",
             "|---|---|---|---|---|---|---|---|"]
    for (setting, rate), seeds in sorted(runs.items()):
        losses, refs, gaps = [], [], []
        for seed, run in sorted(seeds.items()):
            ref = REFERENCE / recipe / f"s_sgd_lr{rate}_s{seed}.json"
            losses.append(run["val_loss"])
            if ref.exists():
                refs.append(load(ref)["val_loss"])
                gaps.append(run["val_loss"] / refs[-1] - 1)
        share = [_share(run) for run in seeds.values() if _share(run) is not None]
        lines.append(_row(setting, rate, seeds, losses, refs, gaps, share))
    return "\n".join(lines)


def _share(run: dict):
    """Bytes a rank sent as a share of S-SGD's (the scripts' two spellings)."""
    if run.get("ssgd_bytes_per_rank"):
        return run["bytes_sent_per_rank"] / run["ssgd_bytes_per_rank"]
    if run.get("ssgd_bytes_per_step"):
        return run["bytes_per_step"] / run["ssgd_bytes_per_step"]
    return None


def _row(setting, rate, seeds, losses, refs, gaps, share) -> str:
    mean = f"**{sum(gaps) / len(gaps):+.2%}**" if gaps else "-"
    return (f"| {LABELS.get(setting, setting)} | {rate} | {', '.join(map(str, sorted(seeds)))} "
            f"| {', '.join(f'{x:.4f}' for x in losses)} "
            f"| {', '.join(f'{x:.4f}' for x in refs) or '-'} "
            f"| {', '.join(f'{g:+.2%}' for g in gaps) or '-'} | {mean} "
            f"| {f'{share[0]:.4f}' if share else '-'} |")


def section(page: Path = None) -> List[str]:
    """The tables of every recipe run, as lines (``page`` unused: no links)."""
    recipes = [r for r in TITLES if any((RUNS / r).glob("*.json"))]
    return "\n\n".join(table(r) for r in recipes).split("\n")


def _seeds_of(setting: str, recipe: str, rate: str) -> dict:
    """Final losses by seed: seeds 0-2 where the tables above have them (the
    8-bit runs, or the defaults' and S-SGD's in bench-results/lm_adam/),
    then bench-results/lm_int8_seeds/ (S-SGD is ``s_sgd``)."""
    found = {}
    for folder in (RUNS / recipe, REFERENCE / recipe, MORE_SEEDS / recipe):
        for path in sorted(folder.glob(f"{setting}_lr{rate}_s*.json")):
            match = NAME.fullmatch(path.name)
            if match and match["setting"] == setting:
                found.setdefault(int(match["seed"]), load(path)["val_loss"])
    return found


def seeds_section(page: Path = None) -> List[str]:
    """Each setting run on more than three seeds against S-SGD on the same
    seeds: the paired gaps' mean, their spread and the mean's standard error."""
    lines = []
    for recipe_dir in sorted(MORE_SEEDS.glob("*")):
        if not recipe_dir.is_dir():
            continue
        recipe = recipe_dir.name
        rates = sorted({NAME.fullmatch(p.name)["rate"] for p in recipe_dir.glob("*.json")
                        if NAME.fullmatch(p.name)})
        lines += [f"**{TITLES.get(recipe, recipe)}, more seeds**", "",
                  "| setting | rate | seeds | gap per seed | mean gap | standard deviation "
                  "| standard error of the mean | mean of seeds 0-2 |",
                  "|---|---|---|---|---|---|---|---|"]
        for rate in rates:
            reference = _seeds_of("s_sgd", recipe, rate)
            settings = sorted({NAME.fullmatch(p.name)["setting"]
                               for p in recipe_dir.glob(f"*_lr{rate}_s*.json")} - {"s_sgd"})
            for setting in settings:
                runs = _seeds_of(setting, recipe, rate)
                seeds = sorted(set(runs) & set(reference))
                gaps = [runs[k] / reference[k] - 1 for k in seeds]
                if len(gaps) < 2:
                    continue
                mean, sd = statistics.fmean(gaps), statistics.stdev(gaps)
                first = [g for k, g in zip(seeds, gaps) if k < 3]
                first_mean = f"{statistics.fmean(first):+.2%}" if first else "-"
                lines.append(
                    f"| {LABELS.get(setting, setting)} | {rate} | {seeds[0]}-{seeds[-1]} "
                    f"({len(seeds)}) | {', '.join(f'{g:+.2%}' for g in gaps)} "
                    f"| **{mean:+.2%}** | {sd:.2%} | {sd / len(gaps) ** 0.5:.2%} "
                    f"| {first_mean} |")
        lines.append("")
    return lines[:-1] if lines else ["No runs in bench-results/lm_int8_seeds/ yet."]


def results_page() -> str:
    """bench-results/lm_int8/results.md."""
    return "\n".join([
        "# int8_factors and the TSR-style baseline on the transformer recipes", "",
        "Generated by `scripts/docgen.py` (`scripts/lm_int8_table.py`). S-SGD: its runs at "
        "its best rate in bench-results/lm_adam/ (scripts/lm_study.py). Gaps are paired by "
        "seed. The commands: docs/convergence.md, \"Below a tenth of the bytes\".", "",
        *section(), ""])


def seeds_page() -> str:
    """bench-results/lm_int8_seeds/results.md."""
    return "\n".join([
        "# The 8-bit factors on more seeds", "",
        "Generated by `scripts/docgen.py` (`scripts/lm_int8_table.py`). Seeds 0-2 of a "
        "setting and of S-SGD are the runs of bench-results/lm_int8/ and "
        "bench-results/lm_adam/; the others are here, with S-SGD's (`s_sgd_*`) on the same "
        "seeds. Gaps are paired by seed; the standard deviation is the gaps' (n - 1), the "
        "standard error the mean's. The commands: docs/convergence.md, \"Below a tenth of "
        "the bytes\".", "",
        *seeds_section(), ""])
