"""The compression maths of ACP-SGD, in one process (hvd_acp.compression)."""
import pytest
import torch
from torch.testing import assert_close

from hvd_acp.compression import (Phase, compress_, compute_dtype, factor_rank, init_factor,
                                 local_residual_, matrix_shape, orthonormalize_, project_,
                                 reconstruct_, should_compress)

F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=_gen(seed), dtype=F64)


def _orthonormalized(matrix):
    out = matrix.clone()
    orthonormalize_([out])
    return out


def _acp_steps(grads_per_step, n, m, r, check):
    """Run ACP-SGD over simulated ranks, calling ``check`` after every step.

    ``grads_per_step[t][i]`` is rank i's gradient (n, m) at step t. The P and
    Q factors are averaged over the simulated ranks exactly as the reducer
    does after its all-reduce; each rank keeps its own residual.
    """
    world = len(grads_per_step[0])
    p_factor = _randn(n, r, seed=100)
    q_factor = _randn(m, r, seed=101)
    errors = [torch.zeros(n, m, dtype=F64) for _ in range(world)]
    for step, grads in enumerate(grads_per_step):
        phase = Phase.P if step % 2 == 0 else Phase.Q
        before = [e.clone() for e in errors]
        applied = torch.full((n, m), float("nan"), dtype=F64)
        if phase is Phase.P:
            basis = _orthonormalized(q_factor)
            local = [torch.empty(n, r, dtype=F64) for _ in range(world)]
            for g, e, out in zip(grads, errors, local):
                compress_(g, e, basis, out)
                local_residual_(e, out, basis)
            p_factor = torch.stack(local).mean(0)
            recon = [out @ basis.t() for out in local]
            reconstruct_(applied, p_factor, basis)
        else:
            basis = _orthonormalized(p_factor)
            local = [torch.empty(m, r, dtype=F64) for _ in range(world)]
            for g, e, out in zip(grads, errors, local):
                compress_(g.t(), e.t(), basis, out)
                local_residual_(e.t(), out, basis)
            q_factor = torch.stack(local).mean(0)
            recon = [basis @ out.t() for out in local]
            reconstruct_(applied, basis, q_factor)
        check(phase, grads, before, errors, recon, applied, basis)


def test_error_feedback_identity_holds_for_every_rank_and_step():
    n, m, r, world, steps = 7, 5, 2, 2, 6
    grads = [[_randn(n, m, seed=10 * t + i) for i in range(world)] for t in range(steps)]
    phases = []

    def check(phase, grads, before, after, recon, applied, basis):
        phases.append(phase)
        for g, e_before, e_after, own in zip(grads, before, after, recon):
            # M_i + E_i(before) == P_i Qh^T + E_i(after): this rank's own factor.
            assert_close(g + e_before, own + e_after)
        # Over ranks: the sum of the gradients plus residuals is N G plus the
        # sum of the new residuals; nothing is lost or counted twice.
        assert_close(sum(g + e for g, e in zip(grads, before)),
                     len(grads) * applied + sum(after))
        # G is the average of the ranks' own reconstructions P_i Qh^T (Ph Q_i^T).
        assert_close(applied, torch.stack(recon).mean(0))
        # Low rank r < min(n, m): the residual cannot be zero.
        assert all(e.abs().max() > 1e-6 for e in after)

    _acp_steps(grads, n, m, r, check)
    assert phases == [Phase.P, Phase.Q] * 3


def test_local_residual_is_orthogonal_to_the_basis_and_zero_at_full_rank():
    n, m, r = 6, 5, 2
    accumulated = _randn(n, m, seed=7)
    basis = _orthonormalized(_randn(m, r, seed=8))
    error, out = accumulated.clone(), torch.empty(n, r, dtype=F64)
    compress_(None, error, basis, out)
    local_residual_(error, out, basis)
    assert_close(error @ basis, torch.zeros(n, r, dtype=F64), atol=1e-12, rtol=0)
    assert_close(error, accumulated - accumulated @ basis @ basis.t())
    # Full rank (square orthogonal basis): nothing is left behind, so each
    # rank's residual stays zero and ACP-SGD is exactly S-SGD.
    square = _orthonormalized(_randn(m, m, seed=9))
    error, out = accumulated.clone(), torch.empty(n, m, dtype=F64)
    compress_(None, error, square, out)
    local_residual_(error, out, square)
    assert error.abs().max() < 1e-12


def test_compress_keeps_the_accumulated_gradient_until_the_residual():
    n, m, r = 6, 4, 2
    error = _randn(n, m, seed=1)
    grad = _randn(n, m, seed=3)
    before = error.clone()
    basis = _orthonormalized(_randn(m, r, seed=2))
    out = torch.empty(n, r, dtype=F64)
    compress_(grad, error, basis, out)
    assert_close(error, before + grad)
    assert_close(out, (before + grad) @ basis)
    # A missing gradient is a zero one: the residual still flows into the factor.
    error = before.clone()
    compress_(None, error, basis, out)
    assert_close(error, before)
    assert_close(out, before @ basis)
    local_residual_(error, out, basis)
    assert_close(error, before - out @ basis.t())


def test_project_matches_the_plain_product_for_both_layouts():
    matrix, basis = _randn(9, 7, seed=4), _orthonormalized(_randn(7, 3, seed=5))
    out = torch.full((9, 3), float("nan"), dtype=F64)
    project_(matrix, basis, out)
    assert_close(out, matrix @ basis, atol=1e-12, rtol=0)
    # Q step: a transposed view of the residual.
    basis_t = _orthonormalized(_randn(9, 3, seed=6))
    out_t = torch.empty(7, 3, dtype=F64)
    project_(matrix.t(), basis_t, out_t)
    assert_close(out_t, matrix.t() @ basis_t, atol=1e-12, rtol=0)


def test_square_full_rank_is_exact_in_both_phases():
    n = 5
    grads = [[_randn(n, n, seed=10 * t + i) for i in range(2)] for t in range(4)]
    seen = []

    def check(phase, grads, before, after, recon, applied, basis):
        seen.append(phase)
        # Nothing is lost: the residuals cancel over ranks (each rank keeps
        # its deviation from the average, which never reaches G).
        total = torch.stack(after).sum(0)
        assert_close(total, torch.zeros_like(total), atol=1e-12, rtol=0)
        assert_close(applied, torch.stack(grads).mean(0), atol=1e-12, rtol=1e-12)

    _acp_steps(grads, n, n, n, check)
    assert seen == [Phase.P, Phase.Q, Phase.P, Phase.Q]


def test_tall_matrix_with_r_equal_to_m_is_exact_only_in_the_p_phase():
    n, m = 6, 3
    grads = [[_randn(n, m, seed=t)] for t in range(2)]
    residual = {}

    def check(phase, grads, before, after, recon, applied, basis):
        residual[phase] = after[0].abs().max().item()
        if phase is Phase.P:
            assert_close(applied, grads[0], atol=1e-12, rtol=1e-12)

    _acp_steps(grads, n, m, m, check)
    assert residual[Phase.P] < 1e-12
    assert residual[Phase.Q] > 1e-3


def _assert_orthonormal(matrix):
    eye = torch.eye(matrix.shape[1], dtype=matrix.dtype)
    assert_close(matrix.t() @ matrix, eye, atol=1e-10, rtol=0)


def test_orthonormalize_gives_orthonormal_columns_spanning_the_same_space():
    original = _randn(9, 3, seed=3)
    ortho = _orthonormalized(original)
    _assert_orthonormal(ortho)
    # Same column space: projecting the original onto it changes nothing.
    assert_close(ortho @ (ortho.t() @ original), original)


def test_orthonormalize_batches_same_shapes_and_handles_mixed_shapes():
    originals = [_randn(8, 2, seed=s) for s in range(3)] + [_randn(5, 3, seed=9)]
    batch = [x.clone() for x in originals]
    orthonormalize_(batch)
    for x, original in zip(batch, originals):
        _assert_orthonormal(x)
        # Batching must not mix matrices: each equals its own factorization.
        assert_close(x, _orthonormalized(original), atol=1e-12, rtol=0)


def test_orthonormalize_of_a_zero_matrix_has_no_nan():
    for dtype in (torch.float32, F64):
        zero = torch.zeros(6, 2, dtype=dtype)
        other = torch.randn(6, 2, generator=_gen(0), dtype=dtype)
        orthonormalize_([zero, other])
        assert torch.isfinite(zero).all()
        assert_close(zero.t() @ zero, torch.eye(2, dtype=dtype))


def test_reconstruct_writes_the_product_ignoring_old_contents():
    factor, basis = _randn(4, 2, seed=1), _randn(3, 2, seed=2)
    target = torch.full((4, 3), float("nan"), dtype=F64)
    reconstruct_(target, factor, basis)
    assert_close(target, factor @ basis.t())


def test_matrix_shape_and_factor_rank():
    assert matrix_shape((16, 3, 3, 3)) == (16, 27)
    assert matrix_shape((5,)) == (5, 1)
    assert matrix_shape(()) == (1, 1)
    assert factor_rank(16, 27, 4) == 4
    assert factor_rank(3, 27, 4) == 3
    assert factor_rank(16, 2, 4) == 2


def test_should_compress_boundary():
    # (n + m) r * rate <= n m: (8 + 8) * 2 * 2 == 64 == 8 * 8.
    assert should_compress((8, 8), 2, 2.0)
    assert not should_compress((8, 8), 2, 2.01)
    assert not should_compress((64,), 2, 0.0)
    assert should_compress((16, 3, 3, 3), 4, 2.0)
    assert not should_compress((2, 32), 4, 2.0)


def test_compute_dtype_promotes_half_precision_only():
    assert compute_dtype(torch.float16) is torch.float32
    assert compute_dtype(torch.bfloat16) is torch.float32
    assert compute_dtype(torch.float32) is torch.float32
    assert compute_dtype(F64) is F64


def test_init_factor_is_reproducible_from_the_seed():
    a = init_factor(5, 2, _gen(7), torch.float32, torch.device("cpu"))
    b = init_factor(5, 2, _gen(7), torch.float32, torch.device("cpu"))
    c = init_factor(5, 2, _gen(8), torch.float32, torch.device("cpu"))
    assert a.dtype is torch.float32 and a.shape == (5, 2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("phase, expected", [(Phase.P, Phase.Q), (Phase.Q, Phase.P),
                                             (Phase.PQ, Phase.PQ), (Phase.DENSE, Phase.DENSE)])
def test_phase_flipped(phase, expected):
    assert phase.flipped() is expected


def test_a_q_step_on_the_untransposed_residual_equals_the_transposed_form():
    from hvd_acp.compression import compress_columns_, local_residual_columns_
    grad, start = _randn(9, 7, seed=7), _randn(9, 7, seed=8)
    basis = _orthonormalized(_randn(9, 3, seed=9))
    transposed_error, out_t = start.clone(), torch.empty(7, 3, dtype=F64)
    compress_(grad.t(), transposed_error.t(), basis, out_t)
    local_residual_(transposed_error.t(), out_t, basis)

    error, out = start.clone(), torch.full((7, 3), float("nan"), dtype=F64)
    factor_t = compress_columns_(grad, error, basis, out)
    assert_close(error, grad + start, atol=0, rtol=0)          # A, before the residual
    assert factor_t.shape == (3, 7)
    local_residual_columns_(error, basis, factor_t)
    assert_close(out, (grad + start).t() @ basis, atol=1e-12, rtol=0)
    assert_close(out, out_t, atol=1e-12, rtol=0)
    assert_close(error, transposed_error, atol=1e-12, rtol=0)
    # M + E_before == Ph Q_i^T + E_after: nothing lost.
    assert_close(grad + start, basis @ out.t() + error, atol=1e-12, rtol=0)


def test_precomputed_transposes_give_the_same_products():
    factor, basis = _randn(6, 2, seed=11), _orthonormalized(_randn(5, 2, seed=12))
    error = _randn(6, 5, seed=13)
    by_view = error.clone()
    local_residual_(by_view, factor, basis, basis.t())
    local_residual_(error, factor, basis)
    assert torch.equal(by_view, error)
    target, target_t = torch.empty(6, 5, dtype=F64), torch.empty(6, 5, dtype=F64)
    reconstruct_(target, factor, basis)
    reconstruct_(target_t, factor, basis, basis.t())
    assert torch.equal(target, target_t)
    assert_close(target, factor @ basis.t(), atol=1e-12, rtol=0)


def _tangent(matrix, p_basis, q_basis):
    """The projection on the tangent space of both bases, written out."""
    n, m = matrix.shape
    left = torch.eye(n, dtype=matrix.dtype) - p_basis @ p_basis.t()
    right = torch.eye(m, dtype=matrix.dtype) - q_basis @ q_basis.t()
    return matrix - left @ matrix @ right


@pytest.mark.parametrize("n, m, r", [(12, 7, 3), (5, 16, 2), (6, 6, 6)])
def test_both_factors_send_the_tangent_projection_and_keep_the_rest(n, m, r):
    from hvd_acp.compression import compress_both_, local_residual_both_, reconstruct_both_
    dt = torch.float64
    ph = _orthonormalized(_randn(n, r, seed=1).to(dt))
    qh = _orthonormalized(_randn(m, r, seed=2).to(dt))
    grads = [_randn(n, m, seed=10 + i).to(dt) for i in range(3)]       # three ranks
    errors = [_randn(n, m, seed=20 + i).to(dt) for i in range(3)]
    accumulated = [g + e for g, e in zip(grads, errors)]
    outs = []
    for grad, error, acc in zip(grads, errors, accumulated):
        out = torch.empty(n + m, r, dtype=dt)
        compress_both_(grad, error, ph, qh, out)
        assert_close(error, acc)                       # A, until the residual
        assert_close(out[:n], acc @ qh)
        assert_close(out[n:], acc.t() @ ph)
        local_residual_both_(error, out[:n], out[n:].t(), ph, qh)
        assert_close(error, acc - _tangent(acc, ph, qh))
        outs.append(out)
    mean = sum(outs) / 3
    target = torch.full((n, m), float("nan"), dtype=dt)
    p, rest = reconstruct_both_(target, mean[:n], mean[n:], ph, qh)
    assert_close(target, _tangent(sum(accumulated) / 3, ph, qh))     # linear in A
    assert_close(p.pow(2).sum() + rest.pow(2).sum(), target.pow(2).sum())
    if r == min(n, m):                                 # a full basis on one side: exact
        assert_close(target, sum(accumulated) / 3)
        assert_close(errors[0], torch.zeros_like(errors[0]))
