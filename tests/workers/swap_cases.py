"""The one-line swap, checked the way Horovod's own optimizer tests check it.

Usage: ``swap_cases.py CASE``. Each case runs what a user of
``hvd.DistributedOptimizer`` relies on against ``hvd_acp.DistributedOptimizer``
(often next to Horovod's own optimizer on a copy of the model) and prints
``OK <case> <rank>`` when every assertion held on that rank. Every rank can
regenerate every rank's inputs, so expected values are computed here.
"""
import inspect
import sys
import warnings

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import hvd_acp

torch.set_num_threads(1)


def generator(rank, step, salt=0):
    return torch.Generator().manual_seed(10_007 * rank + 101 * salt + step)


def flat(model):
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def assert_identical_on_every_rank(tensor, what, process_set=None):
    # Named: Horovod's generated names count this rank's operations, which
    # differ between ranks where a process set left one of them out.
    kwargs = {} if process_set is None else {"process_set": process_set}
    gathered = hvd.allgather(tensor.detach().unsqueeze(0), name=f"check.{what}", **kwargs)
    for rank, other in enumerate(gathered):
        assert torch.equal(other, gathered[0]), f"{what}: rank {rank} differs from rank 0"


def mlp(seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16, bias=bias), nn.Tanh(), nn.Linear(16, 6, bias=bias))


def mlp_loss(model, rank, step):
    x = torch.randn(8, 12, generator=generator(rank, step))
    return model(x).pow(2).mean()


def done(case):
    print(f"OK {case} {hvd.rank()}", flush=True)


# ------------------------------------------------- 1. a frozen integer parameter
class IndexedModel(nn.Module):
    """``a`` is an int32 index that can never have a gradient; ``b`` is trained."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
        self.b = nn.Parameter(torch.rand(4))

    def forward(self, x):
        return torch.index_select(self.b, 0, self.a.long()) * x


def case_frozen_int():
    rank = hvd.rank()
    model = IndexedModel(seed=rank)                  # b differs until broadcast
    # No weight decay: the state-initializing step with a zero gradient, run
    # with each rank's own lr, then leaves b as broadcast.
    inner = torch.optim.SGD(model.parameters(), lr=0.01 * (rank + 1), momentum=0.9,
                            nesterov=True)
    opt = hvd_acp.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    assert list(opt.reducer.params) == ["b"], list(opt.reducer.params)
    assert opt.parameter_names[model.a] == "a"

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    # As with Horovod: the state was initialized with a zero gradient for b
    # only, without a compressed all-reduce, and rank 0's state and options won.
    assert model.a.grad is None
    assert model.b.grad is not None and torch.count_nonzero(model.b.grad) == 0
    assert opt.comm_stats.allreduces == 0, opt.comm_stats
    assert opt.param_groups[0]["lr"] == 0.01, opt.param_groups[0]["lr"]
    assert_identical_on_every_rank(model.b, "b after broadcast")
    assert_identical_on_every_rank(inner.state[model.b]["momentum_buffer"], "momentum")
    assert model.a not in inner.state

    for step in range(4):
        x = torch.randn(2, generator=generator(rank, step))
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        assert model.a.grad is None
        opt.step()
    assert torch.equal(model.a, torch.tensor([1, 3], dtype=torch.int32))
    assert_identical_on_every_rank(model.b, "b after training")
    assert opt.step_count == 4
    done("frozen_int")


# --------------------------------------- 2. step() after synchronize(): a warning
def case_step_warning():
    model = mlp()
    opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(),
                                       matrix_rank=2)
    for step in range(4):
        # Taken before the forward pass, where the parameters are the weights
        # the update applies to (whatever a forward may do to them).
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        mlp_loss(model, hvd.rank(), step).backward()
        opt.synchronize()
        sent = opt.comm_stats.allreduces
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        clipped = [p.grad.clone() for p in model.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in clipped]))
        assert norm <= 0.05 * (1 + 1e-5), norm
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if step % 2:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        if step % 2:
            assert messages == [], messages
        else:
            assert len(messages) == 1, messages
            assert messages[0].startswith("optimizer.step() called without "
                                          "optimizer.skip_synchronize() context after "
                                          "optimizer.synchronize()"), messages[0]
        # Either way the clipped gradient was applied, nothing was sent again.
        assert opt.comm_stats.allreduces == sent, (opt.comm_stats.allreduces, sent)
        for p, g, old in zip(model.parameters(), clipped, before):
            assert torch.equal(p.grad, g)
            assert_close(old - p.detach(), 0.5 * g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.zero_grad()
        mlp_loss(model, hvd.rank(), 9).backward()
        opt.step()                                   # the usual loop: no warning
    assert [w for w in caught if issubclass(w.category, UserWarning)] == []
    assert opt.step_count == 5
    assert_identical_on_every_rank(flat(model), "parameters")
    done("step_warning")


# ---------------------------------------------- 3. generated parameter names
def two_groups(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(1, 6, 3), nn.ReLU(), nn.Conv2d(6, 2, 3))
    groups = [{"params": list(model[0].parameters()), "lr": 0.1},
              {"params": list(model[2].parameters()), "lr": 0.05}]
    return model, groups


def case_parameter_names():
    model, groups = two_groups()
    opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(groups), matrix_rank=2)
    ref_model, ref_groups = two_groups()
    ref = hvd.DistributedOptimizer(torch.optim.SGD(ref_groups))

    names = opt._parameter_names
    assert isinstance(names, dict) and len(names) == 4, names
    for group, ref_group in zip(opt.param_groups, ref.param_groups):
        for p, ref_p in zip(group["params"], ref_group["params"]):
            assert names[p] == ref._parameter_names[ref_p], (names[p], ref._parameter_names)
    assert list(names.values()) == list(ref._parameter_names.values())
    assert sorted(names.values()) == ["allreduce.noname.0.0", "allreduce.noname.0.1",
                                      "allreduce.noname.1.0", "allreduce.noname.1.1"]
    assert names[model[2].weight] == "allreduce.noname.1.0"
    assert opt.parameter_names == names and opt.parameter_names is not names
    assert set(opt.reducer.params) == set(names.values())
    everyone = hvd.allgather_object(sorted(names.values()))
    assert all(other == everyone[0] for other in everyone), everyone

    for step in range(3):
        x = torch.randn(2, 1, 7, 7, generator=generator(hvd.rank(), step))
        for o, m in ((opt, model), (ref, ref_model)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    assert_identical_on_every_rank(flat(model), "parameters")
    done("parameter_names")


# ---------------------------------------------------------- 4. sparse gradients
def embedding(seed=0):
    torch.manual_seed(seed)
    return nn.Embedding(10, 3, sparse=True)


def indices(rank, step):
    return torch.randint(0, 10, (5,), generator=generator(rank, step, salt=4))


def expected_embedding_grad(step):
    """The average over ranks of d/dW sum(emb(idx)): row counts, dense."""
    counts = sum(torch.bincount(indices(rank, step), minlength=10).float()
                 for rank in range(hvd.size()))
    return (counts / hvd.size()).unsqueeze(1).expand(10, 3)


def compare_sparse_with_horovod(sparse_as_dense, steps=4):
    ours, ref = embedding(), embedding()
    opt = hvd_acp.DistributedOptimizer(torch.optim.SparseAdam(ours.parameters(), lr=0.1),
                                       named_parameters=ours.named_parameters(),
                                       sparse_as_dense=sparse_as_dense,
                                       min_compression_rate=4.0)    # (10 x 3): whole
    ref_opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(ref.parameters(), lr=0.1),
                                       named_parameters=[("ref.weight", ref.weight)],
                                       sparse_as_dense=sparse_as_dense)
    assert not opt.reducer.layouts["weight"].compressed
    for step in range(steps):
        idx = indices(hvd.rank(), step)
        for o, m in ((opt, ours), (ref_opt, ref)):
            o.zero_grad()
            m(idx).sum().backward()
        opt.synchronize()
        grad = ours.weight.grad
        assert grad.is_sparse, f"sparse_as_dense={sparse_as_dense}: dense gradient handed back"
        assert_close(grad.to_dense(), expected_embedding_grad(step))
        with opt.skip_synchronize():
            opt.step()
        ref_opt.step()
        assert_close(ours.weight, ref.weight, rtol=1e-6, atol=1e-7)
    assert_identical_on_every_rank(ours.weight, f"embedding, sparse_as_dense={sparse_as_dense}")
    opt.close()


class Tagger(nn.Module):
    """A sparse embedding in front of dense, compressed layers."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(30, 16, sparse=True)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, idx):
        return self.fc2(torch.tanh(self.fc1(self.emb(idx))))


def tagger_loss(model, rank, step, part=None):
    g = generator(rank, step, salt=5)
    idx, y = torch.randint(0, 30, (8,), generator=g), torch.randint(0, 4, (8,), generator=g)
    if part is not None:
        idx, y = idx[4 * part:4 * part + 4], y[4 * part:4 * part + 4]
    return F.cross_entropy(model(idx), y)


def case_sparse():
    compare_sparse_with_horovod(sparse_as_dense=True)
    compare_sparse_with_horovod(sparse_as_dense=False)

    # Next to compressed layers, with gradient accumulation: two half
    # batches accumulate to one whole batch, sparse gradients included.
    whole, halves = Tagger(), Tagger()
    kwargs = dict(matrix_rank=2, min_compression_rate=1)
    opt_whole = hvd_acp.DistributedOptimizer(torch.optim.SGD(whole.parameters(), lr=0.2),
                                             whole.named_parameters(), **kwargs)
    opt_halves = hvd_acp.DistributedOptimizer(torch.optim.SGD(halves.parameters(), lr=0.2),
                                              halves.named_parameters(),
                                              backward_passes_per_step=2, **kwargs)
    assert opt_whole.reducer.layouts["fc1.weight"].compressed
    for step in range(6):
        opt_whole.zero_grad()
        tagger_loss(whole, hvd.rank(), step).backward()
        opt_whole.step()
        opt_halves.zero_grad()
        for part in range(2):
            (tagger_loss(halves, hvd.rank(), step, part) / 2).backward()
        opt_halves.step()
        assert whole.emb.weight.grad.is_sparse and halves.emb.weight.grad.is_sparse
    assert_close(flat(halves), flat(whole), rtol=1e-5, atol=1e-6)
    assert opt_halves.comm_stats.allreduces == opt_whole.comm_stats.allreduces
    assert_identical_on_every_rank(flat(whole), "tagger")
    assert_identical_on_every_rank(flat(halves), "tagger, accumulated")

    # Power-SGD takes the same path.
    model = Tagger()
    opt = hvd_acp.PowerSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.2),
                                    model.named_parameters(), **kwargs)
    for step in range(3):
        opt.zero_grad()
        tagger_loss(model, hvd.rank(), step).backward()
        opt.step()
        assert model.emb.weight.grad.is_sparse
    assert_identical_on_every_rank(flat(model), "tagger, Power-SGD")
    done("sparse")


# ----------------------------------------------------- 5. outside the process set
def square(seed=0, width=8):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width, bias=False), nn.Tanh(),
                         nn.Linear(width, width, bias=False))


def square_step(model, opt, step):
    x = torch.randn(4, 8, generator=generator(hvd.rank(), step, salt=6))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


# The process set of a case, made at hvd.init() (see the bottom of the file).
PROCESS_SETS: dict = {}


def case_process_set():
    """Process set [0] of a 2-rank job: rank 1 steps on its own gradients."""
    rank = hvd.rank()
    first = PROCESS_SETS["process_set"]
    ours, ref, local = square(), square(), square()
    # Full rank on square layers: ACP-SGD is exact, so rank 0 can be compared too.
    opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1),
                                       ours.named_parameters(), process_set=first,
                                       matrix_rank=8, min_compression_rate=0)
    ref_opt = hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1),
                                       named_parameters=[(f"ref.{n}", p) for n, p in
                                                         ref.named_parameters()],
                                       process_set=first)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    for step in range(4):
        square_step(ours, opt, step)
        square_step(ref, ref_opt, step)
        square_step(local, local_opt, step)
    opt.sync_compression_state()         # a collective of the set: a no-op on rank 1
    assert_close(flat(ours), flat(ref), rtol=1e-5, atol=1e-6)
    assert_close(flat(ours), flat(local), rtol=1e-5, atol=1e-6)
    if rank == 1:
        assert torch.equal(flat(ours), flat(local)), "rank 1 did not step locally"
        assert opt.comm_stats.allreduces == 0 and not opt.reducer.hooks.handles
        assert opt.step_count == 0
    else:
        assert opt.comm_stats.allreduces > 0 and opt.step_count == 4
    # The job goes on: a global collective still completes on every rank.
    alive = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="check.alive")
    assert alive.item() == hvd.size()
    done("process_set")


def case_process_set_construction():
    """3 ranks, process set [0, 1]: the cross-rank argument check runs over the
    set only, and on rank 2 nothing collective runs at all."""
    rank = hvd.rank()
    pair = PROCESS_SETS["process_set_construction"]

    def build(matrix_rank):
        model = mlp()
        return model, hvd_acp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
            process_set=pair, matrix_rank=matrix_rank)

    # A bad argument on rank 1 raises on ranks 0 and 1; rank 2 is not asked.
    try:
        build(0 if rank == 1 else 2)
    except ValueError as exc:
        assert rank in (0, 1) and "matrix_rank" in str(exc), (rank, exc)
    else:
        assert rank == 2, f"rank {rank} accepted a bad matrix_rank on rank 1"
    # A bad argument on rank 2 alone raises there only, and at once.
    try:
        build(0 if rank == 2 else 2)
    except ValueError as exc:
        assert rank == 2 and "on rank" not in str(exc), (rank, exc)
    else:
        assert rank in (0, 1)

    model, opt = build(2)
    for step in range(4):
        opt.zero_grad()
        mlp_loss(model, rank, step).backward()
        opt.step()
    if rank == 2:
        assert opt.comm_stats.allreduces == 0 and opt.step_count == 0
    else:
        assert_identical_on_every_rank(flat(model), "pair", process_set=pair)
    done("process_set_construction")


# ----------------------------------- the rest of Horovod's optimizer behaviours
def torch_optimizers():
    """Every optimizer of torch.optim but L-BFGS (whose state Horovod cannot broadcast)."""
    found = [(name, cls) for name, cls in vars(torch.optim).items()
             if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
             and cls not in (torch.optim.Optimizer, torch.optim.LBFGS)]
    return sorted(found)


# Rank 0's options and the others'. Options that add state entries (amsgrad,
# centered) are the same on every rank: hvd.broadcast_optimizer_state needs
# the same state structure everywhere.
OPTIONS = [dict(lr=0.02, momentum=0.8, weight_decay=0.01, nesterov=True, centered=True,
                betas=(0.9, 0.99), etas=(0.4, 1.3), step_sizes=(1e-5, 10.0), amsgrad=True),
           dict(lr=0.05, momentum=0.5, weight_decay=0.02, nesterov=False, centered=True,
                betas=(0.8, 0.9), etas=(0.3, 1.6), step_sizes=(1e-6, 5.0), amsgrad=True)]


def options_for(cls, options):
    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in options.items() if k in accepted}


def model_for(cls, seed):
    if cls is torch.optim.SparseAdam:
        return embedding(seed)
    return mlp(seed, bias=cls is not torch.optim.Muon)     # Muon takes matrices only


def loss_for(model, rank, step):
    if isinstance(model, nn.Embedding):
        return model(indices(rank, step)).pow(2).sum()
    return mlp_loss(model, rank, step)


def state_of(opt):
    """Every state entry and option, in parameter order, comparable with ==."""
    entries = []
    for group in opt.param_groups:
        entries.append(sorted((k, type(v).__name__, repr(v)) for k, v in group.items()
                              if k != "params"))
        for p in group["params"]:
            for key, value in sorted(opt.state.get(p, {}).items()):
                entries.append((key, value.clone() if torch.is_tensor(value) else value))
    return entries


def assert_same_state_on_every_rank(opt, what):
    everyone = hvd.allgather_object(state_of(opt))
    for rank, entries in enumerate(everyone):
        assert len(entries) == len(everyone[0]), f"{what}: rank {rank} has other state keys"
        for mine, theirs in zip(entries, everyone[0]):
            if isinstance(mine, tuple) and torch.is_tensor(mine[1]):
                assert mine[0] == theirs[0] and torch.equal(mine[1], theirs[1]), \
                    f"{what}: state {mine[0]!r} differs on rank {rank}"
            else:
                assert mine == theirs, f"{what}: rank {rank}: {mine} != {theirs}"


def case_broadcast_state():
    """Every torch optimizer, with options that differ per rank until broadcast."""
    rank = hvd.rank()
    checked = []
    for name, cls in torch_optimizers():
        model = model_for(cls, seed=rank)
        inner = cls(model.parameters(), **options_for(cls, OPTIONS[rank % 2]))
        opt = hvd_acp.DistributedOptimizer(inner, model.named_parameters(), matrix_rank=2,
                                           min_compression_rate=1)
        # A fresh optimizer: its state is initialized without an ACP all-reduce.
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        assert opt.comm_stats.allreduces == 0, (name, opt.comm_stats)
        for step in range(2):
            opt.zero_grad()
            loss_for(model, rank, step).backward()
            opt.step()
        # Make this rank's model, state and options its own, then broadcast.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * (rank + 1))
            for p_state in inner.state.values():
                for key, value in p_state.items():
                    if torch.is_tensor(value) and value.is_floating_point() and key != "step":
                        value.mul_(1 + 0.1 * rank)
        for group in opt.param_groups:
            group.update(options_for(cls, OPTIONS[rank % 2]))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        expected = options_for(cls, OPTIONS[0])
        for key, value in expected.items():
            actual = opt.param_groups[0][key]
            assert type(actual) is type(value) and actual == value, (name, key, actual)
            if isinstance(value, tuple):
                assert all(type(a) is type(v) for a, v in zip(actual, value)), (name, key)
        stateful = len(inner.state)
        assert stateful in (0, len(list(model.parameters()))), (name, stateful)
        assert_same_state_on_every_rank(opt, name)
        # The broadcast options work with the ops, and replicas stay identical.
        for step in range(2, 4):
            opt.zero_grad()
            loss_for(model, rank, step).backward()
            opt.step()
        assert_identical_on_every_rank(flat(model), name)
        assert_same_state_on_every_rank(opt, name + " after training")
        opt.close()
        checked.append(name)
    assert {"SGD", "Adam", "AdamW", "SparseAdam", "RMSprop", "Rprop"} <= set(checked), checked
    print(f"BROADCAST {rank} {','.join(checked)}", flush=True)
    done("broadcast_state")


def case_names_and_requires_grad():
    """Duplicate and missing names raise on every rank; requires_grad can change."""
    model = mlp()

    def expect_value_error(named, match):
        try:
            hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named)
        except ValueError as exc:
            assert match in str(exc), exc
        else:
            raise AssertionError(f"no ValueError for {match!r} on rank {hvd.rank()}")

    params = list(model.named_parameters())
    expect_value_error([("same", p) for _, p in params], "must be unique")
    expect_value_error(params[:-1], "not named")
    # Only rank 1 names them wrongly: every rank raises instead of hanging.
    expect_value_error(params[:-1] if hvd.rank() == 1 else params, "not named")

    # Frozen when wrapped, trained later; frozen again; a layer toggled each step.
    model = mlp()
    model[0].weight.requires_grad_(False)
    opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), matrix_rank=2)
    frozen = model[0].weight.detach().clone()
    for step in range(9):
        if step == 3:
            model[0].weight.requires_grad_(True)
        if step >= 6:
            model[2].requires_grad_(step % 2 == 0)
        before = model[2].weight.detach().clone()
        opt.zero_grad()
        mlp_loss(model, hvd.rank(), step).backward()
        opt.step()
        if step < 3:
            assert torch.equal(model[0].weight, frozen), "a frozen parameter moved"
        if step >= 6 and step % 2:
            assert torch.equal(model[2].weight, before), "a frozen layer moved"
    assert not torch.equal(model[0].weight, frozen)
    assert opt.step_count == 9
    assert_identical_on_every_rank(flat(model), "requires_grad")
    done("names_and_requires_grad")


if __name__ == "__main__":
    case = sys.argv[1]
    # Process sets are registered at hvd.init() (static), as most jobs do.
    ranks = {"process_set": [0], "process_set_construction": [0, 1]}.get(case)
    if ranks is not None:
        PROCESS_SETS[case] = hvd.ProcessSet(ranks)
    hvd.init(process_sets=list(PROCESS_SETS.values()))
    globals()[f"case_{case}"]()
    hvd.barrier()   # no rank shuts Horovod down while another still works
