"""The built-in models: ``hvd-acp-plan --model NAME`` and the repository's benchmark.

``resnet50`` and ``bert-base`` are built from ``transformers`` configs with
random weights (nothing is downloaded); ``small`` is a little MLP for smoke
runs. Every model comes with a fixed synthetic batch and a loss function, so
a training step is ``loss_fn(model, batch).backward()``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict

import torch
from torch import Tensor, nn

__all__ = ["MODELS", "DEFAULT_BATCH_SIZE", "ModelSpec", "SmallNet", "build_model",
           "default_matrix_rank"]

#: Model names accepted by ``--model``.
MODELS = ("resnet50", "bert-base", "small")
#: Default batch size per rank of each model.
DEFAULT_BATCH_SIZE = {"resnet50": 8, "bert-base": 4, "small": 32}

#: Default ``matrix_rank`` per model, as in the ACP-SGD paper (4 for CNNs,
#: 32 for transformers).
_DEFAULT_MATRIX_RANK = {"resnet50": 4, "bert-base": 32, "small": 4}


@dataclasses.dataclass
class ModelSpec:
    """A model with its synthetic batch.

    Attributes:
        model: the module, in training mode.
        batch: the inputs of one step (identical at every step).
        loss_fn: ``loss_fn(model, batch)`` returns the scalar loss.
        description: what was built, for the report.
    """

    model: nn.Module
    batch: Dict[str, Tensor]
    loss_fn: Callable[[nn.Module, Dict[str, Tensor]], Tensor]
    description: str


def default_matrix_rank(model: str) -> int:
    """The paper's ``matrix_rank`` for ``model``."""
    if model not in _DEFAULT_MATRIX_RANK:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    return _DEFAULT_MATRIX_RANK[model]


class SmallNet(nn.Module):
    """A 4-layer MLP (0.66 M parameters) for smoke runs."""

    def __init__(self, in_features: int = 256, hidden: int = 512, classes: int = 10):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, classes))

    def forward(self, inputs: Tensor) -> Tensor:
        return self.layers(inputs)


def _hf_loss(model: nn.Module, batch: Dict[str, Tensor]) -> Tensor:
    return model(**batch).loss


def _small_loss(model: nn.Module, batch: Dict[str, Tensor]) -> Tensor:
    return nn.functional.cross_entropy(model(batch["inputs"]), batch["labels"])


def build_model(name: str, batch_size: int, *, image_size: int = 128, seq_len: int = 64,
                data_seed: int = 0) -> ModelSpec:
    """Build ``name`` with weights from ``torch.manual_seed(0)`` and a synthetic batch.

    Args:
        name: one of :data:`MODELS`.
        batch_size: samples per batch (per rank).
        image_size: height and width of ResNet inputs.
        seq_len: tokens per BERT sequence.
        data_seed: seed of the synthetic batch (the benchmark gives each
            rank its own).

    The weights are identical in every process that calls this with the same
    arguments, so ranks start from the same model without a broadcast (a
    broadcast of BERT's 440 MB would take half a minute on a 100 Mbit/s link).
    The global RNG is reseeded: this builds a model to measure, not one to train.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1000 + data_seed)
    if name == "small":
        model = SmallNet()
        batch = {"inputs": torch.randn(batch_size, 256, generator=gen),
                 "labels": torch.randint(0, 10, (batch_size,), generator=gen)}
        return ModelSpec(model.train(), batch, _small_loss, "MLP 256-512-512-512-10")
    if name == "resnet50":
        from transformers import ResNetConfig, ResNetForImageClassification
        config = ResNetConfig(num_labels=1000)    # the defaults are ResNet-50
        model = ResNetForImageClassification(config)
        batch = {"pixel_values": torch.randn(batch_size, 3, image_size, image_size,
                                             generator=gen),
                 "labels": torch.randint(0, 1000, (batch_size,), generator=gen)}
        return ModelSpec(model.train(), batch, _hf_loss,
                         f"transformers ResNetForImageClassification (ResNet-50, 1000 "
                         f"classes), images {image_size}x{image_size}")
    if name == "bert-base":
        from transformers import BertConfig, BertForSequenceClassification
        config = BertConfig(num_labels=2)         # the defaults are BERT-Base uncased
        model = BertForSequenceClassification(config)
        batch = {"input_ids": torch.randint(0, config.vocab_size, (batch_size, seq_len),
                                            generator=gen),
                 "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
                 "labels": torch.randint(0, 2, (batch_size,), generator=gen)}
        return ModelSpec(model.train(), batch, _hf_loss,
                         f"transformers BertForSequenceClassification (BERT-Base), "
                         f"sequence length {seq_len}")
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")
