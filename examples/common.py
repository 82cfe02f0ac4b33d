"""Bookkeeping shared by the example scripts; the optimizer swap is in each script.

- the flags every example takes (:func:`add_training_args`,
  :func:`add_framework_args`), the baselines' flags
  (:func:`add_baseline_args`) and which method takes which flag
  (:func:`check_method_flags`);
- what every script reports: bytes each rank sent against what S-SGD would
  have sent (:class:`ByteMeter`), metrics summed over ranks
  (:func:`allreduce_sums`), the ``--summary`` JSON (:func:`finish_run`),
  over Horovod or, for the DDP example, ``torch.distributed``
  (:class:`TorchCollectives`);
- the digits data (scikit-learn's bundled 8x8 handwritten digits, no
  download), its fixed train/test split and the small CNN trained on it.

Imported as ``common`` by scripts run from this directory
(``python examples/train.py`` puts ``examples/`` first on ``sys.path``).
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from hvd_acp.plan.units import matrix_rank_type


# ----------------------------------------------------------------- arguments
def add_training_args(parser: argparse.ArgumentParser, *, epochs: int,
                      lr: float, batch_size: int) -> None:
    """The flags of every example but the choice of optimizer (or DDP hook)."""
    parser.add_argument("--matrix-rank", type=matrix_rank_type, default=None,
                        help="rank of the low-rank factors, a share of each matrix's smaller "
                             "side such as 0.5, or 'auto' for a rank per tensor (default: "
                             "the library's, which depends on the optimizer)")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="steps of exact averaging before compression starts "
                             "(default: %(default)s)")
    parser.add_argument("--step-ahead", type=float, default=None,
                        help="step-ahead error feedback of acp and powersgd: the next "
                             "gradient is taken at w - lr * a * E; 0 switches it off "
                             "(default: the library's)")
    parser.add_argument("--epochs", type=int, default=epochs,
                        help="epochs to train (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=lr,
                        help="learning rate of one rank; multiplied by the number of "
                             "ranks as in Horovod's examples (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=batch_size,
                        help="batch size per rank (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the model, the data order and the initial "
                             "factors (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar on rank 0")
    parser.add_argument("--summary", metavar="PATH",
                        help="rank 0 writes the results and the config to PATH as JSON")


def add_framework_args(parser: argparse.ArgumentParser, *, out: str) -> None:
    """The flags of the framework examples (Lightning, Accelerate, the Trainer)."""
    parser.add_argument("--no-acp", action="store_true", help="plain DDP averaging")
    parser.add_argument("--matrix-rank", type=matrix_rank_type, default=None,
                        help="default: the library's, which depends on the optimizer")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.025, help="per process; scaled by it")
    parser.add_argument("--out", default=out, help="checkpoints (default: %(default)s)")


#: The baselines' flags: the ``--optimizer`` that takes each, the keyword of
#: its optimizer (``hvd_acp.baselines``) that it sets, its type and its help
#: (left out: the library's default).
BASELINE_FLAGS = {
    "--diloco-h": ("diloco", "inner_steps", int,
                   "DiLoCo's inner steps H between two outer steps (library: 500, the paper's)"),
    "--diloco-outer-lr": ("diloco", "outer_lr", float,
                          "DiLoCo's outer learning rate (library: 0.7)"),
    "--diloco-outer-momentum": ("diloco", "outer_momentum", float,
                                "DiLoCo's outer Nesterov momentum (library: 0.9)"),
    "--demo-k": ("demo", "top_k", int,
                 "DeMo: DCT coefficients each rank sends per chunk (library: 8)"),
    "--demo-chunk": ("demo", "chunk_size", int, "DeMo: elements per DCT chunk (library: 64)"),
    "--demo-beta": ("demo", "momentum_decay", float,
                    "DeMo: decay of each rank's momentum (library: 0.999)"),
    "--tsr-rank": ("tsr", "core_rank", int,
                   "TSR: side r of each matrix's core, columns of its bases (library: 32)"),
    "--tsr-k": ("tsr", "refresh_period", int,
                "TSR: steps K between two refreshes of the bases (library: 10)"),
    "--tsr-embedding-rank": ("tsr", "embedding_core_rank", int,
                             "TSR: r of the nn.Embedding weights (library: --tsr-rank's)"),
    "--tsr-embedding-k": ("tsr", "embedding_refresh_period", int,
                          "TSR: K of the nn.Embedding weights (library: --tsr-k's)"),
    "--tsr-scale": ("tsr", "scale", float, "TSR: factor of the update (library: 1)"),
}


#: ``--optimizer`` of each baseline -> its class in ``hvd_acp.baselines``.
BASELINES = {"diloco": "DiLoCoOptimizer", "demo": "DeMoOptimizer", "tsr": "TSROptimizer"}


def build_baseline(args: argparse.Namespace, optimizer: torch.optim.Optimizer,
                   model: nn.Module):
    """``--optimizer diloco``, ``demo`` or ``tsr`` (:data:`BASELINES`) around
    ``optimizer``, with the keywords its flags set (:data:`BASELINE_FLAGS`;
    ``None``: the library's default); TSR also takes ``--seed`` and the
    model's ``nn.Embedding`` weights as its embeddings."""
    import hvd_acp.baselines as baselines
    settings = {keyword: getattr(args, keyword)
                for method, keyword, _, _ in BASELINE_FLAGS.values() if method == args.optimizer}
    if args.optimizer == "tsr":
        settings.update(seed=args.seed,
                        embedding_names=baselines.embedding_parameter_names(model))
    return getattr(baselines, BASELINES[args.optimizer])(
        optimizer, named_parameters=model.named_parameters(), **settings)


def add_baseline_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``--optimizer diloco``, ``demo`` and ``tsr``
    (:data:`BASELINE_FLAGS`), each stored under the keyword it sets
    (``args.inner_steps``, ...)."""
    group = parser.add_argument_group(
        "baselines", "settings of --optimizer diloco, demo and tsr; left out: the library's "
        "defaults (hvd_acp.baselines.settings)")
    for flag, (_, keyword, kind, text) in BASELINE_FLAGS.items():
        group.add_argument(flag, type=kind, default=None, dest=keyword, help=text)


def check_method_flags(args: argparse.Namespace, compressors: Sequence[str]) -> None:
    """Exit, saying why, where a flag is given that ``args.optimizer`` does not take.

    A baseline's flags (:data:`BASELINE_FLAGS`) apply to that baseline only;
    ``--warmup-steps``, ``--step-ahead``, ``--both-factors``,
    ``--int8-factors``, ``--budget`` and ``--diagnostics`` (where the script has them) to ``compressors``, the
    methods of hvd_acp that compress. ``--matrix-rank`` is left to the
    methods that compress nothing, which ignore it.

    Raises:
        SystemExit: with the flags and the methods they apply to.
    """
    misplaced = {keyword: method for method, keyword, _, _ in BASELINE_FLAGS.values()
                 if getattr(args, keyword, None) is not None and method != args.optimizer}
    if misplaced:
        raise SystemExit(f"--optimizer {args.optimizer} takes no {', '.join(sorted(misplaced))}: "
                         "those flags apply to " + " or ".join(dict.fromkeys(misplaced.values())))
    if args.optimizer not in compressors and (
            getattr(args, "warmup_steps", 0) or getattr(args, "step_ahead", None) is not None
            or getattr(args, "diagnostics", None)
            or getattr(args, "both_factors", None) is not None
            or getattr(args, "int8_factors", False)
            or getattr(args, "budget", None) is not None):
        raise SystemExit("--warmup-steps, --step-ahead, --both-factors, --int8-factors, "
                         "--budget and --diagnostics only apply to --optimizer acp or powersgd")


# ------------------------------------------------------------------- metrics
def allreduce_sums(sums: Dict[str, float], name: str) -> Dict[str, float]:
    """Sum each value over all ranks (one all-reduce, float64)."""
    import horovod.torch as hvd
    keys = sorted(sums)
    local = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64)
    total = hvd.allreduce(local, op=hvd.Sum, name=name)
    return dict(zip(keys, total.tolist()))


class HorovodCollectives:
    """The few collectives the bookkeeping needs, over Horovod."""

    def rank(self) -> int:
        import horovod.torch as hvd
        return hvd.rank()

    def size(self) -> int:
        import horovod.torch as hvd
        return hvd.size()

    def allgather_object(self, obj, name: str) -> list:
        import horovod.torch as hvd
        return hvd.allgather_object(obj, name=name)

    def allreduce_sums(self, sums: Dict[str, float], name: str) -> Dict[str, float]:
        return allreduce_sums(sums, name)

    def versions(self) -> Dict[str, str]:
        import horovod
        return {"torch": torch.__version__, "horovod": horovod.__version__}


class TorchCollectives(HorovodCollectives):
    """The same over ``torch.distributed`` (the DDP example); no Horovod."""

    def rank(self) -> int:
        import torch.distributed as dist
        return dist.get_rank()

    def size(self) -> int:
        import torch.distributed as dist
        return dist.get_world_size()

    def allgather_object(self, obj, name: str) -> list:
        import torch.distributed as dist
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def allreduce_sums(self, sums: Dict[str, float], name: str) -> Dict[str, float]:
        import torch.distributed as dist
        keys = sorted(sums)
        total = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(total)
        return dict(zip(keys, total.tolist()))

    def versions(self) -> Dict[str, str]:
        import torch.distributed as dist
        return {"torch": torch.__version__, "backend": dist.get_backend()}


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of one full gradient of ``model``: what S-SGD sends per step."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class ByteMeter:
    """Bytes this rank put into gradient all-reduces, next to S-SGD's.

    hvd_acp's optimizers count their own traffic (``comm_stats``);
    ``hvd.DistributedOptimizer`` does not, so for S-SGD the count is one
    full gradient per step, which is what it submits (half of it with
    ``fp16``: ``hvd.Compression.fp16`` sends each float32 gradient as
    float16). An all-reduce hands
    back as many bytes as it was handed (the TSR-style method's one
    all-reduce too); the DeMo-style method's all-gather hands back every
    other rank's part, which its ``comm_stats`` count.
    """

    def __init__(self, optimizer, model: nn.Module, fp16: bool = False):
        self._stats = getattr(optimizer, "comm_stats", None)
        self._start = self._stats.bytes_sent if self._stats is not None else 0
        self._start_received = getattr(self._stats, "bytes_received", 0)
        self.dense_bytes_per_step = gradient_bytes(model)
        self._fp16 = fp16

    def sent(self, steps: int) -> int:
        if self._stats is None:
            return steps * (self.dense_bytes_per_step // 2 if self._fp16
                            else self.dense_bytes_per_step)
        return self._stats.bytes_sent - self._start

    def received(self, steps: int) -> int:
        if not getattr(self._stats, "allgathers", 0):
            return self.sent(steps)
        return self._stats.bytes_received - self._start_received

    def ssgd(self, steps: int) -> int:
        return steps * self.dense_bytes_per_step

    def report(self, steps: int, collectives: Optional[HorovodCollectives] = None
               ) -> Dict[str, object]:
        """Per-rank counts gathered from every rank (a collective: call on all ranks)."""
        collectives = collectives or HorovodCollectives()
        counts = collectives.allgather_object((self.sent(steps), self.received(steps)),
                                              name="bytes_sent")
        by_rank = [int(sent) for sent, _ in counts]
        ssgd = self.ssgd(steps)
        return {
            "bytes_sent_per_rank": max(by_rank),
            "bytes_sent_by_rank": by_rank,
            "bytes_received_per_rank": max(int(received) for _, received in counts),
            "ssgd_bytes_per_rank": ssgd,
            "compression_ratio": ssgd / max(by_rank) if max(by_rank) else None,
        }


def format_bytes_report(report: Dict[str, object], steps: int) -> str:
    sent, ssgd = report["bytes_sent_per_rank"], report["ssgd_bytes_per_rank"]
    ratio = report["compression_ratio"]
    return (f"bytes sent per rank: {sent / 1e6:.3f} MB over {steps} steps "
            f"(by rank: {', '.join(f'{b / 1e6:.3f}' for b in report['bytes_sent_by_rank'])}"
            f" MB); S-SGD would send {ssgd / 1e6:.3f} MB: "
            + (f"{ratio:.1f}x less" if ratio else "n/a"))


def settings_of(optimizer) -> Dict[str, object]:
    """``{"settings": ...}``: the ACP-SGD settings a run trained with, every
    default decided (``hvd_acp.Settings``), for the summary's config; empty
    for a method without them."""
    settings = getattr(optimizer, "settings", None)
    if not hasattr(settings, "as_kwargs"):
        return {}
    return {"settings": {key: value if isinstance(value, (int, float, str, bool)) or value is None
                         else str(value) for key, value in settings.as_kwargs().items()}}


def finish_run(args: argparse.Namespace, meter: "ByteMeter", history: Dict[str, list],
               steps: int, wall_s: float, train_s: float, fields: Dict[str, object],
               config: Dict[str, object], final_line: str,
               collectives: Optional[HorovodCollectives] = None) -> dict:
    """The ``--summary`` of a run: the script's own ``fields`` and ``config``
    entries around the record every example keeps (per-epoch train loss,
    steps and training time, bytes sent, arguments and versions).

    A collective (the byte counts are gathered): call on every rank. Rank 0
    prints the bytes report and ``final_line`` and writes the summary.
    ``collectives`` defaults to Horovod's.
    """
    collectives = collectives or HorovodCollectives()
    report = meter.report(steps, collectives)
    summary = {
        **fields,
        "train_loss_per_epoch": history["train_loss"],
        "step_per_epoch": history["step"],
        "train_s_per_epoch": history["train_s"],
        "steps": steps,
        "wall_s": wall_s,
        "train_s": train_s,
        **report,
        "config": {**vars(args), "world_size": collectives.size(), **config,
                   **collectives.versions()},
    }
    if collectives.rank() == 0:
        print(format_bytes_report(report, steps), flush=True)
        print(final_line, flush=True)
        write_summary(args.summary, summary)
    return summary


def write_summary(path: Optional[str], summary: dict) -> None:
    """Write ``summary`` as JSON to ``path`` (rank 0 calls this)."""
    if not path:
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


# -------------------------------------------------------------------- digits
DIGITS_TEST_FRACTION = 0.25
DIGITS_SPLIT_SEED = 0


def load_digits_split() -> Tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """scikit-learn's 1797 handwritten digits, split once and for all.

    The split (75% train, 25% test, stratified) does not depend on the
    training seed, so runs with different seeds are scored on the same test
    set. Pixels are standardized with the training set's mean and std.

    Returns:
        (train, test) datasets of (image, label): image shape (1, 8, 8)
        float32, label int64.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        torch.arange(len(labels)).numpy(), test_size=DIGITS_TEST_FRACTION,
        random_state=DIGITS_SPLIT_SEED, stratify=labels.numpy())
    train_idx, test_idx = torch.from_numpy(train_idx), torch.from_numpy(test_idx)
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    return (torch.utils.data.TensorDataset(images[train_idx], labels[train_idx]),
            torch.utils.data.TensorDataset(images[test_idx], labels[test_idx]))


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and two linear layers for 8x8 grey images.

    Weights (out, in, kh, kw) of shapes (32, 1, 3, 3), (64, 32, 3, 3),
    (128, 1024), (10, 128): at matrix rank 4 all but the first are sent as
    low-rank factors; the first and the biases go uncompressed.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(),
            nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: shape (batch, 1, 8, 8); returns logits of shape (batch, 10)."""
        return self.classifier(self.features(x))


class _Residual(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input, then ReLU (a ResNet basic block)."""

    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
            nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class DigitsResNet(nn.Module):
    """A small BatchNorm ResNet for 8x8 grey images: a stem, two basic blocks
    at 32 channels, a strided convolution to 64, two blocks at 64, global
    average pooling and a linear head (``--arch resnet`` of examples/train.py)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            _Residual(32), _Residual(32),
            nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64),
            nn.ReLU(), _Residual(64), _Residual(64),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: shape (batch, 1, 8, 8); returns logits of shape (batch, 10)."""
        return self.net(x)
