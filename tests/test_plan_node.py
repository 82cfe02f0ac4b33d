"""The planner's profile under the conditions the ranks run in: the defaults
a launch implies, what a profile records and says, how predictions use it,
and the node's ranks profiling at once under horovodrun."""
import json
import sys

import pytest
import torch

from hvd_acp.plan.__main__ import main
from hvd_acp.plan.conditions import describe_conditions, no_spare_core, node_conditions
from hvd_acp.plan.report import predict_grid
from tests.test_plan import synthetic


def test_default_conditions_are_what_the_launch_uses():
    # CPU: a rank per core, the cores divided among the ranks.
    cpu = node_conditions("cpu", cores=2, horovod_thread=True)
    assert (cpu.ranks_per_node, cpu.threads_per_rank, cpu.device) == (2, 1, "cpu")
    # A launch of one rank puts one on the node, and it gets every core.
    one = node_conditions("cpu", cores=16, nps=[1, 8], horovod_thread=True)
    assert (one.ranks_per_node, one.threads_per_rank) == (1, 16)
    assert node_conditions("cpu", cores=16, nps=[2, 8]).ranks_per_node == 2
    # Threads given: as many ranks as they fill the cores.
    assert node_conditions("cpu", cores=16, threads_per_rank=4).ranks_per_node == 4
    ranks = node_conditions("cpu", cores=16, ranks_per_node=4)
    assert ranks.threads_per_rank == 4
    # CUDA: a rank per device, or the node --gpus-per-node describes.
    gpu = node_conditions("cuda", cores=32, cuda_devices=4)
    assert (gpu.ranks_per_node, gpu.threads_per_rank, gpu.device) == (4, 8, "cuda")
    assert node_conditions("cuda:1", cores=32, cuda_devices=4, gpus_per_node=8,
                           nps=[64]).ranks_per_node == 8
    # Alone: one process, no Horovod thread, still a rank's share of the cores.
    alone = node_conditions("cpu", cores=8, nps=[2], alone=True, horovod_thread=True)
    assert (alone.ranks_per_node, alone.threads_per_rank) == (1, 4)
    assert alone.alone and not alone.horovod_thread
    assert node_conditions("cpu", cores=2, cycle_time_ms=10).horovod_cycle_time_ms == 10.0
    with pytest.raises(ValueError, match="ranks_per_node must be a positive int"):
        node_conditions("cpu", ranks_per_node=0)


def test_what_a_profile_assumed_is_said():
    cpu = {"device": "cpu", "conditions": dict(
        node_conditions("cpu", cores=2, horovod_thread=True).as_dict(), ddp_compute_scale=0.9)}
    said = describe_conditions(cpu)
    assert "2 ranks per node computing at once on the node's 2 cores, 1 torch thread each" in said
    assert "Horovod's background thread running in each (cycle 1 ms)" in said
    assert "without it (0.90x)" in said
    gpu = {"device": "cuda:0", "device_name": "H100", "conditions": node_conditions(
        "cuda", cores=16, cuda_devices=8, horovod_thread=False).as_dict()}
    assert describe_conditions(gpu) == ("profiled with 8 ranks per node computing at once one "
                                        "per GPU (H100), 2 torch threads each, without "
                                        "Horovod's background thread")
    # A profile made before conditions were recorded: one process alone.
    assert "one process alone on the CPU with 2 torch threads" in describe_conditions(
        {"device": "cpu", "torch_threads": 2})


def test_predictions_use_the_recorded_conditions():
    prof = synthetic([{"name": "w", "bytes": 4e6, "ready_s": 0.2, "ddp_compressed": True,
                       "acp_p_s": 0.1, "acp_q_s": 0.1, "reconstruct_s": 0.0,
                       "ddp_p_bytes": 1e4, "ddp_q_bytes": 1e4}], backward=1.0, optimizer=0.0)
    prof["host_s_per_byte"] = 1e-8
    base = predict_grid(prof, [2], [1000.0], [0.0])[0]["methods"]
    # Every core busy with a rank: the host work of the all-reduce, hidden under
    # backward beside it, now adds to the step.
    prof["conditions"] = dict(node_conditions("cpu", cores=2, horovod_thread=True).as_dict(),
                              ddp_compute_scale=2.0)
    assert no_spare_core(prof)
    busy = predict_grid(prof, [2], [1000.0], [0.0])[0]["methods"]
    assert busy["ssgd"]["step_s"] == pytest.approx(base["ssgd"]["step_s"] + 0.04)
    # The DDP hook's ranks have no Horovod thread: its compute is the other pass's.
    assert busy["acp-ddp"]["compute_s"] == pytest.approx(2 * base["acp-ddp"]["compute_s"])
    assert busy["acp"]["compute_s"] == pytest.approx(base["acp"]["compute_s"])
    # --no-host-serial overrides the profile.
    told = predict_grid(prof, [2], [1000.0], [0.0], {"host_serial": False})[0]["methods"]
    assert told["ssgd"]["step_s"] == pytest.approx(base["ssgd"]["step_s"])
    # A rank per core with cores to spare, or GPUs: the host work runs beside.
    prof["conditions"]["cores"] = 8
    assert not no_spare_core(prof)
    prof["conditions"].update(device="cuda", cores=2)
    assert not no_spare_core(prof)


def test_cli_profiles_a_users_model_as_the_ranks_of_a_node_run(tmp_path, capsys, monkeypatch):
    """Two ranks profile at once under horovodrun, Horovod's thread alive,
    then again without it, training with AdamW; the profile says so and so
    does the plan."""
    from tests.hvdrun import REPO
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", "tests/workers/ab_user_model.py:build",
                 "--batch-size", "4", "--steps", "1", "--repeats", "1",
                 "--ranks-per-node", "2", "--threads-per-rank", "1", "--optimizer", "adamw",
                 "--out", str(out)]) == 0
    profile = json.loads(out.read_text())
    assert profile["torch_threads"] == 1 and profile["batch_size"] == 4
    assert (profile["optimizer"], profile["scheme"], profile["matrix_rank"]) == (
        "AdamW", "both", 0.3)
    assert profile["model"] == "tests/workers/ab_user_model.py:build"
    assert {p["name"] for p in profile["params"]} == {
        "conv.weight", "conv.bias", "head.weight", "head.bias"}
    cond = profile["conditions"]
    assert (cond["ranks_per_node"], cond["threads_per_rank"], cond["alone"]) == (2, 1, False)
    assert cond["horovod_thread"] and cond["horovod_cycle_time_ms"] == 1.0
    assert len(cond["per_rank_step_s"]) == len(cond["ddp_per_rank_step_s"]) == 2
    # The profile is the slowest rank's: a synchronous step waits for it.
    assert cond["per_rank_step_s"][cond["profiled_rank"]] == max(cond["per_rank_step_s"])
    assert (profile["forward_s"] + profile["backward_s"] + profile["optimizer_s"]
            == pytest.approx(max(cond["per_rank_step_s"])))
    assert cond["ddp_compute_scale"] == pytest.approx(
        max(cond["ddp_per_rank_step_s"]) / max(cond["per_rank_step_s"]))
    # Both ranks timed a float16 and a float32 all-reduce of Horovod: the
    # first's extra host work per byte, a real number, never negative.
    extra = profile["fp16_reduce_s_per_byte"]
    assert isinstance(extra, float) and 0.0 <= extra < 1e-6
    # The two ranks profiled at the same time, not one after the other.
    (a0, a1), (b0, b1) = cond["per_rank_window"]
    assert max(a0, b0) < min(a1, b1)
    said = capsys.readouterr().out
    assert "with 2 ranks per node computing at once" in said
    assert f"the slowest rank's kernels (rank {cond['profiled_rank']}," in said
    assert "Horovod's background thread running in each (cycle 1 ms)" in said
    assert main(["--profile", str(out), "--np", "2", "--bandwidth", "100mbit", "--no-plot",
                 "--out", str(tmp_path / "plan")]) == 0
    plan_md = (tmp_path / "plan" / "plan.md").read_text()
    assert "with 2 ranks per node computing at once" in plan_md
    assert "Horovod's float16 collectives" in plan_md
    assert "AdamW: ACP-SGD matrix rank 0.3, both factors every step, fp16 on the wire" in plan_md
    assert "ACP-SGD (DDP hook)" in plan_md and "S-SGD (fp16)" in plan_md
    config = json.loads((tmp_path / "plan" / "plan.json").read_text())["config"]
    assert config["ddp_compute_scale"] == pytest.approx(cond["ddp_compute_scale"])
    # Two ranks with a thread each on a node of at most 2 cores leave none spare.
    assert config["host_serial"] == (cond["cores"] <= 2)
    with pytest.raises(SystemExit):
        main(["profile", "--model", "resnet", "--out", str(tmp_path / "x.json")])
    assert "package.module:function" in capsys.readouterr().err


def test_cli_profiles_one_process_alone_when_asked(tmp_path, capsys, monkeypatch):
    from tests.hvdrun import REPO
    monkeypatch.chdir(REPO)
    threads = torch.get_num_threads()
    try:
        out = tmp_path / "profile.json"
        assert main(["profile", "--model", "tests/workers/ab_user_model.py:build",
                     "--batch-size", "4", "--steps", "1", "--repeats", "1", "--alone",
                     "--threads-per-rank", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    profile = json.loads(out.read_text())
    assert (profile["optimizer"], profile["scheme"]) == ("SGD", "alternating")
    cond = profile["conditions"]
    assert (cond["ranks_per_node"], cond["threads_per_rank"]) == (1, 1)
    assert cond["alone"] and not cond["horovod_thread"]
    assert "per_rank_step_s" not in cond
    assert "profiled in one process alone (--alone) with 1 torch thread" in capsys.readouterr().out




def test_the_fp16_allreduce_cost_script_runs_both_libraries(tmp_path):
    """scripts/fp16_allreduce_cost.py under horovodrun and torchrun at 2 ranks:
    both libraries' rows, each a positive time per element."""
    import importlib
    from tests.hvdrun import REPO
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        script = importlib.import_module("fp16_allreduce_cost")
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert script.main(["--np", "2", "--numel", "65536", "--repeats", "3",
                        "--out", str(tmp_path)]) == 0
    found = json.loads((tmp_path / "results.json").read_text())
    assert [row["library"] for row in found["rows"]] == ["horovod", "torch"]
    for row in found["rows"]:
        assert set(row["ns_per_element"]) == {"float32", "float16"}
        assert all(v > 0 for v in row["ns_per_element"].values())
    assert "| Horovod" in (tmp_path / "results.md").read_text()
