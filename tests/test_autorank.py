"""matrix_rank="auto": the maths of hvd_acp.autorank and the CompressionState
and optimizer around it, in one process (multi-rank agreement and
checkpoints under horovodrun and torchrun are in tests/test_autorank_ranks.py)."""
import pytest
import torch
from torch import nn

import hvd_acp
from hvd_acp.autorank import (AutoRank, choose_rank, energy_curve, parse_matrix_rank,
                              spectral_factors)
from hvd_acp.compression import Phase
from hvd_acp.state import CompressionState


def low_rank(n, m, rank, noise=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, -1, rank)
    matrix = (torch.randn(n, rank, generator=g) * scales) @ torch.randn(rank, m, generator=g)
    return matrix + noise * torch.randn(n, m, generator=g)


# ----------------------------------------------------------------- maths
@pytest.mark.parametrize("shape", [(300, 80), (80, 300), (24, 9)])
def test_energy_curve_matches_the_exact_singular_values(shape):
    matrix = low_rank(*shape, rank=6, noise=0.05)
    exact = torch.linalg.svdvals(matrix.double()).pow(2)
    exact = exact.cumsum(0) / exact.sum()
    curve = energy_curve(matrix, 8, seed=3)
    assert curve.shape == (8,)
    assert torch.all(curve[1:] >= curve[:-1])
    assert torch.allclose(curve, exact[:8], atol=2e-3), (curve, exact[:8])
    assert torch.equal(curve, energy_curve(matrix, 8, seed=3))      # same seed, same bits


def test_energy_curve_of_degenerate_matrices():
    assert torch.equal(energy_curve(torch.zeros(10, 20), 4), torch.ones(4, dtype=torch.float64))
    assert energy_curve(torch.randn(3, 50), 8).shape == (3,)           # capped at min(n, m)
    assert float(energy_curve(torch.randn(3, 50), 8)[-1]) == pytest.approx(1.0)


def test_choose_rank_is_the_smallest_reaching_the_share():
    curve = torch.tensor([0.5, 0.7, 0.85, 0.95, 1.0], dtype=torch.float64)
    assert choose_rank(curve, 0.8, 1, 32) == 3
    assert choose_rank(curve, 0.5, 1, 32) == 1
    assert choose_rank(curve, 0.5, 2, 32) == 2            # min_rank
    assert choose_rank(curve, 0.99, 1, 4) == 4            # max_rank
    assert choose_rank(curve[:2], 0.99, 1, 32) == 2       # not reached: all there is


def test_spectral_factors_give_the_best_approximation():
    matrix = low_rank(120, 60, rank=10, noise=0.01)
    p, q = spectral_factors(matrix, 4, seed=1)
    assert p.shape == (120, 4) and q.shape == (60, 4)
    assert torch.allclose(q.t() @ q, torch.eye(4), atol=1e-5)
    u, s, vh = torch.linalg.svd(matrix.double())
    best = (u[:, :4] * s[:4]) @ vh[:4]
    assert torch.allclose((p @ q.t()).double(), best, atol=1e-3 * float(s[0]))


def test_the_probe_schedule_doubles_up_to_the_maximum():
    auto = AutoRank(first_interval=25, max_interval=400)
    probes = [s for s in range(3000) if auto.is_probe(s)]
    assert probes[:9] == [25, 75, 175, 375, 775, 1175, 1575, 1975, 2375]
    assert not auto.is_probe(-1) and not auto.is_probe(0)
    assert auto.last_probe(100) == 75 and auto.last_probe(75) == 75 and auto.last_probe(3) == -1


@pytest.mark.parametrize("kwargs, match", [
    ({"energy": 0.0}, "energy must be a number in"),
    ({"energy": 1.5}, "energy must be a number in"),
    ({"max_rank": 0}, "max_rank must be a positive int"),
    ({"min_rank": 8, "max_rank": 4}, "min_rank .8. exceeds max_rank .4."),
    ({"first_interval": 10, "max_interval": 5}, "max_interval .5. is below"),
])
def test_bad_auto_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoRank(**kwargs)


def test_parse_matrix_rank():
    assert parse_matrix_rank(4) == (4, None)
    assert parse_matrix_rank("auto") == (32, AutoRank())
    assert parse_matrix_rank(AutoRank(max_rank=8)) == (8, AutoRank(max_rank=8))
    for bad in (0, "4", 2.0, True, None):
        with pytest.raises(ValueError, match="matrix_rank must be a positive int"):
            parse_matrix_rank(bad)


# ------------------------------------------------------------------ state
def auto_state(**auto):
    state = CompressionState(matrix_rank=AutoRank(first_interval=2, max_interval=4, **auto),
                             min_compression_rate=2.0, warmup_steps=1, seed=0)
    state.add("w", (64, 48), torch.float32, torch.device("cpu"))
    state.add("b", (64,), torch.float32, torch.device("cpu"))
    state.add("tiny", (3, 2), torch.float32, torch.device("cpu"))
    return state


def test_phases_under_auto_rank_restart_after_each_probe():
    state = auto_state()
    phases = []
    for step in range(12):
        state.step_count = step
        phases.append(("probe" if state.probing else "") + state.phase.value)
    # warm-up 1, probes at warm-up + 2, 6, 10
    assert phases == ["dense", "P", "Q", "probedense", "P", "Q", "P",
                      "probedense", "P", "Q", "P", "probedense"]
    assert list(state.tensors) == ["w"]                 # 1-D and too small: never compressed


def test_a_probe_pays_the_residual_and_chooses_rank_and_factors():
    state = auto_state(energy=0.9)
    tensor = state.tensors["w"]
    tensor.error.normal_()
    error = tensor.error.clone()
    grad = low_rank(64, 48, rank=3, seed=5)
    out = torch.empty(64 * 48)
    state.probe_payload_("w", grad, out)
    assert torch.equal(out.view(64, 48), grad + error)
    assert not tensor.error.any()
    rank = state.probe_("w", grad)
    exact = torch.linalg.svdvals(grad.double()).pow(2)
    expected = int(((exact.cumsum(0) / exact.sum()) < 0.9).sum()) + 1
    assert rank == expected == state.ranks()["w"] == state.layouts["w"].r
    assert tensor.p.shape == (64, rank) and tensor.q.shape == (48, rank)
    assert state.layouts["w"].payload_numel(Phase.P) == 64 * rank
    assert state.kept_energy["w"] >= 0.9


def test_ranks_stay_within_the_budget():
    state = auto_state(energy=1.0, max_rank=5)
    state.probe_("w", torch.randn(64, 48))
    assert state.ranks() == {"w": 5}
    assert state.compressed_elements() <= AutoRank(max_rank=5).bytes_bound([(64, 48)]) + 64 + 6


def test_a_checkpoint_restores_the_chosen_ranks():
    state = auto_state(energy=0.6)
    state.probe_("w", low_rank(64, 48, rank=2, seed=1))
    state.step_count = 5
    saved = state.state_dict(rank=0, world_size=1)
    assert saved["matrix_rank"] == "auto" and saved["ranks"] == state.ranks()
    fresh = auto_state(energy=0.6)
    assert fresh.ranks() != state.ranks()
    fresh.load_state_dict(saved, rank=0)
    assert fresh.ranks() == state.ranks() and fresh.layouts["w"].r == state.layouts["w"].r
    assert torch.equal(fresh.tensors["w"].p, state.tensors["w"].p)
    assert fresh.phase is state.phase and fresh.step_count == 5
    fixed = CompressionState(matrix_rank=4, min_compression_rate=2.0, warmup_steps=1, seed=0)
    fixed.add("w", (64, 48), torch.float32, torch.device("cpu"))
    fixed.add("b", (64,), torch.float32, torch.device("cpu"))
    fixed.add("tiny", (3, 2), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="different matrix_rank or model"):
        fixed.load_state_dict(saved, rank=0)


def test_a_checkpoint_of_another_shape_is_refused_under_auto():
    state = auto_state()
    saved = state.state_dict(rank=0, world_size=1)
    saved["params"]["w"]["P"] = torch.zeros(64, 40)
    saved["params"]["w"]["Q"] = torch.zeros(48, 40)
    with pytest.raises(ValueError, match=r"rank in \[1, 13\]"):
        auto_state().load_state_dict(saved, rank=0)


# -------------------------------------------------------------- optimizer
def train(matrix_rank, steps=14, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 8))
    opt = hvd_acp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), matrix_rank=matrix_rank,
        communicator=hvd_acp.LocalCommunicator(), **kwargs)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 8, generator=g)
    phases, sent = [], []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g)
        before = opt.comm_stats.bytes_sent
        phases.append(opt.phase)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x @ teacher).backward()
        opt.step()
        sent.append(opt.comm_stats.bytes_sent - before)
    return model, opt, phases, sent


def test_the_optimizer_probes_chooses_and_reports_ranks():
    auto = AutoRank(first_interval=4, max_interval=4, energy=0.7)
    model, opt, phases, sent = train(auto, diagnostics=True)
    assert phases[:7] == [Phase.P, Phase.Q, Phase.P, Phase.Q, Phase.DENSE, Phase.P, Phase.Q]
    ranks = opt.chosen_ranks()
    # The largest ranks that still compress (min_compression_rate 2): 10, 16, 3.
    limits = {"0.weight": 10, "2.weight": 16, "4.weight": 3}
    assert set(ranks) == set(limits)
    assert all(1 <= ranks[name] <= limit for name, limit in limits.items())
    probes = [r for r in opt.reducer.diagnostics if r["phase"] == "probe"]
    assert [p["step"] for p in probes] == [4, 8, 12]
    assert probes[-1]["ranks"] == ranks
    assert all(k >= 0.7 or ranks[name] == limits[name]
               for name, k in probes[-1]["kept_energy"].items())
    # A compressed step sends the chosen ranks' factors, and the probe everything.
    dense = sum(p.numel() * 4 for p in model.parameters())
    assert sent[4] == sent[8] == dense
    p_elements = sum(p.numel() for n, p in model.named_parameters() if n not in ranks) + sum(
        dict(model.named_parameters())[n].shape[0] * r for n, r in ranks.items())
    assert sent[13] == 4 * p_elements


def test_auto_rank_is_deterministic_and_an_int_keeps_todays_behaviour():
    a, opt_a, _, _ = train("auto")
    b, opt_b, _, _ = train("auto")
    assert opt_a.chosen_ranks() == opt_b.chosen_ranks()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    _, fixed, phases, _ = train(4)
    assert fixed.chosen_ranks() == {"0.weight": 4, "2.weight": 4}     # 8 x 64: not at rank 4
    assert phases[:3] == [Phase.P, Phase.Q, Phase.P]


def test_powersgd_takes_auto_rank_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    opt = hvd_acp.PowerSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                    named_parameters=model.named_parameters(),
                                    matrix_rank=AutoRank(first_interval=3, max_interval=3),
                                    communicator=hvd_acp.LocalCommunicator())
    phases = []
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(16, 32)).pow(2).mean().backward()
        phases.append(opt.phase)
        opt.step()
    assert phases == [Phase.P, Phase.P, Phase.P, Phase.DENSE, Phase.P]
    assert set(opt.chosen_ranks()) == {"0.weight", "2.weight"}


def test_the_planner_profile_uses_the_ranks_auto_chooses():
    from hvd_acp.plan.profile import profile_model
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.Tanh(), nn.Linear(96, 10))
    x, y = torch.randn(32, 48), torch.randint(0, 10, (32,))
    loss = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])   # noqa: E731
    auto = profile_model(model, (x, y), loss, matrix_rank="auto", steps=1, repeats=1)
    fixed = profile_model(model, (x, y), loss, matrix_rank=4, steps=1, repeats=1)
    assert auto["matrix_rank"] == "auto" and fixed["matrix_rank"] == 4
    assert fixed["chosen_ranks"] == {"0.weight": 4, "2.weight": 4}
    ranks = {e["name"]: e["r"] for e in auto["params"] if e["compressed"]}
    assert ranks == auto["chosen_ranks"] and set(ranks) == {"0.weight", "2.weight"}
    # Within the largest ranks that still compress: 16 for (96, 48), 4 for (10, 96).
    assert 1 <= ranks["0.weight"] <= 16 and 1 <= ranks["2.weight"] <= 4
    with pytest.raises(ValueError, match="matrix_rank must be a positive int"):
        profile_model(model, (x, y), loss, matrix_rank=0, steps=1, repeats=1)
