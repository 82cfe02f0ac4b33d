"""DiLoCo and the DeMo-style optimizer under horovodrun, at any world size.

``python baseline_cases.py replicas``: each method trains a small model with
AdamW on per-rank seeded batches, set up as the examples do
(``hvd.broadcast_parameters``, ``hvd.broadcast_optimizer_state``). Every
rank regenerates every rank's batches and runs the same training as a
one-process simulation of all the ranks (the maths of
:mod:`hvd_acp.baselines.maths`, the sums in rank order) and checks the
distributed run against it; the replicas must be bit-identical after every
DeMo step and after every DiLoCo outer step, and differ between DiLoCo's
outer steps. Rank 0 prints ``RESULT {json}`` per method (bytes sent and
received, collectives); every rank prints ``OK replicas <rank>``.

``python baseline_cases.py mismatch``: settings that differ between ranks,
and weights that differ at the first step, raise on every rank; each rank
prints ``CAUGHT <case> rank=<rank> <message>`` and ``OK mismatch <rank>``.
"""
from __future__ import annotations

import copy
import hashlib
import json
import sys

import horovod.torch as hvd
import torch
from torch import nn

import hvd_acp
from hvd_acp import methods
from hvd_acp.baselines import maths
from worker_io import report

torch.set_num_threads(1)

STEPS = 7
INNER_STEPS = 3
TOP_K = 4
CHUNK = 16
LR = 0.01


class Net(nn.Module):
    """An embedding, a matrix whose size is no multiple of the chunk, biases, a norm."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.hidden = nn.Linear(8, 20, bias=bias)
        self.norm = nn.LayerNorm(20, elementwise_affine=bias)
        self.out = nn.Linear(20, 12, bias=bias)

    def forward(self, tokens):
        return self.out(torch.relu(self.norm(self.hidden(self.embed(tokens)))))


def make_model(bias: bool = True, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net(bias)


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, 12, (16,), generator=gen)
    targets = torch.randint(0, 12, (16,), generator=gen)
    return nn.functional.cross_entropy(model(tokens), targets)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def digest(model: nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def same_everywhere(model: nn.Module) -> bool:
    return len(set(hvd.allgather_object(digest(model)))) == 1


def build(key: str, model: nn.Module, **settings):
    optimizer = methods.get(key).build(model, adamw(model), **settings).optimizer
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    return optimizer


def train_step(model: nn.Module, optimizer, rank: int, step: int) -> None:
    optimizer.zero_grad()
    loss_of(model, rank, step).backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with optimizer.skip_synchronize():
        optimizer.step()


# ------------------------------------------------------------------- DiLoCo
def diloco_reference(size: int) -> nn.Module:
    """All ranks in one process: their replicas and AdamWs, the mean of their
    moves, the outer step of :func:`maths.outer_step_`."""
    start = make_model(seed=1)
    replicas = [copy.deepcopy(start) for _ in range(size)]
    optimizers = [adamw(r) for r in replicas]
    for opt in optimizers:
        # hvd.broadcast_optimizer_state's step on zero gradients, weights kept.
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.zeros_like(p)
        saved = [p.detach().clone() for p in opt.param_groups[0]["params"]]
        opt.step()
        with torch.no_grad():
            for p, w in zip(opt.param_groups[0]["params"], saved):
                p.copy_(w)
    shared = copy.deepcopy(start)
    buffers = {}

    def outer():
        with torch.no_grad():
            for (name, g), *locals_ in zip(shared.named_parameters(),
                                           *[r.parameters() for r in replicas]):
                delta = sum(g - p for p in locals_) / size
                buffers[name] = maths.outer_step_(g, delta, buffers.get(name), lr=0.7,
                                                  momentum=0.9, nesterov=True)
            for r in replicas:
                r.load_state_dict(shared.state_dict())

    for step in range(STEPS):
        for rank, (replica, opt) in enumerate(zip(replicas, optimizers)):
            opt.zero_grad()
            loss_of(replica, rank, step).backward()
            torch.nn.utils.clip_grad_norm_(replica.parameters(), 1.0)
            opt.step()
        if (step + 1) % INNER_STEPS == 0:
            outer()
    outer()
    return shared


def run_diloco() -> dict:
    rank, size = hvd.rank(), hvd.size()
    model = make_model(seed=1 + rank)          # the broadcast makes them rank 0's
    optimizer = build("diloco", model, inner_steps=INNER_STEPS)
    agreed = []
    for step in range(STEPS):
        train_step(model, optimizer, rank, step)
        agreed.append(same_everywhere(model))
        with optimizer.global_weights():
            assert same_everywhere(model), "the global weights differ between ranks"
    assert optimizer.pending_inner_steps == STEPS % INNER_STEPS
    optimizer.outer_step()
    assert same_everywhere(model), "replicas differ after the last outer step"
    # Identical right after the outer steps (steps 3 and 6), apart in between.
    assert agreed == [(s + 1) % INNER_STEPS == 0 for s in range(STEPS)], agreed
    expected = diloco_reference(size)
    for (name, mine), theirs in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=name)
    stats = optimizer.comm_stats
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    outer_steps = STEPS // INNER_STEPS + 1
    assert stats.bytes_sent == stats.bytes_received == outer_steps * param_bytes
    assert stats.allgathers == 0
    return {"key": "diloco", "bytes_sent": stats.bytes_sent,
            "bytes_received": stats.bytes_received, "allreduces": stats.allreduces,
            "param_bytes": param_bytes, "outer_steps": optimizer.outer_step_count}


# --------------------------------------------------------------------- DeMo
def demo_reference(size: int) -> nn.Module:
    """All ranks in one process on a model of matrices only: each rank's
    gradient, momentum and selection, the decoded mean, the sign step."""
    model = make_model(bias=False, seed=1)
    dct = maths.dct_matrix(CHUNK)
    momenta = {name: [torch.zeros(maths.num_chunks(p.numel(), CHUNK), CHUNK)
                      for _ in range(size)] for name, p in model.named_parameters()}
    for step in range(STEPS):
        selected = {name: [] for name in momenta}
        for rank in range(size):
            model.zero_grad()
            loss_of(model, rank, step).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for name, p in model.named_parameters():
                maths.accumulate_(momenta[name][rank], p.grad, 0.999, dct)
                selected[name].append(maths.select_(momenta[name][rank], TOP_K))
        with torch.no_grad():
            for name, p in model.named_parameters():
                update = maths.decode(selected[name], momenta[name][0].shape[0], dct)
                maths.sign_step_(p, update, lr=LR, weight_decay=0.1)
    return model


def run_demo(bias: bool) -> dict:
    rank, size = hvd.rank(), hvd.size()
    model = make_model(bias=bias, seed=1 + rank)
    optimizer = build("demo", model, top_k=TOP_K, chunk_size=CHUNK)
    for step in range(STEPS):
        train_step(model, optimizer, rank, step)
        assert same_everywhere(model), f"replicas differ after step {step}"
    if not bias:
        expected = demo_reference(size)
        for (name, mine), theirs in zip(model.named_parameters(), expected.parameters()):
            assert torch.equal(mine, theirs), f"{name} differs from the one-process simulation"
    stats, expected_bytes = optimizer.comm_stats, optimizer.bytes_per_step()
    assert stats.bytes_sent == STEPS * expected_bytes["sent"]
    assert stats.bytes_received == STEPS * expected_bytes["received"]
    assert stats.allgathers == STEPS and stats.allreduces == (STEPS if bias else 0)
    # The 1-D tensors' state was created by the broadcast for them alone.
    matrices = {p for p in model.parameters() if p.dim() >= 2}
    assert not any(p in optimizer.optimizer.state for p in matrices)
    return {"key": "demo" if bias else "demo-matrices", "bytes_sent": stats.bytes_sent,
            "bytes_received": stats.bytes_received, "sent_per_step": expected_bytes["sent"],
            "received_per_step": expected_bytes["received"],
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def replicas() -> None:
    for run in (run_diloco, lambda: run_demo(True), lambda: run_demo(False)):
        result = run()
        if hvd.rank() == 0:
            report("RESULT " + json.dumps(result))
    report(f"OK replicas {hvd.rank()}")


# ----------------------------------------------------------------- mismatch
def mismatch() -> None:
    rank = hvd.rank()
    cases = {"inner_steps": ("diloco", {"inner_steps": 10 + rank}),
             "top_k": ("demo", {"top_k": 4 + (rank > 0)}),
             "chunk_size": ("demo", {"chunk_size": 64 if rank == 0 else 32})}
    for case, (key, settings) in cases.items():
        model = make_model()
        try:
            methods.get(key).build(model, adamw(model), **settings)
        except ValueError as exc:
            report(f"CAUGHT {case} rank={rank} {exc}")
        else:
            raise AssertionError(f"{case}: no ValueError on rank {rank}")
    # One rank's bad setting: every rank raises its error.
    model = make_model()
    try:
        hvd_acp.DiLoCoOptimizer(adamw(model), model.named_parameters(),
                                inner_steps=0 if rank == size_minus_one() else 5)
    except ValueError as exc:
        report(f"CAUGHT bad_setting rank={rank} {exc}")
    else:
        raise AssertionError(f"bad_setting: no ValueError on rank {rank}")
    # Weights that differ (no hvd.broadcast_parameters): the first step raises.
    for key in ("diloco", "demo"):
        model = make_model(seed=rank)
        optimizer = methods.get(key).build(model, adamw(model)).optimizer
        loss_of(model, rank, 0).backward()
        try:
            optimizer.step()
        except RuntimeError as exc:
            report(f"CAUGHT start_{key} rank={rank} {exc}")
        else:
            raise AssertionError(f"start_{key}: no RuntimeError on rank {rank}")
    # Nothing is left in flight: a correct setup trains a step.
    model = make_model()
    optimizer = build("demo", model)
    train_step(model, optimizer, rank, 0)
    report(f"OK mismatch {rank}")


def size_minus_one() -> int:
    return hvd.size() - 1


def main(argv) -> int:
    hvd.init()
    {"replicas": replicas, "mismatch": mismatch}[argv[0]]()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
