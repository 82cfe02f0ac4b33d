"""The models that the planner, the A/B tool and the benchmark time.

``--model NAME`` is one of the built-in models or a model of the user's:

* ``resnet50``, ``bert-base`` and ``gpt2`` (GPT-2 small, 124 M parameters,
  its language-model head tied to the token embedding) are built from
  ``transformers`` configs with random weights (nothing is downloaded);
  ``small`` is a little MLP for smoke runs.
* ``package.module:function`` (or ``path/to/file.py:function``) names a
  function of the user's, called as ``function(batch_size)``, that returns
  ``(model, batch)`` or ``(model, batch, loss_fn)`` (:func:`build_user_model`).

Every model comes with a fixed synthetic batch and a loss function, so a
training step is ``loss_fn(model, batch).backward()``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
from torch import Tensor, nn

__all__ = ["MODELS", "DEFAULT_BATCH_SIZE", "ModelSpec", "SmallNet", "build_model",
           "build_user_model", "is_user_model", "model_file", "default_matrix_rank",
           "check_model_name", "default_batch_size", "add_model_arguments", "to_device",
           "OPTIMIZERS", "OPTIMIZER_NAMES", "optimizer_name", "build_optimizer"]

#: Model names accepted by ``--model``.
MODELS = ("resnet50", "bert-base", "gpt2", "small")
#: Default batch size per rank of each model.
DEFAULT_BATCH_SIZE = {"resnet50": 8, "bert-base": 4, "gpt2": 4, "small": 32}

#: Default batch size per rank of a user's model (``module:function``).
DEFAULT_USER_BATCH_SIZE = 32

#: The optimizers a profile can time: ``sgd``, SGD with momentum 0.9, and
#: ``adamw``, AdamW (torch's defaults otherwise), as the benchmark's
#: ``--optimizer`` names them. The family decides hvd_acp's defaults
#: (:meth:`hvd_acp.Settings.resolve`).
OPTIMIZERS = ("sgd", "adamw")
#: Each of :data:`OPTIMIZERS` in words, for reports.
OPTIMIZER_NAMES = {"sgd": "SGD (momentum 0.9)", "adamw": "AdamW"}


def optimizer_name(name: Optional[str]) -> str:
    """``--optimizer``'s value in words; None (a run before the option) is SGD."""
    name = name or "sgd"
    return OPTIMIZER_NAMES.get(name, name)


def build_optimizer(name: str, params, lr: float = 1e-3) -> torch.optim.Optimizer:
    """The optimizer ``name`` (:data:`OPTIMIZERS`) over ``params``."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


#: Default ``matrix_rank`` per model under SGD, as in the ACP-SGD paper (4
#: for CNNs, 32 for transformers).
_DEFAULT_MATRIX_RANK = {"resnet50": 4, "bert-base": 32, "gpt2": 32, "small": 4}


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


def is_user_model(name: str) -> bool:
    """Whether ``--model name`` names a user's function (``module:function``)."""
    return ":" in name


def model_file(name: str) -> Optional[Path]:
    """The file of a user's ``path/to/file.py:function`` (as given, maybe
    relative); None for a built-in model or a ``package.module:function``."""
    if not is_user_model(name):
        return None
    module = name.rpartition(":")[0]
    return Path(module) if module.endswith(".py") or os.sep in module else None


def check_model_name(name: str) -> str:
    """``name`` if it is a built-in model or ``module:function``; ``ValueError`` otherwise.

    For ``argparse``'s ``type=``: the function itself is imported later, on
    every rank.
    """
    if name in MODELS:
        return name
    module, sep, function = name.rpartition(":")
    if sep and module and function.isidentifier():
        return name
    raise ValueError(f"--model must be one of {', '.join(MODELS)} or "
                     f"'package.module:function' / 'path/to/file.py:function', got {name!r}")


def default_batch_size(model: str) -> int:
    """The batch size per rank of ``--model`` when ``--batch-size`` is not given."""
    return DEFAULT_BATCH_SIZE.get(model, DEFAULT_USER_BATCH_SIZE)


def add_model_arguments(parser: argparse.ArgumentParser, *, default: str = None,
                        required: bool = False, what: str = "") -> None:
    """``--model``, ``--batch-size``, ``--matrix-rank``, ``--image-size`` and
    ``--seq-len``, as the planner and the A/B tool take them."""
    from .units import add_count, matrix_rank_type, positive_int

    def model_name(text: str) -> str:
        try:
            return check_model_name(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parser.add_argument("--model", type=model_name, default=default, required=required,
                        help=f"a built-in model ({', '.join(MODELS)}) or your own as "
                             "package.module:function or path/to/file.py:function: it gets "
                             "the batch size and returns (model, batch) or (model, batch, "
                             f"loss_fn){what}"
                             + (f" (default {default})" if default else ""))
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="per rank (default: " + ", ".join(
                            f"{m} {b}" for m, b in DEFAULT_BATCH_SIZE.items())
                        + f", your model {DEFAULT_USER_BATCH_SIZE})")
    parser.add_argument("--matrix-rank", type=matrix_rank_type, default=None,
                        help="factor rank, a share of each matrix's smaller side in (0, 1), "
                             "or 'auto' for a rank per tensor (default with --optimizer sgd: "
                             "32 for bert-base and gpt2, 4 otherwise; with --optimizer adamw "
                             "hvd_acp's adaptive defaults, hvd_acp.Settings: ACP-SGD both factors "
                             "every step at 0.3 of each matrix's smaller side, Power-SGD "
                             "0.25, fp16 on the wire)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                        help="the torch optimizer the model trains with: sgd, SGD with "
                             "momentum 0.9 (default), or adamw; its family decides hvd_acp's "
                             "defaults, which the profile times")
    add_count(parser, "--image-size", 128, "resnet50's input height and width")
    add_count(parser, "--seq-len", 64, "bert-base's and gpt2's tokens per sequence")


def default_matrix_rank(model: str, optimizer: str = "sgd"):
    """The paper's ``matrix_rank`` for ``model`` under SGD; hvd_acp's default
    (:meth:`hvd_acp.Settings.resolve`) for a user's model, and None under an
    adaptive ``optimizer`` (:data:`OPTIMIZERS`): each method resolves
    hvd_acp's adaptive defaults, a share of each matrix."""
    if optimizer != "sgd":
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        return None
    if is_user_model(model):
        from ..settings import Settings
        return Settings().resolve().matrix_rank
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
        name: one of :data:`MODELS`, or ``module:function`` (:func:`build_user_model`;
            the other keyword arguments do not apply to it).
        batch_size: samples per batch (per rank).
        image_size: height and width of ResNet inputs.
        seq_len: tokens per BERT or GPT-2 sequence.
        data_seed: seed of the synthetic batch (the benchmark gives each
            rank its own).

    The weights are identical in every process that calls this with the same
    arguments, so ranks start from the same model without a broadcast (a
    broadcast of BERT's 440 MB would take half a minute on a 100 Mbit/s link).
    The global RNG is reseeded: this builds a model to measure, not one to train.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if is_user_model(name):
        return build_user_model(name, batch_size)
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
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        config = GPT2Config()                     # the defaults are GPT-2 small
        model = GPT2LMHeadModel(config)
        ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=gen)
        batch = {"input_ids": ids, "labels": ids}
        return ModelSpec(model.train(), batch, _hf_loss,
                         f"transformers GPT2LMHeadModel (GPT-2 small), sequence length {seq_len}")
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or dicts / tuples / lists of them) on ``device``."""
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def _import_function(target: str) -> Callable[..., Any]:
    module_name, _, function_name = check_model_name(target).rpartition(":")
    file = model_file(target)
    if file is not None:
        path = file.resolve()
        if not path.is_file():
            raise ValueError(f"--model {target!r}: no file {path}")
        # As ``python path/to/file.py`` does: the file may import its neighbours.
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        # As ``python -m`` does: a module beside the user is importable.
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"--model {target!r}: cannot import {module_name!r} ({exc}); "
                             "it must be importable from the current directory or "
                             "PYTHONPATH, or be given as path/to/file.py:function") from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"--model {target!r}: {module_name!r} has no function "
                         f"{function_name!r}")
    return function


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _default_loss(model: nn.Module, batch: Any) -> Tensor:
    """The model's own loss (``output.loss``) or a scalar output; else the mean
    square of the output, a stand-in that times the same backward pass."""
    out = _call(model, batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is not None:
        return loss
    if isinstance(out, Tensor):
        return out if out.dim() == 0 else out.float().square().mean()
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0].float().square().mean()
    raise ValueError(f"the model returned {type(out).__name__}, which has no loss: return "
                     "(model, batch, loss_fn) from the --model function")


def build_user_model(target: str, batch_size: int) -> ModelSpec:
    """The model of the user's function ``target`` (``package.module:function`` or
    ``path/to/file.py:function``).

    The function is called as ``function(batch_size)`` after
    ``torch.manual_seed(0)`` and returns ``(model, batch)`` or
    ``(model, batch, loss_fn)``:

    * ``model``: an ``nn.Module`` (on the CPU; the caller moves it);
    * ``batch``: one step's inputs: a dict of tensors (``model(**batch)``), a
      tuple (``model(*batch)``) or a tensor (``model(batch)``);
    * ``loss_fn(model, batch)``: the scalar loss. Without it the loss is the
      model's own (an output with ``.loss``, as ``transformers`` models give
      when the batch has labels, or a scalar output), else the mean square of
      the output: a stand-in with the same backward pass, for timing only.
    """
    function = _import_function(target)
    torch.manual_seed(0)
    built = function(batch_size)
    if isinstance(built, ModelSpec):
        return built
    if not isinstance(built, (tuple, list)) or len(built) not in (2, 3):
        raise ValueError(f"--model {target!r} must return (model, batch) or "
                         f"(model, batch, loss_fn), got {type(built).__name__}")
    model, batch = built[0], built[1]
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {target!r} returned {type(model).__name__} as its model, "
                         "not a torch.nn.Module")
    loss_fn = built[2] if len(built) == 3 else _default_loss
    if not callable(loss_fn):
        raise ValueError(f"--model {target!r}: its loss_fn is not callable")
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return ModelSpec(model.train(), batch, loss_fn,
                     f"{target} ({type(model).__name__}, {params / 1e6:.2f} M parameters)")
