"""What hvd_acp/horovod_broadcast.py reads of ``hvd.broadcast_optimizer_state``,
held against the Horovod installed: the lines of that function the wrapper's
``state_dict()`` and ``step()`` answer must still be there (a Horovod upgrade
that changes them fails here, by name, before the resume tests hang or
diverge). The broadcast itself runs for real in tests/test_resume.py and
tests/test_horovod_swap.py; the explicit ``hvd_acp.broadcast_optimizer_state``
in tests/workers/resume_cases.py."""
import inspect

import pytest
import torch

hvd = pytest.importorskip("horovod.torch")

import horovod  # noqa: E402

import hvd_acp  # noqa: E402
from hvd_acp import horovod_broadcast  # noqa: E402

SOURCE = inspect.getsource(hvd.functions.broadcast_optimizer_state)


def test_the_pinned_horovod():
    assert horovod.__version__ == "0.28.1"


@pytest.mark.parametrize("line", [
    # broadcast_call: the function's frame, whose root_rank it reads ...
    "def broadcast_optimizer_state(optimizer, root_rank, model=None):",
    # ... and first_state_dict_of: its state_dict local, assigned by the first call.
    "state_dict = optimizer.state_dict()",
    # initialize_state: the step Horovod takes on zero gradients where the state is empty.
    "if len(state_dict['state']) == 0:",
    "optimizer.step()",
])
def test_what_the_wrapper_reads_is_in_broadcast_optimizer_state(line):
    assert line in SOURCE, f"Horovod no longer has {line!r}: revisit hvd_acp/horovod_broadcast.py"


def test_the_optimizer_keeps_its_class_and_module():
    model = torch.nn.Linear(4, 4)
    opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       communicator=hvd_acp.LocalCommunicator())
    assert opt.__module__ == "hvd_acp.optimizer" and "__module__" not in vars(opt)
    opt.close()


def test_outside_the_broadcast_nothing_is_read_from_the_stack():
    model = torch.nn.Linear(4, 4)
    opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       communicator=hvd_acp.LocalCommunicator())
    assert horovod_broadcast.broadcast_call(1) is None
    state = opt.state_dict()
    assert "hvd_acp" in state and "hvd_acp" not in state["state"]
    assert all("hvd_acp" not in group["params"] for group in state["param_groups"])
    opt.close()


def test_the_state_is_created_without_moving_the_weights():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    weights = [p.detach().clone() for p in model.parameters()]
    model.weight.grad = torch.ones(4, 4)
    horovod_broadcast.initialize_state_(inner)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert set(inner.state) == set(model.parameters())
    assert torch.equal(model.weight.grad, torch.ones(4, 4)) and model.bias.grad is None
    # A parameter that has state is left as it is.
    step = inner.state[model.weight]["step"].clone()
    horovod_broadcast.initialize_state_(inner)
    assert torch.equal(inner.state[model.weight]["step"], step)
