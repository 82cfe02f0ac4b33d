"""Step-ahead error feedback in one process: the shift's maths and what the
parameters hold around forward, backward and step()."""
import logging

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import hvd_acp
from hvd_acp.compression import adaptive_shift_denom, step_ahead_shift
from hvd_acp.stepahead import eventual_step

F64 = torch.float64


class Net(nn.Module):
    """fc1.weight (24, 32) is compressed at rank 2, fc2.weight (3, 24) is not."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 24)
        self.fc2 = nn.Linear(24, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _net(seed=0):
    torch.manual_seed(seed)
    return Net().double()


def _batch(step):
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(16, 32, generator=gen, dtype=F64)


def _wrap(model, inner=None, **kwargs):
    inner = inner or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kwargs.setdefault("matrix_rank", 2)
    return hvd_acp.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                        communicator=hvd_acp.LocalCommunicator(), **kwargs)


def _train_step(model, opt, step):
    opt.zero_grad()
    model(_batch(step)).pow(2).mean().backward()
    opt.step()


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------- maths
def test_shift_is_the_residual_in_applied_units_times_lr_and_a():
    gen = torch.Generator().manual_seed(0)
    error = torch.randn(5, 7, generator=gen, dtype=F64)
    assert_close(step_ahead_shift(error, 0.3, 2.0), 0.6 * error)
    # Sign: the shift points where paying the residual takes the weights
    # (w - shift), like a gradient step on E.
    assert torch.sum(step_ahead_shift(error, 0.3, 2.0) * error) > 0
    denom = torch.rand(5, 7, generator=gen, dtype=F64) + 0.5
    assert_close(step_ahead_shift(error, 0.3, 2.0, denom=denom), 0.6 * error / denom)
    assert error.abs().sum() > 0                      # not modified in place


def test_adaptive_divisor_is_adams_for_a_step_on_the_residual():
    gen = torch.Generator().manual_seed(2)
    error = torch.randn(4, 5, generator=gen, dtype=F64)
    v = torch.rand(4, 5, generator=gen, dtype=F64) + 0.1
    beta2, step, eps = 0.999, 7.0, 1e-8
    denom = adaptive_shift_denom(error, v, beta2, step, eps)
    expected = ((beta2 * v + (1 - beta2) * error ** 2) / (1 - beta2 ** 8)).sqrt() + eps
    assert_close(denom, expected)
    # A residual small against the gradients so far, many steps in: Adam's
    # own sqrt(v_hat) + eps, to within the decay of one step.
    small = adaptive_shift_denom(error * 1e-6, v, beta2, 1000.0, eps)
    assert_close(small, (v / (1 - beta2 ** 1000)).sqrt() + eps, rtol=1e-3, atol=0)


@pytest.mark.parametrize("step", [1.0, 10.0, 1000.0])
def test_adaptive_shift_is_bounded_where_the_second_moment_is_tiny(step):
    # An element the first compressed steps sent little of has a tiny v: the
    # shift E / denom is bounded by sqrt((1 - beta2^(t + 1)) / (1 - beta2)).
    beta2 = 0.999
    error = torch.tensor([[3.0, -2.0, 1e-3]], dtype=F64)
    v = torch.tensor([[1e-20, 0.0, 1.0]], dtype=F64)
    ratio = error / adaptive_shift_denom(error, v, beta2, step, 1e-8)
    bound = ((1 - beta2 ** (step + 1)) / (1 - beta2)) ** 0.5
    assert ratio[0, :2].abs().max() <= bound * (1 + 1e-9)
    assert ratio[0, :2].abs().min() >= 0.99 * bound          # reached where v is 0
    assert ratio[0, 2].abs() < 1e-2                          # a large v keeps it small


def test_adaptive_shift_under_a_summing_front_end_is_the_averaging_ones():
    # op=Sum: Adam sees N times the gradient (its v N^2 times), the residual
    # counts 1/N of the applied sum (share 1/N), and the user keeps lr.
    world, beta2 = 4, 0.999
    gen = torch.Generator().manual_seed(3)
    error = torch.randn(3, 6, generator=gen, dtype=F64)
    v = torch.rand(3, 6, generator=gen, dtype=F64) * 1e-3
    averaged = step_ahead_shift(error, 0.3, 2.0, denom=adaptive_shift_denom(
        error, v, beta2, 5.0, 1e-8))
    summed = step_ahead_shift(error, 0.3, 2.0, share=1.0 / world, denom=adaptive_shift_denom(
        error, v * world ** 2, beta2, 5.0, 1e-8 * world, share=1.0 / world))
    assert_close(summed, averaged)


def test_summing_and_averaging_reductions_shift_alike():
    # N ranks, same residuals. op=Average: share 1 and the user's lr;
    # op=Sum: the update is N times larger, so the user divides lr by N, and
    # the residual counts 1/N of the applied sum (share = 1/N). The shift is
    # the same weight-space displacement either way.
    world, lr = 3, 0.3
    gen = torch.Generator().manual_seed(1)
    errors = [torch.randn(4, 6, generator=gen, dtype=F64) for _ in range(world)]
    for error in errors:
        averaged = step_ahead_shift(error, lr, 0.5, share=1.0)
        summed = step_ahead_shift(error, lr / world, 0.5, share=1.0 / world)
        assert_close(summed, averaged)
        wrong_share = step_ahead_shift(error, lr / world, 0.5, share=1.0)
        assert not torch.allclose(wrong_share, averaged)


def test_eventual_step_of_sgd_momentum_dampening_and_adam():
    assert eventual_step({"lr": 0.1}, adaptive=False) == pytest.approx(0.1)
    assert eventual_step({"lr": 0.1, "momentum": 0.9}, adaptive=False) == pytest.approx(1.0)
    assert eventual_step({"lr": 0.1, "momentum": 0.9, "dampening": 0.5},
                         adaptive=False) == pytest.approx(0.5)
    assert eventual_step({"lr": 0.1, "betas": (0.9, 0.999)}, adaptive=True) == \
        pytest.approx(0.1)


# --------------------------------------------------------- the parameters
@pytest.mark.parametrize("step_ahead", [0.2, 0.5])
def test_training_forward_shifts_compressed_weights_by_their_residual(step_ahead):
    model = _net()
    opt = _wrap(model, step_ahead=step_ahead)
    _train_step(model, opt, 0)
    true = _params(model)
    error = opt.reducer.errors["fc1.weight"].clone()
    assert error.abs().max() > 0
    model(_batch(1))                                   # training mode, grad enabled
    expected = true["fc1.weight"] - step_ahead * 0.1 / (1 - 0.9) * error
    assert_close(model.fc1.weight.detach(), expected, rtol=1e-12, atol=1e-14)
    for name in ("fc1.bias", "fc2.weight", "fc2.bias"):       # not compressed
        assert torch.equal(dict(model.named_parameters())[name].detach(), true[name])


def test_update_applies_to_the_true_weights():
    model = _net()
    opt = _wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), step_ahead=0.5)
    _train_step(model, opt, 0)
    true = _params(model)
    opt.zero_grad()
    model(_batch(1)).pow(2).mean().backward()
    assert not torch.equal(model.fc1.weight.detach(), true["fc1.weight"])
    opt.synchronize()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with opt.skip_synchronize():
        opt.step()
    for name, p in model.named_parameters():
        assert_close(p.detach(), true[name] - 0.1 * grads[name], rtol=0, atol=1e-15,
                     msg=lambda m, name=name: f"{name}: {m}")


def test_gradient_is_taken_at_the_shifted_weights():
    model, twin = _net(), _net()
    opt = _wrap(model, step_ahead=0.5)
    _train_step(model, opt, 0)
    shifted_weight = model.fc1.weight.detach() - 0.5 * 1.0 * opt.reducer.errors["fc1.weight"]
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        twin.fc1.weight.copy_(shifted_weight)
    twin(_batch(1)).pow(2).mean().backward()
    opt.zero_grad()
    model(_batch(1)).pow(2).mean().backward()
    # fc2 is uncompressed: its gradient reaches p.grad as computed, at the
    # shifted fc1 weights.
    opt.synchronize()
    assert_close(model.fc2.weight.grad, twin.fc2.weight.grad, rtol=1e-12, atol=1e-14)


def test_no_shift_in_eval_mode_or_without_grad():
    model = _net()
    opt = _wrap(model)
    _train_step(model, opt, 0)
    true = _params(model)
    with torch.no_grad():
        model(_batch(1))
    model.eval()
    model(_batch(1))
    model.train()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), true[name]), name
    model(_batch(1))
    assert not torch.equal(model.fc1.weight.detach(), true["fc1.weight"])


def test_true_weights_inside_the_context_and_shift_back_after():
    model = _net()
    opt = _wrap(model)
    _train_step(model, opt, 0)
    true = _params(model)
    model(_batch(1)).pow(2).mean().backward()
    shifted = model.fc1.weight.detach().clone()
    with opt.true_weights():
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), true[name]), name
    assert torch.equal(model.fc1.weight.detach(), shifted)
    opt.step()
    assert opt.step_count == 2


def test_a_write_after_the_forward_pass_wins_and_warns(caplog):
    model = _net()
    opt = _wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), step_ahead=0.5)
    _train_step(model, opt, 0)
    model(_batch(1)).pow(2).mean().backward()
    # Between backward and synchronize(), the end of the window of the shift.
    written = torch.full_like(model.fc1.weight, 0.25)
    with torch.no_grad():
        model.fc1.weight.copy_(written)
    with caplog.at_level(logging.WARNING, logger="hvd_acp.stepahead"):
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
    assert "fc1.weight" in caplog.text and "step-ahead" in caplog.text
    assert_close(model.fc1.weight.detach(), written - 0.1 * model.fc1.weight.grad,
                 rtol=0, atol=1e-15)


def test_step_ahead_zero_and_close_leave_the_weights_alone():
    model = _net()
    opt = _wrap(model, step_ahead=0)
    _train_step(model, opt, 0)
    true = _params(model)
    model(_batch(1))
    assert torch.equal(model.fc1.weight.detach(), true["fc1.weight"])

    other = _net(1)
    opt2 = _wrap(other)
    _train_step(other, opt2, 0)
    opt2.close()
    before = _params(other)
    other(_batch(1))
    assert torch.equal(other.fc1.weight.detach(), before["fc1.weight"])


def test_load_state_dict_after_the_forward_pass_restores_the_true_weights():
    model = _net()
    opt = _wrap(model)
    _train_step(model, opt, 0)
    true = _params(model)
    state = opt.state_dict()
    model(_batch(1))
    opt.load_state_dict(state)
    assert torch.equal(model.fc1.weight.detach(), true["fc1.weight"])
    # The loaded residual is shifted again before the next training forward.
    model(_batch(1))
    assert not torch.equal(model.fc1.weight.detach(), true["fc1.weight"])


def test_adam_shift_is_adams_step_on_the_residual():
    model = _net()
    inner = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-8)
    opt = _wrap(model, inner, step_ahead=0.5)
    _train_step(model, opt, 0)
    _train_step(model, opt, 1)
    true = _params(model)
    error = opt.reducer.errors["fc1.weight"].clone()
    state = inner.state[model.fc1.weight]
    # Adam's divisor had it taken one more step, on the residual.
    steps = float(state["step"])
    v_next = 0.999 * state["exp_avg_sq"] + 0.001 * error ** 2
    denom = (v_next / (1 - 0.999 ** (steps + 1))).sqrt() + 1e-8
    model(_batch(2))
    expected = true["fc1.weight"] - 0.5 * 0.01 * error / denom
    assert_close(model.fc1.weight.detach(), expected, rtol=1e-10, atol=1e-12)
    # The residual's own term matters somewhere: not Adam's sqrt(v_hat) alone.
    v_hat = state["exp_avg_sq"] / (1 - 0.999 ** steps)
    assert not torch.allclose(denom, v_hat.sqrt() + 1e-8, rtol=1e-3, atol=0)


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), True, "0.2"])
def test_bad_step_ahead_raises_value_error_naming_it(value):
    model = _net()
    with pytest.raises(ValueError, match="step_ahead"):
        _wrap(model, step_ahead=value)


def test_another_models_forward_leaves_our_weights_alone():
    model, other = _net(), _net(1)
    opt = _wrap(model)
    _train_step(model, opt, 0)
    true = _params(model)
    other(_batch(1)).sum().backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), true[name]), name
    model(_batch(1))                     # a module holding our parameters
    assert not torch.equal(model.fc1.weight.detach(), true["fc1.weight"])


@pytest.mark.parametrize("cls", [hvd_acp.DistributedOptimizer, hvd_acp.PowerSGDOptimizer])
def test_shift_follows_a_rescaling_of_the_gradient_between_synchronize_and_step(cls):
    # AMP: synchronize() writes scaled gradients, GradScaler.unscale_ divides
    # them by the scale; the residual is in the written (scaled) units, so
    # the shift is divided by the same factor.
    model, twin = _net(), _net()
    opts = [cls(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                named_parameters=m.named_parameters(), matrix_rank=2,
                communicator=hvd_acp.LocalCommunicator()) for m in (model, twin)]
    for net, opt, scale in ((model, opts[0], 1.0), (twin, opts[1], 1024.0)):
        opt.zero_grad()
        (scale * net(_batch(0)).pow(2).mean()).backward()
        opt.synchronize()
        if scale != 1.0:
            for p in net.parameters():
                p.grad.div_(scale)
        with opt.skip_synchronize():
            opt.step()
    assert_close(twin.fc1.weight.detach(), model.fc1.weight.detach())
    errors = [o.reducer.errors["fc1.weight"] for o in opts]
    assert_close(errors[1], 1024.0 * errors[0])
    before = [m.fc1.weight.detach().clone() for m in (model, twin)]
    model(_batch(1))
    twin(_batch(1))
    shifts = [b - m.fc1.weight.detach() for b, m in zip(before, (model, twin))]
    assert shifts[0].abs().max() > 0
    assert_close(shifts[1], shifts[0])


# ------------------------------------------------------------ how it is stored
def _data_ptr(param):
    return param.detach().data_ptr()


def test_shift_swaps_buffers_and_copies_nothing_back():
    """The shifted weights live in a second buffer: the parameter's storage
    alternates between two buffers, and the true weights come back bit for bit."""
    model = _net()
    opt = _wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    _train_step(model, opt, 0)
    true_ptr = _data_ptr(model.fc1.weight)
    true = model.fc1.weight.detach().clone()
    model(_batch(1)).pow(2).mean().backward()
    shifted_ptr = _data_ptr(model.fc1.weight)
    assert shifted_ptr != true_ptr
    assert not torch.equal(model.fc1.weight.detach(), true)
    assert _data_ptr(model.fc2.weight) == _data_ptr(model.fc2.weight)   # not compressed
    with opt.true_weights():
        assert _data_ptr(model.fc1.weight) == true_ptr
        assert torch.equal(model.fc1.weight.detach(), true)
    assert _data_ptr(model.fc1.weight) == shifted_ptr
    opt.synchronize()
    grad = model.fc1.weight.grad.clone()
    momentum = opt.state[model.fc1.weight].get("momentum_buffer").clone()
    with opt.skip_synchronize():
        opt.step()
    # The update went to the true weights' own buffer, and the next shift
    # reuses the other one: two buffers, no third.
    assert _data_ptr(model.fc1.weight) == true_ptr
    assert_close(model.fc1.weight.detach(), true - 0.1 * (0.9 * momentum + grad),
                 rtol=0, atol=1e-15)
    model(_batch(2))
    assert _data_ptr(model.fc1.weight) == shifted_ptr


def test_a_parameter_viewing_a_larger_storage_keeps_its_storage():
    """A parameter that is a view into a flat buffer (cuDNN's RNN weights, a
    sharded optimizer's bucket) is shifted in place and copied back: the flat
    buffer sees the shift, and the true weights still come back bit for bit."""
    model = _net()
    weight = model.fc1.weight
    flat = torch.zeros(weight.numel() + 10, dtype=weight.dtype)
    flat[:weight.numel()].copy_(weight.detach().view(-1))
    weight.data = flat[:weight.numel()].view(weight.shape)
    opt = _wrap(model)
    _train_step(model, opt, 0)
    true = weight.detach().clone()
    model(_batch(1)).pow(2).mean().backward()
    assert weight.detach().data_ptr() == flat.data_ptr()
    assert not torch.equal(flat[:weight.numel()].view(weight.shape), true)
    with opt.true_weights():
        assert torch.equal(flat[:weight.numel()].view(weight.shape), true)
    opt.step()
    assert weight.detach().data_ptr() == flat.data_ptr()


def test_true_weights_between_forward_and_backward_keeps_the_gradient():
    """Entering and leaving the context swaps buffers without a write, so
    autograd's saved weights stay valid and the gradient is the shifted one's."""
    reference, model = _net(), _net()
    opts = [_wrap(m) for m in (reference, model)]
    for m, o in zip((reference, model), opts):
        _train_step(m, o, 0)
    reference(_batch(1)).pow(2).mean().backward()
    loss = model(_batch(1)).pow(2).mean()
    with opts[1].true_weights():
        model(_batch(2))                       # e.g. an evaluation in between
    loss.backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name
        assert torch.equal(a.detach(), b.detach()), name
