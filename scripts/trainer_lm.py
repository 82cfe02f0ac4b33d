"""A Hugging Face ``Trainer`` user's language model: GPT-2 from a config, ACP-SGD in one line.

    torchrun --nproc-per-node 2 scripts/trainer_lm.py --method acp      # register_acp(trainer)
    torchrun --nproc-per-node 2 scripts/trainer_lm.py --method ddp      # the Trainer's own DDP

A recipe hvd_acp's defaults were not tuned on: ``transformers.GPT2LMHeadModel``
built from a small ``GPT2Config`` (no download; byte vocabulary, the token
embedding tied to the output layer, ``Conv1D`` layers whose weights are
stored as (in, out)), trained by the ``Trainer`` with what it does by
default (torch's AdamW with betas (0.9, 0.999), gradient clipping to norm 1)
plus what a user sets: a learning rate, cosine decay after a linear warm-up,
weight decay. The corpus is the ``transformers`` package's own ``*.py``
sources (a third text, beside the standard library of
``examples/train_lm.py`` and torch's sources of ``scripts/user_lm.py``),
split into train and validation by a hash of the path.

The only difference between ``--method ddp`` and ``--method acp`` is the
line ``register_acp(trainer, matrix_rank=...)``; with no ``--matrix-rank``
the library chooses. Rank 0 writes ``--summary`` JSON: the final validation
loss (``trainer.evaluate()``), the bytes each rank sent per step and S-SGD's.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import zlib
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from hvd_acp.comm import leave_process_group
from hvd_acp.integrations.transformers import register_acp
from hvd_acp.plan.units import matrix_rank_type

VALIDATION_BUCKET = 10


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=("ddp", "acp"), default="acp")
    parser.add_argument("--matrix-rank", type=matrix_rank_type, default=None,
                        help="an int, or 'auto'; default: the library's default")
    parser.add_argument("--step-ahead", type=float, default=None,
                        help="register_acp(step_ahead=...); default: the library's")
    parser.add_argument("--fp16-wire", choices=("on", "off"), default=None,
                        help="register_acp(fp16_wire=...); default: the library's")
    parser.add_argument("--both-factors", choices=("on", "off"), default=None,
                        help="register_acp(both_factors=...); default: the library's")
    parser.add_argument("--budget", type=float, default=None,
                        help="register_acp(budget=...): the share of S-SGD's bytes a step may send")
    parser.add_argument("--int8-factors", action="store_true",
                        help="register_acp(int8_factors=True): the factors as 8-bit levels")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="register_acp(warmup_steps=...): exact steps first; default: "
                             "the library's")
    parser.add_argument("--lr", type=float, default=2e-3,
                        help="peak learning rate (default: S-SGD's best of the sweep in "
                             "docs/convergence.md)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup-ratio", type=float, default=0.1,
                        help="share of the steps in linear warm-up")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--val-windows", type=int, default=512)
    parser.add_argument("--corpus-mb", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summary", default=None)
    return parser.parse_args(argv)


def load_corpus(limit_mb: float):
    """transformers' *.py sources (sorted, up to ``limit_mb`` MB): (train, val) uint8 tensors."""
    root = Path(transformers.__file__).parent
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    parts = {True: [], False: []}
    total = 0
    for path in files:
        data = path.read_bytes()
        bucket = zlib.crc32(path.relative_to(root).as_posix().encode()) % VALIDATION_BUCKET
        parts[bucket == 0].append(data)
        total += len(data)
        if total > limit_mb * 1e6:
            break
    train, val = b"\n\n".join(parts[False]), b"\n\n".join(parts[True])
    return (torch.frombuffer(bytearray(train), dtype=torch.uint8).clone(),
            torch.frombuffer(bytearray(val), dtype=torch.uint8).clone())


class RandomWindows(torch.utils.data.Dataset):
    """``count`` windows of ``seq_len`` bytes at seeded random offsets (a
    fresh text for every step of a short run)."""

    def __init__(self, data: torch.Tensor, seq_len: int, count: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(data) - seq_len, (count,), generator=generator)
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int):
        start = int(self.starts[index])
        ids = self.data[start:start + self.seq_len].long()
        return {"input_ids": ids, "labels": ids}


class EvenWindows(RandomWindows):
    """``count`` windows spread evenly over ``data`` (the validation set)."""

    def __init__(self, data: torch.Tensor, seq_len: int, count: int):
        stride = (len(data) - seq_len) // max(count - 1, 1)
        self.starts = torch.arange(count) * stride
        self.data, self.seq_len = data, seq_len


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    train, val = load_corpus(args.corpus_mb)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=args.d_model,
                        n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)
    out = tempfile.mkdtemp(prefix="trainer_lm_")
    training = TrainingArguments(
        output_dir=out, use_cpu=not torch.cuda.is_available(), max_steps=args.steps,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=64,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=args.warmup_ratio,
        weight_decay=args.weight_decay, seed=args.seed, data_seed=args.seed,
        save_strategy="no", eval_strategy="no", logging_steps=50, report_to="none",
        disable_tqdm=True, ddp_find_unused_parameters=False, ddp_backend="gloo")
    dataset = RandomWindows(train, args.seq_len, args.steps * args.batch_size * world, args.seed)
    trainer = Trainer(model=model, args=training, train_dataset=dataset,
                      eval_dataset=EvenWindows(val, args.seq_len, args.val_windows))
    settings = {"matrix_rank": args.matrix_rank, "step_ahead": args.step_ahead,
                "warmup_steps": args.warmup_steps,
                "fp16_wire": None if args.fp16_wire is None else args.fp16_wire == "on",
                "both_factors": None if args.both_factors is None else args.both_factors == "on",
                "int8_factors": args.int8_factors or None, "budget": args.budget}
    acp = register_acp(trainer, **settings) if args.method == "acp" else None
    start = time.time()
    result = trainer.train()
    wall = time.time() - start
    final = trainer.evaluate()["eval_loss"]
    if trainer.is_world_process_zero():
        dense = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        sent = acp.state.comm_stats.bytes_sent / result.global_step if acp else dense
        summary = {"method": args.method, "matrix_rank": args.matrix_rank,
                   "budget": args.budget, "lr": args.lr, "seed": args.seed, "world_size": world,
                   "steps": result.global_step,
                   "val_loss": final, "bytes_per_step": sent,
                   "ssgd_bytes_per_step": dense, "wall_s": wall,
                   "ranks": acp.state.compression.ranks() if acp else None,
                   "settings": ({key: value if isinstance(value, (int, float, bool, type(None)))
                                 else str(value)
                                 for key, value in acp.state.settings.as_kwargs().items()}
                                if acp else None)}
        print(f"final validation loss {final:.4f}; bytes per step and rank {sent:,.0f} "
              f"(S-SGD {dense:,}: {dense / sent:.2f}x less)", flush=True)
        if args.summary:
            Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
            Path(args.summary).write_text(json.dumps(summary, indent=1))
    leave_process_group()       # no abort at exit (hvd_acp.comm.leave_process_group)


if __name__ == "__main__":
    main()
