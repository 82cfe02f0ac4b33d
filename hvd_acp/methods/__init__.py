"""The ways of averaging gradients that hvd_acp is compared with, declared once.

Each :class:`Method` is one way of training data-parallel: its key, its
names in tables and plots, the launcher its ranks need, and a factory that
sets it up for a model and a torch optimizer::

    built = hvd_acp.methods.get("acp").build(model, optimizer, matrix_rank=4)
    loss_fn(built.model, batch).backward()
    built.optimizer.step()

The benchmark (its workers, tables and plots), the planner's method list and
the scripts read :data:`REGISTRY`; a method declared here appears in all of
them. Every factory returns counters (:meth:`Distributed.counters`): hvd_acp's
own, or those :mod:`hvd_acp.methods.counting` keeps for the implementations that keep
none. Horovod and ``torch.distributed`` are imported by the factories only.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, Optional, Tuple

from ..settings import is_int
from .counting import Counters, CountingCompression, DDPBucketCounter, PowerSGDHookProbe
from .counting import counted_hook, fp16_hook_payload

__all__ = ["HOROVOD", "TORCHRUN", "Counters", "Distributed", "Method", "REGISTRY", "KEYS",
           "settings_of",
           "get", "label", "predicted", "serialized_hook"]

#: Launchers: ``horovodrun`` (Horovod's ranks) or ``torchrun`` (a
#: ``torch.distributed`` process group, Gloo on CPUs).
HOROVOD = "horovod"
TORCHRUN = "torchrun"


@dataclasses.dataclass
class Distributed:
    """What a method's factory set up.

    Attributes:
        model: the module to train (a ``DistributedDataParallel`` wrapper for
            the DDP methods, the model itself for Horovod's).
        optimizer: the optimizer to step.
        state: the DDP communication hook's state (None for Horovod's
            methods and for DDP without a hook).
        counters: returns this rank's :class:`~hvd_acp.methods.counting.Counters`
            so far: bytes handed to all-reduce, all-reduces launched,
            seconds of compression maths.
    """

    model: Any
    optimizer: Any
    counters: Callable[[], Counters]
    state: Any = None


def settings_of(built: Distributed) -> Optional[Dict[str, Any]]:
    """The settings a method trained with, every default decided, as JSON
    values: hvd_acp's (:class:`hvd_acp.Settings`), a baseline's, or torch's
    ``powerSGD_hook``'s state; None for a method without any (S-SGD)."""
    state = built.state
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
    if isinstance(state, PowerSGDState):
        return {"matrix_rank": state.matrix_approximation_rank,
                "min_compression_rate": state.min_compression_rate,
                "start_powerSGD_iter": state.start_powerSGD_iter,
                "use_error_feedback": state.use_error_feedback, "warm_start": state.warm_start}
    settings = getattr(built.optimizer, "settings", None)
    if settings is None:
        settings = getattr(state, "settings", None)
    if settings is None or not dataclasses.is_dataclass(settings):
        return None
    return {field.name: _json_value(getattr(settings, field.name))
            for field in dataclasses.fields(settings)}


def _json_value(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


@dataclasses.dataclass(frozen=True)
class Method:
    """One way of averaging gradients.

    Attributes:
        key: its name in ``--methods``, results files and predictions.
        algorithm: what it computes: ``S-SGD``, ``Power-SGD`` or ``ACP-SGD``;
            or ``DiLoCo``, ``DeMo`` or ``TSR``, which average no gradient
            (:mod:`hvd_acp.baselines`).
        label: its short name, for sentences and the planner's tables.
        implementation: the API that runs it.
        launcher: :data:`HOROVOD` or :data:`TORCHRUN`.
        factory: ``factory(model, optimizer, *, matrix_rank, warmup_steps,
            ddp_options, **options)`` returns a :class:`Distributed`; call it
            through :meth:`build`.
        color: its color in the planner's plots.
        min_warmup_steps: exact (uncompressed) steps the implementation needs
            before it compresses (torch's ``powerSGD_hook``: 2, for its error
            feedback and warm start).
        not_predicted: why the planner (:mod:`hvd_acp.plan`) does not
            simulate this method; None where it does.
        settings: the method's own keyword settings that :meth:`build`
            takes (DiLoCo's ``inner_steps``, ...); the compressors' are
            :class:`hvd_acp.Settings`' and not listed here.
        variant_of: the key of the method this one is a setting or an
            ablation of (fp16 on the wire, batching, no overlap, no fusion);
            None for the reference implementation of its algorithm under its
            launcher, which the convergence comparisons train.
    """

    key: str
    algorithm: str
    label: str
    implementation: str
    launcher: str
    factory: Callable[..., Distributed]
    color: str
    min_warmup_steps: int = 0
    not_predicted: Optional[str] = None
    variant_of: Optional[str] = None
    settings: Tuple[str, ...] = ()

    @property
    def averages_gradients(self) -> bool:
        """Whether it averages every step's gradient (S-SGD, Power-SGD, ACP-SGD),
        so that its step time ranks it against the others; DiLoCo, DeMo and
        TSR are other algorithms, whose step time says nothing about their loss."""
        return not self.settings

    @property
    def title(self) -> str:
        """The name in results tables: ``ACP-SGD (hvd_acp.DistributedOptimizer)``."""
        return f"{self.algorithm} ({self.implementation})"

    @property
    def plot_label(self) -> str:
        """:attr:`label` on two lines, for the bars of a plot."""
        return self.label.replace(" (", "\n(")

    def build(self, model, optimizer, *, matrix_rank=None,
              warmup_steps: Optional[int] = None, ddp_options: Optional[dict] = None,
              **options) -> Distributed:
        """Set the method up for ``model`` and the torch ``optimizer`` built on its parameters.

        Horovod must be initialized (``hvd.init()``) for Horovod's methods, the
        default process group for the DDP ones.

        Args:
            matrix_rank: rank of the factors; None: the library's default
                (:class:`hvd_acp.Settings`). S-SGD compresses nothing and
                ignores it.
            warmup_steps: exact steps before compression starts; None: the
                implementation's default (0 for hvd_acp's,
                :attr:`min_warmup_steps` for torch's hook).
            ddp_options: keyword arguments of ``DistributedDataParallel``
                (DDP methods only).
            options: further keyword arguments of the optimizer wrapper
                (Horovod's methods) or of the hook's state (DDP methods).
        """
        if warmup_steps is not None and warmup_steps < self.min_warmup_steps:
            raise ValueError(f"{self.key} needs warmup_steps >= {self.min_warmup_steps}, "
                             f"got {warmup_steps!r}")
        if ddp_options and self.launcher != TORCHRUN:
            raise ValueError(f"ddp_options apply to the DDP methods only, not to {self.key}")
        return self.factory(model, optimizer, matrix_rank=matrix_rank,
                            warmup_steps=warmup_steps, ddp_options=dict(ddp_options or {}),
                            **options)


# -------------------------------------------------------------- factories
def _ssgd(fp16: bool):
    """Factory of S-SGD with ``hvd.DistributedOptimizer``, its gradients sent in
    fp16 (``hvd.Compression.fp16``) or as they are."""
    def factory(model, optimizer, *, matrix_rank, warmup_steps, ddp_options, **options):
        import horovod.torch as hvd
        if warmup_steps:
            raise ValueError("S-SGD averages every step exactly: it has no warmup_steps")
        if "compression" in options:
            raise ValueError("compression is set by the method (ssgd or ssgd-fp16), "
                             f"got compression={options['compression']!r}")
        compression = CountingCompression(
            hvd.Compression.fp16 if fp16 else hvd.Compression.none, timed=fp16)
        wrapped = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                           compression=compression, **options)
        return Distributed(model, wrapped, compression.counters)
    return factory


def _times(matrix_rank, times: int):
    """``times`` the ``matrix_rank`` given: an int rank, or a share in (0, 1)
    that stays below 1."""
    share = isinstance(matrix_rank, float)
    if not (is_int(matrix_rank) or share) or (share and not times * matrix_rank < 1):
        raise ValueError(f"this method runs at {times} times the matrix_rank given: give a "
                         f"rank, or a share below {1 / times:g}; got {matrix_rank!r}")
    return times * matrix_rank


def _hvd_acp_optimizer(class_name: str, fp16: bool = False, rank_times: int = 1, **preset):
    """Factory of one of hvd_acp's Horovod optimizers (``hvd_acp.<class_name>``),
    with the keyword arguments ``preset`` (an ablation's settings) and, with
    ``fp16``, its fused buffers sent in fp16 (``hvd.Compression.fp16``);
    ``rank_times``: at that many times the ``matrix_rank`` given (a rank or a
    share; one must be given)."""
    def factory(model, optimizer, *, matrix_rank, warmup_steps, ddp_options, **options):
        import hvd_acp
        if rank_times != 1:
            matrix_rank = _times(matrix_rank, rank_times)
        preset_here = dict(preset)
        if fp16:
            import horovod.torch as hvd
            preset_here["compression"] = hvd.Compression.fp16
        clash = sorted(set(preset_here) & set(options))
        if clash:
            raise ValueError(f"{', '.join(clash)} is set by the method ({preset_here}); "
                             f"got {({k: options[k] for k in clash})}")
        if warmup_steps is not None:
            options["warmup_steps"] = warmup_steps
        wrapped = getattr(hvd_acp, class_name)(
            optimizer, named_parameters=model.named_parameters(), matrix_rank=matrix_rank,
            **preset_here, **options)
        return Distributed(model, wrapped, lambda: Counters(
            wrapped.comm_stats.bytes_sent, wrapped.comm_stats.allreduces,
            wrapped.reducer.compression_seconds))
    return factory


def _ddp(model, ddp_options: dict):
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, **ddp_options)


def _ddp_allreduce(model, optimizer, *, matrix_rank, warmup_steps, ddp_options, **options):
    """S-SGD with DDP's built-in all-reduce: no hook, counted from its buckets."""
    if warmup_steps:
        raise ValueError("S-SGD averages every step exactly: it has no warmup_steps")
    if options:
        raise TypeError(f"DDP without a hook takes no hook options, got {sorted(options)}")
    wrapped = _ddp(model, ddp_options)
    counter = DDPBucketCounter(wrapped, optimizer)
    return Distributed(wrapped, optimizer, counter.counters)


def _ddp_fp16(model, optimizer, *, matrix_rank, warmup_steps, ddp_options, **options):
    """S-SGD with DDP and torch's ``fp16_compress_hook`` (``options``: its
    ``process_group``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    if warmup_steps:
        raise ValueError("S-SGD averages every step exactly: it has no warmup_steps")
    unknown = sorted(set(options) - {"process_group"})
    if unknown:
        raise TypeError(f"fp16_compress_hook takes only process_group, got {unknown}")
    wrapped = _ddp(model, ddp_options)
    hook, counters = counted_hook(default_hooks.fp16_compress_hook, fp16_hook_payload)
    wrapped.register_comm_hook(options.get("process_group"), hook)
    return Distributed(wrapped, optimizer, counters)


def _powersgd_ddp(batched: bool):
    """Factory of torch's ``powerSGD_hook`` with ``batch_tensors_with_same_shape=batched``."""
    def factory(model, optimizer, *, matrix_rank, warmup_steps, ddp_options, **options):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        from ..autorank import parse_matrix_rank
        from ..settings import Settings
        # torch's hook takes one rank for every tensor: under "auto" it runs at
        # max_rank, the most bytes hvd_acp's auto rank ever sends; under an
        # adaptive optimizer's default share, the int rank that sends about
        # what hvd_acp's Power-SGD sends.
        rank, _ = parse_matrix_rank(Settings(matrix_rank=matrix_rank).resolve(
            optimizer, factors_per_step=2).matrix_rank)
        if matrix_rank is None and not isinstance(rank, int):
            from .counting import torch_hook_rank
            rank = torch_hook_rank(model, optimizer)
        if not isinstance(rank, int):
            raise ValueError(f"torch's powerSGD_hook takes one rank for every tensor, not a "
                             f"share of each matrix (matrix_rank={rank!r}): pass an int")
        wrapped = _ddp(model, ddp_options)
        settings = dict(process_group=None, matrix_approximation_rank=rank,
                        start_powerSGD_iter=2 if warmup_steps is None else warmup_steps,
                        min_compression_rate=2, use_error_feedback=True, warm_start=True,
                        batch_tensors_with_same_shape=batched, random_seed=0)
        settings.update(options)
        state = psgd.PowerSGDState(**settings)
        probe = PowerSGDHookProbe()
        wrapped.register_comm_hook(state, probe.wrap(serialized_hook(psgd.powerSGD_hook)))
        return Distributed(wrapped, optimizer, probe.counters, state)
    return factory


def _acp_ddp(model, optimizer, *, matrix_rank, warmup_steps, ddp_options, **options):
    import hvd_acp.ddp
    # One all-reduce per bucket, launched from the hook itself in bucket
    # order: no serialization needed. The optimizer gives step-ahead error
    # feedback (the default), as for hvd_acp.DistributedOptimizer.
    wrapped = _ddp(model, ddp_options)
    if warmup_steps is not None:
        options["warmup_steps"] = warmup_steps
    state = hvd_acp.ddp.ACPState(matrix_rank=matrix_rank, optimizer=optimizer, **options)
    wrapped.register_comm_hook(state, hvd_acp.ddp.acp_hook)
    return Distributed(wrapped, optimizer, lambda: Counters(
        state.comm_stats.bytes_sent, state.comm_stats.allreduces, state.compression_seconds),
        state)


def _baseline(class_name: str, embeddings: bool = False):
    """Factory of one of :mod:`hvd_acp.baselines`' optimizers around the torch
    optimizer (the inner one). They compress no gradient the way hvd_acp's
    compressors do: ``matrix_rank`` is ignored, as S-SGD ignores it (TSR's
    rank is its own ``core_rank``). With ``embeddings``, ``embedding_names``
    defaults to the model's ``nn.Embedding`` weights."""
    def factory(model, optimizer, *, matrix_rank, warmup_steps, ddp_options, **options):
        import hvd_acp
        if warmup_steps:
            raise ValueError(f"{class_name} has no exact warm-up: no warmup_steps")
        if embeddings and options.get("embedding_names") is None:
            from ..baselines import embedding_parameter_names
            options["embedding_names"] = embedding_parameter_names(model)
        wrapped = getattr(hvd_acp, class_name)(
            optimizer, named_parameters=model.named_parameters(), **options)
        stats = wrapped.comm_stats
        return Distributed(model, wrapped, lambda: Counters(
            stats.bytes_sent, stats.allreduces + stats.allgathers,
            wrapped.compression_seconds, stats.bytes_received))
    return factory


def serialized_hook(hook: Callable) -> Callable:
    """``hook`` (a DDP comm hook) run for one bucket at a time.

    ``powerSGD_hook`` starts its second and third all-reduce (P, then Q)
    from future callbacks on Gloo's threads while backward goes on and hooks
    the next bucket from the autograd thread. With Gloo and more than one
    bucket the ranks can then issue collectives in different orders: the job
    aborts ("Received data size doesn't match expected size") or hangs. Waiting
    for the previous bucket's chain before starting the next one keeps the
    order identical on every rank; a bucket's communication still overlaps
    the backward of the layers before it.
    """
    pending = []

    @functools.wraps(hook)
    def wrapper(state, bucket):
        if pending:
            pending.pop().wait()
        future = hook(state, bucket)
        pending.append(future)
        return future
    return wrapper


# --------------------------------------------------------------- registry
#: Why the planner does not simulate a method (Method.not_predicted).
_FP16_VARIANT = ("a variant: the planner predicts ACP-SGD at the optimizer's defaults, which "
                 "put fp16 on the wire under an adaptive optimizer")
_NO_DDP_SSGD_TIMELINE = "the timeline has no DDP S-SGD (DDP's buckets without a hook) yet"
_NOT_PER_STEP = ("another algorithm than averaging each step's gradient, so its step time "
                 "says nothing about its loss: the plan gives its bytes per step and the "
                 "seconds of its collectives on each link beside the table "
                 "(hvd_acp.plan.baselines)")

#: Every method, by key, in report order.
REGISTRY: Dict[str, Method] = {m.key: m for m in (
    Method("ssgd", "S-SGD", "S-SGD", "hvd.DistributedOptimizer", HOROVOD, _ssgd(False),
           "tab:gray"),
    Method("ssgd-fp16", "S-SGD", "S-SGD (fp16)",
           "hvd.DistributedOptimizer, hvd.Compression.fp16", HOROVOD, _ssgd(True),
           "silver", variant_of="ssgd"),
    Method("ddp", "S-SGD", "S-SGD (DDP)", "torch DDP all-reduce", TORCHRUN, _ddp_allreduce,
           "dimgray", not_predicted=_NO_DDP_SSGD_TIMELINE),
    Method("ddp-fp16", "S-SGD", "S-SGD (DDP fp16)", "torch DDP fp16_compress_hook", TORCHRUN,
           _ddp_fp16, "darkgray", not_predicted=_NO_DDP_SSGD_TIMELINE, variant_of="ddp"),
    Method("powersgd", "Power-SGD", "Power-SGD (hvd_acp)", "hvd_acp.PowerSGDOptimizer",
           HOROVOD, _hvd_acp_optimizer("PowerSGDOptimizer"), "tab:blue"),
    Method("powersgd-ddp", "Power-SGD", "Power-SGD (DDP hook)", "torch DDP powerSGD_hook",
           TORCHRUN, _powersgd_ddp(batched=False), "tab:cyan", min_warmup_steps=2),
    Method("powersgd-ddp-batched", "Power-SGD", "Power-SGD (DDP hook, batched)",
           "torch DDP powerSGD_hook, batch_tensors_with_same_shape", TORCHRUN,
           _powersgd_ddp(batched=True), "tab:purple", min_warmup_steps=2,
           not_predicted="the profile times each matrix's factors apart, not stacked by shape",
           variant_of="powersgd-ddp"),
    Method("acp", "ACP-SGD", "ACP-SGD", "hvd_acp.DistributedOptimizer", HOROVOD,
           _hvd_acp_optimizer("DistributedOptimizer"), "tab:red"),
    Method("acp-fp16", "ACP-SGD", "ACP-SGD (fp16)",
           "hvd_acp.DistributedOptimizer, hvd.Compression.fp16", HOROVOD,
           _hvd_acp_optimizer("DistributedOptimizer", fp16=True), "lightcoral",
           not_predicted=_FP16_VARIANT, variant_of="acp"),
    Method("acp-nooverlap", "ACP-SGD", "ACP-SGD (no overlap)",
           "hvd_acp.DistributedOptimizer, overlap=False", HOROVOD,
           _hvd_acp_optimizer("DistributedOptimizer", overlap=False), "tab:pink",
           not_predicted="an ablation: the timeline simulates ACP-SGD's hooks during backward",
           variant_of="acp"),
    Method("acp-nofusion", "ACP-SGD", "ACP-SGD (no fusion)",
           "hvd_acp.DistributedOptimizer, fusion_threshold_bytes=0", HOROVOD,
           _hvd_acp_optimizer("DistributedOptimizer", fusion_threshold_bytes=0), "tab:brown",
           not_predicted="an ablation: the timeline simulates ACP-SGD's fused buffers",
           variant_of="acp"),
    Method("acp-int8", "ACP-SGD", "ACP-SGD (8-bit factors, twice the rank)",
           "hvd_acp.DistributedOptimizer, int8_factors=True, 2 x matrix_rank", HOROVOD,
           _hvd_acp_optimizer("DistributedOptimizer", rank_times=2, int8_factors=True),
           "darkred", variant_of="acp",
           not_predicted="the planner predicts the 8-bit factors as ACP-SGD, from a profile "
                         "made with --int8-factors"),
    Method("acp-ddp", "ACP-SGD", "ACP-SGD (DDP hook)", "DDP hvd_acp.ddp.acp_hook", TORCHRUN,
           _acp_ddp, "tab:orange"),
    Method("diloco", "DiLoCo", "DiLoCo", "hvd_acp.DiLoCoOptimizer", HOROVOD,
           _baseline("DiLoCoOptimizer"), "tab:green", not_predicted=_NOT_PER_STEP,
           settings=("inner_steps", "outer_lr", "outer_momentum", "nesterov")),
    Method("demo", "DeMo", "DeMo-style", "hvd_acp.DeMoOptimizer", HOROVOD,
           _baseline("DeMoOptimizer"), "tab:olive", not_predicted=_NOT_PER_STEP,
           settings=("top_k", "chunk_size", "momentum_decay")),
    Method("tsr", "TSR", "TSR-style", "hvd_acp.TSROptimizer", HOROVOD,
           _baseline("TSROptimizer", embeddings=True), "goldenrod", not_predicted=_NOT_PER_STEP,
           settings=("core_rank", "embedding_core_rank", "refresh_period",
                     "embedding_refresh_period", "scale", "fp16_wire", "seed",
                     "embedding_names")),
)}
#: The keys, in report order.
KEYS: Tuple[str, ...] = tuple(REGISTRY)


def get(key: str) -> Method:
    """The method named ``key``; ``ValueError`` listing the keys otherwise."""
    try:
        return REGISTRY[key]
    except KeyError:
        raise ValueError(f"method must be one of {', '.join(KEYS)}, got {key!r}") from None


def predicted() -> Tuple[str, ...]:
    """The keys the planner simulates (no :attr:`Method.not_predicted`), in report order."""
    return tuple(key for key, method in REGISTRY.items() if method.not_predicted is None)


def label(key: str) -> str:
    """The short name of method ``key`` (:attr:`Method.label`)."""
    return get(key).label
