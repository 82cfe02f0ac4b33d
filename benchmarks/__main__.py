"""``python -m benchmarks``: the command line, run from the checkout.

``python -m benchmarks [options]`` runs the benchmark; ``python -m benchmarks
check OLD NEW`` compares two of its runs (:mod:`.check`); ``python -m
benchmarks calibrate-link --out link.json`` measures the CPU cost per byte
of its emulated network (:mod:`.calibrate_link`), for the planner's
``--link-calibration``.
"""
from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path
from typing import List, Optional

from hvd_acp.methods import KEYS
from hvd_acp.plan.models import (DEFAULT_BATCH_SIZE, DEFAULT_USER_BATCH_SIZE, MODELS, OPTIMIZERS,
                                  check_model_name, default_batch_size, default_matrix_rank,
                                  model_file)
from hvd_acp.plan.units import matrix_rank_type, number_type, parse_bandwidth, positive_int

from .netem import NetworkSetupError, check_can_emulate
from .stats import parse_methods

PROG = "python -m benchmarks"
#: The smallest number of rounds for which a distribution-free interval of
#: the median reaches 95% (5 rounds: 93.75% at best); see stats.order_statistic_rank.
DEFAULT_ROUNDS = 6


_non_negative = number_type(int, lambda v: v >= 0, "an int >= 0")


def _model_name(text: str) -> str:
    """``--model``: a built-in model or a user's ``module:function``, as the planner takes it."""
    try:
        name = check_model_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    path = model_file(name)
    if path is not None and not path.is_file():
        raise argparse.ArgumentTypeError(f"--model {name!r}: no file {path.resolve()}")
    return name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="S-SGD vs Power-SGD vs ACP-SGD side by side in one run, optionally on "
                    "an emulated cluster network (--bandwidth, needs root).",
        epilog=f"{PROG} check OLD/results.json NEW/results.json compares two runs of "
               f"one configuration: exit 1 if a ratio's intervals do not overlap ({PROG} "
               f"check -h). {PROG} calibrate-link --out link.json measures the CPU cost per "
               f"byte of the emulated network, for hvd-acp-plan --link-calibration ({PROG} "
               "calibrate-link -h).")
    parser.add_argument("--methods", default=",".join(KEYS),
                        help=f"comma-separated subset of {','.join(KEYS)} (default: all)")
    parser.add_argument("--model", type=_model_name, default="resnet50",
                        help=f"a built-in model ({', '.join(MODELS)}; default resnet50) or "
                             "your own as package.module:function or "
                             "path/to/file.py:function (relative to the current directory), "
                             "as hvd-acp-plan takes it: called as function(batch_size), it "
                             "returns (model, batch) or (model, batch, loss_fn); e.g. "
                             "examples/train_lm.py:benchmark_model")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                        help="the torch optimizer of every job (floor, methods, "
                             "diagnostics), at lr 0.01: sgd, SGD with momentum 0.9 (default); "
                             "adamw, AdamW (its other settings torch's defaults), the methods "
                             "then taking hvd_acp's defaults for an adaptive optimizer unless "
                             "--matrix-rank is given")
    parser.add_argument("--np", type=positive_int, default=2, help="ranks (default 2)")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="per rank (default: " + ", ".join(
                            f"{m} {b}" for m, b in DEFAULT_BATCH_SIZE.items())
                        + f", your model {DEFAULT_USER_BATCH_SIZE})")
    parser.add_argument("--matrix-rank", type=matrix_rank_type, default=None,
                        help="factor rank, a share of each matrix's smaller side in (0, 1), "
                             "or 'auto' for a rank per tensor (default with --optimizer sgd: "
                             "4 for resnet50, small and your model, 32 for bert-base and "
                             "gpt2; with --optimizer adamw none is passed and each method resolves "
                             "hvd_acp's adaptive defaults (hvd_acp.Settings: ACP-SGD both factors "
                             "every step at 0.3 of each matrix's smaller side, Power-SGD a "
                             "quarter, fp16 on the wire), torch's powerSGD_hook the int rank whose bytes per step "
                             "come closest to what hvd_acp's Power-SGD sends)")
    parser.add_argument("--rounds", type=positive_int, default=DEFAULT_ROUNDS,
                        help="run every job (floor, methods, diagnostics) once per round, in "
                             "an order rotated from round to round; ratios are paired inside "
                             f"each round, then given a median and interval over the rounds "
                             f"(default {DEFAULT_ROUNDS}, the fewest with a 95%% interval)")
    parser.add_argument("--steps", type=positive_int, default=10,
                        help="timed steps per job and round (default 10)")
    parser.add_argument("--warmup", type=_non_negative, default=3,
                        help="untimed steps first, in every job (default 3)")
    parser.add_argument("--bandwidth", default=None,
                        help="per-node link rate, e.g. 200mbit or 1gbit (tc units); omitted: "
                             "no emulation, plain localhost")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="output directory (default bench-results); its raw/ and logs/ "
                             "are replaced")
    parser.add_argument("--image-size", type=positive_int, default=128,
                        help="resnet50 input height and width (default 128; not passed to "
                             "your model)")
    parser.add_argument("--seq-len", type=positive_int, default=64,
                        help="bert-base tokens per sequence (default 64; not passed to your "
                             "model)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads per rank (default 1)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds before a job is killed as hung (default 1800)")
    parser.add_argument("--reruns", type=_non_negative, default=0,
                        help="run a method again, up to this many times, while other "
                             "processes use over 10%% of the machine during it (default 0)")
    parser.add_argument("--horovod-cycle-time-ms", type=float, default=None,
                        help="HOROVOD_CYCLE_TIME of the Horovod jobs (default: Horovod's, 1 ms); "
                             "like horovodrun --cycle-time-ms")
    parser.add_argument("--count-ops", action="store_true",
                        help="after each job's timed steps, count its operator calls per "
                        "step (torch.profiler on the CPU, 2 untimed steps); results.md "
                        "shows them over the floor's")
    parser.add_argument("--diagnostics", action="store_true",
                        help="also run the floor with all ranks computing at once, Horovod "
                             "initialized but idle, and ACP-SGD without communication: where "
                             "the time over the floor comes from")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        from .check import main as check_main
        return check_main(argv[1:])
    if argv[:1] == ["calibrate-link"]:
        from .calibrate_link import main as calibrate_main
        return calibrate_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        methods = parse_methods(args.methods)
        bandwidth = parse_bandwidth(args.bandwidth)
    except ValueError as exc:
        parser.error(str(exc))
    if bandwidth is not None:
        try:
            check_can_emulate()
        except NetworkSetupError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2
    from .driver import BenchConfig, Interrupted, run_benchmark
    if args.optimizer == "sgd":
        matrix_rank = args.matrix_rank or default_matrix_rank(args.model)
    else:
        # None: every method resolves hvd_acp's default for the optimizer.
        matrix_rank = args.matrix_rank
    cfg = BenchConfig(
        methods=methods, model=args.model, np=args.np,
        batch_size=args.batch_size or default_batch_size(args.model),
        matrix_rank=matrix_rank, optimizer=args.optimizer,
        steps=args.steps, warmup=args.warmup, bandwidth_mbit=bandwidth, out=args.out,
        rounds=args.rounds,
        image_size=args.image_size, seq_len=args.seq_len, threads=args.threads,
        timeout_s=args.timeout, progress=not args.no_progress, reruns=args.reruns,
        diagnostics=args.diagnostics, horovod_cycle_time_ms=args.horovod_cycle_time_ms,
        count_ops=args.count_ops,
        command=f"{PROG} " + " ".join(shlex.quote(a) for a in argv))
    try:
        results = run_benchmark(cfg)
    except NetworkSetupError as exc:
        print(f"{PROG}: error: cannot build the emulated network: {exc}",
              file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted):
        print(f"{PROG}: interrupted; jobs killed and emulated network removed",
              file=sys.stderr)
        return 130
    print((cfg.out / "results.md").read_text())
    jobs = dict(results["methods"], compute_only=results.get("compute_only") or {},
                **(results.get("diagnostics") or {}))
    failed = [job for job, entry in jobs.items() if entry.get("error") or entry.get("errors")]
    if failed:
        print(f"{PROG}: failed (in one round or more): {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
