"""ACP-SGD's settings (hvd_acp/settings.py): one object, its defaults decided
in one place, ``None`` for "the library's default" in every front end."""
import inspect

import pytest
import torch

import hvd_acp
import hvd_acp.ddp
from hvd_acp.compression import Phase
from hvd_acp.methods import Method
from hvd_acp.settings import Settings, optimizer_family

FIELDS = ("matrix_rank", "min_compression_rate", "warmup_steps", "seed", "step_ahead",
          "fp16_wire", "both_factors")


def sgd():
    return torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1, momentum=0.9)


def adamw():
    return torch.optim.AdamW(torch.nn.Linear(4, 4).parameters(), lr=1e-3)


def test_the_defaults_depend_on_the_optimizer_family():
    resolved = Settings().resolve(sgd())
    assert resolved == Settings(matrix_rank=4, min_compression_rate=2.0, warmup_steps=0,
                                seed=0, step_ahead=0.2, fp16_wire=False, both_factors=False,
                                int8_factors=False)
    assert Settings().resolve() == resolved           # no optimizer: the SGD defaults
    adaptive = Settings(matrix_rank=0.3, min_compression_rate=1.0, warmup_steps=0, seed=0,
                        step_ahead=0.2, fp16_wire=True, both_factors=True, int8_factors=False)
    for optimizer in (adamw(), torch.optim.Adam([torch.zeros(2, 2, requires_grad=True)]),
                      torch.optim.RMSprop([torch.zeros(2, 2, requires_grad=True)]),
                      torch.optim.Adagrad([torch.zeros(2, 2, requires_grad=True)])):
        assert Settings().resolve(optimizer) == adaptive, type(optimizer).__name__
    # P and Q in turn: a share 0.5 (the bytes of both factors at 0.25).
    alternating = Settings(both_factors=False).resolve(adamw())
    assert alternating.matrix_rank == 0.5 and alternating.both_factors is False
    assert Settings(both_factors=True).resolve(sgd()).matrix_rank == 4   # an int stays
    # Power-SGD sends both factors its own way: half the share, never both_factors.
    power = Settings().resolve(adamw(), factors_per_step=2)
    assert power.matrix_rank == 0.25 and power.both_factors is False
    assert Settings().resolve(sgd(), factors_per_step=2).matrix_rank == 4
    with pytest.raises(ValueError, match="both_factors is ACP-SGD's"):
        Settings(both_factors=True).resolve(adamw(), factors_per_step=2)
    given = Settings(matrix_rank="auto", step_ahead=0, fp16_wire=False)
    assert given.resolve(adamw()).matrix_rank == "auto" and given.resolve().step_ahead == 0
    assert given.resolve(adamw()).fp16_wire is False
    assert resolved.resolve() is resolved


def test_the_family_of_an_optimizer():
    weight = [torch.zeros(2, 2, requires_grad=True)]

    class Lion(torch.optim.Optimizer):            # betas, no second moment
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-4, "betas": (0.9, 0.99)})

    class Heavy(torch.optim.Optimizer):           # momentum only: SGD-like
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1, "momentum": 0.9})

    assert optimizer_family(None) is None
    assert optimizer_family(torch.optim.SGD(weight, lr=0.1)) == "sgd"
    assert optimizer_family(Heavy(weight)) == "sgd"
    assert optimizer_family(Lion(weight)) == "adaptive"
    assert optimizer_family(torch.optim.NAdam(weight)) == "adaptive"


def test_a_default_chosen_for_an_optimizer_is_logged(caplog):
    with caplog.at_level("INFO", logger="hvd_acp.settings"):
        Settings(matrix_rank=8).resolve(adamw())
    line, = [r.getMessage() for r in caplog.records]
    assert "AdamW is an adaptive optimizer" in line
    assert "matrix_rank=8," in line and "fp16_wire=True (default)" in line


def test_matrix_rank_as_a_share_of_the_smaller_side():
    from hvd_acp.compression import factor_rank
    assert factor_rank(128, 512, 0.5) == 64 and factor_rank(512, 128, 0.5) == 64
    assert factor_rank(7, 9, 0.5) == 4 and factor_rank(1, 100, 0.5) == 1
    assert factor_rank(10, 3, 4) == 3
    assert factor_rank(10, 16, 0.3) == 3 and factor_rank(128, 128, 0.3) == 39


@pytest.mark.parametrize("field, value, kind, match", [
    ("matrix_rank", 0, ValueError, "matrix_rank must be a positive int, got 0"),
    ("min_compression_rate", -1, ValueError, "min_compression_rate must be a number >= 0"),
    ("warmup_steps", 1.5, ValueError, "warmup_steps must be an int >= 0, got 1.5"),
    ("seed", "0", TypeError, "seed must be an int, got '0'"),
    ("step_ahead", -0.1, ValueError, "step_ahead must be a finite number >= 0, got -0.1"),
    ("both_factors", 1, TypeError, "both_factors must be True, False or None, got 1"),
])
def test_a_bad_setting_raises_when_given(field, value, kind, match):
    with pytest.raises(kind, match=match):
        Settings(**{field: value})


def test_the_docstring_states_each_default():
    doc = " ".join(Settings.__doc__.split())
    sgd_defaults = Settings().resolve(sgd()).as_kwargs()
    adaptive = Settings().resolve(adamw()).as_kwargs()
    for field, value in sgd_defaults.items():
        if adaptive[field] == value:
            assert f"``{field}`` (default {value})" in doc, field
        else:
            assert (f"``{field}`` (default {value} for SGD, {adaptive[field]} for adaptive "
                    "optimizers)") in doc, field


def signatures():
    """Every callable a user hands the settings to."""
    yield hvd_acp.DistributedOptimizer
    yield hvd_acp.PowerSGDOptimizer
    yield hvd_acp.ddp.ACPState
    lightning = pytest.importorskip("hvd_acp.integrations.lightning")
    yield lightning.ACPCallback
    yield pytest.importorskip("hvd_acp.integrations.accelerate").register_acp
    yield pytest.importorskip("hvd_acp.integrations.transformers").register_acp


def test_every_front_end_takes_the_settings_object_or_each_setting_by_name():
    for target in signatures():
        parameters = inspect.signature(target).parameters
        assert parameters["settings"].default is None, target
        # Every other setting by name: Settings.of takes and checks them.
        named = [p for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        assert named, target
        for field in FIELDS:
            if field in parameters:
                assert parameters[field].default is None, (target, field)
    # Horovod's own argument says fp16_wire in its optimizers.
    for target in (hvd_acp.DistributedOptimizer, hvd_acp.PowerSGDOptimizer):
        assert inspect.signature(target).parameters["compression"].default is None
    assert inspect.signature(Method.build).parameters["matrix_rank"].default is None


def test_a_name_that_is_not_a_setting_is_refused_naming_it():
    with pytest.raises(TypeError, match="'matrx_rank': not a setting of hvd_acp.Settings"):
        hvd_acp.ddp.ACPState(matrx_rank=4)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="'step_head': not a setting"):
        hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     step_head=0.2, communicator=hvd_acp.LocalCommunicator())


def test_the_horovod_front_ends_take_fp16_wire_by_name_or_as_horovods_compression():
    """fp16_wire is a setting like any other in the Horovod front ends too,
    beside Horovod's own compression=; the two must agree."""
    import horovod.torch as hvd
    for front_end in (hvd_acp.DistributedOptimizer, hvd_acp.PowerSGDOptimizer):
        def build(**kwargs):
            model = torch.nn.Linear(4, 4)
            return front_end(torch.optim.AdamW(model.parameters()),
                             named_parameters=model.named_parameters(),
                             communicator=hvd_acp.LocalCommunicator(), **kwargs)
        assert build(fp16_wire=False).settings.fp16_wire is False
        assert build().settings.fp16_wire is True          # AdamW's default
        assert build(compression=hvd.Compression.none).settings.fp16_wire is False
        both = build(fp16_wire=True, compression=hvd.Compression.fp16)
        assert both.settings.fp16_wire is True
        with pytest.raises(ValueError, match="fp16_wire=True and compression=.* disagree"):
            build(fp16_wire=True, compression=hvd.Compression.none)


def test_settings_given_as_one_object_and_by_name_mix_the_names_winning():
    state = hvd_acp.ddp.ACPState(settings=Settings(matrix_rank=8, step_ahead=0.5),
                                 matrix_rank=2)
    assert state.settings.matrix_rank == 2 and state.settings.step_ahead == 0.5


def test_the_front_ends_resolve_none_to_the_defaults():
    model = torch.nn.Linear(64, 32)
    opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       communicator=hvd_acp.LocalCommunicator())
    assert opt.reducer.layouts["weight"].r == 4 and opt._step_ahead.step_ahead == 0.2
    opt.close()
    state = hvd_acp.ddp.ACPState(named_parameters=model.named_parameters(), step_ahead=None)
    assert state.compression.layouts["weight"].r == 4 and state.step_ahead == 0.2
    assert state.settings == Settings().resolve()       # decided when first used


def test_the_front_ends_resolve_none_by_the_optimizer():
    model = torch.nn.Linear(64, 32)     # weight (32, 64): rank 10 at a share 0.3, 16 at 0.5
    opt = hvd_acp.DistributedOptimizer(torch.optim.AdamW(model.parameters()),
                                       named_parameters=model.named_parameters(),
                                       communicator=hvd_acp.LocalCommunicator())
    assert opt.reducer.layouts["weight"].r == 10 and opt.reducer.phase is Phase.PQ
    opt.close()
    opt = hvd_acp.DistributedOptimizer(torch.optim.AdamW(model.parameters()),
                                       named_parameters=model.named_parameters(),
                                       communicator=hvd_acp.LocalCommunicator(),
                                       both_factors=False)
    assert opt.reducer.layouts["weight"].r == 16 and opt.reducer.phase is Phase.P
    opt.close()
    powersgd = hvd_acp.PowerSGDOptimizer(torch.optim.AdamW(model.parameters()),
                                         named_parameters=model.named_parameters(),
                                         communicator=hvd_acp.LocalCommunicator())
    assert powersgd.reducer.layouts["weight"].r == 8
    powersgd.close()
    state = hvd_acp.ddp.ACPState(named_parameters=model.named_parameters(),
                                 optimizer=torch.optim.AdamW(model.parameters()))
    assert state.compression.layouts["weight"].r == 10 and state.settings.fp16_wire
    assert state.compression.phase is Phase.PQ
    state.close()
