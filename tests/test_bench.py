"""The benchmark: pure pieces in one process, then a small real run.

Timings are never asserted: the machines that run the suite are shared.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import report
from benchmarks.driver import summarize_rounds
from benchmarks.launch import Command, JobError, run_job
from benchmarks.stats import (combine_ranks, median_interval, order_statistic_rank,
                              paired_ratios, parse_methods, percentile, round_order,
                              summarize_steps, tbf_burst_bytes, verdict)
from benchmarks.worker import link_tx_bytes, powersgd_ddp_bytes_per_step
from hvd_acp.methods import label
from hvd_acp.plan.models import SmallNet, build_model, default_matrix_rank
from hvd_acp.plan.units import parse_bandwidth
from tests.hvdrun import requires_emulation

REPO = Path(__file__).resolve().parent.parent
METHOD_FIELDS = ("step_s_median", "step_s_p10", "step_s_p90", "samples_per_s",
                 "bytes_sent_per_step", "allreduces_per_step", "compression_s_per_step")
CONFIG_FIELDS = ("model", "np", "batch_size", "matrix_rank", "bandwidth_mbit", "topology",
                 "versions")
#: examples/train_lm.py's transformer, as a user's model (from the repository root).
LM_MODEL = "examples/train_lm.py:benchmark_model"


# ------------------------------------------------------------------ parsing
@pytest.mark.parametrize("text, mbit", [
    ("200mbit", 200.0), ("1gbit", 1000.0), ("1.5Gbit", 1500.0), ("500kbit", 0.5),
    ("100000000bit", 100.0), (" 10mbit ", 10.0), ("2tbit", 2e6)])
def test_parse_bandwidth(text, mbit):
    assert parse_bandwidth(text) == pytest.approx(mbit)


@pytest.mark.parametrize("text", [None, "", "none", "None"])
def test_parse_bandwidth_none_means_no_emulation(text):
    assert parse_bandwidth(text) is None


@pytest.mark.parametrize("text", ["200", "200mb", "fast", "-5mbit", "0mbit", "1gbps"])
def test_parse_bandwidth_rejects(text):
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth(text)


def test_parse_methods_keeps_order_and_drops_duplicates():
    assert parse_methods("acp, ssgd,acp") == ["acp", "ssgd"]
    with pytest.raises(ValueError, match="'topk'"):
        parse_methods("ssgd,topk")
    with pytest.raises(ValueError, match="at least one"):
        parse_methods(" , ")


def test_tbf_burst_exceeds_offload_packets_and_covers_a_tick():
    assert tbf_burst_bytes(1.0) > 64 * 1024
    assert tbf_burst_bytes(10_000.0) >= 10_000e6 / 8 * 0.002


# --------------------------------------------------------------- statistics
def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    values = [0.9, 0.1, 0.5, 0.3, 2.0, 0.7]
    for q in (0, 10, 50, 90, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([3.0], 90) == 3.0
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)


def test_summarize_steps():
    summary = summarize_steps([1.0, 2.0, 3.0, 4.0, 5.0], samples_per_step=16)
    assert summary["step_s_median"] == 3.0
    assert summary["step_s_p10"] == pytest.approx(1.4)
    assert summary["step_s_p90"] == pytest.approx(4.6)
    assert summary["samples_per_s"] == pytest.approx(16 / 3.0)


def test_combine_ranks_takes_the_slowest_rank_per_step():
    assert combine_ranks([[1.0, 5.0], [2.0, 3.0]]) == [2.0, 5.0]
    with pytest.raises(ValueError, match="different numbers"):
        combine_ranks([[1.0], [1.0, 2.0]])


def test_breakdown_floors_exposed_communication_at_zero():
    parts = report.breakdown({"step_s_median": 1.0, "compression_s_per_step": 0.3}, floor=0.9)
    assert parts == {"compute": 0.9, "compression": 0.3, "exposed_comm": 0.0}
    parts = report.breakdown({"step_s_median": 2.0, "compression_s_per_step": None}, 0.5)
    assert parts["exposed_comm"] == pytest.approx(1.5)


# ------------------------------------------------------ rounds, intervals
def test_round_order_puts_every_job_in_every_position():
    jobs = ["compute", "ssgd", "powersgd", "powersgd-ddp", "acp"]
    orders = [round_order(jobs, i) for i in range(len(jobs))]
    for order in orders:
        assert sorted(order) == sorted(jobs)
    for position in range(len(jobs)):
        assert sorted(order[position] for order in orders) == sorted(jobs)
    assert len({order[0] for order in orders[:2]}) == 2
    assert len({order[-1] for order in orders[:2]}) == 2
    assert round_order(jobs, len(jobs)) == round_order(jobs, 0) == jobs
    with pytest.raises(ValueError, match="round_index"):
        round_order(jobs, -1)


@pytest.mark.parametrize("n, j, coverage", [
    (1, 1, 0.0), (2, 1, 0.5), (5, 1, 0.9375), (6, 1, 0.96875), (8, 1, 0.9921875),
    (9, 2, 1 - 2 * 10 / 512), (12, 3, 1 - 2 * 79 / 4096)])
def test_order_statistic_interval_coverage_is_exact(n, j, coverage):
    assert order_statistic_rank(n) == (j, pytest.approx(coverage))


def test_order_statistic_coverage_holds_by_simulation():
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    values = rng.lognormal(0.0, 0.3, size=(20000, 6))      # median exactly 1.0
    low, high = values.min(axis=1), values.max(axis=1)
    assert ((low <= 1.0) & (1.0 <= high)).mean() == pytest.approx(0.96875, abs=0.005)


def _drifting_rounds(ratio, n=6, noise=0.01, drift=0.2, seed=0):
    """Figures of two jobs per round: a common drift of the machine (up to
    +-``drift``) and a small noise of each job; a's true step is ``ratio``
    times b's."""
    import random
    rng = random.Random(seed)
    a, b = {}, {}
    for i in range(1, n + 1):
        machine = 1 + rng.uniform(-drift, drift)
        a[i] = ratio * machine * (1 + rng.uniform(-noise, noise))
        b[i] = machine * (1 + rng.uniform(-noise, noise))
    return a, b


def test_identical_methods_are_the_same():
    a, b = _drifting_rounds(1.0)
    interval = median_interval(paired_ratios(a, b), log=True)
    assert interval.low <= 1.0 <= interval.high and interval.n == 6
    assert interval.high / interval.low < 1.05        # pairing removed the 20% drift
    assert verdict(interval) == "same"
    same = {i: 1.0 for i in range(1, 7)}
    assert verdict(median_interval(paired_ratios(same, same), log=True)) == "same"


def test_separated_methods_get_a_verdict_despite_drift():
    a, b = _drifting_rounds(0.9)
    # Unpaired, the two jobs' intervals overlap: the drift hides a 10% difference.
    assert median_interval(list(a.values())).overlaps(median_interval(list(b.values())))
    faster = median_interval(paired_ratios(a, b), log=True)
    assert faster.high < 1.0 and verdict(faster) == "faster"
    assert verdict(median_interval(paired_ratios(b, a), log=True)) == "slower"


def test_overlapping_methods_are_not_separable():
    ratios = [0.95, 1.02, 0.98, 1.04, 0.97, 1.01]
    interval = median_interval(ratios, log=True)
    assert (interval.low, interval.high) == (0.95, 1.04)
    assert verdict(interval) == "same"
    # The same spread, all on one side of 1.0, is a verdict.
    assert verdict(median_interval([r * 0.9 for r in ratios], log=True)) == "faster"


def test_median_of_ratios_is_reciprocal_and_one_round_has_no_verdict():
    values = [0.8, 0.9, 1.1, 1.3]
    forward = median_interval(values, log=True)
    backward = median_interval([1 / v for v in values], log=True)
    assert forward.median == pytest.approx(1 / backward.median)
    assert forward.low == pytest.approx(1 / backward.high)
    assert verdict(median_interval([0.5], log=True)) == "same"
    with pytest.raises(ValueError, match="empty"):
        median_interval([])
    with pytest.raises(ValueError, match="positive"):
        median_interval([0.0, 1.0], log=True)


def test_paired_ratios_skip_failed_and_zero_rounds():
    assert paired_ratios({1: 2.0, 2: None, 3: 1.0, 4: 0.0}, {1: 1.0, 2: 1.0, 4: 1.0}) == [2.0]


def _round(i, step, compression=0.0, sent=100.0, steps=4):
    return {"round": i, "position": 1, "step_s_median": step, "step_s": [step] * steps,
            "step_s_p10": step, "step_s_p90": step, "samples_per_s": 64 / step,
            "samples_per_step": 64, "bytes_sent_per_step": sent, "allreduces_per_step": 2,
            "compression_s_per_step": compression, "steps": steps, "wall_s": 10.0,
            "attempts": 1, "cpu_share_outside_job": 0.01, "last_loss": [1.0, 1.0],
            "phase_s_median": {"forward": step / 3, "backward": step / 2,
                               "optimizer_step": step / 6}}


def _results(figures, rounds=6):
    """results.json of a synthetic run: ``figures[job] = (step, compression, bytes)``,
    times a drift common to each round's jobs and a noise of +-2% of each job."""
    import random
    drift = [1.0, 1.2, 0.9, 1.1, 0.95, 1.15, 1.05, 0.85][:rounds]
    entries = {}
    for job, (step, comp, sent) in figures.items():
        noise = random.Random(job)
        entries[job] = summarize_rounds([
            _round(i + 1, step * d * (1 + noise.uniform(-0.02, 0.02)), comp * d, sent)
            for i, d in enumerate(drift)])
    results = {"config": {"model": "small", "np": 2, "batch_size": 32, "matrix_rank": 4,
                          "bandwidth_mbit": 100.0, "topology": "test", "steps": 4,
                          "warmup": 2, "image_size": None, "seq_len": None,
                          "threads_per_rank": 1, "cpus": 2, "horovod_cycle_time_ms": 10.0,
                          "versions": {"hvd_acp": "0.1.0"}, "command": "python -m benchmarks test",
                          "rounds": rounds},
               "rounds": rounds, "compute_only": entries.pop("compute"),
               "methods": entries, "notes": []}
    report.derive(results)
    return results


FIGURES = {"compute": (1.0, 0.0, 0.0), "ssgd": (9.0, 0.0, 1000.0),
           "powersgd": (1.4, 0.05, 20.0), "acp": (1.2, 0.04, 10.0),
           "newmethod": (1.21, 0.04, 10.0)}


def test_summarize_rounds_keeps_per_round_figures_and_failed_rounds():
    rounds = [_round(1, 1.0), {"round": 2, "step_s_median": None, "error": "boom"},
              _round(3, 1.2, 0.1)]
    entry = summarize_rounds(rounds)
    assert entry["step_s_median"] == pytest.approx(1.1)
    assert (entry["step_s_low"], entry["step_s_high"]) == (1.0, 1.2)
    assert entry["rounds_measured"] == 2 and entry["errors"] == ["round 2: boom"]
    assert entry["steps"] == 4 and isinstance(entry["steps"], int)
    assert len(entry["step_s"]) == 8 and entry["per_round"] == rounds
    failed = summarize_rounds([{"round": 1, "step_s_median": None, "error": "boom"}])
    assert failed["step_s_median"] is None and "boom" in failed["error"]


def test_derive_pairs_every_measured_method_with_intervals_and_verdicts():
    results = _results(FIGURES)
    ratios = {(r["a"], r["b"], r["what"]): r for r in results["ratios"]}
    for r in results["ratios"]:
        assert r["low"] <= r["median"] <= r["high"] and r["rounds"] == 6
        assert r["verdict"] in ("faster", "slower", "same")
    # A method the report does not know is compared with every other one.
    for other in ("ssgd", "powersgd", "acp", "floor"):
        assert ("newmethod", other, "step") in ratios
    assert ratios[("acp", "ssgd", "step")]["verdict"] == "faster"
    assert ratios[("acp", "powersgd", "step")]["verdict"] == "faster"
    assert ratios[("newmethod", "acp", "step")]["verdict"] == "same"   # 1.21 vs 1.2, 2% noise
    assert ratios[("acp", "floor", "step")]["verdict"] == "slower"
    assert ratios[("acp", "powersgd", "compression")]["median"] == pytest.approx(0.8)
    assert ratios[("acp", "powersgd", "bytes")]["median"] == pytest.approx(0.5)
    assert ("powersgd", "ssgd", "compression") not in ratios      # S-SGD compresses nothing
    assert ("acp", "floor", "bytes") not in ratios
    speedup = report.find_ratio(results, "ssgd", "acp")
    assert speedup["median"] == pytest.approx(1 / ratios[("acp", "ssgd", "step")]["median"])
    assert speedup["verdict"] == "slower"
    acp = results["methods"]["acp"]
    assert acp["speedup_vs_ssgd"] == pytest.approx(speedup["median"])
    assert acp["ratio_to_floor_low"] <= acp["ratio_to_floor"] <= acp["ratio_to_floor_high"]


def test_markdown_shows_intervals_verdicts_and_a_disturbed_floor(tmp_path):
    text = report.markdown(_results(FIGURES))
    assert "96.9% interval" in text
    assert "ACP-SGD against Power-SGD (hvd_acp)" in text and "ACP-SGD faster" in text
    assert "no measurable difference" in text and "slower than the floor" in text
    assert "Disturbed run" not in text
    disturbed = _results(dict(FIGURES, compute=(1.3, 0.0, 0.0)))
    assert "Disturbed run" in report.markdown(disturbed)
    report.plot_breakdown(disturbed, tmp_path / "breakdown.png")
    assert (tmp_path / "breakdown.png").stat().st_size > 0


def test_results_without_rounds_still_render():
    results = _results(FIGURES, rounds=1)
    for entry in list(results["methods"].values()) + [results["compute_only"]]:
        entry.update(entry.pop("per_round")[0])      # one block of steps per job
    results.pop("rounds")
    report.derive(results)
    assert results["rounds"] == 1
    assert all(r["verdict"] == "same" and r["rounds"] == 1 for r in results["ratios"])
    text = report.markdown(results)
    assert "no intervals and no verdicts" in text and "n/a (1 round)" in text


# -------------------------------------------------------------------- check
def _write(path: Path, results) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results))
    return path


def _check(*args):
    from benchmarks import __main__ as cli
    return cli.main(["check", *map(str, args)])


def test_check_passes_when_every_interval_overlaps(tmp_path, capsys):
    old = _write(tmp_path / "old" / "results.json", _results(FIGURES))
    new = _write(tmp_path / "new" / "results.json",
                 _results(dict(FIGURES, acp=(1.19, 0.04, 10.0))))
    assert _check(old, new) == 0
    assert "every interval overlaps" in capsys.readouterr().out
    assert _check(old.parent, new.parent) == 0          # directories are fine too


def test_check_fails_and_lists_the_ratios_that_moved(tmp_path, capsys):
    old = _write(tmp_path / "old.json", _results(FIGURES))
    new = _write(tmp_path / "new.json", _results(dict(FIGURES, acp=(1.5, 0.04, 10.0))))
    assert _check(old, new) == 1
    out = capsys.readouterr().out
    assert "step acp/powersgd" in out and "step acp/floor" in out
    assert "bytes acp/powersgd" not in out


@pytest.mark.parametrize("change, message", [
    ({"bandwidth_mbit": 1000.0}, "bandwidth_mbit: 100.0 != 1000.0"),
    ({"model": "resnet50"}, "model"),
    ({"horovod_cycle_time_ms": None}, "horovod_cycle_time_ms"),
    ({"optimizer": "adamw"}, "optimizer: 'sgd' != 'adamw'")])
def test_check_refuses_different_configurations(tmp_path, capsys, change, message):
    old = _write(tmp_path / "old.json", _results(FIGURES))
    other = _results(FIGURES)
    other["config"].update(change)
    assert _check(old, _write(tmp_path / "new.json", other)) == 2
    err = capsys.readouterr().err
    assert "not the same configuration" in err and message in err


def test_check_takes_a_run_before_the_optimizer_was_recorded_as_sgd(tmp_path):
    old = _write(tmp_path / "old.json", _results(FIGURES))
    assert "optimizer" not in json.loads(old.read_text())["config"]
    new = _results(FIGURES)
    new["config"]["optimizer"] = "sgd"
    assert _check(old, _write(tmp_path / "new.json", new)) == 0


def test_markdown_names_the_optimizer_and_the_resolved_defaults():
    plain = report.markdown(_results(FIGURES))
    assert "optimizer SGD (momentum 0.9), matrix_rank 4," in plain
    assert "No --matrix-rank" not in plain
    results = _results(FIGURES)
    results["config"].update(optimizer="adamw", matrix_rank=None)
    results["methods"]["acp"]["settings"] = {"matrix_rank": 0.5, "fp16_wire": True}
    results["methods"]["powersgd"]["settings"] = {"matrix_rank": 0.25, "fp16_wire": True}
    text = report.markdown(results)
    assert "optimizer AdamW, matrix_rank each method's default," in text
    assert ("No --matrix-rank: each method resolved its default for AdamW (Power-SGD "
            "(hvd_acp) matrix_rank 0.25, fp16 on the wire; ACP-SGD matrix_rank 0.5, fp16 "
            "on the wire).") in text


def test_check_refuses_missing_or_foreign_files(tmp_path, capsys):
    good = _write(tmp_path / "good.json", _results(FIGURES))
    assert _check(good, tmp_path / "missing.json") == 2
    assert "missing.json: no such file" in capsys.readouterr().err
    (tmp_path / "text.json").write_text("not json")
    assert _check(tmp_path / "text.json", good) == 2
    assert "not a results file" in capsys.readouterr().err
    _write(tmp_path / "other.json", {"hello": 1})
    assert _check(good, tmp_path / "other.json") == 2
    assert "not a results file" in capsys.readouterr().err
    one_round = _results(FIGURES, rounds=1)
    assert _check(good, _write(tmp_path / "one.json", one_round)) == 2
    assert "without rounds" in capsys.readouterr().err


# ------------------------------------------------------------------- docs
@pytest.fixture
def bench_doc(monkeypatch):
    """scripts/bench_doc.py, loaded as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_doc", REPO / "scripts" / "bench_doc.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_doc", module)   # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_bench_doc_judges_targets_from_the_intervals(tmp_path, bench_doc):
    figures = {"compute": (1.0, 0.0, 0.0), "ssgd": (9.0, 0.0, 1000.0),
               "powersgd": (1.4, 0.05, 20.0), "powersgd-ddp": (1.31, 0.09, 20.0),
               "acp": (1.3, 0.03, 10.0)}
    results = tmp_path / "results"
    _write(results / "resnet50_100mbit" / "results.json", dict(_results(figures), duration_s=900))
    _write(results / "resnet50_100mbit_rerun" / "results.json", _results(figures))
    (results / "resnet50_100mbit" / "results.md").write_text(
        report.markdown(_results(figures)))
    doc = tmp_path / "benchmarks.md"
    doc.write_text("intro\n<!-- targets -->\nold\n<!-- end targets -->\nmiddle\n"
                   "<!-- runs -->\nold\n<!-- end runs -->\n<!-- time -->\n<!-- end time -->\n"
                   "<!-- baselines -->\n<!-- end baselines -->\nend\n")
    assert bench_doc.main(["--results", str(results), "--doc", str(doc),
                           "--img", str(tmp_path / "img")]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n") and "\nmiddle\n" in text and text.endswith("end\n")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()
            if line.startswith("| ")}
    assert "**met**" in rows["ACP-SGD >= 3x faster than S-SGD (S-SGD's step / ACP-SGD's)"]
    assert "**met**" in rows["ACP-SGD faster than Power-SGD (hvd_acp) (its step / ACP-SGD's > 1)"]
    assert "not separable from noise" in rows[
        "ACP-SGD faster than Power-SGD (DDP hook) (its step / ACP-SGD's > 1)"]
    assert "**missed**" in rows["ACP-SGD within 1.15x of the floor"]
    assert "15.0 min: **met**" in rows["whole run (all rounds, all jobs) <= 20 min"]
    assert "all overlap: **met**" in text
    # The runs index: one row per run with ACP-SGD's verdicts, linking the
    # run's own results.md and breakdown picture instead of copying its tables.
    title = dict(bench_doc.RUNS)["resnet50_100mbit"]
    row = rows[f"`resnet50_100mbit`: {title}"]
    ssgd = report.find_ratio(_results(figures), "ssgd", "acp")
    assert f"| 6 | {ssgd['median']:.2f}x [{ssgd['low']:.2f}, {ssgd['high']:.2f}], faster |" in row
    assert "| small, 32, 2, 100 Mbit/s |" in row and "| 15.0 min |" in row
    assert "[results](results/resnet50_100mbit/results.md)" in row
    assert "[breakdown](img/bench_resnet50_100mbit.png)" in row
    assert (tmp_path / "img" / "bench_resnet50_100mbit.png").exists()
    assert "\n.venv/bin/python -m benchmarks test\n" in text      # its command, as run today
    for line in (results / "resnet50_100mbit" / "results.md").read_text().splitlines():
        if line.startswith("| "):
            assert line not in text, f"copied from results.md: {line}"
    assert "| method |" not in text and "| A against B" not in text
    # With --doc given only the pages named are written; a README named gets
    # its section from the README's runs (none of them here).
    readme = tmp_path / "README.md"
    readme.write_text("top\n<!-- bench:readme -->\nold\n<!-- end bench:readme -->\nbottom\n")
    assert bench_doc.main(["--results", str(results), "--doc", str(doc), "--readme", str(readme),
                           "--img", str(tmp_path / "img")]) == 0
    assert readme.read_text() == ("top\n<!-- bench:readme -->\n\nNo runs in bench-results/ yet."
                                  "\n\n<!-- end bench:readme -->\nbottom\n")
    # "Where the time goes" lists only runs with diagnostics: none here.
    assert "| run | floor (1 process) |" in text and "(`resnet50_100mbit`" not in text
    assert "No runs in bench-results/ yet." in text.split("<!-- baselines -->")[1]


def test_bench_doc_judges_the_baselines_and_ablations(tmp_path, bench_doc):
    """The baselines section: each target in the runs it applies to, each
    ablation's worth from ACP-SGD's side, and the operator calls per run."""
    figures = {"compute": (1.0, 0.0, 0.0), "ssgd": (9.0, 0.0, 1000.0),
               "ssgd-fp16": (5.0, 0.0, 500.0), "powersgd": (1.4, 0.05, 20.0),
               "powersgd-ddp-batched": (1.16, 0.05, 20.0), "acp": (1.15, 0.025, 10.0),
               "acp-nooverlap": (1.5, 0.025, 10.0), "acp-nofusion": (1.16, 0.03, 10.0)}
    results = tmp_path / "results"
    _write(results / "resnet50_100mbit_baselines" / "results.json", _results(figures))
    ops = _results({"compute": (1.0, 0.0, 0.0), "acp": (1.1, 0.02, 10.0)}, rounds=1)
    ops["methods"]["acp"]["ops_over_floor_per_step"] = 2722.0
    ops["methods"]["acp"]["kernels_over_floor_per_step"] = 601.0
    _write(results / "ops_resnet50" / "results.json", ops)
    doc = tmp_path / "benchmarks.md"
    doc.write_text("<!-- targets -->\n<!-- end targets -->\n<!-- runs -->\n<!-- end runs -->\n"
                   "<!-- time -->\n<!-- end time -->\n<!-- baselines -->\n<!-- end baselines -->\n")
    assert bench_doc.main(["--results", str(results), "--doc", str(doc),
                           "--img", str(tmp_path / "img")]) == 0
    section = doc.read_text().split("<!-- baselines -->")[1]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in section.splitlines()
            if line.startswith("| ")}
    assert "**missed**" in rows["ACP-SGD within 1.10x of the floor (ResNet-50's target)"]
    assert "ACP-SGD within 1.20x of the floor (BERT-Base's target)" not in rows
    assert "**met**" in rows["ACP-SGD compression <= 0.6x Power-SGD's (hvd_acp)"]
    assert "**met**" in rows[f"ACP-SGD faster than {label('ssgd-fp16')} (its step / "
                             "ACP-SGD's > 1)"]
    assert "not separable from noise" in rows[
        f"ACP-SGD faster than {label('powersgd-ddp-batched')} (its step / ACP-SGD's > 1)"]
    assert f"ACP-SGD faster than {label('ddp-fp16')} (its step / ACP-SGD's > 1)" not in rows
    overlap = next(line for text, line in rows.items() if "(`acp-nooverlap`)" in text)
    fusion = next(line for text, line in rows.items() if "(`acp-nofusion`)" in text)
    assert "ACP-SGD faster" in overlap and "not separable from noise" in fusion
    assert "| 2,722 (601) |" in rows[label("acp")]


# -------------------------------------------------------- counters, models
def test_link_tx_bytes_reads_proc_net_dev(tmp_path):
    dev = tmp_path / "dev"
    dev.write_text(
        "Inter-|   Receive                                                |  Transmit\n"
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets "
        "errs drop fifo colls carrier compressed\n"
        "    lo:     100       1    0    0    0     0          0         0      200       2"
        "    0    0    0     0       0          0\n"
        "  acp0: 5000 10 0 0 0 0 0 0 123456 20 0 0 0 0 0 0\n")
    assert link_tx_bytes("acp0", str(dev)) == 123456
    assert link_tx_bytes("lo", str(dev)) == 200
    with pytest.raises(RuntimeError, match="eth9"):
        link_tx_bytes("eth9", str(dev))


def test_powersgd_ddp_bytes_follow_the_hooks_rule():
    model = SmallNet()
    r = 4
    # Weights (512, 256), (512, 512) x2 and (10, 512) are all compressed
    # ((n + m) r * 2 < n m, even 522 * 4 * 2 < 5120); the biases are not.
    expected = ((512 + 256) * r + 2 * (512 + 512) * r + (10 + 512) * r
                + 512 * 3 + 10)
    assert powersgd_ddp_bytes_per_step(model, r) == expected * 4


def test_torch_hook_rank_sends_about_what_hvd_acps_powersgd_sends():
    from benchmarks.worker import TORCH_POWERSGD_HOOKS
    from hvd_acp.methods.counting import hvd_acp_powersgd_bytes, torch_hook_rank
    from hvd_acp.methods import REGISTRY
    assert all("powerSGD_hook" in REGISTRY[key].implementation for key in TORCH_POWERSGD_HOOKS)
    model = SmallNet()
    assert torch_hook_rank(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)) == 4
    adamw = torch.optim.AdamW(model.parameters())
    rank = torch_hook_rank(model, adamw)
    target = hvd_acp_powersgd_bytes(model, adamw)
    # A quarter of each matrix's smaller side in fp16: (768 * 64 + 1024 * 128 * 2
    # + 522 * 3) * 2 bytes for the weights, the biases (1546) in fp16 too.
    assert target == (768 * 64 + 2 * 1024 * 128 + 522 * 3 + 1546) * 2
    gap = abs(powersgd_ddp_bytes_per_step(model, rank) - target)
    for other in (rank - 1, rank + 1):
        assert gap <= abs(powersgd_ddp_bytes_per_step(model, other) - target)


@pytest.fixture
def importable_examples(monkeypatch):
    """examples/ put on sys.path (as loading a model file does), undone after."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    had_common = "common" in sys.modules
    yield
    if not had_common:
        sys.modules.pop("common", None)


def test_train_lm_benchmark_model_builds_and_backprops(importable_examples):
    from hvd_acp.plan.models import build_user_model
    # Loading the file puts its directory on sys.path: train_lm.py imports ``common``.
    spec = build_user_model(LM_MODEL, 3)
    module = spec.loss_fn.__globals__          # train_lm.py's, loaded from its file
    defaults = module["parse_args"]([])
    assert (defaults.seq_len, defaults.d_model, defaults.layers, defaults.heads) == (64, 128, 2, 4)
    assert type(spec.model).__name__ == "TransformerLM"
    assert spec.model.positions.num_embeddings == defaults.seq_len
    assert spec.model.tokens.embedding_dim == defaults.d_model
    assert len(spec.model.encoder.layers) == defaults.layers
    assert spec.model.encoder.layers[0].self_attn.num_heads == defaults.heads
    inputs, targets = spec.batch
    assert inputs.shape == targets.shape == (3, defaults.seq_len)
    assert inputs.dtype == torch.long and int(inputs.max()) < module["VOCAB_SIZE"]
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])     # next-token targets
    loss = spec.loss_fn(spec.model, spec.batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in spec.model.parameters())
    again = build_user_model(LM_MODEL, 3)
    torch.testing.assert_close(again.batch[0], inputs)       # seeded: the same on every rank


def test_models_build_with_a_fixed_batch():
    spec = build_model("small", 3, data_seed=1)
    loss = spec.loss_fn(spec.model, spec.batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    again = build_model("small", 3, data_seed=1)
    torch.testing.assert_close(spec.batch["inputs"], again.batch["inputs"])
    other = build_model("small", 3, data_seed=2)
    assert not torch.equal(spec.batch["inputs"], other.batch["inputs"])
    assert default_matrix_rank("resnet50") == 4 and default_matrix_rank("bert-base") == 32
    with pytest.raises(ValueError, match="model must be one of"):
        build_model("vgg", 2)


def test_every_registered_method_is_a_job():
    from benchmarks.jobs import JOBS
    from hvd_acp.methods import KEYS, REGISTRY
    assert parse_methods(",".join(KEYS)) == list(KEYS)
    for key, method in REGISTRY.items():
        job = JOBS[key]
        assert job.method == key and job.launcher == method.launcher
        assert job.label == method.title and report.name(key) == method.label


def test_rendezvous_slot_env_matches_horovods_assignment():
    from benchmarks.rendezvous import host_plan, slot_env
    for slot in host_plan(3):
        env = slot_env(slot.rank, 3)
        assert env["HOROVOD_HOSTNAME"] == slot.hostname
        assert int(env["HOROVOD_LOCAL_RANK"]) == slot.local_rank
        assert int(env["HOROVOD_CROSS_RANK"]) == slot.cross_rank
        assert int(env["HOROVOD_CROSS_SIZE"]) == slot.cross_size
        assert int(env["HOROVOD_LOCAL_SIZE"]) == slot.local_size


# ---------------------------------------------------------------- launching
def test_run_job_kills_a_hung_job(tmp_path):
    marker = tmp_path / "child.pid"
    code = (f"import os, subprocess, sys, time\n"
            f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(marker)!r}, 'w').write(str(child.pid))\n"
            f"time.sleep(60)\n")
    started = time.monotonic()
    with pytest.raises(JobError, match="timed out"):
        run_job([Command([sys.executable, "-c", code], dict(os.environ), "hang")],
                tmp_path / "log", timeout_s=3)
    assert time.monotonic() - started < 30
    child = int(marker.read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or \
        Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"


def test_run_job_stops_the_others_when_one_fails(tmp_path):
    commands = [Command([sys.executable, "-c", "import sys; sys.exit(3)"], dict(os.environ), "bad"),
                Command([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ),
                        "waiting")]
    started = time.monotonic()
    with pytest.raises(JobError, match="bad exited with status 3"):
        run_job(commands, tmp_path / "log", timeout_s=60)
    assert time.monotonic() - started < 30


def test_bandwidth_without_root_is_a_clear_error(monkeypatch, capsys):
    from benchmarks import __main__ as cli
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.main(["--model", "small", "--bandwidth", "100mbit", "--out", "unused"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_bad_arguments_exit_with_usage(capsys):
    from benchmarks import __main__ as cli
    with pytest.raises(SystemExit):
        cli.main(["--bandwidth", "fast"])
    assert "bandwidth must look like" in capsys.readouterr().err


def test_user_models_and_the_optimizer_parse():
    from benchmarks import __main__ as cli
    parser = cli.build_parser()
    args = parser.parse_args([])
    assert (args.model, args.optimizer) == ("resnet50", "sgd")
    args = parser.parse_args(["--model", LM_MODEL, "--optimizer", "adamw"])
    assert (args.model, args.optimizer) == (LM_MODEL, "adamw")
    # A module is imported by the workers only: its name is all that is checked here.
    assert parser.parse_args(["--model", "my_project.models:build"]).model == \
        "my_project.models:build"


@pytest.mark.parametrize("argv, message", [
    (["--model", "vgg"], "--model must be one of resnet50, bert-base, gpt2, small or "
                         "'package.module:function'"),
    (["--model", "examples/train_lm.py:"], "'path/to/file.py:function', got"),
    (["--model", "examples/no_such_file.py:build"], "no file"),
    (["--optimizer", "adam"], "invalid choice: 'adam'")])
def test_bad_model_or_optimizer_is_a_usage_error(capsys, argv, message):
    from benchmarks import __main__ as cli
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--out", "unused"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err


def test_worker_model_and_optimizer():
    from benchmarks.worker import worker_model
    from hvd_acp.plan.models import build_optimizer, model_file
    assert worker_model("small") == "small" and model_file("small") is None
    assert worker_model("pkg.mod:build") == "pkg.mod:build"
    assert model_file(LM_MODEL) == Path("examples/train_lm.py")
    assert worker_model(LM_MODEL) == f"{Path('examples/train_lm.py').resolve()}:benchmark_model"
    model = SmallNet()
    sgd = build_optimizer("sgd", model.parameters(), 0.01)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9
    assert type(build_optimizer("adamw", model.parameters(), 0.01)) is torch.optim.AdamW
    with pytest.raises(ValueError, match="optimizer must be one of"):
        build_optimizer("adam", model.parameters(), 0.01)


# ---------------------------------------------------------------- real runs
def _bench(out: Path, *args: str, timeout: float, rounds: int = 1) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "benchmarks", "--model", "small", "--np", "2",
           "--steps", "3", "--warmup", "2", "--rounds", str(rounds), "--no-progress",
           "--out", str(out), *args]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        pytest.fail(f"benchmark timed out after {timeout}s\n{output[-4000:]}")
    assert proc.returncode == 0, output[-6000:]
    return proc


def _check_outputs(out: Path, methods, bandwidth):
    results = json.loads((out / "results.json").read_text())
    for field in CONFIG_FIELDS:
        assert field in results["config"], field
    assert results["config"]["bandwidth_mbit"] == bandwidth
    for field in ("torch", "horovod", "hvd_acp"):
        assert results["config"]["versions"][field]
    assert sorted(results["methods"]) == sorted(methods)
    for method, entry in results["methods"].items():
        for field in METHOD_FIELDS:
            assert isinstance(entry[field], (int, float)), (method, field, entry.get(field))
        assert entry["step_s_p10"] <= entry["step_s_median"] <= entry["step_s_p90"]
        assert entry["bytes_sent_per_step"] > 0 and entry["allreduces_per_step"] >= 1
    assert results["compute_only"]["step_s_median"] > 0
    methods_entry = results["methods"]
    dense = methods_entry["ssgd"]["bytes_sent_per_step"]
    assert dense == sum(p.numel() * 4 for p in SmallNet().parameters())
    assert methods_entry["acp"]["bytes_sent_per_step"] < methods_entry["powersgd"][
        "bytes_sent_per_step"] < dense
    if "powersgd-ddp" in methods_entry:
        ddp = methods_entry["powersgd-ddp"]
        assert ddp["bytes_sent_per_step"] == ddp["bytes_sent_per_step_analytic"]
        assert ddp["bytes_sent_per_step"] == methods_entry["powersgd"]["bytes_sent_per_step"]
    if "acp-ddp" in methods_entry:
        # Same tensors compressed, same phases (P, Q, P over the timed steps).
        assert (methods_entry["acp-ddp"]["bytes_sent_per_step"]
                == methods_entry["acp"]["bytes_sent_per_step"])
    table = (out / "results.md").read_text()
    assert "speedup vs S-SGD" in table and "x floor" in table
    assert (out / "breakdown.png").stat().st_size > 0
    return results


@pytest.mark.horovod
@pytest.mark.timeout(150)
def test_smoke_run_writes_every_output(tmp_path):
    methods = ["ssgd", "powersgd", "acp", "powersgd-ddp", "acp-ddp"]
    _bench(tmp_path, "--methods", ",".join(methods), timeout=140)
    results = _check_outputs(tmp_path, methods, None)
    assert "localhost" in results["config"]["topology"]


@pytest.mark.horovod
@pytest.mark.timeout(200)
def test_smoke_run_of_a_user_model_with_adamw(tmp_path):
    # train_lm's transformer from its file (it imports its neighbour
    # examples/common.py), every job on AdamW, no --matrix-rank: each method
    # resolves hvd_acp's defaults for an adaptive optimizer.
    methods = ["acp", "diloco"]
    _bench(tmp_path, "--model", LM_MODEL, "--optimizer", "adamw", "--batch-size", "2",
           "--steps", "2", "--warmup", "1", "--methods", ",".join(methods), timeout=190)
    results = json.loads((tmp_path / "results.json").read_text())
    config = results["config"]
    assert (config["model"], config["optimizer"], config["batch_size"]) == (LM_MODEL, "adamw", 2)
    assert config["matrix_rank"] is None
    assert config["image_size"] is None and config["seq_len"] is None
    assert sorted(results["methods"]) == methods
    floor = results["compute_only"]
    assert floor["step_s_median"] > 0 and floor["optimizer"] == "AdamW"
    dense = floor["gradient_bytes"]
    acp, diloco = results["methods"]["acp"], results["methods"]["diloco"]
    for entry in (acp, diloco):
        assert entry["step_s_median"] > 0 and entry["optimizer"] == "AdamW"
        assert all(isinstance(loss, float) for loss in entry["last_loss"])
    assert acp["settings"]["matrix_rank"] == 0.3 and acp["settings"]["fp16_wire"] is True
    assert acp["settings"]["min_compression_rate"] == 1.0 and acp["settings"]["both_factors"]
    assert 0 < acp["bytes_sent_per_step"] < dense / 4       # 0.3 of the ranks, both, in fp16
    assert diloco["settings"]["inner_steps"] > 0
    assert 0 < diloco["bytes_sent_per_step_analytic"] < dense
    table = (tmp_path / "results.md").read_text()
    assert f"# {LM_MODEL}: 2 ranks, batch 2 per rank, optimizer AdamW" in table
    assert "ACP-SGD matrix_rank 0.3, both factors every step, fp16 on the wire" in table


@pytest.mark.horovod
@pytest.mark.timeout(480)
def test_rounds_run_carries_rounds_and_ratios(tmp_path):
    methods = ["ssgd", "acp"]
    # 6 jobs; about a minute on an idle machine, several on a shared one.
    _bench(tmp_path, "--methods", ",".join(methods), timeout=470, rounds=2)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["rounds"] == 2 and isinstance(results["rounds"], int)
    assert results["order"] == [["compute", "ssgd", "acp"], ["ssgd", "acp", "compute"]]
    for entry in list(results["methods"].values()) + [results["compute_only"]]:
        assert [r["round"] for r in entry["per_round"]] == [1, 2]
        assert entry["step_s_low"] <= entry["step_s_median"] <= entry["step_s_high"]
    keys = set()
    for ratio in results["ratios"]:
        assert set(ratio) >= {"a", "b", "what", "median", "low", "high", "verdict"}
        assert ratio["a"] in methods and ratio["b"] in methods + ["floor"]
        assert ratio["what"] in ("step", "compression", "bytes")
        assert ratio["verdict"] in ("faster", "slower", "same")
        assert ratio["low"] <= ratio["median"] <= ratio["high"]
        keys.add((ratio["a"], ratio["b"], ratio["what"]))
    assert {("acp", "ssgd", "step"), ("acp", "ssgd", "bytes"), ("ssgd", "floor", "step"),
            ("acp", "floor", "step")} <= keys
    assert (tmp_path / "logs" / "round2" / "acp.log").exists()
    assert (tmp_path / "raw" / "round1" / "compute.rank0.json").exists()
    assert "interval for the median" in (tmp_path / "results.md").read_text()
    assert _check(tmp_path / "results.json", tmp_path / "results.json") == 0


@pytest.mark.horovod
@pytest.mark.timeout(150)
@requires_emulation
def test_emulated_run_crosses_the_link_and_cleans_up(tmp_path):
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                                text=True).stdout.split())
    methods = ["ssgd", "powersgd", "acp"]
    _bench(tmp_path, "--methods", ",".join(methods), "--bandwidth", "1gbit", "--diagnostics",
           timeout=140)
    results = _check_outputs(tmp_path, methods, 1000.0)
    assert "namespace" in results["config"]["topology"]
    for method in methods:
        entry = results["methods"][method]
        # Every payload byte went out through the rate-limited interface.
        assert entry["link_tx_bytes_per_step"] >= entry["bytes_sent_per_step"]
    # The idle diagnostics time a tiny all-reduce on the job's own ranks (the
    # planner's latency calibration); the others have no collective to time.
    diags = results["diagnostics"]
    assert set(diags) == {"compute-concurrent", "hvd-idle", "ddp-idle", "acp-local"}
    for name in ("hvd-idle", "ddp-idle"):
        assert 0 < diags[name]["tiny_allreduce_s"] < 1.0, name
    assert "tiny_allreduce_s" not in diags["compute-concurrent"]
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                               text=True).stdout.split())
    # Names are hvdacp-<driver pid>-...: a live pid is another benchmark
    # running on this machine, not a leak of this run (whose driver has exited).
    leaked = {name for name in after - before if name.startswith("hvdacp-")
              and not os.path.exists(f"/proc/{name.split('-')[1]}")}
    assert not leaked


@requires_emulation
def test_leftovers_of_a_dead_run_are_removed():
    from benchmarks.netem import remove_leftovers
    dead = 4_000_000
    while Path(f"/proc/{dead}").exists():
        dead += 1
    name = f"hvdacp-{dead}-hub"
    live = f"hvdacp-{os.getpid()}-hub"
    subprocess.run(["ip", "netns", "add", name], check=True)
    subprocess.run(["ip", "netns", "add", live], check=True)
    try:
        assert name in remove_leftovers()
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert name not in names and live in names
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "netns", "del", live], capture_output=True)
