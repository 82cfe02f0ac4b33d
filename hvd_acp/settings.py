"""ACP-SGD's own settings and their defaults: one object under every front end.

``hvd_acp.DistributedOptimizer``, ``hvd_acp.PowerSGDOptimizer``, the DDP
hook's :class:`~hvd_acp.ddp.ACPState`, the Lightning, Accelerate and
Transformers integrations and the benchmark's methods all take these
settings by name, with ``None`` for "the library's default", and hand them to
:class:`Settings`. :meth:`Settings.resolve` is the one place a default is
decided, given the torch optimizer being trained: SGD-like optimizers (CNNs)
and adaptive ones (Adam and its family: transformers) get different
compression, for the reasons measured in docs/convergence.md.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from typing import Any, Dict, Optional, Tuple, Union

import torch

from .autorank import AutoRank, parse_matrix_rank

__all__ = ["Settings", "RANK_ADVICE", "optimizer_family", "facts_of", "is_int", "is_number",
           "check_step_ahead"]

logger = logging.getLogger(__name__)

#: How to choose ``matrix_rank``: the one wording README, docs and
#: docstrings use (a test holds them to it).
RANK_ADVICE = ("Leave it to the default: rank 4 for SGD-like optimizers (CNNs), and for "
               "Adam-family optimizers (transformers) 0.3 of each matrix's smaller side "
               "with both factors sent every step, in fp16 on the wire; a lower rank sends "
               "less and costs accuracy.")

#: The defaults by optimizer family (:func:`optimizer_family`). An adaptive
#: optimizer divides each coordinate by its own RMS, so it applies every
#: delayed or missing component of the gradient at full strength: it needs
#: a large share of each matrix, and both bases refreshed every step
#: (docs/convergence.md, "Both factors every step").
DEFAULTS = {
    "sgd": {"matrix_rank": 4, "min_compression_rate": 2.0, "fp16_wire": False,
            "both_factors": False},
    "adaptive": {"matrix_rank": 0.3, "min_compression_rate": 1.0, "fp16_wire": True,
                 "both_factors": True},
}
#: An adaptive optimizer's default share for a method sending one factor per
#: step (ACP-SGD with ``both_factors=False``); Power-SGD, which sends two in
#: two all-reduces, gets half of it: the same bytes.
IN_TURN_SHARE = 0.5
COMMON_DEFAULTS = {"warmup_steps": 0, "seed": 0, "step_ahead": 0.2, "int8_factors": False}
#: The settings a ``budget`` chooses (:mod:`hvd_acp.budget`).
BUDGET_PICKS = ("matrix_rank", "fp16_wire", "both_factors", "int8_factors")

def is_int(value) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite real number that is not a bool."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))


def check_step_ahead(step_ahead) -> None:
    """Raise ``ValueError`` unless ``step_ahead`` is a finite number >= 0."""
    if not is_number(step_ahead) or not step_ahead >= 0:
        raise ValueError(f"step_ahead must be a finite number >= 0, got {step_ahead!r}")


def facts_of(settings) -> Dict[str, Any]:
    """A settings dataclass as what every rank must hold equal, by name: the
    value of each field, an :class:`~hvd_acp.AutoRank` as its own fields
    (the one dict every cross-rank check of settings compares)."""
    return {field.name: _comparable(getattr(settings, field.name))
            for field in dataclasses.fields(settings)}


def _comparable(value):
    if isinstance(value, AutoRank):
        return {"auto": value.settings()}
    return value


#: torch optimizers that scale each coordinate by a running statistic of its
#: own gradients (besides any optimizer with ``betas``, as Adam's family has).
_ADAPTIVE = tuple(getattr(torch.optim, name) for name in
                  ("Adagrad", "Adadelta", "RMSprop", "Adafactor") if hasattr(torch.optim, name))


def optimizer_family(optimizer: Optional[torch.optim.Optimizer]) -> Optional[str]:
    """``"sgd"``, ``"adaptive"``, or None without an optimizer.

    ``"sgd"``: ``torch.optim.SGD`` and any optimizer whose parameter groups
    have ``momentum`` and no per-coordinate statistics. ``"adaptive"``:
    Adam, AdamW, NAdam, RAdam, Adamax, Adafactor, Adagrad, RMSprop and any
    optimizer with ``betas`` (Lion, LAMB, 8-bit Adams); an optimizer of
    neither kind is taken as adaptive, whose defaults cost bytes, not accuracy.
    """
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    keys = {key for group in optimizer.param_groups for key in group}
    if isinstance(optimizer, _ADAPTIVE) or keys & {"betas", "beta2_decay", "alpha", "rho"}:
        return "adaptive"
    return "sgd" if "momentum" in keys else "adaptive"


@dataclasses.dataclass(frozen=True)
class Settings:
    r"""The settings of ACP-SGD that every rank must share, and a tuning guide.

    Each one left ``None`` takes the library's default (:meth:`resolve`),
    which depends on the optimizer being trained (:func:`optimizer_family`):
    SGD-like optimizers and adaptive ones (Adam's family) get different
    compression. Bad values raise ``ValueError``/``TypeError`` naming the
    setting, when the object is made.

    1. ``matrix_rank`` (default 4 for SGD, 0.3 for adaptive optimizers):
       the compression, r. Each gradient of shape ``(n, ...)`` is viewed as
       an ``n x m`` matrix and sends ``n r`` (P steps) or ``m r`` (Q steps)
       elements instead of ``n m``, or ``(n + m) r`` every step with
       ``both_factors``. An int is one rank for every matrix; a float in
       (0, 1) is a share of each matrix's smaller side, rounded up (0.3:
       rank 39 for a 128 x 512 matrix). Higher is more accurate and sends
       more. Leave it to the default: rank 4 for SGD-like optimizers (CNNs),
       and for Adam-family optimizers (transformers) 0.3 of each matrix's
       smaller side with both factors sent every step, in fp16 on the wire;
       a lower rank sends less and costs accuracy. ``"auto"`` (or
       an :class:`~hvd_acp.AutoRank`) chooses a rank per tensor from the
       averaged gradients at probe steps (docs/guide.md, "Choosing the rank").
    2. ``fp16_wire`` (default False for SGD, True for adaptive optimizers):
       the fused buffers travel in float16, half the bytes of float32. The
       residual keeps full precision. In ``hvd_acp.DistributedOptimizer``
       Horovod's own argument says it: ``compression=hvd.Compression.fp16``
       (or ``.none``), ``None`` for the default.
    3. ``both_factors`` (default False for SGD, True for adaptive
       optimizers): every step sends both factors, ``P = A Qh`` and ``Q =
       A^T Ph`` on the previous step's bases, in the same single all-reduce,
       instead of P and Q in turn. The gradient applied is ``A``'s
       projection on both bases (up to 2r directions, both refreshed every
       step): at half the rank it sends what alternation sends, and under
       Adam it ends closer to S-SGD (docs/convergence.md, "Both factors
       every step"). With it a rank ``r`` sends ``(n + m) r`` elements per
       step; with ``both_factors=False`` an adaptive optimizer's default
       share is 0.5.
    4. ``warmup_steps`` (default 0): steps of exact averaging (every gradient
       sent whole) before compression starts. The first steps are the most
       sensitive to compression error; 0 is fine for most CNNs, transformers
       gain from a few hundred.
    5. ``min_compression_rate`` (default 2.0 for SGD, 1.0 for adaptive
       optimizers): a matrix is compressed only if its two factors are at
       least this many times smaller than the matrix, ``(n + m) r * rate <=
       n m``; other tensors, and every 1-D tensor (biases, norms), are
       averaged exactly in the same all-reduce. 0 compresses every matrix.
    6. ``step_ahead`` (default 0.2): step-ahead error feedback. Each rank
       computes its next gradient at ``w - step_ahead * lr / (1 - momentum)
       * E_i`` (Adam-family: ``w - step_ahead * lr * E_i / (sqrt(v_hat') +
       eps)``, with ``v_hat'`` the second moment Adam would hold after a
       step on ``E_i``: the step Adam would take for it), where the
       residual it still owes will take the weights. That
       keeps ACP-SGD stable at the learning rates plain averaging trains at
       (scaled by the number of ranks, momentum 0.9), where the residual
       otherwise feeds back late and momentum amplifies it
       (docs/convergence.md). It sends nothing more. 0 runs the published
       method.
    7. ``seed`` (default 0): seed of the dedicated generator that draws the
       initial factors: identical on every rank, the global RNG untouched.
    8. ``int8_factors`` (default False): with ``both_factors`` (its
       default when this is True), each
       element of the factors travels as an 8-bit integer level, four to an
       int32 word (:mod:`hvd_acp.lanes`): half of fp16's bytes for the
       factors (1-D tensors and uncompressed matrices keep ``fp16_wire``'s,
       in buffers of their own). The scale of each factor column is the last
       step's average of it (identical on every rank), times its growth
       from the average before (up to 2x, so that gradients growing
       through a warm-up are not clipped), and the error
       feedback keeps what rounding and clipping leave out
       (:mod:`hvd_acp.codecs.int8`). A rank has ``127 // N`` levels either
       side of zero for N ranks (15 at 8 ranks), up to 127 ranks. The first
       compressed step sends its factors as floats, to learn the scales.
       Not with ``matrix_rank="auto"`` or Power-SGD. In the DDP hook a
       bucket's factors and its other tensors go in two all-reduces.
    9. ``budget`` (default None): instead of 1-3 and 8, the share of S-SGD's
       bytes a step may send, in (0, 1] (``0.077``: 1/13). ACP-SGD then
       picks, for the model's shapes, the largest ``matrix_rank`` share (at
       most the default 0.3) whose step fits, with both factors and fp16 on
       the wire, the factors in 8-bit lanes below share 0.2
       (:mod:`hvd_acp.budget`), and logs what it chose. For Adam-family
       optimizers (not SGD-like ones, nor Power-SGD); a budget below what
       rank 1 sends raises ``ValueError``. docs/guide.md, "A byte budget",
       says what each budget cost in accuracy.
    """

    matrix_rank: Union[int, float, str, AutoRank, None] = None
    min_compression_rate: Optional[float] = None
    warmup_steps: Optional[int] = None
    seed: Optional[int] = None
    step_ahead: Optional[float] = None
    fp16_wire: Optional[bool] = None
    both_factors: Optional[bool] = None
    int8_factors: Optional[bool] = None
    budget: Optional[float] = None

    def __post_init__(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the first bad setting
        given (the defaults pass): every front end checks here, before any
        collective."""
        if self.budget is not None:
            if not is_number(self.budget) or not 0 < self.budget <= 1:
                raise ValueError(f"budget must be a share of S-SGD's bytes in (0, 1], got "
                                 f"{self.budget!r}")
            chosen = [name for name in BUDGET_PICKS if getattr(self, name) is not None]
            if chosen:
                raise ValueError(f"budget picks {', '.join(BUDGET_PICKS)}; leave "
                                 f"{', '.join(chosen)} unset (or give no budget)")
            dataclasses.replace(self, budget=None)      # checks the other settings
            return
        given = self.resolve()
        parse_matrix_rank(given.matrix_rank)
        rate = given.min_compression_rate
        if not isinstance(rate, numbers.Real) or isinstance(rate, bool) or not rate >= 0:
            raise ValueError(f"min_compression_rate must be a number >= 0, got {rate!r}")
        if not is_int(given.warmup_steps) or given.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {given.warmup_steps!r}")
        if not is_int(given.seed):
            raise TypeError(f"seed must be an int, got {given.seed!r}")
        check_step_ahead(given.step_ahead)
        if not isinstance(given.fp16_wire, bool):
            raise TypeError(f"fp16_wire must be True, False or None, got {self.fp16_wire!r}")
        if not isinstance(given.both_factors, bool):
            raise TypeError(f"both_factors must be True, False or None, got "
                            f"{self.both_factors!r}")
        if not isinstance(given.int8_factors, bool):
            raise TypeError(f"int8_factors must be True, False or None, got "
                            f"{self.int8_factors!r}")
        if given.int8_factors and not given.both_factors:
            raise ValueError("int8_factors=True needs both_factors=True (the factors of P "
                             "and Q in turn are not quantized)")
        if given.int8_factors and parse_matrix_rank(given.matrix_rank)[1] is not None:
            raise ValueError("int8_factors=True needs a fixed matrix_rank, not 'auto'")

    @classmethod
    def of(cls, settings: Optional["Settings"] = None, **keywords) -> "Settings":
        """A front end's ``settings=`` beside its keywords: ``settings`` with
        the keywords given (not None) on top, or the keywords alone.

        Every front end takes ACP-SGD's settings this way: one
        ``settings=hvd_acp.Settings(...)``, or any of its fields by name
        (``matrix_rank=4``, ``step_ahead=0``, ...), the names given winning
        over ``settings``; ``None`` is the library's default. A name that is
        not a field raises ``TypeError``.
        """
        unknown = sorted(set(keywords) - {field.name for field in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"{', '.join(map(repr, unknown))}: not a setting of hvd_acp.Settings "
                            f"(its settings: {', '.join(f.name for f in dataclasses.fields(cls))})")
        given = {key: value for key, value in keywords.items() if value is not None}
        if settings is None:
            return cls(**given)
        if not isinstance(settings, Settings):
            raise TypeError(f"settings must be an hvd_acp.Settings, got "
                            f"{type(settings).__name__}")
        return dataclasses.replace(settings, **given) if given else settings

    def resolve(self, optimizer: Optional[torch.optim.Optimizer] = None, *,
                factors_per_step: int = 1, shapes=None) -> "Settings":
        """These settings with every one left ``None`` given its default.

        The one place hvd_acp decides a default: by the family of
        ``optimizer``, the torch optimizer the settings train
        (:func:`optimizer_family`; None where a front end has none: the
        SGD defaults). ``factors_per_step`` is 2 for Power-SGD, which sends
        both factors every step in its own way (``both_factors`` is False
        for it). For an adaptive optimizer ACP-SGD's default share is 0.3
        with both factors, :data:`IN_TURN_SHARE` with P and Q in turn, and
        Power-SGD's half of that (the bytes of P and Q in turn).
        A default decided for a given optimizer is logged at INFO.

        A ``budget`` needs ``shapes``, the trained parameters as (name,
        shape, dtype) triples: it is fitted to them (:mod:`hvd_acp.budget`),
        logged at INFO, and cleared from the settings returned.
        """
        if self.budget is not None:
            return self._fit_budget(optimizer, factors_per_step, shapes)
        family = optimizer_family(optimizer)
        defaults = dict(DEFAULTS[family or "sgd"], **COMMON_DEFAULTS)
        if factors_per_step > 1:
            if self.both_factors:
                raise ValueError("both_factors is ACP-SGD's: Power-SGD already sends both "
                                 "factors, in two all-reduces per step")
            if self.int8_factors:
                raise ValueError("int8_factors is ACP-SGD's (both factors in one all-reduce); "
                                 "Power-SGD sends its factors as floats")
            defaults["both_factors"] = False
        if self.int8_factors and self.both_factors is None:
            defaults["both_factors"] = True          # what int8_factors quantizes
        both = defaults["both_factors"] if self.both_factors is None else self.both_factors
        if family == "adaptive" and (factors_per_step > 1 or not both):
            defaults["matrix_rank"] = IN_TURN_SHARE / factors_per_step
        missing = {key: value for key, value in defaults.items() if getattr(self, key) is None}
        if not missing:
            return self
        resolved = dataclasses.replace(self, **missing)
        if optimizer is not None:
            logger.info("hvd_acp: %s is %s: %s", type(optimizer).__name__,
                        "an adaptive optimizer" if family == "adaptive" else "SGD-like",
                        ", ".join(f"{key}={value!r} (default)" if key in missing
                                  else f"{key}={value!r}"
                                  for key, value in resolved.as_kwargs().items()
                                  if key != "budget" or value is not None))
        return resolved

    def _fit_budget(self, optimizer, factors_per_step: int, shapes) -> "Settings":
        from .budget import fit_budget
        if factors_per_step > 1:
            raise ValueError("budget is ACP-SGD's; Power-SGD takes matrix_rank")
        family = optimizer_family(optimizer)
        if family == "sgd":
            raise ValueError(f"budget picks settings for Adam-family optimizers; with "
                             f"{type(optimizer).__name__} set matrix_rank (its default, rank 4, "
                             f"sends a few % of S-SGD's bytes)")
        if shapes is None:
            raise ValueError("budget needs the model's parameters: pass named_parameters (or "
                             "the optimizer) to the front end")
        adaptive = DEFAULTS["adaptive"]
        rate = (adaptive["min_compression_rate"] if self.min_compression_rate is None
                else self.min_compression_rate)
        fitted, sent = fit_budget(dataclasses.replace(self, min_compression_rate=rate),
                                  list(shapes), adaptive["matrix_rank"])
        logger.info("hvd_acp: budget %.4g of S-SGD's bytes: matrix_rank=%r, int8_factors=%r, "
                    "both_factors=True, fp16_wire=True; a compressed step sends %.4f",
                    self.budget, fitted.matrix_rank, fitted.int8_factors, sent)
        return fitted.resolve(optimizer)

    def as_kwargs(self) -> dict:
        """The settings by name, as every front end takes them."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def facts(self) -> Dict[str, Any]:
        """What every rank must hold equal (:func:`facts_of`)."""
        return facts_of(self)

    @property
    def scheme(self) -> str:
        """The cycle of codecs a compressed run goes through
        (:data:`hvd_acp.codecs.SCHEMES`): ``"both"`` with ``both_factors``,
        else ``"alternating"`` (P and Q in turn)."""
        return "both" if self.both_factors else "alternating"

    def codecs(self, world_size: int = 1) -> Tuple:
        """The codecs of the compressed steps of :attr:`scheme`, in the order
        they use them; with ``int8_factors`` the 8-bit codec for
        ``world_size`` ranks (:meth:`lead_codecs` go first)."""
        from .codecs import SCHEMES, Int8PQCodec
        if self.int8_factors:
            from .lanes import levels_per_rank
            return (Int8PQCodec(levels_per_rank(world_size)),)
        return SCHEMES[self.scheme]

    def lead_codecs(self) -> Tuple:
        """The codecs of the first compressed steps, before :meth:`codecs`
        cycle: one float step of both factors with ``int8_factors`` (its
        averaged factors give the 8-bit scales), else none."""
        from .codecs import SCHEMES
        return SCHEMES["both"] if self.int8_factors else ()
