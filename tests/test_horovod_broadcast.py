"""What hvd_acp/horovod_broadcast.py answers in ``hvd.broadcast_optimizer_state``,
held against the Horovod installed: each trick's one-line reason quotes a
line of that function, and that line must still be there (a Horovod upgrade
that changes it fails here, by name, before the resume tests hang or
diverge). The tricks themselves run for real in tests/test_resume.py and
tests/test_horovod_swap.py."""
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


@pytest.mark.parametrize("trick, line", [
    (horovod_broadcast.pass_as_horovod_optimizer,
     "optimizer.__module__ == DistributedOptimizer.__module__"),
    (horovod_broadcast.LocalStep, "super(optimizer.__class__, optimizer).step()"),
    (horovod_broadcast.called_by_broadcast_optimizer_state, "state_dict = optimizer.state_dict()"),
    (horovod_broadcast.BroadcastEntry, "state_dict['state'][pid][name] = v"),
    (horovod_broadcast.add_broadcast_entry, "for pid in group['params']:"),
])
def test_each_trick_answers_a_line_of_broadcast_optimizer_state(trick, line):
    assert line in SOURCE, f"Horovod no longer has {line!r}: revisit {trick.__name__}"
    reason = " ".join(inspect.getdoc(trick).split("\n\n")[0].split())
    assert reason.startswith("Reason: "), reason


def test_the_optimizer_passes_as_horovods_and_keeps_its_class():
    from horovod.torch.optimizer import DistributedOptimizer
    model = torch.nn.Linear(4, 4)
    opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       communicator=hvd_acp.LocalCommunicator())
    assert opt.__module__ == DistributedOptimizer.__module__
    assert type(opt).__module__ == "hvd_acp.optimizer"
    # super(type(opt), opt).step() reaches the local step, not a collective one.
    assert super(type(opt), opt).step.__func__ is horovod_broadcast.LocalStep.step
    opt.close()


def test_outside_the_broadcast_nothing_is_sniffed():
    model = torch.nn.Linear(4, 4)
    opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       communicator=hvd_acp.LocalCommunicator())
    state = opt.state_dict()
    assert "hvd_acp" in state and "hvd_acp" not in state["state"]
    assert all("hvd_acp" not in group["params"] for group in state["param_groups"])
    opt.close()


def test_the_entry_hands_the_assigned_value_over_while_its_owner_lives():
    class Owner:
        def __init__(self):
            self.adopted = []

        def adopt(self, value):
            self.adopted.append(value)

    owner = Owner()
    state = {"state": {}, "param_groups": [{"params": [0, 1]}]}
    horovod_broadcast.add_broadcast_entry(state, {"step_count": 3}, owner.adopt)
    assert state["param_groups"][-1]["params"] == [0, 1, horovod_broadcast.STATE_KEY]
    entry = state["state"][horovod_broadcast.STATE_KEY]
    assert entry == {"state": {"step_count": 3}} and not owner.adopted
    entry["state"] = {"step_count": 7}          # what broadcast_optimizer_state does
    assert owner.adopted == [{"step_count": 7}]
    del owner
    entry["state"] = {"step_count": 9}          # held weakly: nobody left to adopt it
