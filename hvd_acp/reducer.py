"""Gradient hooks, fused buffers and per-step state of ACP-SGD.

:class:`ACPReducer` owns everything that happens between ``backward()`` and
the optimizer's update:

1. A hook on every parameter fires when its gradient has been accumulated.
   On the last of ``backward_passes_per_step`` passes it compresses the
   gradient (P or Q step with error feedback, see :mod:`.compression`) into
   the parameter's slot of a flat fused buffer (see :mod:`.fusion`).
2. When every member of a buffer is filled, the buffer's named asynchronous
   all-reduce is launched, while backward goes on computing earlier layers.
3. :meth:`synchronize` fills what backward did not reach (a parameter with
   no gradient counts as a zero gradient, so no rank waits for a buffer that
   never completes), waits for every handle, writes the reconstructed
   averaged gradient into ``p.grad``, commits the averaged factors and moves
   to the next phase.

With ``overlap=False`` the hooks only count backward passes: every
gradient is compressed, and every buffer launched, in :meth:`synchronize`,
after backward has ended (the same maths and buffers, no overlap with
backward).

A sparse gradient (``nn.Embedding(sparse=True)``) travels as Horovod sends
it: uncompressed, its indices and values gathered from every rank apart
from the fused buffers, where its slot carries a zero gradient. With
``sparse_as_dense`` it is densified into its slot instead, like any dense
gradient, and handed back to the optimizer as a sparse tensor.

It knows nothing of the wrapped torch optimizer.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .comm import Communicator
from .compression import Phase
from .diagnostics import StepRecord, subspace_turn
from .fusion import Bucket, TensorLayout, plan_buckets
from .state import CompressionState, nonfinite_names

logger = logging.getLogger(__name__)

class _Round:
    """Bookkeeping of one communication round (one optimizer step)."""

    def __init__(self, phase: Phase, buckets: List[Bucket], buffers: List[Tensor],
                 views: Dict[str, Tensor]):
        self.phase = phase
        self.buckets = buckets
        self.buffers = buffers
        #: name -> its slot of a buffer, shaped (made once per plan).
        self.views = views
        self.where: Dict[str, Tuple[int, int]] = {}
        for b_index, bucket in enumerate(buckets):
            for s_index, slot in enumerate(bucket.slots):
                self.where[slot.name] = (b_index, s_index)
        self.filled: Dict[str, bool] = {}     # name -> gradient was present
        self.ready = [0] * len(buckets)
        self.handles: Dict[int, object] = {}
        self.sparse: Dict[str, object] = {}    # name -> handle of its sparse reduction
        self.densified: Dict[str, int] = {}    # name -> sparse_dim of the gradient received
        #: b_index -> (name, the factor its residual needs) of the slot that
        #: completed the buffer, whose residual waits for the launch.
        self.unsettled: Dict[int, Tuple[str, Tensor]] = {}


class ACPReducer:
    """Compresses, fuses and all-reduces gradients with ACP-SGD.

    Args:
        named_parameters: (name, parameter) pairs in registration order.
        communicator: the collective backend.
        matrix_rank: rank r of the factors.
        fusion_threshold_bytes: S-SGD fusion threshold (see
            :func:`.fusion.plan_buckets`).
        min_compression_rate: see :func:`.compression.should_compress`.
        warmup_steps: steps of exact averaging before ACP-SGD starts.
        seed: seed of the generator that draws the initial factors.
        backward_passes_per_step: backward passes accumulated per step.
        groups: optional explicit fusion groups, lists of parameter names.
        sparse_as_dense: densify sparse gradients into the fused buffers
            instead of sending them apart.
        name_prefix: first component of the all-reduce names.
        diagnostics: record one :class:`~hvd_acp.diagnostics.StepRecord` per
            step in :attr:`diagnostics` (costs a few passes per gradient).
        overlap: compress each gradient and launch each buffer from the
            hooks, while backward goes on (True); or all of it in
            :meth:`synchronize`, after backward (False: same maths and
            buffers, in slot order instead of arrival order).
        agree_at_first_step: check with one small collective, at the first
            step, that every rank starts from the same compression state
            (off for elastic jobs, whose workers join at any step and are
            synchronized by Horovod's state handler instead).

    Attributes:
        state: the :class:`~hvd_acp.state.CompressionState` (factors,
            residuals, step count), keyed by parameter name.
    """

    def __init__(self, named_parameters: Sequence[Tuple[str, Tensor]],
                 communicator: Communicator, *, matrix_rank: int,
                 fusion_threshold_bytes: int, min_compression_rate: float,
                 warmup_steps: int = 0, seed: int = 0,
                 backward_passes_per_step: int = 1,
                 groups: Optional[Sequence[Sequence[str]]] = None,
                 sparse_as_dense: bool = False, name_prefix: str = "hvd_acp",
                 diagnostics: bool = False, agree_at_first_step: bool = True,
                 overlap: bool = True):
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        self.params: Dict[str, Tensor] = dict(named_parameters)
        self.overlap = overlap
        self.comm = communicator
        self.fusion_threshold_bytes = fusion_threshold_bytes
        self.backward_passes_per_step = backward_passes_per_step
        self.groups = [list(g) for g in groups] if groups else None
        self.sparse_as_dense = sparse_as_dense
        self.name_prefix = name_prefix
        #: Seconds spent in compression maths (hooks, orthonormalization,
        #: reconstruction) since construction; benchmarks read it.
        self.compression_seconds = 0.0
        #: Steps whose averaged payload was non-finite (state repaired).
        self.nonfinite_steps = 0
        #: Per-step records (dicts, see hvd_acp.diagnostics) when enabled.
        self.diagnostics: Optional[List[dict]] = [] if diagnostics else None
        self._record: Optional[StepRecord] = None
        self._previous_bases: Dict[Tuple[Phase, str], Tensor] = {}
        #: False on a rank outside the communicator's process set: there, as
        #: with Horovod's optimizer, no hook is registered and nothing is
        #: communicated; the wrapped optimizer steps on the local gradients.
        self.included = communicator.included()
        #: The averaged factors of the compressed gradients synchronize() wrote
        #: (||G|| = ||factor||, the basis being orthonormal; None for a
        #: non-finite one), and each one's ``p.grad._version`` right after:
        #: see applied_scale, which only reads the factors' norms if needed.
        self.written_factors: List[Optional[Tensor]] = []
        self.written_versions: Dict[str, int] = {}

        devices = {p.device for p in self.params.values()}
        if len(devices) > 1:
            raise NotImplementedError(
                f"parameters on several devices ({sorted(map(str, devices))}) are not "
                "supported: wrap each device's parameters in its own DistributedOptimizer")
        self.device = devices.pop() if devices else torch.device("cpu")

        # Initial factors drawn in registration order from the state's own
        # generator: identical on every rank, the user's global RNG untouched.
        self.state = CompressionState(matrix_rank=matrix_rank,
                                      min_compression_rate=min_compression_rate,
                                      warmup_steps=warmup_steps, seed=seed)
        for name, param in self.params.items():
            self.state.add(name, param.shape, param.dtype, self.device)
        self._bases: Dict[str, Tensor] = {}
        #: Whether the first-step check of the state across ranks is still owed.
        self._agreement_owed = agree_at_first_step and self.included
        #: Where this rank's state came from, for that check's error message.
        self._origin = "fresh"

        self._plans: Dict[tuple, List[Bucket]] = {}
        self._buffers: Dict[tuple, List[Tensor]] = {}
        self._views: Dict[tuple, Dict[str, Tensor]] = {}
        #: name -> a copy of this rank's P_i, for the residual of a slot that
        #: completes its buffer (the all-reduce writes the average over it).
        self._sent: Dict[str, Tensor] = {}
        self._hooks: Dict[str, object] = {}
        self._passes: Dict[str, int] = {name: 0 for name in self.params}
        #: Without overlap: names whose last backward pass of the step has
        #: arrived, left for synchronize() to take.
        self._deferred: List[str] = []
        self._round: Optional[_Round] = None
        self._bases_phase: Optional[Phase] = None
        self._closed = False
        self.register_hooks()

    # ------------------------------------------------------------------ state
    @property
    def step_count(self) -> int:
        """Steps (communication rounds) completed."""
        return self.state.step_count

    @property
    def layouts(self) -> Dict[str, TensorLayout]:
        return self.state.layouts

    @property
    def errors(self) -> Dict[str, Tensor]:
        """name -> this rank's residual, for every compressed parameter."""
        return self.state.errors

    @property
    def phase(self) -> Phase:
        """Phase of the current step, derived from ``step_count``."""
        return self.state.phase

    def _prepare_bases(self) -> None:
        """Orthonormalize the reused factor of every compressed tensor.

        P step: Qh = orth(Q); Q step: Ph = orth(P). Same-shaped factors are
        orthonormalized in one batched call.
        """
        phase = self.phase
        if self._bases_phase is phase:
            return
        if phase is not Phase.DENSE:
            started = time.perf_counter()
            self.state.orthonormal_bases(phase, self.state.tensors, out=self._bases)
            self.compression_seconds += time.perf_counter() - started
            if self.diagnostics is not None:
                self._record_bases(phase, self.state.tensors)
        self._bases_phase = phase

    def _record_bases(self, phase: Phase, names) -> None:
        self._record = StepRecord(self.step_count, phase.value)
        for name in names:
            basis = self._bases[name]
            previous = self._previous_bases.get((phase, name))
            if previous is not None:
                self._record.turns.append(subspace_turn(basis, previous))
            self._previous_bases[(phase, name)] = basis.clone()

    # ------------------------------------------------------------------ hooks
    def register_hooks(self) -> None:
        """Hook every parameter that requires a gradient and has no hook yet."""
        if self._closed or not self.included:
            return
        for name, param in self.params.items():
            if param.requires_grad and name not in self._hooks:
                self._hooks[name] = param.register_post_accumulate_grad_hook(
                    self._make_hook(name))

    def remove_hooks(self) -> None:
        """Remove every hook for good (the reducer no longer sees gradients)."""
        self._closed = True
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()

    def _make_hook(self, name: str):
        def hook(param: Tensor) -> None:
            self._on_gradient(name, param)
        return hook

    def _on_gradient(self, name: str, param: Tensor) -> None:
        passes = self._passes[name] + 1
        if passes > self.backward_passes_per_step:
            raise RuntimeError(
                f"Gradients were computed more than backward_passes_per_step="
                f"{self.backward_passes_per_step} times before call to step() "
                f"(parameter {name!r}). Increase backward_passes_per_step to "
                "accumulate gradients locally, or call step() after each backward.")
        self._passes[name] = passes
        if passes == self.backward_passes_per_step:
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
            # Its slot still carries zeros, so that the buffer completes and
            # launches as on every rank; its compression state is left alone.
            self._open_round().sparse[name] = self.comm.sparse_allreduce_async(
                grad, f"{self.name_prefix}.sparse.{name}")
            self._fill(name, None)

    # ------------------------------------------------------------------ round
    @property
    def round_open(self) -> bool:
        """Whether backward has started the current round (a gradient was taken,
        or, without overlap, left for :meth:`synchronize`)."""
        return bool(self._deferred) or (self._round is not None and bool(self._round.filled))

    @property
    def pending(self) -> bool:
        """Whether any gradient was counted since the last synchronize()."""
        return any(self._passes.values())

    def _active_names(self) -> Tuple[str, ...]:
        return tuple(n for n, p in self.params.items() if p.requires_grad)

    def _round_phase(self) -> Phase:
        """Phase whose plan the round's first all-reduce uses."""
        return self.phase

    def _plan(self, phase: Phase, names: Tuple[str, ...]
              ) -> Tuple[List[Bucket], List[Tensor], Dict[str, Tensor]]:
        """Buckets, their flat buffers and each slot's view, for ``phase`` over
        ``names`` (cached: the views are made once, not per step)."""
        key = (phase, names, self.state.layout_version)
        if key not in self._plans:
            if len(self._plans) > 64:          # ranks changed many times: drop old plans
                self._plans.clear()
                self._buffers.clear()
                self._views.clear()
                self._sent.clear()
            layouts = [self.layouts[n] for n in names]
            active = set(names)
            groups = ([[n for n in g if n in active] for g in self.groups]
                      if self.groups else None)
            groups = [g for g in groups if g] if groups else None
            self._plans[key] = plan_buckets(
                layouts, phase, self.fusion_threshold_bytes, groups, self.name_prefix)
            self._buffers[key] = [torch.empty(b.numel, dtype=b.dtype, device=self.device)
                                  for b in self._plans[key]]
            self._views[key] = {
                slot.name: buffer[slot.offset:slot.offset + slot.numel].view(slot.shape)
                for bucket, buffer in zip(self._plans[key], self._buffers[key])
                for slot in bucket.slots}
        return self._plans[key], self._buffers[key], self._views[key]

    def _open_round(self) -> _Round:
        if self._round is None:
            if self._agreement_owed:
                self._agree_on_state()
            self.register_hooks()
            self._prepare_bases()
            phase = self._round_phase()
            self._round = _Round(phase, *self._plan(phase, self._active_names()))
        return self._round

    def _slot_view(self, rnd: _Round, name: str) -> Tensor:
        return rnd.views[name]

    def _fill(self, name: str, grad: Optional[Tensor]) -> None:
        """Put this rank's payload for ``name`` into its slot.

        ``grad=None`` is a zero gradient: the error feedback still flows
        (except for a gradient sent apart, whose slot is only zeroed).
        """
        rnd = self._open_round()
        if name not in rnd.where:
            raise RuntimeError(
                f"parameter {name!r} got a gradient but had requires_grad=False when "
                "this step's first gradient arrived; change requires_grad only between steps")
        lay = self.layouts[name]
        out = self._slot_view(rnd, name)
        b_index = rnd.where[name][0]
        if lay.compressed and rnd.phase is not Phase.DENSE and name not in rnd.sparse:
            started = time.perf_counter()
            self._compress(rnd, b_index, name, grad, out)
            self.compression_seconds += time.perf_counter() - started
        elif lay.compressed and name not in rnd.sparse and self.state.probing:
            self.state.probe_payload_(name, grad, out)      # M + E, residual paid
        elif grad is None:
            out.zero_()
        else:
            out.copy_(grad if grad.shape == out.shape else grad.reshape(out.shape))
        rnd.filled[name] = grad is not None
        rnd.ready[b_index] += 1
        if rnd.ready[b_index] == len(rnd.buckets[b_index].slots):
            self._launch(rnd, b_index)

    def _launch(self, rnd: _Round, b_index: int) -> None:
        """Start the buffer's all-reduce; then, while it is on the wire, the
        residual of the slot whose factor completed it."""
        rnd.handles[b_index] = self.comm.allreduce_async_(
            rnd.buffers[b_index], rnd.buckets[b_index].name)
        unsettled = rnd.unsettled.pop(b_index, None)
        if unsettled is not None:
            started = time.perf_counter()
            name, factor = unsettled
            self.state.tensors[name].settle_(rnd.phase, self._bases[name], factor)
            self.compression_seconds += time.perf_counter() - started

    def _compress(self, rnd: _Round, b_index: int, name: str, grad: Optional[Tensor],
                  out: Tensor) -> None:
        """This rank's factor of ``name`` into ``out``, with error feedback.

        The residual is computed right away, while ``A`` is still in the
        cache, except for the slot that completes buffer ``b_index``: its
        residual would delay the launch, and waits for it (:meth:`_launch`),
        computed from a copy of ``P_i`` (a Q step's ``Q_i^T`` is apart anyway).

        Args:
            grad: the gradient (any shape with n * m elements), or None for zero.
            out: shape (n, r) for P, (m, r) for Q; a view into a fused buffer.
        """
        tensor, basis, phase = self.state.tensors[name], self._bases[name], rnd.phase
        factor_t = tensor.project_(phase, grad, basis, out, record=self._record)
        factor = out if phase is Phase.P else factor_t
        if rnd.ready[b_index] + 1 < len(rnd.buckets[b_index].slots):
            tensor.settle_(phase, basis, factor)
            return
        if phase is Phase.P:
            sent = self._sent.get(name)
            if sent is None or sent.shape != out.shape or sent.dtype != out.dtype:
                sent = self._sent[name] = torch.empty_like(out)
            factor = sent.copy_(out)
        rnd.unsettled[b_index] = (name, factor)

    def _agree_on_state(self) -> None:
        """Check, once, that every rank starts from the same compression state.

        Run at the first step on every rank (one small all-gather), so that a
        checkpoint loaded on some ranks only raises on all of them instead of
        leaving them in different phases, whose all-reduces never match.
        """
        self._agreement_owed = False
        step_count, factor_sum = self.state.fingerprint()
        gathered = self.comm.allgather_object((step_count, factor_sum, self._origin),
                                              name=f"{self.name_prefix}.first_step")
        if all(entry[:2] == gathered[0][:2] for entry in gathered):
            return
        described = "; ".join(f"rank {rank} at step {entry[0]} ({entry[2]})"
                              for rank, entry in enumerate(gathered))
        raise RuntimeError(
            "hvd_acp: the ranks start training from different compression states: "
            f"{described}. A checkpoint was loaded on some ranks only. Load it on every "
            "rank, or load it on the root rank and then call "
            "hvd.broadcast_optimizer_state(optimizer, root_rank=0) on every rank, as "
            "Horovod's examples do")

    def synchronize(self) -> None:
        """Finish the round: all-reduce everything, write ``p.grad``, flip phase.

        Parameters that got no gradient in this round on this rank count as
        zero gradients. Afterwards ``p.grad`` of every parameter that
        requires a gradient holds the averaged (reconstructed) gradient,
        identical on every rank.
        """
        if not self.included:
            return
        rnd = self._open_round()
        for bucket in rnd.buckets:
            for slot in bucket.slots:
                if slot.name not in rnd.filled:
                    self._take(slot.name, self.params[slot.name])
        self._complete(rnd)
        if rnd.phase is Phase.DENSE and self.state.probing:
            self._probe(rnd)
        self._complete_sparse(rnd)
        self._round = None
        self._deferred.clear()
        for name in self._passes:
            self._passes[name] = 0
        if self._record is not None:
            self.diagnostics.append(self._record.as_dict())
            self._record = None
        self.state.step_count += 1
        self.register_hooks()

    def _probe(self, rnd: _Round) -> None:
        """Choose each compressed tensor's rank from its averaged gradient (auto rank).

        The averaged buffers are identical on every rank, so every rank
        chooses the same ranks and factors. A tensor whose average is not
        finite, or that arrived sparse, keeps its rank and factors.
        """
        started = time.perf_counter()
        for name in self.state.tensors:
            if name not in rnd.where or name in rnd.sparse:
                continue
            averaged = self._slot_view(rnd, name)
            if bool(torch.isfinite(averaged).all()):
                self.state.probe_(name, averaged)
        self.state.end_probe()
        self._bases_phase = None
        if self.diagnostics is not None:
            self.diagnostics.append({"step": self.step_count, "phase": "probe",
                                     "ranks": self.state.ranks(),
                                     "kept_energy": dict(self.state.kept_energy)})
        self.compression_seconds += time.perf_counter() - started

    def applied_scale(self) -> float:
        """How the user rescaled the written gradients since synchronize().

        1 when no compressed ``p.grad`` was modified; otherwise
        ``||p.grad|| / ||G||`` over the compressed tensors, e.g. ``1 / scale``
        after ``GradScaler.unscale_`` (times a clipping factor). The
        residuals are in the units of what was written.
        """
        changed = any(self.params[n].grad is not None and self.params[n].grad._version != v
                      for n, v in self.written_versions.items())
        if not changed or any(f is None for f in self.written_factors):
            return 1.0
        written = sum(float(f.double().pow(2).sum()) for f in self.written_factors)
        if written <= 0:
            return 1.0
        now = sum(float(self.params[n].grad.double().pow(2).sum())
                  for n in self.written_versions if self.params[n].grad is not None)
        scale = (now / written) ** 0.5
        return scale if scale == scale and scale != float("inf") else 1.0

    def _complete(self, rnd: _Round) -> None:
        """Wait for the round's buffers and turn them into ``p.grad``.

        Buffers are taken in launch (backward) order, and each one's
        gradients are reconstructed as soon as it arrives, while the later
        buffers (those of the first layers, launched at the end of backward)
        are still on the wire.
        """
        nonfinite = set()
        self.written_factors, self.written_versions = [], {}
        for b_index, bucket in enumerate(rnd.buckets):
            self.comm.synchronize(rnd.handles[b_index])
            started = time.perf_counter()
            bad = self._nonfinite_slots(rnd, [b_index])
            for slot in bucket.slots:
                if slot.name not in rnd.sparse:
                    self._write_grad(rnd, slot.name, slot.name not in bad)
            nonfinite |= bad
            self.compression_seconds += time.perf_counter() - started
        self._count_nonfinite(nonfinite)

    def _complete_sparse(self, rnd: _Round) -> None:
        """Hand the optimizer a sparse ``p.grad`` where the gradient arrived sparse.

        The gathered result is identical on every rank; a densified gradient
        keeps the rows (``sparse_dim``) where the average is nonzero, as
        Horovod converts it back.
        """
        for name, handle in rnd.sparse.items():
            self.params[name].grad = self.comm.synchronize_sparse(handle)
        for name, sparse_dim in rnd.densified.items():
            param = self.params[name]
            param.grad = param.grad.to_sparse(sparse_dim)

    def _count_nonfinite(self, names: set) -> None:
        if names:
            self.nonfinite_steps += 1
            logger.info("step %d: non-finite averaged gradient for %d tensor(s); "
                        "factors kept, error feedback reset", self.step_count, len(names))

    def _nonfinite_slots(self, rnd: _Round, indices: Optional[Sequence[int]] = None) -> set:
        """Names whose averaged payload holds inf or NaN (e.g. an fp16 overflow).

        The averaged buffers are identical on every rank, so every rank finds
        the same names and repairs the same state (the caller: the factor
        keeps its previous value and the residual restarts from zero). The
        non-finite gradient still reaches ``p.grad``, where a ``GradScaler``
        sees it and skips the step.
        """
        bad = set()
        for b_index in range(len(rnd.buckets)) if indices is None else indices:
            bucket, buffer = rnd.buckets[b_index], rnd.buffers[b_index]
            # One reduction and one read per buffer: a sum is finite unless an
            # entry is inf or NaN (or the sum overflows, when the per-slot test
            # below finds nothing to repair).
            if not math.isfinite(float(buffer.sum())):
                bad.update(nonfinite_names(
                    (slot.name, buffer[slot.offset:slot.offset + slot.numel])
                    for slot in bucket.slots))
        return bad

    def _grad_target(self, lay: TensorLayout, param: Tensor) -> Tuple[Tensor, bool]:
        """An (n, m) matrix to write ``param``'s gradient into, in ``lay.dtype``.

        Returns the matrix and whether it is ``param.grad`` itself (else the
        caller copies it there).
        """
        if param.grad is None:
            param.grad = torch.empty_like(param, memory_format=torch.contiguous_format)
        grad = param.grad
        if grad.is_contiguous() and grad.dtype == lay.dtype:
            return (grad if grad.shape == (lay.n, lay.m) else grad.view(lay.n, lay.m)), True
        return torch.empty(lay.n, lay.m, dtype=lay.dtype, device=self.device), False

    def _write_grad(self, rnd: _Round, name: str, commit: bool = True) -> None:
        """Write the averaged gradient of ``name`` into ``p.grad``.

        With ``commit`` the averaged factor becomes the state reused by the
        next step; without (a non-finite round, whose residuals were reset)
        the factor is left alone.
        """
        lay, param = self.layouts[name], self.params[name]
        averaged = self._slot_view(rnd, name)
        if lay.compressed and rnd.phase is not Phase.DENSE:
            tensor = self.state.tensors[name]
            matrix, direct = self._grad_target(lay, param)
            tensor.apply_(rnd.phase, averaged, self._bases[name], matrix, commit)
            if self._record is not None:
                self._record.add_feedback(matrix, tensor.error)
            if not direct:
                param.grad.copy_(matrix.view(param.grad.shape))
            # ||G|| = ||averaged factor|| (the basis is orthonormal): what was
            # written, to tell later how the user rescaled it (AMP unscaling).
            self.written_factors.append(
                (tensor.p if rnd.phase is Phase.P else tensor.q) if commit else None)
            self.written_versions[name] = param.grad._version
        else:
            if param.grad is None:
                param.grad = torch.empty_like(param, memory_format=torch.contiguous_format)
            grad = param.grad
            grad.copy_(averaged if averaged.shape == grad.shape else averaged.view(grad.shape))

    def share(self) -> float:
        """This rank's part of an all-reduced result (1 when it is the average)."""
        return 1.0 / (self.comm.size() * self.comm.reduction_weight())

    def discard_round(self) -> None:
        """Forget the round in progress: counted passes, filled slots, handles.

        Used when state is restored after a failure (elastic training), when
        the in-flight all-reduces will never complete.
        """
        if self.round_open:
            logger.warning("discarding the gradients of an unfinished step")
        self._round = None
        self._deferred.clear()
        for name in self._passes:
            self._passes[name] = 0

    # ------------------------------------------------------------- checkpoint
    def wire_elements(self, phase: Phase) -> int:
        """Elements one rank sends in a step of ``phase`` (all tensors active)."""
        return self.state.wire_elements(phase)

    def state_dict(self, with_error: bool = True) -> dict:
        """Compression state of this rank (see :meth:`.CompressionState.state_dict`).

        Args:
            with_error: include this rank's error-feedback residuals.
        """
        return self.state.state_dict(rank=self.comm.rank(), world_size=self.comm.size(),
                                     with_error=with_error)

    def load_state_dict(self, state: dict, reset_error_feedback: bool = False) -> None:
        """Restore :meth:`state_dict` output of this rank or another one.

        A residual is installed only on the rank that saved it (see
        :meth:`.CompressionState.load_state_dict`).

        Args:
            state: as returned by :meth:`state_dict`.
            reset_error_feedback: start every residual from zero.
        """
        self.state.load_state_dict(state, rank=self.comm.rank(),
                                   reset_error_feedback=reset_error_feedback)
        self._origin = (f"loaded from a checkpoint of step {self.state.step_count} saved by "
                        f"rank {state.get('rank')}")
        self.discard_round()
        self._bases_phase = None

    def reset_error_feedback(self) -> None:
        self.state.reset_error_feedback()
