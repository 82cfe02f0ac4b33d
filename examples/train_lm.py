"""Train a small byte-level transformer language model on Python's own source.

    horovodrun -np 2 -H localhost:2 --gloo python examples/train_lm.py --optimizer acp

The corpus is the standard library's ``*.py`` files
(``sysconfig.get_paths()['stdlib']``, third-party ``site-packages`` left
out), present wherever Python is. Files are split into train and validation
by a hash of their path, so the split does not depend on the seed or on the
order the file system lists them in. Tokens are bytes (vocabulary 256).

The model is ``torch.nn.TransformerEncoder`` with a causal mask, learned
positions and a linear head. The corpus (about 30 MB) holds far more text
than a few CPU-minutes can read, so an "epoch" here is ``--steps-per-epoch``
optimizer steps, after which rank 0 reports validation loss and perplexity;
training windows are drawn without replacement over the whole run, so no
window is read twice.

AdamW with linear warm-up and cosine decay, wrapped for Horovod by the one
line that differs between methods (``--optimizer``, in ``main``)::

    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=...)      # S-SGD
    optimizer = hvd_acp.DistributedOptimizer(optimizer, named_parameters=...)  # ACP-SGD
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import sysconfig
import time
import zlib
from pathlib import Path
from typing import List, Tuple

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import hvd_acp
from common import (BASELINES, ByteMeter, add_baseline_args, add_training_args,
                    allreduce_sums, build_baseline, check_method_flags, finish_run,
                    settings_of)

VOCAB_SIZE = 256
VALIDATION_BUCKET = 10   # one file in ten (by path hash) is validation
#: ``--optimizer``: Horovod's S-SGD, hvd_acp's compressors, the baselines.
OPTIMIZERS = ("ssgd", "ssgd-fp16", "powersgd", "acp", "acp-fp16", "acp-nooverlap",
              "acp-nofusion", "diloco", "demo", "tsr")
#: Those that take --warmup-steps, --step-ahead and --both-factors.
COMPRESSORS = ("powersgd", "acp", "acp-fp16", "acp-nooverlap", "acp-nofusion")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="acp",
                        help="ssgd: hvd.DistributedOptimizer; ssgd-fp16: the same with "
                             "hvd.Compression.fp16; powersgd: hvd_acp.PowerSGDOptimizer; acp: "
                             "hvd_acp.DistributedOptimizer; acp-fp16: the same with "
                             "hvd.Compression.fp16; acp-nooverlap: overlap=False; "
                             "acp-nofusion: fusion_threshold_bytes=0; diloco: "
                             "hvd_acp.baselines.DiLoCoOptimizer; demo: "
                             "hvd_acp.baselines.DeMoOptimizer; tsr: "
                             "hvd_acp.baselines.TSROptimizer (default: %(default)s)")
    add_training_args(parser, epochs=10, lr=4e-3, batch_size=16)
    add_baseline_args(parser)
    parser.add_argument("--steps-per-epoch", type=int, default=100,
                        help="optimizer steps between two validations")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per training window")
    parser.add_argument("--d-model", type=int, default=128, help="width of the transformer")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--lr-warmup-steps", type=int, default=30,
                        help="steps of linear learning-rate warm-up before cosine decay")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    parser.add_argument("--both-factors", choices=("on", "off"), default=None,
                        help="acp: both factors every step (on) or P and Q in turn (off); "
                             "default: the library's (on for adaptive optimizers)")
    parser.add_argument("--int8-factors", action="store_true",
                        help="acp: the factors as 8-bit levels on the wire (int8_factors=True: "
                             "half of fp16's bytes)")
    parser.add_argument("--budget", type=float, default=None,
                        help="acp: the share of S-SGD's bytes a step may send (budget=...: "
                             "the library picks the rank and the wire; e.g. 0.077 for 1/13)")
    parser.add_argument("--update", choices=("adamw", "sign"), default="adamw",
                        help="sign: the matrices step by the sign of their averaged gradient "
                             "(the DeMo-style update), the 1-D tensors by AdamW "
                             "(scripts/sign_adamw.py, a study of scripts/lm_study.py, not "
                             "part of the example); with --optimizer acp, ACP-SGD carrying "
                             "error-fed momentum")
    parser.add_argument("--val-windows", type=int, default=256,
                        help="validation windows of --seq-len tokens, spread evenly over "
                             "the validation files")
    args = parser.parse_args(argv)
    check_method_flags(args, COMPRESSORS)
    return args


# -------------------------------------------------------------------- corpus
def stdlib_sources() -> List[Path]:
    """The standard library's ``*.py`` files, sorted; site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs
                            if d not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(Path(directory, n) for n in names if n.endswith(".py"))
    return sorted(files)


def is_validation(path: Path, root: Path) -> bool:
    """Deterministic split by file: a hash of the path relative to the stdlib."""
    return zlib.crc32(path.relative_to(root).as_posix().encode()) % VALIDATION_BUCKET == 0


def load_corpus() -> Tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes, validation bytes, description), each a uint8 tensor.

    Files are joined with a blank line between them.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = {True: [], False: []}
    for path in stdlib_sources():
        parts[is_validation(path, root)].append(path.read_bytes())
    train, val = b"\n\n".join(parts[False]), b"\n\n".join(parts[True])
    info = {"root": str(root), "train_files": len(parts[False]),
            "val_files": len(parts[True]), "train_bytes": len(train), "val_bytes": len(val)}
    return (torch.frombuffer(bytearray(train), dtype=torch.uint8),
            torch.frombuffer(bytearray(val), dtype=torch.uint8), info)


class Windows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes: (input, target) pairs."""

    def __init__(self, data: torch.Tensor, seq_len: int):
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int):
        chunk = self.data[index * self.seq_len:(index + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


def validation_windows(data: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """``count`` windows of ``seq_len + 1`` bytes spread evenly over ``data``.

    Returns:
        shape (count, seq_len + 1), int64.
    """
    stride = (len(data) - seq_len - 1) // max(count - 1, 1)
    starts = torch.arange(count) * stride
    return torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).long()


# --------------------------------------------------------------------- model
class TransformerLM(nn.Module):
    """Causal byte-level language model on ``nn.TransformerEncoder`` (pre-norm)."""

    def __init__(self, seq_len: int, d_model: int, layers: int, heads: int):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB_SIZE, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE)
        self.register_buffer("causal_mask",
                             nn.Transformer.generate_square_subsequent_mask(seq_len),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: shape (batch, t), t <= seq_len; returns logits (batch, t, 256)."""
        t = tokens.shape[1]
        x = self.tokens(tokens) + self.positions(torch.arange(t, device=tokens.device))
        x = self.encoder(x, mask=self.causal_mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


@torch.no_grad()
def evaluate(model: nn.Module, windows: torch.Tensor) -> dict:
    """Mean validation loss per byte (nats) and perplexity, over all ranks' shares."""
    model.eval()
    mine = windows[hvd.rank()::hvd.size()]
    loss_sum = 0.0
    for batch in mine.split(64):
        logits = model(batch[:, :-1])
        loss_sum += F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1),
                                    reduction="sum").item()
    sums = allreduce_sums({"loss": loss_sum, "tokens": mine[:, 1:].numel()}, name="eval.val")
    model.train()
    loss = sums["loss"] / sums["tokens"]
    return {"loss": loss, "ppl": math.exp(loss)}


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up to 1, then cosine decay to 0.1 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def benchmark_model(batch_size: int):
    """This script's model for the benchmark (``python -m benchmarks --model
    examples/train_lm.py:benchmark_model``, whose workers find ``common``
    beside this file): the TransformerLM that :func:`main` trains with its
    default arguments, a batch of ``batch_size`` random windows of the
    default ``--seq-len`` tokens, and the training loss. It calls no
    ``hvd.init()`` and reads no corpus.

    Returns:
        ``(model, batch, loss_fn)``: ``batch`` is (inputs, targets), each of
        shape (batch_size, seq_len), int64; ``loss_fn(model, batch)`` is
        main()'s cross-entropy per token.
    """
    args = parse_args([])

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        inputs, targets = batch
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))

    model = TransformerLM(args.seq_len, args.d_model, args.layers, args.heads)
    windows = torch.randint(0, VOCAB_SIZE, (batch_size, args.seq_len + 1))
    return model, (windows[:, :-1], windows[:, 1:]), loss_fn


def sign_adamw():
    """``SignAdamW`` of scripts/sign_adamw.py (``--update sign``), loaded from its file."""
    path = Path(__file__).resolve().parent.parent / "scripts" / "sign_adamw.py"
    spec = importlib.util.spec_from_file_location("sign_adamw", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SignAdamW


def main(argv=None) -> dict:
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    is_root = hvd.rank() == 0

    train_data, val_data, corpus = load_corpus()
    train_set = Windows(train_data, args.seq_len)
    val_windows = validation_windows(val_data, args.seq_len, args.val_windows)
    # One shuffle for the whole run; each rank reads its own shard of it.
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                 shuffle=True, seed=args.seed)
    batches = iter(DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              drop_last=True))

    model = TransformerLM(args.seq_len, args.d_model, args.layers, args.heads)
    lr = args.lr * hvd.size()
    update = sign_adamw() if args.update == "sign" else torch.optim.AdamW
    optimizer = update(model.parameters(), lr=lr, weight_decay=args.weight_decay)

    # The swap. hvd_acp's compressors take these settings (None: the library's default).
    acp_args = dict(matrix_rank=args.matrix_rank, warmup_steps=args.warmup_steps,
                    seed=args.seed, step_ahead=args.step_ahead,
                    both_factors=None if args.both_factors is None else args.both_factors == "on",
                    int8_factors=args.int8_factors or None, budget=args.budget)
    if args.optimizer == "ssgd":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    elif args.optimizer == "ssgd-fp16":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=hvd.Compression.fp16)
    elif args.optimizer == "powersgd":
        optimizer = hvd_acp.PowerSGDOptimizer(
            optimizer, named_parameters=model.named_parameters(), **acp_args)
    elif args.optimizer == "acp":
        optimizer = hvd_acp.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), **acp_args)
    elif args.optimizer == "acp-fp16":          # its buffers in fp16 on the wire
        optimizer = hvd_acp.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16, **acp_args)
    elif args.optimizer == "acp-nooverlap":     # an ablation: all-reduces after backward
        optimizer = hvd_acp.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), overlap=False, **acp_args)
    elif args.optimizer == "acp-nofusion":      # an ablation: one all-reduce per tensor
        optimizer = hvd_acp.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), fusion_threshold_bytes=0,
            **acp_args)
    elif args.optimizer in BASELINES:           # DiLoCo, DeMo-style, TSR-style
        optimizer = build_baseline(args, optimizer, model)
    total_steps = args.epochs * args.steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, args.lr_warmup_steps, total_steps))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    meter = ByteMeter(optimizer, model, fp16=args.optimizer == "ssgd-fp16")

    if is_root:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"stdlib corpus: {corpus['train_files']} train files "
              f"({corpus['train_bytes'] / 1e6:.1f} MB), {corpus['val_files']} validation "
              f"files ({corpus['val_bytes'] / 1e6:.1f} MB); model {n_params / 1e6:.2f} M "
              f"parameters; {hvd.size()} ranks, optimizer {args.optimizer}, matrix rank "
              f"{args.matrix_rank}, lr {lr:g}", flush=True)

    history = {"val_loss": [], "val_ppl": [], "train_loss": [], "step": [], "train_s": []}
    initial = evaluate(model, val_windows)
    if is_root:
        print(f"step     0  val loss {initial['loss']:.4f}  val ppl {initial['ppl']:.2f}",
              flush=True)
    steps, train_s = 0, 0.0
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        epoch_start = time.perf_counter()
        loss_sum = 0.0
        bar = tqdm(range(args.steps_per_epoch), desc=f"epoch {epoch}/{args.epochs}",
                   leave=False, disable=not is_root or args.no_progress)
        for _ in bar:
            inputs, targets = next(batches)
            optimizer.zero_grad()
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))
            loss.backward()
            optimizer.step()
            scheduler.step()
            steps += 1
            loss_sum += loss.item()
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"training loss is {loss.item()} at step {steps}")
        if epoch == args.epochs and args.optimizer == "diloco" and optimizer.pending_inner_steps:
            optimizer.outer_step()      # DiLoCo ends on an outer step: the replicas agree
        train_s += time.perf_counter() - epoch_start

        train = allreduce_sums({"loss": loss_sum, "steps": args.steps_per_epoch},
                               name="eval.train")
        # DiLoCo is scored on the weights of its last outer step, which every rank shares.
        with (optimizer.global_weights() if args.optimizer == "diloco"
              else contextlib.nullcontext()):
            val = evaluate(model, val_windows)
        history["val_loss"].append(val["loss"])
        history["val_ppl"].append(val["ppl"])
        history["train_loss"].append(train["loss"] / train["steps"])
        history["step"].append(steps)
        history["train_s"].append(train_s)
        if is_root:
            print(f"step {steps:5d}  epoch {epoch:3d}  train loss "
                  f"{history['train_loss'][-1]:.4f}  val loss {val['loss']:.4f}  "
                  f"val ppl {val['ppl']:.2f}", flush=True)
    wall_s = time.perf_counter() - start

    return finish_run(
        args, meter, history, steps, wall_s, train_s,
        fields={"example": "stdlib_lm", "optimizer": args.optimizer,
                "val_loss": history["val_loss"][-1], "val_ppl": history["val_ppl"][-1],
                "initial_val_loss": initial["loss"],
                "val_loss_per_epoch": history["val_loss"],
                "val_ppl_per_epoch": history["val_ppl"], "corpus": corpus},
        config={"effective_lr": lr,
                "parameters": sum(p.numel() for p in model.parameters()),
                **settings_of(optimizer)},
        final_line=f"final val loss {history['val_loss'][-1]:.4f} "
                   f"(ppl {history['val_ppl'][-1]:.2f}), wall time {wall_s:.1f} s")


if __name__ == "__main__":
    main()
