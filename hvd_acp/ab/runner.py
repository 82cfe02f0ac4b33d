"""Time several methods in rotating rounds on the same processes and devices.

Every round trains each method once, in an order that rotates from round to
round (:func:`.rounds.round_order`): a fresh copy of the same initial
weights, a torch SGD optimizer wrapped by the method
(:meth:`hvd_acp.methods.Method.build`), ``warmup`` untimed steps, then
``steps`` timed ones. A step counts as done when the slowest rank is done
(:func:`.rounds.combine_ranks`); a method's figure for a round is its median
step. Methods of one round run back to back on the same ranks, so the
ratios between them (computed per round, :mod:`.report`) cancel what drifts
slowly: the cluster's other jobs, the clocks of the devices.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from ..methods import TORCHRUN, get, settings_of
from ..plan.models import ModelSpec, build_optimizer, to_device
from .rounds import combine_ranks, percentile, round_order
from .world import World

__all__ = ["ACP_KEYS", "Settings", "measure"]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one A/B run measures.

    Attributes:
        methods: keys of :mod:`hvd_acp.methods`, all for the launch's launcher.
        rounds: how many rounds (each method once per round).
        steps: timed steps per method and round.
        warmup: untimed steps before them (an implementation that must start
            with more exact steps, torch's ``powerSGD_hook``, gets its
            minimum instead).
        matrix_rank: rank of the compressed methods' factors (None: each
            front end's default for the optimizer, :class:`hvd_acp.Settings`).
        lr: learning rate of the optimizer under every method.
        optimizer: ``sgd`` (momentum 0.9) or ``adamw``
            (:data:`hvd_acp.plan.models.OPTIMIZERS`); its family decides the
            compressed methods' defaults.
        acp_options: settings of :class:`hvd_acp.Settings` given to ACP-SGD's
            own methods (:data:`ACP_KEYS`) and no other: ``budget`` (then
            they take no ``matrix_rank``: the budget picks it) or
            ``int8_factors``.
    """

    methods: Sequence[str]
    rounds: int = 6
    steps: int = 5
    warmup: int = 3
    matrix_rank: Union[int, str, None] = None
    lr: float = 0.01
    optimizer: str = "sgd"
    acp_options: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        unknown = sorted(set(self.acp_options) - {"budget", "int8_factors"})
        if unknown:
            raise ValueError(f"acp_options takes budget and int8_factors, got {unknown}")


#: ACP-SGD's own methods, which :attr:`Settings.acp_options` apply to (its
#: variants and ablations fix their own settings).
ACP_KEYS = ("acp", "acp-ddp")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ddp_options(world: World) -> Dict[str, Any]:
    # The ranks start from the same weights (broadcast once), so DDP's initial
    # broadcast is skipped; buffers are not broadcast at every forward either,
    # as with Horovod's methods (and the repository's benchmark).
    options: Dict[str, Any] = {"init_sync": False, "broadcast_buffers": False}
    if world.device.type == "cuda":
        options["device_ids"] = [world.device.index]
    return options


def _one(world: World, key: str, template: torch.nn.Module, spec: ModelSpec,
         settings: Settings) -> Dict[str, Any]:
    """Train ``key`` once from a copy of ``template``: this rank's step times and counters."""
    method = get(key)
    model = copy.deepcopy(template)
    optimizer = build_optimizer(settings.optimizer, model.parameters(), settings.lr)
    options: Dict[str, Any] = {}
    if method.launcher == TORCHRUN:
        options["ddp_options"] = _ddp_options(world)
    warmup = settings.warmup
    if method.min_warmup_steps:
        warmup = max(warmup, method.min_warmup_steps)
        options["warmup_steps"] = warmup
    matrix_rank = settings.matrix_rank
    if key in ACP_KEYS and settings.acp_options:
        options.update(settings.acp_options)
        if settings.acp_options.get("budget") is not None:
            matrix_rank = None                    # the budget picks it
    built = method.build(model, optimizer, matrix_rank=matrix_rank, **options)
    counters = built.counters
    chosen = settings_of(built)
    times: List[float] = []
    start = None
    loss = None
    try:
        for index in range(warmup + settings.steps):
            if index == warmup:
                _sync(world.device)
                start = counters() if counters is not None else None
            began = time.perf_counter()
            built.optimizer.zero_grad()
            loss = spec.loss_fn(built.model, spec.batch)
            loss.backward()
            built.optimizer.step()
            _sync(world.device)
            if index >= warmup:
                times.append(time.perf_counter() - began)
        end = counters() if counters is not None else None
        last_loss = float(loss.detach()) if loss is not None else float("nan")
    finally:
        close = getattr(built.optimizer, "close", None)
        if callable(close):
            close()
        del built, model, optimizer
        gc.collect()
        if world.device.type == "cuda":
            torch.cuda.empty_cache()
    result: Dict[str, Any] = {"step_s": times, "loss": last_loss}
    if chosen is not None:
        result["settings"] = chosen
    if start is not None and settings.steps:
        result["bytes_per_step"] = (end.bytes_sent - start.bytes_sent) / settings.steps
        result["allreduces_per_step"] = (end.allreduces - start.allreduces) / settings.steps
        if end.bytes_received is not None:
            result["bytes_received_per_step"] = (
                (end.bytes_received - start.bytes_received) / settings.steps)
        result["compression_s_per_step"] = (
            (end.compression_seconds - start.compression_seconds) / settings.steps)
    return result


def measure(world: World, spec: ModelSpec, settings: Settings,
            progress: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Every method of ``settings`` in ``settings.rounds`` rotating rounds.

    Returns, identical on every rank, ``{key: {"rounds": [round figures],
    "step_s": [every combined step], "bytes_per_step": ..., ...}}`` where a
    round figure is the median of the round's combined steps (slowest rank
    per step).
    """
    template = spec.model.to(world.device)
    world.broadcast_parameters(template)
    spec = dataclasses.replace(spec, batch=to_device(spec.batch, world.device))
    out: Dict[str, Dict[str, Any]] = {key: {"rounds": [], "step_s": [], "loss": []}
                                      for key in settings.methods}
    for round_index in range(settings.rounds):
        for key in round_order(list(settings.methods), round_index):
            world.barrier()
            mine = _one(world, key, template, spec, settings)
            everyone = world.allgather(mine)
            steps = combine_ranks([r["step_s"] for r in everyone])
            entry = out[key]
            entry["rounds"].append(percentile(steps, 50))
            entry["step_s"].extend(steps)
            entry["loss"].append(everyone[0]["loss"])
            if "settings" in mine:
                entry["settings"] = mine["settings"]
            for field in ("bytes_per_step", "bytes_received_per_step", "allreduces_per_step",
                          "compression_s_per_step"):
                if field in mine:
                    # Bytes and all-reduces are the same on every rank; the
                    # compression time is the slowest rank's.
                    values = [r[field] for r in everyone]
                    entry.setdefault(field, []).append(
                        max(values) if field == "compression_s_per_step" else values[0])
            if progress is not None:
                progress(f"round {round_index + 1}/{settings.rounds}: {key} "
                         f"{entry['rounds'][-1]:.4f} s/step")
    return out
