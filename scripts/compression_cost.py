"""What ACP-SGD's compression costs per step in one process: seconds, operator calls, FLOPs.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/compression_cost.py --model resnet50 --batch-size 4
    OMP_NUM_THREADS=1 .venv/bin/python scripts/compression_cost.py --model bert-base \
        --batch-size 8 --inner adamw                # the defaults for AdamW

One process, no communication (hvd_acp.LocalCommunicator): the benchmark's
model and batch, trained with hvd_acp.DistributedOptimizer. Prints the
median over ``--steps`` steps of the reducer's compression seconds (the
maths in the hooks and in step(): projection, residual, orthonormalization,
reconstruction) and of the step-ahead shift put on and taken off, and the
operator calls (``aten::`` events of torch.profiler) per step over plain
torch SGD's, and the kernels among them (views, metadata and allocations
left out), and the floating-point operations per step over plain torch's
(``torch.utils.flop_counter.FlopCounterMode``: matrix products and
convolutions; the QR of the orthonormalization is not counted by it). To
compare two versions on the same host, put a folder holding
the other version's ``hvd_acp`` package (and nothing else) on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import statistics
import time

import sys
from pathlib import Path
from typing import Dict

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

# Appended, not inserted: an hvd_acp on PYTHONPATH (the version to compare)
# comes first; the counting is this checkout's.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import hvd_acp  # noqa: E402
from benchmarks.worker import count_calls  # noqa: E402
from hvd_acp.plan.models import MODELS, build_model, default_matrix_rank  # noqa: E402
from hvd_acp.plan.units import matrix_rank_type  # noqa: E402


def operator_calls(step, steps: int = 2) -> Dict[str, float]:
    """Operator calls and kernels per step (see benchmarks.worker.count_calls)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return {key: value / steps for key, value in count_calls(prof.events()).items()}


def flops(step, steps: int = 2) -> float:
    """Floating-point operations per step that FlopCounterMode counts."""
    with FlopCounterMode(display=False) as counter:
        for _ in range(steps):
            step()
    return counter.get_total_flops() / steps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", choices=MODELS)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--matrix-rank", type=matrix_rank_type, default=None,
                        help="an int rank or a share in (0, 1); default: the model's "
                             "rank under SGD, the library's adaptive defaults under AdamW")
    parser.add_argument("--inner", choices=("sgd", "adamw"), default="sgd",
                        help="the wrapped optimizer: SGD with momentum 0.9, or AdamW")
    parser.add_argument("--both-factors", choices=("on", "off"), default=None,
                        help="send both factors every step (default: the library's choice)")
    parser.add_argument("--int8-factors", action="store_true",
                        help="int8_factors=True: the factors as 8-bit levels (the quantization "
                             "is in the compression's time; packing the words is the "
                             "communicator's, not timed here)")
    parser.add_argument("--budget", type=float, default=None,
                        help="budget=...: the share of S-SGD's bytes a step may send (the "
                             "library picks the rank and the wire)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--optimizer", choices=("acp", "powersgd"), default="acp",
                        help="hvd_acp.DistributedOptimizer (ACP-SGD) or "
                             "hvd_acp.PowerSGDOptimizer (Power-SGD), the same arguments")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    adaptive = args.inner == "adamw"
    rank = args.matrix_rank or (None if adaptive else default_matrix_rank(args.model))
    settings = {} if rank is None else {"matrix_rank": rank}
    if args.both_factors is not None:
        settings["both_factors"] = args.both_factors == "on"
    if args.int8_factors:
        settings["int8_factors"] = True
    if args.budget is not None:
        settings["budget"] = args.budget

    def inner_optimizer(params):
        if adaptive:
            return torch.optim.AdamW(params, lr=1e-4)
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    spec = build_model(args.model, args.batch_size)
    plain = inner_optimizer(spec.model.parameters())

    def plain_step():
        plain.zero_grad()
        spec.loss_fn(spec.model, spec.batch).backward()
        plain.step()

    plain_step()
    floor_calls = operator_calls(plain_step)
    floor_flops = flops(plain_step)

    spec = build_model(args.model, args.batch_size)
    inner = inner_optimizer(spec.model.parameters())
    wrapper = (hvd_acp.DistributedOptimizer if args.optimizer == "acp"
               else hvd_acp.PowerSGDOptimizer)
    opt = wrapper(inner, spec.model.named_parameters(), **settings,
                  communicator=hvd_acp.LocalCommunicator())
    reducer, shift = opt._reducer, opt._step_ahead

    def step():
        opt.zero_grad()
        spec.loss_fn(spec.model, spec.batch).backward()
        opt.step()

    for _ in range(3):
        step()
    compression, shifting = [], []
    for _ in range(args.steps):
        before = reducer.compression_seconds
        step()
        compression.append(reducer.compression_seconds - before)
        start = time.perf_counter()
        shift.apply()
        shift.restore()
        shifting.append(time.perf_counter() - start)
        shift.after_step()
    calls = operator_calls(step)
    extra_flops = flops(step) - floor_flops
    resolved = opt.settings
    print(f"{hvd_acp.__file__}: {wrapper.__name__} over {type(inner).__name__}, {args.model}, "
          f"batch {args.batch_size}, matrix_rank {resolved.matrix_rank}"
          f"{', both factors' if resolved.both_factors else ''}"
          f"{', int8 factors' if resolved.int8_factors else ''}: "
          f"compression {statistics.median(compression) * 1e3:.1f} ms per step "
          f"(min {min(compression) * 1e3:.1f}), step-ahead shift on and off "
          f"{statistics.median(shifting) * 1e3:.1f} ms, operator calls per step "
          f"{calls['ops']:.0f} ({calls['ops'] - floor_calls['ops']:.0f} over the plain step's "
          f"{floor_calls['ops']:.0f}), kernels {calls['kernels']:.0f} "
          f"({calls['kernels'] - floor_calls['kernels']:.0f} over the plain step's "
          f"{floor_calls['kernels']:.0f}), GFLOP per step over the plain step's "
          f"{extra_flops / 1e9:.2f} (the plain step's {floor_flops / 1e9:.2f})")


if __name__ == "__main__":
    main()
