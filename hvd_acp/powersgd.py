"""Classic Power-SGD on Horovod: the baseline ACP-SGD is measured against.

Per step and compressed parameter (Vogels et al., 2019), with warm start::

    A   = M + E
    P_i = A @ Q                       # all-reduce 1 (launched from the hooks)
    Ph  = orth(mean_i P_i)
    Q_i = A.T @ Ph                    # all-reduce 2 (needs all-reduce 1)
    E   = A - Ph @ Q_i.T              # this rank's unsent part, before all-reduce 2
    G   = Ph @ mean_i(Q_i).T

Two dependent all-reduces per step, and ``(n + m) * r`` elements on the wire
instead of ACP-SGD's ``n * r`` or ``m * r``. Everything else (hooks, fused
buffers, error feedback, the optimizer contract) is ACP-SGD's machinery.
"""
from __future__ import annotations

import time
from typing import Optional

from torch import Tensor

from .compression import Phase, orthonormalize_
from .optimizer import DistributedOptimizer
from .reducer import ACPReducer, _Round

__all__ = ["PowerSGDOptimizer", "PowerSGDReducer"]


class PowerSGDReducer(ACPReducer):
    """Power-SGD with the reducer machinery of ACP-SGD.

    The hooks fill and launch the P buffers (P factors and uncompressed
    tensors); :meth:`synchronize` then orthonormalizes P, computes and
    all-reduces Q, and reconstructs.
    """

    @property
    def phase(self) -> Phase:
        """DENSE during warm-up (and auto-rank probes), then P: every step
        starts with the P all-reduce."""
        if self.step_count < self.state.warmup_steps or self.state.probing:
            return Phase.DENSE
        return Phase.P

    def _prepare_bases(self) -> None:
        # Power-SGD multiplies by the previous Q as it is (warm start).
        self._bases_phase = self.phase

    def _compress(self, rnd: _Round, b_index: int, name: str, grad: Optional[Tensor],
                  out: Tensor) -> None:
        # P_i = A Q with A = M + E; the residual waits for the second projection.
        tensor = self.state.tensors[name]
        tensor.compress_(Phase.P, grad, tensor.q, out, residual=False)

    def _complete(self, rnd: _Round) -> None:
        if rnd.phase is Phase.DENSE:
            super()._complete(rnd)
            return
        self.written_factors, self.written_versions = [], {}
        for b_index in range(len(rnd.buckets)):
            self.comm.synchronize(rnd.handles[b_index])
        started = time.perf_counter()
        nonfinite = self._nonfinite_slots(rnd)
        tensors = self.state.tensors
        compressed = []
        for bucket in rnd.buckets:
            for slot in bucket.slots:
                if slot.name in rnd.sparse:
                    continue                       # sent apart, see ACPReducer._take
                if slot.name in tensors:
                    tensors[slot.name].commit_(Phase.P, self._slot_view(rnd, slot.name))
                    compressed.append(slot.name)
                else:
                    self._write_grad(rnd, slot.name)
        if not compressed:
            self._count_nonfinite(nonfinite)
            self.compression_seconds += time.perf_counter() - started
            return
        orthonormalize_(tensors[name].p for name in compressed)           # Ph = orth(P)
        buckets, buffers, views = self._plan(Phase.Q, tuple(compressed))
        second = _Round(Phase.Q, buckets, buffers, views)
        for name in compressed:
            # Q_i = A^T Ph, E = A - Ph Q_i^T: the ACP-SGD Q step on A.
            tensors[name].compress_(Phase.Q, None, tensors[name].p, self._slot_view(second, name))
        handles = [self.comm.allreduce_async_(buf, b.name) for b, buf in zip(buckets, buffers)]
        waited = time.perf_counter()
        for handle in handles:
            self.comm.synchronize(handle)
        # Waiting for the second all-reduce is communication, not compression.
        self.compression_seconds -= time.perf_counter() - waited
        nonfinite |= self._nonfinite_slots(second)
        self._count_nonfinite(nonfinite)
        for name in compressed:
            lay, param, tensor = self.layouts[name], self.params[name], tensors[name]
            q = self._slot_view(second, name)
            matrix, direct = self._grad_target(lay, param)
            # G = Ph Q^T; Q is the warm start of the next step unless non-finite.
            tensor.apply_(Phase.Q, q, tensor.p, matrix, commit=name not in nonfinite)
            # ||G|| = ||Q||: the committed Q (see ACPReducer.applied_scale).
            self.written_factors.append(tensor.q if name not in nonfinite else None)
            if not direct:
                param.grad.copy_(matrix.view(param.grad.shape))
            self.written_versions[name] = param.grad._version
        self.compression_seconds += time.perf_counter() - started

    def wire_elements(self, phase: Phase) -> int:
        if phase is Phase.DENSE:
            return super().wire_elements(phase)
        return sum(lay.payload_numel(Phase.P) + (lay.payload_numel(Phase.Q)
                                                 if lay.compressed else 0)
                   for lay in self.layouts.values())


class PowerSGDOptimizer(DistributedOptimizer):
    """Classic Power-SGD, with the constructor and contract of
    :class:`~hvd_acp.DistributedOptimizer`.

    Use it to compare against ACP-SGD: same arguments, same hooks, fusion and
    error feedback, but two dependent all-reduces per step (P, then Q) and
    both factors on the wire every step.
    """

    reducer_class = PowerSGDReducer
    name_prefix = "hvd_acp.powersgd"
