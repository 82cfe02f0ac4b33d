"""The settings of the baselines, their defaults and their checks.

The optimizers (:mod:`.diloco`, :mod:`.demo`, :mod:`.tsr`), the registry of methods and
the planner's cost model (:mod:`hvd_acp.plan.baselines`) read the defaults
from here. ``None`` for a setting means its default, as for
:class:`hvd_acp.Settings`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from ..settings import is_int as _is_int
from ..settings import is_number as _is_number

__all__ = ["DiLoCoSettings", "DeMoSettings", "TSRSettings"]


def _with_defaults(settings):
    """``settings`` (a frozen dataclass) with each ``None`` replaced by its ``DEFAULTS`` entry."""
    return dataclasses.replace(settings, **{name: value for name, value in settings.DEFAULTS.items()
                                            if getattr(settings, name) is None})


@dataclasses.dataclass(frozen=True)
class DiLoCoSettings:
    """DiLoCo's settings; the defaults are the paper's (arXiv 2311.08105).

    Attributes:
        inner_steps: ``H``, the optimizer steps each rank takes alone between
            two outer steps. The bytes per step are the parameters' over
            ``H``; the paper trains with 500 and finds up to 1,000 about as
            good, and a run much shorter than ``H`` steps is local training
            with one average at the end.
        outer_lr: learning rate of the outer SGD step (0.7).
        outer_momentum: its momentum (0.9); 0 switches momentum off.
        nesterov: Nesterov momentum (the paper's; needs ``outer_momentum > 0``).
    """

    inner_steps: Optional[int] = None
    outer_lr: Optional[float] = None
    outer_momentum: Optional[float] = None
    nesterov: Optional[bool] = None

    DEFAULTS = {"inner_steps": 500, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}

    def resolve(self) -> "DiLoCoSettings":
        """These settings with every ``None`` replaced by its default, checked
        (``ValueError``/``TypeError`` naming the first bad one and its value)."""
        done = _with_defaults(self)
        if not _is_int(done.inner_steps) or done.inner_steps < 1:
            raise ValueError(f"inner_steps must be an int >= 1, got {done.inner_steps!r}")
        if not _is_number(done.outer_lr) or done.outer_lr <= 0:
            raise ValueError(f"outer_lr must be a number > 0, got {done.outer_lr!r}")
        if not _is_number(done.outer_momentum) or not 0 <= done.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be a number in [0, 1), got "
                             f"{done.outer_momentum!r}")
        if not isinstance(done.nesterov, bool):
            raise TypeError(f"nesterov must be a bool, got {done.nesterov!r}")
        if done.nesterov and done.outer_momentum == 0:
            raise ValueError("nesterov=True needs outer_momentum > 0 (as torch.optim.SGD)")
        return done


@dataclasses.dataclass(frozen=True)
class DeMoSettings:
    """The DeMo-style method's settings.

    Attributes:
        top_k: coefficients each rank sends per chunk (default 8: the setting
            that beat tuned S-SGD in the project's simulation). A chunk of
            64 float32 elements sends ``top_k`` values and ``top_k`` one-byte
            positions, ``5 * top_k`` bytes of its 256: 0.156 of S-SGD's bytes
            at 8, 0.020 at 1.
        chunk_size: elements per chunk, each transformed by its own DCT-II
            (default 64, the paper's chunk). The chunks are runs of the
            flattened tensor; the paper's reference code cuts a matrix into
            square blocks instead.
        momentum_decay: ``beta`` of each rank's momentum (0.999, the paper's).
    """

    top_k: Optional[int] = None
    chunk_size: Optional[int] = None
    momentum_decay: Optional[float] = None

    DEFAULTS = {"top_k": 8, "chunk_size": 64, "momentum_decay": 0.999}

    def resolve(self) -> "DeMoSettings":
        """These settings with every ``None`` replaced by its default, checked
        (``ValueError`` naming the first bad one and its value)."""
        done = _with_defaults(self)
        if not _is_int(done.chunk_size) or not 1 <= done.chunk_size <= 2 ** 31 - 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {done.chunk_size!r}")
        if not _is_int(done.top_k) or not 1 <= done.top_k <= done.chunk_size:
            raise ValueError(f"top_k must be an int in [1, chunk_size={done.chunk_size}], got "
                             f"{done.top_k!r}")
        if not _is_number(done.momentum_decay) or not 0 <= done.momentum_decay < 1:
            raise ValueError(f"momentum_decay must be a number in [0, 1), got "
                             f"{done.momentum_decay!r}")
        return done


@dataclasses.dataclass(frozen=True)
class TSRSettings:
    """The TSR-style method's settings (:class:`hvd_acp.baselines.TSROptimizer`).

    Attributes:
        core_rank: ``r``, the side of the r x r core each matrix sends per
            step and the columns of its bases (default 32), at most the
            matrix's smaller side.
        embedding_core_rank: the same for the embeddings
            (``embedding_names``); default ``core_rank``.
        refresh_period: ``K``, steps between two refreshes of the bases
            (default 10). A refresh sends two sketches, (n + m) r elements;
            per step an (n, m) matrix sends ``r^2 + (n + m) r / K`` elements
            over a period.
        embedding_refresh_period: the same for the embeddings; default
            ``refresh_period``.
        scale: the factor of the update (GaLore's alpha; default 1).
        fp16_wire: the step's buffer (cores, sketches and the exactly
            averaged gradients) travels in float16 (default True), otherwise
            in float32 (the parameters' dtype where wider).
        seed: seed of the sketches' Gaussian draws, the same on every rank
            (default 0).
        embedding_names: the parameters that take the embedding settings, by
            name (default none; :func:`hvd_acp.baselines.embedding_parameter_names`
            lists a model's ``nn.Embedding`` weights); kept sorted.
    """

    core_rank: Optional[int] = None
    embedding_core_rank: Optional[int] = None
    refresh_period: Optional[int] = None
    embedding_refresh_period: Optional[int] = None
    scale: Optional[float] = None
    fp16_wire: Optional[bool] = None
    seed: Optional[int] = None
    embedding_names: Optional[Tuple[str, ...]] = None

    DEFAULTS = {"core_rank": 32, "refresh_period": 10, "scale": 1.0, "fp16_wire": True,
                "seed": 0, "embedding_names": ()}

    def resolve(self) -> "TSRSettings":
        """These settings with every ``None`` replaced by its default (the
        embeddings' by the others'), checked (``ValueError``/``TypeError``
        naming the first bad one and its value)."""
        done = _with_defaults(self)
        done = dataclasses.replace(
            done, embedding_core_rank=(done.core_rank if done.embedding_core_rank is None
                                       else done.embedding_core_rank),
            embedding_refresh_period=(done.refresh_period if done.embedding_refresh_period is None
                                      else done.embedding_refresh_period))
        for name in ("core_rank", "embedding_core_rank", "refresh_period",
                     "embedding_refresh_period"):
            value = getattr(done, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not _is_number(done.scale) or done.scale <= 0:
            raise ValueError(f"scale must be a number > 0, got {done.scale!r}")
        if not isinstance(done.fp16_wire, bool):
            raise TypeError(f"fp16_wire must be a bool, got {done.fp16_wire!r}")
        if not _is_int(done.seed) or not 0 <= done.seed < 2 ** 63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {done.seed!r}")
        names = done.embedding_names
        if isinstance(names, (str, bytes)) or not _is_iterable(names):
            raise TypeError(f"embedding_names must be an iterable of parameter names, got "
                            f"{names!r}")
        names = tuple(names)
        if not all(isinstance(name, str) for name in names):
            raise TypeError(f"embedding_names must hold parameter names (str), got {names!r}")
        return dataclasses.replace(done, embedding_names=tuple(sorted(set(names))))


def _is_iterable(value) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True
