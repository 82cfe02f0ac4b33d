"""The planner's outputs: plan.json, plan.md, plan.png, and the recommendation."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..baselines.settings import DeMoSettings, DiLoCoSettings, TSRSettings
from ..methods import REGISTRY, get, label
from .baselines import baseline_costs
from .cost import Network
from .link import stack_s_per_byte
from .conditions import describe_conditions, no_spare_core
from .timeline import METHODS, Settings, predict_methods

__all__ = ["predict_grid", "recommend", "crossovers", "write_plan", "format_plan_md"]


def _fmt_bw(mbit: float) -> str:
    if mbit >= 1000 and (mbit / 1000) == int(mbit / 1000):
        return f"{mbit / 1000:g} Gbit/s"
    return f"{mbit:g} Mbit/s"


#: A compressor is recommended only if it is predicted at least this much
#: faster than S-SGD: smaller gains are inside the planner's error
#: (docs/planner.md, validation) and do not pay for a lossy gradient.
MIN_GAIN = 0.05


def recommend(methods: Dict[str, dict], matrix_rank, np: int, bandwidth_mbit: float,
              psgd_matrix_rank=None) -> dict:
    """The fastest method, with its matrix rank and one sentence saying why;
    S-SGD unless a compressor is predicted more than :data:`MIN_GAIN` faster.
    ``psgd_matrix_rank``: Power-SGD's where it differs from ACP-SGD's (its
    own share under an adaptive optimizer)."""
    best = min(methods, key=lambda m: methods[m]["step_s"])
    b, s = methods[best], methods["ssgd"]
    where = f"at {np} ranks and {_fmt_bw(bandwidth_mbit)}"
    if best != "ssgd" and s["step_s"] < (1.0 + MIN_GAIN) * b["step_s"]:
        reason = (f"S-SGD is recommended {where}: the fastest compressor, {label(best)}, "
                  f"is predicted only {s['step_s'] / b['step_s']:.2f}x faster "
                  f"({b['step_s']:.3f} s against {s['step_s']:.3f} s per step), inside the "
                  f"planner's error; exact gradients cost nothing here.")
        return {"method": "ssgd", "matrix_rank": None, "reason": reason}
    if best == "ssgd":
        runner = min((m for m in methods if m != "ssgd"), key=lambda m: methods[m]["step_s"])
        r = methods[runner]
        reason = (f"S-SGD is predicted fastest {where} ({s['step_s']:.3f} s per step): its "
                  f"{s['exposed_comm_s']:.3f} s of exposed communication costs less than "
                  f"{label(runner)}'s {r['compression_s']:.3f} s of compression plus "
                  f"{max(r['exposed_comm_s'], 0):.3f} s exposed ({r['step_s']:.3f} s per step).")
        return {"method": best, "matrix_rank": None, "reason": reason}
    reason = (f"{label(best)} is predicted fastest {where}: {b['step_s']:.3f} s per step, "
              f"{s['step_s'] / b['step_s']:.2f}x S-SGD, sending {b['bytes_per_step'] / 1e6:.2f} MB "
              f"per rank per step instead of {s['bytes_per_step'] / 1e6:.1f} MB.")
    algorithm = get(best).algorithm
    if algorithm == "S-SGD":            # fp16 S-SGD sends every gradient whole
        rank = None
    elif algorithm == "Power-SGD" and psgd_matrix_rank is not None:
        rank = psgd_matrix_rank
    else:
        rank = matrix_rank
    return {"method": best, "matrix_rank": rank, "reason": reason}


def _entry(profile: dict, settings: Settings, latency_us: float) -> dict:
    preds = predict_methods(profile, settings)
    base = preds["ssgd"].step_s
    methods = {}
    for m, p in preds.items():
        d = p.as_dict()
        d["speedup_vs_ssgd"] = base / p.step_s if p.step_s > 0 else math.nan
        methods[m] = d
    baselines = baseline_costs(profile["params"], settings.np, settings.network)
    return {"np": settings.np, "bandwidth_mbit": settings.network.bandwidth_mbit,
            "latency_us": latency_us, "methods": methods,
            "baselines": {key: cost.as_dict() for key, cost in baselines.items()},
            "recommendation": recommend(methods, profile["matrix_rank"], settings.np,
                                        settings.network.bandwidth_mbit,
                                        profile.get("psgd_matrix_rank"))}


def _settings(profile: dict, np: int, bw: float, latency_us: float, opts: dict) -> Settings:
    host, link = opts.get("host_s_per_byte"), opts.get("link")
    net = Network(bandwidth_mbit=bw, latency_s=latency_us * 1e-6,
                  wire_efficiency=opts.get("wire_efficiency") or Network.wire_efficiency,
                  host_s_per_byte=profile.get("host_s_per_byte", 0.0) if host is None else host,
                  stack_s_per_byte=stack_cost(profile, link, bw, opts)[0],
                  gpus_per_node=opts.get("gpus_per_node") or 1,
                  intra_bandwidth_mbit=opts.get("intra_bandwidth_mbit"),
                  intra_latency_s=(opts.get("intra_latency_us") or 0.0) * 1e-6,
                  burst_bytes=opts.get("burst_bytes") or 0.0)
    scale = opts.get("compute_scale") or 1.0
    # The profile's ranks ran with Horovod's thread; the DDP hook's run without it.
    ddp_scale = scale * ((profile.get("conditions") or {}).get("ddp_compute_scale") or 1.0)
    return Settings(np=np, network=net, cycle_time_s=opts.get("cycle_time_ms", 1.0) / 1e3,
                    compute_scale=scale, ddp_compute_scale=ddp_scale,
                    host_serial=host_serial(profile, opts),
                    horovod_negotiation_s=(opts.get("negotiation_us") or 0.0) * 1e-6)


def stack_cost(profile: dict, link: Optional[dict], bw: float, opts: dict):
    """(seconds per byte, where from) of the network stack's CPU work: the
    link calibration where one is given, else the host's TCP stack over
    loopback that a CPU profile measured (``--no-tcp-stack``: none)."""
    if link:
        return stack_s_per_byte(link, bw), f"`{opts.get('link_source')}`"
    tcp = profile.get("tcp_stack_s_per_byte")
    if tcp and not opts.get("no_tcp_stack"):
        return float(tcp), "this host's TCP over loopback, measured by the profile"
    return 0.0, None


def host_serial(profile: dict, opts: dict) -> bool:
    """``--host-serial`` as given, else whether the profile's ranks used every
    core of a CPU node (:func:`.conditions.no_spare_core`)."""
    given = opts.get("host_serial")
    return no_spare_core(profile) if given is None else bool(given)


def predict_grid(profile: dict, nps: Sequence[int], bandwidths_mbit: Sequence[float],
                 latencies_us: Sequence[float], opts: Optional[dict] = None) -> List[dict]:
    """One prediction entry per (np, bandwidth, latency)."""
    opts = opts or {}
    return [_entry(profile, _settings(profile, np, bw, lat, opts), lat)
            for np in nps for bw in bandwidths_mbit for lat in latencies_us]


def crossovers(profile: dict, nps: Sequence[int], latency_us: float, opts: Optional[dict] = None,
               low_mbit: float = 10.0, high_mbit: float = 1e6, points: int = 97) -> List[dict]:
    """Bandwidths where a compressor's step equals S-SGD's (log-interpolated on a grid)."""
    opts = opts or {}
    grid = [low_mbit * (high_mbit / low_mbit) ** (i / (points - 1)) for i in range(points)]
    found = []
    for np in nps:
        if np == 1:
            continue
        steps = [{m: p.step_s for m, p in predict_methods(
            profile, _settings(profile, np, bw, latency_us, opts)).items()} for bw in grid]
        for method in METHODS:
            if method == "ssgd":
                continue
            diff = [s[method] - s["ssgd"] for s in steps]
            for i in range(points - 1):
                if (diff[i] < 0) != (diff[i + 1] < 0):
                    a, b = math.log(grid[i]), math.log(grid[i + 1])
                    x = a + (b - a) * diff[i] / (diff[i] - diff[i + 1])
                    found.append({"np": np, "method": method, "vs": "ssgd",
                                  "bandwidth_mbit": math.exp(x),
                                  "faster_below": diff[i] < 0})
    return found


def _settings_md(cfg: dict) -> str:
    """What the profile's optimizer gives each compressor (its defaults)."""
    both = cfg.get("scheme") == "both"
    text = (f"{cfg.get('optimizer', 'SGD')}: ACP-SGD matrix rank {cfg.get('matrix_rank')}, "
            + ("both factors every step" if both else "P and Q in turn")
            + (", the factors in 8-bit lanes" if cfg.get("int8_factors") else "")
            + (", fp16 on the wire" if cfg.get("fp16_wire") else "")
            + (f" (budget {cfg['budget']:g} of S-SGD's bytes)"
               if cfg.get("budget") is not None else ""))
    psgd = cfg.get("psgd_matrix_rank", cfg.get("matrix_rank"))
    if psgd != cfg.get("matrix_rank"):
        text += f"; Power-SGD matrix rank {psgd}"
    return text


def _methods_of(plan: dict) -> List[str]:
    """The predicted methods of ``plan``, in report order (a plan written
    before a method was predicted lacks it)."""
    first = plan["predictions"][0]["methods"] if plan["predictions"] else {}
    return [m for m in METHODS if m in first]


def format_plan_md(plan: dict) -> str:
    cfg = plan["config"]
    methods = _methods_of(plan)
    lines = [f"# hvd-acp-plan: {cfg.get('model') or cfg.get('description', '')}", "",
             f"Profile: `{cfg.get('profile_source', '')}` ({cfg.get('description', '')}; device "
             f"{cfg.get('device')}, batch {cfg.get('batch_size')} per rank; "
             f"{_settings_md(cfg)}; {cfg.get('assumed', '')}); compute scale "
             f"{cfg['compute_scale']:g}"
             + ("; host work serial with compute" if cfg.get("host_serial") else "")
             + f"; Horovod cycle "
             f"{cfg['cycle_time_ms']:g} ms; host cost {cfg['host_s_per_byte'] * 1e9:.2f} ns/byte"
             + (f" (Horovod's float16 collectives {cfg['fp16_reduce_s_per_byte'] * 1e9:.2f} "
                "ns/byte more, measured by the profile)"
                if cfg.get("fp16_reduce_s_per_byte") is not None else "")
             + (f"; network stack {cfg['stack_s_per_byte'] * 1e9:.2f} ns/byte at "
                f"{_fmt_bw(cfg['bandwidth_mbit'][0])} ({cfg['stack_source']})"
                if cfg.get("stack_source") else "") + "; "
             f"wire efficiency {cfg['wire_efficiency']:.3f}"
             + (f"; a token bucket of {cfg['burst_bytes']:.0f} B on each link"
                if cfg.get("burst_bytes") else "")
             + (f"; {cfg['gpus_per_node']} GPUs per node at "
                f"{_fmt_bw(cfg['intra_bandwidth_mbit'])}" if cfg.get("gpus_per_node", 1) > 1
                else "") + ".", "",
             "Step times in seconds, predicted; speedup = S-SGD's step / the method's.", "",
             "| ranks | link | latency (us) | " + " | ".join(label(m) for m in methods)
             + " | recommended |",
             "|---:|---|---:|" + "---:|" * len(methods) + "---|"]
    for e in plan["predictions"]:
        cells = [f"{e['methods'][m]['step_s']:.3f} ({e['methods'][m]['speedup_vs_ssgd']:.2f}x)"
                 for m in methods]
        rec = e["recommendation"]
        lines.append(f"| {e['np']} | {_fmt_bw(e['bandwidth_mbit'])} | {e['latency_us']:g} | "
                     + " | ".join(cells) + f" | {label(rec['method'])}"
                     + (f", rank {rec['matrix_rank']}" if rec["matrix_rank"] else "") + " |")
    lines += ["", "Where the time goes (seconds per step: compute / compression / exposed "
              "communication; MB per rank per step):", "",
              "| ranks | link | " + " | ".join(label(m) for m in methods) + " |",
              "|---:|---|" + "---|" * len(methods)]
    for e in plan["predictions"]:
        cells = [f"{p['compute_s']:.3f} / {p['compression_s']:.3f} / {p['exposed_comm_s']:.3f}; "
                 f"{p['bytes_per_step'] / 1e6:.2f} MB"
                 for p in (e["methods"][m] for m in methods)]
        lines.append(f"| {e['np']} | {_fmt_bw(e['bandwidth_mbit'])} | " + " | ".join(cells) + " |")
    lines += _baselines_md(plan)
    if plan.get("crossovers"):
        lines += ["", "Crossover bandwidths (a compressor's step equals S-SGD's; below it the "
                  "compressor is faster):", "", "| ranks | method | bandwidth |", "|---:|---|---:|"]
        for c in plan["crossovers"]:
            lines.append(f"| {c['np']} | {label(c['method'])} | {_fmt_bw(round(c['bandwidth_mbit'], 0))} |")
    lines += ["", "Recommendations:", ""]
    for e in plan["predictions"]:
        lines.append(f"- {e['recommendation']['reason']}")
    skipped = [m for m in REGISTRY.values() if m.not_predicted]
    if skipped:
        lines += ["", "Not predicted (measure them with `python -m benchmarks` or "
                  "`hvd-acp-ab`):", ""]
        lines += [f"- {m.label}: {m.not_predicted}." for m in skipped]
    if cfg.get("command"):
        lines += ["", f"Command: `{cfg['command']}`"]
    return "\n".join(lines) + "\n"


def _baselines_md(plan: dict) -> List[str]:
    """The table of what DiLoCo, the DeMo-style and the TSR-style method send
    (:mod:`.baselines`)."""
    entries = [e for e in plan["predictions"] if "baselines" in e]
    if not entries:
        return []
    diloco, demo = DiLoCoSettings().resolve(), DeMoSettings().resolve()
    tsr = TSRSettings().resolve()
    keys = ("diloco", "demo", "tsr")
    lines = ["", f"{label('diloco')} (H = {diloco.inner_steps}), {label('demo')} (k = "
             f"{demo.top_k} of {demo.chunk_size}) and {label('tsr')} (r = {tsr.core_rank}, "
             f"K = {tsr.refresh_period}), other algorithms than averaging each step's "
             "gradient, are not in the tables above; per rank and step, MB sent / received "
             "and the seconds of their collectives on the link, not overlapped with compute:",
             "", "| ranks | link | " + " | ".join(label(k) for k in keys) + " |",
             "|---:|---|" + "---|" * len(keys)]
    for e in entries:
        cells = [f"{c['bytes_sent'] / 1e6:.3g} / {c['bytes_received'] / 1e6:.3g} MB; "
                 f"{c['comm_s']:.3g} s" if c else "n/a (the profile lacks the shapes)"
                 for c in (e["baselines"].get(k) for k in keys)]
        lines.append(f"| {e['np']} | {_fmt_bw(e['bandwidth_mbit'])} | " + " | ".join(cells) + " |")
    return lines


def _plot(plan: dict, profile: dict, opts: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cfg = plan["config"]
    nps, bws, lat = cfg["np"], cfg["bandwidth_mbit"], cfg["latency_us"][0]
    colors = {m: get(m).color for m in METHODS}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    np_big = max(nps)
    lo, hi = min(bws) / 10, max(bws) * 10
    grid = [lo * (hi / lo) ** (i / 48) for i in range(49)]
    curves = {m: [] for m in METHODS}
    for bw in grid:
        preds = predict_methods(profile, _settings(profile, np_big, bw, lat, opts))
        for m in METHODS:
            curves[m].append(preds[m].step_s)
    for m in METHODS:
        left.plot([g / 1000 for g in grid], curves[m], label=label(m), color=colors[m])
    for c in plan.get("crossovers", []):
        if c["np"] == np_big and lo <= c["bandwidth_mbit"] <= hi:
            left.axvline(c["bandwidth_mbit"] / 1000, color=colors[c["method"]], ls=":")
            left.annotate(f"{c['bandwidth_mbit'] / 1000:.2g}", (c["bandwidth_mbit"] / 1000,
                          max(curves["ssgd"]) * 0.9), color=colors[c["method"]], fontsize=8)
    left.set(xscale="log", yscale="log", xlabel="link bandwidth (Gbit/s)",
             ylabel="step time (s)", title=f"{np_big} ranks (dotted: crossovers vs S-SGD)")
    left.legend(fontsize=8)
    styles = ["-", "--", ":", "-."]
    for k, bw in enumerate(bws):
        for m in METHODS:
            ys = [e["methods"][m]["step_s"] for e in plan["predictions"]
                  if e["bandwidth_mbit"] == bw and e["latency_us"] == lat]
            right.plot(nps, ys, color=colors[m], ls=styles[k % 4], marker="o", ms=3,
                       label=f"{label(m)}, {_fmt_bw(bw)}")
    right.set(xscale="log", yscale="log", xlabel="ranks", ylabel="step time (s)",
              title="step time against the number of ranks")
    right.legend(fontsize=6, ncol=2)
    fig.suptitle(f"hvd-acp-plan: {cfg.get('model') or cfg.get('description', '')}, "
                 f"batch {cfg.get('batch_size')}, matrix rank {cfg.get('matrix_rank')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plan(profile: dict, out: Path, nps: Sequence[int], bandwidths_mbit: Sequence[float],
               latencies_us: Sequence[float], opts: dict, command: str = "",
               profile_source: str = "", plot: bool = True) -> dict:
    """Predict the grid and write ``out/plan.json``, ``plan.md`` and ``plan.png``."""
    out.mkdir(parents=True, exist_ok=True)
    first = _settings(profile, nps[0], bandwidths_mbit[0], latencies_us[0], opts)
    plan = {"config": {
        "model": profile.get("model"), "description": profile.get("description"),
        "batch_size": profile.get("batch_size"), "matrix_rank": profile["matrix_rank"],
        "optimizer": profile.get("optimizer", "SGD"),
        "optimizer_family": profile.get("optimizer_family", "sgd"),
        "scheme": profile.get("scheme", "alternating"),
        "fp16_wire": bool(profile.get("fp16_wire", False)),
        "int8_factors": bool(profile.get("int8_factors", False)),
        "budget": profile.get("budget"),
        "psgd_matrix_rank": profile.get("psgd_matrix_rank", profile["matrix_rank"]),
        "device": profile.get("device"), "device_name": profile.get("device_name"),
        "profile_source": profile_source, "np": list(nps), "bandwidth_mbit": list(bandwidths_mbit),
        "latency_us": list(latencies_us), "cycle_time_ms": first.cycle_time_s * 1e3,
        "horovod_negotiation_us": first.horovod_negotiation_s * 1e6,
        "compute_scale": first.compute_scale, "wire_efficiency": first.network.wire_efficiency,
        "burst_bytes": first.network.burst_bytes,
        "host_s_per_byte": first.network.host_s_per_byte,
        "fp16_reduce_s_per_byte": profile.get("fp16_reduce_s_per_byte"),
        "link_calibration": opts.get("link_source"),
        "stack_s_per_byte": first.network.stack_s_per_byte,
        "stack_source": stack_cost(profile, opts.get("link"), bandwidths_mbit[0], opts)[1],
        "gpus_per_node": first.network.gpus_per_node,
        "intra_bandwidth_mbit": first.network.intra_bandwidth_mbit, "command": command,
        "host_serial": first.host_serial, "ddp_compute_scale": first.ddp_compute_scale,
        "assumed": describe_conditions(profile),
        "profile": {k: profile.get(k) for k in ("forward_s", "backward_s", "optimizer_s",
                                                 "gradient_bytes", "torch_threads",
                                                 "conditions")}},
        "predictions": predict_grid(profile, nps, bandwidths_mbit, latencies_us, opts),
        "crossovers": crossovers(profile, nps, latencies_us[0], opts)}
    (out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    (out / "plan.md").write_text(format_plan_md(plan))
    if plot:
        _plot(plan, profile, opts, out / "plan.png")
    return plan
