"""What the auto-rank workers share (autorank_cases.py under horovodrun,
autorank_ddp.py under torchrun): the settings, the model, each rank's
batches and the digest of the weights. Imported as ``autorank_setup`` (the
worker's folder is first on ``sys.path`` when it runs as a script)."""
import hashlib

import torch

import hvd_acp

#: Probes at steps 2, 6, 10, ...
AUTO = hvd_acp.AutoRank(first_interval=2, max_interval=4, energy=0.7)


def mlp() -> torch.nn.Module:
    """The model, identical on every rank (seed 0)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 48), torch.nn.Tanh(),
                               torch.nn.Linear(48, 6))


def batch(step: int, rank: int):
    """Rank ``rank``'s own (inputs, labels) of ``step``: local gradients differ,
    only the averages agree."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(32, 24, generator=g)
    return x, (x[:, :6] * (1 + step % 3)).argmax(dim=1)


def digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()
