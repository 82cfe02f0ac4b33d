"""Multi-process checks of hvd_acp.DistributedOptimizer, run under horovodrun.

Usage: ``core_cases.py CASE`` with CASE one of:

- ``two`` (2 ranks): construction errors that must be raised on every rank;
  replicas stay bit-identical and gradients equal those recomputed here
  from every rank's inputs; full-rank ACP-SGD matches
  ``hvd.DistributedOptimizer``; a rank-dependent unused branch;
  ``hvd.broadcast_parameters`` / ``hvd.broadcast_optimizer_state``; a
  rank waiting for a late one in step() sleeps instead of spinning;
- ``three`` (3 ranks): the training checks again on an odd world size.

They share one launch per world size because starting horovodrun costs
several seconds; each check builds its own model and optimizer.

Every check that succeeds prints ``PASS <check> rank=<rank>``; a caught
construction error prints ``CAUGHT <check> rank=<rank> <type>: <message>``.
A failed check raises, so the rank exits non-zero. Checks that compare
ranks gather the data first, so every rank reaches the same verdict and no
rank is left waiting in a collective.

Every rank can regenerate every rank's inputs (a generator seeded by rank
and step), so expected values are computed here, not hard-coded.
"""
import sys
import time

import horovod.torch as hvd
import torch
from torch import nn
from torch.testing import assert_close

import hvd_acp
from hvd_acp.compression import Phase, orthonormalize_

torch.set_num_threads(1)
F64 = torch.float64


def report(check, detail=""):
    print(f"PASS {check} rank={hvd.rank()} {detail}".rstrip(), flush=True)


def generator(rank, step, salt=0):
    return torch.Generator().manual_seed(100_003 * rank + 1_009 * salt + step)


def assert_replicas_identical(model, tag):
    """Bit-identical parameters on every rank (gathered, compared everywhere)."""
    for name, p in model.named_parameters():
        gathered = hvd.allgather(p.detach().unsqueeze(0), name=f"check.{tag}.{name}")
        for other in range(1, hvd.size()):
            assert torch.equal(gathered[other], gathered[0]), \
                f"{tag}: parameter {name} differs between rank 0 and rank {other}"


def grads_of(build, model, loss_fn, shift=None):
    """The gradients ``loss_fn`` gives a copy of ``model``, keyed by name.

    ``model`` is a module or a state dict; ``shift`` (name -> tensor) is
    subtracted from the copy's parameters first. A parameter the loss does
    not reach gets a zero gradient.
    """
    copy = build()
    copy.load_state_dict(model if isinstance(model, dict) else model.state_dict())
    with torch.no_grad():
        for name, p in copy.named_parameters():
            if shift and name in shift:
                p.sub_(shift[name].reshape(p.shape))
    loss_fn(copy).backward()
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
            for n, p in copy.named_parameters()}


class AcpSimulation:
    """ACP-SGD of all ranks, recomputed in one process from every rank's gradient."""

    def __init__(self, opt):
        reducer = opt.reducer
        self.layouts = reducer.layouts
        self.p = {n: f.clone() for n, f in reducer.state.p_factors.items()}
        self.q = {n: f.clone() for n, f in reducer.state.q_factors.items()}
        self.errors = [{n: torch.zeros_like(e) for n, e in reducer.errors.items()}
                       for _ in range(hvd.size())]

    def step(self, phase, grads_per_rank):
        """Expected averaged gradients of a step, given each rank's local ones."""
        world = len(grads_per_rank)
        expected = {}
        for name, lay in self.layouts.items():
            if not lay.compressed or phase is Phase.DENSE:
                expected[name] = sum(g[name] for g in grads_per_rank) / world
                continue
            basis = (self.q if phase is Phase.P else self.p)[name].clone()
            orthonormalize_([basis])
            accumulated = [grads[name].reshape(lay.n, lay.m) + self.errors[rank][name]
                           for rank, grads in enumerate(grads_per_rank)]
            if phase is Phase.P:
                local = [a @ basis for a in accumulated]
                own = [f @ basis.t() for f in local]
                average = sum(local) / world
                self.p[name] = average
                applied = average @ basis.t()
            else:
                local = [a.t() @ basis for a in accumulated]
                own = [basis @ f.t() for f in local]
                average = sum(local) / world
                self.q[name] = average
                applied = basis @ average.t()
            for rank, a in enumerate(accumulated):
                self.errors[rank][name] = a - own[rank]     # this rank's unsent part
            expected[name] = applied.reshape(lay.shape)
        return expected

    def shift(self, rank, scale):
        """Rank ``rank``'s step-ahead shift: ``scale * E_rank`` per compressed tensor."""
        return {name: scale * error for name, error in self.errors[rank].items()}


# ------------------------------------------------------------------ models
class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.fc1 = nn.Linear(8 * 4 * 4, 24)
        self.fc2 = nn.Linear(24, 5)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def build_conv():
    torch.manual_seed(0)
    return ConvNet()


def conv_batch(rank, step):
    gen = generator(rank, step)
    return torch.randn(6, 3, 8, 8, generator=gen), torch.randint(0, 5, (6,), generator=gen)


def conv_loss(rank, step):
    x, y = conv_batch(rank, step)
    return lambda model: nn.functional.cross_entropy(model(x), y)


def build_square(width=12):
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(width, width, bias=False), nn.Tanh(),
                         nn.Linear(width, width, bias=False), nn.Tanh(),
                         nn.Linear(width, width, bias=False)).double()


def square_loss(rank, step, width=12):
    x = torch.randn(5, width, generator=generator(rank, step, salt=1), dtype=F64)
    return lambda model: model(x).pow(2).mean()


class Branchy(nn.Module):
    """``head_b`` is used by every rank except rank 1."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.head_a = nn.Linear(16, 4)
        self.head_b = nn.Linear(16, 12)

    def forward(self, x, use_b):
        h = torch.tanh(self.trunk(x))
        out = self.head_a(h).pow(2).mean()
        if use_b:
            out = out + self.head_b(h).pow(2).mean()
        return out


def build_branchy():
    torch.manual_seed(2)
    return Branchy()


def branchy_loss(rank, step):
    x = torch.randn(4, 8, generator=generator(rank, step, salt=2))
    return lambda model: model(x, use_b=rank != 1)


def build_mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


def mlp_loss(rank, step):
    x = torch.randn(4, 10, generator=generator(rank, step, salt=3))
    return lambda model: model(x).pow(2).mean()


def train_step(opt, model, loss_fn):
    opt.zero_grad()
    loss_fn(model).backward()
    opt.step()


# ------------------------------------------------------------------ checks
def check_replicas(steps=32, simulated_steps=4, lr=0.05, momentum=0.9, step_ahead=0.2):
    """Conv2d + Linear + biases, momentum, several buffers, inputs per rank.

    With step-ahead error feedback each rank computes its gradient at its
    own shifted weights ``w - step_ahead * lr / (1 - momentum) * E_rank``;
    the recomputation here shifts every rank's copy the same way, from the
    true weights (``opt.true_weights()``) and that rank's simulated residual.
    """
    model = build_conv()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = hvd_acp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
        named_parameters=model.named_parameters(), matrix_rank=2,
        fusion_threshold_bytes=4 * 1024, step_ahead=step_ahead)
    scale = step_ahead * lr / (1 - momentum)
    compressed = {n for n, lay in opt.reducer.layouts.items() if lay.compressed}
    assert compressed == {"conv1.weight", "conv2.weight", "fc1.weight", "fc2.weight"}, compressed
    simulation = AcpSimulation(opt)
    phases = []
    for step in range(steps):
        phases.append(opt.phase)
        opt.zero_grad()
        conv_loss(hvd.rank(), step)(model).backward()
        if step < simulated_steps:
            with opt.true_weights():
                true = {k: v.clone() for k, v in model.state_dict().items()}
            grads = [grads_of(build_conv, true, conv_loss(rank, step),
                              simulation.shift(rank, scale))
                     for rank in range(hvd.size())]
            expected = simulation.step(opt.phase, grads)
            opt.synchronize()
            for name, p in model.named_parameters():
                assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6,
                             msg=lambda m, name=name, step=step: f"{name} step {step}: {m}")
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    assert phases[:4] == [Phase.P, Phase.Q, Phase.P, Phase.Q], phases
    assert opt.step_count == steps
    assert opt.comm_stats.allreduces >= 2 * steps, opt.comm_stats     # several buffers
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        assert not torch.equal(p.detach(), initial[name]), name
    assert_replicas_identical(model, "replicas")
    report("replicas", f"steps={steps} allreduces={opt.comm_stats.allreduces}")


def check_exact_vs_horovod(steps=6):
    """Square layers, matrix_rank = width: ACP-SGD is exact S-SGD."""
    model, reference, local = build_square(), build_square(), build_square()
    opt = hvd_acp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(), matrix_rank=12, min_compression_rate=0,
        fusion_threshold_bytes=0)
    assert all(lay.compressed and lay.r == 12 for lay in opt.reducer.layouts.values())
    ref_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9),
        named_parameters=reference.named_parameters())
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        train_step(opt, model, square_loss(hvd.rank(), step))
        train_step(ref_opt, reference, square_loss(hvd.rank(), step))
        # The same S-SGD, averaged here from every rank's regenerated inputs.
        grads = [grads_of(build_square, local, square_loss(rank, step))
                 for rank in range(hvd.size())]
        for name, p in local.named_parameters():
            p.grad = sum(g[name] for g in grads) / len(grads)
        local_opt.step()
    for (name, p), q, s in zip(model.named_parameters(), reference.parameters(),
                               local.parameters()):
        assert_close(p, q, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
        assert_close(p, s, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    assert not torch.equal(model[0].weight, build_square()[0].weight)
    assert_replicas_identical(model, "exact")
    report("exact_vs_horovod")


def check_unused_branch(steps=8):
    """Rank 1 never uses head_b: no hang, rank 0's gradient is averaged with zero."""
    model = build_branchy()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = hvd_acp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
        named_parameters=model.named_parameters(), matrix_rank=2, fusion_threshold_bytes=0)
    assert opt.reducer.layouts["head_b.weight"].compressed
    for step in range(steps):
        opt.zero_grad()
        branchy_loss(hvd.rank(), step)(model).backward()
        if hvd.rank() == 1:
            assert model.head_b.bias.grad is None
        if step == 0:
            grads = [grads_of(build_branchy, model, branchy_loss(rank, 0))
                     for rank in range(hvd.size())]
            opt.synchronize()
            assert torch.count_nonzero(grads[1]["head_b.bias"]) == 0
            expected = sum(g["head_b.bias"] for g in grads) / hvd.size()
            assert torch.count_nonzero(expected) > 0
            assert_close(model.head_b.bias.grad, expected)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    for name in ("head_b.weight", "head_b.bias"):
        assert not torch.equal(dict(model.named_parameters())[name], initial[name]), name
    assert opt.step_count == steps
    assert_replicas_identical(model, "unused")
    report("unused_branch")


def check_broadcast(steps=4):
    """broadcast_parameters + broadcast_optimizer_state through the wrapper."""
    model = build_mlp(seed=10 + hvd.rank())     # replicas differ before the broadcast
    inner = torch.optim.Adam(model.parameters(), lr=0.01 * (hvd.rank() + 1))
    opt = hvd_acp.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                       matrix_rank=2, min_compression_rate=1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    # State initialization must not have started an ACP all-reduce.
    assert opt.comm_stats.allreduces == 0 and opt.step_count == 0, opt.comm_stats
    assert opt.param_groups[0]["lr"] == 0.01, opt.param_groups[0]["lr"]
    for name, p in build_mlp(seed=10).named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], p), name
    assert len(inner.state) == len(list(model.parameters()))
    for step in range(steps):
        train_step(opt, model, mlp_loss(hvd.rank(), step))
    assert opt.step_count == steps
    # One state-initializing step (zero gradients) plus the training steps.
    assert all(int(s["step"]) == steps + 1 for s in inner.state.values())
    assert_replicas_identical(model, "broadcast")
    for name, p in model.named_parameters():
        moment = inner.state[p]["exp_avg_sq"]
        assert torch.count_nonzero(moment) > 0, name
        gathered = hvd.allgather(moment.unsqueeze(0), name=f"check.broadcast.state.{name}")
        assert all(torch.equal(g, gathered[0]) for g in gathered), name
    report("broadcast")


def check_adaptive_defaults(steps=6):
    """AdamW with no ACP setting given: both factors every step at a share
    0.3 of each matrix's smaller side, in fp16 on the wire (2 bytes per
    element sent), replicas bit-identical; Horovod's own
    compression=hvd.Compression.none sends fp32; both_factors=False sends P
    and Q in turn at a share 0.5."""
    for compression, width, both in ((None, 2, None), (hvd.Compression.none, 4, None),
                                     (None, 2, False)):
        model = build_mlp(seed=0)
        opt = hvd_acp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                           named_parameters=model.named_parameters(),
                                           compression=compression, both_factors=both)
        layouts = opt.reducer.layouts
        ranks = (3, 1) if both is None else (5, 2)      # 0.3 of 10 and 3; 0.5
        assert (layouts["0.weight"].r, layouts["2.weight"].r) == ranks, layouts
        sent = []
        for step in range(steps):
            before = opt.comm_stats.bytes_sent
            train_step(opt, model, mlp_loss(hvd.rank(), step))
            sent.append(opt.comm_stats.bytes_sent - before)
        phases = ([Phase.PQ] * steps if both is None
                  else [Phase.P if step % 2 == 0 else Phase.Q for step in range(steps)])
        expected = [width * opt.reducer.state.wire_elements(phase) for phase in phases]
        assert sent == expected, (sent, expected)
        assert_replicas_identical(model, f"adaptive_defaults_{width}_{both}")
        opt.close()
    report("adaptive_defaults")


def check_waiting_is_idle(delay_s=1.0):
    """A rank that waits in step() for another rank's buffers sleeps
    instead of spinning (Horovod's synchronize keeps a core busy): rank 1
    starts its backward ``delay_s`` late; rank 0's training thread must use
    under a third of the wall time of its step() in CPU time."""
    torch.manual_seed(0)
    model = build_mlp(0)
    opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       matrix_rank=2, min_compression_rate=1)
    train_step(opt, model, mlp_loss(hvd.rank(), 0))
    opt.zero_grad()
    loss = mlp_loss(hvd.rank(), 1)(model)
    if hvd.rank() == 1:
        time.sleep(delay_s)
    loss.backward()
    wall, cpu = time.perf_counter(), time.thread_time()
    opt.step()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    wall, cpu = hvd.broadcast_object((wall, cpu), root_rank=0, name="check.waiting")
    assert wall > 0.5 * delay_s, f"rank 0 waited {wall:.3f} s in step(), not ~{delay_s} s"
    assert cpu < wall / 3, f"rank 0's step() used {cpu:.3f} s of CPU in {wall:.3f} s"
    assert_replicas_identical(model, "waiting")
    opt.close()
    report("waiting_is_idle", f"wall={wall:.3f} cpu={cpu:.3f}")


def expect_error(check, kind, build):
    try:
        build()
    except kind as exc:
        print(f"CAUGHT {check} rank={hvd.rank()} {type(exc).__name__}: {exc}", flush=True)
    else:
        raise AssertionError(f"{check}: no {kind.__name__} raised on rank {hvd.rank()}")


def check_errors():
    def differing_model():
        torch.manual_seed(0)
        width = 6 if hvd.rank() == 1 else 4
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, width))
        return hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters())

    def wrap(matrix_rank):
        model = build_mlp(seed=0)
        return hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(),
                                            matrix_rank=matrix_rank)

    """Bad or differing arguments raise on every rank instead of hanging."""
    expect_error("models_differ", ValueError, differing_model)
    expect_error("bad_on_one_rank", ValueError, lambda: wrap(0 if hvd.rank() == 1 else 4))
    expect_error("settings_differ", ValueError, lambda: wrap(2 if hvd.rank() == 1 else 4))

    # Nothing is left in flight: a correct construction still trains.
    model = build_mlp(seed=0)
    opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       matrix_rank=2, min_compression_rate=1)
    for step in range(2):
        train_step(opt, model, mlp_loss(hvd.rank(), step))
    assert_replicas_identical(model, "after_errors")
    report("recovered")


CASES = {
    "two": [check_errors, check_replicas, check_exact_vs_horovod, check_unused_branch,
            check_broadcast, check_adaptive_defaults, check_waiting_is_idle],
    "three": [check_replicas, check_exact_vs_horovod, check_unused_branch],
    "four": [check_replicas, check_adaptive_defaults],
}


def main():
    hvd.init()
    for check in CASES[sys.argv[1]]:
        check()
    print(f"DONE rank={hvd.rank()}", flush=True)


if __name__ == "__main__":
    main()
