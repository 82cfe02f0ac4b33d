r"""Train the digits CNN with Hugging Face Accelerate and ACP-SGD.

    accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py
    accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py --no-acp
    accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py \
        --resume runs/accelerate-digits/epoch_4

The second is plain DDP, to compare; the third continues the first from its
fourth epoch. ``--multi_gpu`` is Accelerate's name for its torchrun launcher:
without GPUs the processes train on the CPU (Gloo); ``torchrun
--nproc-per-node 2 examples/train_accelerate.py`` works too. The line that
makes it ACP-SGD, after ``prepare``::

    state = register_acp(accelerator, model, optimizer, matrix_rank=4)

``accelerator.save_state`` (after every epoch, under ``--out``) then holds
every rank's compression state, and ``accelerator.load_state`` restores it.
"""
import argparse
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader

from common import DigitsCNN, add_framework_args, gradient_bytes, load_digits_split
from hvd_acp.comm import leave_process_group
from hvd_acp.integrations.accelerate import register_acp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_framework_args(parser, out="runs/accelerate-digits")
    parser.add_argument("--resume", metavar="DIR", help="a folder of accelerator.save_state")
    args = parser.parse_args()

    # Without cpu=True, Accelerate on a machine without GPUs trains each process
    # alone; a seedable sampler shuffles epoch N alike in a resumed run.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    train, test = load_digits_split()
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * accelerator.num_processes,
                                momentum=0.9, weight_decay=1e-4)
    model, optimizer, train_loader, test_loader = accelerator.prepare(
        model, optimizer, DataLoader(train, batch_size=32, shuffle=True),
        DataLoader(test, batch_size=256))
    state = None if args.no_acp else register_acp(accelerator, model, optimizer,
                                                  matrix_rank=args.matrix_rank)
    first_epoch = 0
    if args.resume:
        accelerator.load_state(args.resume)
        first_epoch = int(args.resume.rstrip("/").rsplit("_", 1)[1])

    steps = 0
    for epoch in range(first_epoch, args.epochs):
        model.train()
        train_loader.set_epoch(epoch)       # the same shuffle after a resume
        for images, labels in train_loader:
            optimizer.zero_grad()
            accelerator.backward(F.cross_entropy(model(images), labels))
            optimizer.step()
            steps += 1
        accelerator.save_state(os.path.join(args.out, f"epoch_{epoch + 1}"))

        model.eval()
        correct = count = 0
        with torch.no_grad():
            for images, labels in test_loader:
                predictions, labels = accelerator.gather_for_metrics(
                    (model(images).argmax(1), labels))
                correct += int((predictions == labels).sum())
                count += len(labels)
        accelerator.print(f"epoch {epoch + 1:3d}  test accuracy {100 * correct / count:.2f}%")

    dense = gradient_bytes(model)
    sent = state.comm_stats.bytes_sent / steps if state else dense
    accelerator.print(f"final test accuracy {100 * correct / count:.2f}%; bytes sent per step "
                      f"and rank: {sent:,.0f} (full gradient {dense:,}: {dense / sent:.1f}x less)")
    leave_process_group()


if __name__ == "__main__":
    main()
