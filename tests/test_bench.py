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

from hvd_acp.bench import report
from hvd_acp.bench.launch import Command, JobError, run_job
from hvd_acp.bench.models import SmallNet, build_model, default_matrix_rank
from hvd_acp.bench.stats import (combine_ranks, parse_bandwidth, parse_methods, percentile,
                                 summarize_steps, tbf_burst_bytes)
from hvd_acp.bench.worker import link_tx_bytes, powersgd_ddp_bytes_per_step
from tests.hvdrun import requires_emulation

REPO = Path(__file__).resolve().parent.parent
METHOD_FIELDS = ("step_s_median", "step_s_p10", "step_s_p90", "samples_per_s",
                 "bytes_sent_per_step", "allreduces_per_step", "compression_s_per_step")
CONFIG_FIELDS = ("model", "np", "batch_size", "matrix_rank", "bandwidth_mbit", "topology",
                 "versions")


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


def test_rendezvous_slot_env_matches_horovods_assignment():
    from hvd_acp.bench.rendezvous import host_plan, slot_env
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
    from hvd_acp.bench import __main__ as cli
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.main(["--model", "small", "--bandwidth", "100mbit", "--out", "unused"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_bad_arguments_exit_with_usage(capsys):
    from hvd_acp.bench import __main__ as cli
    with pytest.raises(SystemExit):
        cli.main(["--bandwidth", "fast"])
    assert "bandwidth must look like" in capsys.readouterr().err


# ---------------------------------------------------------------- real runs
def _bench(out: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hvd_acp.bench", "--model", "small", "--np", "2",
           "--steps", "3", "--warmup", "2", "--no-progress", "--out", str(out), *args]
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
    table = (out / "results.md").read_text()
    assert "speedup vs S-SGD" in table and "x floor" in table
    assert (out / "breakdown.png").stat().st_size > 0
    return results


@pytest.mark.horovod
@pytest.mark.timeout(150)
def test_smoke_run_writes_every_output(tmp_path):
    methods = ["ssgd", "powersgd", "acp", "powersgd-ddp"]
    _bench(tmp_path, "--methods", ",".join(methods), timeout=140)
    results = _check_outputs(tmp_path, methods, None)
    assert "localhost" in results["config"]["topology"]


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
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                               text=True).stdout.split())
    # Names are hvdacp-<driver pid>-...: a live pid is another benchmark
    # running on this machine, not a leak of this run (whose driver has exited).
    leaked = {name for name in after - before if name.startswith("hvdacp-")
              and not os.path.exists(f"/proc/{name.split('-')[1]}")}
    assert not leaked


@requires_emulation
def test_leftovers_of_a_dead_run_are_removed():
    from hvd_acp.bench.netem import remove_leftovers
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
