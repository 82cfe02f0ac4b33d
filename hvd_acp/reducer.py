"""Gradient hooks and fused buffers of the Horovod front end.

:class:`ACPReducer` owns what happens between ``backward()`` and the
optimizer's update: it hooks, fills, launches and waits. What goes into a
slot and what comes out of an averaged buffer is the compression state's
(:meth:`.CompressionState.encode_`, :meth:`.CompressionState.decode_`); the
buffers, hooks and round bookkeeping are :mod:`.rounds`'.

1. On the last of ``backward_passes_per_step`` backward passes, a
   parameter's hook puts its payload into its slot of a fused buffer.
2. The buffer its slot completes is launched (a named asynchronous
   all-reduce) while backward goes on; then that slot's residual.
3. :meth:`synchronize` fills what backward did not reach (a zero gradient:
   no rank waits for a buffer that never completes), waits for each buffer
   in launch order and writes its averaged gradients into ``p.grad``.

With ``overlap=False`` all of it happens in :meth:`synchronize`. A sparse
gradient travels as Horovod sends it, apart from the buffers (its slot
carries zeros); with ``sparse_as_dense`` it is densified into its slot and
handed back to the optimizer sparse.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .codecs import Codec
from .comm import Communicator
from .diagnostics import Recorder
from .fusion import plan_buckets
from .rounds import BufferCache, GradientHooks, Plan, Round
from .settings import Settings
from .state import CompressionState

logger = logging.getLogger(__name__)


class ACPReducer:
    """Compresses, fuses and all-reduces gradients with ACP-SGD.

    Args:
        named_parameters: (name, parameter) pairs in registration order, all
            on one device.
        communicator: the collective backend.
        settings: the resolved :class:`~hvd_acp.settings.Settings`.
        fusion_threshold_bytes: S-SGD fusion threshold (:func:`.fusion.plan_buckets`).
        backward_passes_per_step: backward passes accumulated per step.
        groups: optional explicit fusion groups, lists of parameter names.
        sparse_as_dense: densify sparse gradients into the fused buffers.
        name_prefix: first component of the all-reduce names.
        diagnostics: record the error feedback's health per step in :attr:`diagnostics`.
        on_first_round: called once with the reducer, when the first round
            opens (the optimizer's check that every rank starts alike).
        overlap: fill and launch from the hooks (True), or all in :meth:`synchronize`.

    Attributes:
        state: the :class:`~hvd_acp.state.CompressionState`, keyed by name.
        compression_seconds: seconds of compression maths since construction.
        included: False on a rank outside the communicator's process set:
            there, as with Horovod, nothing is hooked or communicated.
    """

    #: The codecs of the compressed steps (None: the settings' scheme).
    cycle: Optional[Tuple[Codec, ...]] = None

    def __init__(self, named_parameters: Sequence[Tuple[str, Tensor]],
                 communicator: Communicator, settings: Settings, *,
                 fusion_threshold_bytes: int, backward_passes_per_step: int = 1,
                 groups: Optional[Sequence[Sequence[str]]] = None,
                 sparse_as_dense: bool = False, name_prefix: str = "hvd_acp",
                 diagnostics: bool = False, overlap: bool = True,
                 on_first_round: Optional[Callable[["ACPReducer"], None]] = None):
        self.params: Dict[str, Tensor] = dict(named_parameters)
        self.comm = communicator
        self.overlap = overlap
        self.fusion_threshold_bytes = fusion_threshold_bytes
        self.backward_passes_per_step = backward_passes_per_step
        self.groups = [list(g) for g in groups] if groups else None
        self.sparse_as_dense = sparse_as_dense
        self.name_prefix = name_prefix
        self.compression_seconds = 0.0
        self.recorder = Recorder() if diagnostics else None
        self.included = communicator.included()
        self.device = next((p.device for p in self.params.values()), torch.device("cpu"))
        self.state = CompressionState(settings, cycle=self.cycle,
                                      world_size=communicator.size())
        for name, param in self.params.items():
            self.state.add(name, param.shape, param.dtype, self.device)
        if self.included:
            logger.info("hvd_acp: %s", self.state.describe(settings.fp16_wire))
        self._on_first_round = on_first_round
        #: Where the state came from (for the first round's check).
        self.origin = "fresh"
        self._buffers = BufferCache()
        self.hooks = GradientHooks(self.params, backward_passes_per_step, self._on_gradient)
        self._deferred: List[str] = []  # without overlap: left for synchronize()
        self._round: Optional[Round] = None
        self.register_hooks()

    # ------------------------------------------------------------------ state
    step_count = property(lambda self: self.state.step_count, doc="Steps completed.")
    phase = property(lambda self: self.state.phase, doc="Phase of the current step.")
    codec = property(lambda self: self.state.codec, doc="Codec of the current step.")
    layouts = property(lambda self: self.state.layouts, doc="name -> TensorLayout.")
    errors = property(lambda self: self.state.errors, doc="name -> this rank's residual.")
    nonfinite_steps = property(lambda self: self.state.nonfinite_steps,
                               doc="Steps whose average was non-finite (state repaired).")
    diagnostics = property(lambda self: None if self.recorder is None else self.recorder.records,
                           doc="Per-step records (:mod:`hvd_acp.diagnostics`), if enabled.")

    def share(self) -> float:
        """This rank's part of an all-reduced result (1 when it is the average)."""
        return 1.0 / (self.comm.size() * self.comm.reduction_weight())

    # ------------------------------------------------------------------ hooks
    def register_hooks(self) -> None:
        """Hook every parameter that requires a gradient and has no hook yet."""
        if self.included:
            self.hooks.register()

    def remove_hooks(self) -> None:
        """Remove every hook for good (the reducer no longer sees gradients)."""
        self.hooks.remove()

    def _on_gradient(self, name: str, param: Tensor) -> None:
        if self.overlap:
            self._take(name, param)
        else:
            self._deferred.append(name)

    def _take(self, name: str, param: Tensor) -> None:
        """Send this rank's gradient of ``name``: into its slot or, if sparse, apart."""
        grad = param.grad
        if grad is None or not grad.is_sparse:
            self._fill(name, grad)
        elif self.sparse_as_dense:
            self._open_round().densified[name] = grad.sparse_dim()
            param.grad = grad.to_dense()
            self._fill(name, param.grad)
        else:
            self._open_round().sparse[name] = self.comm.sparse_allreduce_async(
                grad, f"{self.name_prefix}.sparse.{name}")
            self._fill(name, None, sparse=True)

    # ------------------------------------------------------------ fill, launch
    @property
    def round_open(self) -> bool:
        """Whether backward has started the current round."""
        return bool(self._deferred) or (self._round is not None and bool(self._round.taken))

    @property
    def pending(self) -> bool:
        """Whether any gradient was counted since the last synchronize()."""
        return self.hooks.pending

    def _plan(self, codec: Codec, names: Tuple[str, ...]) -> Plan:
        """The buffers of ``codec`` over ``names`` (made once per plan)."""
        def buckets():
            active = set(names)
            groups = [g for g in ([n for n in g if n in active] for g in self.groups or ()) if g]
            return plan_buckets([self.layouts[n] for n in names], codec,
                                self.fusion_threshold_bytes, groups or None, self.name_prefix)
        return self._buffers.get((codec, names, self.state.layout_version), buckets, self.device)

    def _open_round(self) -> Round:
        if self._round is None:
            if self._on_first_round is not None:
                first, self._on_first_round = self._on_first_round, None
                first(self)
            self.register_hooks()
            codec = self.state.begin_step(self.comm.size())
            active = tuple(n for n, p in self.params.items() if p.requires_grad)
            self._round = Round(codec, self._plan(codec, active))
            self._prepare_bases(codec)
        return self._round

    def _prepare_bases(self, codec: Codec) -> None:
        """Every compressed tensor's basis of the step, made at once (same
        shapes batched) as the round opens."""
        if codec.compressed:
            started = time.perf_counter()
            bases = self.state.bases(self.state.tensors, codec)
            self.compression_seconds += time.perf_counter() - started
            if self.recorder is not None:
                self.recorder.start(self.step_count, codec.name,
                                    ((n, bases[n]) for n in self.state.tensors))

    def _fill(self, name: str, grad: Optional[Tensor], *, sparse: bool = False) -> None:
        """Put this rank's payload for ``name`` into its slot; launch the buffer
        it completes. ``grad=None`` is a zero gradient (the error feedback
        still flows); a gradient sent apart leaves zeros in its slot."""
        rnd = self._open_round()
        b_index = rnd.plan.where.get(name)
        if b_index is None:
            raise RuntimeError(
                f"parameter {name!r} got a gradient but had requires_grad=False when "
                "this step's first gradient arrived; change requires_grad only between steps")
        out = rnd.plan.views[name]
        if sparse:
            out.zero_()
        elif not rnd.codec.compressed or name not in self.state.tensors:
            self.state.encode_(name, grad, out, rnd.codec)
        else:
            started = time.perf_counter()
            # The slot that completes the buffer has its residual after the launch.
            owed = self.state.encode_(name, grad, out, rnd.codec, defer=rnd.completes(b_index),
                                      record=self.recorder and self.recorder.current)
            if owed is not None:
                rnd.owed[b_index] = owed
            self.compression_seconds += time.perf_counter() - started
        rnd.taken.add(name)
        rnd.ready[b_index] += 1
        if rnd.ready[b_index] == len(rnd.plan.members[b_index]):
            self._launch(rnd, b_index)

    def _launch(self, rnd: Round, b_index: int) -> None:
        """Start the buffer's all-reduce; then, while it is on the wire, the
        residual of the slot that completed it."""
        bucket = rnd.plan.buckets[b_index]
        start = self.comm.allreduce_lanes_async_ if bucket.lanes else self.comm.allreduce_async_
        rnd.handles[b_index] = start(rnd.plan.buffers[b_index], bucket.name)
        owed = rnd.owed.pop(b_index, None)
        if owed is not None:
            started = time.perf_counter()
            owed.finish_()
            self.compression_seconds += time.perf_counter() - started

    # -------------------------------------------------------------- wait, write
    def synchronize(self) -> None:
        """Finish the round: ``p.grad`` of every parameter that requires a
        gradient holds the averaged one, identical on every rank (a parameter
        without a gradient on this rank counted as zero); next phase."""
        if not self.included:
            return
        rnd = self._open_round()
        for name in rnd.plan.views:
            if name not in rnd.taken:
                self._take(name, self.params[name])
        self._complete(rnd)
        if self.state.probing and self.recorder is not None:
            self.recorder.probe(self.step_count, self.state.ranks(), self.state.kept_energy)
        for name, handle in rnd.sparse.items():
            self.params[name].grad = self.comm.synchronize_sparse(handle)
        for name, sparse_dim in rnd.densified.items():
            # The rows where the average is nonzero, as Horovod converts it back.
            self.params[name].grad = self.params[name].grad.to_sparse(sparse_dim)
        self._end_round()
        if self.recorder is not None:
            self.recorder.finish()
        self.state.end_step()
        self.register_hooks()

    def _complete(self, rnd: Round) -> None:
        """Wait for each buffer in launch order; write its gradients while the
        later ones (the first layers') are still on the wire."""
        for b_index in range(len(rnd.plan.buckets)):
            self.comm.synchronize(rnd.handles[b_index])
            started = time.perf_counter()
            self._decode(rnd, b_index)
            self.compression_seconds += time.perf_counter() - started

    def _decode(self, rnd: Round, b_index: int, *, bad=()) -> set:
        """Write averaged buffer ``b_index`` into ``p.grad`` (see
        :meth:`.CompressionState.decode_`); returns the non-finite names."""
        members = rnd.plan.members[b_index]
        grads = [None if name in rnd.sparse else self._grad(name) for name, _ in members]
        return self.state.decode_(rnd.codec, rnd.plan.buffers[b_index], members, grads,
                                  bad=bad, record=self.recorder and self.recorder.current)

    def _grad(self, name: str) -> Tensor:
        """``p.grad`` of ``name``, made (contiguous) if it has none."""
        param = self.params[name]
        if param.grad is None:
            param.grad = torch.empty_like(param, memory_format=torch.contiguous_format)
        return param.grad

    def _end_round(self) -> None:
        self._round = None
        self._deferred.clear()
        self.hooks.reset()

    def discard_round(self) -> None:
        """Forget the round in progress (state restored after a failure, whose
        in-flight all-reduces will never complete)."""
        if self.round_open:
            logger.warning("discarding the gradients of an unfinished step")
        self._end_round()

    # ------------------------------------------------------------- checkpoint
    def state_dict(self, with_error: bool = True) -> dict:
        """This rank's compression state (see :meth:`.CompressionState.state_dict`)."""
        return self.state.state_dict(rank=self.comm.rank(), world_size=self.comm.size(),
                                     with_error=with_error)

    def load_state_dict(self, state: dict, reset_error_feedback: bool = False) -> None:
        """Restore :meth:`state_dict` output of this rank or another one (a
        residual only on the rank that saved it)."""
        self.state.load_state_dict(state, rank=self.comm.rank(),
                                   reset_error_feedback=reset_error_feedback)
        self.origin = (f"loaded from a checkpoint of step {self.state.step_count} saved by "
                        f"rank {state.get('rank')}")
        self.discard_round()
