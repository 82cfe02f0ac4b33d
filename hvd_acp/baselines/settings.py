"""The settings of the two baselines, their defaults and their checks.

The optimizers (:mod:`.diloco`, :mod:`.demo`), the registry of methods and
the planner's cost model (:mod:`hvd_acp.plan.baselines`) read the defaults
from here. ``None`` for a setting means its default, as for
:class:`hvd_acp.Settings`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..settings import is_int as _is_int
from ..settings import is_number as _is_number

__all__ = ["DiLoCoSettings", "DeMoSettings"]


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
