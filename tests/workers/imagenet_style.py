"""A training script written the way Horovod's ImageNet example is, with the
one-line swap to hvd_acp, on stand-in data.

What it keeps of that example: resume from the last checkpoint file found
(``--checkpoint-format``), the epoch number broadcast from rank 0; rank 0
alone loads the checkpoint, then ``hvd.broadcast_parameters`` and
``hvd.broadcast_optimizer_state``; the learning rate warmed up per batch over
``--warmup-epochs`` to ``base_lr * size * batches_per_allreduce``; batches of
``batch_size * batches_per_allreduce`` split into sub-batches, each backward
pass divided by their number (``backward_passes_per_step``); metrics
averaged with ``hvd.allreduce``; a checkpoint per epoch written by rank 0.

Each rank prints, after its last epoch, ``FINAL rank=R epoch=E steps=S
val_loss=L digest=D`` (D: a hash of its parameters' bytes), and after a
resume ``RESUMED rank=R epoch=E steps=S phase=PH``.

    horovodrun -np 2 -H localhost:2 --gloo python imagenet_style.py \
        --checkpoint-format DIR/checkpoint-{epoch}.pt --epochs 3
"""
import argparse
import hashlib
import math
import os

import horovod.torch as hvd
import torch
import torch.nn.functional as F
import torch.utils.data.distributed
from torch import nn

import hvd_acp

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-format", required=True)
parser.add_argument("--batches-per-allreduce", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--base-lr", type=float, default=0.125)
parser.add_argument("--warmup-epochs", type=float, default=1)
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--wd", type=float, default=5e-5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--train-size", type=int, default=640)


def stand_in_data(size, seed):
    """Images of 3 x 12 x 12 whose class (of 4) a fixed linear map of their 3 x 4 x 4
    average-pooled version decides."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 3, 12, 12, generator=g)
    teacher = torch.randn(4, 3 * 4 * 4, generator=torch.Generator().manual_seed(7))
    y = (F.avg_pool2d(x, 3).flatten(1) @ teacher.t()).argmax(dim=1)
    return torch.utils.data.TensorDataset(x, y)


def small_cnn():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.AvgPool2d(3), nn.Flatten(),
                         nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 4))


class Metric:
    """An average over batches and ranks (Horovod's allreduce)."""

    def __init__(self, name):
        self.name, self.sum, self.n = name, torch.tensor(0.), torch.tensor(0.)

    def update(self, value):
        self.sum += hvd.allreduce(value.detach().cpu(), name=self.name)
        self.n += 1

    @property
    def avg(self):
        return self.sum / self.n


def adjust_learning_rate(epoch, batch_idx):
    if epoch < args.warmup_epochs:
        epoch += float(batch_idx + 1) / len(train_loader)
        lr_adj = 1. / hvd.size() * (epoch * (hvd.size() - 1) / args.warmup_epochs + 1)
    else:
        lr_adj = 1.
    for group in optimizer.param_groups:
        group["lr"] = args.base_lr * hvd.size() * args.batches_per_allreduce * lr_adj


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        adjust_learning_rate(epoch, batch_idx)
        optimizer.zero_grad()
        for i in range(0, len(data), args.batch_size):
            output = model(data[i:i + args.batch_size])
            loss = F.cross_entropy(output, target[i:i + args.batch_size])
            loss.div_(math.ceil(float(len(data)) / args.batch_size))
            loss.backward()
        optimizer.step()


def validate():
    model.eval()
    val_loss = Metric("val_loss")
    with torch.no_grad():
        for data, target in val_loader:
            val_loss.update(F.cross_entropy(model(data), target))
    return val_loss.avg.item()


def save_checkpoint(epoch):
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                   args.checkpoint_format.format(epoch=epoch + 1))


if __name__ == "__main__":
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    resume_from_epoch = 0
    for try_epoch in range(args.epochs, 0, -1):
        if os.path.exists(args.checkpoint_format.format(epoch=try_epoch)):
            resume_from_epoch = try_epoch
            break
    resume_from_epoch = hvd.broadcast(torch.tensor(resume_from_epoch), root_rank=0,
                                      name="resume_from_epoch").item()

    train_dataset = stand_in_data(args.train_size, seed=1)
    val_dataset = stand_in_data(128, seed=2)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size * args.batches_per_allreduce,
        sampler=train_sampler)
    val_sampler = torch.utils.data.distributed.DistributedSampler(
        val_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    val_loader = torch.utils.data.DataLoader(val_dataset, batch_size=32, sampler=val_sampler)

    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(),
                                lr=args.base_lr * hvd.size() * args.batches_per_allreduce,
                                momentum=args.momentum, weight_decay=args.wd)
    optimizer = hvd_acp.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        backward_passes_per_step=args.batches_per_allreduce)

    if resume_from_epoch > 0 and hvd.rank() == 0:
        checkpoint = torch.load(args.checkpoint_format.format(epoch=resume_from_epoch))
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if resume_from_epoch > 0:
        print(f"RESUMED rank={hvd.rank()} epoch={resume_from_epoch} "
              f"steps={optimizer.step_count} phase={optimizer.phase.value}", flush=True)

    val_loss = float("nan")
    for epoch in range(resume_from_epoch, args.epochs):
        train(epoch)
        val_loss = validate()
        save_checkpoint(epoch)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    print(f"FINAL rank={hvd.rank()} epoch={args.epochs} steps={optimizer.step_count} "
          f"val_loss={val_loss:.6f} digest={digest}", flush=True)
