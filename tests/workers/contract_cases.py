"""Multi-rank checks of the production contract, run under horovodrun --gloo.

Usage: contract_cases.py CASE [ARG]. Each rank prints ``OK <case> <rank>``
when every assertion of the case held on that rank.
"""
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_acp

torch.set_num_threads(1)


TEACHER = torch.randn(12, 5, generator=torch.Generator().manual_seed(99))


def batch(rank, step, n=8):
    """Rank- and step-specific inputs, labelled by a fixed linear teacher."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(n, 12, generator=g)
    return x, (x @ TEACHER).argmax(dim=1)


def mlp(seed=0, width=16, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 5)).to(dtype)


def flat(model):
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def assert_replicas_identical(tensor, process_set=None):
    kwargs = {} if process_set is None else {"process_set": process_set}
    gathered = hvd.allgather(tensor.unsqueeze(0), **kwargs)
    for other in gathered:
        assert torch.equal(other, gathered[0]), "replicas diverged"


def acp(model, base=None, **kwargs):
    base = base or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kwargs.setdefault("matrix_rank", 2)
    return hvd_acp.DistributedOptimizer(base, model.named_parameters(), **kwargs)


def train(model, opt, steps, start=0, loss_scale=1.0):
    losses = []
    for step in range(start, start + steps):
        x, y = batch(hvd.rank(), step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(next(model.parameters()).dtype)), y)
        (loss * loss_scale).backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------- checkpoints
def case_checkpoint(directory):
    """Policy (a): each rank saves and resumes its own state, bitwise.
    Policy (b): rank 0's file loaded by every rank, error feedback reset."""
    rank = hvd.rank()
    model = mlp()
    opt = acp(model)
    train(model, opt, 5)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
               os.path.join(directory, f"ckpt.{rank}.pt"))
    train(model, opt, 6, start=5)
    uninterrupted = flat(model)

    # (a) resume from this rank's own file: same trajectory, bit for bit.
    model2 = mlp(seed=123)
    opt2 = acp(model2)
    saved = torch.load(os.path.join(directory, f"ckpt.{rank}.pt"))
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    assert opt2.step_count == 5 and opt2.phase is hvd_acp.Phase.Q
    train(model2, opt2, 6, start=5)
    assert torch.equal(flat(model2), uninterrupted), "resumed run left the trajectory"
    opt.close()
    opt2.close()

    # (b) every rank loads rank 0's file, with the error feedback reset.
    model3 = mlp(seed=7)
    opt3 = acp(model3)
    saved0 = torch.load(os.path.join(directory, "ckpt.0.pt"))
    model3.load_state_dict(saved0["model"])
    opt3.load_state_dict(saved0["opt"], reset_error_feedback=True)
    assert all(float(e.abs().max()) == 0 for e in opt3.reducer.errors.values())
    assert opt3.step_count == 5
    losses = train(model3, opt3, 10, start=5)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert_replicas_identical(flat(model3))

    # The wrapped optimizer's checkpoint is a plain torch checkpoint plus a section.
    plain = torch.optim.SGD(mlp().parameters(), lr=0.05, momentum=0.9)
    plain.load_state_dict(saved0["opt"])
    assert len(plain.state) == len(saved0["opt"]["state"])
    print("OK checkpoint", rank, flush=True)


def case_load_other_world(directory):
    """A rank-0 checkpoint written at 2 ranks loads at another world size."""
    model = mlp()
    opt = acp(model)
    saved0 = torch.load(os.path.join(directory, "ckpt.0.pt"))
    model.load_state_dict(saved0["model"])
    opt.load_state_dict(saved0["opt"], reset_error_feedback=True)
    assert saved0["opt"]["hvd_acp"]["world_size"] == 2 and hvd.size() != 2
    losses = train(model, opt, 8, start=5)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert_replicas_identical(flat(model))
    print("OK load_other_world", hvd.rank(), flush=True)


# ------------------------------------------------------- gradient accumulation
def case_accumulation():
    """k backward passes of half batches == one pass of the whole batch."""
    k = 2
    model_a, model_b = mlp(), mlp()
    opt_a = acp(model_a, torch.optim.SGD(model_a.parameters(), lr=0.1),
                backward_passes_per_step=k)
    opt_b = acp(model_b, torch.optim.SGD(model_b.parameters(), lr=0.1))
    for step in range(6):
        x, y = batch(hvd.rank(), step, n=8)
        opt_a.zero_grad()
        for part in range(k):
            xs, ys = x[part * 4:(part + 1) * 4], y[part * 4:(part + 1) * 4]
            (F.cross_entropy(model_a(xs), ys) / k).backward()
        opt_a.step()
        opt_b.zero_grad()
        F.cross_entropy(model_b(x), y).backward()
        opt_b.step()
    torch.testing.assert_close(flat(model_a), flat(model_b), rtol=1e-5, atol=1e-6)
    # One all-reduce per buffer per step: both made the same number.
    assert opt_a.comm_stats.allreduces == opt_b.comm_stats.allreduces
    assert_replicas_identical(flat(model_a))
    print("OK accumulation", hvd.rank(), flush=True)


# ------------------------------------------------------------ mixed precision
def case_amp():
    """GradScaler pattern; an overflow on one rank is skipped everywhere and
    leaves no non-finite value in the compression state."""
    rank = hvd.rank()
    model = mlp()
    opt = acp(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    losses, skipped = [], 0
    for step in range(30):
        x, y = batch(rank, step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        scaled = scaler.scale(loss)
        if step == 7 and rank == 1:
            scaled = scaled * float("inf")          # overflow on one rank only
        scaled.backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        before = flat(model)
        scale = scaler.get_scale()
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < scale:
            skipped += 1
            assert step == 7, f"unexpected skip at step {step}"
            assert torch.equal(flat(model), before), "a non-finite step was applied"
        for name, tensor in list(opt.reducer.errors.items()) + list(
                opt.reducer.state.p_factors.items()) + list(opt.reducer.state.q_factors.items()):
            assert torch.isfinite(tensor).all(), f"non-finite state in {name} at {step}"
        losses.append(loss.item())
    assert skipped == 1 and opt.reducer.nonfinite_steps == 1
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    assert_replicas_identical(flat(model))
    print("OK amp", rank, flush=True)


def case_dtypes():
    """fp16 and bf16 parameters train; factors are computed in float32."""
    for dtype in (torch.bfloat16, torch.float16):
        model = mlp(dtype=dtype)
        opt = acp(model, torch.optim.SGD(model.parameters(), lr=0.05))
        losses = train(model, opt, 12)
        assert all(p.grad.dtype == dtype for p in model.parameters())
        assert all(e.dtype == torch.float32 for e in opt.reducer.errors.values())
        assert all(torch.isfinite(torch.tensor(losses))), losses
        assert_replicas_identical(flat(model))
        opt.close()
    print("OK dtypes", hvd.rank(), flush=True)


# ------------------------------------------------------ Horovod's other arguments
def square_model(seed=0, width=8):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(width, width, bias=False))


def square_step(model, opt, step):
    g = torch.Generator().manual_seed(50 * hvd.rank() + step)
    x = torch.randn(4, 8, generator=g)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def compare_with_horovod(label, acp_kwargs, hvd_kwargs, steps=4, tol=1e-5):
    """At full rank on square matrices ACP-SGD equals hvd.DistributedOptimizer."""
    ref, ours = square_model(), square_model()
    if callable(acp_kwargs):
        acp_kwargs = acp_kwargs(ours)
    ref_opt = hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1),
                                       named_parameters=[(f"ref.{n}", p) for n, p in
                                                         ref.named_parameters()],
                                       **hvd_kwargs)
    our_opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1),
                                           ours.named_parameters(), matrix_rank=8,
                                           min_compression_rate=0, **acp_kwargs)
    assert all(lay.compressed for lay in our_opt.reducer.layouts.values())
    for step in range(steps):
        square_step(ref, ref_opt, step)
        square_step(ours, our_opt, step)
    torch.testing.assert_close(flat(ours), flat(ref), rtol=tol, atol=tol, msg=label)
    our_opt.close()
    return our_opt


def case_horovod_args():
    compare_with_horovod("op=Sum", {"op": hvd.Sum}, {"op": hvd.Sum})
    compare_with_horovod("predivide", {"gradient_predivide_factor": 2.0},
                         {"gradient_predivide_factor": 2.0})
    compare_with_horovod("num_groups", {"num_groups": 2}, {"num_groups": 2})
    compare_with_horovod("groups", lambda m: {"groups": [[p] for p in m.parameters()]}, {})
    fp16 = compare_with_horovod("fp16", {"compression": hvd.Compression.fp16},
                                {"compression": hvd.Compression.fp16}, tol=2e-3)
    plain = compare_with_horovod("plain", {}, {})
    assert fp16.comm_stats.bytes_sent * 2 == plain.comm_stats.bytes_sent

    # explicit groups give one buffer per group
    model = mlp()
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    groups = [list(layers[0].parameters()), list(layers[1].parameters()) +
              list(layers[2].parameters())]
    opt = acp(model, groups=groups)
    train(model, opt, 2)
    assert opt.comm_stats.allreduces == 2 * 2
    opt.close()

    # sparse gradients, sent apart or densified (see also swap_cases.py)
    torch.manual_seed(0)
    emb = torch.nn.Embedding(20, 6, sparse=True)
    idx = torch.tensor([1, 2, 3 + hvd.rank()])
    for sparse_as_dense in (False, True):
        opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                           [("emb.weight", emb.weight)], matrix_rank=2,
                                           sparse_as_dense=sparse_as_dense)
        for _ in range(3):
            opt.zero_grad()
            emb(idx).sum().backward()
            opt.step()
            assert emb.weight.grad.is_sparse
        assert_replicas_identical(emb.weight.detach().reshape(-1))
        opt.close()

    try:
        acp(mlp(), op=hvd.Adasum)
    except NotImplementedError as exc:
        assert "Adasum" in str(exc)
    else:
        raise AssertionError("op=hvd.Adasum accepted")
    print("OK horovod_args", hvd.rank(), flush=True)


# ------------------------------------------------------------- several optimizers
def case_several():
    """Two optimizers (a GAN's pair) and requires_grad toggled between steps."""
    rank = hvd.rank()
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 12))
    disc = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt_g = hvd_acp.DistributedOptimizer(torch.optim.Adam(gen.parameters(), lr=1e-3),
                                         [(f"G.{n}", p) for n, p in gen.named_parameters()],
                                         matrix_rank=2)
    opt_d = hvd_acp.DistributedOptimizer(torch.optim.Adam(disc.parameters(), lr=1e-3),
                                         [(f"D.{n}", p) for n, p in disc.named_parameters()],
                                         matrix_rank=2)
    for step in range(8):
        g = torch.Generator().manual_seed(10 * rank + step)
        real, noise = torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)
        opt_d.zero_grad()
        d_loss = (F.softplus(-disc(real)) + F.softplus(disc(gen(noise).detach()))).mean()
        d_loss.backward()
        opt_d.step()
        # As with hvd.DistributedOptimizer, D is frozen while G learns, so
        # G's backward does not start a round of D's optimizer.
        disc.requires_grad_(False)
        opt_g.zero_grad()
        g_loss = F.softplus(-disc(gen(noise))).mean()
        g_loss.backward()
        opt_g.step()
        disc.requires_grad_(True)
    assert_replicas_identical(torch.cat([flat(gen), flat(disc)]))

    model = mlp()
    opt = acp(model)
    first = model[0]
    train(model, opt, 3)
    first.weight.requires_grad_(False)
    frozen = first.weight.detach().clone()
    train(model, opt, 4, start=3)
    assert torch.equal(first.weight.detach(), frozen), "a frozen parameter moved"
    first.weight.requires_grad_(True)
    train(model, opt, 4, start=7)
    assert not torch.equal(first.weight.detach(), frozen)
    assert_replicas_identical(flat(model))
    print("OK several", rank, flush=True)


def case_process_sets():
    """Two process sets train two different models at once."""
    rank = hvd.rank()
    sets = {0: PS_A, 1: PS_B}
    mine = sets[rank // 2]
    model = mlp(seed=rank // 2, width=8 + 8 * (rank // 2))
    opt = acp(model, process_set=mine)
    losses = train(model, opt, 8)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert_replicas_identical(flat(model), process_set=mine)
    print("OK process_sets", rank, flush=True)


if __name__ == "__main__":
    case = sys.argv[1]
    if case == "process_sets":
        PS_A, PS_B = hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3])
        hvd.init(process_sets=[PS_A, PS_B])
    else:
        hvd.init()
    globals()[f"case_{case}"](*sys.argv[2:])
    hvd.barrier()   # no rank shuts Horovod down while another still works
