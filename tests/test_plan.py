"""The planner: cost model and timeline on cases computable by hand, the
profiler on a tiny model, a measured configuration predicted, the CLI."""
import dataclasses
import json
import math
import statistics
import time

import pytest
import torch
from torch import nn

from hvd_acp.plan import Network, Settings, allreduce_s, predict_methods, ring_allreduce_s
from hvd_acp.plan.__main__ import main
from hvd_acp.plan.timeline import HorovodThread
from hvd_acp.plan.validate import format_validation, validate
from tests.hvdrun import requires_emulation

MB = 1e6


def net(bytes_per_s=1e6, **kw):
    """A network whose payload rate is ``bytes_per_s`` (wire efficiency 1)."""
    return Network(bandwidth_mbit=bytes_per_s * 8 / 1e6, wire_efficiency=1.0, **kw)


def synthetic(params, forward=1.0, backward=2.0, optimizer=0.5, buckets=None, ddp=None,
              orth=0.0):
    """A profile of hand-made parameters (dicts with name, bytes, ready_s...)."""
    full = []
    for p in params:
        q = {"compressed": False, "ddp_compressed": False, "acp_p_s": 0.0, "acp_q_s": 0.0,
             "psgd_p_s": 0.0, "psgd_q_s": 0.0, "reconstruct_s": 0.0, "ddp_p_bytes": 0,
             "ddp_q_bytes": 0}
        q.update(p)
        full.append(q)
    one = [{"bytes": p["bytes"], "members": [p["name"]]} for p in full]
    buckets = buckets or {"acp_p": one, "acp_q": one, "psgd_p": one, "psgd_q": []}
    return {"format": 1, "matrix_rank": 4, "forward_s": forward, "backward_s": backward,
            "optimizer_s": optimizer, "params": full, "buckets": buckets,
            "ddp_buckets": ddp or [[p["name"]] for p in sorted(full, key=lambda p: -p["ready_s"])],
            "orthonormalize_s": {"acp_p": orth, "acp_q": orth, "psgd": orth},
            "host_s_per_byte": 0.0}


# ------------------------------------------------------------------ cost model
def test_ring_allreduce_by_hand():
    # 2 ranks: 2 alpha + n / B.
    assert ring_allreduce_s(1e6, 2, 1e6, 1e-3) == pytest.approx(1.002)
    # 4 ranks: 6 alpha + 1.5 n / B, plus the host's cost on the 1.5 n bytes moved.
    assert ring_allreduce_s(1e6, 4, 1e6, 1e-3, host_s_per_byte=1e-7) == pytest.approx(
        6e-3 + 1.5 + 1.5e6 * 1e-7)
    assert ring_allreduce_s(1e6, 1, 1e6, 1e-3) == 0.0
    assert ring_allreduce_s(0, 8, 1e6, 1e-3) == 0.0


def test_latency_bound_tiny_messages():
    # 8 bytes over 64 ranks at 10 Gbit/s with 20 us per step: 126 steps of latency.
    t = allreduce_s(8, 64, Network(10000, latency_s=20e-6))
    assert t == pytest.approx(126 * 20e-6, rel=1e-3)
    # The same bytes as one fused message or 100 tiny ones: latency dominates.
    thread = HorovodThread(0.0, 0, lambda b: allreduce_s(b, 64, Network(10000, latency_s=20e-6)))
    finish = thread.submit([(0.0, 8)] * 100)
    assert thread.collectives == 100
    assert max(finish) == pytest.approx(100 * 126 * 20e-6, rel=1e-3)


def test_hierarchical_allreduce_by_hand():
    n = Network(bandwidth_mbit=80, wire_efficiency=1.0, gpus_per_node=4,
                intra_bandwidth_mbit=800)
    # intra: ring over 4 at 100 MB/s (1.5 n), inter: ring over 2 nodes at 10 MB/s (n).
    assert allreduce_s(1e6, 8, n) == pytest.approx(1.5e6 / 1e8 + 1e6 / 1e7)
    assert allreduce_s(1e6, 4, n) == pytest.approx(1.5e6 / 1e8)
    with pytest.raises(ValueError, match="multiple of gpus_per_node"):
        allreduce_s(1e6, 6, n)
    with pytest.raises(ValueError, match="intra_bandwidth_mbit"):
        Network(bandwidth_mbit=80, gpus_per_node=4)


def test_network_stack_is_per_byte_between_nodes_and_not_scaled_with_compute():
    # 4 ranks: 1.5 n moved, each byte paying the host's work and the stack's.
    n = net(host_s_per_byte=1e-7, stack_s_per_byte=2e-7)
    assert allreduce_s(1e6, 4, n) == pytest.approx(1.5 + 1.5e6 * 3e-7)
    # A compute scale multiplies the host's work only.
    assert allreduce_s(1e6, 4, n.scaled_host(3.0)) == pytest.approx(1.5 + 1.5e6 * 5e-7)
    assert allreduce_s(1e6, 4, n.wire_only()) == pytest.approx(1.5)
    # Inside a node (NVLink) there is no network stack; across nodes there is.
    h = Network(bandwidth_mbit=80, wire_efficiency=1.0, gpus_per_node=4,
                intra_bandwidth_mbit=800, stack_s_per_byte=1e-7)
    assert allreduce_s(1e6, 4, h) == pytest.approx(1.5e6 / 1e8)
    assert allreduce_s(1e6, 8, h) == pytest.approx(1.5e6 / 1e8 + 1e6 / 1e7 + 1e6 * 1e-7)
    with pytest.raises(ValueError, match="stack_s_per_byte"):
        Network(bandwidth_mbit=80, stack_s_per_byte=-1.0)
    # Serial host work: the stack's share is added to the step like the host's.
    prof = synthetic([{"name": "w", "bytes": 1e6, "ready_s": 0.0}])
    serial = predict_methods(prof, Settings(np=2, network=net(stack_s_per_byte=1e-6),
                                            cycle_time_s=0.0, host_serial=True,
                                            compute_scale=1.0), ["ssgd"])
    assert serial["ssgd"].step_s == pytest.approx(4.5)


@pytest.mark.timeout(120)
@requires_emulation
def test_calibrate_link_measures_the_emulated_network(tmp_path, capsys):
    # The benchmark of the checkout measures it; the planner reads the file.
    from benchmarks.__main__ import main as bench_main
    from hvd_acp.plan.link import read_link
    out = tmp_path / "link.json"
    # 64 MB, median of 3: about 70 ms of stack CPU time against the start-up
    # of a sender's interpreter it subtracts (16 MB once came out at 0 in CI).
    assert bench_main(["calibrate-link", "--rates", "1gbit", "--megabytes", "64",
                       "--repeats", "3", "--out", str(out)]) == 0
    link = read_link(out)
    (row,) = link["per_rate"]
    # Moving bytes costs CPU time, and the token bucket held the rate to 1 Gbit/s.
    assert row["rate_mbit"] == 1000.0 and row["stack_s_per_byte"] > 0
    assert row["achieved_mbit"][0] < 1000.0 * 1.05
    assert "ns per byte" in capsys.readouterr().out
    assert bench_main(["calibrate-link", "--rates", "fast", "--out", str(out)]) == 2
    assert "bandwidth must" in capsys.readouterr().err


def test_the_tcp_stack_a_cpu_profile_measures_is_charged_unless_replaced():
    """A CPU profile's loopback TCP cost is charged on every all-reduce by
    default; --no-tcp-stack removes it and a link calibration replaces it."""
    from hvd_acp.plan.link import loopback_tcp_s_per_byte
    from hvd_acp.plan.report import predict_grid, stack_cost
    measured = loopback_tcp_s_per_byte(nbytes=32 << 20)
    assert 0 < measured < 1e-7          # a kernel copy costs well under 100 ns a byte
    prof = synthetic([{"name": "w", "bytes": 4_000_000, "ready_s": 2.0}])   # at backward's end
    base = predict_grid(prof, [2], [80.0], [0.0])[0]["methods"]["ssgd"]["step_s"]
    prof["tcp_stack_s_per_byte"] = 1e-7
    charged = predict_grid(prof, [2], [80.0], [0.0])[0]["methods"]["ssgd"]["step_s"]
    # 2 ranks: each moves 2 (N - 1) / N = 1 times the 4 MB, at 1e-7 s a byte.
    assert charged - base == pytest.approx(0.4, rel=1e-6)
    assert predict_grid(prof, [2], [80.0], [0.0], {"no_tcp_stack": True})[0][
        "methods"]["ssgd"]["step_s"] == pytest.approx(base)
    link = {"stack_s_per_byte": 2e-7}
    assert stack_cost(prof, link, 80.0, {"link_source": "l.json"}) == (2e-7, "`l.json`")
    assert stack_cost(prof, None, 80.0, {})[0] == 1e-7
    assert stack_cost(prof, None, 80.0, {"no_tcp_stack": True}) == (0.0, None)


def test_link_calibration_file_and_interpolation(tmp_path):
    from hvd_acp.plan.link import read_link, stack_s_per_byte
    link = {"kind": "hvd-acp link calibration", "format": 1, "stack_s_per_byte": 2e-9,
            "per_rate": [{"rate_mbit": 10000.0, "stack_s_per_byte": 3e-9},
                         {"rate_mbit": 1000.0, "stack_s_per_byte": 1e-9}]}
    # Log-linear between the measured rates, the nearest value outside them.
    assert stack_s_per_byte(link, 1000.0) == pytest.approx(1e-9)
    assert stack_s_per_byte(link, 10 ** 3.5) == pytest.approx(2e-9)
    assert stack_s_per_byte(link, 100.0) == pytest.approx(1e-9)
    assert stack_s_per_byte(link, 1e5) == pytest.approx(3e-9)
    assert stack_s_per_byte({"stack_s_per_byte": 4e-9}, 5.0) == 4e-9
    good = tmp_path / "link.json"
    good.write_text(json.dumps(link))
    assert read_link(good)["stack_s_per_byte"] == 2e-9
    with pytest.raises(FileNotFoundError, match="not found"):
        read_link(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "hvd-acp link calibration", "stack_s_per_byte": -1}))
    with pytest.raises(ValueError, match="not a link calibration"):
        read_link(bad)
    bad.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        read_link(bad)


def test_horovod_cycle_and_fusion():
    thread = HorovodThread(0.01, 64, lambda b: b * 1e-3)
    # Ready at 3 ms: waits for the tick at 10 ms; two tensors of one tick fuse.
    assert thread.submit([(0.003, 10), (0.004, 20)]) == pytest.approx([0.04, 0.04])
    assert thread.collectives == 1
    # Over the fusion threshold: two collectives, one after the other.
    thread = HorovodThread(0.01, 64, lambda b: b * 1e-3)
    assert thread.submit([(0.0, 40), (0.0, 40)]) == pytest.approx([0.04, 0.08])


def test_horovod_negotiation_starts_every_cycle_that_has_work():
    thread = HorovodThread(0.01, 64, lambda b: b * 1e-3, negotiation_s=0.002)
    # Tick at 10 ms, 2 ms of negotiation, then 30 ms on the wire.
    assert thread.submit([(0.003, 10), (0.004, 20)]) == pytest.approx([0.042, 0.042])
    # A second cycle with work pays it again.
    thread = HorovodThread(0.01, 64, lambda b: b * 1e-3, negotiation_s=0.002)
    assert thread.submit([(0.0, 1), (0.02, 1)]) == pytest.approx([0.003, 0.023])


def test_latency_calibrated_from_the_runs_tiny_allreduce_probes():
    from hvd_acp.plan.timeline import horovod_tiny_allreduce_s
    from hvd_acp.plan.validate import calibration, latency
    prof = synthetic([{"name": "w", "bytes": 1e6, "ready_s": 2.0}])
    bench = _bench({"acp": 4.0}, diagnostics={
        "hvd-idle": {"step_s_median": 3.5, "tiny_allreduce_s": 0.040},
        "ddp-idle": {"step_s_median": 3.5, "tiny_allreduce_s": 0.012},
        "compute-concurrent": {"step_s_median": 7.0}})
    bench["config"]["np"] = 4
    cal = calibration(bench, prof)
    # The Gloo floor is the DDP hook's calibration when the run has it.
    assert cal["ddp_compute_scale"] == pytest.approx(1.0)
    base = Settings(np=4, network=net(), cycle_time_s=0.01)
    tuned = latency(cal, base)
    # 12 ms for 6 ring steps; Horovod's probe reproduced exactly by the timeline.
    assert tuned.network.latency_s == pytest.approx(0.002)
    assert tuned.horovod_negotiation_s > 0
    assert horovod_tiny_allreduce_s(tuned) == pytest.approx(0.040, rel=1e-3)
    # A probe faster than the cycle's wait alone: no negative negotiation.
    cal["horovod_tiny_allreduce_s"] = 1e-4
    assert latency(cal, base).horovod_negotiation_s == 0.0
    # Without probes (older runs): no latency, no negotiation.
    none = latency(calibration(_bench({"acp": 4.0}), prof), base)
    assert none.network.latency_s == 0.0 and none.horovod_negotiation_s == 0.0
    result = validate(bench, prof)
    assert result["latency_s"] == pytest.approx(0.002)
    assert "tiny all-reduce probes" in format_validation(result)


# ------------------------------------------------------------------ timeline
def test_one_bucket_acp_by_hand():
    prof = synthetic([{"name": "w", "bytes": 1e6, "ready_s": 2.0, "compressed": True,
                       "acp_p_s": 0.1, "acp_q_s": 0.1, "reconstruct_s": 0.05}])
    pred = predict_methods(prof, Settings(np=2, network=net(), cycle_time_s=0.0), ["acp"])["acp"]
    # forward 1 + backward 2 + hook 0.1, 1 s on the wire, reconstruct 0.05, update 0.5.
    assert pred.step_s == pytest.approx(4.65)
    assert pred.compute_s == pytest.approx(3.5)
    assert pred.compression_s == pytest.approx(0.15)
    assert pred.exposed_comm_s == pytest.approx(1.0)
    assert pred.bytes_per_step == 1e6


def test_two_buckets_overlap_backward():
    params = [{"name": "first", "bytes": 1e6, "ready_s": 2.0},   # input layer: last in backward
              {"name": "last", "bytes": 1e6, "ready_s": 0.5}]
    prof = synthetic(params)
    s = Settings(np=2, network=net(), cycle_time_s=0.0, horovod_fusion_bytes=1)
    # "last" goes at 1.5 and is done at 2.5, under backward; "first" at 3.0, done at 4.0.
    assert predict_methods(prof, s, ["ssgd"])["ssgd"].step_s == pytest.approx(4.5)
    # At half the rate the first all-reduce (1.5 -> 3.5) delays the second (3.5 -> 5.5).
    s = Settings(np=2, network=net(5e5), cycle_time_s=0.0, horovod_fusion_bytes=1)
    pred = predict_methods(prof, s, ["ssgd"])["ssgd"]
    assert pred.step_s == pytest.approx(6.0)
    assert pred.allreduces_per_step == 2
    assert pred.link_busy_s == pytest.approx(4.0)


def test_a_token_bucket_lets_what_it_saved_up_cross_at_once():
    # S-SGD on two ranks: one 1 MB gradient ready when backward starts (1 s
    # on the wire at 1 MB/s, under backward's 2 s); the step is 3.5 s.
    prof = synthetic([{"name": "w", "bytes": 1e6, "ready_s": 0.0}])
    plain = Settings(np=2, network=net(), cycle_time_s=0.0)
    assert predict_methods(prof, plain, ["ssgd"])["ssgd"].link_busy_s == pytest.approx(1.0)
    bucket = dataclasses.replace(plain, network=net(burst_bytes=3e5))
    pred = predict_methods(prof, bucket, ["ssgd"])["ssgd"]
    # The link idles 2.5 s a step (more than the 0.3 s the bucket needs to
    # fill): 0.3 MB cross at once, the other 0.7 MB at the rate.
    assert pred.link_busy_s == pytest.approx(0.7)
    assert pred.link_tail_s == pytest.approx(3.5 - 1.0 - 0.7)
    # Two gradients back to back: the bucket saved up before the first only.
    two = synthetic([{"name": "a", "bytes": 1e6, "ready_s": 0.0},
                     {"name": "b", "bytes": 1e6, "ready_s": 0.0}])
    s = dataclasses.replace(bucket, horovod_fusion_bytes=1)
    assert predict_methods(two, s, ["ssgd"])["ssgd"].link_busy_s == pytest.approx(1.7)
    # A gradient ready at the end of a 0.5 s backward, 1.5 s on the wire at
    # 2/3 MB/s, then a 0.5 s update: steady, the link idles 1 s between
    # collectives (the update, then backward) and saves 2/3 MB of its 1 MB
    # bucket; the rest, 1/3 MB, takes 0.5 s.
    late = synthetic([{"name": "w", "bytes": 1e6, "ready_s": 0.5}], forward=0.0,
                     backward=0.5, optimizer=0.5)
    slow = Settings(np=2, network=net(2e6 / 3, burst_bytes=1e6), cycle_time_s=0.0)
    pred = predict_methods(late, slow, ["ssgd"])["ssgd"]
    assert pred.link_busy_s == pytest.approx(0.5)
    assert pred.step_s == pytest.approx(1.5)
    assert pred.link_tail_s == pytest.approx(0.5)
    plain_slow = dataclasses.replace(slow, network=net(2e6 / 3))
    assert predict_methods(late, plain_slow, ["ssgd"])["ssgd"].step_s == pytest.approx(2.5)
    with pytest.raises(ValueError, match="burst_bytes"):
        net(burst_bytes=-1)


def test_plan_takes_the_emulated_links_token_bucket(tmp_path, monkeypatch):
    """``--burst-bytes`` reaches the prediction and the plan says so;
    scripts/plan_vs_bench.py reads the burst from a run's topology."""
    import importlib
    from tests.hvdrun import REPO
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    run = REPO / "bench-results/planval_adamw/train_lm_b16_20mbit"
    cfg = json.loads((run / "results.json").read_text())["config"]
    burst = importlib.import_module("plan_vs_bench").link_burst_bytes(cfg)
    assert burst == 131072 and f"burst {burst} B" in cfg["topology"]
    profile = REPO / "bench-results/planval_adamw/timed_2s/profile_train_lm_b16_adamw.json"
    plans = {}
    for name, extra in (("plain", []), ("bucket", ["--burst-bytes", str(burst)])):
        assert main(["predict", "--profile", str(profile), "--np", "2", "--bandwidth", "20mbit",
                     "--no-plot", "--out", str(tmp_path / name), *extra]) == 0
        plans[name] = json.loads((tmp_path / name / "plan.json").read_text())
    assert plans["plain"]["config"]["burst_bytes"] == 0
    assert plans["bucket"]["config"]["burst_bytes"] == burst
    assert "token bucket of 131072 B" in (tmp_path / "bucket" / "plan.md").read_text()
    plain, bucket = (plans[k]["predictions"][0]["methods"] for k in ("plain", "bucket"))
    # Power-SGD's 0.33 MB a step: the bucket's 0.13 MB is a large share of it.
    assert bucket["powersgd"]["step_s"] < 0.8 * plain["powersgd"]["step_s"]
    assert bucket["ssgd"]["step_s"] < plain["ssgd"]["step_s"]


def test_host_work_serial_or_beside():
    prof = synthetic([{"name": "w", "bytes": 1e6, "ready_s": 0.0}])
    host = net(host_s_per_byte=1e-6)
    # Beside computation: the 1 s of host work lengthens the all-reduce (1 + 1 s),
    # hidden under backward (2 s) but for what runs past it.
    beside = predict_methods(prof, Settings(np=2, network=host, cycle_time_s=0.0), ["ssgd"])
    assert beside["ssgd"].step_s == pytest.approx(3.5)
    # Serial: the wire's 1 s hides under backward, the host's 1 s adds to the step.
    serial = predict_methods(prof, Settings(np=2, network=host, cycle_time_s=0.0,
                                            host_serial=True), ["ssgd"])
    assert serial["ssgd"].step_s == pytest.approx(4.5)


def test_powersgd_dependent_round():
    params = [{"name": "w", "bytes": 4e6, "ready_s": 2.0, "compressed": True,
               "psgd_p_s": 0.1, "psgd_q_s": 0.2, "reconstruct_s": 0.05}]
    buckets = {"acp_p": [], "acp_q": [], "psgd_p": [{"bytes": 1e6, "members": ["w"]}],
               "psgd_q": [{"bytes": 2e6, "members": ["w"]}]}
    prof = synthetic(params, buckets=buckets, orth=0.15)
    pred = predict_methods(prof, Settings(np=2, network=net(), cycle_time_s=0.0),
                           ["powersgd"])["powersgd"]
    # 1 + 2 + 0.1 (P), 1 s on the wire, 0.15 + 0.2 (orth, Q), 2 s on the wire, 0.05, 0.5.
    assert pred.step_s == pytest.approx(3.1 + 1 + 0.35 + 2 + 0.05 + 0.5)
    assert pred.bytes_per_step == 3e6
    assert pred.compression_s == pytest.approx(0.5)


def test_powersgd_pays_the_step_ahead_shift_of_what_it_compresses():
    """Power-SGD runs step-ahead error feedback as ACP-SGD does: the shift of
    each matrix it compresses before the forward pass (``step_ahead_s``)."""
    params = [{"name": "w", "bytes": 4e6, "ready_s": 2.0, "compressed": True,
               "psgd_p_s": 0.1, "psgd_q_s": 0.2, "reconstruct_s": 0.05, "step_ahead_s": 0.3},
              {"name": "v", "bytes": 4e6, "ready_s": 2.0, "compressed": True,
               "psgd_compressed": False, "step_ahead_s": 0.7}]
    buckets = {"acp_p": [], "acp_q": [], "psgd_p": [{"bytes": 1e6, "members": ["w"]}],
               "psgd_q": [{"bytes": 2e6, "members": ["w"]}]}
    prof = synthetic(params, buckets=buckets, orth=0.15)
    settings = Settings(np=2, network=net(), cycle_time_s=0.0)
    pred = predict_methods(prof, settings, ["powersgd"])["powersgd"]
    # As test_powersgd_dependent_round, and w's shift (v is not compressed by Power-SGD).
    assert pred.step_s == pytest.approx(0.3 + 3.1 + 1 + 0.35 + 2 + 0.05 + 0.5)
    assert pred.compression_s == pytest.approx(0.3 + 0.5)


def test_the_ddp_hooks_compression_keeps_the_profiles_compute_scale():
    """Without Horovod's thread the DDP ranks compute faster
    (``ddp_compute_scale``); the hook's compression is priced as the
    profile timed it (``compute_scale``)."""
    params = [{"name": "a", "bytes": 4e6, "ready_s": 0.5, "ddp_compressed": True,
               "compressed": True, "acp_p_s": 0.1, "acp_q_s": 0.2, "reconstruct_s": 0.05,
               "step_ahead_s": 0.02, "ddp_p_bytes": 1e6, "ddp_q_bytes": 2e6}]
    prof = synthetic(params, backward=1.0, optimizer=0.0, ddp=[["a"]])
    same = predict_methods(prof, Settings(np=2, network=net()), ["acp-ddp"])["acp-ddp"]
    faster = predict_methods(prof, Settings(np=2, network=net(), ddp_compute_scale=0.5),
                             ["acp-ddp"])["acp-ddp"]
    assert faster.compression_s == pytest.approx(same.compression_s)
    assert faster.compute_s == pytest.approx(same.compute_s / 2)


def test_a_profile_of_an_optimizer_it_cannot_build_again_skips_the_real_hook():
    """The real hook runs on a copy with a fresh optimizer of the user's
    class; where that class takes more than (params, lr) the profile is
    still made, without ``ddp_hook_compression_s``."""
    from hvd_acp.plan import profile_model

    class Scaled(torch.optim.AdamW):
        def __init__(self, params, scale, lr=1e-3):
            super().__init__(params, lr=lr * scale)
    torch.manual_seed(0)
    model = Tiny()
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    prof = profile_model(model, batch, _tiny_loss, optimizer=Scaled(model.parameters(), 2.0),
                         steps=1, repeats=1)
    assert prof["optimizer"] == "Scaled" and "ddp_hook_compression_s" not in prof
    assert predict_methods(prof, Settings(np=2, network=net()), ["acp-ddp"])["acp-ddp"].step_s > 0


def test_the_ddp_hooks_kernels_add_up_to_its_measured_compression():
    """``ddp_hook_compression_s`` (the hook run for real) scales the hook's
    kernels so that they add up to it; the step-ahead shift, which the
    optimizer runs outside the hook, keeps its own time."""
    params = [{"name": "a", "bytes": 4e6, "ready_s": 0.5, "ddp_compressed": True,
               "compressed": True, "acp_p_s": 0.1, "acp_q_s": 0.2, "reconstruct_s": 0.05,
               "step_ahead_s": 0.02, "ddp_p_bytes": 1e6, "ddp_q_bytes": 2e6}]
    prof = synthetic(params, backward=1.0, optimizer=0.0, ddp=[["a"]])
    settings = Settings(np=2, network=net())
    plain = predict_methods(prof, settings, ["acp-ddp"])["acp-ddp"]
    hook = plain.compression_s - 0.02
    measured = dict(prof, ddp_hook_compression_s=2 * hook)
    scaled = predict_methods(measured, settings, ["acp-ddp"])["acp-ddp"]
    assert scaled.compression_s == pytest.approx(0.02 + 2 * hook)
    assert scaled.step_s > plain.step_s


def test_powersgd_ddp_chain_blocks_backward():
    params = [{"name": "a", "bytes": 4e6, "ready_s": 0.5, "ddp_compressed": True,
               "psgd_p_s": 0.1, "psgd_q_s": 0.1, "ddp_p_bytes": 1e6, "ddp_q_bytes": 1e6},
              {"name": "b", "bytes": 1e6, "ready_s": 1.0}]
    prof = synthetic(params, backward=1.0, optimizer=0.0, ddp=[["a"], ["b"]])
    pred = predict_methods(prof, Settings(np=2, network=net()),
                           ["powersgd-ddp"])["powersgd-ddp"]
    # a: ready 1.5, P 0.1 -> 1.6, P on the wire -> 2.6, Q 0.1 -> 2.7, Q wire -> 3.7.
    # b: ready at 1.6 + 0.5 = 2.1 (backward shifted by a's P), its hook waits for a's
    # chain (3.7), then its 1 MB -> 4.7.
    assert pred.step_s == pytest.approx(4.7)
    assert pred.bytes_per_step == 3e6


def test_acp_ddp_one_allreduce_per_bucket_overlapping_backward():
    params = [{"name": "a", "bytes": 4e6, "ready_s": 0.5, "ddp_compressed": True,
               "acp_p_s": 0.1, "acp_q_s": 0.2, "reconstruct_s": 0.05,
               "ddp_p_bytes": 1e6, "ddp_q_bytes": 2e6},
              {"name": "b", "bytes": 1e6, "ready_s": 1.0}]
    prof = synthetic(params, backward=1.0, optimizer=0.0, ddp=[["a"], ["b"]])
    pred = predict_methods(prof, Settings(np=2, network=net()), ["acp-ddp"])["acp-ddp"]
    # P step: a ready at 1.5, hook 0.1, its 1 MB on the wire 1.6 -> 2.6, rebuilt 2.65;
    # b ready at 2.0 + 0.1 (backward delayed by a's hook), on the wire after a: 2.6 -> 3.6.
    # Q step: a's hook 0.2, 2 MB 1.7 -> 3.7, rebuilt 3.75; b 3.7 -> 4.7. Mean 4.15.
    assert pred.step_s == pytest.approx((3.6 + 4.7) / 2)
    assert pred.bytes_per_step == pytest.approx(((1e6 + 1e6) + (2e6 + 1e6)) / 2)
    assert pred.allreduces_per_step == 2
    assert pred.compression_s == pytest.approx((0.15 + 0.25) / 2)
    # The hook is not serialized behind a chain as powerSGD_hook's is: faster here.
    assert pred.step_s < predict_methods(prof, Settings(np=2, network=net()),
                                         ["powersgd-ddp"])["powersgd-ddp"].step_s


def test_the_completing_factors_residual_comes_after_the_launch():
    """Only the residual of the buffer's last member to arrive waits for the
    launch (hvd_acp.reducer: defer=rnd.completes(b)); the others are
    computed right after their projection."""
    def prof(residual):
        params = [{"name": name, "bytes": 1e6, "ready_s": ready, "compressed": True,
                   "acp_p_s": 0.1, "acp_q_s": 0.1, "acp_p_residual_s": residual,
                   "acp_q_residual_s": residual, "reconstruct_s": 0.05}
                  for name, ready in (("first", 2.0), ("last", 1.0))]
        one = [{"bytes": 1e6, "members": ["last", "first"]}]
        return synthetic(params, buckets={"acp_p": one, "acp_q": one, "psgd_p": one,
                                          "psgd_q": []})
    settings = Settings(np=2, network=net(), cycle_time_s=0.0)
    # "first" (its gradient last of backward) completes the buffer at
    # 1 + 2 + 0.1 + 0.1 = 3.2, launched before its residual (0.04): 3.16 -> 4.16
    # on the wire, two reconstructions 0.1, the update 0.5. Deferring both
    # residuals would give 4.72, deferring none 4.80.
    assert predict_methods(prof(0.04), settings, ["acp"])["acp"].step_s == pytest.approx(4.76)
    assert predict_methods(prof(0.0), settings, ["acp"])["acp"].step_s == pytest.approx(4.80)


def test_the_ddp_hook_launches_before_its_last_compressed_residual():
    params = [{"name": name, "bytes": 4e6, "ready_s": ready, "ddp_compressed": True,
               "compressed": True, "acp_p_s": 0.1, "acp_q_s": 0.1, "acp_p_residual_s": 0.04,
               "acp_q_residual_s": 0.04, "reconstruct_s": 0.05,
               "ddp_p_bytes": 5e5, "ddp_q_bytes": 5e5}
              for name, ready in (("a", 0.5), ("b", 1.0))]
    prof = synthetic(params, backward=1.0, optimizer=0.0, ddp=[["a", "b"]])
    pred = predict_methods(prof, Settings(np=2, network=net()), ["acp-ddp"])["acp-ddp"]
    # The bucket is ready at 2.0; the hook compresses both (0.2) and launches
    # before b's residual: 2.16 -> 3.16 on the wire, rebuilt 3.26 (both phases).
    assert pred.step_s == pytest.approx(3.26)


def test_a_buffer_half_full_goes_before_a_tensor_that_fills_one_alone():
    """The fusion rule of hvd_acp.fusion.plan_buckets, seen by the timeline
    through a profile's plans redone from its shapes (current_plans)."""
    from hvd_acp.plan.replan import current_plans
    params = [{"name": name, "shape": [numel], "dtype": "float32", "numel": numel,
               "bytes": 4 * numel, "ready_s": ready, "n": numel, "m": 1, "r": 0}
              for name, numel, ready in (("big", 250, 2.0), ("b", 100, 1.0), ("a", 100, 0.5))]
    merged = [{"bytes": 1800, "members": ["a", "b", "big"]}]
    old = synthetic(params, buckets={"acp_p": merged, "acp_q": merged, "psgd_p": merged,
                                     "psgd_q": []})
    old["fusion_threshold_bytes"] = 1000
    new = current_plans(old)
    assert [b["members"] for b in new["buckets"]["acp_p"]] == [["a", "b"], ["big"]]
    assert old["buckets"]["acp_p"] == merged            # the profile read is left alone
    settings = Settings(np=2, network=net(1000.0), cycle_time_s=0.0)
    # a and b (800 B) leave at 2.0 and arrive at 2.8, under backward; big's
    # 1000 B go at 3.0 and arrive at 4.0; then the update. One buffer: 4.8 + 0.5.
    assert predict_methods(new, settings, ["acp"])["acp"].step_s == pytest.approx(4.5)
    assert predict_methods(old, settings, ["acp"])["acp"].step_s == pytest.approx(5.3)


def test_ddp_buckets_are_the_ones_ddp_hands_the_hook():
    """DDP rebuilds its buckets in the order the gradients arrived; a model
    whose layers are registered in another order than they run shows it."""
    import torch.distributed as dist
    from hvd_acp.plan import profile_model

    class Shuffled(nn.Module):
        def __init__(self):
            super().__init__()
            self.late = nn.Linear(512, 1024)      # registered first, runs second
            self.early = nn.Linear(256, 512)
            self.head = nn.Linear(1024, 300)

        def forward(self, x):
            return self.head(torch.relu(self.late(torch.relu(self.early(x)))))

    torch.manual_seed(0)
    model = Shuffled()
    batch = (torch.randn(8, 256), torch.randint(0, 300, (8,)))
    prof = profile_model(model, batch, _tiny_loss, matrix_rank=4, steps=1, repeats=1)
    names = {p: n for n, p in model.named_parameters()}
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(model)
        seen = {}

        def hook(_state, bucket):
            seen[bucket.index()] = [names[p] for p in bucket.parameters()]
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        ddp.register_comm_hook(None, hook)
        for _ in range(3):
            seen.clear()
            _tiny_loss(ddp, batch).backward()
    finally:
        dist.destroy_process_group()
    assert [seen[i] for i in sorted(seen)] == prof["ddp_buckets"]
    # The order of registration would put early's tensors first in the second bucket.
    assert prof["ddp_buckets"][1][:2] == ["late.bias", "late.weight"]


def test_settings_reject_bad_values():
    with pytest.raises(ValueError, match="np must be a positive int"):
        Settings(np=0, network=net())
    with pytest.raises(ValueError, match="bandwidth_mbit"):
        Network(bandwidth_mbit=0)
    with pytest.raises(ValueError, match="methods must be among"):
        predict_methods(synthetic([{"name": "w", "bytes": 1, "ready_s": 0}]),
                        Settings(np=2, network=net()), ["sgd"])


# ------------------------------------------------------------------ profile
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(64, 128)
        self.last = nn.Linear(128, 10)

    def forward(self, x):
        return self.last(torch.relu(self.first(x)))


def _tiny_loss(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_profile_model_under_adamw_times_the_adaptive_defaults(monkeypatch):
    """Under AdamW the profile times what the library runs: ACP-SGD's both
    factors at 0.3 of each matrix, fp16 on the wire, Power-SGD at its
    own share (0.25), each planned as its front end plans its buffers, and
    the step-ahead shift with Adam's divisor."""
    import math as _math
    from hvd_acp.compression import Phase
    from hvd_acp.fusion import make_layouts, plan_buckets
    from hvd_acp.plan import profile_model
    import hvd_acp.plan.profile as profile_module
    divisors = []

    def counted(error, *args, **kw):
        divisors.append(tuple(error.shape))
        return real(error, *args, **kw)
    real = profile_module.adaptive_shift_denom
    monkeypatch.setattr(profile_module, "adaptive_shift_denom", counted)
    torch.manual_seed(0)
    model = Tiny()
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    profile_model(model, batch, _tiny_loss, optimizer=sgd, steps=1, repeats=1)
    assert divisors == []                  # SGD's shift has no divisor
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = profile_model(model, batch, _tiny_loss, optimizer=adamw, steps=1, repeats=1)
    compressed = [tuple(p["shape"]) for p in prof["params"] if p["compressed"]]
    assert compressed and set(divisors) == set(compressed)
    # The DDP hook, run for real in a one-rank group (and the group gone after).
    import torch.distributed as dist
    assert prof["ddp_hook_compression_s"] > 0 and not dist.is_initialized()
    assert (prof["optimizer"], prof["optimizer_family"]) == ("AdamW", "adaptive")
    assert prof["scheme"] == "both" and prof["fp16_wire"] and prof["psgd_fp16_wire"]
    assert (prof["matrix_rank"], prof["psgd_matrix_rank"]) == (0.3, 0.25)
    by = {p["name"]: p for p in prof["params"]}
    first = by["first.weight"]                       # 128 x 64
    assert first["compressed"] and first["r"] == _math.ceil(0.3 * 64)
    assert first["psgd_compressed"] and first["psgd_r"] == _math.ceil(0.25 * 64)
    for key in ("acp_pq_s", "acp_pq_residual_s", "reconstruct_pq_s", "psgd_p_s", "psgd_q_s",
                "psgd_reconstruct_s", "step_ahead_s"):
        assert first[key] > 0, key
    assert "acp_p_s" not in first          # P and Q in turn is not what AdamW runs
    assert set(prof["orthonormalize_s"]) == {"acp_pq", "psgd"}
    assert prof["fp16_cast_s_per_byte"] > 0
    shapes = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    both = plan_buckets(make_layouts(shapes, 0.3, 1.0), Phase.PQ, prof["fusion_threshold_bytes"])
    assert [b["bytes"] for b in prof["buckets"]["acp_pq"]] == [b.nbytes for b in both]
    plain = plan_buckets(make_layouts(shapes, 0.25, 1.0), Phase.P,
                         prof["fusion_threshold_bytes"], prefix="hvd_acp.powersgd")
    assert [b["bytes"] for b in prof["buckets"]["psgd_p"]] == [b.nbytes for b in plain]
    # Every method predicted, each with its bytes on the wire: fp16 halves them.
    preds = predict_methods(prof, Settings(np=2, network=net()))
    assert {"ssgd", "ssgd-fp16", "powersgd", "acp", "acp-ddp"} <= set(preds)
    assert preds["ssgd-fp16"].bytes_per_step == preds["ssgd"].bytes_per_step / 2
    assert preds["acp"].bytes_per_step == sum(b.nbytes for b in both) / 2
    assert preds["acp-ddp"].bytes_per_step == preds["acp"].bytes_per_step
    json.dumps(prof)
    # Replanned from the file as the code plans today: the same buffers.
    from hvd_acp.plan.replan import current_plans
    assert current_plans(json.loads(json.dumps(prof)))["buckets"] == prof["buckets"]


def test_both_factors_with_fp16_on_the_wire_by_hand():
    """One step of both factors: the hook's projection and the cast of its
    buffer to fp16 before the launch, half the bytes on the wire, the cast
    back and the reconstruction on both bases after."""
    prof = synthetic([{"name": "w", "bytes": 2e6, "ready_s": 2.0, "compressed": True,
                       "acp_pq_s": 0.1, "reconstruct_pq_s": 0.05}],
                     buckets={"acp_pq": [{"bytes": 1e6, "members": ["w"]}],
                              "psgd_p": [], "psgd_q": []})
    prof.update(scheme="both", fp16_wire=True, fp16_cast_s_per_byte=2e-7,
                orthonormalize_s={"acp_pq": 0.2, "psgd": 0.0})
    pred = predict_methods(prof, Settings(np=2, network=net(), cycle_time_s=0.0),
                           ["acp"])["acp"]
    # forward 1, orth 0.2, backward 2, hook 0.1, cast 0.1 (1 MB at 1e-7 s per
    # byte, one way); 0.5 MB on the wire: 0.5 s; cast back 0.1,
    # reconstruct 0.05, update 0.5.
    assert pred.step_s == pytest.approx(1 + 0.2 + 2 + 0.1 + 0.1 + 0.5 + 0.1 + 0.05 + 0.5)
    assert pred.bytes_per_step == 5e5
    assert pred.compression_s == pytest.approx(0.2 + 0.1 + 0.1 + 0.1 + 0.05)
    # The same without fp16: the full buffer on the wire, no casts.
    prof["fp16_wire"] = False
    plain = predict_methods(prof, Settings(np=2, network=net(), cycle_time_s=0.0),
                            ["acp"])["acp"]
    assert plain.step_s == pytest.approx(1 + 0.2 + 2 + 0.1 + 1.0 + 0.05 + 0.5)
    # fp16 S-SGD: each gradient cast in its hook (0.2 s for 2 MB), 1 MB on
    # the wire, the cast back in step().
    fp16 = predict_methods(prof, Settings(np=2, network=net(), cycle_time_s=0.0),
                           ["ssgd", "ssgd-fp16"])
    assert fp16["ssgd"].step_s == pytest.approx(1 + 2 + 2 + 0.5)
    assert fp16["ssgd-fp16"].step_s == pytest.approx(1 + 2 + 0.2 + 1 + 0.2 + 0.5)
    assert fp16["ssgd-fp16"].bytes_per_step == 1e6


def test_horovods_float16_collectives_cost_their_extra_host_work_by_hand():
    """A float16 collective of Horovod costs the profile's
    ``fp16_reduce_s_per_byte`` per byte moved on top of the float32 one's
    host work, serial or not; float32 collectives, the 8-bit lanes and the
    DDP hooks do not pay it."""
    prof = synthetic([{"name": "w", "bytes": 2e6, "ready_s": 2.0, "compressed": True,
                       "n": 1000, "m": 500, "r": 100, "numel": 5e5,
                       "acp_pq_s": 0.1, "reconstruct_pq_s": 0.05}],
                     buckets={"acp_pq": [{"bytes": 1e6, "members": ["w"]}],
                              "psgd_p": [], "psgd_q": []},
                     ddp=[["w"]])
    prof.update(scheme="both", fp16_wire=True, fp16_cast_s_per_byte=2e-7,
                orthonormalize_s={"acp_pq": 0.2, "psgd": 0.0})
    methods = ["ssgd", "ssgd-fp16", "acp", "acp-ddp"]
    for serial in (False, True):
        settings = Settings(np=2, network=net(), cycle_time_s=0.0, host_serial=serial)
        before = predict_methods(prof, settings, methods)
        costly = dict(prof, fp16_reduce_s_per_byte=1e-6)
        after = predict_methods(costly, settings, methods)
        # At 2 ranks a ring moves each buffer once: 1e6 fp16 bytes of
        # S-SGD's, 5e5 of ACP-SGD's, at 1e-6 s a byte.
        assert after["ssgd-fp16"].step_s == pytest.approx(before["ssgd-fp16"].step_s + 1.0)
        assert after["acp"].step_s == pytest.approx(before["acp"].step_s + 0.5)
        assert after["ssgd"].step_s == before["ssgd"].step_s
        assert after["acp-ddp"].step_s == before["acp-ddp"].step_s
        # Scaled with compute, as the rest of the host work is.
        halved = predict_methods(costly, dataclasses.replace(settings, compute_scale=0.5),
                                 ["ssgd-fp16"])["ssgd-fp16"]
        plain = predict_methods(prof, dataclasses.replace(settings, compute_scale=0.5),
                                ["ssgd-fp16"])["ssgd-fp16"]
        assert halved.step_s == pytest.approx(plain.step_s + 0.5)
    # The 8-bit lanes are summed as integers: no float16 collective.
    lanes = dict(costly, int8_factors=True, lanes_s_per_element=1e-7,
                 buckets={"acp_pq": [{"bytes": 1e6, "members": ["w"], "lanes": True}],
                          "psgd_p": [], "psgd_q": []})
    assert (predict_methods(lanes, settings, ["acp"])["acp"].step_s
            == predict_methods(dict(lanes, fp16_reduce_s_per_byte=0.0), settings,
                               ["acp"])["acp"].step_s)


def test_the_float16_collectives_extra_cost_needs_two_ranks():
    from hvd_acp.plan.profile import fp16_reduce_s_per_byte
    with pytest.raises(ValueError, match="at least 2 ranks"):
        fp16_reduce_s_per_byte(lambda t: None, 1, torch.device("cpu"))


def test_the_factors_in_8_bit_lanes_by_hand():
    """int8_factors: the factors' buffer packs its levels into words before
    the launch (a byte an element and a flag digit on the wire) and reads
    them back before the reconstruction; a buffer of whole tensors is cast
    to fp16 as before. In the DDP hook the bucket's factors and its other
    tensors go in two all-reduces, one after the other."""
    prof = synthetic([{"name": "w", "bytes": 4e6, "ready_s": 2.0, "compressed": True,
                       "n": 1000, "m": 1000, "r": 250, "numel": 1e6,
                       "acp_pq_s": 0.1, "reconstruct_pq_s": 0.05},
                      {"name": "b", "bytes": 4e5, "ready_s": 2.0}],
                     buckets={"acp_pq": [{"bytes": 2e6, "members": ["w"], "lanes": True},
                                         {"bytes": 4e5, "members": ["b"]}],
                              "psgd_p": [], "psgd_q": []},
                     ddp=[["w", "b"]])
    prof.update(scheme="both", fp16_wire=True, int8_factors=True, fp16_cast_s_per_byte=2e-7,
                lanes_s_per_element=1e-7, orthonormalize_s={"acp_pq": 0.0, "psgd": 0.0})
    settings = Settings(np=2, network=net(), cycle_time_s=0.0)
    preds = predict_methods(prof, settings, ["acp", "acp-ddp"])
    # 5e5 levels: 500,004 bytes in words; the other buffer 4e5 float32 bytes in fp16.
    assert preds["acp"].bytes_per_step == 500004 + 2e5
    assert preds["acp-ddp"].bytes_per_step == 500004 + 2e5
    assert preds["acp-ddp"].allreduces_per_step == 2
    # forward 1, backward 2, the hook 0.1 and packing 0.05 (5e5 levels), then
    # the launch: 0.500004 s on the wire, then the other buffer's 0.2 s
    # (cast in 0.04 meanwhile), while the levels are read back (0.05) and
    # reconstructed (0.05); its cast back 0.04; the update 0.5.
    assert preds["acp"].step_s == pytest.approx(
        1 + 2 + 0.1 + 0.05 + 0.500004 + 0.2 + 0.04 + 0.5)
    assert preds["acp"].compression_s == pytest.approx(0.1 + 2 * (0.05 + 0.04) + 0.05)


def test_profile_model_with_a_budget_plans_the_8_bit_factors():
    """A budget fitted to the model: the profile records the share and the
    8-bit factors, plans the lanes buffers as the optimizer does, and the
    predicted bytes are what the optimizer sends (its lanes words, the rest
    in fp16), within the budget."""
    from hvd_acp import DistributedOptimizer, LocalCommunicator
    from hvd_acp.plan import profile_model
    torch.manual_seed(0)
    model = Tiny()
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = profile_model(model, batch, _tiny_loss, optimizer=adamw, steps=1, repeats=1,
                         budget=0.1)
    assert prof["int8_factors"] and prof["budget"] == 0.1 and prof["lanes_s_per_element"] > 0
    assert any(b.get("lanes") for b in prof["buckets"]["acp_pq"])
    assert prof["psgd_matrix_rank"] == 0.25          # Power-SGD keeps its defaults
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                               named_parameters=model.named_parameters(), budget=0.1,
                               communicator=LocalCommunicator())
    assert opt.settings.matrix_rank == prof["matrix_rank"]
    for _ in range(2):                               # the first step sends floats
        before = opt.comm_stats.bytes_sent
        opt.zero_grad()
        _tiny_loss(model, batch).backward()
        opt.step()
    sent = opt.comm_stats.bytes_sent - before
    # One process sends the whole tensors in float32; Horovod sends them in fp16.
    whole = sum(4 * p["numel"] for p in prof["params"] if not p["compressed"])
    pred = predict_methods(prof, Settings(np=2, network=net()), ["acp"])["acp"]
    assert pred.bytes_per_step == sent - whole / 2
    assert pred.bytes_per_step <= 0.1 * prof["gradient_bytes"] + 4
    from hvd_acp.plan.replan import current_plans
    assert current_plans(json.loads(json.dumps(prof)))["buckets"] == prof["buckets"]


def test_the_sgd_validation_runs_replanned_from_their_profiles_are_unchanged(tmp_path):
    """The planner's figures for the eight SGD validation runs, from their
    committed profiles, are the ones docs/planner.md publishes."""
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(repo / "scripts"))
    import plan_vs_bench
    folder = repo / "bench-results" / "planval" / "defaults"
    published = json.loads((folder / "defaults.json").read_text())
    assert len(published) == 8
    runs = [repo / run["run"] / "results.json" for run in published]
    # --reuse-profiles: the profiles the runs were validated with, found in the folder.
    profiles = plan_vs_bench._saved_profiles(runs, folder)
    assert sorted(p.name for p in set(profiles.values())) == [
        "profile_bert-base_b4.json", "profile_bert-base_b8.json",
        "profile_resnet50_b16.json", "profile_resnet50_b8.json"]
    with pytest.raises(SystemExit, match="--reuse-profiles: no"):
        plan_vs_bench._saved_profiles(runs, tmp_path)
    for run, results in zip(published, runs):
        again = plan_vs_bench._predict(results, tmp_path, profiles, [])
        for method, row in run["methods"].items():
            assert again["methods"][method]["predicted_step_s"] == row["predicted_step_s"], \
                (run["run"], method)


def test_replanning_reads_the_saved_profiles_from_another_folder(tmp_path):
    """``plan_vs_bench.py --reuse-profiles --profiles DIR`` predicts from the
    profiles in DIR and writes only its predictions to OUT: the SGD
    validation runs come out as published, with no profile copied."""
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(repo / "scripts"))
    import plan_vs_bench
    folder = repo / "bench-results" / "planval" / "defaults"
    published = json.loads((folder / "defaults.json").read_text())
    runs = [str(repo / run["run"] / "results.json") for run in published]
    with pytest.raises(SystemExit):                  # --profiles needs --reuse-profiles
        plan_vs_bench.main([*runs, "--out", str(tmp_path), "--profiles", str(folder)])
    assert plan_vs_bench.main([*runs, "--out", str(tmp_path), "--reuse-profiles",
                               "--profiles", str(folder)]) == 0
    assert not list(tmp_path.glob("profile_*.json"))
    again = json.loads((tmp_path / "defaults.json").read_text())
    assert [{m: r["predicted_step_s"] for m, r in run["methods"].items()} for run in again] == \
        [{m: r["predicted_step_s"] for m, r in run["methods"].items()} for run in published]


def test_profile_model_fields_and_plans():
    from hvd_acp.fusion import make_layouts, plan_buckets
    from hvd_acp.compression import Phase
    from hvd_acp.plan import profile_model
    torch.manual_seed(0)
    model = Tiny()
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    prof = profile_model(model, batch, _tiny_loss, matrix_rank=2, steps=2, repeats=2)
    by = {p["name"]: p for p in prof["params"]}
    assert set(by) == {"first.weight", "first.bias", "last.weight", "last.bias"}
    # Backward reaches the last layer before the first.
    assert by["last.weight"]["ready_s"] < by["first.weight"]["ready_s"] <= prof["backward_s"]
    assert by["first.weight"]["compressed"] and not by["first.bias"]["compressed"]
    assert by["first.weight"]["acp_p_s"] > 0 and by["first.weight"]["reconstruct_s"] > 0
    assert by["first.weight"]["acp_p_residual_s"] > 0 and by["first.weight"]["acp_q_residual_s"] > 0
    assert "acp_p_residual_s" not in by["first.bias"]
    assert prof["ready_order"][:2] == ["last.bias", "last.weight"]
    assert set(prof["ready_order"]) == set(by)
    assert prof["conditions"]["alone"] and prof["conditions"]["ranks_per_node"] == 1
    layouts = make_layouts([(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()],
                           2, 2.0)
    expected = plan_buckets(layouts, Phase.Q, prof["fusion_threshold_bytes"])
    assert [b["bytes"] for b in prof["buckets"]["acp_q"]] == [b.nbytes for b in expected]
    assert prof["host_s_per_byte"] > 0
    json.dumps(prof)     # a file, as written by the CLI


def _measured_acp_step(model, batch, steps=12, skip=2):
    """Median seconds of a training step of hvd_acp's ACP-SGD on a world of one."""
    import hvd_acp
    opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3,
                                                       momentum=0.9),
                                       model.named_parameters(), matrix_rank=4,
                                       communicator=hvd_acp.LocalCommunicator())
    times = []
    try:
        for i in range(steps):
            opt.zero_grad()
            started = time.perf_counter()
            _tiny_loss(model, batch).backward()
            opt.step()
            if i >= skip:
                times.append(time.perf_counter() - started)
    finally:
        opt.close()
    return statistics.median(times)


def test_prediction_of_a_measured_configuration():
    """ACP-SGD on a world of one (no communication): the predicted step is the
    profile's compute plus compression (step-ahead included); it must match a
    measured step of the optimizer with its default settings.

    Wall-clock times on a shared 2-core machine drift from one moment to the
    next: the profile and the measurement are taken back to back on one
    thread, and the comparison gets three tries. A prediction that leaves out
    a part of the step (the compression, the step-ahead passes, the update)
    misses on every try."""
    from hvd_acp.plan import profile_model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    errors = []
    try:
        for attempt in range(3):
            torch.manual_seed(attempt)
            model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                  nn.Linear(512, 10))
            batch = (torch.randn(256, 256), torch.randint(0, 10, (256,)))
            prof = profile_model(model, batch, _tiny_loss, matrix_rank=4, steps=5, repeats=3)
            assert all(p["step_ahead_s"] > 0 for p in prof["params"] if p["compressed"])
            pred = predict_methods(prof, Settings(np=1, network=net(), cycle_time_s=0.0),
                                   ["acp"])["acp"]
            assert pred.exposed_comm_s == pytest.approx(0.0, abs=1e-9)
            measured = _measured_acp_step(model, batch)
            errors.append((pred.step_s - measured) / measured)
            if abs(errors[-1]) < 0.35:
                break
    finally:
        torch.set_num_threads(threads)
    assert abs(errors[-1]) < 0.35, f"relative errors of the predicted step per try: {errors}"


# ------------------------------------------------------------------ CLI
@pytest.fixture()
def profile_file(tmp_path):
    prof = synthetic([{"name": "w", "bytes": 4e6, "ready_s": 2.0, "compressed": True,
                       "ddp_compressed": True, "acp_p_s": 0.01, "acp_q_s": 0.01,
                       "psgd_p_s": 0.01, "psgd_q_s": 0.01, "reconstruct_s": 0.01,
                       "ddp_p_bytes": 4e4, "ddp_q_bytes": 4e4},
                      {"name": "b", "bytes": 4e3, "ready_s": 0.1}],
                     buckets={"acp_p": [{"bytes": 4e4 + 4e3, "members": ["w", "b"]}],
                              "acp_q": [{"bytes": 4e4 + 4e3, "members": ["w", "b"]}],
                              "psgd_p": [{"bytes": 4e4 + 4e3, "members": ["w", "b"]}],
                              "psgd_q": [{"bytes": 4e4, "members": ["w"]}]})
    prof.update(model="small", batch_size=8, description="synthetic")
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    return path


def test_cli_predict_outputs(profile_file, tmp_path, capsys):
    out = tmp_path / "plan"
    rc = main(["predict", "--profile", str(profile_file), "--np", "2,8",
               "--bandwidth", "100mbit,10gbit", "--latency-us", "20", "--out", str(out)])
    assert rc == 0
    plan = json.loads((out / "plan.json").read_text())
    assert len(plan["predictions"]) == 4
    entry = plan["predictions"][0]
    assert set(entry["methods"]) == {"ssgd", "ssgd-fp16", "powersgd", "powersgd-ddp", "acp",
                                     "acp-ddp"}
    for fields in entry["methods"].values():
        for key in ("step_s", "compute_s", "compression_s", "exposed_comm_s",
                    "bytes_per_step", "speedup_vs_ssgd"):
            assert math.isfinite(fields[key])
    # S-SGD's 4 MB after backward take 0.33 s at 100 Mbit/s, ACP-SGD's 44 kB 4 ms.
    slow = [e for e in plan["predictions"] if e["bandwidth_mbit"] == 100.0 and e["np"] == 8][0]
    assert slow["recommendation"]["method"] != "ssgd"
    assert slow["recommendation"]["matrix_rank"] == 4
    assert slow["methods"]["ssgd"]["exposed_comm_s"] > 0.3
    assert slow["methods"]["acp"]["speedup_vs_ssgd"] > 1.05
    # Where no compressor is predicted 5% faster, S-SGD is recommended.
    for entry in plan["predictions"]:
        gain = max(m["speedup_vs_ssgd"] for m in entry["methods"].values())
        assert (entry["recommendation"]["method"] == "ssgd") == (gain < 1.05), entry
    assert "|" in (out / "plan.md").read_text()
    assert (out / "plan.png").stat().st_size > 1000
    assert "plan.json" in capsys.readouterr().out
    # The bare form (no subcommand) is predict.
    assert main(["--profile", str(profile_file), "--np", "2", "--bandwidth", "1gbit",
                 "--no-plot", "--out", str(tmp_path / "bare")]) == 0
    assert (tmp_path / "bare" / "plan.json").exists()
    # Horovod's negotiation and a network stack's cost lengthen the Horovod
    # methods' steps; the link calibration is named in plan.md.
    link = tmp_path / "link.json"
    link.write_text(json.dumps({"kind": "hvd-acp link calibration", "stack_s_per_byte": 1e-8}))
    assert main(["--profile", str(profile_file), "--np", "2", "--bandwidth", "1gbit",
                 "--no-plot", "--horovod-negotiation-us", "5000", "--link-calibration",
                 str(link), "--out", str(tmp_path / "slow")]) == 0
    base = json.loads((tmp_path / "bare" / "plan.json").read_text())["predictions"][0]
    slower = json.loads((tmp_path / "slow" / "plan.json").read_text())
    assert slower["config"]["horovod_negotiation_us"] == 5000.0
    assert slower["config"]["stack_s_per_byte"] == 1e-8
    for m in ("ssgd", "acp"):
        assert (slower["predictions"][0]["methods"][m]["step_s"]
                > base["methods"][m]["step_s"] + 0.004)
    assert "network stack 10.00 ns/byte" in (tmp_path / "slow" / "plan.md").read_text()


def test_cli_errors(profile_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["predict", "--profile", str(profile_file), "--bandwidth", "fast",
              "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "bandwidth must look like" in capsys.readouterr().err
    rc = main(["predict", "--profile", str(tmp_path / "nope.json"), "--out", str(tmp_path)])
    assert rc == 2
    assert "nope.json' not found" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 1}))
    assert main(["predict", "--profile", str(bad), "--out", str(tmp_path)]) == 2
    assert "not a hvd-acp-plan profile" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["predict", "--profile", str(profile_file), "--np", "2,0", "--out", str(tmp_path)])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["predict", "--profile", str(profile_file), "--gpus-per-node", "4",
              "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "--intra-bandwidth" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["predict", "--profile", str(profile_file), "--int8-factors", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "are the profile's settings" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["predict", "--model", "small", "--budget", "2", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "a share of S-SGD's bytes in (0, 1]" in capsys.readouterr().err
    # A budget under SGD: the profile's ValueError, on the command line.
    assert main(["profile", "--model", "small", "--alone", "--budget", "0.1",
                 "--out", str(tmp_path / "p.json")]) == 2
    assert "Adam-family" in capsys.readouterr().err
    assert main(["validate", "--bench", str(tmp_path / "missing.json")]) == 2
    assert "not found" in capsys.readouterr().err


def _bench(step_s, compute_only=3.5, diagnostics=None):
    return {"config": {"model": "small", "np": 2, "batch_size": 8, "matrix_rank": 4,
                       "bandwidth_mbit": 8.0 / 1.0, "horovod_cycle_time_ms": None,
                       "command": "synthetic"},
            "methods": {m: {"step_s_median": s, "compression_s_per_step": 0.0}
                        for m, s in step_s.items()},
            "compute_only": {"step_s_median": compute_only},
            "diagnostics": diagnostics or {}}


def test_validate_synthetic_run(tmp_path, capsys):
    prof = synthetic([{"name": "w", "bytes": 1e6, "ready_s": 2.0, "compressed": True,
                       "acp_p_s": 0.1, "acp_q_s": 0.1, "reconstruct_s": 0.05}])
    prof.update(model="small", batch_size=8)
    # 8 Mbit/s = 1 MB/s nominal; the default wire efficiency (1448/1514) applies.
    bench = _bench({"acp": 3.15 + 1e6 / (1e6 * 1448 / 1514) + 0.5, "ssgd": 10.0})
    result = validate(bench, prof)
    assert result["calibration"]["compute_scale"] == pytest.approx(1.0)
    # Horovod's default 1 ms cycle delays the launch by 0.5 ms on average.
    assert result["methods"]["acp"]["error"] == pytest.approx(0.0, abs=2e-3)
    assert result["worst_method"] == "ssgd" and result["worst_abs_error"] > 0.4
    # Calibration: a floor twice the profile's compute doubles compute and compression.
    doubled = validate(_bench({"acp": 1.0}, compute_only=7.0), prof)
    assert doubled["calibration"]["compute_scale"] == pytest.approx(2.0)
    assert doubled["methods"]["acp"]["predicted"]["compute_s"] == pytest.approx(7.0)
    # With the diagnostic jobs: Horovod's idle floor for Horovod, the concurrent one for DDP.
    diag = _bench({"acp": 1.0}, compute_only=3.5,
                  diagnostics={"hvd-idle": {"step_s_median": 4.2},
                               "compute-concurrent": {"step_s_median": 3.85}})
    cal = validate(diag, prof)["calibration"]
    assert cal["compute_scale"] == pytest.approx(1.2)
    assert cal["ddp_compute_scale"] == pytest.approx(1.1)
    # The CLI: a table on stdout, exit 1 over --max-error.
    pf, bf = tmp_path / "p.json", tmp_path / "results.json"
    pf.write_text(json.dumps(prof))
    bf.write_text(json.dumps(bench))
    assert main(["validate", "--bench", str(bf), "--profile", str(pf),
                 "--max-error", "0.15", "--out", str(tmp_path / "v")]) == 1
    out = capsys.readouterr()
    assert "| ACP-SGD |" in out.out and "exceeds --max-error" in out.err
    assert json.loads((tmp_path / "v" / "validate.json").read_text())[0]["worst_method"] == "ssgd"
    with pytest.raises(ValueError, match="batch_size"):
        validate(dict(bench, config=dict(bench["config"], batch_size=16)), prof)
    # A run of the benchmark's --optimizer adamw needs a profile taken with AdamW.
    with pytest.raises(ValueError, match="--optimizer adamw but the profile was taken with"):
        validate(dict(bench, config=dict(bench["config"], optimizer="adamw")), prof)
    assert validate(dict(bench, config=dict(bench["config"], optimizer="sgd")), prof)
    # A link calibration adds its stack cost per byte moved to the serial step
    # (2 ranks on 2 CPUs: no spare core) and to nothing else.
    serial = dict(bench, config=dict(bench["config"], cpus=2, threads_per_rank=1))
    link = {"kind": "hvd-acp link calibration", "stack_s_per_byte": 1e-7}
    plain, linked = validate(serial, prof), validate(serial, prof, link=link)
    assert linked["stack_s_per_byte"] == 1e-7 and plain["stack_s_per_byte"] == 0.0
    assert (linked["methods"]["acp"]["predicted_step_s"]
            - plain["methods"]["acp"]["predicted_step_s"]) == pytest.approx(1e6 * 1e-7)
    lf = tmp_path / "link.json"
    lf.write_text(json.dumps(link))
    assert main(["validate", "--bench", str(bf), "--profile", str(pf),
                 "--link-calibration", str(lf)]) == 0
    assert "network stack 100.00 ns/byte" in capsys.readouterr().out
    assert main(["validate", "--bench", str(bf), "--profile", str(pf),
                 "--link-calibration", str(tmp_path / "none.json")]) == 2
    assert "none.json' not found" in capsys.readouterr().err


def test_recommendation_needs_a_gain_beyond_the_planners_error():
    from hvd_acp.plan.report import recommend

    def methods(acp_step):
        base = {"compression_s": 0.01, "exposed_comm_s": 0.0, "bytes_per_step": 1e6}
        return {"ssgd": dict(base, step_s=1.0, compression_s=0.0, bytes_per_step=1e8),
                "powersgd": dict(base, step_s=1.2), "powersgd-ddp": dict(base, step_s=1.2),
                "acp": dict(base, step_s=acp_step)}

    near = recommend(methods(0.97), 4, 8, 10000.0)
    assert near["method"] == "ssgd" and near["matrix_rank"] is None
    assert "1.03x" in near["reason"]
    clear = recommend(methods(0.90), 4, 8, 10000.0)
    assert clear["method"] == "acp" and clear["matrix_rank"] == 4


def test_the_plan_lists_the_baselines_bytes_beside_its_tables():
    from hvd_acp.plan.report import format_plan_md, predict_grid
    params = [{"name": "w", "bytes": 4 * 64 * 100, "ready_s": 1.0, "shape": [64, 100],
               "numel": 6400},
              {"name": "b", "bytes": 4 * 64, "ready_s": 0.5, "shape": [64], "numel": 64}]
    entries = predict_grid(synthetic(params), [2, 4], [100.0], [0.0])
    four = entries[1]["baselines"]
    assert set(entries[1]["methods"]) == {"ssgd", "ssgd-fp16", "powersgd", "powersgd-ddp",
                                          "acp", "acp-ddp"}
    # DiLoCo: every parameter once per 500 steps; DeMo: 100 chunks of 64,
    # 8 values of 4 bytes and 8 positions of 1, and the 1-D tensor.
    assert four["diloco"]["bytes_sent"] == four["diloco"]["bytes_received"] == 25856 / 500
    assert four["demo"]["bytes_sent"] == 100 * 8 * 5 + 256
    assert four["demo"]["bytes_received"] == 3 * 100 * 8 * 5 + 256
    assert entries[0]["baselines"]["demo"]["bytes_received"] == 100 * 8 * 5 + 256
    # TSR: a core of 32 x 32 every step and sketches of (64 + 100) x 32 every
    # 10, and the 1-D tensor, 2 bytes each (fp16).
    tsr = (32 * 32 + 164 * 32 / 10 + 64) * 2
    assert four["tsr"]["bytes_sent"] == four["tsr"]["bytes_received"] == pytest.approx(tsr)
    plan = {"config": {"compute_scale": 1.0, "cycle_time_ms": 1.0, "host_s_per_byte": 0.0,
                       "wire_efficiency": 1.0}, "predictions": entries}
    text = format_plan_md(plan)
    assert "| 4 | 100 Mbit/s | 5.17e-05 / 5.17e-05 MB; 6.49e-06 s | 0.00426 / 0.0123 MB;" in text
    assert "DiLoCo (H = 500), DeMo-style (k = 8 of 64) and TSR-style (r = 32, K = 10)" in text
    assert "| DiLoCo | DeMo-style | TSR-style |" in text
    assert "0.00323 / 0.00323 MB;" in text
    # A profile without shapes (format 1 does not require them): DiLoCo only.
    bare = predict_grid(synthetic([{k: v for k, v in p.items() if k != "shape"}
                                   for p in params]), [2], [100.0], [0.0])
    assert set(bare[0]["baselines"]) == {"diloco"}
    assert format_plan_md(dict(plan, predictions=bare)).count(
        "n/a (the profile lacks the shapes)") == 2


def test_the_paper_table_of_planner_md_is_what_the_script_writes(monkeypatch):
    """docs/planner.md's projections for the paper's settings come from the
    committed profiles through today's timeline: a change to either shows."""
    import importlib
    from tests.hvdrun import REPO
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    paper = importlib.import_module("paper_projection")
    page = REPO / "docs" / "planner.md"
    text = page.read_text(encoding="utf-8")
    rows = paper.project(15.7, 0.4)
    lines = paper.markdown(rows, 15.7, 0.4)
    rendered = paper.replace_marked(text, paper.MARKERS, lines, page)
    assert rendered == text, "docs/planner.md is not what scripts/paper_projection.py writes"
    # The rows are the paper's settings: 2 models x 3 networks x 8-64 GPUs.
    assert len(rows) == 24 and {r["np"] for r in rows} == {8, 16, 32, 64}
    assert all(r["vs_ssgd"] > 0.95 for r in rows)
    # The transformers under AdamW: their AdamW profiles, every method at the
    # adaptive defaults, the fastest named per row.
    adamw = paper.project_adamw(15.7, 0.4)
    rendered = paper.replace_marked(text, paper.ADAMW_MARKERS,
                                    paper.markdown_adamw(adamw, 15.7, 0.4), page)
    assert rendered == text, "docs/planner.md's AdamW rows are not what the script writes"
    assert len(adamw) == 24
    for row in adamw:
        assert row["fastest"] == min(row["steps"], key=row["steps"].get)
        # fp16 on the wire: half of S-SGD's bytes; ACP-SGD's both factors at
        # 0.3 send about 1.2 times Power-SGD's at 0.25.
        mb = row["mb_per_step"]
        assert mb["ssgd-fp16"] == pytest.approx(mb["ssgd"] / 2)
        assert 1.1 < mb["acp"] / mb["powersgd"] < 1.3


def test_the_defaults_table_of_planner_md_is_what_plan_vs_bench_writes(monkeypatch):
    """docs/planner.md's table of the planner's defaults against the eight
    benchmark runs is rendered from bench-results/planval/defaults, and each
    measured figure in it is the one in the run's own results.json."""
    import importlib
    from tests.hvdrun import REPO
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    script = importlib.import_module("plan_vs_bench")
    found = json.loads((REPO / "bench-results/planval/defaults/defaults.json").read_text())
    page = REPO / "docs" / "planner.md"
    text = page.read_text(encoding="utf-8")
    rendered = script.replace_marked(text, script.MARKERS, script.markdown(found).split("\n"),
                                     page)
    assert rendered == text, "docs/planner.md is not what scripts/plan_vs_bench.py writes"
    assert len(found) == 8
    for run in found:
        bench = json.loads((REPO / run["run"] / "results.json").read_text())
        for method, row in run["methods"].items():
            assert row["measured_step_s"] == bench["methods"][method]["step_s_median"]
    # The same under AdamW, each run trained with it and predicted from a
    # profile taken with it.
    adamw = json.loads((REPO / "bench-results/planval_adamw_polled/predicted/defaults.json")
                       .read_text())
    markers = ("<!-- planval-adamw -->", "<!-- end planval-adamw -->")
    rendered = script.replace_marked(text, markers, script.markdown(adamw).split("\n"), page)
    assert rendered == text, "docs/planner.md's AdamW validation is not plan_vs_bench's"
    assert len(adamw) == 8
    for run in adamw:
        bench = json.loads((REPO / run["run"] / "results.json").read_text())
        assert bench["config"]["optimizer"] == run["optimizer"] == "adamw"
        assert set(run["methods"]) == {"ssgd", "ssgd-fp16", "powersgd", "acp", "acp-ddp"}
        for method, row in run["methods"].items():
            assert row["measured_step_s"] == bench["methods"][method]["step_s_median"]


def test_a_profile_times_steps_until_they_add_up_to_its_minimum():
    """A small model's few steps are too short a sample on a busy host: the
    profile times more of them until they add up to ``min_timed_s``, never
    fewer than asked and never more than ``MAX_TIMED_STEPS``."""
    from hvd_acp.plan.profile import MAX_TIMED_STEPS, time_training_steps
    model = nn.Linear(8, 4)
    batch = torch.randn(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(m, b):
        time.sleep(0.01)
        return m(b).square().mean()
    cpu = torch.device("cpu")
    exact = time_training_steps(model, batch, loss_fn, opt, cpu, 2, 1, min_timed_s=0.0)
    assert len(exact["forward_s"]) == 2
    more = time_training_steps(model, batch, loss_fn, opt, cpu, 2, 1, min_timed_s=0.1)
    steps = [f + b + u for f, b, u in zip(more["forward_s"], more["backward_s"],
                                          more["optimizer_s"])]
    assert 2 < len(steps) < MAX_TIMED_STEPS and sum(steps) >= 0.1
    assert sum(steps[:-1]) < 0.1            # it stops once they add up
    capped = time_training_steps(model, batch, loss_fn, opt, cpu, 2, 0, min_timed_s=60.0)
    assert len(capped["forward_s"]) == MAX_TIMED_STEPS
