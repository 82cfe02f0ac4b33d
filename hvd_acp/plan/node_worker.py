"""One rank of a node's profile (:mod:`.node`): ``python -m hvd_acp.plan.node_worker``.

Every rank builds the model (its own synthetic batch), waits until every
rank has, then profiles it at the same moment as the others
(:func:`.profile.profile_builtin`), and keeps training until every rank is
done, so that no rank is measured on an emptier node. With ``--horovod``
(under ``horovodrun``) Horovod is initialized first and its background
thread runs throughout the profile (nothing is all-reduced); then every
rank times a float16 and a float32 all-reduce at once (what the float16
one costs more per byte), shuts Horovod down and times training steps
again, all at once,
without it: the step the DDP hook's ranks compute. Each rank writes
``rank<k>.json`` into ``--dir`` (rank 0 with the profile).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import List, Optional

#: Seconds a rank waits for the others to arrive or to finish.
WAIT_S = 1800.0


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hvd_acp.plan.node_worker")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--horovod", action="store_true")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--size", type=int, default=1)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--matrix-rank", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--int8-factors", action="store_true")
    p.add_argument("--budget", type=float, default=None)
    return p.parse_args(argv)


def _all_there(directory: Path, prefix: str, size: int) -> bool:
    return all((directory / f"{prefix}.{rank}").exists() for rank in range(size))


def _arrive(directory: Path, prefix: str, rank: int, size: int) -> None:
    """Mark this rank's arrival and wait for every rank's."""
    (directory / f"{prefix}.{rank}").touch()
    deadline = time.monotonic() + WAIT_S
    while not _all_there(directory, prefix, size):
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: the other ranks did not arrive at {prefix!r}")
        time.sleep(0.02)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parse(argv)
    import torch
    torch.set_num_threads(args.threads)
    rank, size = args.rank, args.size
    if args.horovod:
        import horovod.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    device = args.device
    if device.startswith("cuda") and torch.cuda.device_count() > 1 and size > 1:
        device = f"cuda:{rank % torch.cuda.device_count()}"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))

    from .models import build_model, build_optimizer, to_device
    from .profile import MIN_TIMED_S, profile_builtin, time_training_steps
    from .units import matrix_rank_type
    matrix_rank = None if args.matrix_rank is None else matrix_rank_type(args.matrix_rank)
    spec = build_model(args.model, args.batch_size, image_size=args.image_size,
                       seq_len=args.seq_len, data_seed=rank)
    _arrive(args.dir, "ready", rank, size)

    result = {"rank": rank, "pid": os.getpid(), "threads": torch.get_num_threads()}
    started = time.time()
    profile = profile_builtin(args.model, args.batch_size, matrix_rank=matrix_rank,
                              device=device, image_size=args.image_size, seq_len=args.seq_len,
                              steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                              spec=spec, optimizer=args.optimizer,
                              int8_factors=args.int8_factors or None, budget=args.budget)
    result["window"] = [started, time.time()]
    result["step_s"] = profile["forward_s"] + profile["backward_s"] + profile["optimizer_s"]
    result["profile"] = profile     # every rank's: the node keeps the slowest one's
    dev = torch.device(device)
    model, batch = spec.model.to(dev), to_device(spec.batch, dev)
    optimizer = build_optimizer(args.optimizer, model.parameters())

    def train(steps: int, warmup: int, min_timed_s: float = MIN_TIMED_S) -> dict:
        return time_training_steps(model, batch, spec.loss_fn, optimizer, dev, steps, warmup,
                                   min_timed_s=min_timed_s)
    _finish(args.dir, "done", rank, size, train)
    if args.horovod and size > 1:
        # Every rank at once, after the last rank's training: what a float16
        # all-reduce costs over a float32 one on this node's collective.
        from .profile import fp16_reduce_s_per_byte

        def allreduce(tensor):
            hvd.allreduce_(tensor, op=hvd.Average, name=f"fp16-cost.{tensor.dtype}")
        result["fp16_reduce_s_per_byte"] = fp16_reduce_s_per_byte(allreduce, size, dev)
    if args.horovod:
        hvd.shutdown()
        _arrive(args.dir, "plain", rank, size)
        timed = train(args.steps, args.warmup)
        result["plain_step_s"] = statistics.median(
            f + b + u for f, b, u in zip(timed["forward_s"], timed["backward_s"],
                                         timed["optimizer_s"]))
        _finish(args.dir, "plain-done", rank, size, train)
    path = args.dir / f"rank{rank}.json"
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(result))
    partial.rename(path)
    return 0


def _finish(directory: Path, prefix: str, rank: int, size: int, train) -> None:
    """Mark this rank done and keep training until every rank is."""
    (directory / f"{prefix}.{rank}").touch()
    deadline = time.monotonic() + WAIT_S
    while not _all_there(directory, prefix, size) and time.monotonic() < deadline:
        train(1, 0, 0.0)


if __name__ == "__main__":
    sys.exit(main())
