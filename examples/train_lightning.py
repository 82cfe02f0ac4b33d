r"""Train the digits CNN with PyTorch Lightning and ACP-SGD.

    python examples/train_lightning.py                 # Lightning starts 2 CPU processes
    python examples/train_lightning.py --no-acp        # plain DDP, to compare
    python examples/train_lightning.py --accelerator gpu --devices 4
    python examples/train_lightning.py --epochs 12 \
        --resume "runs/lightning-digits/checkpoints/epoch=7-step=176.ckpt"

The lines that make a Lightning DDP run ACP-SGD::

    from hvd_acp.integrations.lightning import ACPCallback
    trainer = L.Trainer(strategy="ddp", ..., callbacks=[ACPCallback(matrix_rank=4)])

The callback hands the optimizer to the hook (step-ahead error feedback) and
keeps the compression state in Lightning's checkpoints (the last one in
``--out``/``checkpoints/``; the fourth command continues the first to 12
epochs). Rank 0 prints the test accuracy after every epoch and, at the end,
the bytes each rank sent per step against the full gradient.
"""
import argparse

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import DigitsCNN, add_framework_args, gradient_bytes, load_digits_split
from hvd_acp.integrations.lightning import ACPCallback


class Digits(L.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        self.model, self.lr = DigitsCNN(), lr

    def training_step(self, batch, index):
        images, labels = batch
        return F.cross_entropy(self.model(images), labels)

    def validation_step(self, batch, index):
        images, labels = batch
        logits = self.model(images)
        self.log_dict({"test_loss": F.cross_entropy(logits, labels),
                       "test_accuracy": (logits.argmax(1) == labels).float().mean()},
                      sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)


class PrintAccuracy(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.first_step = trainer.global_step       # > 0 when resumed

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero and not trainer.sanity_checking:
            metrics = trainer.callback_metrics
            print(f"epoch {trainer.current_epoch + 1:3d}  step {trainer.global_step:5d}  test "
                  f"loss {metrics['test_loss']:.4f}  test accuracy "
                  f"{100 * metrics['test_accuracy']:.2f}%", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_framework_args(parser, out="runs/lightning-digits")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--resume", metavar="PATH", help="checkpoint to resume from")
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    train, test = load_digits_split()
    acp = None if args.no_acp else ACPCallback(matrix_rank=args.matrix_rank)
    printer = PrintAccuracy()
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy="ddp",
                        max_epochs=args.epochs, default_root_dir=args.out, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[printer] + ([acp] if acp else []))
    module = Digits(args.lr * args.devices)
    trainer.fit(module, DataLoader(train, batch_size=32, shuffle=True),
                DataLoader(test, batch_size=256), ckpt_path=args.resume)
    if trainer.is_global_zero:
        dense = gradient_bytes(module.model)
        steps = trainer.global_step - printer.first_step
        sent = acp.state.comm_stats.bytes_sent / steps if acp else dense
        print(f"final test accuracy {100 * trainer.callback_metrics['test_accuracy']:.2f}%; "
              f"bytes sent per step and rank: {sent:,.0f} (full gradient {dense:,}: "
              f"{dense / sent:.1f}x less)", flush=True)


if __name__ == "__main__":
    main()
