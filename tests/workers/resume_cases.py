"""The checkpoint patterns users have, under horovodrun --gloo.

Usage: resume_cases.py DIR CASE [CASE ...]. Each case trains a small MLP for
``TOTAL`` steps without interruption, then again with a checkpoint taken at
step ``k`` and a new model and optimizer resumed from it the way the pattern
does (a new job, in this process: the first optimizer is closed). Each rank
prints ``OK <case> <rank> <measurements>`` when every assertion held on it.

The data are one global batch per step, sliced between the ranks, so that
the averaged gradient and the uninterrupted trajectory do not depend on the
world size (up to step-ahead's per-rank shift); the evaluation loss is taken
on a fixed batch, identical on every rank.

Cases (k is the saved step count):

- ``per_rank``: every rank saves and loads its own file: bit for bit.
- ``rank0_file``: rank 0 saves, every rank loads rank 0's file (default
  arguments): rank 0 keeps its residual, the others start from zero.
- ``broadcast``: Horovod's ImageNet example, rank 0 loads, then
  ``hvd.broadcast_parameters`` and ``hvd.broadcast_optimizer_state``; odd and
  even k, SGD with momentum, SGD without state, Adam (both factors every
  step, its default), two backward passes per step. It must leave exactly the state of ``rank0_file`` (same bits).
- ``warmup``: checkpoints during the warm-up and right after it.
- ``rank0_only``: rank 0 loads and nobody broadcasts: every rank raises.
- ``save_world`` / ``resume_world``: save at one world size (per-rank and
  rank-0 files), resume at another (two launches).
"""
import argparse
import json
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_acp

torch.set_num_threads(1)

TOTAL = 16
GLOBAL_BATCH = 48
TEACHER = torch.randn(16, 6, generator=torch.Generator().manual_seed(99))
#: Relative difference of the final evaluation loss allowed between a run
#: resumed from rank 0's checkpoint and the uninterrupted run.
LOSS_TOLERANCE = 0.05


def global_batch(step, n=GLOBAL_BATCH):
    g = torch.Generator().manual_seed(5000 + step)
    x = torch.randn(n, 16, generator=g)
    return x, (x @ TEACHER).argmax(dim=1)


def my_slice(step):
    x, y = global_batch(step)
    per = GLOBAL_BATCH // hvd.size()
    lo = hvd.rank() * per
    return x[lo:lo + per], y[lo:lo + per]


EVAL = global_batch(10_000, n=256)


def mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 6))


def make(seed, kind="sgd", bpps=1, warmup=0):
    model = mlp(seed)
    if kind == "adam":
        base = torch.optim.Adam(model.parameters(), lr=3e-3)
    else:
        base = torch.optim.SGD(model.parameters(), lr=0.1,
                               momentum=0.0 if kind == "sgd0" else 0.9)
    opt = hvd_acp.DistributedOptimizer(base, model.named_parameters(), matrix_rank=2,
                                       backward_passes_per_step=bpps, warmup_steps=warmup)
    return model, opt


def train(model, opt, start, stop, bpps=1):
    for step in range(start, stop):
        x, y = my_slice(step)
        opt.zero_grad()
        for part in range(bpps):
            n = len(x) // bpps
            loss = F.cross_entropy(model(x[part * n:(part + 1) * n]), y[part * n:(part + 1) * n])
            (loss / bpps).backward()
        opt.step()


def eval_loss(model):
    with torch.no_grad():
        return float(F.cross_entropy(model(EVAL[0]), EVAL[1]))


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def assert_identical_on_every_rank(tensor, what):
    gathered = hvd.allgather(tensor.unsqueeze(0), name=f"check.{what}")
    for other in gathered:
        assert torch.equal(other, gathered[0]), f"replicas differ: {what}"


def save(directory, tag, model, opt):
    """Every rank's file (``<tag>.<rank>.pt``); rank 0's is the one shared."""
    path = os.path.join(directory, f"{tag}.{hvd.rank()}.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    hvd.allreduce(torch.zeros(1), name=f"saved.{tag}")          # barrier
    return path


def load(path, model, opt):
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    return checkpoint


def report(case, **measured):
    text = " ".join(f"{k}={v}" for k, v in measured.items())
    print(f"OK {case} {hvd.rank()} {text}".rstrip(), flush=True)


class Run:
    """The uninterrupted run and the checkpoint at step k of one setting."""

    def __init__(self, directory, k, kind="sgd", bpps=1, warmup=0):
        self.kind, self.bpps, self.warmup, self.k = kind, bpps, warmup, k
        model, opt = make(0, kind, bpps, warmup)
        train(model, opt, 0, k, bpps)
        self.tag = f"ckpt_{kind}_b{bpps}_w{warmup}_k{k}"
        self.path = save(directory, self.tag, model, opt)
        self.rank0_path = os.path.join(directory, f"{self.tag}.0.pt")
        self.saved_errors = {n: e.clone() for n, e in opt.reducer.errors.items()}
        train(model, opt, k, TOTAL, bpps)
        self.final = flat(model)
        self.loss = eval_loss(model)
        opt.close()

    def fresh(self, seed):
        return make(seed, self.kind, self.bpps, self.warmup)

    def finish(self, model, opt):
        train(model, opt, self.k, TOTAL, self.bpps)
        return flat(model), eval_loss(model)

    def within_tolerance(self, loss, what):
        gap = abs(loss - self.loss) / self.loss
        assert gap <= LOSS_TOLERANCE, (
            f"{what}: eval loss {loss:.5f} vs uninterrupted {self.loss:.5f} "
            f"({100 * gap:.2f}% > {100 * LOSS_TOLERANCE:.0f}%)")
        return gap


def case_per_rank(directory, k=7, **setting):
    run = Run(directory, k, **setting)
    model, opt = run.fresh(seed=11)
    load(run.path, model, opt)
    assert opt.step_count == k
    final, loss = run.finish(model, opt)
    assert torch.equal(final, run.final), "per-rank resume left the uninterrupted trajectory"
    assert_identical_on_every_rank(final, "per_rank")
    opt.close()
    return {"loss_gap": 0.0}


def resume_from_rank0_file(run):
    """Every rank loads rank 0's file with default arguments."""
    model, opt = run.fresh(seed=12)
    load(run.rank0_path, model, opt)
    assert opt.step_count == run.k
    for name, error in opt.reducer.errors.items():
        if hvd.rank() == 0:
            assert torch.equal(error, run.saved_errors[name]), "rank 0 lost its residual"
        else:
            assert not error.any(), f"rank {hvd.rank()} installed rank 0's residual"
    return model, opt


def case_rank0_file(directory, k=7, **setting):
    run = Run(directory, k, **setting)
    model, opt = resume_from_rank0_file(run)
    final, loss = run.finish(model, opt)
    assert_identical_on_every_rank(final, "rank0_file")
    opt.close()
    return {"loss_gap": f"{run.within_tolerance(loss, 'rank0_file'):.4f}"}


def resume_by_broadcast(run):
    """Horovod's ImageNet example: rank 0 loads, then the two broadcasts."""
    model, opt = run.fresh(seed=13 + hvd.rank())
    if hvd.rank() == 0:
        load(run.rank0_path, model, opt)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.step_count == run.k and opt.phase is hvd_acp.compression.phase_of(
        run.k, run.warmup, opt.settings.both_factors), (opt.step_count, opt.phase)
    assert opt.comm_stats.allreduces == 0     # the broadcast ran no ACP-SGD step
    for name, error in opt.reducer.errors.items():
        if hvd.rank() == 0:
            assert torch.equal(error, run.saved_errors[name]), "root lost its residual"
        else:
            assert not error.any()
    return model, opt


def case_broadcast(directory, k=7, **setting):
    run = Run(directory, k, **setting)
    model, opt = resume_by_broadcast(run)
    state = opt.state_dict()
    factors = torch.cat([torch.cat([e["P"].reshape(-1), e["Q"].reshape(-1)])
                         for e in state["hvd_acp"]["params"].values()])
    assert_identical_on_every_rank(factors, f"factors.{run.tag}")
    final, loss = run.finish(model, opt)
    assert_identical_on_every_rank(final, f"broadcast.{run.tag}")
    owed = sum(float(e.abs().sum()) for e in run.saved_errors.values())
    if float(hvd.allreduce(torch.tensor([owed]), op=hvd.Sum, name=f"owed.{run.tag}")) == 0:
        # No rank owed anything at the checkpoint (warm-up): nothing was lost.
        assert torch.equal(final, run.final), "a resume with no residual left the trajectory"
    opt.close()
    # Loading rank 0's file everywhere leaves the same state: the same bits.
    model2, opt2 = resume_from_rank0_file(run)
    final2, _ = run.finish(model2, opt2)
    assert torch.equal(final, final2), "broadcast and rank-0 file resumes differ"
    opt2.close()
    return {"loss_gap": f"{run.within_tolerance(loss, 'broadcast'):.4f}"}


def case_rank0_only(directory, k=7):
    """Rank 0 loads and nobody broadcasts: a clear error on every rank."""
    run = Run(directory, k)
    model, opt = run.fresh(seed=14)
    if hvd.rank() == 0:
        load(run.rank0_path, model, opt)
    x, y = my_slice(k)
    try:
        F.cross_entropy(model(x), y).backward()
    except RuntimeError as exc:
        assert "different compression states" in str(exc), exc
        assert "broadcast_optimizer_state" in str(exc), exc
    else:
        raise AssertionError("ranks in different states trained on")
    opt.close()
    return {}


def case_save_world(directory):
    """First launch of a world-size change: per-rank and rank-0 files at step 7."""
    model, opt = make(0)
    train(model, opt, 0, 7)
    save(directory, "world", model, opt)
    train(model, opt, 7, TOTAL)
    if hvd.rank() == 0:
        with open(os.path.join(directory, "world.json"), "w") as f:
            json.dump({"size": hvd.size(), "loss": eval_loss(model)}, f)
    opt.close()
    return {}


def case_resume_world(directory):
    """Second launch at another world size: rank 0's file, by broadcast and
    loaded everywhere (the same state); each rank's own file where it has one."""
    with open(os.path.join(directory, "world.json")) as f:
        saved = json.load(f)
    assert saved["size"] != hvd.size()
    rank0 = os.path.join(directory, "world.0.pt")
    finals = []
    for pattern in ("broadcast", "rank0_file"):
        model, opt = make(20 + hvd.rank())
        if pattern == "rank0_file" or hvd.rank() == 0:
            load(rank0, model, opt)
        if pattern == "broadcast":
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        assert opt.step_count == 7
        train(model, opt, 7, TOTAL)
        finals.append(flat(model))
        assert_identical_on_every_rank(finals[-1], f"world.{pattern}")
        loss = eval_loss(model)
        gap = abs(loss - saved["loss"]) / saved["loss"]
        assert gap <= LOSS_TOLERANCE, (pattern, loss, saved["loss"])
        opt.close()
    assert torch.equal(finals[0], finals[1])
    # Per-rank files: ranks that have one resume from it (their residual
    # kept), the others from rank 0's (theirs from zero).
    own = os.path.join(directory, f"world.{hvd.rank()}.pt")
    model, opt = make(30)
    load(own if os.path.exists(own) else rank0, model, opt)
    errors_kept = any(e.any() for e in opt.reducer.errors.values())
    assert errors_kept == os.path.exists(own), (hvd.rank(), errors_kept)
    train(model, opt, 7, TOTAL)
    assert_identical_on_every_rank(flat(model), "world.per_rank")
    opt.close()
    return {"loss_gap": f"{gap:.4f}", "from": saved["size"]}


SETTINGS = {
    # name: (case, kwargs)
    "per_rank": (case_per_rank, {}),
    "per_rank_adam": (case_per_rank, {"kind": "adam"}),
    "rank0_file": (case_rank0_file, {}),
    "broadcast_odd": (case_broadcast, {"k": 7}),
    "broadcast_even": (case_broadcast, {"k": 8}),
    "broadcast_stateless": (case_broadcast, {"k": 7, "kind": "sgd0"}),
    "broadcast_adam": (case_broadcast, {"k": 7, "kind": "adam"}),
    "broadcast_accumulation": (case_broadcast, {"k": 5, "bpps": 2}),
    "warmup_during": (case_broadcast, {"k": 3, "warmup": 4}),
    "warmup_after": (case_broadcast, {"k": 4, "warmup": 4}),
    "warmup_per_rank": (case_per_rank, {"k": 3, "warmup": 4}),
    "rank0_only": (case_rank0_only, {}),
    "save_world": (case_save_world, {}),
    "resume_world": (case_resume_world, {}),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("cases", nargs="+", choices=sorted(SETTINGS))
    args = parser.parse_args()
    hvd.init()
    for name in args.cases:
        case, kwargs = SETTINGS[name]
        report(name, **(case(args.dir, **kwargs) or {}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
