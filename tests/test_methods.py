"""The registry of methods (hvd_acp.methods): its entries, its checks, and the
factories of hvd_acp's Horovod optimizers on a world of one."""
import pytest
import torch
from torch import nn

import hvd_acp
from hvd_acp import methods
from hvd_acp.methods import HOROVOD, KEYS, REGISTRY, TORCHRUN, Counters


def test_every_method_is_declared_once_in_report_order():
    assert KEYS == ("ssgd", "powersgd", "powersgd-ddp", "acp", "acp-ddp")
    for key, method in REGISTRY.items():
        assert method.key == key and method.launcher in (HOROVOD, TORCHRUN)
        assert method.title == f"{method.algorithm} ({method.implementation})"
        assert "\n" not in method.label and method.plot_label.replace("\n", " ") == method.label
    assert methods.label("powersgd") == "Power-SGD (hvd_acp)"
    assert REGISTRY["acp-ddp"].title == "ACP-SGD (DDP hvd_acp.ddp.acp_hook)"
    assert [m.key for m in REGISTRY.values() if m.launcher == HOROVOD] == ["ssgd", "powersgd",
                                                                            "acp"]
    with pytest.raises(ValueError, match="method must be one of ssgd, powersgd"):
        methods.get("topk")


def test_the_planner_predicts_registered_methods_in_their_order():
    from hvd_acp.plan import METHODS
    assert METHODS == tuple(k for k in KEYS if k in METHODS)
    assert set(METHODS) == {"ssgd", "powersgd", "powersgd-ddp", "acp"}


def test_build_refuses_settings_a_method_cannot_take():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="warmup_steps >= 2"):
        methods.get("powersgd-ddp").build(model, opt, warmup_steps=1)
    with pytest.raises(ValueError, match="DDP methods only"):
        methods.get("acp").build(model, opt, ddp_options={"init_sync": False})


@pytest.mark.parametrize("key", ["acp", "powersgd"])
def test_hvd_acp_factories_train_and_count(key):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    built = methods.get(key).build(model, opt, matrix_rank=2,
                                   communicator=hvd_acp.LocalCommunicator())
    try:
        assert built.model is model and built.state is None
        assert isinstance(built.optimizer, getattr(hvd_acp, REGISTRY[key].implementation
                                                   .split(".")[-1]))
        batch = torch.randn(8, 32)
        for _ in range(2):
            built.optimizer.zero_grad()
            built.model(batch).square().mean().backward()
            built.optimizer.step()
        counters = built.counters()
        assert isinstance(counters, Counters)
        assert counters.compression_seconds > 0
        assert counters.bytes_sent == built.optimizer.comm_stats.bytes_sent
    finally:
        built.optimizer.close()
