"""``Settings(budget=...)``: a share of S-SGD's bytes turned into settings."""
import copy
import logging

import pytest
import torch

import hvd_acp
from hvd_acp.budget import FP16_SHARE_FLOOR, SHARE_STEP, share_sent
from hvd_acp.comm import LocalCommunicator
from tests.hvdrun import horovodrun, rank_lines, torchrun

#: A transformer block's matrices and vectors (d 128, 4x MLP, vocabulary 1000).
SHAPES = [("wte", (1000, 128), torch.float32), ("attn", (128, 384), torch.float32),
          ("proj", (128, 128), torch.float32), ("fc", (128, 512), torch.float32),
          ("out", (512, 128), torch.float32), ("ln", (128,), torch.float32),
          ("bias", (512,), torch.float32)]


def adamw():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


def fitted(budget):
    return hvd_acp.Settings(budget=budget).resolve(adamw(), shapes=SHAPES)


def test_a_large_budget_gets_the_defaults():
    defaults = hvd_acp.Settings().resolve(adamw())
    settings = fitted(0.9)
    assert settings == defaults and settings.budget is None


@pytest.mark.parametrize("budget", [0.18, 0.15])
def test_a_budget_the_fp16_factors_fit_keeps_them_at_the_largest_share(budget):
    settings = fitted(budget)
    assert not settings.int8_factors and settings.fp16_wire and settings.both_factors
    assert FP16_SHARE_FLOOR <= settings.matrix_rank < 0.3
    assert share_sent(SHAPES, settings) <= budget
    larger = hvd_acp.Settings(matrix_rank=settings.matrix_rank + SHARE_STEP, both_factors=True,
                              fp16_wire=True).resolve(adamw())
    assert share_sent(SHAPES, larger) > budget


@pytest.mark.parametrize("budget", [1 / 13, 1 / 40])
def test_a_small_budget_sends_the_factors_in_8_bits_at_the_largest_share(budget):
    settings = fitted(budget)
    assert settings.int8_factors and settings.fp16_wire and settings.both_factors
    assert share_sent(SHAPES, settings) <= budget
    larger = hvd_acp.Settings(matrix_rank=settings.matrix_rank + SHARE_STEP,
                              int8_factors=True).resolve(adamw())
    assert share_sent(SHAPES, larger) > budget
    # A smaller budget never gets a larger share.
    assert fitted(budget / 2).matrix_rank < settings.matrix_rank


def test_the_choice_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="hvd_acp"):
        settings = fitted(1 / 13)
    assert f"matrix_rank={settings.matrix_rank!r}, int8_factors=True" in caplog.text


def test_bad_budgets_raise_clear_errors():
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        hvd_acp.Settings(budget=0)
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        hvd_acp.Settings(budget=True)
    with pytest.raises(ValueError, match="leave matrix_rank, int8_factors unset"):
        hvd_acp.Settings(budget=0.1, matrix_rank=4, int8_factors=True)
    with pytest.raises(ValueError, match="Adam-family"):
        hvd_acp.Settings(budget=0.1).resolve(torch.optim.SGD([torch.zeros(1)], lr=0.1),
                                             shapes=SHAPES)
    with pytest.raises(ValueError, match="Power-SGD"):
        hvd_acp.Settings(budget=0.1).resolve(adamw(), factors_per_step=2, shapes=SHAPES)
    with pytest.raises(ValueError, match="needs the model's parameters"):
        hvd_acp.Settings(budget=0.1).resolve(adamw())
    with pytest.raises(ValueError, match="below what rank 1 on every matrix sends"):
        fitted(0.001)


def test_the_optimizer_fits_its_parameters_and_a_checkpoint_keeps_the_share():
    """(The bytes a step sends under Horovod, with fp16 on the wire: the
    horovodrun and torchrun tests below.)"""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(300, 64), torch.nn.Linear(64, 256),
                              torch.nn.GELU(), torch.nn.Linear(256, 300))
    x = torch.randint(0, 300, (32,))
    opt = hvd_acp.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2),
                                       named_parameters=net.named_parameters(),
                                       communicator=LocalCommunicator(), budget=1 / 13)
    assert opt.settings.int8_factors and opt.settings.budget is None
    shapes = [(n, p.shape, p.dtype) for n, p in net.named_parameters()]
    assert share_sent(shapes, opt.settings) <= 1 / 13
    for _ in range(4):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), x).backward()
        opt.step()
    state = opt.state_dict()
    other = copy.deepcopy(net)
    again = hvd_acp.DistributedOptimizer(torch.optim.AdamW(other.parameters(), lr=1e-2),
                                         named_parameters=other.named_parameters(),
                                         communicator=LocalCommunicator(), budget=1 / 13)
    again.load_state_dict(state)
    assert again.settings == opt.settings


# ------------------------------------------------------- several processes
@pytest.mark.horovod
@pytest.mark.timeout(300)
@pytest.mark.parametrize("np", [2, 4])
def test_under_horovod_the_budget_holds_and_the_ranks_sums_stay_exact(np):
    result = horovodrun("int8_cases.py", "budget", np=np, timeout=240)
    assert sorted(int(r) for r in rank_lines(result.stdout, "OK budget")) == list(range(np))


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_the_ddp_hook_fits_the_budget_from_its_named_parameters():
    output = torchrun("int8_ddp.py", "budget", np=2, timeout=240)
    assert sorted(int(r) for r in rank_lines(output, "OK ddp-sums")) == [0, 1], output[-3000:]
