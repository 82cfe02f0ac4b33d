"""Mixed precision with the real ``torch.amp.GradScaler``: step-ahead reads
the scaler's units, in every front end.

One process first (``hvd_acp.LocalCommunicator``), then every front end at 2
and 4 ranks under its launcher (``tests/workers/amp_cases.py``). No
autocast: with fp32 on the wire the only difference a scaler makes is a
power-of-two factor, exact in fp32, so a run under it must be the unscaled
run bit for bit.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import hvd_acp
from hvd_acp.rescaling import GradientRescaling
from tests.hvdrun import horovodrun, torchrun

OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9),
              "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2)}


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()


def _wrap(cls, model, optimizer, **settings):
    return cls(OPTIMIZERS[optimizer](model.parameters()), named_parameters=model.named_parameters(),
               matrix_rank=2, communicator=hvd_acp.LocalCommunicator(), **settings)


def _train(cls, optimizer, scaler, steps=10, overflow_at=None):
    """The guide's pattern; returns the model, its optimizer and the weights
    before and after each step."""
    model = _net()
    opt = _wrap(cls, model, optimizer)
    history = []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            loss = scaler.scale(loss)
        if step == overflow_at:
            loss = loss * float("inf")
        loss.backward()
        opt.synchronize()
        before = [p.detach().clone() for p in model.parameters()]
        if scaler is not None:
            scaler.unscale_(opt)
        with opt.skip_synchronize():
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
        history.append((before, [p.detach().clone() for p in model.parameters()]))
    return model, opt, history


# ---------------------------------------------------------------- one process
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("cls", [hvd_acp.DistributedOptimizer, hvd_acp.PowerSGDOptimizer])
def test_a_constant_scale_trains_the_unscaled_run_bit_for_bit(cls, optimizer):
    plain, _, _ = _train(cls, optimizer, None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=10 ** 6)
    scaled, opt, _ = _train(cls, optimizer, scaler)
    assert opt.settings.step_ahead > 0
    for a, b in zip(plain.parameters(), scaled.parameters()):
        assert torch.equal(a, b)
    # The residuals are in the scaler's units; the step-ahead unit undoes them.
    assert opt.reducer.state.rescaling.unit == 2.0 ** -16


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_skipped_step_leaves_the_true_weights_and_training_goes_on(optimizer):
    scaler = torch.amp.GradScaler("cpu", growth_interval=10 ** 6)
    model, opt, history = _train(hvd_acp.DistributedOptimizer, optimizer, scaler, steps=12,
                                 overflow_at=6)
    assert scaler.get_scale() == 2.0 ** 15
    before, after = history[6]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    # synchronize() put the true weights back: what the step before left.
    assert all(torch.equal(a, b) for a, b in zip(history[5][1], before))
    assert opt.reducer.nonfinite_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(history[-1][1][0], history[7][0][0])


def test_the_unit_survives_a_checkpoint():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=10 ** 6)
    _, opt, _ = _train(hvd_acp.DistributedOptimizer, "sgd", scaler, steps=3)
    saved = opt.state_dict()
    model = _net()
    other = _wrap(hvd_acp.DistributedOptimizer, model, "sgd")
    other.load_state_dict(saved)
    assert other.reducer.state.rescaling.unit == 2.0 ** -10


# ------------------------------------------------------ the measure itself
def _written(shape=(6, 5), seed=0):
    """A parameter whose gradient was written, and its factor's norm source."""
    g = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(torch.zeros(shape))
    param.grad = torch.randn(shape, generator=g)
    return param, param.grad.clone()


def _record(**written):
    rescaling = GradientRescaling()
    rescaling.enabled = True
    rescaling.clear()
    for name, (param, factor) in written.items():
        rescaling.wrote(name, param.grad, factor)
    return rescaling, {name: param for name, (param, _) in written.items()}


def test_nothing_changed_reads_one():
    rescaling, params = _record(a=_written(seed=0), b=_written(seed=1))
    assert rescaling.measure(params) == 1.0


def test_grad_scaler_unscale_is_seen_though_it_bumps_no_version():
    param = torch.nn.Parameter(torch.randn(6, 5))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    scaler.scale(param.pow(2).sum()).backward()
    rescaling, params = _record(w=(param, param.grad.clone()))
    version = param.grad._version
    scaler.unscale_(opt)
    assert param.grad._version == version          # what the probes are for
    assert rescaling.measure(params) == 2.0 ** -12


def test_clipping_is_measured_from_the_norms():
    a, b = _written(seed=0), _written(seed=1)
    rescaling, params = _record(a=a, b=b)
    total = torch.cat([a[0].grad.reshape(-1), b[0].grad.reshape(-1)]).norm()
    torch.nn.utils.clip_grad_norm_(params.values(), float(total) / 4)
    assert rescaling.measure(params) == pytest.approx(0.25, rel=1e-6)


def test_a_change_the_probes_miss_is_measured_from_the_norms():
    # Only the third gradient is changed, in place: its version says so.
    first, second, third = (_written(seed=s) for s in range(3))
    rescaling, params = _record(a=first, b=second, c=third)
    third[0].grad.mul_(3.0)
    norms = [w[1].pow(2).sum() for w in (first, second, third)]
    expected = float(((norms[0] + norms[1] + 9 * norms[2]) / sum(norms)).sqrt())
    assert rescaling.measure(params) == pytest.approx(expected, rel=1e-6)


def test_a_replaced_gradient_is_read_at_the_probe():
    param, factor = _written()
    rescaling, params = _record(w=(param, factor))
    param.grad = param.grad / 8          # a new tensor: no version to compare
    assert rescaling.measure(params) == 0.125


def test_nothing_written_keeps_the_last_unit():
    rescaling = GradientRescaling()
    rescaling.enabled = True
    rescaling.unit = 0.5
    rescaling.clear()
    assert rescaling.measure({}) == 0.5


def test_off_records_nothing():
    rescaling = GradientRescaling()
    param, factor = _written()
    rescaling.wrote("w", param.grad, factor)
    param.grad.div_(4)
    assert rescaling.measure({"w": param}) == 1.0


# ------------------------------------------------------------- every front end
def _ok(output: str, case: str) -> list:
    return sorted(int(r) for r in re.findall(rf"OK {case} (\d+)", output))


@pytest.mark.horovod
@pytest.mark.parametrize("np", [2, 4])
@pytest.mark.parametrize("case", ["constant", "dynamic"])
@pytest.mark.parametrize("front_end", ["acp", "acp-int8", "powersgd"])
def test_horovod_front_ends_under_a_grad_scaler(front_end, case, np):
    result = horovodrun("amp_cases.py", front_end, case, np=np, timeout=300)
    assert _ok(result.stdout, case) == list(range(np)), result.stdout[-3000:]


@pytest.mark.ddp
@pytest.mark.parametrize("np", [2, 4])
@pytest.mark.parametrize("case", ["constant", "dynamic"])
@pytest.mark.parametrize("front_end", ["ddp", "ddp-int8"])
def test_the_ddp_hook_under_a_grad_scaler(front_end, case, np):
    output = torchrun("amp_cases.py", front_end, case, np=np, timeout=300)
    assert _ok(output, case) == list(range(np)), output[-3000:]


@pytest.mark.horovod
@pytest.mark.parametrize("baseline", ["diloco", "demo", "tsr"])
def test_an_overflow_on_one_rank_is_skipped_by_every_rank_of_a_baseline(baseline):
    # Before the agreement the rank that did not overflow waited in step()'s
    # collective for ever; the timeout makes a hang a failure.
    result = horovodrun("amp_cases.py", baseline, "overflow", np=2, timeout=120)
    assert _ok(result.stdout, "overflow") == [0, 1], result.stdout[-3000:]
