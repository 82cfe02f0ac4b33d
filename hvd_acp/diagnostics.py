"""Per-step health of the low-rank error feedback, for diagnosing divergence.

Recorded by a :class:`Recorder` of the Horovod front end when created with
``diagnostics=True`` (``hvd_acp.DistributedOptimizer(..., diagnostics=True)``),
summed over the compressed tensors of this rank, one record per step:

- ``residual_ratio``: ``||E|| / ||M||`` after the step, the residual this
  rank still owes against the gradient it computed;
- ``kept_share``: ``||A B||^2 / ||A||^2``, the share of the accumulated
  gradient ``A = M + E`` that the projection onto the step's basis ``B``
  (``Qh`` or ``Ph``; on a PQ step the tangent space of both) keeps, i.e.
  what reaches the factors;
- ``subspace_turn``: ``1 - ||B_t^T B_{t-2}||_F^2 / r``, how far the basis of
  one side (rows on P steps, columns on Q steps, both on PQ steps) turned since that side's
  previous step: 0 when it stayed, 1 when it became orthogonal;
- ``grad_norm``, ``applied_norm``, ``residual_norm``: ``||M||``, ``||G||``
  and ``||E||`` themselves.

Norms are Frobenius norms, combined over tensors as the root of the sum of
squares. Recording costs a few passes over each gradient and is off by
default.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["Recorder", "StepRecord", "subspace_turn"]


def subspace_turn(basis: Tensor, previous: Tensor) -> float:
    """``1 - ||basis^T previous||_F^2 / r`` for two (k, r) orthonormal bases."""
    r = basis.shape[1]
    if r == 0:
        return 0.0
    overlap = torch.mm(basis.t(), previous)
    return float(1.0 - overlap.pow(2).sum() / r)


class StepRecord:
    """Sums of squares of one step, over the compressed tensors of one rank."""

    def __init__(self, step: int, phase: str):
        self.step, self.phase = step, phase
        self.grad2 = self.accumulated2 = self.kept2 = 0.0
        self.applied2 = self.residual2 = 0.0
        self.turns: List[float] = []

    def add_compressed(self, grad: Optional[Tensor], accumulated: Tensor,
                       factor: Tensor, counted_twice: Optional[Tensor] = None) -> None:
        """``grad`` M (or None), ``accumulated`` A = M + E, ``factor`` A B;
        ``counted_twice``: the part of ``factor`` on both bases of a PQ step
        (``Ph^T A Qh``), in A Qh and in A^T Ph alike, kept once."""
        if grad is not None:
            self.grad2 += float(grad.double().pow(2).sum())
        self.accumulated2 += float(accumulated.double().pow(2).sum())
        self.kept2 += float(factor.double().pow(2).sum())
        if counted_twice is not None:
            self.kept2 -= float(counted_twice.double().pow(2).sum())

    def add_feedback(self, applied: Tensor, residual: Tensor) -> None:
        self.applied2 += float(applied.double().pow(2).sum())
        self.residual2 += float(residual.double().pow(2).sum())

    def as_dict(self) -> Dict[str, object]:
        grad = math.sqrt(self.grad2)
        return {
            "step": self.step, "phase": self.phase,
            "grad_norm": grad, "applied_norm": math.sqrt(self.applied2),
            "residual_norm": math.sqrt(self.residual2),
            "residual_ratio": math.sqrt(self.residual2) / grad if grad else None,
            "kept_share": self.kept2 / self.accumulated2 if self.accumulated2 else None,
            "subspace_turn": (sum(self.turns) / len(self.turns)) if self.turns else None,
        }


class Recorder:
    """The records of one optimizer, one per compressed step and one per probe.

    Attributes:
        records: the records so far (dicts, see the module's docstring).
        current: the :class:`StepRecord` of the step in progress, if any.
    """

    def __init__(self) -> None:
        self.records: List[dict] = []
        self.current: Optional[StepRecord] = None
        self._previous: Dict[Tuple[str, str, int], Tensor] = {}

    def start(self, step: int, phase: str, bases: Iterable[Tuple[str, Any]]) -> None:
        """A compressed step begins on ``bases`` (name, basis, or the pair
        (Ph, Qh) of a PQ step): record how far each basis turned since the
        same side's previous step."""
        self.current = StepRecord(step, phase)
        for name, basis in bases:
            for side, one in enumerate(basis if isinstance(basis, tuple) else (basis,)):
                previous = self._previous.get((phase, name, side))
                if previous is not None:
                    self.current.turns.append(subspace_turn(one, previous))
                self._previous[(phase, name, side)] = one.clone()

    def finish(self) -> None:
        """The step in progress is over."""
        if self.current is not None:
            self.records.append(self.current.as_dict())
            self.current = None

    def probe(self, step: int, ranks: Dict[str, int], kept_energy: Dict[str, float]) -> None:
        """An auto-rank probe chose ``ranks``."""
        self.records.append({"step": step, "phase": "probe", "ranks": dict(ranks),
                             "kept_energy": dict(kept_energy)})
