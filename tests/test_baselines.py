"""DiLoCo and the DeMo-style method (hvd_acp.baselines): their maths in one
process, against hand computations; their optimizers on a world of one; the
planner's bytes against the optimizers' counts; and both under horovodrun at
2 and 4 ranks (tests/workers/baseline_cases.py): bit-identical replicas that
match a one-process simulation of every rank, and settings or weights that
differ between ranks raising on every rank."""
import copy
import json
import math

import pytest
import torch
from torch import nn

import hvd_acp
from hvd_acp import methods
from hvd_acp.baselines import DeMoSettings, DiLoCoSettings, maths
from hvd_acp.methods import Counters
from hvd_acp.plan.baselines import demo_cost, diloco_cost, index_bytes
from hvd_acp.plan.cost import Network, allreduce_s, ring_allgather_s
from tests.hvdrun import horovodrun, rank_lines


# ------------------------------------------------------------ DiLoCo's maths
def test_outer_step_is_nesterov_sgd_on_the_mean_delta_by_hand():
    weights = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    deltas = [torch.tensor([0.2, -0.4, 0.0], dtype=torch.float64),
              torch.tensor([-0.1, 0.3, 0.5], dtype=torch.float64)]
    lr, mu = 0.7, 0.9
    buffer = None
    w = weights.clone()
    for delta in deltas:
        buffer = maths.outer_step_(w, delta, buffer, lr=lr, momentum=mu, nesterov=True)
    # By hand: b1 = d1, w1 = w0 - lr (d1 + mu b1); b2 = mu b1 + d2, w2 = w1 - lr (d2 + mu b2).
    d1, d2 = deltas
    w1 = weights - lr * (d1 + mu * d1)
    b2 = mu * d1 + d2
    torch.testing.assert_close(w, w1 - lr * (d2 + mu * b2), rtol=0, atol=1e-15)
    torch.testing.assert_close(buffer, b2, rtol=0, atol=1e-15)
    # The same bits as torch's SGD with Nesterov momentum.
    param = nn.Parameter(weights.clone())
    sgd = torch.optim.SGD([param], lr=lr, momentum=mu, nesterov=True)
    for delta in deltas:
        param.grad = delta.clone()
        sgd.step()
    assert torch.equal(param.detach(), w)


def test_outer_step_without_momentum_at_lr_1_averages_the_replicas():
    start = torch.tensor([1.0, 2.0], dtype=torch.float64)
    replicas = [torch.tensor([0.0, 4.0], dtype=torch.float64),
                torch.tensor([3.0, 1.0], dtype=torch.float64)]
    delta = sum(start - r for r in replicas) / 2
    w = start.clone()
    assert maths.outer_step_(w, delta, None, lr=1.0, momentum=0.0, nesterov=False) is None
    torch.testing.assert_close(w, sum(replicas) / 2)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(step):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=gen), torch.randn(8, 3, generator=gen)


def _loss(model, step):
    x, y = _batch(step)
    return (model(x) - y).square().mean()


def _train(optimizer, model, steps, first=0):
    for step in range(first, first + steps):
        optimizer.zero_grad()
        _loss(model, step).backward()
        optimizer.step()


def test_diloco_on_one_rank_is_the_outer_step_of_its_inner_steps():
    model = _model()
    start = copy.deepcopy(model)
    opt = hvd_acp.DiLoCoOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                  model.named_parameters(), inner_steps=3,
                                  communicator=hvd_acp.LocalCommunicator())
    # Its inner steps are those of AdamW alone.
    alone = copy.deepcopy(model)
    inner = torch.optim.AdamW(alone.parameters(), lr=0.01)
    _train(opt, model, 2)
    _train(inner, alone, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), alone.parameters()))
    assert opt.pending_inner_steps == 2 and opt.comm_stats.allreduces == 0
    with opt.global_weights():
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), start.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), alone.parameters()))
    _train(opt, model, 1, first=2)
    _train(inner, alone, 1, first=2)
    # The third step ends on the outer step: first momentum buffer = delta.
    for mine, s, local in zip(model.parameters(), start.parameters(), alone.parameters()):
        delta = s - local
        torch.testing.assert_close(mine, s - 0.7 * (delta + 0.9 * delta))
    assert opt.pending_inner_steps == 0 and opt.outer_step_count == 1
    params = list(model.parameters())
    assert opt.comm_stats.allreduces == len(params)
    assert opt.comm_stats.bytes_sent == sum(p.numel() * p.element_size() for p in params)
    assert opt.expected_bytes_per_step() == opt.comm_stats.bytes_sent / 3


def _resumed_matches(make, steps_before=4, steps_after=3):
    """Train, save, train on; a fresh optimizer loaded from the save trains
    to the same bits."""
    model = _model()
    opt = make(model)
    _train(opt, model, steps_before)
    saved = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(model.state_dict())
    _train(opt, model, steps_after, first=steps_before)
    other = _model()
    other.load_state_dict(weights)
    resumed = make(other)
    resumed.load_state_dict(saved)
    _train(resumed, other, steps_after, first=steps_before)
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


@pytest.mark.parametrize("key, settings", [("diloco", {"inner_steps": 3}),
                                           ("demo", {"top_k": 2, "chunk_size": 16}),
                                           ("tsr", {"core_rank": 2, "refresh_period": 3})])
def test_a_checkpoint_resumes_bit_for_bit(key, settings):
    def make(model):
        return methods.get(key).build(model, torch.optim.AdamW(model.parameters(), lr=0.01),
                                      communicator=hvd_acp.LocalCommunicator(),
                                      **settings).optimizer
    assert _resumed_matches(make)
    # The comparison can fail: without the method's section the resume differs.
    def forgetful(model):
        opt = make(model)
        opt.load_state_dict = lambda sd, load=opt.load_state_dict: load(
            {k: v for k, v in sd.items() if not k.startswith("hvd_acp.")})
        return opt
    assert not _resumed_matches(forgetful)


# -------------------------------------------------------------- DeMo's maths
def test_dct_matrix_is_orthonormal_and_is_scipys_dct_ii():
    fft = pytest.importorskip("scipy.fft")
    dct = maths.dct_matrix(64, torch.float64)
    torch.testing.assert_close(dct @ dct.t(), torch.eye(64, dtype=torch.float64))
    x = torch.randn(5, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = torch.from_numpy(fft.dct(x.numpy(), type=2, norm="ortho", axis=1))
    torch.testing.assert_close(x @ dct.t(), expected)
    # The round trip: chunks of a tensor whose size is no multiple of the chunk.
    tensor = torch.randn(7, 9, dtype=torch.float64)
    rows = maths.chunked(tensor, 16)
    assert rows.shape == (4, 16) and rows.reshape(-1)[63:].tolist() == [0.0]
    small = maths.dct_matrix(16, torch.float64)
    back = (rows @ small.t()) @ small
    torch.testing.assert_close(back.reshape(-1)[:63].view(7, 9), tensor)


def test_select_takes_the_largest_magnitudes_of_each_chunk():
    momentum = torch.tensor([[0.1, -3.0, 2.0, 0.5], [4.0, 0.0, -0.2, -5.0]])
    positions, values = maths.select_(momentum.clone(), 2)
    assert [sorted(row) for row in positions.tolist()] == [[1, 2], [0, 3]]
    assert sorted(map(sorted, values.tolist())) == [[-5.0, 4.0], [-3.0, 2.0]]
    with pytest.raises(RuntimeError):
        maths.select_(momentum.clone(), 5)


def test_error_feedback_what_is_sent_plus_the_new_momentum_is_the_old_plus_the_gradient():
    gen = torch.Generator().manual_seed(3)
    dct = maths.dct_matrix(32, torch.float64)
    momentum = torch.randn(6, 32, dtype=torch.float64, generator=gen)      # frequency domain
    grad = torch.randn(5, 37, dtype=torch.float64, generator=gen)         # 185 of 192
    old_time = momentum @ dct                                              # time domain
    beta = 0.999
    maths.accumulate_(momentum, grad, beta, dct)
    accumulated = momentum.clone()
    positions, values = maths.select_(momentum, 4)
    sent = maths.scatter_selected_(torch.zeros_like(momentum), positions, values)
    # Exact where the momentum is held: the sent coefficients leave it.
    assert torch.equal(sent + momentum, accumulated)
    assert int((sent != 0).sum(dim=1).max()) <= 4 and torch.all(momentum.gather(1, positions) == 0)
    # In the time domain: sent + new momentum = beta * old momentum + gradient.
    expected = beta * old_time + maths.chunked(grad, 32)
    torch.testing.assert_close(sent @ dct + momentum @ dct, expected)
    # It could fail: without the error feedback the identity breaks.
    assert not torch.allclose(sent @ dct + accumulated @ dct, expected)


def test_decode_averages_the_ranks_coefficients_in_the_time_domain():
    dct = maths.dct_matrix(8, torch.float64)
    ranks = [(torch.tensor([[0, 3]]), torch.tensor([[1.0, 2.0]], dtype=torch.float64)),
             (torch.tensor([[3, 5]]), torch.tensor([[4.0, -6.0]], dtype=torch.float64))]
    dense = torch.tensor([[1.0, 0, 0, 6.0, 0, -6.0, 0, 0]], dtype=torch.float64) / 2
    torch.testing.assert_close(maths.decode(ranks, 1, dct), dense @ dct)


def test_sign_step_decays_then_steps_by_the_sign():
    weights = torch.tensor([[1.0, -1.0], [0.5, 2.0]])
    update = torch.tensor([[3.0, -0.1, 0.0, 0.2, 9.0]])       # a padded chunk
    maths.sign_step_(weights, update, lr=0.1, weight_decay=0.5)
    expected = torch.tensor([[1.0, -1.0], [0.5, 2.0]]) * 0.95 - 0.1 * torch.tensor(
        [[1.0, -1.0], [0.0, 1.0]])
    torch.testing.assert_close(weights, expected)


def test_pack_unpack_round_trip_with_any_alignment():
    parts = [torch.arange(3, dtype=torch.uint8), torch.randn(2, 5), torch.arange(4).to(torch.int16),
             torch.randn(3, dtype=torch.float64)]
    packed = maths.pack(parts)
    assert packed.dtype == torch.uint8 and packed.numel() == 3 + 40 + 8 + 24
    back = maths.unpack(packed, [(tuple(p.shape), p.dtype) for p in parts])
    assert all(torch.equal(a, b) for a, b in zip(parts, back))
    with pytest.raises(ValueError, match="does not hold the layout"):
        maths.unpack(packed[:-1], [(tuple(p.shape), p.dtype) for p in parts])
    assert maths.index_dtype(64) == torch.uint8 and maths.index_dtype(257) == torch.int16
    assert [index_bytes(c) for c in (64, 256, 257, 2 ** 15, 2 ** 15 + 1)] == [1, 1, 2, 2, 4]


def test_demo_on_one_rank_steps_matrices_by_the_sign_and_vectors_by_the_optimizer():
    model = _model()
    before = copy.deepcopy(model)
    inner = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    opt = hvd_acp.DeMoOptimizer(inner, model.named_parameters(), top_k=3, chunk_size=16,
                                communicator=hvd_acp.LocalCommunicator())
    _loss(model, 0).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    reference = torch.optim.AdamW([p for p in before.parameters() if p.dim() == 1], lr=0.02,
                                  weight_decay=0.1)
    for (name, p), (_, q) in zip(model.named_parameters(), before.named_parameters()):
        if p.dim() == 1:
            q.grad = grads[name]
            continue
        dct = maths.dct_matrix(16)
        momentum = torch.zeros(maths.num_chunks(p.numel(), 16), 16)
        maths.accumulate_(momentum, grads[name], 0.999, dct)
        update = maths.decode([maths.select_(momentum, 3)], momentum.shape[0], dct)
        expected = q.detach() * (1 - 0.02 * 0.1) - 0.02 * update.reshape(-1)[:p.numel()].sign(
            ).view_as(q)
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=0)
        assert torch.equal(p.grad, grads[name])            # its gradient is left as it was
    reference.step()
    for p, q in zip(model.parameters(), before.parameters()):
        if p.dim() == 1:
            assert torch.equal(p, q)
    assert not any(p in inner.state for p in model.parameters() if p.dim() >= 2)
    sent = opt.bytes_per_step()
    assert opt.comm_stats.bytes_sent == sent["sent"]
    # One rank receives no other rank's coefficients, only its averaged vectors.
    assert opt.comm_stats.bytes_received == sent["received"] == 4 * (16 + 3)
    assert opt.comm_stats.allgathers == 1 and opt.comm_stats.allreduces == 1


# ------------------------------------------------------- settings, registry
@pytest.mark.parametrize("settings, match", [
    (DiLoCoSettings(inner_steps=0), "inner_steps must be an int >= 1, got 0"),
    (DiLoCoSettings(inner_steps=2.5), "inner_steps must be an int >= 1, got 2.5"),
    (DiLoCoSettings(outer_lr=-1), "outer_lr must be a number > 0, got -1"),
    (DiLoCoSettings(outer_momentum=1.0), r"outer_momentum must be a number in \[0, 1\)"),
    (DiLoCoSettings(outer_momentum=0.0), "nesterov=True needs outer_momentum > 0"),
    (DeMoSettings(top_k=0), r"top_k must be an int in \[1, chunk_size=64\], got 0"),
    (DeMoSettings(top_k=17, chunk_size=16), r"top_k must be an int in \[1, chunk_size=16\]"),
    (DeMoSettings(chunk_size=0), "chunk_size must be an int >= 1, got 0"),
    (DeMoSettings(momentum_decay=1.0), r"momentum_decay must be a number in \[0, 1\)"),
])
def test_bad_settings_are_named(settings, match):
    with pytest.raises(ValueError, match=match):
        settings.resolve()


def test_defaults_are_the_papers():
    assert DiLoCoSettings().resolve() == DiLoCoSettings(500, 0.7, 0.9, True)
    assert DeMoSettings().resolve() == DeMoSettings(8, 64, 0.999)
    with pytest.raises(TypeError, match="nesterov must be a bool"):
        DiLoCoSettings(nesterov=1).resolve()


@pytest.mark.parametrize("key", ["diloco", "demo"])
def test_the_registry_builds_and_counts_them(key):
    method = methods.get(key)
    assert method.algorithm in ("DiLoCo", "DeMo") and method.not_predicted
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with pytest.raises(ValueError, match="no warmup_steps"):
        method.build(model, inner, warmup_steps=2, communicator=hvd_acp.LocalCommunicator())
    with pytest.raises(TypeError, match="unexpected keyword"):
        method.build(model, inner, no_such_setting=1, communicator=hvd_acp.LocalCommunicator())
    settings = {"diloco": {"inner_steps": 2}, "demo": {"top_k": 2}}[key]
    assert set(settings) <= set(method.settings)
    built = method.build(model, inner, matrix_rank=4, communicator=hvd_acp.LocalCommunicator(),
                         **settings)
    _train(built.optimizer, built.model, 4)
    counters = built.counters()
    assert isinstance(counters, Counters) and counters.bytes_received is not None
    assert counters.bytes_sent == 4 * built.optimizer.expected_bytes_per_step() > 0
    assert counters.compression_seconds > 0


# ------------------------------------------------------------------ planner
def _profile_params(model):
    return [{"name": n, "shape": list(p.shape), "numel": p.numel(),
             "bytes": p.numel() * p.element_size()} for n, p in model.named_parameters()]


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_planners_bytes_are_the_optimizers(ranks):
    model = nn.Sequential(nn.Embedding(100, 24), nn.Linear(24, 50), nn.LayerNorm(50))
    net = Network(bandwidth_mbit=100.0, latency_s=1e-4)

    class World(hvd_acp.LocalCommunicator):
        def size(self):
            return ranks
    opt = hvd_acp.DeMoOptimizer(torch.optim.AdamW(model.parameters()), model.named_parameters(),
                                top_k=5, chunk_size=32, communicator=World())
    cost = demo_cost(_profile_params(model), ranks, net, top_k=5, chunk_size=32)
    assert (cost.bytes_sent, cost.bytes_received) == (opt.bytes_per_step()["sent"],
                                                      opt.bytes_per_step()["received"])
    gathered = sum(math.ceil(p.numel() / 32) * 5 * 5 for p in model.parameters() if p.dim() == 2)
    exact = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 1)
    assert cost.bytes_received == (ranks - 1) * gathered + exact
    assert cost.comm_s == pytest.approx(ring_allgather_s(gathered, ranks, net)
                                        + allreduce_s(exact, ranks, net))
    total = sum(p.numel() * 4 for p in model.parameters())
    diloco = diloco_cost(_profile_params(model), ranks, net, inner_steps=20)
    assert diloco.bytes_sent == diloco.bytes_received == total / 20
    assert diloco.comm_s == pytest.approx(allreduce_s(total, ranks, net) / 20)


def test_ring_allgather_moves_n_minus_1_parts_each_way():
    net = Network(bandwidth_mbit=8.0, latency_s=0.01, wire_efficiency=1.0)
    assert ring_allgather_s(1e6, 1, net) == 0.0
    assert ring_allgather_s(1e6, 4, net) == pytest.approx(3 * 0.01 + 3 * 1e6 / 1e6)


# ------------------------------------------------------- 2 and 4 ranks, real
@pytest.mark.parametrize("np", [2, 4])
def test_replicas_are_identical_and_match_the_one_process_simulation(np):
    out = horovodrun("baseline_cases.py", "replicas", np=np, timeout=300).stdout
    assert sorted(rank_lines(out, "OK replicas")) == [str(r) for r in range(np)], out[-4000:]
    results = {r["key"]: r for r in map(json.loads, rank_lines(out, "RESULT"))}
    diloco, demo = results["diloco"], results["demo"]
    assert diloco["bytes_sent"] == diloco["outer_steps"] * diloco["param_bytes"]
    # An all-gather receives every other rank's part: N - 1 times what it sends.
    exact = demo["sent_per_step"] - results["demo-matrices"]["sent_per_step"]
    gathered = results["demo-matrices"]["sent_per_step"]
    assert demo["received_per_step"] == (np - 1) * gathered + exact
    assert demo["sent_per_step"] < demo["param_bytes"] / 2


def test_settings_or_weights_that_differ_between_ranks_raise_on_every_rank():
    np = 4
    out = horovodrun("baseline_cases.py", "mismatch", np=np, timeout=300).stdout
    assert sorted(rank_lines(out, "OK mismatch")) == [str(r) for r in range(np)], out[-4000:]
    caught = rank_lines(out, "CAUGHT")
    for case in ("inner_steps", "top_k", "chunk_size", "bad_setting", "start_diloco",
                 "start_demo"):
        lines = [line for line in caught if line.startswith(case + " ")]
        assert sorted(line.split()[1] for line in lines) == [f"rank={r}" for r in range(np)], case
    assert any("inner_steps=10 on rank 0 but 11 on rank 1" in line for line in caught)
    assert any("on rank 3: inner_steps must be an int >= 1, got 0" in line for line in caught)
    assert any("hvd.broadcast_parameters" in line for line in caught)
