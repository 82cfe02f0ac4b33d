"""Every setting that changes what is sent or how it is named, different on
rank 0 than on the other ranks: ``hvd_acp.DistributedOptimizer`` raises the
same ``ValueError`` on every rank, with no hang. Run under horovodrun at any
world size; each case prints ``CAUGHT <setting> rank=<rank> <message>``,
then a correct construction trains one step and prints ``OK trained
rank=<rank>`` (nothing was left in flight).
"""
import horovod.torch as hvd
import torch
from torch import nn

import hvd_acp
from worker_io import report

torch.set_num_threads(1)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


#: setting -> its keyword arguments on rank 0 (first) and on the others.
CASES = {
    "matrix_rank": ({"matrix_rank": 4}, {"matrix_rank": 2}),
    "min_compression_rate": ({"min_compression_rate": 2.0}, {"min_compression_rate": 1.0}),
    "warmup_steps": ({"warmup_steps": 0}, {"warmup_steps": 3}),
    "seed": ({"seed": 0}, {"seed": 1}),
    "step_ahead": ({"step_ahead": 0.2}, {"step_ahead": 0.0}),
    "fusion_threshold_bytes": ({}, {"fusion_threshold_bytes": 0}),
    "backward_passes_per_step": ({"backward_passes_per_step": 1},
                                 {"backward_passes_per_step": 2}),
    "num_groups": ({"num_groups": 0}, {"num_groups": 2}),
    "groups": ({}, {"groups": "first layer"}),
    "sparse_as_dense": ({"sparse_as_dense": False}, {"sparse_as_dense": True}),
    "compression": ({"compression": hvd.Compression.none},
                    {"compression": hvd.Compression.fp16}),
    "op": ({"op": hvd.Average}, {"op": hvd.Sum}),
    "gradient_predivide_factor": ({"gradient_predivide_factor": 1.0},
                                  {"gradient_predivide_factor": 2.0}),
}


def build(net, **kwargs):
    if kwargs.get("groups") == "first layer":
        kwargs["groups"] = [[net[0].weight, net[0].bias]]
    return hvd_acp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                        named_parameters=net.named_parameters(), **kwargs)


def main():
    hvd.init()
    for setting, (first, others) in CASES.items():
        try:
            build(model(), **(first if hvd.rank() == 0 else others))
        except ValueError as exc:
            report(f"CAUGHT {setting} rank={hvd.rank()} {exc}")
        else:
            raise AssertionError(f"{setting}: no ValueError on rank {hvd.rank()}")
    net = model()
    opt = build(net)
    opt.zero_grad()
    net(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    report(f"OK trained rank={hvd.rank()}")


if __name__ == "__main__":
    main()
