"""A new user's transformer LM: the one-line swap on a script hvd_acp did not write.

    horovodrun -np 4 -H localhost:4 --gloo python scripts/user_lm.py --optimizer acp

A GPT-style causal byte-level transformer (its own attention blocks, not
``nn.TransformerEncoder``), trained the way such scripts are written: AdamW
with betas (0.9, 0.95) and weight decay, linear learning-rate warm-up then
cosine decay, gradients clipped to norm 1 between ``synchronize()`` and
``step()`` (Horovod's documented pattern). The corpus is torch's own Python
sources (a different text from the standard library of
``examples/train_lm.py``), split into train and validation by a hash of the
path. Only the ``--optimizer`` line differs between methods:

- ``ssgd``: ``hvd.DistributedOptimizer``; ``ssgd-fp16`` with
  ``compression=hvd.Compression.fp16``;
- ``acp``: ``hvd_acp.DistributedOptimizer`` with ``--matrix-rank`` (an int,
  a share of each matrix's smaller side, ``auto``, or left out: the
  library's default);
- ``powersgd``: ``hvd_acp.PowerSGDOptimizer`` with ``--matrix-rank``;
- ``diloco``: ``hvd_acp.DiLoCoOptimizer`` (AdamW as the inner optimizer)
  with ``--diloco-h``, ``--diloco-outer-lr``, ``--diloco-outer-momentum``;
  the run ends on an outer step;
- ``demo``: ``hvd_acp.DeMoOptimizer`` (a sign update at ``--lr`` for the
  matrices, AdamW for the 1-D tensors) with ``--demo-k``, ``--demo-chunk``,
  ``--demo-beta``;
- ``tsr``: ``hvd_acp.TSROptimizer`` (Adam in each matrix's core at the
  AdamW group's rate and betas, AdamW for the 1-D tensors; the two
  ``nn.Embedding`` weights take the embedding settings) with ``--tsr-rank``,
  ``--tsr-k``, ``--tsr-embedding-rank``, ``--tsr-embedding-k``,
  ``--tsr-scale`` and ``--fp16-wire``.

Rank 0 writes ``--summary`` JSON: final validation loss, bytes each rank
sent (and received: more than sent for ``demo``'s all-gather), and (for
``acp`` with ``auto``) the ranks chosen per tensor.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
import zlib
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

import hvd_acp
from hvd_acp.plan.units import matrix_rank_type


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", choices=("ssgd", "ssgd-fp16", "acp", "powersgd", "diloco",
                                                "demo", "tsr"),
                        default="acp")
    parser.add_argument("--matrix-rank", type=matrix_rank_type, default=None,
                        help="an int, or 'auto'; default: the library's default")
    parser.add_argument("--auto-energy", type=float, default=None,
                        help="with --matrix-rank auto: AutoRank(energy=...)")
    parser.add_argument("--auto-keep-residual", action="store_true",
                        help="with --matrix-rank auto: AutoRank(pay_residual=False)")
    parser.add_argument("--auto-max-rank", type=int, default=None,
                        help="with --matrix-rank auto: AutoRank(max_rank=...)")
    parser.add_argument("--step-ahead", type=float, default=None)
    parser.add_argument("--fp16-wire", choices=("on", "off"), default=None,
                        help="acp, powersgd, tsr: the factors (tsr: its buffer) in fp16 on "
                             "the wire or not (default: the library's)")
    parser.add_argument("--both-factors", choices=("on", "off"), default=None,
                        help="acp: both factors every step (on) or P and Q in turn (off); "
                             "default: the library's (on for adaptive optimizers)")
    parser.add_argument("--budget", type=float, default=None,
                        help="acp: the share of S-SGD's bytes a step may send (budget=...)")
    parser.add_argument("--int8-factors", action="store_true",
                        help="acp: the factors as 8-bit levels on the wire (int8_factors=True)")
    parser.add_argument("--diloco-h", type=int, default=None,
                        help="diloco: inner steps between outer steps (default: the library's)")
    parser.add_argument("--diloco-outer-lr", type=float, default=None)
    parser.add_argument("--diloco-outer-momentum", type=float, default=None)
    parser.add_argument("--demo-k", type=int, default=None,
                        help="demo: coefficients sent per chunk (default: the library's)")
    parser.add_argument("--demo-chunk", type=int, default=None)
    parser.add_argument("--demo-beta", type=float, default=None)
    parser.add_argument("--tsr-rank", type=int, default=None,
                        help="tsr: side r of each matrix's core (default: the library's)")
    parser.add_argument("--tsr-k", type=int, default=None,
                        help="tsr: steps between two refreshes of the bases (default: the "
                             "library's)")
    parser.add_argument("--tsr-embedding-rank", type=int, default=None)
    parser.add_argument("--tsr-embedding-k", type=int, default=None)
    parser.add_argument("--tsr-scale", type=float, default=None)
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="hvd_acp's exact steps before compression (default: the library's)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=1e-2,
                        help="peak learning rate (default: S-SGD's best of the sweep in "
                             "docs/convergence.md)")
    parser.add_argument("--optim", choices=("adamw", "sgd"), default="adamw",
                        help="sgd: SGD with momentum 0.9 and the same weight decay split")
    parser.add_argument("--lr-warmup", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--amp", action="store_true",
                        help="train under torch.amp.GradScaler (its default dynamic scale, "
                             "from 65536), unscaling before the clip; on CPU without "
                             "autocast, so the scaler's factor is the only difference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-mb", type=float, default=8.0)
    parser.add_argument("--summary", default=None)
    return parser.parse_args(argv)


def load_corpus(limit_mb: float):
    """torch's *.py sources (sorted, up to ``limit_mb`` MB): (train, val) uint8 tensors."""
    root = Path(torch.__file__).parent
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    parts = {True: [], False: []}
    total = 0
    for path in files:
        data = path.read_bytes()
        parts[zlib.crc32(path.relative_to(root).as_posix().encode()) % 10 == 0].append(data)
        total += len(data)
        if total > limit_mb * 1e6:
            break
    train, val = b"\n\n".join(parts[False]), b"\n\n".join(parts[True])
    return (torch.frombuffer(bytearray(train), dtype=torch.uint8),
            torch.frombuffer(bytearray(val), dtype=torch.uint8))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, seq_len: int, d: int, layers: int, heads: int):
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batch(data: torch.Tensor, starts: torch.Tensor, seq_len: int):
    chunk = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).long()
    return chunk[:, :-1], chunk[:, 1:]


def main(argv=None) -> dict:
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train, val = load_corpus(args.corpus_mb)
    model = GPT(args.seq_len, args.d_model, args.layers, args.heads)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if args.optim == "sgd":
        for group in groups:
            group["weight_decay"] *= 1e-2
        optimizer = torch.optim.SGD(groups, lr=args.lr, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    named = model.named_parameters()
    extra = {}
    if args.matrix_rank is not None:
        extra["matrix_rank"] = args.matrix_rank
    auto = {key: value for key, value in (("energy", args.auto_energy),
                                          ("max_rank", args.auto_max_rank),
                                          ("pay_residual", False if args.auto_keep_residual
                                           else None)) if value is not None}
    if auto:
        extra["matrix_rank"] = hvd_acp.AutoRank(**auto)
    if args.step_ahead is not None:
        extra["step_ahead"] = args.step_ahead
    if args.warmup_steps is not None:
        extra["warmup_steps"] = args.warmup_steps
    if args.fp16_wire is not None:
        extra["compression"] = hvd.Compression.fp16 if args.fp16_wire == "on" \
            else hvd.Compression.none
    if args.both_factors is not None:
        extra["both_factors"] = args.both_factors == "on"
    if args.int8_factors:
        extra["int8_factors"] = True
    if args.budget is not None:
        extra["budget"] = args.budget
    if args.optimizer == "tsr":
        # TSR takes --fp16-wire as its own setting, none of the compressors' others.
        compression = extra.pop("compression", None)
        fp16_wire = None if compression is None else compression is hvd.Compression.fp16
    if extra and args.optimizer in ("diloco", "demo", "tsr"):
        raise SystemExit(f"--optimizer {args.optimizer} takes none of {sorted(extra)}")
    if args.optimizer in ("ssgd", "ssgd-fp16"):
        compression = hvd.Compression.fp16 if args.optimizer == "ssgd-fp16" \
            else hvd.Compression.none
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                             compression=compression)
    elif args.optimizer == "diloco":
        optimizer = hvd_acp.DiLoCoOptimizer(optimizer, named_parameters=named,
                                            inner_steps=args.diloco_h,
                                            outer_lr=args.diloco_outer_lr,
                                            outer_momentum=args.diloco_outer_momentum)
    elif args.optimizer == "demo":
        optimizer = hvd_acp.DeMoOptimizer(optimizer, named_parameters=named,
                                          top_k=args.demo_k, chunk_size=args.demo_chunk,
                                          momentum_decay=args.demo_beta)
    elif args.optimizer == "tsr":
        optimizer = hvd_acp.TSROptimizer(
            optimizer, named_parameters=named, core_rank=args.tsr_rank,
            refresh_period=args.tsr_k, embedding_core_rank=args.tsr_embedding_rank,
            embedding_refresh_period=args.tsr_embedding_k, scale=args.tsr_scale,
            fp16_wire=fp16_wire, seed=args.seed,
            embedding_names=hvd_acp.baselines.embedding_parameter_names(model))
    elif args.optimizer == "acp":
        optimizer = hvd_acp.DistributedOptimizer(optimizer, named_parameters=named, **extra)
    else:
        optimizer = hvd_acp.PowerSGDOptimizer(optimizer, named_parameters=named, **extra)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def lr_at(step):
        if step < args.lr_warmup:
            return (step + 1) / args.lr_warmup
        progress = (step - args.lr_warmup) / max(1, args.steps - args.lr_warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    generator = torch.Generator().manual_seed(1000 * args.seed + hvd.rank())
    high = len(train) - args.seq_len - 1
    val_starts = torch.linspace(0, len(val) - args.seq_len - 2, 256).long()
    # Disabled, the scaler passes everything through: the same loop either way.
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp)
    skipped = 0
    started = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(train, torch.randint(0, high, (args.batch_size,), generator=generator),
                     args.seq_len)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        scaler.scale(loss).backward()
        optimizer.synchronize()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scale = scaler.get_scale()
        with optimizer.skip_synchronize():
            scaler.step(optimizer)
        scaler.update()
        skipped += int(scaler.get_scale() < scale)
        scheduler.step()
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"loss {loss.item()} at step {step}")
    if getattr(optimizer, "pending_inner_steps", 0):
        optimizer.outer_step()      # DiLoCo: the replicas agree again
    wall = time.perf_counter() - started

    model.eval()
    with torch.no_grad():
        mine = val_starts[hvd.rank()::hvd.size()]
        vx, vy = batch(val, mine, args.seq_len)
        total = F.cross_entropy(model(vx).reshape(-1, 256), vy.reshape(-1), reduction="sum")
    sums = hvd.allreduce(torch.tensor([float(total), float(vy.numel())], dtype=torch.float64),
                         op=hvd.Sum, name="val")
    val_loss = float(sums[0] / sums[1])
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    stats = getattr(optimizer, "comm_stats", None)
    # Horovod's optimizer counts nothing: one gradient a step, in fp16 if asked.
    dense = grad_bytes // 2 if args.optimizer == "ssgd-fp16" else grad_bytes
    sent = stats.bytes_sent if stats is not None else dense * args.steps
    received = stats.bytes_received if stats is not None else dense * args.steps
    summary = {"optimizer": args.optimizer, "optim": args.optim, "lr": args.lr,
               "matrix_rank": args.matrix_rank, "budget": args.budget, "auto": auto,
               "step_ahead": args.step_ahead, "seed": args.seed, "ranks": hvd.size(),
               "steps": args.steps, "val_loss": val_loss, "bytes_per_step": sent / args.steps,
               "bytes_received_per_step": received / args.steps,
               "ssgd_bytes_per_step": grad_bytes, "wall_s": wall}
    if args.amp:
        summary["amp"] = {"skipped_steps": skipped, "final_scale": scaler.get_scale()}
    if args.optimizer in ("diloco", "demo", "tsr"):
        summary["method_settings"] = dataclasses.asdict(optimizer.settings)
    elif args.optimizer in ("acp", "powersgd"):
        summary["settings"] = {key: value if isinstance(value, (int, float, bool, type(None)))
                               else str(value)
                               for key, value in optimizer.settings.as_kwargs().items()}
    if hasattr(optimizer, "chosen_ranks"):
        summary["chosen_ranks"] = optimizer.chosen_ranks()
    if hvd.rank() == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "chosen_ranks"}), flush=True)
        if args.summary:
            os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
            with open(args.summary, "w", encoding="utf-8") as out:
                json.dump(summary, out, indent=1)
    return summary


if __name__ == "__main__":
    main()
