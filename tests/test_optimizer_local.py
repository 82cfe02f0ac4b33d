"""hvd_acp.DistributedOptimizer in one process, through a LocalCommunicator."""
import contextlib
import re
import warnings

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import hvd_acp
from hvd_acp.compression import Phase
from hvd_acp.fusion import plan_buckets

F64 = torch.float64


class ConvNet(nn.Module):
    """conv.weight (16, 27) and fc1.weight (32, 256) are compressed at rank 2;
    fc2.weight (2, 32) is not: (2 + 32) * 2 * 2 > 2 * 32."""

    COMPRESSED = {"conv.weight", "fc1.weight"}

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3)
        self.fc1 = nn.Linear(256, 32)
        self.fc2 = nn.Linear(32, 2)

    def forward(self, x):
        x = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


def _conv_net(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return ConvNet().to(dtype)


def _conv_input(step, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, 3, 6, 6, generator=gen, dtype=dtype)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 6)).double()


def _mlp_input(step):
    gen = torch.Generator().manual_seed(2000 + step)
    return torch.randn(8, 12, generator=gen, dtype=F64)


def _wrap(model, inner=None, comm=None, **kwargs):
    inner = inner or torch.optim.SGD(model.parameters(), lr=0.1)
    comm = comm or hvd_acp.LocalCommunicator()
    kwargs.setdefault("matrix_rank", 2)
    opt = hvd_acp.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                       communicator=comm, **kwargs)
    return opt, comm


def _backward(model, x):
    model(x).pow(2).mean().backward()


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _wire_elements(model, phase, compressed, r):
    total = 0
    for name, p in model.named_parameters():
        n = p.shape[0]
        m = p.numel() // n
        if name in compressed:
            total += (n if phase is Phase.P else m) * r
        else:
            total += p.numel()
    return total


# ------------------------------------------------------------------ wire volume
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("threshold", [0, 1 << 30])
def test_wire_volume_per_step_alternates_between_p_and_q(dtype, threshold):
    model = _conv_net(dtype)
    opt, comm = _wrap(model, fusion_threshold_bytes=threshold)
    assert {n for n, l in opt.reducer.layouts.items() if l.compressed} == ConvNet.COMPRESSED
    size = torch.empty((), dtype=dtype).element_size()
    phases = []
    for step in range(4):
        phases.append(opt.phase)
        sent = comm.stats.bytes_sent
        opt.zero_grad()
        _backward(model, _conv_input(step, dtype))
        opt.step()
        elements = _wire_elements(model, phases[-1], ConvNet.COMPRESSED, r=2)
        assert comm.stats.bytes_sent - sent == elements * size
        assert opt.comm_stats is comm.stats
    assert phases == [Phase.P, Phase.Q, Phase.P, Phase.Q]
    # Sanity of the expectation itself: P sends 16*2 + 32*2 factor elements.
    uncompressed = 16 + 32 + 2 * 32 + 2
    assert _wire_elements(model, Phase.P, ConvNet.COMPRESSED, 2) == 96 + uncompressed
    assert _wire_elements(model, Phase.Q, ConvNet.COMPRESSED, 2) == 27 * 2 + 256 * 2 + uncompressed


# ------------------------------------------------- one all-reduce per buffer
@pytest.mark.parametrize("threshold, buffers", [(0, {6}), (4000, {3, 4}), (1 << 30, {1})])
def test_one_allreduce_per_buffer_launched_during_backward(threshold, buffers):
    model = _conv_net()
    opt, comm = _wrap(model, fusion_threshold_bytes=threshold)
    layouts = list(opt.reducer.layouts.values())
    for step in range(4):
        plan = plan_buckets(layouts, opt.phase, threshold)
        assert len(plan) in buffers
        start = len(comm.launched)
        opt.zero_grad()
        _backward(model, _conv_input(step))
        # Every parameter got a gradient: all buffers are already in flight.
        during_backward = comm.launched[start:]
        opt.step()
        assert comm.launched[start:] == during_backward
        assert sorted(during_backward) == sorted(b.name for b in plan)
        assert comm.stats.allreduces == len(comm.launched)


def test_gradient_accumulation_launches_once_per_buffer():
    model = _conv_net()
    opt, comm = _wrap(model, fusion_threshold_bytes=0, backward_passes_per_step=2)
    for step in range(2):
        start = len(comm.launched)
        opt.zero_grad()
        _backward(model, _conv_input(2 * step))
        assert comm.launched[start:] == []
        _backward(model, _conv_input(2 * step + 1))
        assert len(comm.launched) - start == 6
        opt.step()
        assert len(comm.launched) - start == 6
        assert len(set(comm.launched[start:])) == 6


def test_parameter_without_gradient_is_still_reduced_once():
    model = _conv_net()
    opt, comm = _wrap(model, fusion_threshold_bytes=0)
    x = torch.relu(model.conv(_conv_input(0))).flatten(1)
    model.fc1(x).sum().backward()        # fc2 gets no gradient
    opt.step()
    assert len(comm.launched) == len(set(comm.launched)) == 6
    assert torch.count_nonzero(model.fc2.weight.grad) == 0


# ------------------------------------------------------------- applied update
def test_update_of_a_compressed_matrix_has_rank_at_most_r():
    torch.manual_seed(0)
    layer = nn.Linear(16, 12, bias=False).double()
    opt, _ = _wrap(layer, torch.optim.SGD(layer.parameters(), lr=1.0), matrix_rank=2)
    assert opt.reducer.layouts["weight"].compressed
    for step in range(4):
        before = layer.weight.detach().clone()
        opt.zero_grad()
        x = torch.randn(10, 16, generator=torch.Generator().manual_seed(step), dtype=F64)
        layer(x).pow(2).sum().backward()
        local_rank = torch.linalg.matrix_rank(layer.weight.grad).item()
        opt.step()
        delta = before - layer.weight.detach()
        assert_close(delta, layer.weight.grad)
        assert local_rank > 2
        assert 1 <= torch.linalg.matrix_rank(delta).item() <= 2


@pytest.mark.parametrize("cls", [hvd_acp.DistributedOptimizer, hvd_acp.PowerSGDOptimizer])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_error_feedback_identity_through_the_optimizer(cls, scale):
    """M + E(before) == G / (N w) + E(after) when the all-reduce leaves
    w * (sum over N ranks): at one rank G / (N w) is this rank's own factor
    product, so nothing of the gradient is lost or counted twice, whether
    the reduction averages (w = 1/N) or sums (w = 1, op=hvd.Sum)."""
    model = _conv_net(F64)
    opt = cls(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
              matrix_rank=2, fusion_threshold_bytes=0,
              communicator=hvd_acp.LocalCommunicator(scale))
    errors = opt.reducer.errors
    assert set(errors) == ConvNet.COMPRESSED
    for step in range(4):
        # The hooks add the gradient to the residual and subtract what is sent.
        a, applied = _step_with_residual(opt, model, step)
        for name in ConvNet.COMPRESSED:
            assert_close(a[name], applied[name] / scale + errors[name])
            assert errors[name].abs().max() > 0


def _step_with_residual(opt, model, step):
    """One step of ``model`` (a ConvNet in float64); returns, per compressed
    name as an (n, m) matrix, ``A = M + E`` (this rank's gradient plus the
    residual before the step) and the gradient handed to the optimizer."""
    errors = opt.reducer.errors
    before = {n: e.clone() for n, e in errors.items()}
    opt.zero_grad()
    _backward(model, _conv_input(step, F64))
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    params = dict(model.named_parameters())
    return ({n: local[n].reshape(e.shape) + before[n] for n, e in errors.items()},
            {n: params[n].grad.reshape(e.shape) for n, e in errors.items()})


class _InPlaceCommunicator(hvd_acp.LocalCommunicator):
    """Writes the reduced value over the buffer as soon as it is launched
    (Horovod reduces in place, on its own thread, while backward goes on),
    and records each compressed tensor's residual buffer at that moment."""

    def __init__(self, scale, errors):
        super().__init__(scale)
        self.errors = errors
        self.at_launch = {}

    def allreduce_async_(self, tensor, name):
        for key, error in self.errors().items():
            if key in name:
                self.at_launch[key] = error.clone()
        handle = super().allreduce_async_(tensor, name)
        tensor.mul_(self.scale)
        return handle

    def synchronize(self, handle):
        pass


@pytest.mark.parametrize("threshold", [0, 1 << 30])
def test_residual_is_computed_after_the_launch_from_the_factor_as_sent(threshold):
    """The factor that completes a buffer goes on the wire before its
    residual's GEMM: at the launch its residual still holds A = M + E (one
    buffer per tensor: every tensor), and afterwards E = A - P_i Qh^T with
    this rank's own P_i, not the reduced values the all-reduce wrote over it
    (one buffer for all: the other tensors' residuals, computed before)."""
    model = _conv_net(F64)
    comm = _InPlaceCommunicator(3.0, lambda: opt.reducer.errors)
    opt = hvd_acp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        matrix_rank=2, fusion_threshold_bytes=threshold, communicator=comm)
    errors = opt.reducer.errors
    for step in range(4):
        comm.at_launch.clear()
        a, applied = _step_with_residual(opt, model, step)
        for name in ConvNet.COMPRESSED:
            if threshold == 0:      # one buffer per tensor, named after it
                assert_close(comm.at_launch[name], a[name])
            assert_close(a[name], applied[name] / 3.0 + errors[name])
            assert (errors[name] - a[name]).abs().max() > 0


def _square_net(width=10, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width, bias=False), nn.Tanh(),
                         nn.Linear(width, width, bias=False), nn.Tanh(),
                         nn.Linear(width, width, bias=False)).double()


def test_square_layers_at_full_rank_match_plain_sgd():
    model, reference, initial = _square_net(), _square_net(), _square_net()
    opt, _ = _wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                   matrix_rank=10, min_compression_rate=0)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    assert all(l.compressed and l.r == 10 for l in opt.reducer.layouts.values())
    for step in range(5):
        x = torch.randn(6, 10, generator=torch.Generator().manual_seed(step), dtype=F64)
        for net, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            _backward(net, x)
            o.step()
    assert opt.step_count == 5
    for (name, p), q, p0 in zip(model.named_parameters(), reference.parameters(),
                                initial.parameters()):
        assert not torch.equal(p, p0)
        assert_close(p, q, atol=1e-12, rtol=1e-10, msg=name)
    for error in opt.reducer.errors.values():
        assert error.abs().max() < 1e-12


# ------------------------------------------------------------------- warm-up
def test_warmup_steps_average_densely_then_alternate():
    model = _mlp()
    opt, comm = _wrap(model, fusion_threshold_bytes=0, warmup_steps=2, min_compression_rate=1)
    compressed = {n for n, l in opt.reducer.layouts.items() if l.compressed}
    assert compressed == {"0.weight", "2.weight"}
    dense_elements = sum(p.numel() for p in model.parameters())
    phases = []
    for step in range(5):
        phases.append(opt.phase)
        start, sent = len(comm.launched), comm.stats.bytes_sent
        opt.zero_grad()
        _backward(model, _mlp_input(step))
        local = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        names = comm.launched[start:]
        assert len(names) == 4
        grads = {n: p.grad for n, p in model.named_parameters()}
        if step < 2:
            assert all(f".{Phase.DENSE.value}." in name for name in names)
            assert comm.stats.bytes_sent - sent == dense_elements * 8
            for name in local:
                assert torch.equal(grads[name], local[name]), name
            assert all(torch.count_nonzero(e) == 0 for e in opt.reducer.errors.values())
        else:
            assert all(f".{phases[-1].value}." in name for name in names)
            elements = _wire_elements(model, phases[-1], compressed, r=2)
            assert comm.stats.bytes_sent - sent == elements * 8
            for name in compressed:
                assert not torch.allclose(grads[name], local[name]), name
    assert phases == [Phase.DENSE, Phase.DENSE, Phase.P, Phase.Q, Phase.P]


# ------------------------------------------------------------- initial factors
def test_initial_factors_depend_only_on_the_seed_and_leave_the_global_rng_alone():
    factors = []
    for seed, global_seed in ((3, 11), (3, 12), (4, 11)):
        model = _conv_net()
        torch.manual_seed(global_seed)
        rng = torch.random.get_rng_state()
        opt, _ = _wrap(model, seed=seed)
        _backward(model, _conv_input(0))
        opt.step()
        assert torch.equal(torch.random.get_rng_state(), rng)
        factors.append(opt.reducer.state)
    first, same_seed, other_seed = factors
    assert set(first.q_factors) == ConvNet.COMPRESSED
    for name in ConvNet.COMPRESSED:
        for attr in ("p_factors", "q_factors"):
            assert torch.equal(getattr(first, attr)[name], getattr(same_seed, attr)[name])
            assert not torch.equal(getattr(first, attr)[name], getattr(other_seed, attr)[name])


def test_initial_factors_are_identical_before_any_step():
    a, _ = _wrap(_conv_net(), seed=5)
    torch.manual_seed(99)
    b, _ = _wrap(_conv_net(), seed=5)
    for name in ConvNet.COMPRESSED:
        assert torch.equal(a.reducer.state.q_factors[name], b.reducer.state.q_factors[name])
        assert torch.equal(a.reducer.state.p_factors[name], b.reducer.state.p_factors[name])


# ------------------------------------------------------- wrapping an optimizer
def test_wrapping_keeps_the_existing_momentum_buffers():
    model = _mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _backward(model, _mlp_input(0))
    inner.step()
    inner.zero_grad()
    buffers = {n: inner.state[p]["momentum_buffer"].clone()
               for n, p in model.named_parameters()}

    opt, _ = _wrap(model, inner)
    assert opt.state is inner.state and opt.param_groups is inner.param_groups
    for name, p in model.named_parameters():
        assert torch.equal(opt.state[p]["momentum_buffer"], buffers[name])

    before = _params(model)
    _backward(model, _mlp_input(1))
    opt.step()
    for name, p in model.named_parameters():
        expected = 0.9 * buffers[name] + p.grad
        assert_close(inner.state[p]["momentum_buffer"], expected)
        assert_close(before[name] - p.detach(), 0.1 * expected)


def test_lr_scheduler_on_the_wrapper_changes_the_lr_used():
    model = _mlp()
    opt, _ = _wrap(model, torch.optim.SGD(model.parameters(), lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    for step, lr in enumerate((1.0, 0.1, 0.01)):
        assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(lr)
        before = _params(model)
        opt.zero_grad()
        _backward(model, _mlp_input(step))
        opt.step()
        for name, p in model.named_parameters():
            assert_close(before[name] - p.detach(), lr * p.grad)
        with warnings.catch_warnings():
            # "lr_scheduler.step() before optimizer.step()" would mean the
            # scheduler did not see the wrapper's step().
            warnings.simplefilter("error")
            scheduler.step()


# --------------------------------------------------- synchronize, clip, step
@pytest.mark.parametrize("skip", [True, False])
def test_step_after_synchronize_uses_the_clipped_gradient(skip):
    model = _mlp()
    opt, comm = _wrap(model, torch.optim.SGD(model.parameters(), lr=1.0))
    for step in range(2):
        before = _params(model)
        opt.zero_grad()
        _backward(model, _mlp_input(step))
        opt.synchronize()
        launched = len(comm.launched)
        averaged = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in averaged.values()]))
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.25 * norm.item())
        clipped = {n: p.grad.clone() for n, p in model.named_parameters()}
        if skip:
            with opt.skip_synchronize():
                opt.step()
        else:
            with pytest.warns(UserWarning, match=r"optimizer.step\(\) called without "
                              r"optimizer.skip_synchronize\(\) context"):
                opt.step()
        assert len(comm.launched) == launched
        for name, p in model.named_parameters():
            # clip_grad_norm_ divides by (norm + 1e-6): hence rtol.
            assert_close(clipped[name], 0.25 * averaged[name], rtol=1e-4, atol=0)
            assert torch.equal(p.grad, clipped[name])
            assert_close(before[name] - p.detach(), clipped[name])
    assert opt.step_count == 2


# --------------------------------------------------------------- zero_grad
def test_zero_grad_both_ways():
    model = _mlp()
    opt, _ = _wrap(model)
    _backward(model, _mlp_input(0))
    opt.step()
    grads = [p.grad for p in model.parameters()]
    opt.zero_grad(set_to_none=False)
    for p, g in zip(model.parameters(), grads):
        assert p.grad is g
        assert torch.count_nonzero(p.grad) == 0
    _backward(model, _mlp_input(1))
    opt.step()
    assert all(torch.count_nonzero(p.grad) > 0 for p in model.parameters())
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_zero_grad_between_backward_and_step_is_refused():
    model = _mlp()
    opt, _ = _wrap(model)
    _backward(model, _mlp_input(0))
    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()
    assert opt.step_count == 1


# -------------------------------------------------------- argument validation
@pytest.mark.parametrize("kwargs, argument", [
    ({"matrix_rank": 0}, "matrix_rank"),
    ({"matrix_rank": -1}, "matrix_rank"),
    ({"matrix_rank": 2.5}, "matrix_rank"),
    ({"matrix_rank": True}, "matrix_rank"),
    ({"fusion_threshold_bytes": -1}, "fusion_threshold_bytes"),
    ({"min_compression_rate": -0.5}, "min_compression_rate"),
    ({"warmup_steps": -1}, "warmup_steps"),
])
def test_bad_settings_raise_value_error_naming_the_argument(kwargs, argument):
    model = _mlp()
    (value,) = kwargs.values()
    with pytest.raises(ValueError, match=f"{argument}.*{re.escape(repr(value))}"):
        _wrap(model, **kwargs)


def test_duplicate_names_are_rejected():
    model = _mlp()
    named = [("layer", p) for p in model.parameters()]
    with pytest.raises(ValueError, match="unique.*'layer'"):
        hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=named,
                                     communicator=hvd_acp.LocalCommunicator())


def test_parameters_missing_from_named_parameters_are_rejected():
    model = _mlp()
    named = list(model.named_parameters())[:-1]
    with pytest.raises(ValueError, match=r"named_parameters.*not named.*\[3\]"):
        hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=named,
                                     communicator=hvd_acp.LocalCommunicator())


def test_integer_parameters_are_carried_and_complex_ones_rejected():
    weight = nn.Parameter(torch.zeros(4, 4))
    counter = torch.arange(4, dtype=torch.int64)
    inner = torch.optim.SGD([{"params": [weight, counter]}], lr=0.1)
    opt = hvd_acp.DistributedOptimizer(inner, named_parameters=[("weight", weight),
                                                                ("counter", counter)],
                                       communicator=hvd_acp.LocalCommunicator())
    assert list(opt.reducer.params) == ["weight"]
    assert opt.parameter_names == {weight: "weight", counter: "counter"}
    (weight * torch.arange(16.0).view(4, 4)).sum().backward()
    opt.step()
    assert torch.equal(counter, torch.arange(4)) and counter.grad is None
    assert torch.count_nonzero(weight) > 0

    complex_weight = nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64))
    with pytest.raises(TypeError, match="'z'.*torch.complex64"):
        hvd_acp.DistributedOptimizer(torch.optim.SGD([complex_weight], lr=0.1),
                                     named_parameters=[("z", complex_weight)],
                                     communicator=hvd_acp.LocalCommunicator())


def test_generated_names_cover_every_group():
    model = _mlp()
    inner = torch.optim.SGD([{"params": list(model[0].parameters())},
                             {"params": list(model[2].parameters()), "lr": 0.01}], lr=0.1)
    opt = hvd_acp.DistributedOptimizer(inner, communicator=hvd_acp.LocalCommunicator())
    assert opt._parameter_names == {model[0].weight: "allreduce.noname.0.0",
                                    model[0].bias: "allreduce.noname.0.1",
                                    model[2].weight: "allreduce.noname.1.0",
                                    model[2].bias: "allreduce.noname.1.1"}
    assert opt.parameter_names == opt._parameter_names


# ------------------------------------------------------------ sparse gradients
def _embedding_steps(opt, emb, steps=3):
    grads = []
    for step in range(steps):
        idx = torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        emb(idx).pow(2).sum().backward()
        if isinstance(opt, hvd_acp.DistributedOptimizer):
            opt.synchronize()
        grads.append(emb.weight.grad)
        with getattr(opt, "skip_synchronize", contextlib.nullcontext)():
            opt.step()
    return grads


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients_reach_sparse_adam_unchanged_in_one_process(sparse_as_dense):
    torch.manual_seed(0)
    emb, ref = nn.Embedding(10, 3, sparse=True), nn.Embedding(10, 3, sparse=True)
    ref.load_state_dict(emb.state_dict())
    comm = hvd_acp.LocalCommunicator()
    # Rank 4 leaves the (10, 3) embedding whole: what arrives is exact.
    opt = hvd_acp.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                                       named_parameters=emb.named_parameters(),
                                       communicator=comm, sparse_as_dense=sparse_as_dense,
                                       matrix_rank=4)
    plain = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    for grad, ref_grad in zip(_embedding_steps(opt, emb), _embedding_steps(plain, ref)):
        assert grad.is_sparse
        assert_close(grad.to_dense(), ref_grad.to_dense())
    assert_close(emb.weight, ref.weight)
    # Sent apart, the sparse gradient is one more operation per step.
    buffers = 1 if sparse_as_dense else 2
    assert comm.stats.allreduces == 3 * buffers
    assert any(".sparse." in name for name in comm.launched) != sparse_as_dense


def test_sparse_gradient_sent_apart_leaves_its_compression_state_alone():
    torch.manual_seed(0)
    emb = nn.Embedding(40, 16, sparse=True)
    opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                       named_parameters=emb.named_parameters(),
                                       communicator=hvd_acp.LocalCommunicator(),
                                       matrix_rank=2)
    assert opt.reducer.layouts["weight"].compressed
    factors = [opt.reducer.state.p_factors["weight"].clone(), opt.reducer.state.q_factors["weight"].clone()]
    for step in range(2):                     # a P step and a Q step
        before = emb.weight.detach().clone()
        opt.zero_grad()
        emb(torch.tensor([3, 5, 5])).sum().backward()
        opt.step()
        moved = (before - emb.weight.detach()).abs().sum(dim=1) > 0
        assert moved.nonzero().flatten().tolist() == [3, 5]       # exact, sparse update
    assert torch.count_nonzero(opt.reducer.errors["weight"]) == 0
    assert torch.equal(opt.reducer.state.p_factors["weight"], factors[0])
    assert torch.equal(opt.reducer.state.q_factors["weight"], factors[1])


def test_sparse_gradient_without_a_sparse_reduction_names_the_way_out():
    class DenseOnly(hvd_acp.LocalCommunicator):
        sparse_allreduce_async = hvd_acp.Communicator.sparse_allreduce_async

    emb = nn.Embedding(10, 3, sparse=True)
    opt = hvd_acp.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters()),
                                       named_parameters=emb.named_parameters(),
                                       communicator=DenseOnly())
    with pytest.raises(NotImplementedError, match="DenseOnly.*sparse_as_dense=True"):
        emb(torch.tensor([1, 2])).sum().backward()
    del opt


# ----------------------------------------------------- outside the process set
class _Outsider(hvd_acp.LocalCommunicator):
    """A rank outside the process set: any collective would be an error."""

    def included(self) -> bool:
        return False

    def _refuse(self, *args, **kwargs):
        raise AssertionError("a collective ran on a rank outside the process set")

    allreduce_async_ = synchronize = sparse_allreduce_async = _refuse
    allgather_object = broadcast_object = _refuse

    def size(self) -> int:
        return 2


def test_rank_outside_the_process_set_steps_locally_without_collectives():
    model, local = _mlp(), _mlp()
    opt, comm = _wrap(model, comm=_Outsider())
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    for step in range(3):
        for o, m in ((opt, model), (local_opt, local)):
            o.zero_grad()
            _backward(m, _mlp_input(step))
            o.step()
    opt.sync_compression_state()
    for (name, p), q in zip(model.named_parameters(), local.parameters()):
        assert torch.equal(p, q), name
    assert comm.stats.allreduces == 0 and opt.step_count == 0

    with pytest.raises(ValueError, match="matrix_rank"):
        _wrap(_mlp(), comm=_Outsider(), matrix_rank=0)
