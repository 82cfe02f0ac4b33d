"""The planner with default flags against measured benchmark runs.

For each ``results.json`` of the benchmark (``python -m benchmarks``), this
does what a user would: ``hvd-acp-plan --model M --batch-size B --np N
--bandwidth X`` with nothing else but the Horovod cycle time the run used
(``--horovod-cycle-time-ms``, a setting of the run, not a calibration), and
compares each predicted step with the measured median. No link calibration,
no diagnostics floors: the defaults. The profile is measured here once per
model and batch with the planner's defaults: as many ranks at once as a
node of this host runs (at most the run's ranks), the host's cores divided
among them as threads, Horovod's background thread alive (``--alone``: one
process alone, as the planner profiled before issue 33, for comparison).
``--link-burst`` also tells the planner the token bucket of the run's
emulated link (``--burst-bytes``, the burst its topology names): a property
of the link, like its rate.

    .venv/bin/python scripts/plan_vs_bench.py bench-results/resnet50_100mbit/results.json ... \\
        --out bench-results/validation/defaults

Writes ``defaults.json`` and ``defaults.md`` (a table: run, method, measured,
predicted, error; then the counts against the targets and, for every pair
of methods whose measured interval separates them, whether the predicted
order agrees) and prints them. With ``--doc docs/planner.md`` the same text
goes between ``<!-- planval -->`` and ``<!-- end planval -->`` of that page;
``--report-only`` renders ``OUT/defaults.json`` again without profiling.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "scripts"))

from bench_doc import replace_marked  # noqa: E402  (scripts/, beside this file)
from hvd_acp.methods import label  # noqa: E402
from hvd_acp.plan.__main__ import main as plan_main  # noqa: E402

MARKERS = ("<!-- planval -->", "<!-- end planval -->")

#: A prediction within this fraction of the measurement meets the target.
TARGET = 0.20
#: The tighter target of S-SGD's predictions.
SSGD_TARGET = 0.15


def _suffix(optimizer: str) -> str:
    return "" if optimizer == "sgd" else f"_{optimizer}"


def _profile_path(cfg: dict, out: Path) -> Path:
    """Where this script keeps the profile of a run's model and batch."""
    model = Path(cfg["model"].split(":")[0]).stem
    return out / (f"profile_{model}_b{cfg['batch_size']}"
                  f"{_suffix(cfg.get('optimizer', 'sgd'))}.json")


def _key(cfg: dict) -> Tuple:
    return (cfg["model"], cfg["batch_size"], cfg["matrix_rank"], cfg.get("optimizer", "sgd"))


def _saved_profiles(results: List[Path], out: Path) -> Dict[Tuple, Path]:
    """The profiles in ``out`` of every run's model and batch (``--reuse-profiles``);
    ``SystemExit`` naming the first one missing."""
    found = {}
    for path in results:
        cfg = json.loads(path.read_text())["config"]
        profile = _profile_path(cfg, out)
        if not profile.exists():
            raise SystemExit(f"--reuse-profiles: no {profile} for {path}")
        found[_key(cfg)] = profile
    return found


def link_burst_bytes(cfg: dict) -> int:
    """The token bucket of a run's emulated link, from its topology
    (``tc tbf rate R burst B B``)."""
    found = re.search(r"\btbf rate \S+ burst (\d+) B\b", cfg.get("topology") or "")
    if found is None:
        raise SystemExit(f"--link-burst: no tbf burst in the run's topology: "
                         f"{cfg.get('topology')!r}")
    return int(found.group(1))


def _predict(results: Path, out: Path, profiles: Dict[Tuple, Path], extra: List[str],
             link_burst: bool = False) -> dict:
    bench = json.loads(results.read_text())
    cfg = bench["config"]
    optimizer = cfg.get("optimizer", "sgd")
    key = _key(cfg)
    profile = profiles.get(key)
    flags = ["--np", str(cfg["np"]), "--bandwidth", f"{cfg['bandwidth_mbit']:g}mbit",
             "--no-plot"]
    if link_burst:
        flags += ["--burst-bytes", str(link_burst_bytes(cfg))]
    if cfg.get("horovod_cycle_time_ms"):
        flags += ["--horovod-cycle-time-ms", f"{cfg['horovod_cycle_time_ms']:g}"]
    plan_dir = out / results.parent.name
    if profile is None:
        profile = _profile_path(cfg, out)
        rank = [] if cfg["matrix_rank"] is None else ["--matrix-rank", str(cfg["matrix_rank"])]
        command = ["--model", cfg["model"], "--batch-size", str(cfg["batch_size"]), *rank,
                   "--optimizer", optimizer, "--save-profile", str(profile), *extra]
        profiles[key] = profile
    else:
        command = ["--profile", str(profile)]
    if plan_main(["predict", *command, *flags, "--out", str(plan_dir)]) != 0:
        raise RuntimeError(f"hvd-acp-plan failed on {results}")
    plan = json.loads((plan_dir / "plan.json").read_text())
    predicted = plan["predictions"][0]["methods"]
    order = []
    for ratio in bench.get("ratios") or ():
        a, b = ratio["a"], ratio["b"]
        if (ratio.get("what") == "step" and ratio.get("verdict") in ("faster", "slower")
                and a in predicted and b in predicted and a in bench["methods"]
                and b in bench["methods"]):
            faster = predicted[a]["step_s"] < predicted[b]["step_s"]
            order.append({"a": a, "b": b, "measured": ratio["verdict"],
                          "interval": [ratio["low"], ratio["high"]],
                          "predicted": "faster" if faster else "slower",
                          "agrees": faster == (ratio["verdict"] == "faster")})
    rows = {}
    for method, entry in bench["methods"].items():
        measured = entry.get("step_s_median")
        if measured and method in predicted:
            p = predicted[method]["step_s"]
            rows[method] = {"measured_step_s": measured, "predicted_step_s": p,
                            "error": (p - measured) / measured}
    return {"run": str(results.parent.relative_to(REPO) if results.is_relative_to(REPO)
                       else results.parent),
            "model": cfg["model"], "batch_size": cfg["batch_size"], "np": cfg["np"],
            "bandwidth_mbit": cfg["bandwidth_mbit"],
            "command": "hvd-acp-plan " + " ".join(
                ["--model", cfg["model"], "--batch-size", str(cfg["batch_size"]),
                 *(["--optimizer", optimizer] if optimizer != "sgd" else []), *flags, *extra]),
            "optimizer": optimizer,
            "assumed": plan["config"].get("assumed"), "methods": rows, "order": order}


def markdown(found: List[dict]) -> str:
    lines = ["| run | model, batch | link | method | measured (s) | predicted (s) | error |",
             "|---|---|---|---|---|---|---|"]
    for run in found:
        for method, row in run["methods"].items():
            flag = "" if abs(row["error"]) <= TARGET else " **x**"
            lines.append(f"| {Path(run['run']).name} | {run['model']}, {run['batch_size']} | "
                         f"{run['bandwidth_mbit']:g} Mbit/s | {label(method)} | "
                         f"{row['measured_step_s']:.3f} | {row['predicted_step_s']:.3f} | "
                         f"{row['error'] * 100:+.1f}%{flag} |")
    errors = [abs(r["error"]) for run in found for r in run["methods"].values()]
    within = sum(e <= TARGET for e in errors)
    lines += ["", f"{within} of {len(errors)} predictions within {TARGET:.0%}; worst "
              f"{max(errors) * 100:.1f}%." if errors else "no prediction"]
    per_method: Dict[str, List[float]] = {}
    for run in found:
        for method, row in run["methods"].items():
            per_method.setdefault(method, []).append(abs(row["error"]))
    if len(per_method) > 1:
        lines.append("Per method: " + "; ".join(
            f"{label(m)} {sum(e <= TARGET for e in errs)} of {len(errs)} within {TARGET:.0%} "
            f"(worst {max(errs) * 100:.1f}%)" for m, errs in per_method.items()) + ".")
    ssgd = [abs(run["methods"]["ssgd"]["error"]) for run in found if "ssgd" in run["methods"]]
    if ssgd:
        lines.append(f"S-SGD: {sum(e <= SSGD_TARGET for e in ssgd)} of {len(ssgd)} within "
                     f"{SSGD_TARGET:.0%}; worst {max(ssgd) * 100:.1f}%.")
    pairs = [(run, o) for run in found for o in run.get("order", ())]
    if pairs:
        wrong = [f"{Path(run['run']).name}: {label(o['a'])} measured {o['measured']} than "
                 f"{label(o['b'])}, predicted {o['predicted']}" for run, o in pairs
                 if not o["agrees"]]
        lines.append(f"Order: {len(pairs) - len(wrong)} of {len(pairs)} pairs of methods whose "
                     "measured interval separates them are predicted in the measured order"
                     + (": " + "; ".join(wrong) if wrong else "."))
    lines += _profiles(found)
    return "\n".join(lines)


def _profiles(found: List[dict]) -> List[str]:
    """What the profiles assumed: the common conditions once, then each
    model and batch's own DDP compute scale where the text gives one."""
    seen: Dict[str, str] = {}
    for run in found:
        if run.get("assumed"):
            seen.setdefault(f"{run['model']} batch {run['batch_size']}", run["assumed"])
    if not seen:
        return []
    split = "; the DDP hook's compute"
    heads = {text.split(split)[0] for text in seen.values()}
    if len(heads) != 1 or not all(split in text for text in seen.values()):
        return ["Profiles: " + "; ".join(f"{k}: {v}" for k, v in seen.items()) + "."]
    tails, slowest = [], []
    for key, text in seen.items():
        scale = re.search(r"without it \(([0-9.]+x)\)", text)
        tails.append(f"{key} {scale.group(1) if scale else 'n/a'}")
        slow = re.search(r"the slowest rank's kernels \((rank \d+, [0-9.]+x)", text)
        if slow:
            slowest.append(f"{key} {slow.group(1)}")
    line = (f"Profiles (one per model and batch): {heads.pop()}; the DDP hook's compute "
            f"from the same ranks without Horovod's thread ({', '.join(tails)})")
    if slowest:
        line += ("; each the slowest rank's kernels (the rank, its step over the fastest "
                 f"rank's: {', '.join(slowest)})")
    return [line + "."]


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="*", help="the runs' results.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--alone", action="store_true",
                        help="profile one process alone (hvd-acp-plan --alone) instead of "
                             "every local rank at once")
    parser.add_argument("--doc", type=Path, default=None,
                        help="a page with the markers %s and %s" % MARKERS)
    parser.add_argument("--marker", default="planval",
                        help="the name in the page's markers (default planval: "
                             "<!-- planval --> ... <!-- end planval -->)")
    parser.add_argument("--reuse-profiles", action="store_true",
                        help="predict from the profiles already in OUT (profile_*.json, as "
                             "this script names them) instead of profiling again: the runs "
                             "replanned by today's planner from the profiles they were "
                             "validated with")
    parser.add_argument("--profiles", type=Path, default=None,
                        help="with --reuse-profiles: the folder of the profiles (default OUT), "
                             "so that another prediction of the same runs needs no copies")
    parser.add_argument("--link-burst", action="store_true",
                        help="predict each run's link with the token bucket its topology "
                             "names (hvd-acp-plan --burst-bytes)")
    parser.add_argument("--report-only", action="store_true",
                        help="render OUT/defaults.json again (no profiling, no prediction)")
    args = parser.parse_args(argv)
    if args.report_only:
        found = json.loads((args.out / "defaults.json").read_text())
    else:
        if not args.results:
            parser.error("give the runs' results.json (or --report-only)")
        args.out.mkdir(parents=True, exist_ok=True)
        if args.profiles is not None and not args.reuse_profiles:
            parser.error("--profiles goes with --reuse-profiles")
        profiles: Dict[Tuple, Path] = (_saved_profiles(args.results, args.profiles or args.out)
                                       if args.reuse_profiles else {})
        extra = ["--alone"] if args.alone else []
        found = [_predict(path.resolve(), args.out, profiles, extra, args.link_burst)
                 for path in args.results]
        (args.out / "defaults.json").write_text(json.dumps(found, indent=1) + "\n")
    text = markdown(found)
    (args.out / "defaults.md").write_text(text + "\n")
    if args.doc is not None:
        page = args.doc.read_text(encoding="utf-8")
        markers = (f"<!-- {args.marker} -->", f"<!-- end {args.marker} -->")
        args.doc.write_text(replace_marked(page, markers, text.split("\n"), args.doc),
                            encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
