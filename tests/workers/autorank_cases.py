"""matrix_rank="auto" across real ranks, under horovodrun --gloo.

Usage: autorank_cases.py DIR CASE [CASE ...]. A small MLP trains with
``AutoRank(first_interval=2, max_interval=4)`` (probes at steps 2, 6,
10, ...) on each rank's own batches, so that local gradients differ and only the
averages agree. Each rank prints ``OK <case> <rank> <json>`` when every
assertion held on it.

Cases:

- ``agree``: every rank chooses the same ranks at every probe, and the
  replicas stay bit-identical.
- ``per_rank``: every rank saves its own checkpoint at step 5 (between two
  probes) and a new optimizer loads it: the ranks come back, and training
  continues bit for bit as without the interruption.
- ``broadcast``: Horovod's ImageNet pattern: rank 0 loads its file, then
  ``broadcast_parameters`` and ``broadcast_optimizer_state``: every rank
  leaves with rank 0's ranks and factors, and the replicas stay identical.
"""
import json
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_acp
from autorank_setup import AUTO, batch, digest, mlp

torch.set_num_threads(1)

TOTAL, SAVE_AT = 12, 5


def build():
    model = mlp()
    opt = hvd_acp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(), matrix_rank=AUTO)
    return model, opt


def train(model, opt, start, stop, probes=None):
    for step in range(start, stop):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        probing = opt.reducer.state.probing
        opt.step()
        if probes is not None and probing:
            probes.append((step, opt.chosen_ranks()))


def same_everywhere(value, what):
    gathered = hvd.allgather_object(value, name=f"check.{what}")
    assert all(v == gathered[0] for v in gathered), f"{what} differs between ranks: {gathered}"


def case_agree(directory):
    model, opt = build()
    probes = []
    train(model, opt, 0, TOTAL, probes)
    assert [step for step, _ in probes] == [2, 6, 10], probes
    same_everywhere(probes, "probes")
    same_everywhere(digest(model), "weights")
    return {"ranks": probes[-1][1], "probes": len(probes)}


def checkpoint_path(directory, rank):
    return os.path.join(directory, f"auto_rank{rank}.pt")


def case_per_rank(directory):
    model, opt = build()
    train(model, opt, 0, TOTAL)
    uninterrupted, final_ranks = digest(model), opt.chosen_ranks()
    del opt

    model, opt = build()
    train(model, opt, 0, SAVE_AT)
    saved_ranks = opt.chosen_ranks()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
               checkpoint_path(directory, hvd.rank()))
    del opt

    model, opt = build()
    checkpoint = torch.load(checkpoint_path(directory, hvd.rank()), weights_only=False)
    assert checkpoint["optimizer"]["hvd_acp"]["ranks"] == saved_ranks
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    assert opt.chosen_ranks() == saved_ranks, (opt.chosen_ranks(), saved_ranks)
    train(model, opt, SAVE_AT, TOTAL)
    assert opt.chosen_ranks() == final_ranks
    assert digest(model) == uninterrupted, "resumed run left the uninterrupted trajectory"
    same_everywhere(digest(model), "weights")
    return {"ranks": saved_ranks}


def case_broadcast(directory):
    model, opt = build()
    train(model, opt, 0, SAVE_AT)
    saved_ranks = opt.chosen_ranks()
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   checkpoint_path(directory, "root"))
    hvd.allgather_object(0, name="saved")
    del opt

    model, opt = build()
    fresh_ranks = opt.chosen_ranks()
    if hvd.rank() == 0:
        checkpoint = torch.load(checkpoint_path(directory, "root"), weights_only=False)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.chosen_ranks() == saved_ranks != fresh_ranks, (opt.chosen_ranks(), saved_ranks)
    assert opt.reducer.step_count == SAVE_AT
    train(model, opt, SAVE_AT, TOTAL)
    same_everywhere(digest(model), "weights")
    same_everywhere(opt.chosen_ranks(), "ranks")
    return {"ranks": saved_ranks}


CASES = {"agree": case_agree, "per_rank": case_per_rank, "broadcast": case_broadcast}


def main():
    directory, names = sys.argv[1], sys.argv[2:]
    hvd.init()
    for name in names:
        result = CASES[name](directory)
        print(f"OK {name} {hvd.rank()} {json.dumps(result, sort_keys=True)}", flush=True)


if __name__ == "__main__":
    main()
