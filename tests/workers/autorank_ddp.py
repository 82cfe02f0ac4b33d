"""matrix_rank="auto" in the DDP hook, under torchrun (gloo).

Each rank trains a small MLP on its own batches with
``ACPState(matrix_rank=AutoRank(first_interval=2, max_interval=4))``; prints
``OK ddp <rank> <json>`` when every rank chose the same ranks at every probe
and the replicas are bit-identical, and when a state saved by rank 0 and
loaded on every rank brings the ranks back.
"""
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from hvd_acp.ddp import ACPState, acp_hook
from autorank_setup import AUTO, batch, digest, mlp
from worker_io import report

torch.set_num_threads(1)


def build():
    module = mlp()
    model = DDP(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = ACPState(matrix_rank=AUTO, named_parameters=module.named_parameters(),
                     optimizer=opt)
    model.register_comm_hook(state, acp_hook)
    return module, model, opt, state


def train(model, opt, state, start, stop, probes):
    for step in range(start, stop):
        x, y = batch(step, dist.get_rank())
        opt.zero_grad()
        probing = state.compression.probing
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if probing:
            probes.append((step, state.chosen_ranks()))


def gathered(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def main():
    dist.init_process_group("gloo")
    module, model, opt, state = build()
    probes = []
    train(model, opt, state, 0, 12, probes)
    assert [s for s, _ in probes] == [2, 6, 10], probes
    for what, value in (("probes", probes), ("weights", digest(module))):
        every = gathered(value)
        assert all(v == every[0] for v in every), f"{what} differs between ranks: {every}"
    saved = gathered(state.state_dict())[0]           # rank 0's state, on every rank
    _, model2, opt2, state2 = build()
    assert state2.chosen_ranks() != saved["ranks"]
    state2.load_state_dict(saved)
    assert state2.chosen_ranks() == saved["ranks"] == state.chosen_ranks()
    report(f"OK ddp {dist.get_rank()} {json.dumps(probes[-1][1], sort_keys=True)}")
    from hvd_acp.comm import leave_process_group
    leave_process_group()


if __name__ == "__main__":
    main()
