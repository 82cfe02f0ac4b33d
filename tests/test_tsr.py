"""The TSR-style method (hvd_acp.baselines.TSROptimizer): its maths in one
process, against hand computations and torch's AdamW; the optimizer on a
world of one against a step-by-step simulation from the maths; its bytes
against the analytic count and the planner's; its settings; and under
horovodrun at 2 and 4 ranks (tests/workers/tsr_cases.py): bit-identical
replicas that match a one-process simulation of every rank, a checkpoint
resume that equals an uninterrupted run, and bad or differing settings that
raise on every rank."""
import copy
import json

import pytest
import torch
from torch import nn

import hvd_acp
from hvd_acp import methods
from hvd_acp.baselines import TSRSettings, embedding_parameter_names, maths
from hvd_acp.plan.baselines import tsr_cost
from hvd_acp.plan.cost import Network, allreduce_s
from tests.hvdrun import horovodrun, rank_lines


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _orthonormal(rows, cols, seed):
    return torch.linalg.qr(torch.randn(rows, cols, dtype=torch.float64, generator=_gen(seed))).Q


# -------------------------------------------------------------------- maths
def test_the_core_of_a_rank_r_matrix_on_its_own_bases_reconstructs_it():
    n, m, r = 12, 9, 3
    a = torch.randn(n, r, dtype=torch.float64, generator=_gen(1))
    b = torch.randn(m, r, dtype=torch.float64, generator=_gen(2))
    grad = a @ b.t()
    # The bases the sketches give: the sketches of a rank-r matrix span its
    # column and row spaces.
    omega, psi = maths.sketch_draws(n, m, r, maths.sketch_seed(0, 0, 0), torch.float64)
    y, z = maths.sketches(grad, omega, psi)
    assert y.shape == (n, r) and z.shape == (m, r)
    U, V = maths.orthonormal_basis(y), maths.orthonormal_basis(z)
    torch.testing.assert_close(U.t() @ U, torch.eye(r, dtype=torch.float64))
    core = maths.project(grad, U, V)
    assert core.shape == (r, r)
    torch.testing.assert_close(U @ core @ V.t(), grad)
    # It can fail: on other bases the core loses most of the matrix.
    other = maths.project(grad, _orthonormal(n, r, 3), _orthonormal(m, r, 4))
    assert not torch.allclose(_orthonormal(n, r, 3) @ other @ _orthonormal(m, r, 4).t(), grad,
                              atol=1e-3)


def test_rotating_the_moments_with_identical_bases_is_a_no_op():
    U, V = _orthonormal(10, 4, 0), _orthonormal(7, 4, 1)
    M = torch.randn(4, 4, dtype=torch.float64, generator=_gen(2))
    S = torch.rand(4, 4, dtype=torch.float64, generator=_gen(3))
    M2, S2 = maths.rotate_moments(M, S, U, V, U, V)
    torch.testing.assert_close(M2, M, rtol=0, atol=1e-14)
    torch.testing.assert_close(S2, S, rtol=0, atol=1e-14)


def test_rotating_the_moments_keeps_the_first_moment_in_the_same_span():
    """New bases that span the old ones (rotated inside them): ``U M V^T`` is
    unchanged; ``S`` stays non-negative. Other spans change it."""
    U, V = _orthonormal(10, 4, 0), _orthonormal(7, 4, 1)
    Q1, Q2 = _orthonormal(4, 4, 5), _orthonormal(4, 4, 6)
    M = torch.randn(4, 4, dtype=torch.float64, generator=_gen(2))
    S = torch.rand(4, 4, dtype=torch.float64, generator=_gen(3))
    M2, S2 = maths.rotate_moments(M, S, U, V, U @ Q1, V @ Q2)
    torch.testing.assert_close((U @ Q1) @ M2 @ (V @ Q2).t(), U @ M @ V.t())
    assert bool((S2 >= 0).all())
    M3, _ = maths.rotate_moments(M, S, U, V, _orthonormal(10, 4, 7), V)
    assert not torch.allclose(_orthonormal(10, 4, 7) @ M3 @ V.t(), U @ M @ V.t(), atol=1e-3)


def test_core_adam_on_identity_bases_is_adamw():
    """With ``U = I``, ``V = I`` (r = n = m) the core is the gradient, and
    the step is AdamW's on the matrix."""
    weights = torch.randn(5, 5, dtype=torch.float64, generator=_gen(0))
    param = nn.Parameter(weights.clone())
    adamw = torch.optim.AdamW([param], lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    M, S = torch.zeros(5, 5, dtype=torch.float64), torch.zeros(5, 5, dtype=torch.float64)
    eye = torch.eye(5, dtype=torch.float64)
    for step in range(1, 4):
        grad = torch.randn(5, 5, dtype=torch.float64, generator=_gen(step))
        core = maths.project(grad, eye, eye)
        maths.core_adam_(weights, core, eye, eye, M, S, step, lr=0.01, betas=(0.8, 0.99),
                         eps=1e-6, weight_decay=0.1, scale=1.0)
        param.grad = grad
        adamw.step()
    torch.testing.assert_close(weights, param.detach(), rtol=1e-12, atol=1e-12)
    # scale multiplies the update (weight decay apart).
    w2, M0, S0 = torch.ones(5, 5, dtype=torch.float64), torch.zeros(5, 5), torch.zeros(5, 5)
    core = torch.full((5, 5), 2.0, dtype=torch.float64)
    maths.core_adam_(w2, core, eye, eye, M0.double(), S0.double(), 1, lr=0.1, betas=(0.9, 0.999),
                     eps=0.0, weight_decay=0.0, scale=0.5)
    torch.testing.assert_close(w2, torch.full((5, 5), 1 - 0.05, dtype=torch.float64))


def test_the_sketches_draws_are_seeded_by_seed_step_and_tensor():
    one = maths.sketch_draws(6, 4, 2, maths.sketch_seed(0, 10, 3))
    assert one[0].shape == (4, 2) and one[1].shape == (6, 2)
    again = maths.sketch_draws(6, 4, 2, maths.sketch_seed(0, 10, 3))
    assert all(torch.equal(a, b) for a, b in zip(one, again))
    for other in (maths.sketch_seed(0, 11, 3), maths.sketch_seed(0, 10, 4),
                  maths.sketch_seed(1, 10, 3)):
        assert not torch.equal(maths.sketch_draws(6, 4, 2, other)[0], one[0])
    assert maths.sketch_seed(0, 10, 3) == 7919 * 10 + 3
    assert 0 <= maths.sketch_seed(2 ** 62, 10 ** 9, 10 ** 5) < 2 ** 63


def test_what_compresses():
    assert maths.matrix_view((8, 3, 2, 2)) == (8, 12)
    assert maths.core_rank_of(8, 12, 32) == 8 and maths.core_rank_of(80, 120, 32) == 32
    # 4x4 at r 4: 16 + 8 * 4 / 10 >= 16, sent exactly; 64x100 at r 32 gains.
    assert not maths.compresses(4, 4, 4, 10)
    assert maths.elements_per_step(64, 100, 32, 10) == pytest.approx(1024 + 524.8)
    assert maths.compresses(64, 100, 32, 10)


# -------------------------------------------------------- the optimizer, one rank
class Net(nn.Module):
    """An embedding, two matrices that gain, one that does not (2 x 2 at r 2), biases."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(12, 8)
        self.hidden = nn.Linear(8, 20)
        self.out = nn.Linear(20, 12)
        self.pair = nn.Linear(2, 2, bias=False)

    def forward(self, tokens):
        logits = self.out(torch.relu(self.hidden(self.embed(tokens))))
        return torch.cat([self.pair(logits[:, :2]), logits[:, 2:]], dim=1)


def _loss(model, step):
    gen = _gen(step)
    tokens, targets = torch.randint(0, 12, (16,), generator=gen), torch.randint(
        0, 12, (16,), generator=gen)
    return nn.functional.cross_entropy(model(tokens), targets)


SETTINGS = dict(core_rank=2, refresh_period=3, embedding_core_rank=3,
                embedding_refresh_period=2, embedding_names=["embed.weight"])


def _tsr(model, lr=0.01, **settings):
    inner = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.85, 0.99), weight_decay=0.1)
    return hvd_acp.TSROptimizer(inner, model.named_parameters(),
                                communicator=hvd_acp.LocalCommunicator(),
                                **dict(SETTINGS, **settings))


def _simulate(model, steps, fp16_wire=True):
    """The method by hand from the maths: one rank, steps 0 .. steps-1."""
    names = dict(model.named_parameters())
    index = {n: i for i, n in enumerate(names)}
    plan = {"embed.weight": (3, 2), "hidden.weight": (2, 3), "out.weight": (2, 3)}  # (r, K)
    exact = [n for n in names if n not in plan]
    inner = torch.optim.AdamW([names[n] for n in exact], lr=0.01, betas=(0.85, 0.99),
                              weight_decay=0.1)
    wire = torch.float16 if fp16_wire else torch.float32
    bases, moments = {}, {n: (torch.zeros(r, r), torch.zeros(r, r)) for n, (r, _) in plan.items()}
    for step in range(steps):
        model.zero_grad()
        _loss(model, step).backward()
        with torch.no_grad():
            for name, (r, period) in plan.items():
                p = names[name]
                grad = p.grad.reshape(p.shape[0], -1)
                if name in bases:
                    U, V = bases[name]
                    core = maths.project(grad, U, V).to(wire).float()
                    maths.core_adam_(p, core, U, V, *moments[name], step, lr=0.01,
                                     betas=(0.85, 0.99), eps=1e-8, weight_decay=0.1, scale=1.0)
                if step % period == 0:
                    draws = maths.sketch_draws(*grad.shape, r,
                                               maths.sketch_seed(0, step, index[name]))
                    y, z = (s.to(wire).float() for s in maths.sketches(grad, *draws))
                    new = maths.orthonormal_basis(y), maths.orthonormal_basis(z)
                    if name in bases:
                        moments[name] = maths.rotate_moments(*moments[name], *bases[name], *new)
                    bases[name] = new
            for name in exact:
                names[name].grad = names[name].grad.to(wire).float()
            for name in plan:
                names[name].grad = None
        inner.step()
    return bases, moments


@pytest.mark.parametrize("fp16_wire", [True, False])
def test_one_rank_is_the_method_by_hand(fp16_wire):
    model, reference = Net(), Net()
    opt = _tsr(model, fp16_wire=fp16_wire)
    assert [m.name for m in opt.matrices] == ["embed.weight", "hidden.weight", "out.weight"]
    assert [(m.core_rank, m.refresh_period) for m in opt.matrices] == [(3, 2), (2, 3), (2, 3)]
    assert [n for n, _ in opt.exact] == ["hidden.bias", "out.bias", "pair.weight"]
    steps = 7            # refreshes at 0, 2, 4, 6 (embedding) and 0, 3, 6
    for step in range(steps):
        opt.zero_grad()
        _loss(model, step).backward()
        before = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        # The matrices' gradients are left as they were.
        assert torch.equal(model.hidden.weight.grad, before["hidden.weight"])
    bases, moments = _simulate(reference, steps, fp16_wire)
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(mine, theirs), name
    for name, (U, V) in bases.items():
        assert torch.equal(opt._bases[name][0], U) and torch.equal(opt._bases[name][1], V)
        assert all(torch.equal(a, b) for a, b in zip(opt._moments[name], moments[name]))
    assert opt._core_steps == dict.fromkeys(["embed.weight", "hidden.weight", "out.weight"],
                                            steps - 1)
    # The wrapped optimizer holds state for the exact tensors alone.
    assert set(opt.optimizer.state) == {p for _, p in opt.exact}
    # One all-reduce per step, of what step_bytes says.
    assert opt.comm_stats.allreduces == steps and opt.comm_stats.allgathers == 0
    assert opt.comm_stats.bytes_sent == opt.comm_stats.bytes_received == sum(
        opt.step_bytes(t) for t in range(steps))


def test_the_first_step_sends_sketches_only_and_steps_the_exact_tensors_alone():
    model = Net()
    start = copy.deepcopy(model)
    opt = _tsr(model)
    opt.zero_grad()
    _loss(model, 0).backward()
    opt.step()
    assert torch.equal(model.embed.weight, start.embed.weight)
    assert torch.equal(model.hidden.weight, start.hidden.weight)
    assert not torch.equal(model.hidden.bias, start.hidden.bias)
    exact = sum(p.numel() for _, p in opt.exact)
    assert exact == 20 + 12 + 4
    assert opt.comm_stats.bytes_sent == 2 * (exact + (12 + 8) * 3 + (20 + 8) * 2 + (12 + 20) * 2)


def test_bytes_per_step_is_the_analytic_count():
    model = Net()
    opt = _tsr(model)
    exact = 20 + 12 + 4
    # Embedding 12 x 8 at r 3, every 2 steps; 20 x 8 and 12 x 20 at r 2, every 3.
    elements = exact + 9 + (12 + 8) * 3 / 2 + 4 + (20 + 8) * 2 / 3 + 4 + (12 + 20) * 2 / 3
    assert opt.bytes_per_step() == {"sent": pytest.approx(2 * elements),
                                    "received": pytest.approx(2 * elements)}
    assert opt.expected_bytes_per_step() == pytest.approx(2 * elements)
    # Over a long run the steps' bytes average to it (the first step sends no core).
    period = 6
    run = sum(opt.step_bytes(t) for t in range(period, 100 * period + period))
    assert run / (100 * period) == pytest.approx(2 * elements)
    assert opt.step_bytes(1) == 2 * (exact + 9 + 4 + 4)
    wide = _tsr(Net(), fp16_wire=False)
    assert wide.bytes_per_step()["sent"] == pytest.approx(4 * elements)
    assert wide.wire_dtype == torch.float32


def test_the_planners_bytes_are_the_optimizers():
    model = nn.Sequential(nn.Embedding(100, 24), nn.Linear(24, 50), nn.LayerNorm(50),
                          nn.Linear(50, 3))
    opt = hvd_acp.TSROptimizer(torch.optim.AdamW(model.parameters()), model.named_parameters(),
                               core_rank=4, refresh_period=5,
                               communicator=hvd_acp.LocalCommunicator())
    # 100 x 24 and 50 x 24 gain at r 4; 3 x 50 (r 3: 9 + 53 * 3 / 5 = 40.8 < 150) too.
    assert [m.name for m in opt.matrices] == ["0.weight", "1.weight", "3.weight"]
    params = [{"name": n, "shape": list(p.shape), "numel": p.numel(),
               "bytes": p.numel() * p.element_size()} for n, p in model.named_parameters()]
    net = Network(bandwidth_mbit=100.0, latency_s=1e-4)
    cost = tsr_cost(params, 4, net, core_rank=4, refresh_period=5)
    assert cost.bytes_sent == cost.bytes_received == pytest.approx(opt.bytes_per_step()["sent"])
    cores = (16 + 16 + 9 + 50 + 50 + 50 + 3) * 2
    sketches = ((100 + 24) * 4 + (50 + 24) * 4 + (3 + 50) * 3) * 2
    assert cost.comm_s == pytest.approx(
        (4 * allreduce_s(cores, 4, net) + allreduce_s(cores + sketches, 4, net)) / 5)


def test_embedding_names_take_the_embedding_settings():
    model = Net()
    assert embedding_parameter_names(model) == ["embed.weight"]
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    tied[1].weight = tied[0].weight
    assert embedding_parameter_names(tied) == ["0.weight"]
    plain = _tsr(Net(), embedding_names=None)
    assert [(m.core_rank, m.refresh_period) for m in plain.matrices] == [(2, 3)] * 3
    with pytest.raises(ValueError, match=r"embedding_names \['embed\.wieght'\] name no "
                                         "parameter of two or more dimensions"):
        _tsr(Net(), embedding_names=["embed.wieght"])
    with pytest.raises(ValueError, match=r"embedding_names \['hidden\.bias'\]"):
        _tsr(Net(), embedding_names=["hidden.bias"])
    # The registry passes the model's embeddings.
    model = Net()
    built = methods.get("tsr").build(model, torch.optim.AdamW(model.parameters()),
                                     embedding_core_rank=3,
                                     communicator=hvd_acp.LocalCommunicator())
    assert built.optimizer.settings.embedding_names == ("embed.weight",)
    assert built.optimizer.matrices[0].core_rank == 3


def test_an_optimizer_without_betas_gets_adams_defaults_and_the_groups_lr():
    model = Net()
    inner = torch.optim.SGD([{"params": [model.hidden.weight], "lr": 0.0},
                             {"params": [p for n, p in model.named_parameters()
                                         if n != "hidden.weight"], "lr": 0.05}])
    opt = hvd_acp.TSROptimizer(inner, model.named_parameters(), core_rank=2, refresh_period=3,
                               communicator=hvd_acp.LocalCommunicator())
    hidden, embed = model.hidden.weight.detach().clone(), model.embed.weight.detach().clone()
    for step in range(3):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
    assert torch.equal(model.hidden.weight, hidden)            # its group's lr is 0
    assert not torch.equal(model.embed.weight, embed)
    # The first core step of Adam moves each core entry by about lr (scale 1):
    # the weights move by at most lr * r (|U|, |V| entries <= 1).
    assert float((model.embed.weight.detach() - embed).abs().max()) <= 2 * 0.05 * 2


def test_a_state_saved_with_other_core_ranks_does_not_load():
    model = Net()
    opt = _tsr(model)
    opt.zero_grad()
    _loss(model, 0).backward()
    opt.step()
    saved = opt.state_dict()
    other = _tsr(Net(), core_rank=3)
    with pytest.raises(ValueError, match="saved with other matrices or core ranks"):
        other.load_state_dict(saved)
    assert other.step_count == 0 and not other._bases          # all or nothing
    again = _tsr(Net())
    again.load_state_dict(saved)
    assert again.step_count == 1 and set(again._bases) == {"embed.weight", "hidden.weight",
                                                           "out.weight"}


# ----------------------------------------------------------------- settings
@pytest.mark.parametrize("settings, error, match", [
    (TSRSettings(core_rank=0), ValueError, "core_rank must be an int >= 1, got 0"),
    (TSRSettings(core_rank=2.5), ValueError, "core_rank must be an int >= 1, got 2.5"),
    (TSRSettings(embedding_core_rank=-1), ValueError, "embedding_core_rank must be an int >= 1"),
    (TSRSettings(refresh_period=0), ValueError, "refresh_period must be an int >= 1, got 0"),
    (TSRSettings(embedding_refresh_period=True), ValueError,
     "embedding_refresh_period must be an int >= 1, got True"),
    (TSRSettings(scale=0.0), ValueError, "scale must be a number > 0, got 0.0"),
    (TSRSettings(scale=float("nan")), ValueError, "scale must be a number > 0"),
    (TSRSettings(fp16_wire=1), TypeError, "fp16_wire must be a bool, got 1"),
    (TSRSettings(seed=-1), ValueError, r"seed must be an int in \[0, 2\*\*63\), got -1"),
    (TSRSettings(embedding_names="embed.weight"), TypeError,
     "embedding_names must be an iterable of parameter names"),
    (TSRSettings(embedding_names=[1]), TypeError, r"embedding_names must hold parameter names"),
])
def test_bad_settings_are_named(settings, error, match):
    with pytest.raises(error, match=match):
        settings.resolve()


def test_the_defaults():
    done = TSRSettings().resolve()
    assert done == TSRSettings(32, 32, 10, 10, 1.0, True, 0, ())
    assert TSRSettings(core_rank=8, refresh_period=4).resolve() == TSRSettings(
        8, 8, 4, 4, 1.0, True, 0, ())
    assert TSRSettings(embedding_names=iter(["b", "a", "b"])).resolve().embedding_names == (
        "a", "b")
    with pytest.raises(ValueError, match="refresh_period must be an int >= 1, got 0"):
        hvd_acp.TSROptimizer(torch.optim.AdamW(Net().parameters()), refresh_period=0,
                             communicator=hvd_acp.LocalCommunicator())


def test_the_registry_builds_and_counts_it():
    method = methods.get("tsr")
    assert method.algorithm == "TSR" and method.label == "TSR-style" and method.not_predicted
    assert not method.averages_gradients
    model = Net()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="no warmup_steps"):
        method.build(model, inner, warmup_steps=2, communicator=hvd_acp.LocalCommunicator())
    built = method.build(model, inner, matrix_rank=4, core_rank=2, refresh_period=2,
                         communicator=hvd_acp.LocalCommunicator())
    assert built.optimizer.settings.core_rank == 2        # matrix_rank is not TSR's
    for step in range(4):
        built.optimizer.zero_grad()
        _loss(built.model, step).backward()
        built.optimizer.step()
    counters = built.counters()
    assert counters.bytes_sent == counters.bytes_received == sum(
        built.optimizer.step_bytes(t) for t in range(4))
    assert counters.allreduces == 4 and counters.compression_seconds > 0
    from hvd_acp.methods import settings_of
    assert settings_of(built)["core_rank"] == 2


# ------------------------------------------------------- 2 and 4 ranks, real
@pytest.mark.parametrize("np", [2, 4])
def test_replicas_are_identical_and_resume_as_if_never_stopped(np):
    out = horovodrun("tsr_cases.py", "replicas", np=np, timeout=300).stdout
    assert sorted(rank_lines(out, "OK replicas")) == [str(r) for r in range(np)], out[-4000:]
    results = {r["key"]: r for r in map(json.loads, rank_lines(out, "RESULT"))}
    assert set(results) == {"fp32", "fp16", "resume"}, out[-4000:]
    fp32, fp16 = results["fp32"], results["fp16"]
    # The simulation of every rank in one process: the same bits at 2 ranks
    # (a sum of two has one order), within rounding at 4 (Gloo's ring sums
    # each chunk in its own order).
    if np == 2:
        assert fp32["max_difference"] == 0.0
    else:
        assert fp32["max_difference"] < 1e-5
    assert fp16["digest"] != fp32["digest"]
    assert fp16["bytes_sent"] * 2 == fp32["bytes_sent"] == fp32["expected_bytes"]
    assert results["resume"]["resumed_digest"] == results["resume"]["digest"]


def test_bad_or_differing_settings_raise_on_every_rank():
    np = 4
    out = horovodrun("tsr_cases.py", "mismatch", np=np, timeout=300).stdout
    assert sorted(rank_lines(out, "OK mismatch")) == [str(r) for r in range(np)], out[-4000:]
    caught = rank_lines(out, "CAUGHT")
    for case in ("refresh_period", "bad_setting", "embedding_names", "start"):
        lines = [line for line in caught if line.startswith(case + " ")]
        assert sorted(line.split()[1] for line in lines) == [f"rank={r}" for r in range(np)], case
    assert any("refresh_period=10 on rank 0 but 11 on rank 1" in line for line in caught)
    assert any("on rank 3: core_rank must be an int >= 1, got 0" in line for line in caught)
    assert any("name no parameter of two or more dimensions" in line for line in caught)
    assert any("hvd.broadcast_parameters" in line for line in caught)
