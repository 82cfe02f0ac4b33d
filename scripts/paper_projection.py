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
        profile = _profile(REPO / model["profile"])
        compute = profile["forward_s"] + profile["backward_s"] + profile["optimizer_s"]
        gpu_s = model["flop"] / (gpu_tflops * 1e12 * utilisation)
        scale = gpu_s / compute
        for net in NETWORKS:
            opts = {"compute_scale": scale, "host_s_per_byte": 0.0, "cycle_time_ms": 1.0,
                    "wire_efficiency": net["wire_efficiency"]}
            for entry in predict_grid(profile, NPS, [net["mbit"]], [net["latency_us"]], opts):
                steps = {m: p["step_s"] for m, p in entry["methods"].items()}
                rows.append({"model": model["name"], "setting": model["setting"],
                             "network": net["name"], "np": entry["np"],
                             "compute_scale": scale, "gpu_compute_s": gpu_s, "steps": steps,
                             "vs_ssgd": steps["ssgd"] / steps["acp"],
                             "vs_powersgd": steps["powersgd"] / steps["acp"],
                             "vs_powersgd_ddp": steps["powersgd-ddp"] / steps["acp"]})
    return rows


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
    scales = {r["model"]: (r["compute_scale"], r["gpu_compute_s"]) for r in rows}
    lines += ["", "Assumed GPU: " + f"{gpu_tflops:g} TFLOPS FP32 at {utilisation:.0%} "
              "utilisation: " + "; ".join(
                  f"{m['name']} {m['flop'] / 1e12:.2f} TFLOP per step ({m['flop_source']}), "
                  f"{scales[m['name']][1]:.3f} s, `--compute-scale {scales[m['name']][0]:.3g}` "
                  f"on `{m['profile']}`" for m in MODELS) + ".",
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
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "paper_projection.json").write_text(json.dumps(rows, indent=1) + "\n")
    if args.doc is not None:
        page = args.doc.read_text(encoding="utf-8")
        args.doc.write_text(replace_marked(page, MARKERS, lines, args.doc), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
