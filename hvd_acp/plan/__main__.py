"""``hvd-acp-plan`` / ``python -m hvd_acp.plan``: profile, predict, validate.

``hvd-acp-plan profile ...`` measures one step on this machine and writes a
profile; ``hvd-acp-plan predict ...`` (or ``hvd-acp-plan`` with predict's
options) predicts every method's step for a grid of clusters;
``hvd-acp-plan validate --bench RUN/results.json`` predicts a measured
benchmark run and prints measured, predicted and error per method.
``--link-calibration FILE`` reads the CPU cost per byte of a network stack,
as the repository's benchmark measures it on its emulated network
(``python -m benchmarks calibrate-link``).
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import List, Optional

from .models import add_model_arguments, default_batch_size
from .units import add_count, number_type, parse_bandwidth_list, parse_int_list, positive_int

SUBCOMMANDS = ("profile", "predict", "validate")


_positive_float = number_type(float, lambda v: v > 0, "a positive number")
_non_negative_float = number_type(float, lambda v: v >= 0, "a number >= 0")



_budget = number_type(float, lambda v: 0 < v <= 1, "a share of S-SGD's bytes in (0, 1]")


def _link_calibration(parser: argparse.ArgumentParser, what: str) -> None:
    """``--link-calibration``: a file of ``python -m benchmarks calibrate-link``."""
    parser.add_argument("--link-calibration", type=Path, default=None,
                        help=f"a link calibration (python -m benchmarks calibrate-link) {what}")

def _add_model_args(p: argparse.ArgumentParser, required: bool) -> None:
    add_model_arguments(p, required=required, what=", profiled on this machine")
    p.add_argument("--int8-factors", action="store_true",
                   help="ACP-SGD with int8_factors=True: its factors as 8-bit levels (with "
                        "--optimizer adamw, or a --matrix-rank)")
    p.add_argument("--budget", type=_budget, default=None,
                   help="ACP-SGD with budget=...: the share of S-SGD's bytes a step may send, "
                        "fitted to the model (with --optimizer adamw)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--ranks-per-node", type=positive_int, default=None,
                   help="ranks profiled at once on this node, as the launch will run them "
                        "(default: one per GPU with --device cuda, one per core on the CPU; "
                        "with predict at most the smallest --np, or --gpus-per-node)")
    p.add_argument("--threads-per-rank", type=positive_int, default=None,
                   help="torch threads of each rank (default: this node's cores divided among "
                        "the ranks per node)")
    p.add_argument("--alone", action="store_true",
                   help="profile one process alone: no other rank computing, no Horovod "
                        "thread (a rank that has its node to itself)")
    p.add_argument("--no-horovod-thread", action="store_true",
                   help="profile the ranks without Horovod initialized (default: with its "
                        "background thread alive, where Horovod is installed)")
    add_count(p, "--steps", 3, "timed profiling steps")
    add_count(p, "--warmup", 1, "untimed steps first", minimum=0)
    add_count(p, "--repeats", 3, "timed calls of each compression kernel")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hvd-acp-plan",
        description="Predict S-SGD, Power-SGD and ACP-SGD step times on a cluster from a "
                    "profile measured on one device.",
        epilog="Without a subcommand, the options are predict's: hvd-acp-plan --model "
               "resnet50 --np 8,32 --bandwidth 1gbit,10gbit --out DIR")
    sub = parser.add_subparsers(dest="command")
    prof = sub.add_parser("profile", help="measure one training step on this machine")
    _add_model_args(prof, required=True)
    prof.add_argument("--horovod-cycle-time-ms", type=_non_negative_float, default=None,
                      help="HOROVOD_CYCLE_TIME of the profiled ranks' Horovod thread (default: "
                           "the environment's, else Horovod's 1 ms)")
    prof.add_argument("--out", type=Path, required=True, help="profile.json to write")

    pred = sub.add_parser("predict", help="predict step times for a grid of clusters")
    src = pred.add_argument_group("profile (one of)")
    src.add_argument("--profile", type=Path, default=None, help="a profile.json")
    _add_model_args(pred, required=False)
    pred.add_argument("--np", default="2,8,32,64", help="ranks, comma-separated")
    pred.add_argument("--bandwidth", default="1gbit,10gbit,100gbit",
                      help="per-node link rates, comma-separated (tc units: 100mbit, 1gbit)")
    pred.add_argument("--latency-us", default="20",
                      help="latency of one ring step, microseconds, comma-separated")
    pred.add_argument("--gpus-per-node", type=positive_int, default=1,
                      help="GPUs per node: > 1 prices hierarchical all-reduces")
    pred.add_argument("--intra-bandwidth", default=None,
                      help="rate between the GPUs of a node (needed with --gpus-per-node > 1)")
    pred.add_argument("--intra-latency-us", type=_non_negative_float, default=2.0)
    pred.add_argument("--horovod-cycle-time-ms", type=_non_negative_float, default=1.0,
                      help="HOROVOD_CYCLE_TIME (default Horovod's, 1 ms)")
    pred.add_argument("--horovod-negotiation-us", type=_non_negative_float, default=0.0,
                      help="Horovod's coordination at the start of each cycle that runs "
                           "collectives, microseconds (default 0)")
    pred.add_argument("--compute-scale", type=_positive_float, default=1.0,
                      help="multiply the profile's compute and compression times (e.g. to "
                           "project a CPU profile onto a faster device; default 1)")
    pred.add_argument("--host-s-per-byte", type=_non_negative_float, default=None,
                      help="host cost per byte of an all-reduce (default: the profile's)")
    pred.add_argument("--wire-efficiency", type=_positive_float, default=None,
                      help="payload share of the link rate (default 1448/1514, TCP on Ethernet)")
    pred.add_argument("--burst-bytes", type=_non_negative_float, default=0.0,
                      help="a token bucket on each node's link, each way (tc tbf's burst, as "
                           "the benchmark's emulated links): bytes saved up while the link "
                           "idles and let through at once (default 0: a plain link)")
    pred.add_argument("--no-tcp-stack", action="store_true",
                      help="charge no network stack CPU work (default on a CPU profile: this "
                           "host's TCP over loopback, measured by the profile)")
    _link_calibration(pred, "add its network stack's CPU cost per byte to every all-reduce, "
                            "instead of the profile's TCP over loopback")
    pred.add_argument("--host-serial", action=argparse.BooleanOptionalAction, default=None,
                      help="the collectives' host work delays computation (no spare core per "
                           "rank, e.g. a CPU cluster with a rank per core; default: where the "
                           "profile's ranks used every core of a CPU node)")
    pred.add_argument("--save-profile", type=Path, default=None,
                      help="with --model: also write the profile measured here")
    pred.add_argument("--no-plot", action="store_true", help="skip plan.png")
    pred.add_argument("--out", type=Path, required=True, help="output directory")

    val = sub.add_parser("validate", help="predict a measured benchmark run and compare")
    val.add_argument("--bench", type=Path, required=True, nargs="+",
                     help="one or more results.json of the benchmark (python -m benchmarks)")
    val.add_argument("--profile", type=Path, default=None,
                     help="a profile of the run's model and batch (default: profile it here, "
                          "once per distinct model, batch and rank)")
    _link_calibration(val, "of this machine: the emulated network's CPU cost per byte, "
                           "added to every all-reduce")
    val.add_argument("--no-calibration", action="store_true",
                     help="use the profile's times as they are (no floor-based scale)")
    val.add_argument("--max-error", type=_positive_float, default=None,
                     help="exit 1 if a method's |error| exceeds this fraction (e.g. 0.15)")
    val.add_argument("--repeats", type=positive_int, default=3)
    val.add_argument("--steps", type=positive_int, default=3)
    val.add_argument("--out", type=Path, default=None, help="write validate.json and validate.md")
    return parser


def _fail(message: str) -> int:
    print(f"hvd-acp-plan: error: {message}", file=sys.stderr)
    return 2


def _read_profile(path: Path) -> dict:
    """A profile from a file, with today's fusion plans and DDP buckets
    (:func:`.replan.current_plans`)."""
    from .profile_format import check_profile, read_json
    from .replan import current_plans
    profile = read_json(path, "profile")
    check_profile(profile, str(path))
    return current_plans(profile)


def _read_link(path: Optional[Path]) -> Optional[dict]:
    from .link import read_link
    return None if path is None else read_link(path)


def _builtin(args, nps: Optional[List[int]] = None) -> dict:
    """Profile ``--model`` here as the ranks of a node will run it: every local
    rank at once, each with its threads, Horovod's thread alive (what was
    assumed is recorded in the profile and printed; :mod:`.node`)."""
    from .node import node_conditions, profile_on_node
    conditions = node_conditions(
        args.device, ranks_per_node=args.ranks_per_node, threads_per_rank=args.threads_per_rank,
        nps=nps, gpus_per_node=getattr(args, "gpus_per_node", None),
        horovod_thread=False if args.no_horovod_thread else None,
        cycle_time_ms=args.horovod_cycle_time_ms, alone=args.alone)
    return profile_on_node(args.model, args.batch_size or default_batch_size(args.model),
                           conditions, matrix_rank=args.matrix_rank, device=args.device,
                           image_size=args.image_size, seq_len=args.seq_len, steps=args.steps,
                           warmup=args.warmup, repeats=args.repeats,
                           optimizer=args.optimizer, int8_factors=args.int8_factors or None,
                           budget=args.budget)


def _assumed(profile: dict) -> str:
    """What the profile assumed about a rank, in one line."""
    from .conditions import describe_conditions
    return describe_conditions(profile)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help"):
        argv = ["predict"] + argv
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = "hvd-acp-plan " + " ".join(shlex.quote(a) for a in argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command == "profile":
            started = time.perf_counter()
            profile = _builtin(args)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(profile, indent=1) + "\n")
            print(f"profile of {args.model} written to {args.out} in "
                  f"{time.perf_counter() - started:.1f} s: forward {profile['forward_s']:.3f} s, "
                  f"backward {profile['backward_s']:.3f} s, {profile['optimizer']} update "
                  f"{profile['optimizer_s']:.3f} s; "
                  f"{_assumed(profile)}")
            return 0
        if args.command == "predict":
            return _predict(parser, args, command)
        return _validate(args)
    except FileNotFoundError as exc:
        return _fail(str(exc))
    except ValueError as exc:
        return _fail(str(exc))
    except RuntimeError as exc:
        # A node's profile whose ranks failed: their output is in the message.
        return _fail(str(exc))


def _predict(parser, args, command: str) -> int:
    if (args.profile is None) == (args.model is None):
        parser.error("predict needs exactly one of --profile FILE or --model NAME")
    if args.profile is not None and (args.int8_factors or args.budget is not None):
        parser.error("--int8-factors and --budget are the profile's settings: give them to "
                     "hvd-acp-plan profile (or predict --model)")
    try:
        nps = parse_int_list(args.np, "np")
        bws = parse_bandwidth_list(args.bandwidth)
        lats = [float(x) for x in args.latency_us.split(",") if x.strip()]
        if not lats or any(x < 0 for x in lats):
            raise ValueError(f"--latency-us must list numbers >= 0, got {args.latency_us!r}")
        intra = parse_bandwidth_list(args.intra_bandwidth)[0] if args.intra_bandwidth else None
    except ValueError as exc:
        parser.error(str(exc))
    if args.gpus_per_node > 1:
        if intra is None:
            parser.error("--gpus-per-node > 1 needs --intra-bandwidth")
        bad = [n for n in nps if n > args.gpus_per_node and n % args.gpus_per_node]
        if bad:
            parser.error(f"--np values {bad} are not multiples of --gpus-per-node "
                         f"{args.gpus_per_node}")
    started = time.perf_counter()
    if args.profile is not None:
        profile, source = _read_profile(args.profile), str(args.profile)
    else:
        profile, source = _builtin(args, nps), f"measured here ({args.model}, {args.device})"
        if args.save_profile:
            args.save_profile.write_text(json.dumps(profile, indent=1) + "\n")
    from .report import write_plan
    opts = {"cycle_time_ms": args.horovod_cycle_time_ms, "compute_scale": args.compute_scale,
            "negotiation_us": args.horovod_negotiation_us,
            "host_s_per_byte": args.host_s_per_byte, "wire_efficiency": args.wire_efficiency,
            "gpus_per_node": args.gpus_per_node, "intra_bandwidth_mbit": intra,
            "intra_latency_us": args.intra_latency_us, "host_serial": args.host_serial,
            "no_tcp_stack": args.no_tcp_stack, "burst_bytes": args.burst_bytes}
    if args.link_calibration is not None:
        opts["link"] = _read_link(args.link_calibration)
        opts["link_source"] = str(args.link_calibration)
    write_plan(profile, args.out, nps, bws, lats, opts, command=command,
               profile_source=source, plot=not args.no_plot)
    print((args.out / "plan.md").read_text())
    print(f"assumed: {_assumed(profile)}")
    print(f"wrote {args.out}/plan.json, plan.md" + ("" if args.no_plot else ", plan.png")
          + f" in {time.perf_counter() - started:.1f} s")
    return 0


def _validate(args) -> int:
    from .validate import format_validation, load_bench, validate
    benches = [(path, load_bench(path)) if path.is_file() else (path, None)
               for path in args.bench]
    missing = [str(p) for p, b in benches if b is None]
    if missing:
        raise FileNotFoundError(f"benchmark results {', '.join(missing)} not found")
    given = _read_profile(args.profile) if args.profile else None
    link = _read_link(args.link_calibration)
    cache = {}
    results, text, worst = [], [], 0.0
    for path, bench in benches:
        cfg = bench["config"]
        if given is not None:
            profile = given
        else:
            key = (cfg["model"], cfg["batch_size"], cfg["matrix_rank"],
                   cfg.get("image_size") or 128, cfg.get("seq_len") or 64,
                   cfg.get("optimizer", "sgd"))
            if key not in cache:
                from .profile import profile_builtin
                import torch
                torch.set_num_threads(int(cfg.get("threads_per_rank") or 1))
                cache[key] = profile_builtin(key[0], key[1], matrix_rank=key[2],
                                             image_size=key[3], seq_len=key[4],
                                             steps=args.steps, repeats=args.repeats,
                                             optimizer=key[5])
            profile = cache[key]
        result = validate(bench, profile, calibrate=not args.no_calibration, link=link)
        result["bench"] = str(path)
        results.append(result)
        block = format_validation(result, str(path.parent.name or path))
        text.append(block)
        print(block)
        worst = max(worst, result["worst_abs_error"] or 0.0)
    print(f"worst |error| over {len(results)} run(s): {worst * 100:.1f}%")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "validate.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "validate.md").write_text("\n".join(text))
        if cache:
            for i, profile in enumerate(cache.values()):
                (args.out / f"profile_{profile['model']}_b{profile['batch_size']}.json"
                 ).write_text(json.dumps(profile, indent=1) + "\n")
    if args.max_error is not None and worst > args.max_error:
        print(f"hvd-acp-plan: worst error {worst * 100:.1f}% exceeds --max-error "
              f"{args.max_error * 100:.1f}%", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
