"""Mixed precision with the real ``torch.amp.GradScaler("cpu")``, under
``horovodrun --gloo`` (the Horovod front ends) or ``torchrun`` (the DDP hook).

Usage: ``amp_cases.py FRONT_END CASE`` with FRONT_END ``acp``, ``acp-int8``
or ``ddp-int8`` (``int8_factors=True``), ``powersgd``,
``diloco``, ``demo``, ``tsr`` (horovodrun) or ``ddp`` (torchrun). Each rank prints
``OK <case> <rank>`` when every assertion held.

- ``constant``: a constant power-of-two scale (growth off) and fp32 on the
  wire: the run under the scaler is the unscaled run, bit for bit, at
  default step-ahead, for SGD and AdamW.
- ``dynamic``: the default dynamic scale (growth on, every 3 steps here) and
  an overflow on one rank at one step: every rank skips that step, the
  weights after it are the true weights before it, the replicas stay
  identical and training goes on.
- ``overflow`` (the baselines, which communicate inside ``step()``): an
  overflow on one rank, under the guide's pattern and under a plain
  ``scaler.step(opt)``: every rank skips that step (none waits in a
  collective the other skipped), and the replicas end identical.
"""
import sys

import torch
import torch.nn.functional as F

from worker_io import report

torch.set_num_threads(1)
FRONT_END, CASE = sys.argv[1], sys.argv[2]
#: ``acp-int8`` and ``ddp-int8``: the front end with ``int8_factors=True``.
INT8 = FRONT_END.endswith("-int8")
FRONT_END = FRONT_END.removesuffix("-int8")
TEACHER = torch.randn(12, 5, generator=torch.Generator().manual_seed(99))

if FRONT_END == "ddp":
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvd_acp.ddp
    from hvd_acp.comm import leave_process_group

    dist.init_process_group("gloo")
    RANK = dist.get_rank()
else:
    import horovod.torch as hvd

    import hvd_acp

    hvd.init()
    RANK = hvd.rank()


def batch(rank, step, n=8):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(n, 12, generator=g)
    return x, (x @ TEACHER).argmax(dim=1)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 5))


def inner(params, optimizer):
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def flat(params):
    return torch.cat([p.detach().reshape(-1).double() for p in params])


def gathered(tensor):
    if FRONT_END == "ddp":
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(out, tensor)
        return out
    return list(hvd.allgather(tensor.unsqueeze(0)))


def assert_replicas_identical(tensor):
    for other in gathered(tensor):
        assert torch.equal(other, tensor), "replicas diverged"


class Run:
    """One model trained by the front end under test, with or without a scaler."""

    def __init__(self, optimizer, scaler, **settings):
        module = mlp()
        if INT8:
            settings["int8_factors"] = True
        self.scaler = scaler
        if FRONT_END == "ddp":
            self.model = DDP(module)
            self.opt = inner(self.model.parameters(), optimizer)
            self.state = hvd_acp.ddp.ACPState(named_parameters=module.named_parameters(),
                                              optimizer=self.opt, matrix_rank=2, **settings)
            self.model.register_comm_hook(self.state, hvd_acp.ddp.acp_hook)
        elif FRONT_END in ("diloco", "demo", "tsr"):
            self.model = module
            base = inner(module.parameters(), optimizer)
            named = module.named_parameters()
            self.opt = (hvd_acp.DiLoCoOptimizer(base, named, inner_steps=4)
                        if FRONT_END == "diloco"
                        else hvd_acp.DeMoOptimizer(base, named) if FRONT_END == "demo"
                        else hvd_acp.TSROptimizer(base, named, core_rank=2, refresh_period=3))
        else:
            self.model = module
            cls = (hvd_acp.PowerSGDOptimizer if FRONT_END == "powersgd"
                   else hvd_acp.DistributedOptimizer)
            if "fp16_wire" in settings:
                wire = settings.pop("fp16_wire")
                settings["compression"] = hvd.Compression.fp16 if wire else hvd.Compression.none
            self.opt = cls(inner(module.parameters(), optimizer),
                           named_parameters=module.named_parameters(), matrix_rank=2,
                           **settings)
        self.params = list(module.parameters())

    def step(self, step, overflow=False, plain=False):
        """One step of the pattern each front end documents (``plain``:
        ``scaler.step(opt)`` straight after backward); returns the loss."""
        x, y = batch(RANK, step)
        self.opt.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        scaled = loss if self.scaler is None else self.scaler.scale(loss)
        if overflow:
            scaled = scaled * float("inf")
        scaled.backward()
        if self.scaler is None:
            self.opt.step()
        elif FRONT_END == "ddp" or plain:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.synchronize()
            self.scaler.unscale_(self.opt)
            with self.opt.skip_synchronize():
                self.scaler.step(self.opt)
            self.scaler.update()
        return float(loss.detach())

    def close(self):
        (self.state if FRONT_END == "ddp" else self.opt).close()

    def global_weights(self):
        """The weights every replica shares (DiLoCo's last outer step's)."""
        if FRONT_END != "diloco":
            return flat(self.params)
        with self.opt.global_weights():
            return flat(self.params)


def case_constant():
    for optimizer in ("sgd", "adamw"):
        plain = Run(optimizer, None, fp16_wire=False)
        scaled = Run(optimizer, torch.amp.GradScaler("cpu", init_scale=2.0 ** 12,
                                                     growth_interval=10 ** 6),
                     fp16_wire=False)
        for step in range(12):
            losses = plain.step(step), scaled.step(step)
            assert losses[0] == losses[1], (optimizer, step, losses)
        assert scaled.scaler.get_scale() == 2.0 ** 12
        assert torch.equal(flat(scaled.params), flat(plain.params)), optimizer
        assert_replicas_identical(flat(scaled.params))
        plain.close()
        scaled.close()


def case_dynamic():
    for optimizer in ("sgd", "adamw"):
        run = Run(optimizer, torch.amp.GradScaler("cpu", growth_interval=3))
        losses, skipped = [], []
        for step in range(24):
            before = flat(run.params)
            scale = run.scaler.get_scale()
            losses.append(run.step(step, overflow=step == 10 and RANK == 1))
            if run.scaler.get_scale() < scale:
                skipped.append(step)
                # The skipped step leaves the true weights, not the shifted ones.
                assert torch.equal(flat(run.params), before), (optimizer, step)
            assert torch.isfinite(flat(run.params)).all(), (optimizer, step)
            assert_replicas_identical(flat(run.params))
        # Every rank skipped the overflowing step. With fp16 on the wire (the
        # AdamW defaults) the growing scale also overflows fp16's range now
        # and then, and the scaler backs off, on every rank alike.
        assert 10 in skipped, (optimizer, skipped)
        if optimizer == "sgd":
            assert skipped == [10], skipped
        marks = torch.zeros(24)
        marks[skipped] = 1
        assert_replicas_identical(marks)
        assert sum(losses[-4:]) < sum(losses[:4]), (optimizer, losses)
        run.close()


def case_overflow():
    for plain in (False, True):
        run = Run("adamw", torch.amp.GradScaler("cpu", growth_interval=10 ** 6))
        losses = []
        for step in range(14):
            scale = run.scaler.get_scale()
            losses.append(run.step(step, overflow=step == 2 and RANK == 1, plain=plain))
            assert (run.scaler.get_scale() < scale) == (step == 2), (plain, step)
        assert run.opt.overflow.overflows == 1
        if FRONT_END == "diloco":
            run.opt.outer_step()
        assert torch.isfinite(run.global_weights()).all()
        assert_replicas_identical(run.global_weights())
        assert sum(losses[-3:]) < sum(losses[:3]), losses
        run.close()


try:
    {"constant": case_constant, "dynamic": case_dynamic, "overflow": case_overflow}[CASE]()
    report(f"OK {CASE} {RANK}")
finally:
    if FRONT_END == "ddp":
        leave_process_group()
