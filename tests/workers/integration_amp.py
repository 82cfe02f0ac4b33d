"""Each framework's own fp16 mixed precision, with ACP-SGD at its defaults, on 2 CPU processes.

Usage: ``integration_amp.py FRAMEWORK --dir DIR`` under the framework's
launcher (``lightning``: Lightning starts rank 1 itself; ``accelerate``:
``accelerate launch``; ``transformers``: ``torchrun``).

What each framework's switch does on a GPU, driven on the CPU:

- ``lightning``: ``precision="16-mixed"`` falls back to bf16 on a CPU, so
  the worker passes the plugin it builds on a GPU,
  ``MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))``:
  Lightning's own closure, ``unscale_``, clipping and ``scaler.step``.
- ``accelerate``: ``Accelerator(mixed_precision="fp16")`` leaves fp16 off
  on a CPU (no scaler, no autocast); the worker hands it the CPU
  ``GradScaler`` and turns its native AMP on before ``prepare()``, as
  Accelerate does itself on a GPU: ``accelerator.backward``,
  ``accelerator.clip_grad_norm_`` and the ``AcceleratedOptimizer``'s step
  are Accelerate's own.
- ``transformers``: ``TrainingArguments(fp16=True)``, the same Accelerate
  switch inside the Trainer, with the Trainer's clipping.

Two trainings of the digits MLP per launch, SGD with momentum, ACP-SGD's
defaults (rank 4, step-ahead 0.2), gradients clipped to norm 5: without
mixed precision, then with it (autocast to float16, the scaler from 65536).
Each rank writes ``<dir>/result.<framework>-amp.<rank>.json``.
"""
import argparse
import os
import warnings

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from integration_common import MLP, digits, evaluate, replicas_identical, report
from hvd_acp.comm import leave_process_group

torch.set_num_threads(1)
warnings.filterwarnings("ignore")
EPOCHS, BATCH, LR, CLIP = 3, 32, 0.05 * 2, 5.0
TRAIN, TEST = digits()


def outcome(net, state, scaler, initial) -> dict:
    """What the test checks of one training, on this rank."""
    record = {"initial": initial, "final": evaluate(net, TEST),
              "identical": replicas_identical(net),
              "finite": bool(torch.isfinite(torch.cat([p.detach().reshape(-1)
                                                        for p in net.parameters()])).all()),
              "steps": state.step_count}
    rescaling = getattr(state.compression, "rescaling", None)
    record["unit"] = None if rescaling is None else rescaling.unit
    record["scale"] = None if scaler is None else scaler.get_scale()
    return record


# ------------------------------------------------------------------ Lightning
def lightning(directory):
    import lightning.pytorch as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from hvd_acp.integrations.lightning import ACPCallback

    from lightning_train import Digits          # the worker of the plain Lightning tests

    records, rank = {}, 0
    for amp in (False, True):
        acp = ACPCallback()
        plugins = ([MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
                   if amp else [])
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS,
                            callbacks=[acp], plugins=plugins, gradient_clip_val=CLIP,
                            logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False,
                            num_sanity_val_steps=0, default_root_dir=directory)
        module = Digits(seed=0)
        initial = evaluate(module.net, TEST)
        trainer.fit(module)
        rank = trainer.global_rank
        scaler = trainer.precision_plugin.scaler if amp else None
        records["amp" if amp else "plain"] = outcome(module.net, acp.state, scaler, initial)
    report(directory, "lightning-amp", rank, **records)


# ----------------------------------------------------------------- Accelerate
def accelerate(directory):
    from accelerate import Accelerator

    from hvd_acp.integrations.accelerate import register_acp

    records, rank = {}, 0
    for amp in (False, True):
        # One mixed precision per process (AcceleratorState); fp16's is off on
        # a CPU, so the first run is plain, and the second switches it on.
        accelerator = Accelerator(cpu=True, mixed_precision="fp16")
        assert accelerator.scaler is None and not accelerator.native_amp
        if amp:
            accelerator.scaler = torch.amp.GradScaler("cpu")
            accelerator.native_amp = True
        torch.manual_seed(0)
        net = MLP()
        initial = evaluate(net, TEST)
        optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
        loader = DataLoader(TensorDataset(*TRAIN), batch_size=BATCH, shuffle=True)
        model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
        state = register_acp(accelerator, model, optimizer)
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                accelerator.backward(F.cross_entropy(model(x), y))
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
                optimizer.step()
        rank = accelerator.process_index
        records["amp" if amp else "plain"] = outcome(net, state, accelerator.scaler, initial)
        state.close()
    report(directory, "accelerate-amp", rank, **records)


# --------------------------------------------------------------- the Trainer
def transformers(directory):
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from hvd_acp.integrations.transformers import register_acp

    hf_logging.set_verbosity_error()

    from trainer_train import Classifier, Examples   # those of the plain Trainer tests

    records, rank = {}, 0
    for amp in (False, True):
        args = TrainingArguments(
            output_dir=os.path.join(directory, "amp" if amp else "plain"), use_cpu=True,
            fp16=amp, per_device_train_batch_size=BATCH, num_train_epochs=EPOCHS,
            learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
            max_grad_norm=CLIP, save_strategy="no", logging_strategy="no", report_to="none",
            disable_tqdm=True, ddp_find_unused_parameters=False, seed=0)
        model = Classifier()
        initial = evaluate(model.net, TEST)
        trainer = Trainer(model=model, args=args, train_dataset=Examples(*TRAIN),
                          optimizer_cls_and_kwargs=(torch.optim.SGD,
                                                    {"lr": LR, "momentum": 0.9}))
        if amp:
            assert trainer.accelerator.scaler is None   # fp16 is off on a CPU: switch it on
            trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
            trainer.accelerator.native_amp = True
        callback = register_acp(trainer)
        trainer.train()
        rank = trainer.args.process_index
        records["amp" if amp else "plain"] = outcome(model.net, callback.state,
                                                     trainer.accelerator.scaler, initial)
    report(directory, "transformers-amp", rank, **records)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=("lightning", "accelerate", "transformers"))
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    {"lightning": lightning, "accelerate": accelerate,
     "transformers": transformers}[args.framework](args.dir)
    leave_process_group()


if __name__ == "__main__":
    main()
