"""ACP-SGD's settings (hvd_acp/settings.py): one object, its defaults decided
in one place, ``None`` for "the library's default" in every front end."""
import inspect

import pytest
import torch

import hvd_acp
import hvd_acp.ddp
from hvd_acp.methods import Method
from hvd_acp.settings import Settings

FIELDS = ("matrix_rank", "min_compression_rate", "warmup_steps", "seed", "step_ahead")


def sgd():
    return torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1, momentum=0.9)


def test_the_defaults_are_todays():
    resolved = Settings().resolve(sgd())
    assert resolved == Settings(matrix_rank=4, min_compression_rate=2.0, warmup_steps=0,
                                seed=0, step_ahead=0.2)
    adam = torch.optim.Adam(torch.nn.Linear(4, 4).parameters())
    assert Settings().resolve(adam) == resolved == Settings().resolve()
    given = Settings(matrix_rank="auto", step_ahead=0)
    assert given.resolve(sgd()).matrix_rank == "auto" and given.resolve().step_ahead == 0
    assert resolved.resolve() is resolved


@pytest.mark.parametrize("field, value, kind, match", [
    ("matrix_rank", 0, ValueError, "matrix_rank must be a positive int, got 0"),
    ("min_compression_rate", -1, ValueError, "min_compression_rate must be a number >= 0"),
    ("warmup_steps", 1.5, ValueError, "warmup_steps must be an int >= 0, got 1.5"),
    ("seed", "0", TypeError, "seed must be an int, got '0'"),
    ("step_ahead", -0.1, ValueError, "step_ahead must be a finite number >= 0, got -0.1"),
])
def test_a_bad_setting_raises_when_given(field, value, kind, match):
    with pytest.raises(kind, match=match):
        Settings(**{field: value})


def test_the_docstring_states_each_default():
    doc = " ".join(Settings.__doc__.split())
    for field, value in Settings().resolve().as_kwargs().items():
        assert f"``{field}`` (default {value})" in doc, field


def signatures():
    """Every callable a user hands the settings to."""
    yield hvd_acp.DistributedOptimizer
    yield hvd_acp.PowerSGDOptimizer
    yield hvd_acp.ddp.ACPState
    lightning = pytest.importorskip("hvd_acp.integrations.lightning")
    yield lightning.ACPCallback
    yield pytest.importorskip("hvd_acp.integrations.accelerate").register_acp
    yield pytest.importorskip("hvd_acp.integrations.transformers").register_acp


def test_every_front_end_takes_none_for_the_default():
    for target in signatures():
        parameters = inspect.signature(target).parameters
        for field in FIELDS:
            assert parameters[field].default is None, (target, field)
    assert inspect.signature(Method.build).parameters["matrix_rank"].default is None


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
