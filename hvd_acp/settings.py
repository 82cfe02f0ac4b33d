"""ACP-SGD's own settings and their defaults: one object under every front end.

``hvd_acp.DistributedOptimizer``, ``hvd_acp.PowerSGDOptimizer``, the DDP
hook's :class:`~hvd_acp.ddp.ACPState`, the Lightning, Accelerate and
Transformers integrations and the benchmark's methods all take these five
settings by name, with ``None`` for "the library's default", and hand them to
:class:`Settings`. :meth:`Settings.resolve` is the one place a default is
decided, given the torch optimizer being trained.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from .autorank import AutoRank
from .state import check_compression_settings
from .stepahead import check_step_ahead

__all__ = ["Settings", "RANK_ADVICE"]

#: How to choose ``matrix_rank``: the one wording README, docs and
#: docstrings use (a test holds them to it).
RANK_ADVICE = ("Start from 4 (the default) for CNNs trained with SGD, and 32 or more for "
               "transformers trained with Adam; raise the rank as long as the accuracy "
               "does not hold.")


@dataclasses.dataclass(frozen=True)
class Settings:
    r"""The settings of ACP-SGD that every rank must share, and a tuning guide.

    Each one left ``None`` takes the library's default (:meth:`resolve`).
    Bad values raise ``ValueError``/``TypeError`` naming the setting, when
    the object is made.

    1. ``matrix_rank`` (default 4): the compression, r. Each gradient of
       shape ``(n, ...)`` is viewed as an ``n x m`` matrix and sends ``n r``
       (P steps) or ``m r`` (Q steps) elements instead of ``n m``. Higher is
       more accurate and sends more. Start from 4 (the default) for CNNs
       trained with SGD, and 32 or more for transformers trained with Adam;
       raise the rank as long as the accuracy does not hold. ``"auto"`` (or
       an :class:`~hvd_acp.AutoRank`) chooses a rank per tensor from the
       averaged gradients at probe steps (docs/guide.md, "Choosing the rank").
    2. ``warmup_steps`` (default 0): steps of exact averaging (every gradient
       sent whole) before compression starts. The first steps are the most
       sensitive to compression error; 0 is fine for most CNNs, transformers
       gain from a few hundred.
    3. ``min_compression_rate`` (default 2.0): a matrix is compressed only if
       its two factors are at least this many times smaller than the matrix,
       ``(n + m) r * rate <= n m``; other tensors, and every 1-D tensor
       (biases, norms), are averaged exactly in the same all-reduce. 0
       compresses every matrix.
    4. ``step_ahead`` (default 0.2): step-ahead error feedback. Each rank
       computes its next gradient at ``w - step_ahead * lr / (1 - momentum)
       * E_i`` (Adam-family: ``w - step_ahead * lr * E_i / (sqrt(v_hat) +
       eps)``), where the residual it still owes will take the weights. That
       keeps ACP-SGD stable at the learning rates plain averaging trains at
       (scaled by the number of ranks, momentum 0.9), where the residual
       otherwise feeds back late and momentum amplifies it
       (docs/convergence.md). It sends nothing more. 0 runs the published
       method.
    5. ``seed`` (default 0): seed of the dedicated generator that draws the
       initial factors: identical on every rank, the global RNG untouched.
    """

    matrix_rank: Union[int, str, AutoRank, None] = None
    min_compression_rate: Optional[float] = None
    warmup_steps: Optional[int] = None
    seed: Optional[int] = None
    step_ahead: Optional[float] = None

    def __post_init__(self) -> None:
        given = self.resolve()          # the defaults pass; a bad given value raises
        check_compression_settings(given.matrix_rank, given.min_compression_rate,
                                   given.warmup_steps, given.seed)
        check_step_ahead(given.step_ahead)

    def resolve(self, optimizer: Optional[torch.optim.Optimizer] = None) -> "Settings":
        """These settings with every one left ``None`` given its default.

        The one place hvd_acp decides a default. ``optimizer`` is the torch
        optimizer the settings train (None where a front end has none); the
        defaults do not depend on it yet.
        """
        defaults = {"matrix_rank": 4, "min_compression_rate": 2.0, "warmup_steps": 0,
                    "seed": 0, "step_ahead": 0.2}
        missing = {key: value for key, value in defaults.items() if getattr(self, key) is None}
        return dataclasses.replace(self, **missing) if missing else self

    def as_kwargs(self) -> dict:
        """The five settings by name, as every front end takes them."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def compression_kwargs(self) -> dict:
        """The keyword arguments of :class:`~hvd_acp.state.CompressionState`."""
        return {"matrix_rank": self.matrix_rank,
                "min_compression_rate": self.min_compression_rate,
                "warmup_steps": self.warmup_steps, "seed": self.seed}
