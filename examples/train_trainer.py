"""Train the digits CNN with the Hugging Face Trainer and ACP-SGD.

    torchrun --nproc-per-node 2 examples/train_trainer.py               # CPU: Gloo
    torchrun --nproc-per-node 2 examples/train_trainer.py --no-acp      # plain DDP
    torchrun --nproc-per-node 2 examples/train_trainer.py --resume      # last checkpoint in --out

The line that makes it ACP-SGD, after building the Trainer::

    register_acp(trainer, matrix_rank=4)

The Trainer's checkpoints (one per epoch, under ``--out``) then hold every
rank's compression state, and ``train(resume_from_checkpoint=...)`` restores it.
"""
import argparse

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from common import DigitsCNN, add_framework_args, gradient_bytes, load_digits_split
from hvd_acp.comm import leave_process_group
from hvd_acp.integrations.transformers import register_acp


class Classifier(nn.Module):
    """The CNN with the Trainer's calling convention: a dict with the loss."""

    def __init__(self):
        super().__init__()
        self.cnn = DigitsCNN()

    def forward(self, images, labels=None):
        logits = self.cnn(images)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class Examples(torch.utils.data.Dataset):
    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        images, labels = self.dataset[index]
        return {"images": images, "labels": labels}


class FirstStep(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step       # > 0 when resumed


def accuracy(prediction):
    return {"accuracy": float(np.mean(prediction.predictions.argmax(1) == prediction.label_ids))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_framework_args(parser, out="runs/trainer-digits")
    parser.add_argument("--resume", action="store_true", help="from the last checkpoint in --out")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    train, test = load_digits_split()
    training = TrainingArguments(
        output_dir=args.out, use_cpu=not torch.cuda.is_available(), num_train_epochs=args.epochs,
        per_device_train_batch_size=32, per_device_eval_batch_size=256,
        lr_scheduler_type="constant", eval_strategy="epoch", save_strategy="epoch",
        logging_strategy="epoch", report_to="none", disable_tqdm=True,
        ddp_find_unused_parameters=False)
    lr = args.lr * training.world_size
    trainer = Trainer(model=Classifier(), args=training, train_dataset=Examples(train),
                      eval_dataset=Examples(test), compute_metrics=accuracy,
                      optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": lr, "momentum": 0.9,
                                                                  "weight_decay": 1e-4}))
    acp = None if args.no_acp else register_acp(trainer, matrix_rank=args.matrix_rank)
    first = FirstStep()
    trainer.add_callback(first)
    result = trainer.train(resume_from_checkpoint=args.resume or None)

    if trainer.is_world_process_zero():
        dense = gradient_bytes(trainer.model.cnn)
        steps = result.global_step - first.step
        sent = acp.state.comm_stats.bytes_sent / steps if acp else dense
        final = [log["eval_accuracy"] for log in trainer.state.log_history
                 if "eval_accuracy" in log]
        print(f"final test accuracy {100 * final[-1]:.2f}%; bytes sent per step and rank: "
              f"{sent:,.0f} (full gradient {dense:,}: {dense / sent:.1f}x less)", flush=True)
    leave_process_group()


if __name__ == "__main__":
    main()
