"""Make the failure visible: error-feedback health of a failing and a healthy run.

    .venv/bin/python scripts/diagnose.py            # np 8, seed 0, the demo's recipe

Runs the digits example twice under ``horovodrun`` with ``--diagnostics``:
ACP-SGD without step-ahead error feedback (``--step-ahead 0``, the method as
published) and with the default, then plots per step the training loss,
``||E|| / ||M||``, the share of ``||A||^2`` the projection keeps and how far
the subspace turns (see hvd_acp.diagnostics), into
``docs/img/diagnostics.png``, and prints a short summary of each run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402  (the launch helpers of the convergence comparison)

REPO = compare.REPO


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=8, help="ranks (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="more flags for examples/train.py (e.g. --batch-size 128 --lr 0.1)")
    parser.add_argument("--results", type=Path, default=REPO / "results" / "diagnose")
    parser.add_argument("--img", type=Path, default=REPO / "docs" / "img" / "diagnostics.png")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw the picture from the runs already in --results")
    return parser.parse_args(argv)


RUNS = (("ACP-SGD without step-ahead (--step-ahead 0)", ("--step-ahead", "0")),
        ("ACP-SGD (default: step-ahead 0.2)", ()))


def run(args, label, flags):
    args.results.mkdir(parents=True, exist_ok=True)
    stem = "noahead" if flags else "default"
    diag = args.results / f"{stem}.diagnostics.json"
    summary = args.results / f"{stem}.json"
    task = compare.Task("diagnose", "train.py", label, [])
    one = compare.Run(label, "acp", args.seed,
                      (*flags, *args.extra, "--diagnostics", compare._rel(diag)), args.np)
    cmd = compare.command(task, one, args.np, summary)
    print(f"[diagnose] {compare.shell_line(cmd)}", flush=True)
    rc = compare.launch(cmd, summary.with_suffix(".log"), args.timeout)
    if rc != 0 or not diag.exists():
        raise SystemExit(f"[diagnose] run failed (exit {rc}); see {summary.with_suffix('.log')}")
    return step_records(diag), json.loads(summary.read_text())


def step_records(path: Path) -> list:
    """The per-step records of a diagnostics file (auto rank's probe records,
    which carry ranks instead of norms, left out)."""
    return [s for s in json.loads(path.read_text())["steps"] if s.get("phase") != "probe"]


def describe(label, steps, summary):
    ratio = [s["residual_ratio"] for s in steps if s["residual_ratio"] is not None]
    kept = [s["kept_share"] for s in steps if s["kept_share"] is not None]
    turn = [s["subspace_turn"] for s in steps if s["subspace_turn"] is not None]
    return (f"{label}: final test accuracy {100 * summary['test_accuracy']:.2f}%; "
            f"||E||/||M|| median {statistics.median(ratio):.2f}, max {max(ratio):.1f}; "
            f"kept share median {statistics.median(kept):.2f}; "
            f"subspace turn median {statistics.median(turn):.2f}")


def plot(results, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("train_loss", "training loss (rank 0)", True),
              ("grad_norm", "||M|| (solid), ||E|| (dashed), rank 0", True),
              ("residual_ratio", "||E|| / ||M||", True),
              ("kept_share", "share of ||A||² the projection keeps", False),
              ("subspace_turn", "subspace turn since that side's last step", False))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 3.6))
    for label, steps, summary in results:
        for ax, (key, ylabel, log) in zip(axes, panels):
            xs = [s["step"] for s in steps if s.get(key) is not None]
            ys = [s[key] for s in steps if s.get(key) is not None]
            line, = ax.plot(xs, ys, linewidth=1.2,
                            label=f"{label}: {100 * summary['test_accuracy']:.1f}%")
            if key == "grad_norm":
                ax.plot(xs, [s["residual_norm"] for s in steps if s.get(key) is not None],
                        linestyle="--", linewidth=1.0, color=line.get_color())
            ax.set_ylabel(ylabel)
            ax.set_xlabel("optimizer step")
            if log:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    results = []
    for label, flags in RUNS:
        stem = args.results / ("noahead" if flags else "default")
        if args.plot_only:
            steps = step_records(stem.with_suffix(".diagnostics.json"))
            summary = json.loads(stem.with_suffix(".json").read_text())
        else:
            steps, summary = run(args, label, flags)
        results.append((label, steps, summary))
        print("[diagnose] " + describe(label, steps, summary), flush=True)
    recipe = " ".join(args.extra) or "default flags"
    plot(results, args.img, f"digits CNN, {args.np} ranks, seed {args.seed}, {recipe} "
                            "(momentum 0.9, lr 0.025 x ranks)")
    print(f"[diagnose] wrote {compare._rel(args.img)}", flush=True)


if __name__ == "__main__":
    main()
