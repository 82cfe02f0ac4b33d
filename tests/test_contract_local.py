"""Production contract in one process: misuse errors, checkpoint formats,
non-finite repair, ownership of parameters."""
import copy
import gc

import pytest
import torch
import torch.nn.functional as F

import hvd_acp
from hvd_acp import LocalCommunicator, Phase


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def wrap(model, cls=hvd_acp.DistributedOptimizer, **kwargs):
    kwargs.setdefault("matrix_rank", 2)
    return cls(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
               model.named_parameters(), communicator=LocalCommunicator(), **kwargs)


def loss_of(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    return F.cross_entropy(model(torch.randn(8, 10, generator=g)),
                           torch.randint(0, 4, (8,), generator=g))


def test_zero_grad_between_backward_and_step_raises():
    model = make_model()
    opt = wrap(model)
    loss_of(model).backward()
    with pytest.raises(RuntimeError, match="zero_grad.*before optimizer.step"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()          # allowed again after step()


def test_second_backward_with_one_pass_per_step_raises():
    model = make_model()
    opt = wrap(model)
    loss_of(model).backward()
    with pytest.raises(RuntimeError, match="backward_passes_per_step=1"):
        loss_of(model, seed=1).backward()


def test_too_many_passes_with_accumulation_raises():
    model = make_model()
    opt = wrap(model, backward_passes_per_step=2)
    loss_of(model).backward()
    loss_of(model, seed=1).backward()
    with pytest.raises(RuntimeError, match="more than backward_passes_per_step=2"):
        loss_of(model, seed=2).backward()
    del opt


def test_a_parameter_belongs_to_one_optimizer_until_closed():
    model = make_model()
    opt = wrap(model)
    with pytest.raises(ValueError, match="already handled by another hvd_acp optimizer"):
        wrap(model)
    opt.close()
    again = wrap(model)
    loss_of(model).backward()
    again.step()
    del again
    gc.collect()
    wrap(model)              # a garbage-collected optimizer releases its parameters


def test_closed_optimizer_leaves_no_hook():
    model = make_model()
    opt = wrap(model)
    opt.close()
    loss_of(model).backward()           # would raise inside the hook if one were left
    assert opt.comm_stats.allreduces == 0
    opt.step()                          # communicates in step(), but hooks stay removed
    assert opt.comm_stats.allreduces == 1
    model.zero_grad()
    loss_of(model).backward()
    loss_of(model).backward()           # a hook would raise: one pass per step


def test_step_with_closure_is_rejected():
    model = make_model()
    opt = wrap(model)
    loss_of(model).backward()
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(lambda: loss_of(model))


@pytest.mark.parametrize("cls", [hvd_acp.DistributedOptimizer, hvd_acp.PowerSGDOptimizer])
def test_checkpoint_resume_is_bitwise(cls):
    def run(model, opt, steps, start):
        for step in range(start, start + steps):
            opt.zero_grad()
            loss_of(model, seed=step).backward()
            opt.step()

    model = make_model()
    opt = wrap(model, cls)
    run(model, opt, 3, 0)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())   # as torch.save would
    assert saved_opt["hvd_acp"]["step_count"] == 3 and saved_opt["hvd_acp"]["version"] == 2
    run(model, opt, 4, 3)
    expected = [p.detach().clone() for p in model.parameters()]
    opt.close()

    resumed = make_model(seed=5)
    resumed.load_state_dict(saved_model)
    opt2 = wrap(resumed, cls)
    opt2.load_state_dict(saved_opt)
    run(resumed, opt2, 4, 3)
    for got, want in zip(resumed.parameters(), expected):
        assert torch.equal(got, want)


def test_plain_and_wrapped_checkpoints_load_into_each_other():
    model = make_model()
    opt = wrap(model)
    loss_of(model).backward()
    opt.step()
    wrapped_state = opt.state_dict()
    assert "hvd_acp" in wrapped_state
    plain = torch.optim.SGD(make_model().parameters(), lr=0.1, momentum=0.9)
    plain.load_state_dict(wrapped_state)
    assert set(plain.state_dict()["state"]) == set(wrapped_state["state"])

    phase, factors = opt.phase, {k: v.clone() for k, v in opt.reducer.state.q_factors.items()}
    plain_state = plain.state_dict()
    plain_state["param_groups"][0]["lr"] = 0.01
    opt.load_state_dict(plain_state)       # no hvd_acp section: compression state kept
    assert opt.param_groups[0]["lr"] == 0.01 and opt.phase is phase
    for name, value in factors.items():
        assert torch.equal(opt.reducer.state.q_factors[name], value)


def test_loading_a_checkpoint_of_another_model_names_the_problem():
    opt = wrap(make_model())
    state = opt.state_dict()
    other = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt_other = wrap(other)
    with pytest.raises(ValueError, match="'0.weight'.*shape"):
        opt_other.load_state_dict(state)
    state["hvd_acp"]["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        wrap(make_model(1)).load_state_dict(state)


def test_a_compression_section_that_cannot_load_loads_nothing():
    # An unknown format or factors of another shape raise before the wrapped
    # optimizer's state is touched: nothing half-loaded.
    model = make_model()
    opt = wrap(model)
    loss_of(model).backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["lr"] = 0.5
    other = wrap(make_model(1))
    lr_before = other.param_groups[0]["lr"]
    unknown = copy.deepcopy(saved)
    unknown["hvd_acp"]["version"] = 1
    with pytest.raises(ValueError, match="unsupported hvd_acp state format version 1"):
        other.load_state_dict(unknown)
    reshaped = copy.deepcopy(saved)
    name = next(iter(reshaped["hvd_acp"]["params"]))
    reshaped["hvd_acp"]["params"][name]["Q"] = torch.zeros(3, 1)
    with pytest.raises(ValueError, match=f"{name!r}: Q has shape \\(3, 1\\)"):
        other.load_state_dict(reshaped)
    assert other.param_groups[0]["lr"] == lr_before and other.step_count == 0
    other.load_state_dict(saved)
    assert other.param_groups[0]["lr"] == 0.5 and other.step_count == 1
    for name, factor in opt.reducer.state.p_factors.items():
        assert torch.equal(other.reducer.state.p_factors[name], factor)


@pytest.mark.parametrize("cls", [hvd_acp.DistributedOptimizer, hvd_acp.PowerSGDOptimizer])
def test_nonfinite_gradient_reaches_grad_but_not_the_state(cls):
    model = make_model()
    opt = wrap(model, cls)
    for step in range(3):
        opt.zero_grad()
        loss_of(model, seed=step).backward()
        opt.step()
    before = opt.reducer.state_dict()["params"]          # clones
    opt.zero_grad()
    (loss_of(model, seed=9) * float("inf")).backward()
    opt.synchronize()
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert opt.reducer.nonfinite_steps == 1
    for name, entry in opt.reducer.state_dict()["params"].items():
        assert torch.equal(entry["P"], before[name]["P"]) or cls is hvd_acp.PowerSGDOptimizer
        assert torch.equal(entry["Q"], before[name]["Q"])
        assert torch.isfinite(entry["error"]).all() and not entry["error"].any()


def test_bf16_parameters_keep_float32_factors():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 12).to(torch.bfloat16)
    opt = wrap(model)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    opt.step()
    assert model.weight.grad.dtype == torch.bfloat16
    assert opt.reducer.errors["weight"].dtype == torch.float32
    assert opt.phase is Phase.Q
