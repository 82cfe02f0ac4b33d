"""results.json -> results.md (a table) and breakdown.png (stacked bars)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from .stats import METHODS

__all__ = ["LABELS", "derive", "breakdown", "markdown", "plot_breakdown"]

#: How each method is named in tables and plots.
LABELS = {
    "ssgd": "S-SGD (hvd.DistributedOptimizer)",
    "powersgd": "Power-SGD (hvd_acp.PowerSGDOptimizer)",
    "powersgd-ddp": "Power-SGD (torch DDP powerSGD_hook)",
    "acp": "ACP-SGD (hvd_acp.DistributedOptimizer)",
}
_SHORT = {"ssgd": "S-SGD", "powersgd": "Power-SGD\n(hvd_acp)",
          "powersgd-ddp": "Power-SGD\n(DDP hook)", "acp": "ACP-SGD"}


def _ordered(methods: Dict[str, Any]) -> List[str]:
    return [m for m in METHODS if m in methods] + [m for m in methods if m not in METHODS]


def derive(results: Dict[str, Any]) -> None:
    """Add ``speedup_vs_ssgd`` and ``ratio_to_floor`` to every measured method, in place."""
    floor = (results.get("compute_only") or {}).get("step_s_median")
    ssgd = (results["methods"].get("ssgd") or {}).get("step_s_median")
    for entry in results["methods"].values():
        step = entry.get("step_s_median")
        if step is None:
            continue
        entry["speedup_vs_ssgd"] = ssgd / step if ssgd else None
        entry["ratio_to_floor"] = step / floor if floor else None


def breakdown(entry: Dict[str, Any], floor: float) -> Dict[str, float]:
    """Split a method's median step into compute, compression and exposed communication.

    compute is the floor (the same step with no communication); exposed
    communication is what remains of the step, floored at zero.
    """
    compression = entry.get("compression_s_per_step") or 0.0
    exposed = max(0.0, entry["step_s_median"] - floor - compression)
    return {"compute": floor, "compression": compression, "exposed_comm": exposed}


def _fmt(value: Optional[float], digits: int = 3, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}{suffix}"


def markdown(results: Dict[str, Any]) -> str:
    """The results table with speedup over S-SGD and ratio to the floor."""
    cfg = results["config"]
    floor_entry = results.get("compute_only") or {}
    floor = floor_entry.get("step_s_median")
    link = (f"{cfg['bandwidth_mbit']:g} Mbit/s" if cfg.get("bandwidth_mbit") is not None
            else "no emulation (localhost)")
    lines = [
        f"# {cfg['model']}: {cfg['np']} ranks, batch {cfg['batch_size']} per rank, "
        f"matrix_rank {cfg['matrix_rank']}, link {link}",
        "",
        "| method | step median (s) | p10 (s) | p90 (s) | samples/s | speedup vs S-SGD "
        "| x floor | MB sent/step/rank | all-reduces/step | compression s/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method in _ordered(results["methods"]):
        entry = results["methods"][method]
        label = LABELS.get(method, method)
        if entry.get("error"):
            lines.append(f"| {label} | failed: {entry['error']} |||||||||")
            continue
        mb = entry["bytes_sent_per_step"] / 1e6
        lines.append(
            f"| {label} | {_fmt(entry['step_s_median'])} | {_fmt(entry['step_s_p10'])} "
            f"| {_fmt(entry['step_s_p90'])} | {_fmt(entry['samples_per_s'], 1)} "
            f"| {_fmt(entry.get('speedup_vs_ssgd'), 2, 'x')} "
            f"| {_fmt(entry.get('ratio_to_floor'), 2, 'x')} | {mb:.3f} "
            f"| {entry['allreduces_per_step']:g} "
            f"| {_fmt(entry.get('compression_s_per_step'), 4)} |")
    if floor is not None:
        lines.append(
            f"| compute only (floor, 1 process, no communication) | {_fmt(floor)} "
            f"| {_fmt(floor_entry.get('step_s_p10'))} | {_fmt(floor_entry.get('step_s_p90'))} "
            f"| {_fmt(floor_entry.get('samples_per_s'), 1)} | | 1.00x | 0 | 0 | 0 |")
    lines.append("")
    lines += _phase_table(results)
    lines += _diagnostics_table(results)
    ratio = cfg.get("compute_vs_communication") or {}
    if ratio.get("ssgd_comm_s_at_line_rate") is not None and floor is not None:
        lines.append(
            f"Compute vs communication: the floor is {floor:.3f} s per step; S-SGD's "
            f"{ratio['gradient_mb']:.1f} MB of gradients take "
            f"{ratio['ssgd_comm_s_at_line_rate']:.3f} s per step at line rate (ring "
            f"all-reduce, each rank sends 2(N-1)/N of them), "
            f"{ratio['ssgd_comm_s_at_line_rate'] / floor:.2f}x the floor.")
        lines.append("")
    lines += [
        f"Topology: {cfg['topology']}.",
        "",
        f"Steps: {cfg['warmup']} warm-up + {cfg['steps']} timed per method; a step's time "
        f"is the slowest rank's; {cfg.get('threads_per_rank', 1)} thread(s) per rank on "
        f"{cfg.get('cpus')} CPUs; Horovod cycle time "
        + (f"{cfg['horovod_cycle_time_ms']:g} ms" if cfg.get("horovod_cycle_time_ms")
           is not None else "Horovod's default (1 ms)")
        + ". Versions: "
        + ", ".join(f"{k} {v}" for k, v in cfg["versions"].items()) + ".",
        "",
        f"Command: `{cfg.get('command', '')}`",
        "",
    ]
    notes = results.get("notes") or []
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def _phase_table(results: Dict[str, Any]) -> List[str]:
    """Where the time goes: medians of rank 0's phases, traffic, interference."""
    rows = [("compute only", results.get("compute_only") or {})]
    rows += [(LABELS.get(m, m), results["methods"][m]) for m in _ordered(results["methods"])]
    rows = [(label, e) for label, e in rows if e.get("phase_s_median")]
    if not rows:
        return []
    lines = ["| where the time goes (rank 0, medians) | forward (s) | backward (s) "
             "| optimizer step (s) | link MB/step/rank | CPU share used outside the job |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, entry in rows:
        phases = entry["phase_s_median"]
        link = entry.get("link_tx_bytes_per_step")
        share = entry.get("cpu_share_outside_job")
        flag = " (disturbed?)" if share is not None and share > 0.10 else ""
        lines.append(f"| {label} | {_fmt(phases.get('forward'))} | {_fmt(phases.get('backward'))} "
                     f"| {_fmt(phases.get('optimizer_step'))} "
                     f"| {'n/a' if link is None else f'{link / 1e6:.3f}'} "
                     f"| {_fmt(share, 2)}{flag} |")
    lines.append("")
    return lines


_DIAGNOSTIC_LABELS = {
    "compute-concurrent": "floor with every rank computing at once (N processes, no "
                          "communication)",
    "hvd-idle": "same under Horovod: hvd.init(), plain local optimizer, nothing "
                "all-reduced",
    "acp-local": "ACP-SGD on a world of one (LocalCommunicator) in N processes at once: "
                 "compression, no communication",
}


def _diagnostics_table(results: Dict[str, Any]) -> List[str]:
    """Steps of the diagnostic runs, against the floor."""
    diagnostics = results.get("diagnostics")
    floor = (results.get("compute_only") or {}).get("step_s_median")
    if not diagnostics or not floor:
        return []
    lines = ["| diagnostic | step median (s) | x floor | compression s/step "
             "| CPU share used outside the job |", "|---|---:|---:|---:|---:|"]
    for name, entry in diagnostics.items():
        if entry.get("step_s_median") is None:
            lines.append(f"| {_DIAGNOSTIC_LABELS.get(name, name)} | failed |||")
            continue
        lines.append(f"| {_DIAGNOSTIC_LABELS.get(name, name)} | {_fmt(entry['step_s_median'])} "
                     f"| {entry['step_s_median'] / floor:.2f}x "
                     f"| {_fmt(entry.get('compression_s_per_step'), 4)} "
                     f"| {_fmt(entry.get('cpu_share_outside_job'), 2)} |")
    lines.append("")
    return lines


def _bars(ax, names, parts, steps) -> None:
    xs = list(range(len(names)))
    bottoms = [0.0] * len(names)
    for key, label, color in (("compute", "compute (floor)", "#4c72b0"),
                              ("compression", "compression", "#dd8452"),
                              ("exposed_comm", "exposed communication (step - floor - compression)", "#c44e52")):
        values = [p[key] for p in parts]
        ax.bar(xs, values, bottom=bottoms, label=label, color=color, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.scatter(xs, steps, marker="_", s=900, color="black", zorder=3, label="measured step")
    for x, step in zip(xs, steps):
        ax.annotate(f"{step:.3g} s", (x, max(step, bottoms[x])), textcoords="offset points",
                    xytext=(0, 4), ha="center", fontsize=8)
    ax.set_xticks(xs)
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylim(0, max(max(steps), max(bottoms)) * 1.15)


def plot_breakdown(results: Dict[str, Any], path: Path) -> None:
    """Stacked bars per method: compute (floor), compression, exposed communication.

    When a method is far slower than the others (S-SGD on a slow link), a
    second panel zooms on the rest so their compression is visible.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = results["config"]
    floor = (results.get("compute_only") or {}).get("step_s_median")
    methods = [m for m in _ordered(results["methods"])
               if results["methods"][m].get("step_s_median") is not None]
    rows = []
    if floor is not None:
        rows.append(("compute only\n(floor)",
                     {"compute": floor, "compression": 0.0, "exposed_comm": 0.0}, floor))
    for method in methods:
        entry = results["methods"][method]
        rows.append((_SHORT.get(method, method), breakdown(entry, floor or 0.0),
                     entry["step_s_median"]))
    zoom = [r for r in rows if floor is None or r[2] <= 3 * floor]
    panels = [rows] + ([zoom] if 1 < len(zoom) < len(rows) else [])
    fig, axes = plt.subplots(1, len(panels), squeeze=False,
                             figsize=(1.7 * sum(len(p) for p in panels) + 2.5, 4.6),
                             gridspec_kw={"width_ratios": [len(p) for p in panels]})
    for ax, panel in zip(axes[0], panels):
        _bars(ax, [r[0] for r in panel], [r[1] for r in panel], [r[2] for r in panel])
    axes[0][0].set_ylabel("seconds per step (median)")
    if len(panels) > 1:
        axes[0][1].set_title("zoom: methods within 3x the floor", fontsize=8)
    link = (f"{cfg['bandwidth_mbit']:g} Mbit/s per node" if cfg.get("bandwidth_mbit")
            is not None else "localhost, no emulation")
    fig.suptitle(f"{cfg['model']}, {cfg['np']} ranks, batch {cfg['batch_size']}/rank, "
                 f"rank {cfg['matrix_rank']}, {link}", fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
