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

from .codecs import PowerSGDFirst, PowerSGDSecond
from .optimizer import DistributedOptimizer
from .reducer import ACPReducer
from .rounds import Round

__all__ = ["PowerSGDOptimizer", "PowerSGDReducer"]

FIRST, SECOND = PowerSGDFirst(), PowerSGDSecond()


class PowerSGDReducer(ACPReducer):
    """Power-SGD with the reducer machinery of ACP-SGD.

    The hooks fill and launch the first round's buffers (P factors and
    uncompressed tensors, :class:`~hvd_acp.codecs.PowerSGDFirst`);
    :meth:`synchronize` then orthonormalizes P, fills and all-reduces the
    second round's buffers (:class:`~hvd_acp.codecs.PowerSGDSecond`), and
    reconstructs.
    """

    #: Every compressed step is Power-SGD's two rounds.
    cycle = (FIRST,)

    def _complete(self, rnd: Round) -> None:
        if rnd.codec is not FIRST:
            super()._complete(rnd)
            return
        for b_index in range(len(rnd.plan.buckets)):
            self.comm.synchronize(rnd.handles[b_index])
        started = time.perf_counter()
        bad = set()
        for b_index in range(len(rnd.plan.buckets)):      # P committed, the rest written
            bad |= self._decode(rnd, b_index)
        compressed = tuple(name for name in rnd.plan.views
                           if name in self.state.tensors and name not in rnd.sparse)
        if compressed:
            self.state.orthonormalize_p_(compressed)                  # Ph = orth(P)
            second = Round(SECOND, self._plan(SECOND, compressed))
            for name in compressed:
                # Q_i = A^T Ph, E = A - Ph Q_i^T: the ACP-SGD Q step on A.
                self.state.encode_(name, None, second.plan.views[name], SECOND)
            for b_index, (bucket, buffer) in enumerate(zip(second.plan.buckets,
                                                           second.plan.buffers)):
                second.handles[b_index] = self.comm.allreduce_async_(buffer, bucket.name)
            waited = time.perf_counter()
            for handle in second.handles.values():
                self.comm.synchronize(handle)
            # Waiting for the second all-reduce is communication, not compression.
            self.compression_seconds -= time.perf_counter() - waited
            for b_index in range(len(second.plan.buckets)):
                # G = Ph Q^T; Q is the warm start of the next step unless non-finite.
                self._decode(second, b_index, bad=bad)
        self.compression_seconds += time.perf_counter() - started


class PowerSGDOptimizer(DistributedOptimizer):
    """Classic Power-SGD, with the constructor and contract of
    :class:`~hvd_acp.DistributedOptimizer`.

    Use it to compare against ACP-SGD: same arguments, same hooks, fusion and
    error feedback, but two dependent all-reduces per step (P, then Q) and
    both factors on the wire every step.
    """

    reducer_class = PowerSGDReducer
    name_prefix = "hvd_acp.powersgd"
    #: Both factors travel every step: a default share of each matrix half
    #: ACP-SGD's sends what ACP-SGD sends (:meth:`hvd_acp.Settings.resolve`).
    factors_per_step = 2
