"""``hvd_acp.ddp``: ACP-SGD as a DDP communication hook.

Single-process checks of the state, then the multi-rank cases of
``tests/workers/ddp_cases.py`` under ``torchrun`` (Gloo), Horovod blocked.
"""
from __future__ import annotations

import re
import sys
import textwrap

import pytest
import torch

import hvd_acp.ddp
from hvd_acp.compression import Phase
from tests.hvdrun import run_with_timeout, torchrun

TWO_RANK_CASES = ["replicas", "full_rank", "error_feedback", "no_sync", "unused", "dtypes",
                  "nonfinite", "step_ahead", "step_ahead_closure", "checkpoint", "errors",
                  "fp16_wire", "both_factors"]

NO_HOROVOD = textwrap.dedent("""
    import importlib.abc, sys
    class NoHorovod(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "horovod" or name.startswith("horovod."):
                raise ImportError("horovod is blocked")
    sys.meta_path.insert(0, NoHorovod())
""")


def ok_ranks(output: str, case: str) -> list:
    return sorted(int(r) for r in re.findall(rf"^OK {re.escape(case)} (\d+)$", output, re.M))


# ---------------------------------------------------------------- one process
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 16)
        self.fc2 = torch.nn.Linear(16, 8)


@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_matrix_rank_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match=f"matrix_rank must be a positive int, got {value!r}"):
        hvd_acp.ddp.ACPState(matrix_rank=value)


def test_other_bad_settings():
    with pytest.raises(ValueError, match="min_compression_rate must be a number >= 0"):
        hvd_acp.ddp.ACPState(min_compression_rate=-1)
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0, got -2"):
        hvd_acp.ddp.ACPState(warmup_steps=-2)
    with pytest.raises(TypeError, match="seed must be an int"):
        hvd_acp.ddp.ACPState(seed="0")
    with pytest.raises(TypeError, match="needs an hvd_acp.ddp.ACPState"):
        hvd_acp.ddp.acp_hook(object(), None)
    with pytest.raises(ValueError, match="step_ahead must be a finite number >= 0, got -0.1"):
        hvd_acp.ddp.ACPState(step_ahead=-0.1)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        hvd_acp.ddp.ACPState(optimizer=[])
    net = Net()
    twice = [("w", net.fc1.weight), ("w", net.fc2.weight)]
    with pytest.raises(ValueError, match="'w' appears twice"):
        hvd_acp.ddp.ACPState(named_parameters=twice)


def test_phase_follows_warmup_and_step_count():
    state = hvd_acp.ddp.ACPState(warmup_steps=2)
    phases = []
    for step_count in range(5):
        state.compression.step_count = step_count
        phases.append(state.phase)
    assert phases == [Phase.DENSE, Phase.DENSE, Phase.P, Phase.Q, Phase.P]


def test_named_state_round_trip_and_mismatches():
    net = Net()
    state = hvd_acp.ddp.ACPState(matrix_rank=2, seed=1, named_parameters=net.named_parameters())
    saved = state.state_dict()
    # fc1 (16 x 32) and fc2 (8 x 16) are compressed at rank 2; biases are not.
    assert sorted(saved["params"]) == ["fc1.weight", "fc2.weight"]
    assert saved["params"]["fc1.weight"]["P"].shape == (16, 2)
    assert saved["params"]["fc1.weight"]["Q"].shape == (32, 2)
    assert saved["world_size"] is None and saved["phase"] == "P"
    # The factors come from the seed, not from the global RNG.
    again = hvd_acp.ddp.ACPState(matrix_rank=2, seed=1, named_parameters=Net().named_parameters())
    torch.testing.assert_close(again.state_dict()["params"]["fc1.weight"]["Q"],
                               saved["params"]["fc1.weight"]["Q"], rtol=0, atol=0)

    saved["params"]["fc1.weight"]["error"].fill_(3.0)
    saved["step_count"] = 7
    other = hvd_acp.ddp.ACPState(matrix_rank=2, seed=2, named_parameters=net.named_parameters())
    other.load_state_dict(saved)
    assert other.step_count == 7 and other.phase is Phase.Q
    loaded = other.state_dict()["params"]["fc1.weight"]
    assert torch.equal(loaded["P"], saved["params"]["fc1.weight"]["P"])
    assert bool((loaded["error"] == 3.0).all())
    other.load_state_dict(saved, reset_error_feedback=True)
    assert not other.state_dict()["params"]["fc1.weight"]["error"].any()

    with pytest.raises(ValueError, match="unsupported hvd_acp state format version 99"):
        other.load_state_dict(dict(saved, version=99))
    wider = hvd_acp.ddp.ACPState(matrix_rank=3, min_compression_rate=0,
                                  named_parameters=net.named_parameters())
    with pytest.raises(ValueError, match=r"P has shape \(16, 2\), expected \(16, 3\)"):
        wider.load_state_dict(saved)
    renamed = dict(saved, params={"layer." + k: v for k, v in saved["params"].items()})
    with pytest.raises(ValueError, match="missing.*fc1.weight.*unexpected.*layer.fc1.weight"):
        other.load_state_dict(renamed)


def test_names_from_the_optimizer_given_or_attached():
    net = Net()
    opt = torch.optim.SGD([{"params": [net.fc1.weight, net.fc1.bias]},
                           {"params": [net.fc2.weight, net.fc2.bias]}], lr=0.1, momentum=0.9)
    given = hvd_acp.ddp.ACPState(matrix_rank=2, optimizer=opt)
    assert sorted(given.state_dict()["params"]) == ["group.0.0", "group.1.0"]
    assert given.step_ahead == 0.2 and given.optimizer is opt
    given.close()
    # Frameworks build the comm state before the optimizer: attach it later,
    # with the same names and factors as if it had been given.
    attached = hvd_acp.ddp.ACPState(matrix_rank=2)
    attached.attach_optimizer(opt)
    for name, entry in attached.state_dict()["params"].items():
        torch.testing.assert_close(entry["Q"], given.state_dict()["params"][name]["Q"],
                                   rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="has an optimizer already"):
        attached.attach_optimizer(opt)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        hvd_acp.ddp.ACPState().attach_optimizer(net)

    class Wrapper(torch.optim.Optimizer):       # as Accelerate's AcceleratedOptimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer
    unwrapped = hvd_acp.ddp.ACPState()
    with pytest.raises(TypeError, match="a Wrapper, a wrapper without the step hooks.*"
                                        r"\.optimizer"):
        unwrapped.attach_optimizer(Wrapper(opt))
    assert unwrapped.optimizer is None
    attached.close()


def test_ddp_hook_imports_and_trains_without_horovod(tmp_path):
    """A world of one, Horovod unimportable: ``import hvd_acp`` and the hook
    work, and at full rank the hook hands back the local gradients."""
    script = NO_HOROVOD + textwrap.dedent(f"""
        import torch, torch.distributed as dist
        import hvd_acp
        state = hvd_acp.ddp.ACPState(matrix_rank=8, min_compression_rate=0)
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store",
                                rank=0, world_size=1)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
        ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
        model = torch.nn.parallel.DistributedDataParallel(net)
        model.register_comm_hook(state, hvd_acp.ddp.acp_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state.attach_optimizer(opt)     # after DDP, as frameworks do
        for step in range(4):
            x = torch.randn(5, 8)
            ref.load_state_dict(net.state_dict())
            ref.zero_grad()
            ref(x).square().sum().backward()
            opt.zero_grad()
            model(x).square().sum().backward()
            for p, q in zip(net.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)
            opt.step()
        assert state.step_count == 4 and state.comm_stats.allreduces == 4
        assert not any(m.split(".")[0] == "horovod" for m in sys.modules)
        dist.destroy_process_group()
        print("OK no-horovod")
    """)
    out = run_with_timeout([sys.executable, "-c", script], 90, "world of one")
    assert "OK no-horovod" in out, out[-4000:]


# -------------------------------------------------------------- several ranks
@pytest.fixture(scope="module")
def two_rank_output(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ddp")
    return torchrun("ddp_cases.py", "--dir", str(directory), *TWO_RANK_CASES, np=2,
                    timeout=240)


@pytest.mark.ddp
@pytest.mark.parametrize("case", TWO_RANK_CASES)
def test_two_ranks(two_rank_output, case):
    assert ok_ranks(two_rank_output, case) == [0, 1], two_rank_output[-6000:]


@pytest.mark.ddp
def test_both_factors_at_four_ranks(tmp_path):
    out = torchrun("ddp_cases.py", "--dir", str(tmp_path), "both_factors", np=4, timeout=240)
    assert ok_ranks(out, "both_factors") == [0, 1, 2, 3], out[-6000:]


@pytest.mark.ddp
def test_replicas_bit_identical_at_three_ranks():
    out = torchrun("ddp_cases.py", "replicas", np=3, timeout=240)
    assert ok_ranks(out, "replicas") == [0, 1, 2], out[-6000:]


def test_leave_process_group_ends_torch_distributed_and_is_a_no_op_without_it():
    """hvd_acp.comm.leave_process_group: after it no group is initialized (a
    barrier ran first: a world of one passes it), and where none is it does
    nothing."""
    import torch.distributed as dist

    from hvd_acp.comm import leave_process_group
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    leave_process_group(pause_s=0)                  # nothing to leave: no error
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        work = dist.all_reduce(torch.ones(3), async_op=True)
        work.wait()
        leave_process_group(pause_s=0)
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
