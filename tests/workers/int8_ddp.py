"""``int8_factors=True`` in the DDP hook under torchrun: prints ``OK ddp-sums <rank>``.

Every step after the first (floats) the ranks' payloads add up exactly: for
every compressed tensor, ``sum_i (M_i + E_i before - E_i after) = N G``,
against each rank's own gradient computed apart; the bytes sent are the
lanes' words for the factors plus the other tensors in fp16; the replicas
stay bit for bit identical. With the argument ``budget`` the state takes
``budget=0.1`` instead of the settings, and a step sends no more than that
share of S-SGD's bytes (up to the word of the flag digit).
"""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_acp.ddp
from hvd_acp import lanes
from hvd_acp.comm import leave_process_group
from worker_io import report

torch.set_num_threads(1)
dist.init_process_group("gloo")
RANK, SIZE = dist.get_rank(), dist.get_world_size()
TEACHER = torch.randn(24, 6, generator=torch.Generator().manual_seed(7))


def batch(step):
    g = torch.Generator().manual_seed(1000 * RANK + step)
    x = torch.randn(16, 24, generator=g)
    return x, (x @ TEACHER).argmax(dim=1)


torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                          torch.nn.Tanh(), torch.nn.Linear(32, 6))
model = DDP(net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
BUDGET = 0.1 if sys.argv[1:] == ["budget"] else None
state = hvd_acp.ddp.ACPState(named_parameters=net.named_parameters(), optimizer=opt,
                             **({"budget": BUDGET} if BUDGET
                                else dict(matrix_rank=4, int8_factors=True)))
model.register_comm_hook(state, hvd_acp.ddp.acp_hook)
names = dict(net.named_parameters())
for step in range(8):
    x, y = batch(step)
    own = dict(zip(names, torch.autograd.grad(F.cross_entropy(net(x), y), list(names.values()))))
    before = {n: e.clone() for n, e in state.compression.errors.items()} if step else None
    sent_before = state.comm_stats.bytes_sent
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    grads = {n: p.grad.detach().clone() for n, p in names.items()}
    opt.step()
    layouts = state.compression.layouts
    assert state.compression.errors, "nothing compressed"
    for name, error in (state.compression.errors.items() if step else ()):
        n, m = error.shape
        mine = (own[name].reshape(n, m) + before[name] - error).double()
        dist.all_reduce(mine)
        expected = SIZE * grads[name].reshape(n, m).double()
        assert torch.allclose(mine, expected, atol=1e-5, rtol=1e-4), (
            name, step, float((mine - expected).abs().max()))
    if step:
        factors = sum((lay.n + lay.m) * lay.r for lay in layouts.values() if lay.compressed)
        others = sum(lay.numel for lay in layouts.values() if not lay.compressed)
        sent = state.comm_stats.bytes_sent - sent_before
        # One DDP bucket here (a small model): its factors' words, its rest in fp16.
        assert sent == 4 * lanes.words_for(factors + 1) + 2 * others, (step, sent)
        dense = sum(4 * lay.numel for lay in layouts.values())
        assert not BUDGET or sent <= BUDGET * dense + 4, (sent, BUDGET * dense)
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    everyone = [torch.empty_like(weights) for _ in range(SIZE)]
    dist.all_gather(everyone, weights)
    assert all(torch.equal(w, weights) for w in everyone), "replicas diverged"
assert state.settings.int8_factors, state.settings
report(f"OK ddp-sums {RANK}")
state.close()
leave_process_group()
