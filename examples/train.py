"""Train a small CNN on scikit-learn's handwritten digits with Horovod.

    horovodrun -np 2 -H localhost:2 --gloo python examples/train.py --optimizer acp

A Horovod script as users write them; the only line that differs between
S-SGD, Power-SGD and ACP-SGD is the optimizer swap (``--optimizer``, in
``main``)::

    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=...)      # S-SGD
    optimizer = hvd_acp.DistributedOptimizer(optimizer, named_parameters=...,  # ACP-SGD
                                             matrix_rank=4)

``--optimizer`` also offers S-SGD with fp16 gradients, ACP-SGD's fp16 wire
and two ablations of it (no overlap with backward, no fusion), and three
methods that average no gradient, DiLoCo, a DeMo-style and a TSR-style
method (``hvd_acp.baselines``); DiLoCo's replicas differ between its outer
steps, so the run ends on one and is scored on the weights of the last.

Rank 0 prints the test accuracy and loss after every epoch and, at the end,
the bytes each rank sent next to what S-SGD would have sent for the same
steps; ``--summary PATH`` also writes them as JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import hvd_acp
from common import (BASELINES, ByteMeter, DigitsCNN, DigitsResNet, add_baseline_args,
                    add_training_args, allreduce_sums, build_baseline, check_method_flags,
                    finish_run, load_digits_split, settings_of)

#: ``--optimizer``: Horovod's S-SGD, hvd_acp's compressors, the baselines.
OPTIMIZERS = ("ssgd", "ssgd-fp16", "powersgd", "acp", "acp-fp16", "acp-nooverlap",
              "acp-nofusion", "diloco", "demo", "tsr")
#: Those that take --warmup-steps, --step-ahead and --diagnostics.
COMPRESSORS = ("powersgd", "acp", "acp-fp16", "acp-nooverlap", "acp-nofusion")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="acp",
                        help="ssgd: hvd.DistributedOptimizer; ssgd-fp16: the same with "
                             "hvd.Compression.fp16; powersgd: hvd_acp.PowerSGDOptimizer; acp: "
                             "hvd_acp.DistributedOptimizer; acp-fp16: the same with "
                             "hvd.Compression.fp16; acp-nooverlap: overlap=False; "
                             "acp-nofusion: fusion_threshold_bytes=0; diloco: "
                             "hvd_acp.baselines.DiLoCoOptimizer; demo: "
                             "hvd_acp.baselines.DeMoOptimizer; tsr: "
                             "hvd_acp.baselines.TSROptimizer (default: %(default)s)")
    add_training_args(parser, epochs=12, lr=0.025, batch_size=32)
    add_baseline_args(parser)
    parser.add_argument("--arch", choices=("cnn", "resnet"), default="cnn",
                        help="cnn: two convolutions and two linear layers; resnet: a small "
                             "BatchNorm ResNet (default: %(default)s)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--nesterov", action="store_true", help="Nesterov momentum")
    parser.add_argument("--diagnostics", metavar="PATH",
                        help="acp/powersgd: rank 0 writes the per-step health of the error "
                             "feedback (hvd_acp.diagnostics) and the training loss to PATH")
    parser.add_argument("--weight-decay", type=float, default=1e-4, help="SGD weight decay")
    parser.add_argument("--amp", action="store_true",
                        help="mixed precision's gradient scaling: torch.amp.GradScaler with "
                             "its default dynamic scale, the pattern of Horovod's examples "
                             "(autocast to float16 where the model is on a GPU)")
    args = parser.parse_args(argv)
    check_method_flags(args, COMPRESSORS)
    return args


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset) -> dict:
    """Test accuracy and mean loss over the whole test set.

    Every rank scores its own share (every ``hvd.size()``-th sample); the
    sums are added over ranks, so all ranks return the same numbers.
    """
    model.eval()
    images, labels = dataset.tensors
    images, labels = images[hvd.rank()::hvd.size()], labels[hvd.rank()::hvd.size()]
    logits = model(images)
    sums = allreduce_sums({
        "loss": F.cross_entropy(logits, labels, reduction="sum").item(),
        "correct": (logits.argmax(dim=1) == labels).sum().item(),
        "count": len(labels)}, name="eval.test")
    model.train()
    return {"accuracy": sums["correct"] / sums["count"], "loss": sums["loss"] / sums["count"]}


def write_diagnostics(path: str, optimizer, step_losses) -> None:
    """Rank 0's per-step error-feedback records, each with that step's training loss."""
    records = [dict(record, train_loss=step_losses[record["step"]])
               for record in optimizer.reducer.diagnostics if record["step"] < len(step_losses)]
    with open(path, "w", encoding="utf-8") as out:
        json.dump({"steps": records}, out, indent=1)


def main(argv=None) -> dict:
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    is_root = hvd.rank() == 0

    train_set, test_set = load_digits_split()
    # Each rank reads its own shard, reshuffled every epoch.
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = DigitsResNet() if args.arch == "resnet" else DigitsCNN()
    lr = args.lr * hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                nesterov=args.nesterov, weight_decay=args.weight_decay)

    # The swap. hvd_acp's compressors take these settings (None: the library's default).
    acp_args = dict(matrix_rank=args.matrix_rank, warmup_steps=args.warmup_steps,
                    seed=args.seed, step_ahead=args.step_ahead,
                    diagnostics=bool(args.diagnostics))
    if args.optimizer == "ssgd":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    elif args.optimizer == "ssgd-fp16":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=hvd.Compression.fp16)
    elif args.optimizer == "powersgd":
        optimizer = hvd_acp.PowerSGDOptimizer(
            optimizer, named_parameters=model.named_parameters(), **acp_args)
    elif args.optimizer == "acp":
        optimizer = hvd_acp.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), **acp_args)
    elif args.optimizer == "acp-fp16":          # its buffers in fp16 on the wire
        optimizer = hvd_acp.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16, **acp_args)
    elif args.optimizer == "acp-nooverlap":     # an ablation: all-reduces after backward
        optimizer = hvd_acp.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), overlap=False, **acp_args)
    elif args.optimizer == "acp-nofusion":      # an ablation: one all-reduce per tensor
        optimizer = hvd_acp.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), fusion_threshold_bytes=0,
            **acp_args)
    elif args.optimizer in BASELINES:           # DiLoCo, DeMo-style, TSR-style
        optimizer = build_baseline(args, optimizer, model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    meter = ByteMeter(optimizer, model, fp16=args.optimizer == "ssgd-fp16")
    device = next(model.parameters()).device.type
    scaler = torch.amp.GradScaler(device) if args.amp else None
    skipped = 0                 # steps the scaler skipped (an overflow)

    if is_root:
        print(f"digits: {len(train_set)} train / {len(test_set)} test images, "
              f"{hvd.size()} ranks, optimizer {args.optimizer}, "
              f"matrix rank {args.matrix_rank}, lr {lr:g}", flush=True)

    history = {"test_accuracy": [], "test_loss": [], "train_loss": [], "step": [],
               "train_s": []}
    steps, train_s = 0, 0.0
    step_losses = []
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        epoch_start = time.perf_counter()
        loss_sum = count = 0.0
        bar = tqdm(loader, desc=f"epoch {epoch}/{args.epochs}", leave=False,
                   disable=not is_root or args.no_progress)
        for images, labels in bar:
            optimizer.zero_grad()
            if scaler is None:
                loss = F.cross_entropy(model(images), labels)
                loss.backward()
                optimizer.step()
            else:
                with torch.autocast(device, dtype=torch.float16, enabled=device == "cuda"):
                    loss = F.cross_entropy(model(images), labels)
                scaler.scale(loss).backward()
                optimizer.synchronize()
                scaler.unscale_(optimizer)
                scale = scaler.get_scale()
                with optimizer.skip_synchronize():
                    scaler.step(optimizer)
                scaler.update()
                skipped += int(scaler.get_scale() < scale)
            steps += 1
            step_losses.append(loss.item())
            loss_sum += loss.item() * len(labels)
            count += len(labels)
        if epoch == args.epochs and args.optimizer == "diloco" and optimizer.pending_inner_steps:
            optimizer.outer_step()      # DiLoCo ends on an outer step: the replicas agree
        train_s += time.perf_counter() - epoch_start

        train = allreduce_sums({"loss": loss_sum, "count": count}, name="eval.train")
        # DiLoCo is scored on the weights of its last outer step, which every rank shares.
        with (optimizer.global_weights() if args.optimizer == "diloco"
              else contextlib.nullcontext()):
            test = evaluate(model, test_set)
        history["test_accuracy"].append(test["accuracy"])
        history["test_loss"].append(test["loss"])
        history["train_loss"].append(train["loss"] / train["count"])
        history["step"].append(steps)
        history["train_s"].append(train_s)
        if is_root:
            print(f"epoch {epoch:3d}  step {steps:5d}  train loss "
                  f"{history['train_loss'][-1]:.4f}  test loss {test['loss']:.4f}  "
                  f"test accuracy {100 * test['accuracy']:.2f}%", flush=True)
    wall_s = time.perf_counter() - start
    if args.diagnostics and is_root:
        write_diagnostics(args.diagnostics, optimizer, step_losses)

    return finish_run(
        args, meter, history, steps, wall_s, train_s,
        fields={"example": "digits", "optimizer": args.optimizer,
                "test_accuracy": history["test_accuracy"][-1],
                "test_loss": history["test_loss"][-1],
                "test_accuracy_per_epoch": history["test_accuracy"],
                "loss_per_epoch": history["test_loss"]},
        config={"effective_lr": lr, "train_size": len(train_set), "test_size": len(test_set),
                **settings_of(optimizer),
                **({"amp": {"skipped_steps": skipped, "final_scale": scaler.get_scale()}}
                   if scaler is not None else {})},
        final_line=f"final test accuracy {100 * history['test_accuracy'][-1]:.2f}%, "
                   f"wall time {wall_s:.1f} s")


if __name__ == "__main__":
    main()
