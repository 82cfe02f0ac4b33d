"""Every method of hvd_acp.methods for one launcher, trained at 2 ranks.

``python methods_cases.py horovod|torchrun KEY [KEY ...]`` (under
``horovodrun --gloo`` or ``torchrun``) builds each method in turn in this
process, as the A/B tool does, on a fresh copy of the same seeded model, trains
``STEPS`` steps on per-rank seeded batches, and checks that the replicas are
bit-identical. Rank 0 prints one ``RESULT {json}`` line per method: its
counters per step, the gradient bytes of the model, a checksum of the final
weights; every rank prints ``OK <launcher> <rank>`` at the end.
"""
from __future__ import annotations

import hashlib
import json
import sys

import torch
from torch import nn

from hvd_acp import methods
from worker_io import report

STEPS = 6
MATRIX_RANK = 2
#: Small buckets: several per step, so that DDP's rebuild, the per-bucket
#: hooks and the serialized powerSGD_hook chains all take part.
DDP_OPTIONS = {"init_sync": False, "broadcast_buffers": False, "bucket_cap_mb": 0.004}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * rank + step))


class World:
    def __init__(self, launcher: str) -> None:
        self.launcher = launcher
        if launcher == methods.HOROVOD:
            import horovod.torch as hvd
            hvd.init()
            self.rank, self.size = hvd.rank(), hvd.size()
            self.allgather_object = hvd.allgather_object
        else:
            import torch.distributed as dist
            dist.init_process_group("gloo")
            self.rank, self.size = dist.get_rank(), dist.get_world_size()

            def allgather_object(obj):
                out = [None] * self.size
                dist.all_gather_object(out, obj)
                return out
            self.allgather_object = allgather_object

    def shutdown(self) -> None:
        if self.launcher == methods.HOROVOD:
            import horovod.torch as hvd
            hvd.shutdown()
        else:
            from hvd_acp.comm import leave_process_group
            leave_process_group()


def train(world: World, key: str) -> dict:
    method = methods.get(key)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    options = {"ddp_options": DDP_OPTIONS} if method.launcher == methods.TORCHRUN else {}
    built = method.build(model, optimizer, matrix_rank=MATRIX_RANK, **options)
    counted = []
    for step in range(STEPS):
        built.optimizer.zero_grad()
        built.model(batch(world.rank, step)).square().mean().backward()
        built.optimizer.step()
        counted.append(built.counters())
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()
    digests = world.allgather_object(digest)
    assert len(set(digests)) == 1, f"{key}: replicas differ after {STEPS} steps: {digests}"
    close = getattr(built.optimizer, "close", None)
    if callable(close):
        close()
    previous = [methods.Counters(0, 0, 0.0)] + counted[:-1]
    params = [p for p in model.parameters() if p.requires_grad]
    return {"key": key, "digest": digest, "tensors": len(params),
            "gradient_bytes": sum(p.numel() * p.element_size() for p in params),
            "bytes_per_step": [c.bytes_sent - b.bytes_sent for c, b in zip(counted, previous)],
            "allreduces_per_step": [c.allreduces - b.allreduces
                                    for c, b in zip(counted, previous)],
            "compression_seconds": counted[-1].compression_seconds,
            "analytic_powersgd_bytes": _analytic(model)}


def _analytic(model: nn.Module) -> int:
    from hvd_acp.methods.counting import powersgd_ddp_bytes_per_step
    return powersgd_ddp_bytes_per_step(model, MATRIX_RANK)


def main(argv) -> int:
    launcher, keys = argv[0], argv[1:]
    world = World(launcher)
    for key in keys:
        result = train(world, key)
        if world.rank == 0:
            report("RESULT " + json.dumps(result))
    report(f"OK {launcher} {world.rank}")
    world.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
