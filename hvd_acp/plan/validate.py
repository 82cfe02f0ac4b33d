"""``hvd-acp-plan validate``: predict a measured benchmark run and compare.

Calibration (one documented step, the same for every run): the profile is
taken in one process, but the benchmark's ranks share this machine's cores.
The run's own floor jobs say what that costs, without any communication,
so the profile's compute and compression times (and its host cost per byte)
are scaled by one factor per front end::

    Horovod methods: c = (floor under Horovod: every rank computing, Horovod
                          initialized, nothing all-reduced) / profile's step
    DDP hook:        c = (the same under torch.distributed, or in runs made
                          before that job existed, the floor with every rank
                          computing at once) / profile's step

A run without those diagnostic jobs (no ``--diagnostics``) uses its
single-process floor for both. Where the run had no spare core (cores <=
ranks x threads per rank, as on this 2-core machine) the collectives' host
work is serial with computation (``Settings.host_serial``).

Latency (the same two diagnostic jobs): each times a tiny all-reduce on
the run's own ranks after its steps. The Gloo one (torch.distributed, no
cycle) gives the latency of one ring step, ``alpha = t / (2(N-1))``; the
Horovod one, beyond what the timeline already predicts for it (the wait
for the cycle and the ring's latency), gives Horovod's negotiation per
cycle (``Settings.horovod_negotiation_s``). Runs without the probes (no
``--diagnostics``, or results files that have no probe entries) get 0 for
both.

Network stack: with a link calibration (:mod:`.link`, ``--link-calibration``)
the emulated network's own CPU cost per byte, at the run's link rate, is
added to every all-reduce. Nothing is read from the methods' own
measurements.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from ..methods import label
from .cost import Network
from .link import stack_s_per_byte
from .timeline import METHODS, Settings, horovod_tiny_allreduce_s, predict_methods

__all__ = ["load_bench", "calibration", "latency", "validate", "format_validation"]


def load_bench(path: Path) -> dict:
    """A benchmark's results.json, checked for what validation needs."""
    data = json.loads(Path(path).read_text())
    for key in ("config", "methods", "compute_only"):
        if key not in data:
            raise ValueError(f"{path}: not a results.json of the benchmark (python -m benchmarks; no {key!r})")
    if not data["config"].get("bandwidth_mbit"):
        raise ValueError(f"{path}: the run has no emulated bandwidth (plain localhost); "
                         "its link rate is unknown, so it cannot be predicted")
    return data


def calibration(bench: dict, profile: dict) -> dict:
    """Compute scales from the run's floor jobs (see the module docstring)."""
    compute = profile["forward_s"] + profile["backward_s"] + profile["optimizer_s"]
    diags = bench.get("diagnostics") or {}
    floor = bench["compute_only"]["step_s_median"]
    hvd = (diags.get("hvd-idle") or {}).get("step_s_median")
    concurrent = ((diags.get("ddp-idle") or {}).get("step_s_median")
                  or (diags.get("compute-concurrent") or {}).get("step_s_median"))
    source = "diagnostics" if hvd and concurrent else "floor (1 process; no diagnostics in run)"
    hvd, concurrent = hvd or floor, concurrent or floor
    return {"source": source, "profile_step_s": compute, "floor_s": floor,
            "horovod_floor_s": hvd, "ddp_floor_s": concurrent,
            "compute_scale": hvd / compute, "ddp_compute_scale": concurrent / compute,
            "ddp_tiny_allreduce_s": (diags.get("ddp-idle") or {}).get("tiny_allreduce_s"),
            "horovod_tiny_allreduce_s": (diags.get("hvd-idle") or {}).get("tiny_allreduce_s")}


def latency(cal: dict, settings: Settings) -> Settings:
    """``settings`` with the ring's latency and Horovod's negotiation from the
    run's tiny all-reduce probes (see the module docstring)."""
    ranks = settings.np
    alpha = 0.0
    if cal.get("ddp_tiny_allreduce_s") and ranks > 1:
        alpha = cal["ddp_tiny_allreduce_s"] / (2 * (ranks - 1))
    net = dataclasses.replace(settings.network, latency_s=alpha)
    settings = dataclasses.replace(settings, network=net)
    if cal.get("horovod_tiny_allreduce_s"):
        negotiation = cal["horovod_tiny_allreduce_s"] - horovod_tiny_allreduce_s(settings)
        settings = dataclasses.replace(settings, horovod_negotiation_s=max(0.0, negotiation))
    return settings


def validate(bench: dict, profile: dict, calibrate: bool = True,
             wire_efficiency: Optional[float] = None, link: Optional[dict] = None) -> dict:
    """Measured, predicted and relative error per method of a benchmark run."""
    cfg = bench["config"]
    for key, want in (("model", cfg.get("model")), ("batch_size", cfg.get("batch_size")),
                      ("matrix_rank", cfg.get("matrix_rank"))):
        if profile.get(key) is not None and want is not None and profile[key] != want:
            raise ValueError(f"the profile's {key} is {profile[key]!r} but the run's is {want!r}")
    family = "adaptive" if cfg.get("optimizer", "sgd") != "sgd" else "sgd"
    if profile.get("optimizer_family", "sgd") != family:
        raise ValueError(f"the run trained with --optimizer {cfg.get('optimizer', 'sgd')} but "
                         f"the profile was taken with {profile.get('optimizer', 'SGD')}: "
                         "profile with the run's optimizer (hvd-acp-plan profile --optimizer)")
    cal = calibration(bench, profile) if calibrate else {
        "source": "none", "compute_scale": 1.0, "ddp_compute_scale": 1.0}
    rate = float(cfg["bandwidth_mbit"])
    net = Network(bandwidth_mbit=rate, latency_s=0.0,
                  wire_efficiency=wire_efficiency or Network.wire_efficiency,
                  host_s_per_byte=profile.get("host_s_per_byte", 0.0),
                  stack_s_per_byte=stack_s_per_byte(link, rate))
    cycle_ms = cfg.get("horovod_cycle_time_ms") or 1.0
    # No spare core (every core runs a rank's compute thread): the collectives'
    # host work delays computation instead of running beside it.
    cores, threads = cfg.get("cpus"), int(cfg.get("threads_per_rank") or 1)
    host_serial = bool(cores) and cores <= int(cfg["np"]) * threads
    settings = Settings(np=int(cfg["np"]), network=net, cycle_time_s=cycle_ms / 1e3,
                        compute_scale=cal["compute_scale"],
                        ddp_compute_scale=cal["ddp_compute_scale"], host_serial=host_serial)
    if calibrate:
        settings = latency(cal, settings)
    methods = [m for m in METHODS if m in bench["methods"]
               and bench["methods"][m].get("step_s_median")]
    preds = predict_methods(profile, settings, methods)
    rows = {}
    for m in methods:
        measured = bench["methods"][m]["step_s_median"]
        p = preds[m]
        rows[m] = {"measured_step_s": measured, "predicted_step_s": p.step_s,
                   "error": (p.step_s - measured) / measured,
                   "measured_compression_s": bench["methods"][m].get("compression_s_per_step"),
                   "predicted": p.as_dict()}
    worst = max(rows, key=lambda m: abs(rows[m]["error"])) if rows else None
    return {"run": cfg.get("command"), "model": cfg.get("model"), "np": cfg.get("np"),
            "batch_size": cfg.get("batch_size"), "matrix_rank": cfg.get("matrix_rank"),
            "bandwidth_mbit": cfg.get("bandwidth_mbit"), "cycle_time_ms": cycle_ms,
            "calibration": cal, "host_serial": host_serial,
            "stack_s_per_byte": net.stack_s_per_byte,
            "latency_s": settings.network.latency_s,
            "horovod_negotiation_s": settings.horovod_negotiation_s, "methods": rows,
            "worst_method": worst,
            "worst_abs_error": abs(rows[worst]["error"]) if worst else None}


def format_validation(result: dict, name: str = "") -> str:
    cal = result["calibration"]
    head = (f"{name or result['model']}: {result['np']} ranks, batch {result['batch_size']}, "
            f"matrix rank {result['matrix_rank']}, {result['bandwidth_mbit']:g} Mbit/s, "
            f"Horovod cycle {result['cycle_time_ms']:g} ms; calibration: {cal['source']}, "
            f"compute scale {cal['compute_scale']:.3f} (Horovod), "
            f"{cal['ddp_compute_scale']:.3f} (DDP)"
            + (f"; network stack {result['stack_s_per_byte'] * 1e9:.2f} ns/byte"
               if result.get("stack_s_per_byte") else "")
            + (f"; ring step latency {result['latency_s'] * 1e3:.2f} ms, Horovod negotiation "
               f"{result['horovod_negotiation_s'] * 1e3:.2f} ms (tiny all-reduce probes)"
               if result.get("latency_s") or result.get("horovod_negotiation_s") else ""))
    lines = [head, "",
             "| method | measured step (s) | predicted step (s) | error | measured compression "
             "(s) | predicted compression (s) |", "|---|---:|---:|---:|---:|---:|"]
    for m, row in result["methods"].items():
        mc = row["measured_compression_s"]
        lines.append(f"| {label(m)} | {row['measured_step_s']:.3f} | "
                     f"{row['predicted_step_s']:.3f} | {row['error'] * 100:+.1f}% | "
                     f"{'' if mc is None else f'{mc:.3f}'} | "
                     f"{row['predicted']['compression_s']:.3f} |")
    if result["worst_method"]:
        lines += ["", f"worst: {label(result['worst_method'])}, "
                      f"{result['worst_abs_error'] * 100:.1f}%"]
    return "\n".join(lines) + "\n"
