"""hvd_acp.integrations.lightning under Lightning's own launcher.

Usage: ``python lightning_train.py --dir DIR`` with ``devices=2``: Lightning
starts rank 1 itself (its subprocess script launcher), CPU and Gloo.

Three fits of the digits MLP, in one launch:

1. plain DDP (no callback): the reference accuracy;
2. ACP-SGD (``ACPCallback``), Lightning's ``ModelCheckpoint`` saving at
   the end of every epoch;
3. a new model resumed with ``fit(ckpt_path=<end of epoch 2>)``.

Each rank writes its results to DIR (see integration_common).
"""
import argparse
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as L
from lightning.pytorch.callbacks import ModelCheckpoint

from integration_common import (MLP, digits, evaluate, factors, gradient_bytes, replicas_identical,
                                report, residual_norm, same_factors, wire_bytes)
from hvd_acp.integrations.lightning import ACPCallback

torch.set_num_threads(1)
warnings.filterwarnings("ignore")
EPOCHS, BATCH, LR = 3, 32, 0.05 * 2
TRAIN, TEST = digits()


class Digits(L.LightningModule):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = MLP()

    def training_step(self, batch, index):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*TRAIN), batch_size=BATCH, shuffle=True)


class Probe(L.Callback):
    """Records what the test checks; listed after ACPCallback."""

    def __init__(self, acp=None, reference=None):
        self.acp, self.reference = acp, reference
        self.record = {}
        self.at_epoch_1 = None

    def on_fit_start(self, trainer, pl_module):
        self.record["initial"] = evaluate(pl_module.net, TEST)
        state = self.acp.state if self.acp else None
        if state is not None:
            self.record["start_step"] = state.step_count
            self.record["start_residual"] = residual_norm(state)
            if self.reference is not None:
                self.record["factors_continue"] = same_factors(factors(state),
                                                               self.reference["factors"])

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 1 and self.acp is not None:
            self.at_epoch_1 = {"factors": factors(self.acp.state),
                               "step": self.acp.state.step_count,
                               "residual": residual_norm(self.acp.state)}

    def on_train_end(self, trainer, pl_module):
        self.record["identical"] = replicas_identical(pl_module.net)
        self.record["final"] = evaluate(pl_module.net, TEST)
        self.record["global_step"] = trainer.global_step
        if self.acp is not None:
            state = self.acp.state
            self.record.update(steps=state.step_count, bytes_sent=state.comm_stats.bytes_sent,
                               allreduces=state.comm_stats.allreduces,
                               optimizer_attached=state.optimizer is trainer.optimizers[0])
            if self.reference is None:
                self.record["expected_bytes"] = wire_bytes(state, state.step_count)


def fit(directory, acp=None, reference=None, ckpt_path=None, seed=0):
    probe = Probe(acp, reference)
    callbacks = [acp, probe] if acp else [probe]
    if acp is not None:
        callbacks.append(ModelCheckpoint(dirpath=directory, every_n_epochs=1, save_top_k=-1,
                                         save_on_train_epoch_end=True))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS,
                        callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=acp is not None,
                        num_sanity_val_steps=0, default_root_dir=directory)
    module = Digits(seed)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module, probe


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    directory = parser.parse_args().dir

    trainer, module, plain = fit(directory)
    rank = trainer.global_rank
    dense = gradient_bytes(module.net)

    acp = ACPCallback(matrix_rank=4)
    _, _, run = fit(directory, acp=acp)
    checkpoint = os.path.join(directory, "epoch=1-step=48.ckpt")

    resumed_acp = ACPCallback(matrix_rank=4)
    _, _, resumed = fit(directory, acp=resumed_acp, reference=run.at_epoch_1,
                        ckpt_path=checkpoint, seed=123)
    report(directory, "lightning", rank, dense_bytes=dense, plain=plain.record, acp=run.record,
           saved_step=run.at_epoch_1["step"], saved_residual=run.at_epoch_1["residual"],
           checkpoint_exists=os.path.isfile(checkpoint), resumed=resumed.record)
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
