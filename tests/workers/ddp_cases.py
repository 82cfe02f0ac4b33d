"""Multi-rank checks of ``hvd_acp.ddp`` under ``torchrun`` (Gloo, CPU).

Usage: ``torchrun --standalone --nproc-per-node N ddp_cases.py [--dir DIR] CASE...``.
Each rank prints ``OK <case> <rank>`` when every assertion of the case held
on that rank, ``FAIL <case> <rank>`` and the traceback otherwise (and the
remaining cases are skipped).

Horovod is made unimportable first: the DDP path must not need it.
"""
import argparse
import importlib.abc
import os
import sys
import traceback


class _NoHorovod(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "horovod" or name.startswith("horovod."):
            raise ImportError(f"{name} is blocked: the DDP hook must not import Horovod")
        return None


sys.meta_path.insert(0, _NoHorovod())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import hvd_acp.ddp  # noqa: E402
from hvd_acp.compression import Phase  # noqa: E402
from hvd_acp.comm import leave_process_group  # noqa: E402
from worker_io import report  # noqa: E402

torch.set_num_threads(1)
TEACHER = torch.randn(6, 6, generator=torch.Generator().manual_seed(99))


def rank():
    return dist.get_rank()


def size():
    return dist.get_world_size()


def batch(r, step, n=8, dim=6):
    """Rank- and step-specific inputs labelled by a fixed teacher; any rank can
    regenerate any rank's batch."""
    g = torch.Generator().manual_seed(1000 * r + step)
    x = torch.randn(n, dim, generator=g)
    return x, (x @ TEACHER[:dim]).argmax(dim=1)


class Mixed(nn.Module):
    """Square and rectangular matrices, a convolution, biases."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 3, padding=1)          # (4, 1, 3): not compressed at r=2
        self.fc1 = nn.Linear(24, 16)
        self.fc2 = nn.Linear(16, 16)
        self.out = nn.Linear(16, 6)

    def forward(self, x):
        h = F.relu(self.conv(x.unsqueeze(1))).flatten(1)
        return self.out(F.relu(self.fc2(F.relu(self.fc1(h)))))


class Square(nn.Module):
    """Only square matrices and biases: at full rank every step is exact."""

    def __init__(self, dtypes=(torch.float32, torch.float32, torch.float32)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6).to(dt) for dt in dtypes)

    def forward(self, x):
        for index, layer in enumerate(self.layers):
            x = layer(x.to(layer.weight.dtype))
            if index < len(self.layers) - 1:
                x = torch.tanh(x)
        return x.float()


class Branches(nn.Module):
    """A trunk and a branch that rank 1 skips (a parameter unused on one rank)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 6)
        self.branch = nn.Linear(6, 6)
        self.head = nn.Linear(6, 6)

    def forward(self, x, use_branch=True):
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def build(cls, seed=0, **kwargs):
    torch.manual_seed(seed)
    return cls(**kwargs)


def flat(module):
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])


def assert_replicas_identical(tensor):
    gathered = [torch.empty_like(tensor) for _ in range(size())]
    dist.all_gather(gathered, tensor)
    for other in gathered:
        assert torch.equal(other, gathered[0]), "replicas diverged"


def ddp(module, state=None, **kwargs):
    model = DDP(module, **kwargs)
    if state is not None:
        model.register_comm_hook(state, hvd_acp.ddp.acp_hook)
    return model


def step(model, opt, x, y, **forward_kwargs):
    opt.zero_grad()
    loss = F.cross_entropy(model(x, **forward_kwargs), y)
    loss.backward()
    opt.step()
    return loss.item()


def expected_average(reference, model, inputs, forward_kwargs=None):
    """Plain average over ranks of the local gradients, computed on one rank.

    Args:
        reference: a non-DDP module of the same class, overwritten with
            ``model``'s parameters.
        inputs: ``inputs[r]`` is the list of (x, y) micro-batches of rank r
            (their gradients are summed, as under ``no_sync()``).
        forward_kwargs: rank -> keyword arguments of the forward pass.
    """
    reference.load_state_dict(model.module.state_dict())
    total = [torch.zeros_like(p, dtype=torch.float64) for p in reference.parameters()]
    for r, micro in enumerate(inputs):
        reference.zero_grad()
        for x, y in micro:
            kwargs = forward_kwargs(r) if forward_kwargs else {}
            F.cross_entropy(reference(x, **kwargs), y).backward()
        for t, p in zip(total, reference.parameters()):
            if p.grad is not None:
                t += p.grad.double()
    return [t / len(inputs) for t in total]


def assert_grads(model, expected, atol=1e-5, rtol=1e-5):
    for (name, p), e in zip(model.module.named_parameters(), expected):
        torch.testing.assert_close(p.grad.double(), e, atol=atol, rtol=rtol,
                                   msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------- cases
def case_replicas(_):
    """50 steps: replicas bit-identical; one all-reduce per bucket; the phase
    flips once per iteration (several buckets), so each iteration sends the
    P or the Q payload of the whole model."""
    model_module = build(Mixed)
    state = hvd_acp.ddp.ACPState(matrix_rank=2, seed=3, step_ahead=0)
    # A small cap: several buckets, rebuilt after the first iteration.
    model = ddp(model_module, state, bucket_cap_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    per_step, calls = [], []
    for i in range(50):
        before, launched = state.comm_stats.bytes_sent, state.comm_stats.allreduces
        x, y = batch(rank(), i)
        step(model, opt, x, y)
        per_step.append(state.comm_stats.bytes_sent - before)
        calls.append(state.comm_stats.allreduces - launched)
    assert state.step_count == 50 and state.phase is Phase.P
    wire = {ph: 4 * state.wire_elements(ph) for ph in (Phase.P, Phase.Q)}
    assert wire[Phase.P] != wire[Phase.Q]
    assert per_step == [wire[Phase.P] if i % 2 == 0 else wire[Phase.Q] for i in range(50)], \
        (per_step[:4], wire)
    assert max(calls) > 1, calls        # several buckets, one all-reduce each
    assert len(state.state_dict()["params"]) == 3   # fc1, fc2, out compressed; conv not
    assert_replicas_identical(flat(model.module))
    params = flat(model.module)
    assert torch.isfinite(params).all()


def case_full_rank(_):
    """Full rank, min_compression_rate=0, square matrices: the hook's averaged
    gradients equal plain averaging, step after step (P and Q phases)."""
    state = hvd_acp.ddp.ACPState(matrix_rank=6, min_compression_rate=0, step_ahead=0)
    model = ddp(build(Square), state, bucket_cap_mb=0.0002)
    reference = build(Square)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(6):
        inputs = [[batch(r, i)] for r in range(size())]
        expected = expected_average(reference, model, inputs)
        opt.zero_grad()
        x, y = inputs[rank()][0]
        F.cross_entropy(model(x), y).backward()
        assert_grads(model, expected)
        opt.step()
    assert len(state.state_dict()["params"]) == 3
    assert_replicas_identical(flat(model.module))


def case_error_feedback(_):
    """Nothing is lost at low rank: after T steps the applied gradients plus
    the ranks' mean residual add up to the sum of the averaged gradients
    (weights fixed, lr=0). The two warm-up steps are plain averages."""
    module = build(Mixed)
    state = hvd_acp.ddp.ACPState(matrix_rank=1, warmup_steps=2, step_ahead=0,
                                 named_parameters=module.named_parameters())
    model = ddp(module, state, bucket_cap_mb=0.002)
    reference = build(Mixed)
    applied = [torch.zeros_like(p, dtype=torch.float64) for p in module.parameters()]
    averaged = [torch.zeros_like(a) for a in applied]
    for i in range(7):
        expected = expected_average(reference, model, [[batch(r, i)] for r in range(size())])
        model.zero_grad()
        x, y = batch(rank(), i)
        F.cross_entropy(model(x), y).backward()
        if i < 2:
            assert_grads(model, expected)
        for a, s, p, e in zip(applied, averaged, module.parameters(), expected):
            a += p.grad.double()
            s += e
    residuals = state.state_dict()["params"]
    assert sorted(residuals) == ["fc1.weight", "fc2.weight", "out.weight"]
    for (name, p), a, s in zip(module.named_parameters(), applied, averaged):
        if name in residuals:
            error = residuals[name]["error"].double().reshape(p.shape)
            dist.all_reduce(error)
            assert error.abs().max() > 1e-3, name      # rank 1 is lossy: there is a residual
            a = a + error / size()
        torch.testing.assert_close(a, s, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def case_no_sync(_):
    """Two passes under no_sync() and one synchronized: one communication,
    the average of the summed gradients."""
    state = hvd_acp.ddp.ACPState(matrix_rank=6, min_compression_rate=0, step_ahead=0)
    model = ddp(build(Square), state)
    reference = build(Square)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(4):
        inputs = [[batch(r, 10 * i + k) for k in range(3)] for r in range(size())]
        expected = expected_average(reference, model, inputs)
        opt.zero_grad()
        launched = state.comm_stats.allreduces
        with model.no_sync():
            for x, y in inputs[rank()][:2]:
                F.cross_entropy(model(x), y).backward()
        assert state.comm_stats.allreduces == launched and state.step_count == i
        x, y = inputs[rank()][2]
        F.cross_entropy(model(x), y).backward()
        assert state.comm_stats.allreduces > launched and state.step_count == i + 1
        assert_grads(model, expected)
        opt.step()
    assert_replicas_identical(flat(model.module))


def case_unused(_):
    """find_unused_parameters=True, the branch unused on rank 1: a zero
    gradient there, the same maths everywhere, no hang; exact at full rank
    and replicas identical at low rank."""
    def use_branch(r):
        return {"use_branch": r != 1}

    for matrix_rank in (6, 2):
        state = hvd_acp.ddp.ACPState(matrix_rank=matrix_rank, min_compression_rate=0,
                                     step_ahead=0)
        model = ddp(build(Branches), state, find_unused_parameters=True)
        reference = build(Branches)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for i in range(8):
            inputs = [[batch(r, i)] for r in range(size())]
            expected = expected_average(reference, model, inputs, forward_kwargs=use_branch)
            opt.zero_grad()
            x, y = inputs[rank()][0]
            F.cross_entropy(model(x, **use_branch(rank())), y).backward()
            if matrix_rank == 6:
                assert_grads(model, expected)
            opt.step()
        assert state.step_count == 8
        assert_replicas_identical(flat(model.module))


def case_dtypes(_):
    """float64, float32 and bfloat16 parameters: DDP puts them in buckets of
    their own; fp32 and fp64 are exact at full rank, bf16 to its precision
    (its factors and residual are kept in float32)."""
    dtypes = (torch.float64, torch.float32, torch.bfloat16)
    state = hvd_acp.ddp.ACPState(matrix_rank=6, min_compression_rate=0, step_ahead=0)
    model = ddp(build(Square, dtypes=dtypes), state)
    reference = build(Square, dtypes=dtypes)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(4):
        inputs = [[batch(r, i)] for r in range(size())]
        expected = expected_average(reference, model, inputs)
        opt.zero_grad()
        x, y = inputs[rank()][0]
        F.cross_entropy(model(x), y).backward()
        for layer, (w, b) in zip(model.module.layers, zip(expected[::2], expected[1::2])):
            tol = 1e-5 if layer.weight.dtype != torch.bfloat16 else 2e-2
            for p, e in ((layer.weight, w), (layer.bias, b)):
                torch.testing.assert_close(p.grad.double(), e, atol=tol, rtol=tol)
        opt.step()
    errors = state.compression.errors
    assert {e.dtype for e in errors.values()} == {torch.float64, torch.float32}
    assert_replicas_identical(flat(model.module))


def case_nonfinite(_):
    """An overflow on one rank: every rank keeps the factors, resets the
    residuals and sees the non-finite gradient (so a GradScaler would skip
    the step); training then goes on with identical replicas."""
    module = build(Mixed)
    state = hvd_acp.ddp.ACPState(matrix_rank=2, named_parameters=module.named_parameters(),
                                 step_ahead=0)
    model = ddp(module, state, bucket_cap_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in range(3):
        step(model, opt, *batch(rank(), i))
    before = state.state_dict()["params"]
    assert state.phase is Phase.Q and all(e["error"].any() for e in before.values())
    opt.zero_grad()
    x, y = batch(rank(), 3)
    (F.cross_entropy(model(x), y) * (float("inf") if rank() == 1 else 1.0)).backward()
    assert state.nonfinite_steps == 1
    for name, entry in state.state_dict()["params"].items():
        assert torch.equal(entry["Q"], before[name]["Q"]), name
        assert not entry["error"].any(), name
    assert not torch.isfinite(model.module.fc1.weight.grad).all()
    for i in range(4, 8):                  # the overflowing step skipped, as GradScaler does
        step(model, opt, *batch(rank(), i))
    assert state.nonfinite_steps == 1
    params = flat(model.module)
    assert torch.isfinite(params).all()
    assert_replicas_identical(params)


def case_fp16_wire(_):
    """fp16_wire: every bucket travels as float16 (2 bytes per element), the
    average is plain averaging up to fp16 rounding (full rank, square), the
    replicas stay bit-identical; AdamW turns it on by default, SGD does not."""
    state = hvd_acp.ddp.ACPState(matrix_rank=6, min_compression_rate=0, step_ahead=0,
                                 fp16_wire=True)
    model = ddp(build(Square), state, bucket_cap_mb=0.0002)
    reference = build(Square)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rounded = False
    for i in range(6):
        inputs = [[batch(r, i)] for r in range(size())]
        expected = expected_average(reference, model, inputs)
        before = state.comm_stats.bytes_sent
        opt.zero_grad()
        x, y = inputs[rank()][0]
        F.cross_entropy(model(x), y).backward()
        # Square at full rank: P and Q payloads are the same size.
        assert state.comm_stats.bytes_sent - before == 2 * state.wire_elements(Phase.P)
        assert state.comm_stats.bytes_received == state.comm_stats.bytes_sent
        assert_grads(model, expected, atol=2e-3, rtol=2e-3)
        rounded |= any(not torch.equal(p.grad.double(), e)
                       for p, e in zip(model.module.parameters(), expected))
        opt.step()
    assert rounded, "nothing was rounded to fp16"
    assert_replicas_identical(flat(model.module))
    for optimizer, fp16 in ((torch.optim.AdamW, True), (torch.optim.SGD, False)):
        module = build(Mixed)
        default = hvd_acp.ddp.ACPState(optimizer=optimizer(module.parameters(), lr=1e-3))
        assert default.settings.fp16_wire is fp16 and default.step_ahead == 0.2
        default.close()


def case_step_ahead(_):
    """With the optimizer, each rank takes its gradient at w - a * lr / (1 - momentum)
    * E_i (its own residual); step() updates the true weights, identical on
    every rank; true_weights() shows them between backward and step()."""
    module = build(Mixed)
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    state = hvd_acp.ddp.ACPState(matrix_rank=2, optimizer=opt,
                                 named_parameters=module.named_parameters())
    model = ddp(module, state, bucket_cap_mb=0.002)
    scale = 0.2 * 0.05 / (1 - 0.9)
    for i in range(6):
        true = {n: p.detach().clone() for n, p in module.named_parameters()}
        errors = {n: e["error"] for n, e in state.state_dict()["params"].items()}
        assert i == 0 or all(e.any() for e in errors.values())
        opt.zero_grad()
        x, y = batch(rank(), i)
        out = model(x)
        for n, p in module.named_parameters():
            expected = true[n] - scale * errors[n].reshape(p.shape) if n in errors else true[n]
            torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)
        if i == 3:
            gathered = [torch.empty_like(flat(module)) for _ in range(size())]
            dist.all_gather(gathered, flat(module))
            assert not torch.equal(gathered[0], gathered[1]), "the shift is rank-local"
        F.cross_entropy(out, y).backward()
        with state.true_weights():
            assert all(torch.equal(p, true[n]) for n, p in module.named_parameters())
        opt.step()
        assert_replicas_identical(flat(module))
    # A shift is owed now; after close() no forward applies it.
    state.close()
    before = flat(module)
    module(batch(rank(), 6)[0])
    assert torch.equal(flat(module), before), "shifted after close()"


def case_checkpoint(directory):
    """(a) every rank saves and resumes its own state: bit for bit;
    (b) every rank loads rank 0's file with the residuals reset. Names from
    DDP's first backward, from named_parameters, or from the optimizer
    (step-ahead on)."""
    def fresh(naming, seed=0):
        module = build(Mixed, seed=seed)
        opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        kwargs = {"named": {"named_parameters": module.named_parameters(), "step_ahead": 0},
                  "optimizer": {"optimizer": opt}}.get(naming, {"step_ahead": 0})
        state = hvd_acp.ddp.ACPState(matrix_rank=2, **kwargs)
        assert bool(state.step_ahead) == (naming == "optimizer")
        return ddp(module, state, bucket_cap_mb=0.002), state, opt

    def train(model, opt, start, count):
        for i in range(start, start + count):
            x, y = batch(rank(), i)
            step(model, opt, x, y)

    for named in ("ddp_order", "named", "optimizer"):
        model, state, opt = fresh(named)
        train(model, opt, 0, 5)
        path = os.path.join(directory, f"ddp.{named}.{rank()}.pt")
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "acp": state.state_dict()}, path)
        train(model, opt, 5, 6)
        uninterrupted = flat(model.module)

        # (a) a new process would build everything again: a new model (other
        # initial weights), DDP with its first-iteration buckets, a new state.
        model2, state2, opt2 = fresh(named, seed=123)
        saved = torch.load(path)
        model2.module.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["opt"])
        state2.load_state_dict(saved["acp"])
        assert state2.step_count == 5 and state2.phase is Phase.Q
        train(model2, opt2, 5, 6)
        assert torch.equal(flat(model2.module), uninterrupted), named

        # (b) rank 0's file everywhere, residuals reset.
        dist.barrier()
        saved0 = torch.load(os.path.join(directory, f"ddp.{named}.0.pt"))
        model3, state3, opt3 = fresh(named, seed=7)
        model3.module.load_state_dict(saved0["model"])
        opt3.load_state_dict(saved0["opt"])
        state3.load_state_dict(saved0["acp"], reset_error_feedback=True)
        for name, entry in state3.state_dict()["params"].items():
            assert torch.equal(entry["P"], saved0["acp"]["params"][name]["P"])
            assert "error" not in entry or not entry["error"].any()
        train(model3, opt3, 5, 4)
        assert state3.step_count == 9
        assert_replicas_identical(flat(model3.module))
        assert not torch.equal(flat(model3.module), flat(model2.module))


# ------------------------------------------------------------ resume patterns
def acp_model(seed=0, **state_kwargs):
    """The Mixed model under DDP with the hook, its optimizer given to the state."""
    module = build(Mixed, seed=seed)
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    state = hvd_acp.ddp.ACPState(matrix_rank=2, optimizer=opt,
                                 named_parameters=module.named_parameters(), **state_kwargs)
    return ddp(module, state, bucket_cap_mb=0.002), state, opt


def train_steps(model, opt, start, stop):
    for i in range(start, stop):
        step(model, opt, *batch(rank(), i))


def eval_loss(model):
    x, y = batch(99, 0, n=128)
    with torch.no_grad():
        return float(F.cross_entropy(model.module(x), y))


def case_resume_rank0_file(directory):
    """PyTorch's DDP checkpoint pattern: rank 0 saves model, optimizer and
    comm state; every rank loads rank 0's file (default arguments). Rank 0
    keeps its residual, the others start from zero; the replicas stay
    identical and the run ends within 5% of the uninterrupted one."""
    k, total = 7, 16
    model, state, opt = acp_model()
    train_steps(model, opt, 0, k)
    path = os.path.join(directory, f"ddp_rank0.{size()}.pt")
    if rank() == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                    "acp": state.state_dict()}, path)
    saved_errors = {n: e.clone() for n, e in state.compression.errors.items()}
    train_steps(model, opt, k, total)
    uninterrupted = eval_loss(model)
    state.close()
    dist.barrier()

    model2, state2, opt2 = acp_model(seed=5)
    checkpoint = torch.load(path)
    model2.module.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["optimizer"])
    state2.load_state_dict(checkpoint["acp"])
    assert state2.step_count == k and state2.phase is Phase.Q
    for name, error in state2.compression.errors.items():
        if rank() == 0:
            assert torch.equal(error, saved_errors[name]), "rank 0 lost its residual"
        else:
            assert not error.any(), f"rank {rank()} installed rank 0's residual"
    train_steps(model2, opt2, k, total)
    assert state2.step_count == total
    assert_replicas_identical(flat(model2.module))
    resumed = eval_loss(model2)
    gap = abs(resumed - uninterrupted) / uninterrupted
    report(f"GAP resume_rank0_file {rank()} {gap:.4f}")
    assert gap <= 0.05, (resumed, uninterrupted)
    state2.close()


def case_rank0_only(directory):
    """Rank 0 alone loads the comm state: every rank raises at the first
    bucket (no hang, no silent mismatch)."""
    model, state, opt = acp_model()
    train_steps(model, opt, 0, 3)
    saved = state.state_dict()
    state.close()
    model2, state2, opt2 = acp_model(seed=5)
    if rank() == 0:
        state2.load_state_dict(saved)
    expect_error(ValueError, "step_count=3 on rank 0 but 0 on rank 1",
                 lambda: step(model2, opt2, *batch(rank(), 3)))
    state2.close()


def case_attach_optimizer(_):
    """A comm state built before the optimizer (as Lightning's DDPStrategy
    does), the optimizer attached after DDP wraps the model: the same bits
    as a state given its optimizer at construction."""
    module = build(Mixed)
    state = hvd_acp.ddp.ACPState(matrix_rank=2, named_parameters=module.named_parameters())
    model = ddp(module, state, bucket_cap_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state.attach_optimizer(opt)
    reference, ref_state, ref_opt = acp_model()
    train_steps(model, opt, 0, 6)
    train_steps(reference, ref_opt, 0, 6)
    assert torch.equal(flat(model.module), flat(reference.module))
    assert state.step_ahead and any(e.any() for e in state.compression.errors.values())
    state.close()
    ref_state.close()
    # Once the hook has run, the first iterations went without step-ahead.
    late = hvd_acp.ddp.ACPState(matrix_rank=2, step_ahead=0)
    late_model = ddp(build(Square), late)
    late_opt = torch.optim.SGD(late_model.parameters(), lr=0.1)
    step(late_model, late_opt, *batch(rank(), 0))
    expect_error(RuntimeError, "before the first backward pass",
                 lambda: late.attach_optimizer(late_opt))


def case_step_ahead_closure(_):
    """optimizer.step(closure), as PyTorch Lightning steps: the forward and
    backward passes inside the step see the shifted weights, the update
    applies to the true ones: the same bits as step() after backward()."""
    plain, plain_state, plain_opt = acp_model()
    closed, closed_state, closed_opt = acp_model()
    for i in range(6):
        x, y = batch(rank(), i)
        step(plain, plain_opt, x, y)

        def closure():
            closed_opt.zero_grad()
            loss = F.cross_entropy(closed(x), y)
            loss.backward()
            return loss
        if i % 2:
            closed_opt.step(closure=closure)
        else:
            closed_opt.step(closure)
        assert torch.equal(flat(closed.module), flat(plain.module)), f"step {i}"
    assert_replicas_identical(flat(closed.module))
    plain_state.close()
    closed_state.close()


def case_needs_optimizer(_):
    """Step-ahead on (the default) and no optimizer: the first backward
    raises on every rank instead of silently training without it."""
    state = hvd_acp.ddp.ACPState(matrix_rank=2)
    model = ddp(build(Square), state)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    expect_error(RuntimeError, "no optimizer: pass ACPState.*attach_optimizer",
                 lambda: step(model, opt, *batch(rank(), 0)))


class TorchDistCommunicator(hvd_acp.Communicator):
    """hvd_acp's Communicator over torch.distributed, averaging as the DDP hook
    does (sum, then divide by the world size), so that the Horovod front end
    can run next to the hook in one job."""

    def size(self):
        return dist.get_world_size()

    def rank(self):
        return dist.get_rank()

    def reduction_weight(self):
        return 1.0 / self.size()

    def allreduce_async_(self, tensor, name):
        self._count(tensor)
        return dist.all_reduce(tensor, async_op=True), tensor

    def synchronize(self, handle):
        work, tensor = handle
        work.wait()
        tensor.div_(self.size())

    def allgather_object(self, obj, name):
        gathered = [None] * self.size()
        dist.all_gather_object(gathered, obj)
        return gathered


def assert_same_state(front, module, hook_state, hook_model, step):
    """The Horovod front end and the DDP hook hold the same factors, residuals
    and weights, bit for bit."""
    ours, theirs = front.reducer.state.tensors, hook_state.compression.tensors
    assert sorted(ours) == sorted(theirs), (sorted(ours), sorted(theirs))
    for name, tensor in ours.items():
        for attr in ("p", "q", "error"):
            assert torch.equal(getattr(tensor, attr), getattr(theirs[name], attr)), (
                step, name, attr)
    assert torch.equal(flat(module), flat(hook_model.module)), f"weights differ at step {step}"


def case_same_as_horovod_front_end(_):
    """The same gradients through the DDP hook and through
    hvd_acp.DistributedOptimizer (one compression state under both): the
    same factors, residuals and weights, bit for bit, step after step, with
    step-ahead on."""
    hook_model, hook_state, hook_opt = acp_model()
    module = build(Mixed)
    base = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    front = hvd_acp.DistributedOptimizer(base, module.named_parameters(), matrix_rank=2,
                                         communicator=TorchDistCommunicator())
    for i in range(8):
        x, y = batch(rank(), i)
        step(hook_model, hook_opt, x, y)
        front.zero_grad()
        F.cross_entropy(module(x), y).backward()
        front.step()
        assert front.step_count == hook_state.step_count == i + 1
        assert sorted(front.reducer.state.tensors) == ["fc1.weight", "fc2.weight", "out.weight"]
        assert_same_state(front, module, hook_state, hook_model, i)
    assert any(e.any() for e in front.reducer.errors.values())
    front.close()
    hook_state.close()


def case_both_factors(directory):
    """AdamW with the defaults: both factors every step (PQ). The DDP hook and
    hvd_acp.DistributedOptimizer agree bit for bit at two ranks (factors,
    residuals, weights; with more, their differently fused buffers are summed
    in other orders) with step-ahead on (fp32 on the wire: the test's
    communicator has no fp16); each iteration sends the PQ payload; a
    checkpoint taken at step 5 resumes in a new model, state and optimizer
    (bit for bit at two ranks); replicas stay identical."""
    def fresh(seed=0):
        module = build(Mixed, seed=seed)
        opt = torch.optim.AdamW(module.parameters(), lr=0.01)
        state = hvd_acp.ddp.ACPState(optimizer=opt, named_parameters=module.named_parameters(),
                                     fp16_wire=False)
        return ddp(module, state, bucket_cap_mb=0.002), state, opt

    hook_model, hook_state, hook_opt = fresh()
    module = build(Mixed)
    front = hvd_acp.DistributedOptimizer(torch.optim.AdamW(module.parameters(), lr=0.01),
                                         module.named_parameters(),
                                         communicator=TorchDistCommunicator())
    path = os.path.join(directory, f"pq.{rank()}.pt")
    for i in range(10):
        assert hook_state.phase is Phase.PQ
        before = hook_state.comm_stats.bytes_sent
        x, y = batch(rank(), i)
        step(hook_model, hook_opt, x, y)
        assert hook_state.comm_stats.bytes_sent - before == 4 * hook_state.wire_elements(
            Phase.PQ), i
        if i == 4:
            torch.save({"model": hook_model.module.state_dict(), "opt": hook_opt.state_dict(),
                        "acp": hook_state.state_dict()}, path)
        front.zero_grad()
        F.cross_entropy(module(x), y).backward()
        front.step()
        assert hook_state.compression.ranks() == front.reducer.state.ranks() == {   # 0.3
            "conv.weight": 1, "fc1.weight": 5, "fc2.weight": 5, "out.weight": 2}
        if size() == 2:
            assert_same_state(front, module, hook_state, hook_model, i)
    assert any(e.any() for e in front.reducer.errors.values())
    assert_replicas_identical(flat(hook_model.module))
    model2, state2, opt2 = fresh(seed=123)
    saved = torch.load(path)
    model2.module.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    state2.load_state_dict(saved["acp"])
    assert state2.step_count == 5 and state2.phase is Phase.PQ
    for i in range(5, 10):
        step(model2, opt2, *batch(rank(), i))
    if size() == 2:
        assert torch.equal(flat(model2.module), flat(hook_model.module))
    else:                   # a new DDP's first buckets: other sums, the same maths
        torch.testing.assert_close(flat(model2.module), flat(hook_model.module))
    assert_replicas_identical(flat(model2.module))
    front.close()
    hook_state.close()
    state2.close()


def expect_error(kind, match, fn):
    import re
    try:
        fn()
    except kind as exc:
        assert re.search(match, str(exc)), f"{kind.__name__} without {match!r}: {exc}"
        return
    raise AssertionError(f"no {kind.__name__} matching {match!r}")


def case_errors(_):
    """A clear error on every rank, no hang: a hook registered twice, a state
    shared between two models, settings that differ between ranks."""
    expect_error(ValueError, "matrix_rank must be a positive int",
                 lambda: hvd_acp.ddp.ACPState(matrix_rank=0))

    state = hvd_acp.ddp.ACPState(matrix_rank=2, step_ahead=0)
    model = ddp(build(Square), state)
    expect_error(RuntimeError, "can only be called once",
                 lambda: model.register_comm_hook(state, hvd_acp.ddp.acp_hook))

    # One state on two models: the second model's first backward raises.
    shared = hvd_acp.ddp.ACPState(matrix_rank=2, step_ahead=0)
    first, second = ddp(build(Square), shared), ddp(build(Square, seed=1), shared)
    x, y = batch(rank(), 0)
    F.cross_entropy(first(x), y).backward()
    expect_error(RuntimeError, "one ACPState per DDP model",
                 lambda: F.cross_entropy(second(x), y).backward())

    named_module = build(Square)
    named = hvd_acp.ddp.ACPState(matrix_rank=2, named_parameters=named_module.named_parameters(),
                                 step_ahead=0)
    other = ddp(build(Square, seed=2), named)
    expect_error(RuntimeError, "not among this ACPState's parameters",
                 lambda: F.cross_entropy(other(x), y).backward())

    # Settings that differ between ranks: every rank raises, none hangs.
    differing = hvd_acp.ddp.ACPState(matrix_rank=2 + rank(), step_ahead=0)
    model = ddp(build(Square), differing)
    expect_error(ValueError, "matrix_rank=2 on rank 0 but 3 on rank 1",
                 lambda: F.cross_entropy(model(x), y).backward())


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=".")
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    for case in args.cases:
        try:
            CASES[case](args.dir)
            dist.barrier()
            report(f"OK {case} {rank()}")
        except Exception:  # noqa: BLE001 - reported, then the run stops
            report(f"FAIL {case} {rank()}\n{traceback.format_exc()}")
            break
    assert not any(m == "horovod" or m.startswith("horovod.") for m in sys.modules)
    leave_process_group()


if __name__ == "__main__":
    main()
