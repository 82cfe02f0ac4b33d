"""hvd_acp.integrations.accelerate on 2 CPU processes (Gloo).

Usage: ``accelerate launch --multi_gpu --num_processes 2 accelerate_train.py --dir DIR``
(or ``torchrun --nproc-per-node 2``): Accelerate picks MULTI_CPU, DDP on Gloo.

Three runs of the digits MLP, in one launch, each with its own Accelerator:

1. plain DDP: the reference accuracy;
2. ACP-SGD (``register_acp``), ``accelerator.save_state`` after epoch 2;
3. a new model, ``register_acp``, ``accelerator.load_state`` of that
   checkpoint, the last epoch: every rank has its own residual back, so the
   weights must equal run 2's bit for bit.

Each rank writes its results to DIR (see integration_common).
"""
import argparse
import os
import warnings

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from integration_common import (MLP, digits, evaluate, factors, flat, gradient_bytes,
                                replicas_identical, report, residual_norm, same_factors,
                                wire_bytes)
from hvd_acp.integrations.accelerate import register_acp

torch.set_num_threads(1)
warnings.filterwarnings("ignore")
EPOCHS, BATCH, LR = 3, 32, 0.05 * 2
TRAIN, TEST = digits()


def run(directory, acp=False, resume=False, seed=0):
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(seed)
    net = MLP()
    torch.manual_seed(0)        # the data order (Accelerate seeds its sampler from torch's RNG)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    # A fixed order (the split is shuffled once): the resumed run must see
    # the batches the uninterrupted one saw.
    loader = DataLoader(TensorDataset(*TRAIN), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    record = {"distributed_type": accelerator.distributed_type.value}
    state = register_acp(accelerator, model, optimizer, matrix_rank=4) if acp else None
    if state is not None:
        record["optimizer_attached"] = state.optimizer is optimizer.optimizer
    first_epoch, saved = 0, None
    if resume:
        accelerator.load_state(os.path.join(directory, "ckpt"))
        first_epoch = 2
        record.update(start_step=state.step_count, start_residual=residual_norm(state),
                      start_factors=factors(state))
    record["initial"] = evaluate(net, TEST)
    for epoch in range(first_epoch, EPOCHS):
        loader.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
        if acp and not resume and epoch == 1:
            accelerator.save_state(os.path.join(directory, "ckpt"))
            saved = {"factors": factors(state), "step": state.step_count,
                     "residual": residual_norm(state)}
    record.update(identical=replicas_identical(net), final=evaluate(net, TEST))
    if state is not None:
        record.update(steps=state.step_count, bytes_sent=state.comm_stats.bytes_sent,
                      allreduces=state.comm_stats.allreduces)
        if not resume:
            record["expected_bytes"] = wire_bytes(state, state.step_count)
        state.close()
    return accelerator, net, record, saved


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    directory = parser.parse_args().dir

    accelerator, net, plain, _ = run(directory)
    rank = accelerator.process_index
    _, acp_net, acp, saved = run(directory, acp=True)
    _, resumed_net, resumed, _ = run(directory, acp=True, resume=True, seed=123)
    resumed["factors_continue"] = same_factors(resumed.pop("start_factors"), saved["factors"])
    resumed["same_as_uninterrupted"] = torch.equal(flat(resumed_net), flat(acp_net))
    report(directory, "accelerate", rank, dense_bytes=gradient_bytes(net), plain=plain, acp=acp,
           saved_step=saved["step"], saved_residual=saved["residual"],
           rank_file=os.path.isfile(os.path.join(directory, "ckpt",
                                                 f"hvd_acp_state_rank{rank}.pt")),
           resumed=resumed)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
