"""hvd-acp-plan's projections for the ACP-SGD paper's own settings, beside its measured speed-ups.

    .venv/bin/python scripts/paper_projection.py [--doc docs/planner.md] [--out DIR]

Zhang et al., "Evaluation and Optimization of Gradient Compression for
Distributed Deep Learning", ICDCS 2023 (arXiv 2306.08881), trained on a
32-GPU cluster, from 8 to 64 GPUs, over 1 Gb/s Ethernet to 100 Gb/s
InfiniBand, and measured ACP-SGD 4.06x faster than S-SGD and 1.43x faster
than Power-SGD on average (its abstract). This predicts each of its models
(:data:`MODELS`) on each of its networks (:data:`NETWORKS`) at 8 to 64
ranks from the profiles committed in ``bench-results/profiles/`` (CPU
profiles, their plans redone as the code plans today), their compute scaled
to an assumed GPU (``--gpu-tflops``, ``--utilisation``: the step's FLOP
over what the GPU sustains), and prints one table: every setting's steps
and ACP-SGD's speed-ups, then their means beside the paper's. With
``--doc`` it also writes the table between ``<!-- paper -->`` and
``<!-- end paper -->`` of that page; with ``--out`` the figures as
``paper_projection.json``.

The transformer rows under AdamW (:data:`ADAMW_MODELS`, ``--doc`` writes
them between ``<!-- paper-adamw -->`` and ``<!-- end paper-adamw -->``):
BERT-Base and GPT-2 small profiled with AdamW, so each method at the
library's defaults for an adaptive optimizer (ACP-SGD both factors every
step at 0.3 of each matrix, Power-SGD 0.25, both with fp16 on the wire)
beside S-SGD in fp32 and fp16, on the same networks and ranks; per setting
the method predicted fastest, and whether that holds with a GPU half and
four times as fast as the one assumed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List

from bench_doc import replace_marked  # scripts/, beside this file
from hvd_acp.plan.profile_format import check_profile, read_json
from hvd_acp.plan.replan import current_plans
from hvd_acp.plan.report import predict_grid

REPO = Path(__file__).resolve().parent.parent
MARKERS = ("<!-- paper -->", "<!-- end paper -->")
ADAMW_MARKERS = ("<!-- paper-adamw -->", "<!-- end paper-adamw -->")

#: The paper's measured averages (its abstract): ACP-SGD's speed-up.
PAPER = {"ssgd": 4.06, "powersgd": 1.43}

#: The models: profile, what the paper trains, and the FLOP of one training
#: step (forward and backward, backward twice the forward) with its source.
MODELS = [
    {"name": "ResNet-50", "profile": "bench-results/profiles/resnet50_b64_224.json",
     "setting": "batch 64, 224x224, rank 4",
     "flop": 3 * 2 * 3.8e9 * 64,
     "flop_source": "3 x 2 x 3.8 G multiply-adds per image forward (He et al. 2016, Table 1) "
                    "x 64"},
    {"name": "BERT-Base", "profile": "bench-results/profiles/bert_b32.json",
     "setting": "batch 32, sequence 64, rank 32",
     "flop": 6 * 110e6 * 32 * 64,
     "flop_source": "6 x 110 M parameters (Devlin et al. 2019) x 2048 tokens"},
]

#: The transformers under AdamW: profiles taken with ``--optimizer adamw``
#: (``hvd-acp-plan profile ... --alone --threads-per-rank 1 --steps 2``).
ADAMW_MODELS = [
    {"name": "BERT-Base", "profile": "bench-results/profiles/bert_b32_adamw.json",
     "setting": "batch 32, sequence 64", "flop": 6 * 110e6 * 32 * 64,
     "flop_source": "6 x 110 M parameters (Devlin et al. 2019) x 2048 tokens"},
    {"name": "GPT-2 small", "profile": "bench-results/profiles/gpt2_b16_adamw.json",
     "setting": "batch 16, sequence 128", "flop": 6 * 124e6 * 16 * 128,
     "flop_source": "6 x 124 M parameters (Radford et al. 2019; the head tied to the "
                    "embedding) x 2048 tokens"},
]
#: The methods of the AdamW rows, and the GPU speeds (relative to the
#: assumed one) a verdict is checked at.
ADAMW_METHODS = ("ssgd", "ssgd-fp16", "powersgd", "acp")
GPU_CHECKS = (0.5, 4.0)

#: The networks: link rate per node, latency of a ring step, payload share.
NETWORKS = [
    {"name": "1 Gb/s Ethernet", "mbit": 1000.0, "latency_us": 20.0, "wire_efficiency": None},
    {"name": "10 Gb/s Ethernet", "mbit": 10000.0, "latency_us": 20.0, "wire_efficiency": None},
    {"name": "100 Gb/s InfiniBand", "mbit": 100000.0, "latency_us": 2.0,
     "wire_efficiency": 0.98},
]

#: Ranks: the paper's range (abstract: 8 to 64 GPUs; its cluster has 32).
NPS = [8, 16, 32, 64]


def _profile(path: Path) -> dict:
    profile = read_json(path, "profile")
    check_profile(profile, str(path))
    return current_plans(profile)


def project(gpu_tflops: float, utilisation: float) -> List[dict]:
    """One row per (model, network, ranks): steps and ACP-SGD's speed-ups."""
    rows = []
    for model in MODELS:
        profile, gpu_s, scale = _scaled(model, gpu_tflops, utilisation)
        for net in NETWORKS:
            for entry in _steps(profile, scale, net):
                steps = {m: p["step_s"] for m, p in entry["methods"].items()}
                rows.append({"model": model["name"], "setting": model["setting"],
                             "network": net["name"], "np": entry["np"],
                             "compute_scale": scale, "gpu_compute_s": gpu_s, "steps": steps,
                             "vs_ssgd": steps["ssgd"] / steps["acp"],
                             "vs_powersgd": steps["powersgd"] / steps["acp"],
                             "vs_powersgd_ddp": steps["powersgd-ddp"] / steps["acp"]})
    return rows


def _scaled(model: dict, gpu_tflops: float, utilisation: float):
    """``model``'s profile, its step's compute on the assumed GPU (seconds),
    and the factor that scales the profile's times to it."""
    profile = _profile(REPO / model["profile"])
    compute = profile["forward_s"] + profile["backward_s"] + profile["optimizer_s"]
    gpu_s = model["flop"] / (gpu_tflops * 1e12 * utilisation)
    return profile, gpu_s, gpu_s / compute


def _assumed_gpu(models: List[dict], rows: List[dict], gpu_tflops: float,
                 utilisation: float) -> str:
    scales = {r["model"]: (r["compute_scale"], r["gpu_compute_s"]) for r in rows}
    return ("Assumed GPU: " + f"{gpu_tflops:g} TFLOPS FP32 at {utilisation:.0%} "
            "utilisation: " + "; ".join(
                f"{m['name']} {m['flop'] / 1e12:.2f} TFLOP per step ({m['flop_source']}), "
                f"{scales[m['name']][1]:.3f} s, `--compute-scale {scales[m['name']][0]:.3g}` "
                f"on `{m['profile']}`" for m in models) + ".")


def _steps(profile: dict, scale: float, net: dict) -> List[dict]:
    opts = {"compute_scale": scale, "host_s_per_byte": 0.0, "cycle_time_ms": 1.0,
            "wire_efficiency": net["wire_efficiency"]}
    return predict_grid(profile, NPS, [net["mbit"]], [net["latency_us"]], opts)


def project_adamw(gpu_tflops: float, utilisation: float) -> List[dict]:
    """One row per (model, network, ranks) under AdamW: each method's step,
    the fastest, and the fastest with a GPU of each speed of :data:`GPU_CHECKS`."""
    rows = []
    for model in ADAMW_MODELS:
        profile, gpu_s, scale = _scaled(model, gpu_tflops, utilisation)
        for net in NETWORKS:
            checks = {speed: _steps(profile, scale / speed, net) for speed in GPU_CHECKS}
            for k, entry in enumerate(_steps(profile, scale, net)):
                steps = {m: entry["methods"][m]["step_s"] for m in ADAMW_METHODS}
                fastest = min(steps, key=steps.get)
                rows.append({
                    "model": model["name"], "setting": model["setting"],
                    "network": net["name"], "np": entry["np"], "compute_scale": scale,
                    "gpu_compute_s": gpu_s, "steps": steps,
                    "mb_per_step": {m: entry["methods"][m]["bytes_per_step"] / 1e6
                                    for m in ADAMW_METHODS},
                    "fastest": fastest,
                    "fastest_at": {str(speed): min(ADAMW_METHODS, key=lambda m: checks[speed][k][
                        "methods"][m]["step_s"]) for speed in GPU_CHECKS}})
    return rows


def markdown_adamw(rows: List[dict], gpu_tflops: float, utilisation: float) -> List[str]:
    from hvd_acp.methods import label
    lines = ["| model | network | GPUs | S-SGD (s) | S-SGD fp16 (s) | Power-SGD (s) | "
             "ACP-SGD (s) | fastest | with a GPU 0.5x / 4x as fast |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        s = r["steps"]
        at = [r["fastest_at"][str(speed)] for speed in GPU_CHECKS]
        rests = ("same" if all(m == r["fastest"] for m in at)
                 else " / ".join(label(m) for m in at))
        lines.append(f"| {r['model']}, {r['setting']} | {r['network']} | {r['np']} | "
                     + " | ".join(f"{s[m]:.3f}" for m in ADAMW_METHODS)
                     + f" | **{label(r['fastest'])}** | {rests} |")
    first = {m["name"]: next(r for r in rows if r["model"] == m["name"]) for m in ADAMW_MODELS}
    lines += ["", "MB each rank sends per step: " + "; ".join(
        f"{name}: " + ", ".join(f"{label(m)} {r['mb_per_step'][m]:.1f}" for m in ADAMW_METHODS)
        for name, r in first.items()) + "."]
    lines += ["", "Fastest predicted, per network over 8 to 64 GPUs:", ""]
    for model in ADAMW_MODELS:
        for net in NETWORKS:
            group = [r for r in rows if r["model"] == model["name"]
                     and r["network"] == net["name"]]
            winners = sorted({r["fastest"] for r in group}, key=ADAMW_METHODS.index)
            steady = all(all(m == r["fastest"] for m in r["fastest_at"].values())
                         for r in group)
            lines.append(f"- {model['name']}, {net['name']}: "
                         + " or ".join(label(m) for m in winners)
                         + (" (the same with a GPU half or four times as fast)" if steady
                            else " (the verdict rests on the assumed GPU: see the last "
                                 "column)"))
    lines += ["", _assumed_gpu(ADAMW_MODELS, rows, gpu_tflops, utilisation)]
    return lines


def markdown(rows: List[dict], gpu_tflops: float, utilisation: float) -> List[str]:
    lines = ["| model | network | GPUs | S-SGD (s) | Power-SGD (s) | ACP-SGD (s) | ACP-SGD vs "
             "S-SGD | vs Power-SGD (hvd_acp) | vs Power-SGD (DDP hook) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        s = r["steps"]
        lines.append(f"| {r['model']}, {r['setting']} | {r['network']} | {r['np']} | "
                     f"{s['ssgd']:.3f} | {s['powersgd']:.3f} | {s['acp']:.3f} | "
                     f"{r['vs_ssgd']:.2f}x | {r['vs_powersgd']:.2f}x | "
                     f"{r['vs_powersgd_ddp']:.2f}x |")
    lines += ["", "| mean of the projected speed-ups (arithmetic, as the paper's \"average\") "
              "| ACP-SGD vs S-SGD | vs Power-SGD (hvd_acp) | vs Power-SGD (DDP hook) |",
              "|---|---:|---:|---:|"]
    groups: Dict[str, List[dict]] = {"every row above": rows}
    for model in MODELS:
        groups[model["name"]] = [r for r in rows if r["model"] == model["name"]]
    for net in NETWORKS:
        groups[net["name"]] = [r for r in rows if r["network"] == net["name"]]
    groups["10 Gb/s Ethernet and 100 Gb/s InfiniBand"] = [
        r for r in rows if r["network"] != NETWORKS[0]["name"]]
    for name, group in groups.items():
        lines.append(f"| {name} ({len(group)} rows) | "
                     + " | ".join(f"{statistics.mean(r[k] for r in group):.2f}x"
                                  for k in ("vs_ssgd", "vs_powersgd", "vs_powersgd_ddp")) + " |")
    lines.append(f"| **the paper, measured** (abstract: its settings, 8 to 64 GPUs) | "
                 f"**{PAPER['ssgd']:.2f}x** | **{PAPER['powersgd']:.2f}x** (its Power-SGD) | |")
    lines += ["", _assumed_gpu(MODELS, rows, gpu_tflops, utilisation),
              f"Command: `.venv/bin/python scripts/paper_projection.py --gpu-tflops "
              f"{gpu_tflops:g} --utilisation {utilisation:g} --doc docs/planner.md`."]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-tflops", type=float, default=15.7,
                        help="the assumed GPU's FP32 peak (default 15.7, a V100's)")
    parser.add_argument("--utilisation", type=float, default=0.4,
                        help="the share of it a training step sustains (default 0.4)")
    parser.add_argument("--doc", type=Path, default=None, help="a page with the markers")
    parser.add_argument("--out", type=Path, default=None, help="write paper_projection.json")
    args = parser.parse_args(argv)
    rows = project(args.gpu_tflops, args.utilisation)
    lines = markdown(rows, args.gpu_tflops, args.utilisation)
    adamw = project_adamw(args.gpu_tflops, args.utilisation)
    adamw_lines = markdown_adamw(adamw, args.gpu_tflops, args.utilisation)
    print("\n".join(lines + [""] + adamw_lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "paper_projection.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.out / "paper_projection_adamw.json").write_text(json.dumps(adamw, indent=1)
                                                              + "\n")
    if args.doc is not None:
        page = args.doc.read_text(encoding="utf-8")
        page = replace_marked(page, MARKERS, lines, args.doc)
        page = replace_marked(page, ADAMW_MARKERS, adamw_lines, args.doc)
        args.doc.write_text(page, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
