"""The compression state every front end holds (hvd_acp/state.py), in one process."""
import logging

import pytest
import torch
from torch.testing import assert_close

from hvd_acp.codecs import PowerSGDFirst, codec_of
from hvd_acp.compression import Phase, orthonormalize_
from hvd_acp.state import CompressedTensor, CompressionState

F64 = torch.float64


def make_state(seed=0, shapes=(("a", (12, 8)), ("bias", (12,)), ("b", (6, 20)))):
    state = CompressionState(matrix_rank=2, min_compression_rate=1.0, warmup_steps=0,
                             seed=seed)
    for name, shape in shapes:
        state.add(name, shape, F64, torch.device("cpu"))
    return state


def step(state, phase, grads):
    """One step on one rank: compress every tensor, 'average' (one rank), apply."""
    bases = state.bases(state.tensors, codec_of(phase))
    applied = {}
    for name, tensor in state.tensors.items():
        lay = tensor.layout
        out = torch.empty(*lay.payload_shape(phase), dtype=F64)
        tensor.compress_(codec_of(phase), grads[name], bases[name], out)
        target = torch.empty(lay.n, lay.m, dtype=F64)
        tensor.decode_(codec_of(phase), out, bases[name], target)
        applied[name] = target
    state.step_count += 1
    return applied


def grads_for(state, seed):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.layout.n, t.layout.m, generator=g, dtype=F64)
            for name, t in state.tensors.items()}


def test_only_matrices_worth_it_are_compressed_and_factors_come_from_the_seed():
    state = make_state()
    assert sorted(state.tensors) == ["a", "b"] and not state.layouts["bias"].compressed
    again = make_state()
    other = make_state(seed=1)
    for name in state.tensors:
        assert torch.equal(state.tensors[name].q, again.tensors[name].q)
        assert not torch.equal(state.tensors[name].q, other.tensors[name].q)
    assert state.wire_elements(Phase.P) == 12 * 2 + 12 + 6 * 2
    assert state.wire_elements(Phase.Q) == 8 * 2 + 12 + 20 * 2


@pytest.mark.parametrize("phase", [Phase.P, Phase.Q])
def test_a_step_keeps_what_it_does_not_send(phase):
    # M + E_before == (what was sent) x basis^T + E_after, per tensor.
    state = make_state()
    for tensor in state.tensors.values():
        tensor.error.normal_(generator=torch.Generator().manual_seed(3))
    before = {n: t.error.clone() for n, t in state.tensors.items()}
    grads = grads_for(state, 1)
    state.step_count = 0 if phase is Phase.P else 1
    bases = state.bases(state.tensors, codec_of(phase))
    for name, tensor in state.tensors.items():
        out = torch.empty(*tensor.layout.payload_shape(phase), dtype=F64)
        tensor.compress_(codec_of(phase), grads[name], bases[name], out)
        sent = out @ bases[name].t() if phase is Phase.P else bases[name] @ out.t()
        assert_close(grads[name] + before[name], sent + tensor.error)


def test_apply_commits_the_average_or_repairs_after_a_nonfinite_one():
    state = make_state()
    tensor = state.tensors["a"]
    basis = state.bases(["a"], codec_of(Phase.P))["a"]
    averaged = torch.randn(12, 2, dtype=F64)
    target = torch.empty(12, 8, dtype=F64)
    tensor.error.fill_(1.0)
    tensor.decode_(codec_of(Phase.P), averaged, basis, target)
    assert torch.equal(tensor.p, averaged) and bool(tensor.error.eq(1.0).all())
    assert_close(target, averaged @ basis.t())
    kept = tensor.p.clone()
    tensor.decode_(codec_of(Phase.P), torch.full((12, 2), float("nan"), dtype=F64), basis, target,
                  commit=False)
    assert torch.equal(tensor.p, kept) and not tensor.error.any()


def test_bases_are_orthonormal_and_leave_the_factors_alone():
    state = make_state()
    q_before = state.tensors["a"].q.clone()
    bases = state.bases(state.tensors, codec_of(Phase.P))
    assert bases is state.bases(["a"], codec_of(Phase.P))        # made once per step
    assert torch.equal(state.tensors["a"].q, q_before)
    assert_close(bases["a"].t() @ bases["a"], torch.eye(2, dtype=F64))
    assert_close(bases["a"] @ (bases["a"].t() @ q_before), q_before)   # same span


def test_same_shaped_bases_come_from_one_batched_factorization():
    """One QR call per shape, and the bases are views of its result: nothing
    copied back, each equal to the QR of its own factor."""
    state = CompressionState(matrix_rank=2, min_compression_rate=1.0, warmup_steps=0, seed=3)
    for name in ("a", "b", "c"):
        state.add(name, (12, 10), F64, torch.device("cpu"))
    state.add("d", (9, 16), F64, torch.device("cpu"))
    bases = state.bases(state.tensors, codec_of(Phase.P))
    storages = {bases[n].untyped_storage().data_ptr() for n in ("a", "b", "c")}
    assert len(storages) == 1
    assert bases["d"].untyped_storage().data_ptr() not in storages
    for name, tensor in state.tensors.items():
        alone, _ = torch.linalg.qr(tensor.q, mode="reduced")
        assert_close(bases[name], alone, rtol=0, atol=1e-12)


def test_power_sgd_is_two_projections_of_the_same_tensor():
    # P_i = A Q; Ph = orth(P); Q_i = A^T Ph; E = A - Ph Q_i^T; G = Ph Q^T.
    state = make_state()
    tensor = state.tensors["b"]
    grad = torch.randn(6, 20, dtype=F64)
    a = grad + tensor.error
    p_out = torch.empty(6, 2, dtype=F64)
    tensor.compress_(PowerSGDFirst(), grad, tensor.q, p_out)
    assert_close(p_out, a @ tensor.q)
    PowerSGDFirst().commit_(tensor, p_out)
    orthonormalize_([tensor.p])
    q_out = torch.empty(20, 2, dtype=F64)
    tensor.compress_(codec_of(Phase.Q), None, tensor.p, q_out)
    assert_close(q_out, a.t() @ tensor.p)
    assert_close(tensor.error, a - tensor.p @ q_out.t())


def test_a_residual_is_installed_only_on_the_rank_that_saved_it(caplog):
    saved_state = make_state()
    step(saved_state, Phase.P, grads_for(saved_state, 1))
    saved = saved_state.state_dict(rank=0, world_size=4)
    assert saved["rank"] == 0 and saved["world_size"] == 4
    assert any(e["error"].any() for e in saved["params"].values())

    same_rank = make_state(seed=7)
    same_rank.load_state_dict(saved, rank=0)
    for name, tensor in same_rank.tensors.items():
        assert torch.equal(tensor.error, saved["params"][name]["error"])
        assert torch.equal(tensor.p, saved["params"][name]["P"])
    assert same_rank.step_count == 1 and same_rank.phase is Phase.Q

    other_rank = make_state(seed=7)
    with caplog.at_level(logging.INFO, logger="hvd_acp.state"):
        other_rank.load_state_dict(saved, rank=3)
    assert "saved by rank 0; rank 3 starts its own from zero" in caplog.text
    for name, tensor in other_rank.tensors.items():
        assert not tensor.error.any()
        assert torch.equal(tensor.q, saved["params"][name]["Q"])

    reset = make_state(seed=7)
    reset.load_state_dict(saved, rank=0, reset_error_feedback=True)
    assert not any(t.error.any() for t in reset.tensors.values())

    unknown = make_state(seed=7)          # a state saved with no rank (one process)
    unknown.load_state_dict(dict(saved, rank=None), rank=2)
    assert all(t.error.any() for t in unknown.tensors.values())


def test_a_state_that_cannot_load_changes_nothing():
    saved = make_state().state_dict(rank=0, world_size=1)
    target = make_state(seed=3)
    before = {n: t.q.clone() for n, t in target.tensors.items()}
    bad_shape = dict(saved, params=dict(saved["params"], b={**saved["params"]["b"],
                                                            "Q": torch.zeros(20, 3)}))
    with pytest.raises(ValueError, match=r"'b': Q has shape \(20, 3\), expected \(20, 2\)"):
        target.load_state_dict(bad_shape, rank=0)
    with pytest.raises(ValueError, match=r"missing \['b'\], unexpected \['c'\]"):
        target.load_state_dict(dict(saved, params={"a": saved["params"]["a"],
                                                   "c": saved["params"]["b"]}), rank=0)
    with pytest.raises(ValueError, match="unsupported hvd_acp state format version 1"):
        target.load_state_dict(dict(saved, version=1), rank=0)
    with pytest.raises(ValueError, match="not an hvd_acp compression state"):
        target.load_state_dict({"step_count": 3}, rank=0)
    assert all(torch.equal(t.q, before[n]) for n, t in target.tensors.items())
    assert target.step_count == 0


def test_entries_of_parameters_not_added_yet_wait_for_them():
    # A DDP state learns its parameters in the first iteration.
    saved = make_state().state_dict(rank=0, world_size=1)
    late = CompressionState(matrix_rank=2, min_compression_rate=1.0, warmup_steps=0, seed=9)
    late.load_state_dict(saved, rank=1, complete=False)
    assert late.step_count == 0 + saved["step_count"] and not late.tensors
    assert sorted(late.state_dict(rank=1, world_size=1)["params"]) == ["a", "b"]
    late.add("a", (12, 8), F64, torch.device("cpu"))
    assert torch.equal(late.tensors["a"].q, saved["params"]["a"]["Q"])
    with pytest.raises(ValueError, match=r"parameters this model does not have: \['b'\]"):
        late.check_loaded()
    uncompressed = CompressionState(matrix_rank=2, min_compression_rate=1.0, warmup_steps=0,
                                    seed=9)
    uncompressed.load_state_dict(saved, rank=0, complete=False)
    with pytest.raises(ValueError, match="factors for 'a', which is not compressed here"):
        uncompressed.add("a", (12, 1), F64, torch.device("cpu"))


@pytest.mark.parametrize("kwargs, match", [
    ({"matrix_rank": 0}, "matrix_rank must be a positive int, got 0"),
    ({"matrix_rank": 1.5}, r"positive int, got 1.5; or a float in \(0, 1\)"),
    ({"matrix_rank": 0.0}, "matrix_rank must be a positive int, got 0.0"),
    ({"min_compression_rate": -1}, "min_compression_rate must be a number >= 0"),
    ({"warmup_steps": 1.5}, "warmup_steps must be an int >= 0, got 1.5"),
])
def test_bad_settings_name_the_argument(kwargs, match):
    settings = dict(matrix_rank=2, min_compression_rate=1.0, warmup_steps=0, seed=0)
    with pytest.raises(ValueError, match=match):
        CompressionState(**dict(settings, **kwargs))


def test_compressed_tensor_takes_any_gradient_shape_and_dtype():
    state = make_state(shapes=(("conv", (4, 3, 2, 2)),))
    tensor = state.tensors["conv"]
    assert isinstance(tensor, CompressedTensor) and tensor.layout.m == 12
    grad = torch.randn(4, 3, 2, 2, dtype=torch.float32)
    basis = state.bases(["conv"], codec_of(Phase.P))["conv"]
    out = torch.empty(4, 2, dtype=F64)
    tensor.compress_(codec_of(Phase.P), grad, basis, out)
    assert_close(out, grad.reshape(4, 12).double() @ basis)


@pytest.mark.parametrize("phase", [Phase.P, Phase.Q])
def test_a_gradient_in_the_parameters_shape_or_layout_compresses_alike(phase):
    """The parameter-shaped gradient is added without a view; a flattened or
    channels-last one takes the matrix path: the same bits either way."""
    grad = torch.randn(4, 3, 2, 2, dtype=F64)
    results = []
    for given in (grad, grad.reshape(4, 12), grad.to(memory_format=torch.channels_last)):
        state = make_state(shapes=(("conv", (4, 3, 2, 2)),))
        tensor = state.tensors["conv"]
        tensor.error.copy_(torch.linspace(-1, 1, 48, dtype=F64).view(4, 12))
        basis = state.bases(["conv"], codec_of(phase))["conv"]
        out = torch.empty(4 if phase is Phase.P else 12, 2, dtype=F64)
        tensor.compress_(codec_of(phase), given, basis, out)
        results.append((out, tensor.error.clone()))
    for out, error in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(error, results[0][1])
    accumulated = grad.reshape(4, 12) + torch.linspace(-1, 1, 48, dtype=F64).view(4, 12)
    out, error = results[0]
    sent = out @ basis.t() if phase is Phase.P else basis @ out.t()
    assert_close(sent + error, accumulated)


def test_describe_gives_the_ranks_and_the_share_of_s_sgd_bytes():
    cpu = torch.device("cpu")
    state = CompressionState(matrix_rank=2, min_compression_rate=1.0, warmup_steps=0, seed=0)
    state.add("w", (8, 8), torch.float32, cpu)
    state.add("b", (8,), torch.float32, cpu)
    # Each step sends 8 * 2 factor elements and the 8 of the bias: 24 of 72.
    line = state.describe()
    assert "compressed: 1 tensors, rank 2-2" in line and "1 other tensors averaged whole" in line
    assert "33.3% of S-SGD's bytes (96 of 288 bytes)" in line
    assert "16.7% of S-SGD's bytes (48 of 288 bytes, fp16 on the wire)" in state.describe(True)


def test_a_pq_step_sends_both_factors_on_the_previous_bases():
    state = CompressionState(matrix_rank=2, min_compression_rate=1.0, warmup_steps=1, seed=0,
                             both_factors=True)
    for name, shape in (("a", (12, 8)), ("bias", (12,)), ("b", (6, 20))):
        state.add(name, shape, F64, torch.device("cpu"))
    assert state.phase is Phase.DENSE
    state.step_count = 1
    assert state.phase is Phase.PQ and state.wire_elements(Phase.PQ) == 20 * 2 + 12 + 26 * 2
    for tensor in state.tensors.values():
        tensor.error.normal_(generator=torch.Generator().manual_seed(3))
    before = {n: t.error.clone() for n, t in state.tensors.items()}
    grads = grads_for(state, 1)
    bases = state.bases(state.tensors, codec_of(Phase.PQ))
    for name, tensor in state.tensors.items():
        ph, qh = bases[name]
        assert_close(ph.t() @ ph, torch.eye(2, dtype=F64))
        assert_close(qh, torch.linalg.qr(tensor.q)[0])
        n = tensor.layout.n
        out = torch.empty(*tensor.layout.payload_shape(Phase.PQ), dtype=F64)
        pending = tensor.compress_(codec_of(Phase.PQ), grads[name], bases[name], out, defer=True)
        out.mul_(3)                                    # the all-reduce writes over the slot
        pending.finish_()                              # the residual reads its own copy
        accumulated = grads[name] + before[name]
        sent = (out[:n] / 3) @ qh.t() + ph @ (out[n:] / 3).t() - ph @ ph.t() @ (out[:n] / 3) @ qh.t()
        assert_close(accumulated, sent + tensor.error)
        target = torch.empty(n, tensor.layout.m, dtype=F64)
        p, rest = tensor.decode_(codec_of(Phase.PQ), out / 3, bases[name], target)
        assert_close(target, sent)
        assert_close(tensor.p, out[:n] / 3) and assert_close(tensor.q, out[n:] / 3)
        assert_close(p.pow(2).sum() + rest.pow(2).sum(), target.pow(2).sum())
    assert "PQ" == state.state_dict(rank=0, world_size=1)["phase"]
    assert state.settings.both_factors is True


def test_the_diagnostics_of_pq_steps_count_what_the_projection_keeps_once():
    import hvd_acp
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    opt = hvd_acp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                       named_parameters=model.named_parameters(),
                                       communicator=hvd_acp.LocalCommunicator(),
                                       diagnostics=True)
    for step in range(4):
        x = torch.randn(5, 24, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        accumulated = {n: t.error.clone() for n, t in opt.reducer.state.tensors.items()}
        model(x).square().mean().backward()     # the hooks compress as the gradients come
        for name, param in model.named_parameters():
            if name in accumulated:
                accumulated[name] += param.grad
        opt.step()
        record = opt.reducer.diagnostics[-1]
        assert record["phase"] == "PQ"
        # kept = ||A||^2 - ||(I - Ph Ph^T) A (I - Qh Qh^T)||^2 = ||A||^2 - ||E||^2
        kept = sum(float(a.double().pow(2).sum()) for a in accumulated.values())
        left = sum(float(e.double().pow(2).sum()) for e in opt.reducer.errors.values())
        assert record["kept_share"] == pytest.approx((kept - left) / kept, rel=1e-4)
        assert (record["subspace_turn"] is None) == (step == 0)
    opt.close()
