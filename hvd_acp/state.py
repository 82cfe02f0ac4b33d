"""The compression state of ACP-SGD, one object under every front end.

``torch.optim``'s classes all call one functional step; hvd_acp's front ends
(the Horovod reducer, the DDP hook, Power-SGD and the planner's profiler) all
hold a :class:`CompressionState` and run each parameter's step through
:class:`CompressedTensor`. A change to the error feedback is one edit here.

Per compressed parameter (a gradient viewed as an (n, m) matrix ``M``) and
step, whatever the scheme::

    A = M + E                  (error feedback: this rank's residual added)
    payload = codec.encode_(A) (sent; the residual E = what it does not carry)
    average = mean_i payload   (the all-reduce)
    codec.commit_(average)     (the factors of the next step)
    G = codec.reconstruct_     (written into p.grad)

The codec (:mod:`hvd_acp.codecs`) is the step's kind: ACP-SGD's P and Q in
turn (``P_i = A Qh``, ``Q_i = A^T Ph`` on the other factor of the step
before, orthonormalized), both factors every step, Power-SGD's two rounds.
This module owns what every codec shares: the step (its codec from the
settings' schedule, its bases made once, :meth:`CompressionState.begin_step`
and :meth:`CompressionState.end_step`), initial factors, a slot's payload
(:meth:`CompressionState.encode_`, the residual left for after the launch
where a front end asks), an averaged buffer back into the gradients with one
non-finite test per buffer (:meth:`CompressionState.decode_`: commit,
reconstruct, or repair) and checkpoints. The front ends only register hooks,
fill buffers, launch and wait.

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
import threading
from typing import Dict, Iterable, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from .autorank import choose_rank, energy_curve, parse_matrix_rank, spectral_factors
from .codecs import DENSE, Codec, as_codec
from .compression import compute_dtype, init_factor, orthonormalize_
from .fusion import TensorLayout, dense_bytes, make_layouts, rank_limit, sent_bytes
from .rescaling import GradientRescaling
from .settings import Settings

logger = logging.getLogger(__name__)

__all__ = ["STATE_FORMAT_VERSION", "CompressedTensor", "CompressionState", "PendingResidual",
           "check_state_version"]

#: Version of :meth:`CompressionState.state_dict`'s format: residuals in the
#: local form ``E = A - P_i B^T``.
STATE_FORMAT_VERSION = 2


class CompressedTensor:
    """Factors and error-feedback residual of one compressed parameter.

    What a step sends and makes of the average is its codec's
    (:mod:`hvd_acp.codecs`); this object holds the tensors every codec
    works on and does what every codec shares: ``A = M + E``, a residual
    left for after the launch, a non-finite average's repair, checkpoints.

    Attributes:
        layout: the parameter's matrix view (n, m), rank r and compute dtype.
        p: shape (n, r), the last averaged P (identical on every rank).
        q: shape (m, r), the last averaged Q (identical on every rank).
        error: shape (n, m), this rank's residual ``E``.
        previous_maxima: the column maxima, shape (1, r) each, of the P and Q
            averaged before ``p`` and ``q`` (identical on every rank), which
            the 8-bit codec scales by (:mod:`hvd_acp.codecs.int8`); None
            until it has committed a step.
    """

    __slots__ = ("layout", "p", "q", "error", "previous_maxima", "_error_shaped", "_basis_t",
                 "_sent", "codec_scratch")

    def __init__(self, layout: TensorLayout, generator: torch.Generator,
                 device: torch.device) -> None:
        lay = self.layout = layout
        # Q before P: the order every checkpoint and test of hvd_acp assumes.
        self.q = init_factor(lay.m, lay.r, generator, lay.dtype, device)
        self.p = init_factor(lay.n, lay.r, generator, lay.dtype, device)
        self.error = torch.zeros(lay.n, lay.m, dtype=lay.dtype, device=device)
        self.previous_maxima: Optional[Tuple[Tensor, Tensor]] = None
        #: ``error`` viewed in the parameter's shape, made once: a gradient of
        #: that shape is added in without an operator call to view it.
        self._error_shaped = self.error.view(lay.shape)
        #: (basis, basis.T): a basis used transposed twice (a P step's
        #: residual and reconstruction) is transposed once.
        self._basis_t: Tuple[Optional[Tensor], Optional[Tensor]] = (None, None)
        #: A copy of this rank's payload for a residual computed after the
        #: launch (the all-reduce writes the average over the slot); made once per shape.
        self._sent: Optional[Tensor] = None
        #: What a codec's encode worked out for its commit in the same step
        #: (the 8-bit codec's column steps); the codec checks it still holds.
        self.codec_scratch = None

    def resize_(self, layout: TensorLayout, p: Tensor, q: Tensor) -> None:
        """Take a new rank (``layout.r``) with the factors ``p`` (n, r) and
        ``q`` (m, r); the residual, whose shape does not depend on the rank,
        is kept."""
        self.layout = layout
        self.p = p.to(dtype=layout.dtype, device=self.error.device).contiguous()
        self.q = q.to(dtype=layout.dtype, device=self.error.device).contiguous()
        self.previous_maxima = None                    # the new rank's columns have none

    def transpose(self, basis: Tensor) -> Tensor:
        """``basis.T``, the view made once per basis."""
        if self._basis_t[0] is not basis:
            self._basis_t = (basis, basis.transpose(0, 1))
        return self._basis_t[1]

    def compress_(self, codec, grad: Optional[Tensor], basis, out: Tensor, *,
                  defer: bool = False, record=None) -> Optional["PendingResidual"]:
        """This rank's payload of ``grad`` into ``out``, with error feedback.

        Args:
            codec: the step's :class:`~hvd_acp.codecs.Codec`.
            grad: this rank's gradient, any shape with ``numel == n * m`` and
                any floating dtype; ``None`` for a zero gradient.
            basis: the codec's basis for this tensor (:meth:`.Codec.bases`).
            out: the slot, of shape ``codec.payload_shape(n, m, r)``.
            defer: leave the residual for later and return what it needs, so
                that ``out`` goes on the wire before the residual's GEMM.
            record: a :class:`~hvd_acp.diagnostics.StepRecord` to add to.

        Returns:
            With ``defer`` the :class:`PendingResidual` to finish; else None.

        Modifies ``error`` in place (it holds ``A`` until the residual is done).
        """
        matrix = None
        if grad is not None:
            if grad.shape == self._error_shaped.shape and grad.dtype == self.error.dtype:
                self._error_shaped.add_(grad)         # A = M + E, in the gradient's shape
                matrix = grad
            else:
                matrix = _as_matrix(grad, self.layout)
                self.error.add_(matrix)
        factor = codec.encode_(self, basis, out)
        if record is not None:                         # norms: either orientation
            record.add_compressed(matrix, self.error, out, codec.counted_twice(self, basis, out))
        if not defer:
            codec.residual_(self, basis, factor)
            return None
        if codec.copies_payload:
            sent = self._sent
            if sent is None or sent.shape != out.shape or sent.dtype != out.dtype:
                sent = self._sent = torch.empty_like(out)
            factor = sent.copy_(out)
        return PendingResidual(self, codec, basis, factor)

    def decode_(self, codec, averaged: Tensor, basis, grad: Optional[Tensor], *,
                commit: bool = True, record=None):
        """The averaged payload back: its factors kept (``commit``) and ``G``
        written into ``grad``, the parameter's gradient (any shape of ``n * m``
        elements and any dtype; through a matrix of the compute dtype where it
        is not one already), if the codec writes one.

        Without ``commit`` (a non-finite average, identical on every rank) the
        factors are kept as they were and the residual restarts from zero.

        Returns:
            What has the norm of ``G`` (:meth:`.Codec.reconstruct_`), or None.
        """
        lay = self.layout
        factor = averaged if averaged.dtype == lay.dtype else averaged.to(lay.dtype)
        if commit:
            factor = codec.commit_(self, factor)
        else:
            self.repair_()
        if grad is None or not codec.writes_gradient:
            return None
        direct = grad.dtype == lay.dtype and grad.is_contiguous()
        if direct:
            target = grad if grad.shape == (lay.n, lay.m) else grad.view(lay.n, lay.m)
        else:
            target = torch.empty(lay.n, lay.m, dtype=lay.dtype, device=grad.device)
        terms = codec.reconstruct_(self, factor, basis, target)
        if record is not None:
            record.add_feedback(target, self.error)
        if not direct:
            grad.copy_(target.view(grad.shape))
        return terms

    def repair_(self) -> None:
        """Restart the residual from zero (after a non-finite average)."""
        self.error.zero_()

    def state_dict(self, with_error: bool = True) -> Dict[str, Tensor]:
        entry = {"P": self.p.clone(), "Q": self.q.clone()}
        if self.previous_maxima is not None:
            entry["P_previous_maxima"] = self.previous_maxima[0].clone()
            entry["Q_previous_maxima"] = self.previous_maxima[1].clone()
        if with_error:
            entry["error"] = self.error.clone()
        return entry

    def load_(self, entry: dict, keep_error: bool) -> None:
        """Copy a saved entry in (shapes checked by the caller); the residual
        restarts from zero unless ``keep_error`` and the entry has one."""
        self.p.copy_(entry["P"])
        self.q.copy_(entry["Q"])
        self.previous_maxima = None
        if "P_previous_maxima" in entry and "Q_previous_maxima" in entry:
            self.previous_maxima = tuple(
                entry[key].to(dtype=self.p.dtype, device=self.p.device).clone()
                for key in ("P_previous_maxima", "Q_previous_maxima"))
        if keep_error and "error" in entry:
            self.error.copy_(entry["error"])
        else:
            self.error.zero_()


class PendingResidual:
    """A residual :meth:`CompressedTensor.compress_` left for later (``defer``)."""

    __slots__ = ("tensor", "codec", "basis", "factor")

    def __init__(self, tensor: CompressedTensor, codec, basis, factor: Tensor) -> None:
        self.tensor, self.codec, self.basis, self.factor = tensor, codec, basis, factor

    def finish_(self) -> None:
        """Compute the residual (:meth:`.Codec.residual_`)."""
        self.codec.residual_(self.tensor, self.basis, self.factor)


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
        settings: the resolved :class:`~hvd_acp.Settings` (every default
            decided); or, instead, its settings by keyword (``matrix_rank``,
            ``min_compression_rate``, ``warmup_steps``, ``seed``,
            ``both_factors``; the SGD defaults for the others). What this
            object uses of them: the rank (``"auto"`` or an
            :class:`~hvd_acp.autorank.AutoRank` for a rank per tensor chosen
            at probe steps, see :mod:`.autorank`), which matrices are
            compressed, the steps of exact averaging first, the scheme (the
            cycle of codecs, :meth:`.Settings.codecs`) and the seed of the
            dedicated generator that draws the initial factors in the order
            parameters are added (identical on every rank that adds the same
            parameters; the global RNG is untouched).
        cycle: a front end's own codecs (Power-SGD's), instead of the scheme's.
        world_size: the ranks averaging (the levels of ``int8_factors``).

    Attributes:
        settings: the settings.
        step_count: steps (communication rounds) completed.
        layouts: name -> :class:`~hvd_acp.fusion.TensorLayout` of every
            parameter added, compressed or not.
        tensors: name -> :class:`CompressedTensor` of the compressed ones.
        nonfinite_steps: steps whose averaged payload held inf or NaN (see
            :meth:`decode_`).
        rescaling: what the user did to the gradients :meth:`decode_` wrote
            before the update (:class:`~hvd_acp.rescaling.GradientRescaling`;
            its ``unit`` puts a residual in the optimizer's units).

    The step is this object's: a front end calls :meth:`begin_step` when the
    step's first gradient arrives (the step's codec, its bases, its records
    start), fills each fused buffer's slots with :meth:`encode_`, launches
    the buffer's all-reduce, finishes the residual it was handed back, writes
    the gradients from the average with :meth:`decode_`, and calls
    :meth:`end_step` once the step's communication is done (probes chosen,
    step count moved on). No front end looks at which codec a step uses.
    """

    def __init__(self, settings: Optional[Settings] = None, *,
                 cycle: Optional[Sequence[Codec]] = None, world_size: int = 1,
                 **keywords) -> None:
        if settings is None:
            settings = Settings(**keywords).resolve()
        elif keywords:
            raise TypeError("pass settings or keywords, not both")
        self.settings = settings
        #: The rank of a tensor's first layout (``max_rank`` under auto) and the
        #: auto-rank policy (None for a fixed rank).
        self._initial_rank, self.auto = parse_matrix_rank(settings.matrix_rank)
        #: The codecs of the compressed steps, in turn (a front end of its own
        #: scheme, Power-SGD's, gives its own).
        self._cycle: Tuple[Codec, ...] = (tuple(cycle) if cycle
                                          else settings.codecs(world_size))
        #: The ranks the settings' codecs were made for (None: a front end's own cycle).
        self._world_size: Optional[int] = None if cycle else world_size
        #: The codecs of the first compressed steps, before the cycle
        #: (:meth:`.Settings.lead_codecs`).
        self._lead: Tuple[Codec, ...] = () if cycle else settings.lead_codecs()
        #: Bumped whenever a tensor's rank changes (fused-buffer plans depend on it).
        self.layout_version = 0
        #: Under auto: the share of each probed gradient's energy its rank keeps.
        self.kept_energy: Dict[str, float] = {}
        self.step_count = 0
        self.layouts: Dict[str, TensorLayout] = {}
        self.tensors: Dict[str, CompressedTensor] = {}
        self._generator = torch.Generator().manual_seed(settings.seed)
        #: Loaded entries of parameters not added yet (see load_state_dict).
        self._pending: Optional[Dict[str, dict]] = None
        self._pending_keep_error = False
        self.nonfinite_steps = 0
        self._last_nonfinite: Optional[int] = None
        #: DDP runs each bucket's decode on a communication thread.
        self._lock = threading.Lock()
        self.rescaling = GradientRescaling()
        #: name -> the basis of the step in progress (made once per step and tensor).
        self._bases: Dict[str, object] = {}
        self._bases_codec: Optional[Codec] = None

    # The settings this object reads, by their names.
    matrix_rank = property(lambda self: self.settings.matrix_rank)
    min_compression_rate = property(lambda self: self.settings.min_compression_rate)
    warmup_steps = property(lambda self: self.settings.warmup_steps)
    seed = property(lambda self: self.settings.seed)
    both_factors = property(lambda self: self.settings.both_factors)

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

    # ------------------------------------------------------------- the step
    @property
    def codec(self) -> Codec:
        """The codec of the current step: :data:`~hvd_acp.codecs.DENSE` during
        warm-up and at auto-rank probes, then the scheme's codecs in turn (P,
        Q, P, ... or PQ, PQ, ...), counted from warm-up's end or from the
        step after the last probe (whose Q the first step after it uses)."""
        since = self.step_count - self.warmup_steps
        if since < 0 or self.probing:
            return DENSE
        if self.auto is not None:
            since -= self.auto.last_probe(since) + 1
        if since < len(self._lead):
            return self._lead[since]
        return self._cycle[(since - len(self._lead)) % len(self._cycle)]

    @property
    def phase(self):
        """The current step's :class:`~hvd_acp.compression.Phase` (its codec's)."""
        return self.codec.phase

    @property
    def probing(self) -> bool:
        """Whether the current step is an auto-rank probe (exact, residuals
        sent along, ranks chosen from the average)."""
        return self.probes_at(self.step_count)

    def probes_at(self, step: int) -> bool:
        """Whether step ``step`` is an auto-rank probe."""
        since = step - self.warmup_steps
        return self.auto is not None and since >= 0 and self.auto.is_probe(since)

    def begin_step(self, world_size: Optional[int] = None) -> Codec:
        """A front end starts a step (its first slot or bucket): the records of
        the last one end; returns the step's codec. ``world_size``: the ranks
        averaging now, where they can change between steps (elastic Horovod):
        the settings' codecs are made again for another number (the levels
        of ``int8_factors`` depend on it)."""
        if (world_size is not None and self._world_size is not None
                and world_size != self._world_size):
            self._cycle = self.settings.codecs(world_size)
            self._world_size = world_size
        self.rescaling.clear()
        self._bases, self._bases_codec = {}, None
        return self.codec

    def bases(self, names: Iterable[str], codec: Optional[Codec] = None) -> Dict[str, object]:
        """name -> the basis each compressed tensor of ``names`` projects on in
        this step (``codec``: the current step's), made once per step: those
        not made yet together, same-shaped factors in one batched QR."""
        codec = self.codec if codec is None else codec
        if self._bases_codec is not codec:
            self._bases, self._bases_codec = {}, codec
        if not codec.compressed:
            return self._bases
        missing = [name for name in names if name in self.tensors and name not in self._bases]
        if missing:
            made = codec.bases([self.tensors[name] for name in missing])
            self._bases.update(zip(missing, made))
        return self._bases

    def end_step(self, step: Optional[int] = None) -> None:
        """A step's communication is done (every average written): the ranks
        a probe chose are logged, and the step count moves on.

        Args:
            step: the step that ended (default: the current one); a front
                end that ends it from another thread says which.
        """
        step = self.step_count if step is None else step
        if self.probes_at(step):
            self.end_probe(step)
        with self._lock:
            self.step_count = max(self.step_count, step + 1)
            self._bases, self._bases_codec = {}, None

    def ranks(self) -> Dict[str, int]:
        """name -> rank of every compressed tensor."""
        return {name: t.layout.r for name, t in self.tensors.items()}

    # ------------------------------------------------------- encode, decode
    def encode_(self, name: str, grad: Optional[Tensor], out: Tensor, codec, *,
                basis=None, defer: bool = False, record=None) -> Optional[PendingResidual]:
        """This rank's payload of ``name`` in a step of ``codec`` into ``out``,
        its slot of a fused buffer (``layout.payload_shape(codec)``).

        A compressed tensor in a compressed step sends its codec's payload
        (:meth:`CompressedTensor.compress_`, on ``basis``, by default this
        step's, :meth:`bases`); at a probe step ``M + E``
        (:meth:`probe_payload_`); anything else its gradient, or zeros for
        ``grad=None``.

        Returns:
            The residual left for after the launch (``defer``), or None.
        """
        codec = as_codec(codec)
        tensor = self.tensors.get(name)
        if tensor is not None and codec.compressed:
            if basis is None:
                basis = self.bases((name,), codec)[name]
            return tensor.compress_(codec, grad, basis, out, defer=defer, record=record)
        if tensor is not None and self.probing:
            self.probe_payload_(name, grad, out)        # M + E, residual paid
        elif grad is None:
            out.zero_()
        else:
            out.copy_(grad if grad.shape == out.shape else grad.reshape(out.shape))
        return None

    def decode_(self, codec, buffer: Tensor, members: Sequence[Tuple[str, Tensor]],
                grads: Sequence[Optional[Tensor]], bases: Optional[Dict[str, object]] = None,
                *, bad: Iterable[str] = (), step: Optional[int] = None,
                record=None) -> Set[str]:
        """Write one averaged buffer into the gradients.

        A compressed tensor in a compressed step commits its averaged factors
        and writes ``G`` (:meth:`CompressedTensor.decode_`); anything else
        copies its average, and at a probe step a compressed tensor then
        chooses its rank from it (:meth:`probe_`).

        The averaged buffer is identical on every rank, so every rank finds
        the same slots non-finite (one sum over the buffer, then slot by slot
        only if that sum is not finite) and repairs the same state: such a
        tensor keeps its factors and restarts its residual from zero, and the
        non-finite gradient is still written, where a ``GradScaler`` sees it
        and skips the step.

        Args:
            codec: the buffer's codec.
            buffer: the averaged flat buffer.
            members: (name, averaged slot of ``buffer``) of its tensors.
            grads: per member the gradient to write (any shape of its
                ``n * m`` elements, any dtype), or None to leave it alone (a
                gradient sent apart).
            bases: name -> the basis each compressed tensor was projected
                on; by default this step's (:meth:`bases`).
            bad: names already found non-finite in this step (an earlier
                round of a scheme of several).
            step: the step the buffer belongs to (default: the current one).
            record: a :class:`~hvd_acp.diagnostics.StepRecord` to add to.

        Returns:
            The names whose average (or ``bad``'s) was not finite.
        """
        codec = as_codec(codec)
        found = self.nonfinite(buffer, members)
        bad = found.union(bad) if bad else found
        step = self.step_count if step is None else step
        probing = not codec.compressed and self.probes_at(step)
        if bases is None and codec.compressed:
            bases = self.bases((name for name, _ in members), codec)
        for (name, averaged), grad in zip(members, grads):
            if grad is None:
                continue
            tensor = self.tensors.get(name)
            if tensor is None or not codec.compressed:
                grad.copy_(averaged if averaged.shape == grad.shape
                           else averaged.view(grad.shape))
                if probing and tensor is not None and name not in bad:
                    self.probe_(name, averaged, step)       # rank chosen from the average
                continue
            # A round that writes no gradient commits as it is: the round
            # that writes it finds the average non-finite and repairs.
            commit = name not in bad or not codec.writes_gradient
            terms = tensor.decode_(codec, averaged, bases[name], grad, commit=commit,
                                   record=record)
            if codec.writes_gradient:
                self.rescaling.wrote(name, grad, None if name in bad else terms)
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
        share of S-SGD's bytes a step sends (over the scheme's cycle)."""
        cycle = self._cycle
        sent = sent_bytes(self.layouts.values(), cycle, fp16_wire)
        dense = dense_bytes(self.layouts.values())
        wire = [", fp16 on the wire"] if fp16_wire else []
        if any(codec.lanes for codec in cycle):
            wire = [", factors in 8-bit lanes" + (", the rest in fp16" if fp16_wire else "")]
        return (f"compressed: {describe_ranks(self.ranks())}, "
                f"{len(self.layouts) - len(self.tensors)} other tensors averaged whole; "
                f"a step sends {sent / dense:.1%} of "
                f"S-SGD's bytes ({sent:,.0f} of {dense:,} bytes{''.join(wire)})")

    def compressed_elements(self) -> int:
        """Elements one rank sends in a compressed step (the most of the scheme's codecs)."""
        return max(sum(lay.step_numel(codec) for lay in self.layouts.values())
                   for codec in self._cycle)

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

    def wire_elements(self, codec) -> int:
        """Elements one rank sends in a step of ``codec`` (a
        :class:`~hvd_acp.codecs.Codec` or the :class:`~hvd_acp.compression.Phase`
        of one of hvd_acp's), every parameter added."""
        return sum(lay.payload_numel(codec) for lay in self.layouts.values())

    # ------------------------------------------------------------- checking
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
            "phase": self.codec.name,
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
        self._bases, self._bases_codec = {}, None       # made from the factors loaded
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
            rank = tensor.p.shape[-1]
            expected = {"P": tuple(tensor.p.shape), "Q": tuple(tensor.q.shape),
                        "error": tuple(tensor.error.shape)}
        expected.update({"P_previous_maxima": (1, rank), "Q_previous_maxima": (1, rank)})
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

