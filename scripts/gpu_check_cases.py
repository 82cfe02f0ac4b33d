"""The checks of ``scripts/gpu_check.sh``, one per invocation.

Usage::

    python scripts/gpu_check_cases.py maths --device cuda
    horovodrun -np N -H localhost:N --gloo python scripts/gpu_check_cases.py replicas \\
        --device cuda --comm nccl
    horovodrun ... python scripts/gpu_check_cases.py swap --device cuda --comm host
    torchrun --standalone --nproc-per-node N scripts/gpu_check_cases.py ddp \\
        --device cuda --backend nccl

``scripts/gpu_check.py`` launches each one in its own process group with a
timeout. A check that holds exits 0 and rank 0 prints one line
``DETAIL <what was measured>``; a check that fails raises (the launcher then
exits non-zero). Checks that compare ranks gather first, so every rank
reaches the same verdict and none is left waiting in a collective.

``--comm`` says how Horovod sees the CUDA tensors: ``direct`` hands them to
Horovod as they are (NCCL, or Gloo for CPU tensors); ``host`` copies every
collective's tensors to the host and back, so Horovod's Gloo all-reduces
them (two ranks sharing one GPU cannot use NCCL, and a Horovod built without
GPU operations reduces host tensors only). The compression itself runs on
the device either way.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
from typing import Callable, Dict, List

import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hvd_acp  # noqa: E402
from hvd_acp.comm import HorovodCommunicator  # noqa: E402
from hvd_acp.compression import Phase, orthonormalize_  # noqa: E402

F64 = torch.float64


# ------------------------------------------------------------------ helpers
def pick_device(kind: str, local_rank: int) -> torch.device:
    """``cpu``, or the CUDA device of ``local_rank`` (ranks share devices
    round-robin when there are more ranks than devices)."""
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"--device cuda, but torch {torch.__version__} sees no CUDA device")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def generator(rank: int, step: int, salt: int = 0) -> torch.Generator:
    """Inputs of ``rank`` at ``step``: any rank can regenerate any rank's."""
    return torch.Generator().manual_seed(100_003 * rank + 1_009 * salt + step)


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64, on the CPU."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    scale = float(expected.norm())
    return float((actual - expected).norm()) / (scale if scale > 0 else 1.0)


def digest(named: Dict[str, Tensor]) -> str:
    """SHA-256 of the bytes of ``named`` tensors (bit-identical replicas
    have equal digests)."""
    h = hashlib.sha256()
    for name in sorted(named):
        h.update(name.encode())
        h.update(named[name].detach().cpu().contiguous().reshape(-1)
                 .view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def parameters_of(model: nn.Module) -> Dict[str, Tensor]:
    return dict(model.named_parameters())


def require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def agree(digests: List[str], what: str) -> None:
    """Raise on every rank unless every rank's digest is rank 0's."""
    differing = [rank for rank, d in enumerate(digests) if d != digests[0]]
    require(not differing, f"{what}: ranks {differing} differ from rank 0 (bitwise)")


class ConvNet(nn.Module):
    """Two convolutions and two linear layers: at matrix rank 2 the four
    weights are compressed, the biases travel exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)                  # (8, 27)
        self.conv2 = nn.Conv2d(8, 16, 3)                 # (16, 72)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)             # (32, 256)
        self.fc2 = nn.Linear(32, 10)                     # (10, 32)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


COMPRESSED = ("conv1.weight", "conv2.weight", "fc1.weight", "fc2.weight")


def build_conv(device: torch.device, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return ConvNet().to(device=device, dtype=dtype)


def conv_loss(rank: int, step: int, device: torch.device, dtype=torch.float32):
    g = generator(rank, step)
    x = torch.randn(6, 3, 8, 8, generator=g).to(device=device, dtype=dtype)
    y = torch.randint(0, 10, (6,), generator=g).to(device)
    return lambda model: nn.functional.cross_entropy(model(x), y)


def build_square(device: torch.device, width: int) -> nn.Module:
    """Square float64 layers without biases: at matrix rank ``width`` every
    factor is a full basis, so ACP-SGD is exact S-SGD."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(width, width, bias=False), nn.Tanh(),
                         nn.Linear(width, width, bias=False), nn.Tanh(),
                         nn.Linear(width, width, bias=False)).to(device=device, dtype=F64)


def square_loss(rank: int, step: int, device: torch.device, width: int):
    x = torch.randn(5, width, generator=generator(rank, step, salt=1), dtype=F64).to(device)
    return lambda model: model(x).pow(2).mean()


def gradients(model: nn.Module, loss_fn) -> Dict[str, Tensor]:
    """``loss_fn``'s gradient of every parameter of ``model`` (a plain copy,
    no hooks), keyed by name."""
    model.zero_grad(set_to_none=True)
    loss_fn(model).backward()
    return {name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for name, p in model.named_parameters()}


def average(grads: List[Dict[str, Tensor]]) -> Dict[str, Tensor]:
    return {name: sum(g[name] for g in grads) / len(grads) for name in grads[0]}


def expected_first_step(mean: Dict[str, Tensor], q_init: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """The averaged gradient of ACP-SGD's first step (a P step, no residual
    yet): ``mean(M) Qh Qh^T`` for a compressed matrix, ``mean(M)`` otherwise."""
    expected = dict(mean)
    for name, q in q_init.items():
        qh = q.clone()
        orthonormalize_([qh])
        m = mean[name]
        matrix = m.reshape(m.shape[0], -1).to(qh.dtype)
        expected[name] = (matrix @ qh @ qh.t()).reshape(m.shape).to(m.dtype)
    return expected


def check_first_step(model: nn.Module, expected: Dict[str, Tensor], tol: float) -> float:
    """Largest relative error of ``p.grad`` against ``expected``; raises above ``tol``."""
    worst = 0.0
    for name, p in model.named_parameters():
        error = relative_error(p.grad, expected[name])
        require(error <= tol, f"first averaged gradient of {name}: relative error "
                              f"{error:.2e} > {tol:.0e}")
        worst = max(worst, error)
    return worst


def train_exact_reference(reference: nn.Module, optimizer, losses) -> None:
    """One S-SGD step of ``reference``, averaged here from every rank's loss."""
    mean = average([gradients(reference, loss) for loss in losses])
    for name, p in reference.named_parameters():
        p.grad = mean[name]
    optimizer.step()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 1e-9


# -------------------------------------------------------------- 1. the maths
def maths_run(shapes, dtype, device, steps, seed=0):
    """``steps`` ACP-SGD steps of one rank on ``device`` (P, Q, P, ...):
    per step and shape, the applied gradient G, the residual E and both
    factors, copied to the CPU. Gradients are drawn on the CPU from fixed
    seeds, then moved, so every run sees the same numbers."""
    from hvd_acp.state import CompressionState

    state = CompressionState(matrix_rank=4, min_compression_rate=2.0, warmup_steps=0, seed=seed)
    names = [f"t{i}" for i in range(len(shapes))]
    for name, (shape, grad_dtype) in zip(names, shapes):
        lay = state.add(name, shape, grad_dtype if dtype == torch.float32 else dtype, device)
        require(lay.compressed, f"{name} {shape} should be compressed")
    records = []
    for step in range(steps):
        codec = state.begin_step()
        bases = state.bases(names)
        record = {}
        for index, (name, (shape, grad_dtype)) in enumerate(zip(names, shapes)):
            tensor = state.tensors[name]
            lay = tensor.layout
            # Rounded to the parameter's dtype first: every run sees the same values.
            g = torch.randn(shape, generator=generator(index, step, salt=7), dtype=F64)
            g = g.to(grad_dtype).to(F64)
            g = g.to(device=device, dtype=grad_dtype if dtype == torch.float32 else dtype)
            out = torch.empty(lay.payload_shape(codec), dtype=lay.dtype, device=device)
            tensor.compress_(codec, g, bases[name], out)
            target = torch.empty(lay.n, lay.m, dtype=lay.dtype, device=device)
            tensor.decode_(codec, out, bases[name], target)      # a world of one rank
            record[name] = {"G": target.cpu(), "E": tensor.error.cpu(),
                            "P": tensor.p.cpu(), "Q": tensor.q.cpu()}
        state.end_step()
        records.append(record)
    return records


def signed_alike(actual: Tensor, expected: Tensor) -> Tensor:
    """``actual`` with each column's sign flipped to match ``expected``'s
    (QR factors are unique up to the signs of their columns)."""
    signs = torch.sign((actual.double() * expected.double()).sum(dim=0))
    signs[signs == 0] = 1
    return actual.double() * signs


def case_maths(args) -> None:
    """The per-parameter compression (hvd_acp.state, hvd_acp.compression)
    on ``--device`` against float64 on the CPU; then the Horovod front end in
    one process (LocalCommunicator) on the device against the CPU."""
    device = pick_device(args.device, 0)
    big = not args.quick and device.type == "cuda"
    shapes = [((64, 3, 7, 7), torch.float32), ((256, 1024), torch.float32),
              ((48, 32, 3, 3), torch.bfloat16), ((96, 40), torch.float16)]
    if big:
        shapes += [((512, 512, 3, 3), torch.float32), ((1000, 2048), torch.float32)]
    steps = 4
    reference = maths_run(shapes, F64, torch.device("cpu"), steps)
    worst = {}
    for dtype in (F64, torch.float32):
        measured = maths_run(shapes, dtype, device, steps)
        tol = tolerance(dtype)
        for step, (got, want) in enumerate(zip(measured, reference)):
            for name in got:
                for key in ("G", "E", "P", "Q"):
                    a, b = got[name][key], want[name][key]
                    if key in ("P", "Q"):
                        a = signed_alike(a, b)
                    error = relative_error(a, b)
                    worst[dtype] = max(worst.get(dtype, 0.0), error)
                    require(error <= tol, f"{dtype} on {device}, step {step}, {name} "
                                          f"{shapes[int(name[1:])][0]}: {key} relative error "
                                          f"{error:.2e} > {tol:.0e} against float64 on the CPU")

    # The front end in one process: hooks, fused buffers and step-ahead on
    # the device, against the same optimizer in float64 on the CPU.
    runs = {}
    for key, where, dtype in (("device", device, torch.float32),
                              ("cpu", torch.device("cpu"), F64)):
        model = build_conv(where, dtype)
        opt = hvd_acp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=model.named_parameters(), matrix_rank=2,
            fusion_threshold_bytes=4096, communicator=hvd_acp.LocalCommunicator())
        for step in range(6):
            opt.zero_grad()
            conv_loss(0, step, where, dtype)(model).backward()
            opt.step()
        for name in COMPRESSED:
            factor = opt.reducer.state.tensors[name].p
            require(factor.device == where, f"factor P of {name} is on {factor.device}, "
                                            f"not on {where}")
        runs[key] = parameters_of(model)
        opt.close()
    front = max(relative_error(runs["device"][name], runs["cpu"][name])
                for name in runs["cpu"])
    require(front <= 1e-4, f"DistributedOptimizer (one process) on {device} in float32 "
                           f"against float64 on the CPU after 6 steps: {front:.2e} > 1e-4")
    print(f"DETAIL {len(shapes)} tensors x {steps} steps on {device}: max rel. error "
          f"vs CPU float64 {worst[F64]:.1e} (float64), {worst[torch.float32]:.1e} (float32); "
          f"optimizer in one process, 6 steps: {front:.1e}", flush=True)


# --------------------------------------------- Horovod: helpers per --comm
class HostStagedCommunicator(HorovodCommunicator):
    """Horovod's all-reduce for tensors on a CUDA device through the host:
    each fused buffer is copied to a host tensor, reduced there (Gloo) and
    copied back. Host tensors are copied too, so that ``--device cpu --comm
    host`` runs this same code."""

    def allreduce_async_(self, tensor: Tensor, name: str):
        host = tensor.detach().to("cpu", copy=True)
        return super().allreduce_async_(host, name), host, tensor

    def synchronize(self, handle) -> None:
        inner, host, tensor = handle
        super().synchronize(inner)
        tensor.copy_(host)


def horovod_world(args):
    import horovod.torch as hvd

    hvd.init()
    device = pick_device(args.device, hvd.local_rank())
    return hvd, device


def communicator_kwargs(args) -> dict:
    return {"communicator": HostStagedCommunicator()} if args.comm == "host" else {}


def broadcast_parameters(hvd, module: nn.Module, args) -> None:
    """``hvd.broadcast_parameters`` (direct), or the same through host copies."""
    if args.comm == "direct":
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        return
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            host = tensor.cpu()
            hvd.broadcast_(host, root_rank=0, name=f"gpu_check.broadcast.{name}")
            tensor.copy_(host)


def hvd_agree(hvd, named: Dict[str, Tensor], what: str) -> None:
    agree(hvd.allgather_object(digest(named), name=f"gpu_check.digest.{what}"), what)


# ------------------------------------------- 2. replicas and full-rank exactness
def case_replicas(args) -> None:
    hvd, device = horovod_world(args)
    rank, size = hvd.rank(), hvd.size()
    steps = 6 if args.quick else (20 if device.type == "cuda" else 10)

    # (a) compressed: conv net at matrix rank 2, momentum, step-ahead, several buffers.
    model = build_conv(device)
    opt = hvd_acp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), matrix_rank=2,
        fusion_threshold_bytes=4096, **communicator_kwargs(args))
    broadcast_parameters(hvd, model, args)
    compressed = {n for n, lay in opt.reducer.layouts.items() if lay.compressed}
    require(compressed == set(COMPRESSED), f"compressed parameters: {sorted(compressed)}")
    copy = build_conv(device)
    mean = average([gradients(copy, conv_loss(r, 0, device)) for r in range(size)])
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    phases = []
    first_error = None
    for step in range(steps):
        phases.append(opt.phase)
        opt.zero_grad()
        conv_loss(rank, step, device)(model).backward()
        if step == 0:
            opt.synchronize()
            q_init = {n: opt.reducer.state.tensors[n].q for n in COMPRESSED}
            first_error = check_first_step(model, expected_first_step(mean, q_init), 1e-4)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    require(phases[:4] == [Phase.P, Phase.Q, Phase.P, Phase.Q], f"phases {phases[:4]}")
    for name in COMPRESSED:
        factor = opt.reducer.state.tensors[name].p
        require(factor.device == device, f"factor P of {name} is on {factor.device}")
    for name, p in model.named_parameters():
        require(bool(torch.isfinite(p).all()), f"{name} is not finite")
        require(not torch.equal(p.detach(), initial[name]), f"{name} did not change")
    require(opt.comm_stats.allreduces >= 2 * steps,
            f"only {opt.comm_stats.allreduces} all-reduces in {steps} steps")
    hvd_agree(hvd, parameters_of(model), "replicas")
    opt.close()

    # (b) full rank: square float64 layers, matrix_rank = width, no warm-up.
    width, exact_steps = 16, 6
    model, reference = build_square(device, width), build_square(device, width)
    opt = hvd_acp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(), matrix_rank=width,
        min_compression_rate=0, fusion_threshold_bytes=0, warmup_steps=0,
        **communicator_kwargs(args))
    require(all(lay.compressed and lay.r == width for lay in opt.reducer.layouts.values()),
            "every square layer should be compressed at full rank")
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(exact_steps):
        opt.zero_grad()
        square_loss(rank, step, device, width)(model).backward()
        opt.step()
        train_exact_reference(reference, ref_opt,
                              [square_loss(r, step, device, width) for r in range(size)])
    exact = max(relative_error(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    require(exact <= 1e-10, f"full rank: weights differ from exact S-SGD by {exact:.2e} "
                            "(relative, float64) > 1e-10")
    require(not torch.equal(model[0].weight, build_square(device, width)[0].weight),
            "full-rank model did not train")
    hvd_agree(hvd, parameters_of(model), "full_rank")
    opt.close()
    if rank == 0:
        print(f"DETAIL {size} ranks on {device.type} ({comm_name(args, device)}): replicas "
              f"bit-identical after {steps} steps at matrix rank 2 (first averaged gradient "
              f"{first_error:.1e} from the exact projection); full rank float64 "
              f"{exact:.1e} from exact S-SGD after {exact_steps} steps", flush=True)
    hvd.shutdown()


def comm_name(args, device: torch.device) -> str:
    if args.comm == "host":
        return "Gloo through host copies"
    return "Gloo" if device.type == "cpu" else "NCCL"


# ------------------------------------------------ 3. the one-line swap, ResNet-50
def case_swap(args) -> None:
    from hvd_acp.plan.models import build_model, to_device

    hvd, device = horovod_world(args)
    rank, size = hvd.rank(), hvd.size()
    spec = build_model("resnet50", args.batch_size, image_size=args.image_size, data_seed=rank)
    model = spec.model.to(device)
    batch = to_device(spec.batch, device)

    # As in a user's script: Horovod's line commented out, hvd_acp's below it.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9)
    # optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    optimizer = hvd_acp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             **communicator_kwargs(args))
    broadcast_parameters(hvd, model, args)
    if args.comm == "direct":
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = spec.loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    everyone = hvd.allgather_object(losses, name="gpu_check.losses")
    require(all(math.isfinite(v) for ranks in everyone for v in ranks),
            f"non-finite loss: {everyone}")
    hvd_agree(hvd, parameters_of(model), "resnet50")
    params = sum(p.numel() for p in model.parameters())
    fp32_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * args.steps
    sent = optimizer.comm_stats.bytes_sent
    require(0 < sent < fp32_bytes / 4, f"sent {sent} bytes, S-SGD would send {fp32_bytes}")
    if rank == 0:
        print(f"DETAIL ResNet-50 ({params / 1e6:.1f}M parameters) on {size} ranks, "
              f"{device.type} ({comm_name(args, device)}), batch {args.batch_size} of "
              f"{args.image_size}x{args.image_size} per rank, {args.steps} steps: loss "
              f"{losses[0]:.3f} -> {losses[-1]:.3f}, {fp32_bytes / sent:.0f}x fewer bytes "
              f"than S-SGD, replicas bit-identical", flush=True)
    optimizer.close()
    hvd.shutdown()


# ------------------------------------------------------ 4. the DDP hook, torchrun
def case_ddp(args) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvd_acp.ddp

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(args.device, local_rank)
    dist.init_process_group(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    device_ids = [device.index] if device.type == "cuda" else None
    steps = 6 if args.quick else (20 if device.type == "cuda" else 10)

    def gather(value):
        out = [None] * size
        dist.all_gather_object(out, value)
        return out

    # (a) compressed, step-ahead on, several buckets.
    net = build_conv(device)
    model = DDP(net, device_ids=device_ids, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = hvd_acp.ddp.ACPState(matrix_rank=2, optimizer=opt,
                                 named_parameters=net.named_parameters())
    model.register_comm_hook(state, hvd_acp.ddp.acp_hook)
    copy = build_conv(device)
    mean = average([gradients(copy, conv_loss(r, 0, device)) for r in range(size)])
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}
    phases, first_error = [], None
    for step in range(steps):
        phases.append(state.phase)
        opt.zero_grad()
        conv_loss(rank, step, device)(model).backward()
        if step == 0:
            q_init = {n: state.compression.tensors[n].q for n in COMPRESSED}
            first_error = check_first_step(net, expected_first_step(mean, q_init), 1e-4)
        opt.step()
    require(phases[:4] == [Phase.P, Phase.Q, Phase.P, Phase.Q], f"phases {phases[:4]}")
    for name in COMPRESSED:
        factor = state.compression.tensors[name].p
        require(factor.device == device, f"factor P of {name} is on {factor.device}")
    for name, p in net.named_parameters():
        require(bool(torch.isfinite(p).all()), f"{name} is not finite")
        require(not torch.equal(p.detach(), initial[name]), f"{name} did not change")
    agree(gather(digest(parameters_of(net))), "replicas")
    state.close()

    # (b) full rank: square float64 layers, plain averaging to 1e-10.
    width, exact_steps = 16, 6
    net, reference = build_square(device, width), build_square(device, width)
    model = DDP(net, device_ids=device_ids)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hvd_acp.ddp.ACPState(matrix_rank=width, min_compression_rate=0, step_ahead=0,
                                 named_parameters=net.named_parameters())
    model.register_comm_hook(state, hvd_acp.ddp.acp_hook)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(exact_steps):
        opt.zero_grad()
        square_loss(rank, step, device, width)(model).backward()
        opt.step()
        train_exact_reference(reference, ref_opt,
                              [square_loss(r, step, device, width) for r in range(size)])
    require(all(t.layout.r == width for t in state.compression.tensors.values())
            and len(state.compression.tensors) == 3, "every layer compressed at full rank")
    exact = max(relative_error(p, q) for p, q in zip(net.parameters(), reference.parameters()))
    require(exact <= 1e-10, f"full rank: weights differ from exact averaging by {exact:.2e} "
                            "(relative, float64) > 1e-10")
    agree(gather(digest(parameters_of(net))), "full_rank")
    if rank == 0:
        print(f"DETAIL {size} ranks, torchrun, backend {args.backend} on {device.type}: "
              f"replicas bit-identical after {steps} steps (first averaged gradient "
              f"{first_error:.1e} from the exact projection); full rank float64 {exact:.1e} "
              f"from exact averaging", flush=True)
    from hvd_acp.comm import leave_process_group
    leave_process_group()


# ------------------------------------------- 5. mixed precision, every front end
def amp_front_ends(args):
    """(world, device, [(label, build(model) -> (optimizer, wrapper, state))]) for
    ``--launcher``: Horovod's two optimizers, or the DDP hook."""
    if args.launcher == "horovod":
        hvd, device = horovod_world(args)

        def horovod(cls):
            def build(model):
                broadcast_parameters(hvd, model, args)
                opt = cls(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                          named_parameters=model.named_parameters(), matrix_rank=2,
                          **communicator_kwargs(args))
                return opt, model, opt.reducer.state
            return build
        world = (hvd.rank(), hvd.size(), lambda named, what: hvd_agree(hvd, named, what),
                 hvd.shutdown)
        return world, device, [("DistributedOptimizer", horovod(hvd_acp.DistributedOptimizer)),
                               ("PowerSGDOptimizer", horovod(hvd_acp.PowerSGDOptimizer))]
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hvd_acp.comm import leave_process_group
    from hvd_acp.ddp import ACPState, acp_hook

    device = pick_device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(args.backend)
    size = dist.get_world_size()

    def ddp(model):
        wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                      bucket_cap_mb=0.01)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
        state = ACPState(matrix_rank=2, optimizer=opt, named_parameters=model.named_parameters())
        wrapped.register_comm_hook(state, acp_hook)
        return opt, wrapped, state.compression

    def gathered(named, what):
        out = [None] * size
        dist.all_gather_object(out, digest(named))
        agree(out, what)
    return (dist.get_rank(), size, gathered, leave_process_group), device, [("DDP hook", ddp)]


def amp_train(build, device, rank, steps, scaler, autocast, overflow_at=None):
    """``steps`` steps of the conv net under ``scaler`` (None: none), each
    front end's pattern; returns (model, state, steps the scaler skipped)."""
    model = build_conv(device)
    opt, wrapped, state = build(model)
    horovod = hasattr(opt, "synchronize")
    skipped = []
    for step in range(steps):
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16, enabled=autocast):
            loss = conv_loss(rank, step, device)(wrapped)
        if scaler is None:
            loss.backward()
            opt.step()
            continue
        scaled = scaler.scale(loss) * (float("inf") if step == overflow_at and rank == 1 else 1)
        scaled.backward()
        scale = scaler.get_scale()
        if horovod:
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < scale:
            skipped.append(step)
    if horovod:
        opt.close()
    return model, state, skipped


def case_amp(args) -> None:
    """torch.amp.GradScaler, with fp16 autocast on a GPU, in every front end of
    the launcher, step-ahead on: (a) a constant power-of-two scale without
    autocast trains the unscaled run (bit for bit on the CPU, to float32
    rounding on a GPU); (b) the default dynamic scale, autocast on a GPU, an
    overflow on rank 1: every rank skips that step, replicas bit-identical."""
    (rank, size, agree_on, leave), device, front_ends = amp_front_ends(args)
    steps = 6 if args.quick else 12
    autocast = device.type == "cuda"
    lines = []
    for label, build in front_ends:
        plain, _, _ = amp_train(build, device, rank, steps, None, False)
        constant = torch.amp.GradScaler(device.type, init_scale=2.0 ** 12,
                                        growth_interval=10 ** 6)
        scaled, state, _ = amp_train(build, device, rank, steps, constant, False)
        error = max(relative_error(p, q) for p, q in zip(scaled.parameters(),
                                                           plain.parameters()))
        limit = 0.0 if device.type == "cpu" else 1e-4
        require(error <= limit, f"{label}: a constant scale moved the weights by {error:.1e} "
                                f"(relative) from the unscaled run's, over {limit:g}")
        require(state.rescaling.unit == 2.0 ** -12,
                f"{label}: step-ahead's unit is {state.rescaling.unit}, not 1 / 4096")
        dynamic = torch.amp.GradScaler(device.type)
        model, state, skipped = amp_train(build, device, rank, steps, dynamic, autocast,
                                          overflow_at=2)
        require(2 in skipped, f"{label}: the overflow at step 2 was not skipped ({skipped})")
        for name, p in model.named_parameters():
            require(bool(torch.isfinite(p).all()), f"{label}: {name} is not finite")
        agree_on(parameters_of(model), f"amp.{label.replace(' ', '_')}")
        lines.append(f"{label}: constant scale {error:.1e} from unscaled, dynamic scale "
                     f"skipped steps {skipped}, final scale {dynamic.get_scale():g}")
    if rank == 0:
        print(f"DETAIL {size} ranks on {device.type}, GradScaler"
              f"{' and fp16 autocast' if autocast else ''}, step-ahead on: "
              + "; ".join(lines) + "; replicas bit-identical", flush=True)
    leave()


CASES: Dict[str, Callable] = {"maths": case_maths, "replicas": case_replicas,
                              "swap": case_swap, "ddp": case_ddp, "amp": case_amp}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--comm", choices=("direct", "host"), default="direct",
                   help="Horovod: CUDA tensors to Horovod as they are, or through host copies")
    p.add_argument("--backend", default="gloo", help="torch.distributed backend (ddp)")
    p.add_argument("--launcher", choices=("horovod", "torchrun"), default="horovod",
                   help="amp: the Horovod front ends, or the DDP hook")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    else:
        # Full float32 matmuls and convolutions: the tolerances against the
        # CPU and against exact averages are those of float32, not TF32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    CASES[args.case](args)


if __name__ == "__main__":
    main()
