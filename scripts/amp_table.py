"""Step-ahead under a real ``torch.amp.GradScaler``: the table of issue 48, rerun.

    .venv/bin/python scripts/amp_table.py            # prints the Markdown table
    .venv/bin/python scripts/amp_table.py --np 4 --optimizer adamw

A small MLP, SGD with momentum 0.9 (or AdamW), ``matrix_rank=2`` and every
other setting at its default (step-ahead 0.2), trained on 2 ranks for
``--steps`` steps, four ways per front end: without a scaler, with
``torch.amp.GradScaler("cpu", init_scale=4096)`` and no autocast (the only
difference from the unscaled run is a power-of-two factor, exact in fp32),
and both again with ``step_ahead=0``. A cell reads "= no scaler" where the
run under the scaler ends with the unscaled run's loss, bit for bit.

The Horovod front end runs the guide's pattern (``synchronize()``,
``unscale_``, ``skip_synchronize()``) under ``horovodrun --gloo``; the DDP
hook (``ACPState(optimizer=opt)``, ``scaler.step(opt)``) under ``torchrun``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _batch(rank: int, step: int):
    import torch
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=gen)
    return x, (x[:, :4].sum(1) > 0).long()


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))


def _inner(model, name: str):
    import torch
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-3)
    return torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.9)


def _run_horovod(scaled: bool, step_ahead, steps: int, optimizer: str):
    import torch
    import torch.nn.functional as F
    import horovod.torch as hvd
    import hvd_acp
    hvd.init()
    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd_acp.DistributedOptimizer(_inner(model, optimizer),
                                       named_parameters=model.named_parameters(),
                                       matrix_rank=2, step_ahead=step_ahead)
    scaler = torch.amp.GradScaler("cpu", init_scale=4096.0, enabled=scaled)
    loss = None
    for step in range(steps):
        x, y = _batch(hvd.rank(), step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    return float(loss), scaler.get_scale() if scaled else None, hvd.rank()


def _run_ddp(scaled: bool, step_ahead, steps: int, optimizer: str):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import hvd_acp.ddp
    from hvd_acp.comm import leave_process_group
    dist.init_process_group("gloo")
    module = _model()
    model = torch.nn.parallel.DistributedDataParallel(module)
    opt = _inner(model, optimizer)
    state = hvd_acp.ddp.ACPState(matrix_rank=2, step_ahead=step_ahead, optimizer=opt,
                                 named_parameters=module.named_parameters())
    model.register_comm_hook(state, hvd_acp.ddp.acp_hook)
    scaler = torch.amp.GradScaler("cpu", init_scale=4096.0, enabled=scaled)
    loss = None
    for step in range(steps):
        x, y = _batch(dist.get_rank(), step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    result = float(loss), scaler.get_scale() if scaled else None, dist.get_rank()
    leave_process_group()
    return result


def worker(args) -> None:
    run = _run_horovod if args.front_end == "horovod" else _run_ddp
    step_ahead = None if args.step_ahead is None else float(args.step_ahead)
    loss, scale, rank = run(args.scaled, step_ahead, args.steps, args.optimizer)
    if rank == 0:
        print("RESULT " + json.dumps({"loss": loss, "scale": scale}), flush=True)


def launch(front_end: str, scaled: bool, step_ahead, args) -> dict:
    here = [sys.executable, str(Path(__file__).resolve()), "--worker", "--front-end", front_end,
            "--steps", str(args.steps), "--optimizer", args.optimizer]
    if scaled:
        here.append("--scaled")
    if step_ahead is not None:
        here += ["--step-ahead", str(step_ahead)]
    bin_dir = Path(sys.executable).parent
    if front_end == "horovod":
        cmd = [str(bin_dir / "horovodrun"), "-np", str(args.np), "-H", f"localhost:{args.np}",
               "--gloo", *here]
    else:
        cmd = [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", str(args.np),
               *here[1:]]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=args.timeout).stdout
    for line in out.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise SystemExit(f"{' '.join(cmd)} printed no result:\n{out[-3000:]}")


def _cell(plain: dict, scaled: dict) -> str:
    if scaled["loss"] == plain["loss"]:
        return f"= no scaler ({plain['loss']:.4f})"
    scale = scaled["scale"]
    return f"**{scaled['loss']:.4f}**, scale {scale:g}" if scale is not None else \
        f"**{scaled['loss']:.4f}**"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--front-end", choices=("horovod", "ddp"), help=argparse.SUPPRESS)
    parser.add_argument("--scaled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--step-ahead", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    print(f"{args.np} ranks, {args.optimizer}, matrix_rank=2, {args.steps} steps, "
          "GradScaler('cpu', init_scale=4096), no autocast\n")
    print("| front end | no scaler | GradScaler | `step_ahead=0`: no scaler / GradScaler |")
    print("|---|---|---|---|")
    for front_end, label in (("horovod", "`hvd_acp.DistributedOptimizer`"),
                             ("ddp", "DDP hook (`ACPState(optimizer=opt)`)")):
        default = [launch(front_end, scaled, None, args) for scaled in (False, True)]
        off = [launch(front_end, scaled, 0, args) for scaled in (False, True)]
        print(f"| {label} | loss {default[0]['loss']:.4f} | {_cell(*default)} | "
              f"{off[0]['loss']:.4f} / {_cell(*off)} |", flush=True)


if __name__ == "__main__":
    main()
