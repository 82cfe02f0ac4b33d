"""``python -m benchmarks --count-ops``: operator calls per step from torch.profiler,
counted after the timed steps, reported over the floor's."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import report
from tests.hvdrun import run_with_timeout
from tests.test_bench import FIGURES, _bench, _results


def _worker(job: str, out: Path, *extra: str) -> dict:
    run_with_timeout([sys.executable, "-m", "benchmarks.worker", "--method", job,
                      "--model", "small", "--batch-size", "8", "--matrix-rank", "4",
                      "--steps", "2", "--warmup", "1", "--result-dir", str(out), *extra],
                     120, f"worker {job}")
    return json.loads((out / f"{job}.rank0.json").read_text())


def test_worker_counts_the_calls_a_method_adds_outside_the_timed_steps(tmp_path):
    floor = _worker("compute", tmp_path, "--count-ops")
    acp = _worker("acp-local", tmp_path, "--count-ops")
    assert len(floor["step_s"]) == len(acp["step_s"]) == 2
    # ACP-SGD's compression: per compressed matrix a few GEMMs, an
    # orthonormalization and the error feedback, on top of the plain step.
    assert 0 < floor["ops_per_step"] < acp["ops_per_step"]
    assert floor["ops_per_step"] == int(floor["ops_per_step"])
    # Kernels: a part of the calls (no views, no allocations), more with ACP-SGD.
    assert 0 < floor["kernels_per_step"] < floor["ops_per_step"]
    assert floor["kernels_per_step"] < acp["kernels_per_step"] < acp["ops_per_step"]
    assert "ops_per_step" not in _worker("compute", tmp_path)


def test_markdown_shows_the_calls_over_the_floor_only_when_counted():
    plain = report.markdown(_results(FIGURES))
    assert "operator calls" not in plain
    results = _results(FIGURES)
    results["compute_only"]["ops_per_step"] = 200.0
    for key, entry in results["methods"].items():
        entry["ops_per_step"] = 200.0 + len(key)
        entry["ops_over_floor_per_step"] = float(len(key))
    text = report.markdown(results)
    assert "operator calls/step over the floor's" in text
    row = next(line for line in text.splitlines() if line.startswith("| ACP-SGD (hvd_acp"))
    assert row.endswith("| 3 |")
    assert "| 0 (200 in all) |" in text


def test_kernels_are_the_calls_that_run_one_themselves():
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.worker import count_calls
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.mm(a, b.t())                       # t (a view) and mm
        a.view(-1)
        a.reshape(4, 16)
        torch.nn.functional.linear(a, b)         # linear -> t, matmul -> mm
        a.to(torch.float64)                      # to -> _to_copy -> empty_strided, copy_
    calls = count_calls(prof.events())
    names = [e.name for e in prof.events() if e.name.startswith("aten::")]
    assert calls["ops"] == len(names) > 10
    assert calls["kernels"] == 3                 # mm, mm, copy_
    assert names.count("aten::mm") == 2 and "aten::copy_" in names


def test_markdown_shows_the_kernels_among_the_calls_when_counted():
    results = _results(FIGURES)
    results["compute_only"].update(ops_per_step=200.0, kernels_per_step=50.0)
    for key, entry in results["methods"].items():
        entry.update(ops_per_step=200.0 + len(key), ops_over_floor_per_step=float(len(key)),
                     kernels_per_step=51.0, kernels_over_floor_per_step=1.0)
    text = report.markdown(results)
    assert "(kernels among them)" in text
    row = next(line for line in text.splitlines() if line.startswith("| ACP-SGD (hvd_acp"))
    assert row.endswith("| 3 (1) |")
    assert "| 0 (200 (50) in all) |" in text


@pytest.mark.horovod
@pytest.mark.timeout(200)
def test_benchmark_records_operator_calls_per_method(tmp_path):
    _bench(tmp_path, "--methods", "acp,ddp-fp16", "--count-ops", "--steps", "1",
           timeout=190)
    results = json.loads((tmp_path / "results.json").read_text())
    floor = results["compute_only"]["ops_per_step"]
    assert results["config"]["count_ops"] is True and floor > 0
    for key in ("acp", "ddp-fp16"):
        entry = results["methods"][key]
        assert entry["ops_over_floor_per_step"] == entry["ops_per_step"] - floor > 0, key
        assert (entry["kernels_over_floor_per_step"]
                == entry["kernels_per_step"] - results["compute_only"]["kernels_per_step"]
                > 0), key
    # ACP-SGD compresses; the fp16 hook only casts each bucket (and back, on
    # Gloo's thread, which the profile covers).
    assert (results["methods"]["acp"]["ops_over_floor_per_step"]
            > results["methods"]["ddp-fp16"]["ops_over_floor_per_step"])
    assert "operator calls/step over the floor's" in (tmp_path / "results.md").read_text()
