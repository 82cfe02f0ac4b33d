"""Train the digits CNN with PyTorch DDP and a communication hook.

    torchrun --nproc-per-node 2 examples/train_ddp.py --hook acp

The DDP twin of ``train.py`` (same data, model, schedule and summary); the
only line that differs between the three runs is the hook (``--hook``, in
``main``)::

    model = DDP(model)                                              # allreduce
    model.register_comm_hook(PowerSGDState(None, 4, 2), powerSGD_hook)  # powersgd
    model.register_comm_hook(hvd_acp.ddp.ACPState(matrix_rank=4,        # acp
                                                  optimizer=optimizer),
                             hvd_acp.ddp.acp_hook)

(``optimizer=`` turns on step-ahead error feedback, as in
``hvd_acp.DistributedOptimizer``; ``--step-ahead 0`` switches it off.)

Runs on CPU with Gloo (``--device cpu``, the default) or on one GPU per rank
with NCCL (``--device cuda``). Horovod is not needed. Rank 0 prints the test
accuracy after every epoch and the bytes each rank handed to all-reduce;
``--summary PATH`` writes them as JSON.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import hvd_acp.ddp
from common import (ByteMeter, DigitsCNN, TorchCollectives, add_training_args, finish_run,
                    gradient_bytes, load_digits_split)
from hvd_acp import Settings
from hvd_acp.comm import leave_process_group

HOOKS = ("allreduce", "powersgd", "acp")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--hook", choices=HOOKS, default="acp",
                        help="allreduce: DDP's default averaging; powersgd: torch's "
                             "powerSGD_hook; acp: hvd_acp.ddp.acp_hook")
    add_training_args(parser, epochs=12, lr=0.025, batch_size=32)
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--weight-decay", type=float, default=1e-4, help="SGD weight decay")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: Gloo; cuda: NCCL, GPU LOCAL_RANK")
    args = parser.parse_args(argv)
    if args.step_ahead is not None and args.hook != "acp":
        raise SystemExit("--step-ahead only applies to --hook acp")
    if args.warmup_steps and args.hook == "allreduce":
        raise SystemExit("--warmup-steps only applies to --hook acp or powersgd")
    return args


class PowerSGDCounter:
    """Bytes ``powerSGD_hook`` hands to all-reduce, from its own counters.

    Full gradients before ``start_powerSGD_iter``; then per compressed
    matrix ``(n + m) r`` elements and every other tensor whole, which the
    hook adds up in ``total_numel_after_compression``.
    """

    def __init__(self, state, model: torch.nn.Module):
        self.state = state
        self.dense_bytes = gradient_bytes(model)
        self.element_size = next(model.parameters()).element_size()

    @property
    def comm_stats(self) -> "PowerSGDCounter":
        return self

    @property
    def bytes_sent(self) -> int:
        dense_steps = min(self.state.iter, self.state.start_powerSGD_iter)
        return (dense_steps * self.dense_bytes
                + self.state.total_numel_after_compression * self.element_size)


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, collectives: TorchCollectives,
             device: torch.device) -> dict:
    """Test accuracy and mean loss over the whole test set, summed over ranks."""
    model.eval()
    rank, size = collectives.rank(), collectives.size()
    images, labels = dataset.tensors
    images, labels = images[rank::size].to(device), labels[rank::size].to(device)
    logits = model(images)
    sums = collectives.allreduce_sums({
        "loss": F.cross_entropy(logits, labels, reduction="sum").item(),
        "correct": (logits.argmax(dim=1) == labels).sum().item(),
        "count": len(labels)}, name="eval.test")
    model.train()
    return {"accuracy": sums["correct"] / sums["count"], "loss": sums["loss"] / sums["count"]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    collectives = TorchCollectives()
    rank, size = collectives.rank(), collectives.size()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    is_root = rank == 0

    train_set, test_set = load_digits_split()
    sampler = DistributedSampler(train_set, num_replicas=size, rank=rank, shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    module = DigitsCNN().to(device)
    model = DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
    lr = args.lr * size
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)

    # The swap; ``counter`` is what the byte count reads (``comm_stats``).
    if args.hook == "allreduce":
        counter = None          # DDP's own averaging: every gradient once per step
    elif args.hook == "powersgd":
        # torch needs at least 2 plain iterations before compressing (its
        # state is keyed by bucket, and DDP rebuilds buckets after the first);
        # its hook takes one int rank: the library's default for this optimizer.
        matrix_rank = Settings(matrix_rank=args.matrix_rank).resolve(optimizer).matrix_rank
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=matrix_rank,
            start_powerSGD_iter=max(2, args.warmup_steps), random_seed=args.seed)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        counter = PowerSGDCounter(state, module)
    elif args.hook == "acp":
        state = hvd_acp.ddp.ACPState(matrix_rank=args.matrix_rank,
                                     warmup_steps=args.warmup_steps, seed=args.seed,
                                     optimizer=optimizer, step_ahead=args.step_ahead)
        model.register_comm_hook(state, hvd_acp.ddp.acp_hook)
        counter = state
    meter = ByteMeter(counter, module)

    if is_root:
        print(f"digits: {len(train_set)} train / {len(test_set)} test images, {size} ranks, "
              f"DDP hook {args.hook}, matrix rank {args.matrix_rank}, lr {lr:g}", flush=True)

    history = {"test_accuracy": [], "test_loss": [], "train_loss": [], "step": [],
               "train_s": []}
    steps, train_s = 0, 0.0
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        epoch_start = time.perf_counter()
        loss_sum = count = 0.0
        bar = tqdm(loader, desc=f"epoch {epoch}/{args.epochs}", leave=False,
                   disable=not is_root or args.no_progress)
        for images, labels in bar:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()          # the hook compresses and all-reduces here
            optimizer.step()
            steps += 1
            loss_sum += loss.item() * len(labels)
            count += len(labels)
        train_s += time.perf_counter() - epoch_start

        train = collectives.allreduce_sums({"loss": loss_sum, "count": count}, name="eval.train")
        test = evaluate(model, test_set, collectives, device)
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

    summary = finish_run(
        args, meter, history, steps, wall_s, train_s,
        fields={"example": "digits-ddp", "hook": args.hook,
                "test_accuracy": history["test_accuracy"][-1],
                "test_loss": history["test_loss"][-1],
                "test_accuracy_per_epoch": history["test_accuracy"],
                "loss_per_epoch": history["test_loss"]},
        config={"effective_lr": lr, "train_size": len(train_set), "test_size": len(test_set)},
        final_line=f"final test accuracy {100 * history['test_accuracy'][-1]:.2f}%, "
                   f"wall time {wall_s:.1f} s",
        collectives=collectives)
    leave_process_group()
    return summary


if __name__ == "__main__":
    main()
