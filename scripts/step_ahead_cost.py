"""What step-ahead error feedback and the local residual cost in compute.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/step_ahead_cost.py --model resnet50 --batch-size 16

One process, no communication (hvd_acp.LocalCommunicator): the benchmark's
model and batch, trained with plain torch SGD (the compute floor), with
hvd_acp.DistributedOptimizer at ``step_ahead=0`` and at the default. The
three run in rounds, in an order that rotates every round, each for the same
number of timed steps; a round's figure is each setting's median step, and
the ratios are taken inside each round (paired, so the machine's drift
cancels). Prints the median over rounds with the range of the rounds.
The network part of a step is untouched by step-ahead (same bytes, same
buffers, same launch points): this is the whole of its cost.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/step_ahead_cost.py --model resnet50 --shift-only

times the shift alone instead: after one training step (residuals and
momentum in place), ``--steps`` times putting the shift on and taking it
off again (``StepAhead.apply`` then ``restore``), per round, against the
compute floor's median step of the same round: the share of the floor that
step-ahead's own passes over the weights take.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import hvd_acp
from hvd_acp.plan.models import MODELS, build_model, default_matrix_rank


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", choices=MODELS)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--matrix-rank", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per setting per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--shift-only", action="store_true",
                        help="time putting the shift on and off alone, against the floor")
    return parser.parse_args(argv)


SETTINGS = ("floor", "acp, step_ahead=0", "acp, default")


def make(setting, spec, matrix_rank):
    inner = torch.optim.SGD(spec.model.parameters(), lr=0.01, momentum=0.9)
    if setting == "floor":
        return inner
    extra = {"step_ahead": 0.0} if setting.endswith("=0") else {}
    return hvd_acp.DistributedOptimizer(inner, spec.model.named_parameters(),
                                        matrix_rank=matrix_rank,
                                        communicator=hvd_acp.LocalCommunicator(), **extra)


def time_steps(spec, opt, steps, warmup):
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad()
        spec.loss_fn(spec.model, spec.batch).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_shift(spec, matrix_rank, repeats):
    """Median seconds of one StepAhead.apply() + restore() after a training step."""
    opt = make("acp, default", spec, matrix_rank)
    opt.zero_grad()
    spec.loss_fn(spec.model, spec.batch).backward()
    opt.step()
    shift = opt._step_ahead
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        shift.pending = True
        shift.apply()
        shift.restore()
        times.append(time.perf_counter() - start)
    opt.close()
    return statistics.median(times)


def main_shift(args, matrix_rank):
    shares, costs = [], []
    for rnd in range(args.rounds):
        spec = build_model(args.model, args.batch_size)
        floor = time_steps(spec, make("floor", spec, matrix_rank), args.steps, args.warmup)
        cost = time_shift(build_model(args.model, args.batch_size), matrix_rank,
                          max(args.steps, 5))
        shares.append(cost / floor)
        costs.append(cost)
        print(f"round {rnd + 1}: floor {floor:.3f} s, shift on and off {cost * 1e3:.1f} ms "
              f"({100 * cost / floor:.2f}% of the floor)", flush=True)
    shares.sort()
    print(f"{args.model}, batch {args.batch_size}, matrix rank {matrix_rank}, "
          f"{args.rounds} rounds: step-ahead's shift on and off "
          f"{statistics.median(costs) * 1e3:.1f} ms per step, median "
          f"{100 * statistics.median(shares):.2f}% of the floor "
          f"(rounds {100 * shares[0]:.2f}% - {100 * shares[-1]:.2f}%)")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    matrix_rank = args.matrix_rank or default_matrix_rank(args.model)
    if args.shift_only:
        main_shift(args, matrix_rank)
        return
    per_round = []
    for rnd in range(args.rounds):
        order = SETTINGS[rnd % 3:] + SETTINGS[:rnd % 3]
        figures = {}
        for setting in order:
            spec = build_model(args.model, args.batch_size)
            opt = make(setting, spec, matrix_rank)
            figures[setting] = time_steps(spec, opt, args.steps, args.warmup)
            if setting != "floor":
                opt.close()
        per_round.append(figures)
        print(f"round {rnd + 1}: " + ", ".join(f"{k} {v:.3f} s" for k, v in figures.items()),
              flush=True)
    print(f"{args.model}, batch {args.batch_size}, matrix rank {matrix_rank}, "
          f"{args.rounds} rounds of {args.steps} steps:")
    for a, b in (("acp, step_ahead=0", "floor"), ("acp, default", "floor"),
                 ("acp, default", "acp, step_ahead=0")):
        ratios = sorted(r[a] / r[b] for r in per_round)
        print(f"  {a} / {b}: median {statistics.median(ratios):.3f} "
              f"(rounds {ratios[0]:.3f} - {ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
