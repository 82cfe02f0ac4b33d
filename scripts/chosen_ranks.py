"""The ranks ``matrix_rank="auto"`` chooses for a built-in model, and the bytes.

    .venv/bin/python scripts/chosen_ranks.py resnet50 --out bench-results/autorank/chosen_resnet50.json

One forward and backward pass of the model on the benchmark's synthetic batch
(``hvd_acp.plan.models.build_model``, one process: its gradient is the
average), then the probe ``hvd-acp-plan profile --matrix-rank auto`` runs
(:func:`hvd_acp.plan.profile.probed_state`). Prints the elements one rank sends per P and Q step at rank 4,
rank 32 and auto, and writes the ranks and the energy each keeps as JSON.
"""
from __future__ import annotations

import argparse
import json

import torch

from hvd_acp.compression import Phase
from hvd_acp.plan.models import DEFAULT_BATCH_SIZE, MODELS, build_model
from hvd_acp.plan.profile import probed_state


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    spec = build_model(args.model, args.batch_size or DEFAULT_BATCH_SIZE[args.model])
    spec.loss_fn(spec.model, spec.batch).backward()
    named = list(spec.model.named_parameters())
    result = {"model": args.model, "dense": sum(p.numel() for _, p in named)}
    for label, rank in (("rank4", 4), ("rank32", 32), ("auto", "auto")):
        state = probed_state(named, rank)
        result[label] = {"elements_P": state.wire_elements(Phase.P),
                         "elements_Q": state.wire_elements(Phase.Q),
                         "ranks": state.ranks(), "kept": dict(state.kept_energy)}
        print(f"{args.model} {label}: {result[label]['elements_P']:,} elements per P step, "
              f"{result[label]['elements_Q']:,} per Q step (S-SGD {result['dense']:,})")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=1)
    return result


if __name__ == "__main__":
    main()
