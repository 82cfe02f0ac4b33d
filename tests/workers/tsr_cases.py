"""The TSR-style optimizer under horovodrun, at any world size.

``python tsr_cases.py replicas``: a small model with an embedding trains
with AdamW's hyperparameters on per-rank seeded batches, set up as the
examples do (``hvd.broadcast_parameters``, ``hvd.broadcast_optimizer_state``),
over refreshes of the bases (steps 0, 3, 6; the embedding's at 0, 2, 4, 6).
The replicas must be bit-identical after every step. With float32 on the
wire every rank also runs a one-process simulation of all the ranks (the
maths of :mod:`hvd_acp.baselines.maths`, the sums in rank order) and
reports how far the run is from it; with float16 (the default) the bytes
halve. A checkpoint taken after step 4 and loaded into a fresh model and
optimizer trains on to the bits of the run that did not stop. Rank 0 prints
``RESULT {json}`` per run; every rank prints ``OK replicas <rank>``.

``python tsr_cases.py mismatch``: settings that differ between ranks, a bad
setting on one rank, an embedding name that names no matrix, and weights
that differ at the first step raise on every rank; each rank prints
``CAUGHT <case> rank=<rank> <message>`` and ``OK mismatch <rank>``.
"""
from __future__ import annotations

import copy
import json
import sys

import horovod.torch as hvd
import torch
from torch import nn

import hvd_acp
from hvd_acp import methods
from hvd_acp.baselines import maths
from worker_io import report
# The model, its batches and the replicas' check of the other baselines' cases.
import baseline_cases
from baseline_cases import LR, adamw, digest, loss_of, make_model, same_everywhere, train_step

torch.set_num_threads(1)

STEPS = 8
#: Refreshes at 0, 3, 6; the embedding's at 0, 2, 4, 6.
SETTINGS = {"core_rank": 2, "refresh_period": 3, "embedding_core_rank": 3,
            "embedding_refresh_period": 2}



def build(model: nn.Module, **settings):
    """The registry's TSR (which names the model's embedding) around AdamW."""
    return baseline_cases.build("tsr", model, **dict(SETTINGS, **settings))


# --------------------------------------------------------------- simulation
def reference(size: int) -> nn.Module:
    """All ranks in one process on a model of matrices only, float32 on the
    wire: each rank's clipped gradient, its cores and sketches, their mean
    in rank order, Adam in the core, the refresh."""
    model = make_model(bias=False, seed=1)
    named = list(model.named_parameters())
    # name: (index, r, K); the embedding takes its own.
    plan = {"embed.weight": (0, 3, 2), "hidden.weight": (1, 2, 3), "out.weight": (2, 2, 3)}
    assert [n for n, _ in named] == list(plan)
    bases, moments = {}, {n: (torch.zeros(r, r), torch.zeros(r, r))
                          for n, (_, r, _) in plan.items()}

    def mean(parts):
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total * (1.0 / size)

    for step in range(STEPS):
        grads = {name: [] for name in plan}
        for rank in range(size):
            model.zero_grad()
            loss_of(model, rank, step).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for name, p in named:
                grads[name].append(p.grad.reshape(p.shape[0], -1).clone())
        with torch.no_grad():
            for name, p in named:
                index, r, period = plan[name]
                if name in bases:
                    core = mean([maths.project(g, *bases[name]) for g in grads[name]])
                    maths.core_adam_(p, core, *bases[name], *moments[name], step, lr=LR,
                                     betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, scale=1.0)
                if step % period == 0:
                    draws = maths.sketch_draws(p.shape[0], p[0].numel(), r,
                                               maths.sketch_seed(0, step, index))
                    sketched = [maths.sketches(g, *draws) for g in grads[name]]
                    new = (maths.orthonormal_basis(mean([y for y, _ in sketched])),
                           maths.orthonormal_basis(mean([z for _, z in sketched])))
                    if name in bases:
                        moments[name] = maths.rotate_moments(*moments[name], *bases[name], *new)
                    bases[name] = new
    return model


# -------------------------------------------------------------------- runs
def run_matrices(fp16_wire: bool) -> dict:
    rank, size = hvd.rank(), hvd.size()
    model = make_model(bias=False, seed=1 + rank)        # the broadcast makes them rank 0's
    optimizer = build(model, fp16_wire=fp16_wire)
    assert optimizer.settings.embedding_names == ("embed.weight",)
    for step in range(STEPS):
        train_step(model, optimizer, rank, step)
        assert same_everywhere(model), f"replicas differ after step {step}"
    result = {"key": "fp16" if fp16_wire else "fp32", "digest": digest(model),
              "bytes_sent": optimizer.comm_stats.bytes_sent,
              "expected_bytes": sum(optimizer.step_bytes(t) for t in range(STEPS))}
    stats = optimizer.comm_stats
    assert stats.bytes_sent == stats.bytes_received == result["expected_bytes"]
    assert stats.allreduces == STEPS and stats.allgathers == 0
    if not fp16_wire:
        expected = reference(size)
        result["max_difference"] = max(float((mine - theirs).abs().max())
                                        for mine, theirs in zip(model.parameters(),
                                                                expected.parameters()))
    return result


def run_resume() -> dict:
    """Stop after 4 steps, load into a fresh model and optimizer, go on."""
    rank, stop = hvd.rank(), 4
    model = make_model(seed=1 + rank)
    optimizer = build(model)
    for step in range(stop):
        train_step(model, optimizer, rank, step)
    weights = copy.deepcopy(model.state_dict())
    saved = copy.deepcopy(optimizer.state_dict())
    for step in range(stop, STEPS):
        train_step(model, optimizer, rank, step)
    assert same_everywhere(model)
    again = make_model(seed=7)
    resumed = build(again)
    again.load_state_dict(weights)
    resumed.load_state_dict(saved)
    assert resumed.step_count == stop
    for step in range(stop, STEPS):
        train_step(again, resumed, rank, step)
    assert same_everywhere(again)
    # The 1-D tensors' state was created for them alone.
    assert not any(p in resumed.optimizer.state for _, p in resumed.compressed)
    return {"key": "resume", "digest": digest(model), "resumed_digest": digest(again)}


def replicas() -> None:
    for run in (lambda: run_matrices(False), lambda: run_matrices(True), run_resume):
        result = run()
        if hvd.rank() == 0:
            report("RESULT " + json.dumps(result))
    report(f"OK replicas {hvd.rank()}")


# ----------------------------------------------------------------- mismatch
def mismatch() -> None:
    rank, size = hvd.rank(), hvd.size()
    cases = {"refresh_period": {"refresh_period": 10 + rank},
             "bad_setting": {"core_rank": 0 if rank == size - 1 else 4},
             "embedding_names": {"embedding_names": ["embed.wieght"]}}
    for case, settings in cases.items():
        model = make_model()
        try:
            hvd_acp.TSROptimizer(adamw(model), model.named_parameters(), **settings)
        except ValueError as exc:
            report(f"CAUGHT {case} rank={rank} {exc}")
        else:
            raise AssertionError(f"{case}: no ValueError on rank {rank}")
    # Weights that differ (no hvd.broadcast_parameters): the first step raises.
    model = make_model(seed=rank)
    optimizer = methods.get("tsr").build(model, adamw(model)).optimizer
    loss_of(model, rank, 0).backward()
    try:
        optimizer.step()
    except RuntimeError as exc:
        report(f"CAUGHT start rank={rank} {exc}")
    else:
        raise AssertionError(f"start: no RuntimeError on rank {rank}")
    # Nothing is left in flight: a correct setup trains.
    model = make_model()
    optimizer = build(model)
    for step in range(2):
        train_step(model, optimizer, rank, step)
    assert same_everywhere(model)
    report(f"OK mismatch {rank}")


def main(argv) -> int:
    hvd.init()
    {"replicas": replicas, "mismatch": mismatch}[argv[0]]()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
