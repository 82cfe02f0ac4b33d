"""What the user did to the averaged gradients before the optimizer used them.

A front end writes each compressed parameter's averaged gradient ``G`` into
``p.grad``; between that and the update the user may rescale it:
``GradScaler.unscale_`` multiplies every gradient by ``1 / scale``,
``clip_grad_norm_`` by its clip coefficient, a manual ``div_`` by anything.
The error-feedback residuals stay in the units of what was written, so
whatever reads them as gradient (step-ahead's shift) needs that factor:
:class:`GradientRescaling` measures it, from what really happened to
``p.grad``.

How a change is seen, with no pass over the gradients when there is none:

- an in-place operation bumps a tensor's version counter (``div_``,
  clipping's ``_foreach_mul_``): free to read, where ``p.grad`` is the
  tensor the front end wrote (the Horovod front end);
- ``GradScaler.unscale_`` does not (``torch._amp_foreach_non_finite_check_and_unscale_``
  leaves the counters alone), and the DDP hook writes DDP's bucket, which
  DDP then copies into ``p.grad``: both are seen at *probes*, the first
  element of the first two gradients written, copied when written and
  read again when the unit is measured (a few scalars a step, not a pass).

A rescaling seen by the probes alone, the same ratio at both, is a uniform
one (a scaler's): the unit is that ratio, exactly (a power of two stays
one). Anything else seen (a version moved, probes that disagree or read
zero) is measured as ``||p.grad|| / ||G||`` over the written gradients: one
pass, only then. ``||G||`` is its averaged factor's norm (the basis is
orthonormal), so the written gradients are not read a second time.
"""
from __future__ import annotations

import math
import threading
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["GradientRescaling"]

#: Gradients whose first element is kept to see an in-place rescaling.
PROBES = 2


class GradientRescaling:
    """The factor between the gradients a step wrote and those the optimizer used.

    A front end calls :meth:`clear` when a step's gradients start to be
    written, :meth:`wrote` for each compressed gradient it writes, and
    :meth:`measure` once the user is done with them (just before the
    optimizer's update). :attr:`unit` keeps the last measure: it is what a
    residual of this step is multiplied by to be in the optimizer's units
    (saved with the compression state, so a resume under a scaler goes on
    in the same units).

    Attributes:
        unit: the last measured factor, 1 until one is measured.
        enabled: record what is written (off until something reads
            :attr:`unit`: step-ahead turns it on).
    """

    def __init__(self) -> None:
        self.unit = 1.0
        self.enabled = False
        #: (name, written tensor, its version after the write, the averaged
        #: factor whose squared norm is the written gradient's, or None if non-finite)
        self._written: List[Tuple[str, Tensor, int, object]] = []
        #: Names of the probed gradients, in the order of their slots.
        self._probed: List[str] = []
        #: float64, per device: the probes' values when written, then when measured
        #: (made once; a value written into a view costs one copy, no allocation).
        self._slots: Dict[torch.device, Tuple[Tensor, List[Tensor], List[Tensor]]] = {}
        self._device: Optional[torch.device] = None
        # DDP writes its buckets from communication threads.
        self._lock = threading.Lock()

    def clear(self) -> None:
        """A new step: nothing written yet."""
        with self._lock:
            self._written, self._probed = [], []

    def wrote(self, name: str, grad: Tensor, factor) -> None:
        """``grad`` (the tensor just written: ``p.grad`` or a bucket's slot)
        holds ``name``'s averaged gradient, whose squared norm is that of
        ``factor`` (a tensor, or a tuple of tensors whose squared norms add
        up; None where the average was not finite)."""
        if not self.enabled:
            return
        with self._lock:
            self._written.append((name, grad, grad._version, factor))
            index = len(self._probed)
            if index == PROBES or factor is None:
                return
            self._probed.append(name)
            was = self._views(grad.device)[1][index]
        was.copy_(_first(grad))

    def _views(self, device: torch.device) -> Tuple[Tensor, List[Tensor], List[Tensor]]:
        """The probes' buffer on ``device`` and its one-element views (written, measured)."""
        slots = self._slots.get(device)
        if slots is None:
            buffer = torch.zeros(2 * PROBES, dtype=torch.float64, device=device)
            slots = self._slots[device] = (
                buffer, [buffer[i:i + 1] for i in range(PROBES)],
                [buffer[PROBES + i:PROBES + i + 1] for i in range(PROBES)])
        self._device = device
        return slots

    def measure(self, params: Dict[str, Tensor]) -> float:
        """Read the factor the user applied to the written gradients since
        (``p.grad`` of ``params[name]``), keep it as :attr:`unit` and return it.

        Nothing written this step (warm-up, an auto-rank probe: no residual
        to shift) leaves the unit as it was.
        """
        with self._lock:
            written, probed = list(self._written), list(self._probed)
        if not written:
            return self.unit
        moved = any(params[name].grad is grad and grad._version != version
                    for name, grad, version, _ in written)
        unit = None if moved else self._probe_ratio(probed, params)
        if unit is None:
            unit = _norm_ratio(written, params)
        if unit is not None:
            self.unit = unit
        return self.unit

    def _probe_ratio(self, probed: List[str], params: Dict[str, Tensor]) -> Optional[float]:
        """The factor seen at the probes: 1 when unchanged, the common ratio
        when every probe moved by the same one; None when they cannot tell (a
        probe read zero, its gradient is gone or sparse, or the ratios differ)."""
        if not probed:
            return None
        now = [params[name].grad for name in probed]
        if any(grad is None or grad.layout is not torch.strided for grad in now):
            return None             # gone, or handed back sparse (``sparse_as_dense``)
        buffer, _, after = self._views(self._device)
        for view, grad in zip(after, now):
            view.copy_(_first(grad))
        values = buffer.tolist()
        was, after = values[:len(probed)], values[PROBES:PROBES + len(probed)]
        if any(w == 0 or not math.isfinite(w) for w in was):
            return None
        ratios = {a / w for w, a in zip(was, after)}
        if len(ratios) != 1:
            return None
        ratio = ratios.pop()
        return ratio if math.isfinite(ratio) and ratio > 0 else None


def _first(tensor: Tensor) -> Tensor:
    """A view of ``tensor``'s first element (index 0 in every dimension),
    whatever its strides: a view, no copy."""
    return tensor.as_strided((1,), (1,))


def _norm_ratio(written, params: Dict[str, Tensor]) -> Optional[float]:
    """``||p.grad|| / ||G||`` over the finite written gradients: one pass."""
    finite = [(name, factor) for name, _, _, factor in written if factor is not None]
    was = sum(float(t.double().pow(2).sum()) for _, factor in finite
              for t in (factor if isinstance(factor, tuple) else (factor,)))
    if not finite or was <= 0:
        return None
    now = sum(float(params[name].grad.double().pow(2).sum())
              for name, _ in finite if params[name].grad is not None)
    ratio = math.sqrt(now / was)
    return ratio if math.isfinite(ratio) and ratio > 0 else None
