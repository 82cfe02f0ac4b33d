"""``hvd-acp-ab`` / ``python -m hvd_acp.ab``: will ACP-SGD pay here? Measured.

Run it inside the launch you train with, on your hosts and devices::

    horovodrun -np 16 -H a:8,b:8 hvd-acp-ab --model resnet50 --device cuda
    torchrun --nnodes 2 --nproc-per-node 8 ... -m hvd_acp.ab --ddp --model my.models:build

One job times every method of ``--methods`` in rotating rounds on the same
processes and devices, with no emulation: what it reports is what your
cluster does. Rank 0 prints a table (median step with its interval, samples
per second, bytes per step, ACP-SGD's speed-up over each other method with a
verdict) and a one-line recommendation, and writes ``ab.json`` and ``ab.md``
to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from ..methods import HOROVOD, KEYS, TORCHRUN, get
from ..plan.models import (add_model_arguments, build_model, default_batch_size,
                           default_matrix_rank)
from ..plan.units import add_count, positive_int
from . import report
from .runner import ACP_KEYS, Settings, measure
from .world import start

#: ``--methods`` by default: S-SGD in fp32 and fp16, Power-SGD and ACP-SGD.
DEFAULT_METHODS = {HOROVOD: ("ssgd", "ssgd-fp16", "powersgd", "acp"),
                   TORCHRUN: ("ddp", "ddp-fp16", "powersgd-ddp-batched", "acp-ddp")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hvd-acp-ab",
        description="Time S-SGD, Power-SGD and ACP-SGD on this launch's ranks and devices "
                    "in rotating rounds, and say whether ACP-SGD pays here. Run it under "
                    "horovodrun, or under torchrun with --ddp.")
    add_model_arguments(p, default="resnet50")
    p.add_argument("--ddp", action="store_true",
                   help="measure the DDP methods (torch.distributed, under torchrun) "
                        "instead of Horovod's")
    p.add_argument("--methods", default=None,
                   help="comma-separated keys of hvd_acp.methods (default: "
                        f"{','.join(DEFAULT_METHODS[HOROVOD])}; with --ddp: "
                        f"{','.join(DEFAULT_METHODS[TORCHRUN])})")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="cuda: one device per local rank (default: cuda where torch sees "
                        "one, else cpu)")
    p.add_argument("--rounds", type=positive_int, default=6,
                   help="rounds, every method once per round (default 6: the fewest "
                        "that give a 95%% interval)")
    add_count(p, "--steps", 5, "timed steps per method and round")
    add_count(p, "--warmup", 3, "untimed steps before them", minimum=0)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--budget", type=_share, default=None,
                   help="ACP-SGD's methods (acp, acp-ddp) at this share of S-SGD's fp32 "
                        "bytes per step, as hvd_acp.DistributedOptimizer(budget=X) fits it "
                        "to the model (Adam-family optimizers; e.g. 0.077 for 1/13); the "
                        "other methods keep their defaults")
    p.add_argument("--int8-factors", action="store_true",
                   help="ACP-SGD's methods with their factors in 8-bit lanes "
                        "(int8_factors=True; both factors every step, as under AdamW)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads per rank on CPUs (default: the node's cores over "
                        "its ranks)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for ab.json and ab.md (rank 0 writes them)")
    p.add_argument("--profile", action="store_true",
                   help="first profile the model in one process on rank 0's device, "
                        "nothing communicated (the floor, shown in the table), and write "
                        "it to --out/profile.json for hvd-acp-plan predict --profile")
    return p


def _share(text: str) -> float:
    """``--budget``: a share of S-SGD's bytes in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a share of S-SGD's bytes in (0, 1], got {text}")
    return value


def parse_methods(text: Optional[str], launcher: str) -> List[str]:
    """``--methods`` checked against the registry and the launch: every method
    must run under ``launcher``. ``ValueError`` naming the fix otherwise."""
    keys: List[str] = []
    items = DEFAULT_METHODS[launcher] if text is None else text.split(",")
    for item in (part.strip().lower() for part in items):
        if item and item not in keys:
            keys.append(item)
    if not keys:
        raise ValueError(f"--methods names no method; choose from {', '.join(KEYS)}")
    for key in keys:
        method = get(key)
        if method.launcher != launcher:
            where = ("torchrun, with --ddp" if method.launcher == TORCHRUN
                     else "horovodrun, without --ddp")
            raise ValueError(f"--methods {key} runs under {where}; this run measures the "
                             f"{'DDP' if launcher == TORCHRUN else 'Horovod'} methods")
    return keys


def _threads(requested: Optional[int], local_size: int) -> int:
    if requested is not None:
        return requested
    return max(1, (os.cpu_count() or 1) // max(1, local_size))


def _versions() -> Dict[str, str]:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import horovod
        found["horovod"] = horovod.__version__
    except ImportError:
        pass
    return found


def _profile(world, spec, matrix_rank: int, args, progress) -> Optional[Dict[str, Any]]:
    """Rank 0 profiles one step of the model alone (hvd_acp.plan's profiler,
    nothing communicated) while the other ranks wait; the profile on rank 0,
    None elsewhere."""
    import copy
    profile = None
    if world.rank == 0:
        from ..plan.models import build_optimizer, to_device
        from ..plan.profile import profile_model
        progress("profiling one process (hvd-acp-plan's profile, nothing communicated)")
        model = copy.deepcopy(spec.model).to(world.device)
        profile = profile_model(model, to_device(spec.batch, world.device), spec.loss_fn,
                                matrix_rank=matrix_rank, device=str(world.device),
                                optimizer=build_optimizer(args.optimizer, model.parameters(),
                                                          args.lr),
                                description=spec.description)
        profile.update(model=args.model, batch_size=spec_batch_size(args),
                       image_size=args.image_size, seq_len=args.seq_len)
    world.barrier()
    return profile


def spec_batch_size(args) -> int:
    """The batch size per rank that ``args`` ask for."""
    return args.batch_size or default_batch_size(args.model)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    launcher = TORCHRUN if args.ddp else HOROVOD
    try:
        methods = parse_methods(args.methods, launcher)
    except ValueError as exc:
        print(f"hvd-acp-ab: error: {exc}", file=sys.stderr)
        return 2
    if args.warmup < 0:
        print("hvd-acp-ab: error: --warmup must be >= 0", file=sys.stderr)
        return 2
    if args.budget is not None and args.int8_factors:
        print("hvd-acp-ab: error: --budget picks the 8-bit factors where they fit; leave out "
              "--int8-factors", file=sys.stderr)
        return 2
    if args.budget is not None and args.optimizer == "sgd":
        print("hvd-acp-ab: error: --budget picks settings for Adam-family optimizers "
              "(--optimizer adamw); with SGD give --matrix-rank", file=sys.stderr)
        return 2
    if args.budget is not None and not any(key in ACP_KEYS for key in methods):
        print(f"hvd-acp-ab: error: --budget applies to {' and '.join(ACP_KEYS)}, and "
              "--methods names neither", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    world = start(launcher, device)
    if world.size < 2:
        world.shutdown()
        print("hvd-acp-ab: error: one rank: nothing is communicated. Run it under "
              + ("torchrun --nproc-per-node N -m hvd_acp.ab --ddp ..." if args.ddp
                 else "horovodrun -np N hvd-acp-ab ..."), file=sys.stderr)
        return 2
    threads = _threads(args.threads, world.local_size) if device == "cpu" else \
        torch.get_num_threads()
    torch.set_num_threads(threads)
    batch_size = spec_batch_size(args)
    matrix_rank = args.matrix_rank or default_matrix_rank(args.model, args.optimizer)
    spec = build_model(args.model, batch_size, image_size=args.image_size,
                       seq_len=args.seq_len, data_seed=world.rank)
    acp_options: Dict[str, Any] = {}
    if args.budget is not None:
        acp_options["budget"] = args.budget
    if args.int8_factors:
        acp_options["int8_factors"] = True
    settings = Settings(methods=methods, rounds=args.rounds, steps=args.steps,
                        warmup=args.warmup, matrix_rank=matrix_rank, lr=args.lr,
                        optimizer=args.optimizer, acp_options=acp_options)
    config: Dict[str, Any] = {
        "model": args.model, "model_description": spec.description, "ranks": world.size,
        "launcher": "horovodrun" if launcher == HOROVOD else "torchrun",
        "device": str(world.device.type), "batch_size": batch_size,
        "matrix_rank": matrix_rank, "rounds": args.rounds, "steps": args.steps,
        "warmup": args.warmup, "lr": args.lr, "optimizer": args.optimizer, "threads": threads,
        "acp_options": acp_options,
        "ranks_per_node": world.local_size, "versions": _versions()}

    def progress(line: str) -> None:
        if world.rank == 0:
            print(f"hvd-acp-ab: {line}", file=sys.stderr, flush=True)

    profile = _profile(world, spec, matrix_rank, args, progress) if args.profile else None
    measured = measure(world, spec, settings, progress)
    if world.rank == 0:
        summary = report.summarize(measured, batch_size * world.size)
        if profile is not None:
            summary["floor_s"] = (profile["forward_s"] + profile["backward_s"]
                                  + profile["optimizer_s"])
        text = report.markdown(config, summary)
        print(text, flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "ab.json").write_text(json.dumps(
                {"config": config, "measured": measured, "summary": summary}, indent=1))
            (args.out / "ab.md").write_text(text)
            if profile is not None:
                (args.out / "profile.json").write_text(json.dumps(profile, indent=1) + "\n")
    world.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
