"""Does ACP-SGD end where it ends without mixed precision's gradient scaler?

    .venv/bin/python scripts/amp_convergence.py                 # run what is missing, report
    .venv/bin/python scripts/amp_convergence.py --report-only

Two recipes at the library's defaults, each on seeds 0, 1 and 2, with and
without ``torch.amp.GradScaler`` (its default dynamic scale, from 65536;
on CPU without autocast, so the scaler's factor and the steps it skips are
the only difference):

- the digits CNN with SGD at 8 ranks, ``make demo NP=8``'s recipe
  (``examples/train.py --optimizer acp``): rank 4, fp32 on the wire;
- ``scripts/user_lm.py`` at 4 ranks (AdamW, clipping after ``unscale_``,
  400 steps at S-SGD's best rate 1e-2): both factors at share 0.3, fp16 on
  the wire, as the defaults choose for AdamW.

Each run's ``--summary`` JSON is kept under ``bench-results/amp/``; the
report (a Markdown table of the paired differences, printed and written to
``bench-results/amp/results.md``) is made from those files only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from compare import launch, shell_line  # noqa: E402

RESULTS = REPO / "bench-results" / "amp"
SEEDS = (0, 1, 2)
#: key -> (title, ranks, script and flags, metric in the summary, lower is better)
RECIPES = {
    "digits_np8": ("digits CNN, SGD, 8 ranks (`make demo NP=8`)", 8,
                   ("examples/train.py", "--optimizer", "acp", "--no-progress"),
                   "test_accuracy", False),
    "user_lm_np4": ("scripts/user_lm.py, AdamW, 4 ranks, 400 steps, lr 1e-2", 4,
                    ("scripts/user_lm.py", "--optimizer", "acp", "--steps", "400"),
                    "val_loss", True),
}


def command(recipe: str, seed: int, amp: bool, summary: Path) -> list:
    _, np, flags, _, _ = RECIPES[recipe]
    bin_dir = Path(sys.executable).parent
    cmd = [str(bin_dir / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo",
           sys.executable, *flags, "--seed", str(seed), "--summary", str(summary)]
    return cmd + (["--amp"] if amp else [])


def path_of(recipe: str, seed: int, amp: bool) -> Path:
    return RESULTS / recipe / f"{'amp' if amp else 'plain'}_s{seed}.json"


def run_missing(timeout: float) -> None:
    for recipe in RECIPES:
        for seed in SEEDS:
            for amp in (False, True):
                out = path_of(recipe, seed, amp)
                if out.exists():
                    continue
                out.parent.mkdir(parents=True, exist_ok=True)
                cmd = command(recipe, seed, amp, out)
                print(shell_line(cmd), flush=True)
                code = launch(cmd, out.with_suffix(".log"), timeout)
                if code != 0 or not out.exists():
                    raise SystemExit(f"run failed ({code}): see {out.with_suffix('.log')}")


def report() -> str:
    lines = ["| recipe | metric | seed | no scaler | GradScaler | difference | "
             "steps skipped | final scale |", "|---|---|---|---:|---:|---:|---:|---:|"]
    summary = []
    for recipe, (title, _, _, metric, lower) in RECIPES.items():
        diffs = []
        for seed in SEEDS:
            plain, amp = (json.loads(path_of(recipe, seed, a).read_text()) for a in (False, True))
            a, b = plain[metric], amp[metric]
            scale = amp.get("amp") or {}
            skipped = scale.get("skipped_steps", "")
            final = scale.get("final_scale", amp.get("config", {}).get("amp_final_scale", ""))
            if metric == "test_accuracy":
                a, b = 100 * a, 100 * b
                diffs.append(b - a)
                cells = f"{a:.2f}% | {b:.2f}% | {b - a:+.2f} points"
            else:
                diffs.append(100 * (b - a) / a)
                cells = f"{a:.4f} | {b:.4f} | {100 * (b - a) / a:+.2f}%"
            lines.append(f"| {title} | {metric} | {seed} | {cells} | {skipped} | {final} |")
        unit = " points" if metric == "test_accuracy" else "%"
        summary.append(f"- {title}: mean paired difference {statistics.mean(diffs):+.2f}{unit} "
                       f"(seeds {', '.join(f'{d:+.2f}' for d in diffs)})")
    commands = ["", "Commands (one per run; `--amp` adds the scaler):", "", "```"]
    commands += [shell_line(command(r, 0, True, path_of(r, 0, True)).copy()).replace(
        str(REPO) + "/", "") for r in RECIPES]
    commands += ["```"]
    return "\n".join(lines + [""] + summary + commands) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    if not args.report_only:
        run_missing(args.timeout)
    text = report()
    (RESULTS / "results.md").write_text("# Convergence under torch.amp.GradScaler\n\n"
                                        "Made by `scripts/amp_convergence.py`.\n\n" + text,
                                        encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
