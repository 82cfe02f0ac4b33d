"""``int8_factors=True`` under horovodrun: each rank prints ``OK <case> <rank>``.

- ``sums``: every step, the ranks' payloads add up exactly: for every
  compressed tensor, ``sum_i (M_i + E_i before - E_i after) = N G`` (the
  residual keeps what each rank's 8-bit levels leave out and ``G`` is their
  exact average), checked against each rank's own gradient computed apart;
  the first step sends floats, the others 8-bit lanes, and the bytes sent
  are the lanes' words (one byte per factor element, one flag digit, padded
  to whole int32 words) plus the other tensors in fp16; the replicas stay
  bit for bit identical.
- ``budget``: ``sums`` with ``budget=0.1`` instead of the settings: the
  budget picks the 8-bit factors at a share whose steps send no more than a
  tenth of S-SGD's bytes (up to the word of the flag digit).
- ``resume``: a checkpoint saved after 5 steps and loaded into a new model
  and optimizer continues exactly as the run that did not stop.
"""
import io
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_acp
from hvd_acp import lanes
from worker_io import report

torch.set_num_threads(1)
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
CASE = sys.argv[1]
TEACHER = torch.randn(24, 6, generator=torch.Generator().manual_seed(7))


def batch(step, rank=RANK):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 24, generator=g)
    return x, (x @ TEACHER).argmax(dim=1)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 6))


def make(net, **settings):
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    return hvd_acp.DistributedOptimizer(opt, named_parameters=net.named_parameters(),
                                        **(settings or dict(int8_factors=True, matrix_rank=4)))


def flat(params):
    return torch.cat([p.detach().reshape(-1).double() for p in params])


def same_everywhere(tensor):
    for other in hvd.allgather(tensor.unsqueeze(0)):
        assert torch.equal(other, tensor), "replicas diverged"


def case_sums(budget=None):
    net = model()
    opt = make(net, **({"budget": budget} if budget else {}))
    assert opt.settings.int8_factors, opt.settings
    names = dict(net.named_parameters())
    for step in range(8):
        x, y = batch(step)
        own = torch.autograd.grad(F.cross_entropy(net(x), y), list(names.values()))
        own = dict(zip(names, own))
        before = {n: e.clone() for n, e in opt.reducer.errors.items()} if step else None
        sent_before = opt.comm_stats.bytes_sent
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.synchronize()
        grads = {n: p.grad.detach().clone() for n, p in names.items()}
        with opt.skip_synchronize():
            opt.step()
        assert opt.reducer.errors, "nothing compressed"
        for name, error in (opt.reducer.errors.items() if step else ()):
            # (step 0's floats travel in fp16, which rounds the average)
            n, m = error.shape
            prior = before[name] if before else torch.zeros_like(error)
            mine = (own[name].reshape(n, m) + prior - error).double()
            total = hvd.allreduce(mine, op=hvd.Sum, name=f"check.{name}.{step}")
            expected = SIZE * grads[name].reshape(n, m).double()
            assert torch.allclose(total, expected, atol=1e-5, rtol=1e-4), (
                name, step, float((total - expected).abs().max()))
        sent = opt.comm_stats.bytes_sent - sent_before
        layouts = opt.reducer.layouts
        factors = sum((lay.n + lay.m) * lay.r for lay in layouts.values() if lay.compressed)
        others = sum(lay.numel for lay in layouts.values() if not lay.compressed)
        if step == 0:
            assert sent == 2 * (factors + others), (step, sent)   # the float lead-in step
        else:
            # One lanes buffer here (a small model): its words, then the rest in fp16.
            assert sent == 4 * lanes.words_for(factors + 1) + 2 * others, (step, sent, factors)
            dense = sum(4 * lay.numel for lay in layouts.values())
            assert not budget or sent <= budget * dense + 4, (sent, budget * dense)
        same_everywhere(flat(net.parameters()))
    report(f"OK {'budget' if budget else 'sums'} {RANK}")


def case_resume():
    ref = model()
    ref_opt = make(ref)
    for step in range(10):
        x, y = batch(step)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        if step == 4:
            buffer = io.BytesIO()
            torch.save({"model": ref.state_dict(), "opt": ref_opt.state_dict()}, buffer)
            buffer.seek(0)
            saved = torch.load(buffer)
    net = model()
    opt = make(net)
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    for step in range(5, 10):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    assert torch.equal(flat(net.parameters()), flat(ref.parameters())), "resume differs"
    same_everywhere(flat(net.parameters()))
    report(f"OK resume {RANK}")


{"sums": case_sums, "budget": lambda: case_sums(budget=0.1), "resume": case_resume}[CASE]()
