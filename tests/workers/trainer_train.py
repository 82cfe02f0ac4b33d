"""hvd_acp.integrations.transformers: the Hugging Face Trainer on 2 CPU processes.

Usage: ``torchrun --standalone --nproc-per-node 2 trainer_train.py --dir DIR``
(Gloo, DDP through the Trainer's Accelerate).

Three ``Trainer.train()`` runs of the digits MLP, in one launch:

1. plain DDP: the reference accuracy;
2. ACP-SGD (``register_acp``), the Trainer's checkpoints every 48 steps
   (``save_steps``), each rank's compression state in them;
3. a new Trainer and model, ``train(resume_from_checkpoint=<step 48>)``:
   every rank has its own residual back and the Trainer restores the data
   order, so the weights must equal run 2's bit for bit.

Each rank writes its results to DIR (see integration_common).
"""
import argparse
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from integration_common import (MLP, digits, evaluate, factors, flat, gradient_bytes,
                                replicas_identical, report, residual_norm, same_factors,
                                wire_bytes)
from hvd_acp.integrations.transformers import register_acp

torch.set_num_threads(1)
warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()
EPOCHS, BATCH, LR, SAVE_STEPS = 3, 32, 0.05 * 2, 48
TRAIN, TEST = digits()


class Classifier(nn.Module):
    """The MLP with the Trainer's calling convention: a dict with the loss."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = MLP()

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class Examples(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return {"x": self.x[index], "labels": self.y[index]}


class Probe(TrainerCallback):
    """Records what the test checks; added after register_acp's callback."""

    def __init__(self, trainer, acp=None, reference=None):
        self.trainer, self.acp, self.reference = trainer, acp, reference
        self.record, self.at_save = {}, None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.record["initial"] = evaluate(model.net, TEST)
        if self.acp is not None:
            acp_state = self.acp.state
            self.record.update(start_step=acp_state.step_count,
                               start_residual=residual_norm(acp_state),
                               resumed_from=self.acp.resumed_from,
                               optimizer_attached=acp_state.optimizer
                               is self.trainer.optimizer.optimizer)
            if self.reference is not None:
                self.record["factors_continue"] = same_factors(factors(acp_state),
                                                               self.reference["factors"])

    def on_save(self, args, state, control, **kwargs):
        if self.acp is not None and state.global_step == SAVE_STEPS and self.at_save is None:
            self.at_save = {"factors": factors(self.acp.state), "step": self.acp.state.step_count,
                            "residual": residual_norm(self.acp.state)}

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.record.update(identical=replicas_identical(model.net),
                           final=evaluate(model.net, TEST), global_step=state.global_step)
        self.flat = flat(model.net)
        if self.acp is not None:
            acp_state = self.acp.state
            self.record.update(steps=acp_state.step_count,
                               bytes_sent=acp_state.comm_stats.bytes_sent,
                               allreduces=acp_state.comm_stats.allreduces)
            if self.reference is None:
                self.record["expected_bytes"] = wire_bytes(acp_state, acp_state.step_count)


def train(directory, acp=False, reference=None, resume=None, seed=0):
    args = TrainingArguments(
        output_dir=directory, use_cpu=True, per_device_train_batch_size=BATCH,
        num_train_epochs=EPOCHS, learning_rate=LR, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.0, save_strategy="steps" if acp else "no",
        save_steps=SAVE_STEPS, logging_strategy="no", report_to="none", disable_tqdm=True,
        ddp_find_unused_parameters=False, seed=0)
    trainer = Trainer(model=Classifier(seed), args=args, train_dataset=Examples(*TRAIN),
                      optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": LR, "momentum": 0.9}))
    callback = register_acp(trainer, matrix_rank=4) if acp else None
    probe = Probe(trainer, callback, reference)
    trainer.add_callback(probe)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, probe


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    directory = parser.parse_args().dir

    trainer, plain = train(os.path.join(directory, "plain"))
    rank = trainer.args.process_index
    dense = gradient_bytes(trainer.model.net)
    _, run = train(os.path.join(directory, "acp"), acp=True)
    checkpoint = os.path.join(directory, "acp", f"checkpoint-{SAVE_STEPS}")
    _, resumed = train(os.path.join(directory, "acp"), acp=True, reference=run.at_save,
                       resume=checkpoint, seed=123)
    resumed.record["same_as_uninterrupted"] = torch.equal(resumed.flat, run.flat)
    report(directory, "transformers", rank, dense_bytes=dense, plain=plain.record, acp=run.record,
           saved_step=run.at_save["step"], saved_residual=run.at_save["residual"],
           rank_file=os.path.isfile(os.path.join(checkpoint, f"hvd_acp_state_rank{rank}.pt")),
           resumed=resumed.record)
    dist.barrier()


if __name__ == "__main__":
    main()
