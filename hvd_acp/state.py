"""The compression state of ACP-SGD, one object under every front end.

``torch.optim``'s classes all call one functional step; hvd_acp's front ends
(the Horovod reducer, the DDP hook, Power-SGD and the planner's profiler) all
hold a :class:`CompressionState` and run each parameter's step through
:class:`CompressedTensor`. A change to the error feedback is one edit here.

Per compressed parameter (a gradient viewed as an (n, m) matrix ``M``)::

    P step                                Q step
    A   = M + E                           A   = M + E
    P_i = A Qh          (sent)            Q_i = A^T Ph        (sent)
    E   = A - P_i Qh^T  (kept, local)     E   = A - Ph Q_i^T  (kept, local)
    P   = mean_i P_i    (committed)       Q   = mean_i Q_i    (committed)
    G   = P Qh^T        (applied)         G   = Ph Q^T        (applied)

``Qh`` and ``Ph`` are the orthonormalized factors of the previous step
(:meth:`CompressionState.orthonormal_bases`). With ``both_factors`` every
step is a PQ step: ``P_i = A Qh`` and ``Q_i = A^T Ph`` travel together, on
the bases ``(Ph, Qh)``, and ``G`` is the projection of the average on the
tangent space of both (:func:`.compression.reconstruct_both_`). The maths itself is in
:mod:`.compression`; this module owns the tensors and their lifecycle:
initial factors, a slot's payload (:meth:`CompressionState.encode_`, the
residual left for after the launch where a front end asks), an averaged
buffer back into the gradients with one non-finite test per buffer
(:meth:`CompressionState.decode_`: commit, reconstruct, or repair),
checkpoints and the settings every rank must share. The front ends only
register hooks, fill buffers, launch and wait.

Under ``matrix_rank="auto"`` (:mod:`.autorank`) the rank of each tensor
changes at probe steps, at the same step on every rank: :meth:`CompressionState.probe_payload_`
and :meth:`CompressionState.probe_` are the two halves of a probe, and
``layout_version`` tells the front ends to re-plan their fused buffers.

Checkpoints (:meth:`CompressionState.state_dict`) are keyed by parameter
name. A residual ``E`` belongs to the rank that accumulated it: loaded on
another rank it would be counted twice, so :meth:`load_state_dict` installs
it only on the rank that saved it and starts the others from zero.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import threading
from typing import Dict, Iterable, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from .autorank import AutoRank, choose_rank, energy_curve, parse_matrix_rank, spectral_factors
from .compression import (Phase, compress_, compress_both_, compress_columns_, compute_dtype,
                          init_factor, local_residual_, local_residual_both_,
                          local_residual_columns_, orthonormal_copies, orthonormalize_,
                          phase_of, reconstruct_, reconstruct_both_)
from .fusion import TensorLayout, make_layouts, rank_limit
from .rescaling import GradientRescaling

logger = logging.getLogger(__name__)

__all__ = ["STATE_FORMAT_VERSION", "CompressedTensor", "CompressionState", "PendingResidual",
           "check_compression_settings", "check_state_version"]

#: Version of :meth:`CompressionState.state_dict`'s format: residuals in the
#: local form ``E = A - P_i B^T``.
STATE_FORMAT_VERSION = 2


def is_int(value) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_compression_settings(matrix_rank, min_compression_rate, warmup_steps, seed) -> None:
    """Raise ``ValueError``/``TypeError`` naming the first bad setting of a
    :class:`CompressionState`; front ends call it before any collective."""
    parse_matrix_rank(matrix_rank)
    if (not isinstance(min_compression_rate, numbers.Real)
            or isinstance(min_compression_rate, bool) or not min_compression_rate >= 0):
        raise ValueError("min_compression_rate must be a number >= 0, got "
                         f"{min_compression_rate!r}")
    if not is_int(warmup_steps) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if not is_int(seed):
        raise TypeError(f"seed must be an int, got {seed!r}")


class CompressedTensor:
    """Factors and error-feedback residual of one compressed parameter.

    Attributes:
        layout: the parameter's matrix view (n, m), rank r and compute dtype.
        p: shape (n, r), the last averaged P (identical on every rank).
        q: shape (m, r), the last averaged Q (identical on every rank).
        error: shape (n, m), this rank's residual ``E``.
    """

    __slots__ = ("layout", "p", "q", "error", "_error_shaped", "_basis_t", "_sent", "_g_terms")

    def __init__(self, layout: TensorLayout, generator: torch.Generator,
                 device: torch.device) -> None:
        lay = self.layout = layout
        # Q before P: the order every checkpoint and test of hvd_acp assumes.
        self.q = init_factor(lay.m, lay.r, generator, lay.dtype, device)
        self.p = init_factor(lay.n, lay.r, generator, lay.dtype, device)
        self.error = torch.zeros(lay.n, lay.m, dtype=lay.dtype, device=device)
        #: ``error`` viewed in the parameter's shape, made once: a gradient of
        #: that shape is added in without an operator call to view it.
        self._error_shaped = self.error.view(lay.shape)
        #: (basis, basis.T): a P step's basis is used transposed twice (the
        #: residual, the reconstruction); the view is made once.
        self._basis_t: Tuple[Optional[Tensor], Optional[Tensor]] = (None, None)
        #: A copy of this rank's P_i for a residual computed after the launch
        #: (the all-reduce writes the average over the slot); made once per shape.
        self._sent: Optional[Tensor] = None
        #: (P, Q^T - Ph^T P Qh^T) of the last PQ step: ||G||^2 is the sum of
        #: their squared norms (:meth:`committed`).
        self._g_terms: Optional[Tuple[Tensor, Tensor]] = None

    def resize_(self, layout: TensorLayout, p: Tensor, q: Tensor) -> None:
        """Take a new rank (``layout.r``) with the factors ``p`` (n, r) and
        ``q`` (m, r); the residual, whose shape does not depend on the rank,
        is kept."""
        self.layout = layout
        self.p = p.to(dtype=layout.dtype, device=self.error.device).contiguous()
        self.q = q.to(dtype=layout.dtype, device=self.error.device).contiguous()

    def reused(self, phase: Phase):
        """The factor a step of ``phase`` projects on: Q for a P step, P for a
        Q step, the pair (P, Q) for a PQ step."""
        if phase is Phase.PQ:
            return self.p, self.q
        return self.q if phase is Phase.P else self.p

    def committed(self, phase: Phase):
        """What has the norm of the step's ``G``: the factor a P or Q step
        averages (its basis is orthonormal); after a PQ step the pair of
        tensors whose squared norms add up to ``||G||^2``."""
        if phase is Phase.PQ:
            return self._g_terms
        return self.p if phase is Phase.P else self.q

    def compress_(self, phase: Phase, grad: Optional[Tensor], basis: Tensor, out: Tensor, *,
                  residual: bool = True, defer: bool = False,
                  record=None) -> Optional["PendingResidual"]:
        """This rank's factor of ``grad`` into ``out``, with error feedback.

        Args:
            phase: P or Q.
            grad: this rank's gradient, any shape with ``numel == n * m`` and
                any floating dtype; ``None`` for a zero gradient.
            basis: shape (m, r) (``Qh``) for a P step, (n, r) (``Ph``) for a Q
                step, the pair ``(Ph, Qh)`` for a PQ step.
            out: shape (n, r) for P, (m, r) for Q, receives ``A @ basis``;
                (n + m, r) for PQ, receives ``A Qh`` over ``A^T Ph``.
            residual: keep ``E = A - out @ basis.T``. Without it ``error``
                holds ``A`` afterwards (Power-SGD's first projection, whose
                residual the second one computes).
            defer: leave the residual for later and return what it needs, so
                that ``out`` goes on the wire before the residual's GEMM. A P
                step's residual then reads a copy of ``P_i`` this tensor owns
                (an all-reduce in place writes the average over ``out``).
            record: a :class:`~hvd_acp.diagnostics.StepRecord` to add to.

        Returns:
            With ``defer`` the :class:`PendingResidual` to finish; else None.

        Modifies ``error`` in place (it holds ``A`` until the residual is done).
        """
        error = self.error
        if grad is None:
            matrix = None
        elif grad.shape == self._error_shaped.shape and grad.dtype == error.dtype:
            self._error_shaped.add_(grad)             # A = M + E, in the gradient's shape
            matrix, grad = grad, None
        else:
            matrix = grad = _as_matrix(grad, self.layout)
        if phase is Phase.P:
            compress_(grad, error, basis, out)        # A = M + E, P_i = A Qh
            factor = out
        elif phase is Phase.PQ:
            compress_both_(grad, error, basis[0], basis[1], out)   # P_i over Q_i
            factor = out
        else:
            factor = compress_columns_(grad, error, basis, out)   # Q_i = A^T Ph; Q_i^T back
        if record is not None:                         # norms: either orientation
            record.add_compressed(matrix, error, out, None if phase is not Phase.PQ
                                  else torch.mm(basis[0].t(), out[:self.layout.n]))
        if not residual:
            return None
        if not defer:
            self._residual_(phase, basis, factor)
            return None
        if phase is not Phase.Q:
            sent = self._sent
            if sent is None or sent.shape != out.shape or sent.dtype != out.dtype:
                sent = self._sent = torch.empty_like(out)
            factor = sent.copy_(out)
        return PendingResidual(self, phase, basis, factor)

    def _residual_(self, phase: Phase, basis: Tensor, factor: Tensor) -> None:
        """``E = A - P_i Qh^T`` (P step, ``factor`` is ``P_i`` (n, r)),
        ``E = A - Ph Q_i^T`` (Q step, ``factor`` is ``Q_i^T`` (r, m)) or
        ``E = (I - Ph Ph^T) A (I - Qh Qh^T)`` (PQ step, ``factor`` is the
        payload (n + m, r): ``P_i`` over ``Q_i``)."""
        if phase is Phase.P:
            local_residual_(self.error, factor, basis, self._transpose(basis))
        elif phase is Phase.PQ:
            n = self.layout.n
            local_residual_both_(self.error, factor[:n], factor[n:].transpose(0, 1), *basis)
        else:
            local_residual_columns_(self.error, basis, factor)

    def _transpose(self, basis: Tensor) -> Tensor:
        """``basis.T``, made once per basis."""
        if self._basis_t[0] is not basis:
            self._basis_t = (basis, basis.transpose(0, 1))
        return self._basis_t[1]

    def commit_(self, phase: Phase, averaged: Tensor) -> Tensor:
        """Keep the averaged factor of ``phase`` (both: P over Q) for the next
        step; returns it."""
        if phase is Phase.PQ:
            n = self.layout.n
            self.p.copy_(averaged[:n])
            self.q.copy_(averaged[n:])
            return averaged
        factor = self.p if phase is Phase.P else self.q
        return factor.copy_(averaged)

    def reconstruct_(self, phase: Phase, factor: Tensor, basis, target: Tensor) -> None:
        """``G`` into ``target`` (n, m): ``factor @ basis.T`` (P), ``basis @
        factor.T`` (Q), or the tangent projection of P over Q on ``basis``
        = ``(Ph, Qh)`` (PQ, :func:`.compression.reconstruct_both_`)."""
        if phase is Phase.P:
            reconstruct_(target, factor, basis, self._transpose(basis))  # G = P Qh^T
        elif phase is Phase.PQ:
            n = self.layout.n
            self._g_terms = reconstruct_both_(target, factor[:n], factor[n:], *basis)
        else:
            reconstruct_(target, basis, factor)            # G = Ph Q^T

    def apply_(self, phase: Phase, averaged: Tensor, basis: Tensor, target: Tensor,
               commit: bool = True) -> None:
        """The averaged gradient ``G`` into ``target`` (n, m), from the averaged factor.

        With ``commit`` the averaged factor becomes the one reused by the next
        step; without (a non-finite average, identical on every rank) the
        factor is kept and the residual restarts from zero (:meth:`repair_`).
        """
        factor = averaged if averaged.dtype == self.layout.dtype else averaged.to(self.layout.dtype)
        if commit:
            factor = self.commit_(phase, factor)
        else:
            self.repair_()
        self.reconstruct_(phase, factor, basis, target)

    def decode_(self, phase: Phase, averaged: Tensor, basis: Tensor, grad: Tensor, *,
                commit: bool = True, record=None) -> None:
        """:meth:`apply_` into ``grad``, the parameter's gradient: any shape of
        ``n * m`` elements and any dtype (written through a matrix of the
        compute dtype where it is not one already)."""
        lay = self.layout
        direct = grad.dtype == lay.dtype and grad.is_contiguous()
        if direct:
            target = grad if grad.shape == (lay.n, lay.m) else grad.view(lay.n, lay.m)
        else:
            target = torch.empty(lay.n, lay.m, dtype=lay.dtype, device=grad.device)
        self.apply_(phase, averaged, basis, target, commit)
        if record is not None:
            record.add_feedback(target, self.error)
        if not direct:
            grad.copy_(target.view(grad.shape))

    def repair_(self) -> None:
        """Restart the residual from zero (after a non-finite average)."""
        self.error.zero_()

    def state_dict(self, with_error: bool = True) -> Dict[str, Tensor]:
        entry = {"P": self.p.clone(), "Q": self.q.clone()}
        if with_error:
            entry["error"] = self.error.clone()
        return entry

    def load_(self, entry: dict, keep_error: bool) -> None:
        """Copy a saved entry in (shapes checked by the caller); the residual
        restarts from zero unless ``keep_error`` and the entry has one."""
        self.p.copy_(entry["P"])
        self.q.copy_(entry["Q"])
        if keep_error and "error" in entry:
            self.error.copy_(entry["error"])
        else:
            self.error.zero_()


class PendingResidual:
    """A residual :meth:`CompressedTensor.compress_` left for later (``defer``)."""

    __slots__ = ("tensor", "phase", "basis", "factor")

    def __init__(self, tensor: CompressedTensor, phase: Phase, basis: Tensor,
                 factor: Tensor) -> None:
        self.tensor, self.phase, self.basis, self.factor = tensor, phase, basis, factor

    def finish_(self) -> None:
        """Compute the residual: ``E = A - P_i Qh^T`` (or ``A - Ph Q_i^T``)."""
        self.tensor._residual_(self.phase, self.basis, self.factor)


def _as_matrix(grad: Tensor, lay: TensorLayout) -> Tensor:
    """``grad`` viewed as the (n, m) matrix of ``lay``, in its compute dtype
    (no operator call where it already is one)."""
    if grad.dim() != 2 or grad.shape[0] != lay.n or not grad.is_contiguous():
        grad = grad.reshape(lay.n, lay.m)
    return grad if grad.dtype == lay.dtype else grad.to(lay.dtype)


def check_state_version(state: dict) -> None:
    """Raise ``ValueError`` unless ``state`` is a compression state this version reads."""
    if not isinstance(state, dict) or "params" not in state:
        raise ValueError("not an hvd_acp compression state (expected the dict of "
                         "state_dict(), with 'version', 'step_count' and 'params')")
    version = state.get("version")
    if version != STATE_FORMAT_VERSION:
        raise ValueError(f"unsupported hvd_acp state format version {version!r}; this "
                         f"version reads {STATE_FORMAT_VERSION}")


class CompressionState:
    """Settings, step count and per-parameter state of ACP-SGD for one model.

    Args:
        matrix_rank: rank r of the factors; ``"auto"`` or an
            :class:`~hvd_acp.autorank.AutoRank` for a rank per tensor chosen
            at probe steps (see :mod:`.autorank`).
        min_compression_rate: see :func:`.compression.should_compress`.
        warmup_steps: steps of exact averaging before compression starts.
        both_factors: every compressed step sends both factors (PQ) instead
            of P and Q in turn.
        seed: seed of the dedicated generator that draws the initial factors
            in the order parameters are added: identical on every rank that
            adds the same parameters, and the global RNG is untouched.

    Attributes:
        step_count: steps (communication rounds) completed.
        layouts: name -> :class:`~hvd_acp.fusion.TensorLayout` of every
            parameter added, compressed or not.
        tensors: name -> :class:`CompressedTensor` of the compressed ones.
        nonfinite_steps: steps whose averaged payload held inf or NaN (see
            :meth:`decode_`).
        rescaling: what the user did to the gradients :meth:`decode_` wrote
            before the update (:class:`~hvd_acp.rescaling.GradientRescaling`;
            its ``unit`` puts a residual in the optimizer's units).

    A front end fills each fused buffer's slots with :meth:`encode_`,
    launches the buffer's all-reduce, finishes the residual it was handed
    back, and once the average is in writes the gradients with
    :meth:`decode_`.
    """

    def __init__(self, *, matrix_rank: int, min_compression_rate: float, warmup_steps: int,
                 seed: int, both_factors: bool = False) -> None:
        check_compression_settings(matrix_rank, min_compression_rate, warmup_steps, seed)
        self.matrix_rank = matrix_rank
        self.both_factors = bool(both_factors)
        #: The rank of a tensor's first layout (``max_rank`` under auto) and the
        #: auto-rank policy (None for a fixed rank).
        self._initial_rank, self.auto = parse_matrix_rank(matrix_rank)
        #: Bumped whenever a tensor's rank changes (fused-buffer plans depend on it).
        self.layout_version = 0
        #: Under auto: the share of each probed gradient's energy its rank keeps.
        self.kept_energy: Dict[str, float] = {}
        self.min_compression_rate = min_compression_rate
        self.warmup_steps = warmup_steps
        self.seed = seed
        self.step_count = 0
        self.layouts: Dict[str, TensorLayout] = {}
        self.tensors: Dict[str, CompressedTensor] = {}
        self._generator = torch.Generator().manual_seed(seed)
        #: Loaded entries of parameters not added yet (see load_state_dict).
        self._pending: Optional[Dict[str, dict]] = None
        self._pending_keep_error = False
        self.nonfinite_steps = 0
        self._last_nonfinite: Optional[int] = None
        #: DDP runs each bucket's decode on a communication thread.
        self._lock = threading.Lock()
        self.rescaling = GradientRescaling()

    def begin_step(self) -> None:
        """A front end starts writing a step's payloads (its first slot or bucket)."""
        self.rescaling.clear()

    # --------------------------------------------------------------- layout
    def add(self, name: str, shape: Sequence[int], dtype: torch.dtype,
            device: torch.device) -> TensorLayout:
        """Add a parameter; draws its initial factors if it is compressed."""
        if name in self.layouts:
            raise ValueError(f"two parameters are named {name!r}")
        lay, = make_layouts([(name, tuple(shape), dtype)], self._initial_rank,
                            self.min_compression_rate, payload_dtype=compute_dtype,
                            any_rank=self.auto is not None)
        self.layouts[name] = lay
        if lay.compressed:
            self.tensors[name] = CompressedTensor(lay, self._generator, device)
        if self._pending is not None:
            self._load_entry(name, self._pending.pop(name, None), self._pending_keep_error)
        return lay

    @property
    def phase(self) -> Phase:
        """Phase of the current step: DENSE during warm-up, then P, Q, P, ...
        (PQ, PQ, ... with ``both_factors``).

        Under auto rank a probe step is DENSE too, and P, Q, ... start again
        after it (the first step after a probe uses the probe's Q).
        """
        if self.auto is None:
            return phase_of(self.step_count, self.warmup_steps, self.both_factors)
        if self.step_count < self.warmup_steps or self.probing:
            return Phase.DENSE
        # P, Q, ... counted from the step after the last probe (or from warm-up's end).
        since = self.step_count - self.warmup_steps
        return phase_of(since - self.auto.last_probe(since) - 1, 0, self.both_factors)

    @property
    def probing(self) -> bool:
        """Whether the current step is an auto-rank probe (DENSE, residuals
        sent along, ranks chosen from the average)."""
        return self.probes_at(self.step_count)

    def probes_at(self, step: int) -> bool:
        """Whether step ``step`` is an auto-rank probe."""
        since = step - self.warmup_steps
        return self.auto is not None and since >= 0 and self.auto.is_probe(since)

    def ranks(self) -> Dict[str, int]:
        """name -> rank of every compressed tensor."""
        return {name: t.layout.r for name, t in self.tensors.items()}

    # ------------------------------------------------------- encode, decode
    def encode_(self, name: str, grad: Optional[Tensor], out: Tensor, phase: Phase, *,
                basis: Optional[Tensor] = None, residual: bool = True, defer: bool = False,
                record=None) -> Optional[PendingResidual]:
        """This rank's payload of ``name`` in a step of ``phase`` into ``out``,
        its slot of a fused buffer (shape ``layout.payload_shape(phase)``).

        A compressed tensor outside warm-up sends its factor
        (:meth:`CompressedTensor.compress_`, on ``basis``, by default the
        factor it reuses as it is); at a probe step ``M + E``
        (:meth:`probe_payload_`); anything else its gradient, or zeros for
        ``grad=None``.

        Returns:
            The residual left for after the launch (``defer``), or None.
        """
        tensor = self.tensors.get(name)
        if tensor is not None and phase is not Phase.DENSE:
            return tensor.compress_(phase, grad, tensor.reused(phase) if basis is None else basis,
                                    out, residual=residual, defer=defer, record=record)
        if tensor is not None and self.probing:
            self.probe_payload_(name, grad, out)        # M + E, residual paid
        elif grad is None:
            out.zero_()
        else:
            out.copy_(grad if grad.shape == out.shape else grad.reshape(out.shape))
        return None

    def decode_(self, phase: Phase, buffer: Tensor, members: Sequence[Tuple[str, Tensor]],
                grads: Sequence[Optional[Tensor]],
                bases: Optional[Dict[str, Tensor]] = None, *, bad: Iterable[str] = (),
                reconstruct: bool = True, step: Optional[int] = None,
                record=None) -> Set[str]:
        """Write one averaged buffer into the gradients.

        A compressed tensor outside warm-up commits its averaged factor and
        writes ``G`` (P step: ``P Qh^T``, Q step: ``Ph Q^T``); anything else
        copies its average, and at a probe step a compressed tensor then
        chooses its rank from it (:meth:`probe_`).

        The averaged buffer is identical on every rank, so every rank finds
        the same slots non-finite (one sum over the buffer, then slot by slot
        only if that sum is not finite) and repairs the same state: such a
        tensor keeps its factor and restarts its residual from zero, and the
        non-finite gradient is still written, where a ``GradScaler`` sees it
        and skips the step.

        Args:
            phase: the buffer's phase.
            buffer: the averaged flat buffer.
            members: (name, averaged slot of ``buffer``) of its tensors.
            grads: per member the gradient to write (any shape of its
                ``n * m`` elements, any dtype), or None to leave it alone (a
                gradient sent apart).
            bases: name -> the basis each compressed factor was projected
                on; by default the factor it reuses.
            bad: names already found non-finite in this step (Power-SGD's
                first all-reduce).
            reconstruct: False only commits the compressed factors (Power-SGD's
                P, orthonormalized before its second projection).
            step: the step the buffer belongs to (default: the current one).
            record: a :class:`~hvd_acp.diagnostics.StepRecord` to add to.

        Returns:
            The names whose average (or ``bad``'s) was not finite.
        """
        found = self.nonfinite(buffer, members)
        bad = found.union(bad) if bad else found
        step = self.step_count if step is None else step
        probing = phase is Phase.DENSE and self.probes_at(step)
        for (name, averaged), grad in zip(members, grads):
            if grad is None:
                continue
            tensor = self.tensors.get(name)
            if tensor is None or phase is Phase.DENSE:
                grad.copy_(averaged if averaged.shape == grad.shape
                           else averaged.view(grad.shape))
                if probing and tensor is not None and name not in bad:
                    self.probe_(name, averaged, step)       # rank chosen from the average
            elif reconstruct:
                tensor.decode_(phase, averaged,
                               tensor.reused(phase) if bases is None else bases[name], grad,
                               commit=name not in bad, record=record)
                self.rescaling.wrote(name, grad,
                                     None if name in bad else tensor.committed(phase))
            else:
                tensor.commit_(phase, averaged)
        if found:
            with self._lock:
                if self._last_nonfinite != step:
                    self._last_nonfinite = step
                    self.nonfinite_steps += 1
            logger.info("step %d: non-finite averaged gradient for %d tensor(s); factors "
                        "kept, error feedback reset", step, len(found))
        return bad

    @staticmethod
    def nonfinite(buffer: Tensor, members: Iterable[Tuple[str, Tensor]]) -> Set[str]:
        """Names of the members whose slot of ``buffer`` holds inf or NaN.

        One reduction and one read per buffer: a sum is finite unless an
        entry is inf or NaN (or the sum overflows, when the test slot by
        slot finds nothing).
        """
        if math.isfinite(float(buffer.sum())):
            return set()
        return {name for name, view in members if not bool(torch.isfinite(view).all())}

    def orthonormalize_p_(self, names: Iterable[str]) -> None:
        """``P = orth(P)`` in place for ``names`` (Power-SGD between its two
        all-reduces); same-shaped factors in one batched call."""
        orthonormalize_(self.tensors[name].p for name in names)

    def probe_payload_(self, name: str, grad: Optional[Tensor], out: Tensor) -> None:
        """A probe step's payload of a compressed tensor into ``out`` (any shape
        of n * m elements): ``M + E``, the residual restarting from zero (or
        ``M`` alone, the residual kept, without ``AutoRank.pay_residual``)."""
        tensor = self.tensors[name]
        flat = out.view(tensor.layout.n, tensor.layout.m)
        if not self.auto.pay_residual:
            if grad is None:
                flat.zero_()
            else:
                flat.copy_(grad.reshape(flat.shape))
            return
        if grad is None:
            flat.copy_(tensor.error)
        else:
            torch.add(grad.reshape(flat.shape).to(flat.dtype), tensor.error, out=flat)
        tensor.error.zero_()

    def probe_(self, name: str, averaged: Tensor, step: Optional[int] = None) -> int:
        """Choose the rank of ``name`` from its averaged gradient at a probe step.

        Identical on every rank (the average is), with no communication: the
        rank keeping ``auto.energy`` of ``||averaged||^2``, and factors
        started from ``averaged``'s best approximation of that rank (see
        :mod:`.autorank`). Returns the rank.

        Args:
            name: a compressed tensor.
            averaged: its averaged gradient at the probe (n * m elements).
            step: the probe's step (default: the current step count), which
                seeds the randomized range finder.
        """
        step = self.step_count if step is None else step
        tensor, auto = self.tensors[name], self.auto
        lay = tensor.layout
        matrix = averaged.reshape(lay.n, lay.m).to(lay.dtype)
        limit = rank_limit(lay.n, lay.m, self.min_compression_rate)
        top = min(auto.max_rank, limit)
        seed = (self.seed * 1_000_003 + step * 7919
                + list(self.tensors).index(name)) % (2 ** 63)
        curve = energy_curve(matrix, top, oversample=auto.oversample, seed=seed)
        rank = choose_rank(curve, auto.energy, min(auto.min_rank, top), top)
        self.kept_energy[name] = float(curve[rank - 1]) if len(curve) else 1.0
        self._set_rank(name, rank, *spectral_factors(matrix, rank, oversample=auto.oversample,
                                                     seed=seed))
        return rank

    def _set_rank(self, name: str, rank: int, p: Tensor, q: Tensor) -> None:
        """Give ``name`` the rank ``rank`` and the factors ``p``, ``q`` (its
        residual is kept); fused-buffer plans are re-made if the rank changed."""
        tensor = self.tensors[name]
        lay = tensor.layout
        if rank != lay.r:
            self.layouts[name] = lay = dataclasses.replace(lay, r=rank)
            self.layout_version += 1
        tensor.resize_(lay, p, q)

    def end_probe(self, step: Optional[int] = None) -> None:
        """Log the ranks a probe step chose (call once all tensors are probed).

        Args:
            step: the probe's step (default: the current step count).
        """
        step = self.step_count if step is None else step
        logger.info("hvd_acp: step %d: ranks chosen per tensor (auto): %s; %d elements per "
                    "compressed step at most, S-SGD sends %d", step,
                    describe_ranks(self.ranks()), self.compressed_elements(),
                    sum(lay.numel for lay in self.layouts.values()))

    def describe(self, fp16_wire: bool = False) -> str:
        """One line for the log: what is compressed at which ranks, and the
        share of S-SGD's bytes a step sends (P and Q steps on average)."""
        phases = (Phase.PQ,) if self.both_factors else (Phase.P, Phase.Q)
        sent_bytes = sum(sum(lay.payload_numel(phase) for phase in phases) / len(phases)
                         * (2 if fp16_wire else lay.dtype.itemsize)
                         for lay in self.layouts.values())
        dense = sum(lay.numel * lay.grad_dtype.itemsize for lay in self.layouts.values())
        return (f"compressed: {describe_ranks(self.ranks())}, "
                f"{len(self.layouts) - len(self.tensors)} other tensors averaged whole; "
                f"a step sends {sent_bytes / dense:.1%} of "
                f"S-SGD's bytes ({sent_bytes:,.0f} of {dense:,} bytes"
                f"{', fp16 on the wire' if fp16_wire else ''})")

    def compressed_elements(self) -> int:
        """Elements one rank sends in a compressed step (the larger of P and Q)."""
        if self.both_factors:
            return self.wire_elements(Phase.PQ)
        return max(self.wire_elements(Phase.P), self.wire_elements(Phase.Q))

    @property
    def errors(self) -> Dict[str, Tensor]:
        """name -> this rank's residual ``E`` (n, m), for every compressed parameter."""
        return {name: t.error for name, t in self.tensors.items()}

    @property
    def p_factors(self) -> Dict[str, Tensor]:
        return {name: t.p for name, t in self.tensors.items()}

    @property
    def q_factors(self) -> Dict[str, Tensor]:
        return {name: t.q for name, t in self.tensors.items()}

    def wire_elements(self, phase: Phase) -> int:
        """Elements one rank sends in a step of ``phase`` (every parameter added)."""
        return sum(lay.payload_numel(phase) for lay in self.layouts.values())

    def orthonormal_bases(self, phase: Phase, names: Iterable[str],
                          out: Optional[Dict[str, Tensor]] = None) -> Dict[str, Tensor]:
        """The orthonormalized reused factor (``Qh`` or ``Ph``; the pair
        ``(Ph, Qh)`` for PQ) of each of ``names``.

        Same-shaped factors are orthonormalized in one batched call, and each
        basis is a view of its batch's result (nothing copied back). Written
        into ``out`` (name -> basis) if given; the factors themselves are
        left as they are.
        """
        out = {} if out is None else out
        names = list(names)
        if phase is Phase.PQ:
            tensors = [self.tensors[name] for name in names]
            bases = orthonormal_copies([t.p for t in tensors] + [t.q for t in tensors])
            out.update(zip(names, zip(bases[:len(names)], bases[len(names):])))
            return out
        out.update(zip(names, orthonormal_copies(self.tensors[name].reused(phase)
                                                 for name in names)))
        return out

    # ------------------------------------------------------------- checking
    def settings(self) -> Dict[str, float]:
        """The settings every rank must share, by name."""
        auto = self.auto.settings() if self.auto is not None else {}
        return {"matrix_rank": self._initial_rank, "auto_rank": int(self.auto is not None),
                **{f"auto_{key}": auto.get(key, 0) for key in AutoRank.__dataclass_fields__},
                "min_compression_rate": self.min_compression_rate,
                "warmup_steps": self.warmup_steps, "seed": self.seed,
                "both_factors": int(self.both_factors)}

    def fingerprint(self) -> Tuple[int, float]:
        """(step count, sum of every factor in float64): equal on every rank
        whose state came from the same place; cheap to gather."""
        total = 0.0
        for tensor in self.tensors.values():
            total += float(tensor.p.double().sum()) + float(tensor.q.double().sum())
        return self.step_count, total

    # ---------------------------------------------------------- checkpoints
    def state_dict(self, *, rank: Optional[int], world_size: Optional[int],
                   with_error: bool = True) -> dict:
        """Compression state of this rank, keyed by parameter name.

        Args:
            rank, world_size: recorded so that a residual is only ever
                installed on the rank that accumulated it.
            with_error: include this rank's residuals.
        """
        params = {name: t.state_dict(with_error) for name, t in self.tensors.items()}
        for name, entry in (self._pending or {}).items():
            params[name] = {k: v for k, v in entry.items() if with_error or k != "error"}
        return {
            "version": STATE_FORMAT_VERSION,
            "step_count": self.step_count,
            "phase": self.phase.value,
            "warmup_steps": self.warmup_steps,
            "matrix_rank": self.matrix_rank if self.auto is None else "auto",
            "auto_rank": None if self.auto is None else self.auto.settings(),
            "ranks": self.ranks(),
            "world_size": world_size,
            "rank": rank,
            "grad_unit": self.rescaling.unit,
            "params": params,
        }

    def load_state_dict(self, state: dict, *, rank: Optional[int],
                        reset_error_feedback: bool = False, complete: bool = True) -> None:
        """Restore :meth:`state_dict` output (this rank's, or another rank's).

        Factors and step count are loaded as saved. A residual is installed
        only when ``state`` was saved by this same ``rank`` (or records no
        rank) and ``reset_error_feedback`` is not set: anywhere else it is
        another rank's unsent gradient, and this rank's starts from zero
        (logged). The world size may differ: factors do not depend on it.

        Args:
            state: as returned by :meth:`state_dict`.
            rank: this process's rank, compared with the saving rank's.
            reset_error_feedback: start every residual from zero.
            complete: every parameter has been added. Otherwise entries of
                parameters not added yet wait until :meth:`add` (a DDP state
                learns its parameters in the first iteration) and
                :meth:`check_loaded` reports the ones never added.

        Raises:
            ValueError: an unsupported format, or entries that do not match
                the parameters; nothing is loaded then.
        """
        self.check_state_dict(state, complete)      # before anything is loaded
        saved_rank = state.get("rank")
        keep_error = not reset_error_feedback and (saved_rank is None or rank is None
                                                   or saved_rank == rank)
        saved = state["params"]
        if not keep_error and not reset_error_feedback and any(
                "error" in entry for entry in saved.values()):
            logger.info("hvd_acp: the residuals in this checkpoint were saved by rank %s; "
                        "rank %s starts its own from zero (a residual is one rank's unsent "
                        "gradient)", saved_rank, rank)
        for name in self.tensors:
            self._load_entry(name, saved[name], keep_error)
        self._pending = None if complete else {
            name: {k: v for k, v in entry.items() if keep_error or k != "error"}
            for name, entry in saved.items() if name not in self.layouts}
        self._pending_keep_error = keep_error
        self.step_count = int(state["step_count"])
        # The residuals' units when saved (a checkpoint of an older version: 1).
        self.rescaling.unit = float(state.get("grad_unit", 1.0))

    def check_state_dict(self, state: dict, complete: bool = True) -> None:
        """Raise ``ValueError`` unless :meth:`load_state_dict` can load ``state``."""
        check_state_version(state)
        saved = state["params"]
        if complete:
            missing = sorted(set(self.tensors) - set(saved))
            unexpected = sorted(set(saved) - set(self.tensors))
            if missing or unexpected:
                raise ValueError(f"hvd_acp state does not match the parameters: missing "
                                 f"{missing}, unexpected {unexpected}")
        for name in self.layouts:
            self._check_entry(name, saved.get(name))

    def _check_entry(self, name: str, entry: Optional[dict]) -> None:
        """Raise ``ValueError`` unless ``entry`` can be loaded into parameter ``name``."""
        tensor = self.tensors.get(name)
        if tensor is None:
            if entry is not None:
                raise ValueError(f"hvd_acp state has factors for {name!r}, which is not "
                                 "compressed here (different matrix_rank or model?)")
            return
        if entry is None:
            raise ValueError(f"hvd_acp state has no entry for the compressed parameter "
                             f"{name!r} (a checkpoint of another model?)")
        lay = tensor.layout
        if self.auto is not None and "P" in entry and "Q" in entry:
            # Under auto the rank is the saved one, within what may be compressed.
            rank = entry["P"].shape[-1]
            limit = min(self.auto.max_rank, rank_limit(lay.n, lay.m, self.min_compression_rate))
            if (tuple(entry["P"].shape) != (lay.n, rank)
                    or tuple(entry["Q"].shape) != (lay.m, rank) or not 1 <= rank <= limit):
                raise ValueError(
                    f"hvd_acp state for {name!r}: factors of shapes {tuple(entry['P'].shape)} "
                    f"and {tuple(entry['Q'].shape)} do not fit a ({lay.n}, {lay.m}) matrix "
                    f"at a rank in [1, {limit}] (a checkpoint of another model?)")
            expected = {"P": (lay.n, rank), "Q": (lay.m, rank), "error": (lay.n, lay.m)}
        else:
            expected = {"P": tuple(tensor.p.shape), "Q": tuple(tensor.q.shape),
                        "error": tuple(tensor.error.shape)}
        for key, shape in expected.items():
            if key in entry and tuple(entry[key].shape) != shape:
                raise ValueError(
                    f"hvd_acp state for {name!r}: {key} has shape {tuple(entry[key].shape)}, "
                    f"expected {shape} (different matrix_rank or model?)")

    def _load_entry(self, name: str, entry: Optional[dict], keep_error: bool) -> None:
        self._check_entry(name, entry)
        if entry is None:
            return
        tensor = self.tensors[name]
        rank = entry["P"].shape[-1]
        if self.auto is not None and rank != tensor.layout.r:
            self._set_rank(name, rank, entry["P"].clone(), entry["Q"].clone())
        tensor.load_(entry, keep_error)

    def check_loaded(self) -> None:
        """Once every parameter has been added: raise if a loaded entry found none."""
        pending, self._pending = self._pending, None
        if pending:
            raise ValueError("hvd_acp state has entries for parameters this model does not "
                             f"have: {sorted(pending)}")

    def reset_error_feedback(self) -> None:
        """Set every residual to zero."""
        for tensor in self.tensors.values():
            tensor.repair_()


def describe_ranks(ranks: Dict[str, int]) -> str:
    """``"12 tensors, rank 2-32 (median 8)"``, or ``"none"``."""
    if not ranks:
        return "none"
    values = sorted(ranks.values())
    return (f"{len(values)} tensors, rank {values[0]}-{values[-1]} "
            f"(median {values[len(values) // 2]})")

