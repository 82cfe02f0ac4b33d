"""What the framework workers (``*_train.py`` beside this file) share: the
digits task, the MLP, the checks every rank runs and the report line.

Imported as ``integration_common`` (the worker's folder is first on
``sys.path``). Every rank of a worker writes what it measured to
``<dir>/result.<framework>.<rank>.json`` (two ranks printing to one pipe
interleave), which ``tests/test_integrations.py`` reads and asserts on.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

TRAIN_SIZE = 1500


def digits():
    """scikit-learn's bundled 8x8 digits (no download) as ((x, y) train, (x, y)
    test), split at random with a fixed seed (the bundled order groups writers)."""
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(x / 16.0, dtype=torch.float32)[order]
    y = torch.tensor(y, dtype=torch.long)[order]
    return (x[:TRAIN_SIZE], y[:TRAIN_SIZE]), (x[TRAIN_SIZE:], y[TRAIN_SIZE:])


class MLP(nn.Module):
    """64 -> 128 -> 64 -> 10: three matrices, all compressed at matrix_rank 4."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)
        self.fc3 = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def gradient_bytes(module: nn.Module) -> int:
    """Bytes of one full gradient of the trainable parameters (what plain DDP sends)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


@torch.no_grad()
def evaluate(module: nn.Module, data) -> dict:
    """Accuracy and mean loss of ``module`` on the whole of ``data``."""
    was_training = module.training
    module.eval()
    x, y = data
    logits = module(x)
    module.train(was_training)
    return {"accuracy": float((logits.argmax(1) == y).float().mean()),
            "loss": float(F.cross_entropy(logits, y))}


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in module.parameters()])


def replicas_identical(module: nn.Module) -> bool:
    """Whether every rank holds bit for bit the same parameters (a collective)."""
    mine = flat(module)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return all(torch.equal(other, gathered[0]) for other in gathered)


def factors(state) -> dict:
    """name -> (P, Q) of an ACPState, cloned."""
    return {name: (t.p.clone(), t.q.clone()) for name, t in state.compression.tensors.items()}


def same_factors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]) for k in a)


def residual_norm(state) -> float:
    return float(sum(float(e.double().norm()) for e in state.compression.errors.values()))


def wire_bytes(state, steps: int, element_size: int = 4) -> int:
    """Bytes ACP-SGD sends in ``steps`` iterations from step 0 (no warm-up):
    P and Q steps in turn, or PQ steps (both factors: an adaptive optimizer's default)."""
    from hvd_acp.compression import phase_of
    return sum(state.wire_elements(phase_of(step, 0, state.compression.both_factors))
               for step in range(steps)) * element_size


def report(directory: str, framework: str, rank: int, **fields) -> None:
    """Write this rank's results to ``<directory>/result.<framework>.<rank>.json``."""
    path = os.path.join(directory, f"result.{framework}.{rank}.json")
    with open(path + ".tmp", "w") as out:
        json.dump(dict(framework=framework, rank=rank, **fields), out, indent=1)
    os.replace(path + ".tmp", path)
    print(f"{framework} rank {rank}: results in {path}", flush=True)
