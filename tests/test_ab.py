"""The A/B tool (``hvd-acp-ab``): its statistics and report in one process, then
real runs under ``horovodrun`` and ``torchrun`` on a built-in model and on a
user's model given as ``module:function``.

Timings are never asserted (the machines that run the suite are shared);
what is asserted is what the tool must get right whatever the timings: the
methods, rounds and bytes it records, the direction of its ratios and
verdicts, and clear errors instead of hangs.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

from hvd_acp.ab import report
from hvd_acp.ab.__main__ import parse_methods
from hvd_acp.methods import HOROVOD, TORCHRUN, get
from hvd_acp.plan.models import build_model, build_user_model, check_model_name, to_device
from tests.hvdrun import REPO, run_status

BIN = Path(sys.executable).parent
USER_MODEL = "tests/workers/ab_user_model.py"


# ------------------------------------------------------------ report, pure
def _measured(rounds_by_key, bytes_by_key=None):
    bytes_by_key = bytes_by_key or {}
    return {key: {"rounds": list(rounds), "step_s": list(rounds), "loss": [1.0],
                  **({"bytes_per_step": [bytes_by_key[key]] * len(rounds)}
                     if key in bytes_by_key else {})}
            for key, rounds in rounds_by_key.items()}


def test_summary_ratios_are_other_over_acp_paired_by_round():
    # The machine slows down from round to round; ACP-SGD is 2x faster than
    # S-SGD in every round: the paired ratio is exactly 2 despite the drift.
    measured = _measured({"ssgd": [2.0, 4.0, 6.0, 8.0, 10.0, 12.0],
                          "acp": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]},
                         {"ssgd": 1000.0, "acp": 50.0})
    summary = report.summarize(measured, samples_per_step=64)
    assert summary["candidate"] == "acp"
    ratio = summary["speedup"]["ssgd"]
    assert ratio["median"] == pytest.approx(2.0) and ratio["low"] == pytest.approx(2.0)
    assert ratio["verdict"] == "faster" and ratio["coverage"] >= 0.95
    assert summary["methods"]["acp"]["bytes_per_step"] == 50.0
    assert summary["methods"]["ssgd"]["samples_per_s"] == pytest.approx(64 / 7.0)
    line = summary["recommendation"]
    assert line.startswith("ACP-SGD is 2.00x [2.00, 2.00] faster than S-SGD")
    assert "use it" in line and "Caution" not in line


def test_recommendation_names_the_fastest_other_method_when_acp_loses():
    measured = _measured({"ssgd": [1.0] * 6, "powersgd": [3.0] * 6,
                          "acp": [1.5, 1.4, 1.6, 1.5, 1.45, 1.55]})
    summary = report.summarize(measured, samples_per_step=8)
    assert summary["speedup"]["ssgd"]["verdict"] == "slower"
    assert summary["speedup"]["powersgd"]["verdict"] == "faster"
    line = summary["recommendation"]
    assert line.startswith("S-SGD is ") and "keep S-SGD" in line


def test_recommendation_leaves_the_baselines_out_and_says_why():
    # DiLoCo's timed steps are inner steps: fastest here, but not a rival.
    measured = _measured({"ssgd": [3.0] * 6, "diloco": [0.5] * 6, "demo": [0.8] * 6,
                          "acp": [1.0] * 6}, {"diloco": 0.0, "demo": 10.0, "acp": 5.0})
    summary = report.summarize(measured, samples_per_step=8)
    assert summary["speedup"]["diloco"]["verdict"] == "slower"      # still in the table
    line = summary["recommendation"]
    assert line.startswith("ACP-SGD is 3.00x [3.00, 3.00] faster than S-SGD"), line
    assert "Left out of this comparison: DiLoCo, DeMo-style" in line
    alone = report.summarize(_measured({"diloco": [0.5] * 6, "acp": [1.0] * 6}), 8)
    assert alone["recommendation"].startswith(
        "No other method that averages each step's gradient was measured beside ACP-SGD.")


def test_recommendation_says_not_separable_and_warns_on_few_rounds():
    measured = _measured({"ssgd": [1.0, 1.2], "acp": [1.1, 1.1]})
    summary = report.summarize(measured, samples_per_step=8)
    line = summary["recommendation"]
    assert "cannot be told apart" in line
    assert "Caution: 2 rounds give a 50% interval" in line


def test_markdown_lists_every_method_with_bytes_and_ratio():
    measured = _measured({"powersgd-ddp": [2.0] * 6, "acp-ddp": [1.0] * 6},
                         {"acp-ddp": 2_000_000.0})
    config = {"model_description": "m", "ranks": 2, "launcher": "torchrun", "device": "cpu",
              "batch_size": 4, "matrix_rank": 4, "rounds": 6, "steps": 5, "warmup": 3,
              "threads": 1}
    summary = report.summarize(measured, samples_per_step=8)
    text = report.markdown(config, summary)
    assert "| Power-SGD (torch DDP powerSGD_hook) |" in text
    assert "| 2.000 | (itself) |" in text
    assert "2.00x [2.00, 2.00] (faster)" in text
    assert text.rstrip().endswith(summary["recommendation"])


def test_methods_must_match_the_launch():
    # The defaults: S-SGD in fp32 and fp16, Power-SGD, ACP-SGD, for each launcher.
    for launcher in (HOROVOD, TORCHRUN):
        keys = parse_methods(None, launcher)
        assert len(keys) == 4 and {get(k).algorithm for k in keys} == {
            "S-SGD", "Power-SGD", "ACP-SGD"}
        assert all(get(k).launcher == launcher for k in keys)
    assert parse_methods("acp, ssgd,acp", HOROVOD) == ["acp", "ssgd"]
    with pytest.raises(ValueError, match="torchrun, with --ddp"):
        parse_methods("ssgd,acp-ddp", HOROVOD)
    with pytest.raises(ValueError, match="horovodrun, without --ddp"):
        parse_methods("acp", TORCHRUN)
    with pytest.raises(ValueError, match="must be one of"):
        parse_methods("acp,nope", HOROVOD)


# -------------------------------------------------------- a user's model
def test_user_model_from_a_file_and_from_a_module(monkeypatch):
    monkeypatch.chdir(REPO)
    spec = build_user_model(f"{USER_MODEL}:build", 4)
    loss = spec.loss_fn(spec.model, spec.batch)
    loss.backward()
    assert loss.dim() == 0 and spec.model.conv.weight.grad is not None
    again = build_user_model("tests.workers.ab_user_model:build", 4)
    # Seeded before the call: the same weights in every process.
    assert torch.equal(spec.model.conv.weight, again.model.conv.weight)
    plain = build_model(f"{USER_MODEL}:build_without_loss", 4)
    assert plain.loss_fn(plain.model, plain.batch).dim() == 0
    assert "Net" in plain.description


def test_user_model_errors_are_clear(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ValueError, match="must be one of"):
        check_model_name("resnet")
    with pytest.raises(ValueError, match="no file"):
        build_user_model("nowhere/model.py:build", 2)
    with pytest.raises(ValueError, match="cannot import"):
        build_user_model("no_such_package.models:build", 2)
    with pytest.raises(ValueError, match="has no function"):
        build_user_model(f"{USER_MODEL}:missing", 2)
    with pytest.raises(ValueError, match="must return"):
        build_user_model(f"{USER_MODEL}:build_wrong", 2)


def test_batches_move_to_the_device_whole():
    batch = {"a": torch.ones(2), "b": (torch.zeros(1), [torch.ones(1)]), "n": 3}
    moved = to_device(batch, torch.device("cpu"))
    assert moved["n"] == 3 and isinstance(moved["b"], tuple)
    assert torch.equal(moved["b"][1][0], torch.ones(1))


# ------------------------------------------------------------- real runs
def _read(out: Path) -> dict:
    return json.loads((out / "ab.json").read_text())


def _check_run(found: dict, methods, rounds: int, steps: int) -> None:
    measured, summary = found["measured"], found["summary"]
    assert list(measured) == list(methods)
    for key in methods:
        assert len(measured[key]["rounds"]) == rounds
        assert len(measured[key]["step_s"]) == rounds * steps
        assert all(t > 0 for t in measured[key]["step_s"])
        assert all(torch.isfinite(torch.tensor(v)) for v in measured[key]["loss"])
    assert summary["recommendation"]


def test_ab_under_horovodrun_on_a_builtin_model(tmp_path):
    methods = ("ssgd", "powersgd", "acp")
    status, out = run_status(
        [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
         str(BIN / "hvd-acp-ab"), "--model", "small", "--methods", ",".join(methods),
         "--rounds", "2", "--steps", "3", "--warmup", "2", "--device", "cpu", "--profile",
         "--out", str(tmp_path)], 240, "hvd-acp-ab under horovodrun")
    assert status == 0, out[-3000:]
    assert "ACP-SGD" in out and "Caution: 2 rounds" in out, out[-3000:]
    assert "Compute only, one process" in out
    # Its single-process profile feeds the planner.
    from hvd_acp.plan.__main__ import main as plan_main
    assert plan_main(["predict", "--profile", str(tmp_path / "profile.json"), "--np", "2",
                      "--bandwidth", "1gbit", "--no-plot", "--out", str(tmp_path / "plan")]) == 0
    assert json.loads((tmp_path / "profile.json").read_text())["batch_size"] == 32
    found = _read(tmp_path)
    _check_run(found, methods, rounds=2, steps=3)
    assert found["config"]["ranks"] == 2 and found["config"]["launcher"] == "horovodrun"
    sent = {k: found["summary"]["methods"][k].get("bytes_per_step") for k in methods}
    # ACP-SGD sends one factor per step, Power-SGD both: about half.
    assert 0 < sent["acp"] < 0.7 * sent["powersgd"]
    assert set(found["summary"]["speedup"]) == {"ssgd", "powersgd"}


def test_ab_under_torchrun_on_a_user_model(tmp_path):
    methods = ("powersgd-ddp", "acp-ddp")
    status, out = run_status(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "hvd_acp.ab",
         "--ddp", "--model", f"{USER_MODEL}:build", "--methods", ",".join(methods),
         "--rounds", "2", "--steps", "2", "--warmup", "1", "--batch-size", "8",
         "--device", "cpu", "--out", str(tmp_path)], 240, "hvd-acp-ab under torchrun")
    assert status == 0, out[-3000:]
    found = _read(tmp_path)
    _check_run(found, methods, rounds=2, steps=2)
    assert found["config"]["launcher"] == "torchrun" and found["config"]["batch_size"] == 8
    assert "ab_user_model.py:build (Net" in found["config"]["model_description"], out[-2000:]
    assert found["summary"]["candidate"] == "acp-ddp"


def test_ab_under_horovodrun_on_a_user_module_and_torchrun_defaults(tmp_path):
    # A user's model given as package.module:function, its loss the stand-in.
    status, out = run_status(
        [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
         sys.executable, "-m", "hvd_acp.ab", "--model",
         "tests.workers.ab_user_model:build_without_loss", "--methods", "ssgd-fp16,acp",
         "--rounds", "2", "--steps", "2", "--warmup", "1", "--batch-size", "4",
         "--device", "cpu", "--out", str(tmp_path / "hvd")], 240, "hvd-acp-ab, a user module")
    assert status == 0, out[-3000:]
    found = _read(tmp_path / "hvd")
    _check_run(found, ("ssgd-fp16", "acp"), rounds=2, steps=2)
    sent = {k: v["bytes_per_step"] for k, v in found["summary"]["methods"].items()}
    params = 16 * 3 * 9 + 16 + 16 * 16 * 16 * 10 + 10
    assert sent["ssgd-fp16"] == 2 * params          # every gradient once, in fp16
    # The DDP defaults: DDP (fp32, fp16), batched powerSGD_hook, ACP-SGD's hook.
    status, out = run_status(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "hvd_acp.ab",
         "--ddp", "--model", "small", "--rounds", "2", "--steps", "2", "--warmup", "2",
         "--device", "cpu", "--out", str(tmp_path / "ddp")], 240, "hvd-acp-ab --ddp defaults")
    assert status == 0, out[-3000:]
    found = _read(tmp_path / "ddp")
    methods = ("ddp", "ddp-fp16", "powersgd-ddp-batched", "acp-ddp")
    _check_run(found, methods, rounds=2, steps=2)
    sent = {k: v["bytes_per_step"] for k, v in found["summary"]["methods"].items()}
    assert sent["ddp-fp16"] * 2 == sent["ddp"] and sent["acp-ddp"] < sent["ddp"] / 10


def test_ab_refuses_wrong_methods_and_single_rank_without_hanging(tmp_path):
    status, out = run_status(
        [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
         sys.executable, "-m", "hvd_acp.ab", "--model", "small", "--methods", "acp-ddp",
         "--out", str(tmp_path)], 120, "hvd-acp-ab with a DDP method under horovodrun")
    assert status != 0 and "runs under torchrun, with --ddp" in out, out[-2000:]
    assert not (tmp_path / "ab.json").exists()
    status, out = run_status([sys.executable, "-m", "hvd_acp.ab", "--model", "small",
                              "--methods", "acp", "--out", str(tmp_path)], 120,
                             "hvd-acp-ab on one process")
    assert status == 2 and "one rank: nothing is communicated" in out, out[-2000:]
    assert not (tmp_path / "ab.json").exists()


LM_MODEL = "examples/train_lm.py:benchmark_model"


def _adaptive_payload_bytes(model, share=0.3):
    """Bytes ACP-SGD sends per step under AdamW's defaults, from the shapes:
    both factors, (n + m) r of a compressed matrix at ``share`` of its
    smaller side, every other tensor whole, all in fp16."""
    from hvd_acp.fusion import make_layouts
    layouts = make_layouts([(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()],
                           share, 1.0)
    return sum(2 * ((lay.n + lay.m) * lay.r if lay.compressed else lay.numel) for lay in layouts)


def test_ab_under_adamw_reports_the_adaptive_defaults_in_both_launchers(tmp_path):
    """A user's AdamW transformer: every method at the library's defaults for
    an adaptive optimizer, the settings it resolved in the report, ACP-SGD's
    bytes those of both factors at 0.3 of each matrix in fp16, and a profile
    the planner predicts from."""
    status, out = run_status(
        [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
         str(BIN / "hvd-acp-ab"), "--model", LM_MODEL, "--optimizer", "adamw",
         "--batch-size", "2", "--rounds", "2", "--steps", "2", "--warmup", "1",
         "--device", "cpu", "--profile", "--out", str(tmp_path / "hvd")], 300,
        "hvd-acp-ab --optimizer adamw under horovodrun")
    assert status == 0, out[-3000:]
    found = _read(tmp_path / "hvd")
    methods = ("ssgd", "ssgd-fp16", "powersgd", "acp")
    _check_run(found, methods, rounds=2, steps=2)
    assert found["config"]["optimizer"] == "adamw" and found["config"]["matrix_rank"] is None
    summary = found["summary"]["methods"]
    acp, psgd = summary["acp"]["settings"], summary["powersgd"]["settings"]
    assert (acp["matrix_rank"], acp["both_factors"], acp["fp16_wire"]) == (0.3, True, True)
    assert (psgd["matrix_rank"], psgd["fp16_wire"]) == (0.25, True)
    model = build_model(LM_MODEL, 2).model
    assert summary["acp"]["bytes_per_step"] == _adaptive_payload_bytes(model)
    assert summary["ssgd-fp16"]["bytes_per_step"] * 2 == summary["ssgd"]["bytes_per_step"]
    assert ("ACP-SGD (hvd_acp.DistributedOptimizer): matrix rank 0.3 (0.3 of each matrix's "
            "smaller side), both factors every step, one all-reduce, fp16 on the wire") in out, \
        out[-3000:]
    assert "AdamW, matrix rank each method's default for the optimizer" in out
    # Its profile is AdamW's, and the planner predicts every method from it.
    profile = json.loads((tmp_path / "hvd" / "profile.json").read_text())
    assert profile["scheme"] == "both" and profile["optimizer"] == "AdamW"
    from hvd_acp.plan.__main__ import main as plan_main
    assert plan_main(["predict", "--profile", str(tmp_path / "hvd" / "profile.json"),
                      "--np", "2", "--bandwidth", "100mbit", "--no-plot",
                      "--out", str(tmp_path / "plan")]) == 0
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    predicted = plan["predictions"][0]["methods"]
    assert predicted["acp"]["bytes_per_step"] == summary["acp"]["bytes_per_step"]
    assert predicted["ssgd-fp16"]["bytes_per_step"] == summary["ssgd-fp16"]["bytes_per_step"]
    # The DDP hooks under AdamW: torch's powerSGD_hook at the one int rank that
    # sends about what hvd_acp's Power-SGD sends, ACP-SGD's hook at its defaults.
    status, out = run_status(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "hvd_acp.ab",
         "--ddp", "--model", LM_MODEL, "--optimizer", "adamw", "--methods",
         "powersgd-ddp,acp-ddp", "--batch-size", "2", "--rounds", "2", "--steps", "2",
         "--warmup", "2", "--device", "cpu", "--out", str(tmp_path / "ddp")], 300,
        "hvd-acp-ab --ddp --optimizer adamw")
    assert status == 0, out[-3000:]
    found = _read(tmp_path / "ddp")
    from hvd_acp.methods.counting import torch_hook_rank
    adamw = torch.optim.AdamW(model.parameters())
    summary = found["summary"]["methods"]
    assert summary["powersgd-ddp"]["settings"]["matrix_rank"] == torch_hook_rank(model, adamw)
    assert summary["acp-ddp"]["settings"]["both_factors"] is True
    assert summary["acp-ddp"]["bytes_per_step"] == _adaptive_payload_bytes(model)


def test_ab_budget_and_int8_factors_reach_acp_sgds_methods_only(tmp_path):
    """``--budget`` fits ACP-SGD's methods to a share of S-SGD's bytes, as
    ``DistributedOptimizer(budget=X)`` does, in both launchers; the other
    methods keep their defaults; the report says what the budget chose."""
    budget = 0.077
    status, out = run_status(
        [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
         str(BIN / "hvd-acp-ab"), "--model", LM_MODEL, "--optimizer", "adamw",
         "--budget", str(budget), "--methods", "ssgd,powersgd,acp", "--batch-size", "2",
         "--rounds", "1", "--steps", "1", "--warmup", "1", "--device", "cpu",
         "--out", str(tmp_path / "hvd")], 300, "hvd-acp-ab --budget under horovodrun")
    assert status == 0, out[-3000:]
    found = _read(tmp_path / "hvd")
    assert found["config"]["acp_options"] == {"budget": budget}
    summary = found["summary"]["methods"]
    acp, psgd = summary["acp"]["settings"], summary["powersgd"]["settings"]
    # The budget's picks, as the optimizer resolved them (the budget itself is
    # resolved away): both factors, and at 1/13 the 8-bit factors.
    assert acp["both_factors"] is True and acp["int8_factors"] is True
    assert psgd["int8_factors"] is False and psgd["matrix_rank"] == 0.25
    share = summary["acp"]["bytes_per_step"] / summary["ssgd"]["bytes_per_step"]
    assert 0.5 * budget < share <= budget, share
    assert f"chosen for a budget of {budget:g} of S-SGD's fp32 bytes" in out, out[-3000:]
    assert f"sends {share:.3f} of S-SGD's bytes" in out
    # The DDP hook takes the same budget and sends the same bytes.
    status, out = run_status(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "hvd_acp.ab",
         "--ddp", "--model", LM_MODEL, "--optimizer", "adamw", "--budget", str(budget),
         "--methods", "acp-ddp", "--batch-size", "2", "--rounds", "1", "--steps", "1",
         "--warmup", "1", "--device", "cpu", "--out", str(tmp_path / "ddp")], 300,
        "hvd-acp-ab --ddp --budget")
    assert status == 0, out[-3000:]
    ddp = _read(tmp_path / "ddp")["summary"]["methods"]["acp-ddp"]
    assert ddp["settings"]["matrix_rank"] == acp["matrix_rank"]
    assert ddp["settings"]["int8_factors"] is True


@pytest.mark.parametrize("argv, said", [
    (["--budget", "0.1"], "Adam-family"),
    (["--budget", "0.1", "--optimizer", "adamw", "--int8-factors"], "leave out --int8-factors"),
    (["--budget", "0.1", "--optimizer", "adamw", "--methods", "ssgd,powersgd"],
     "--methods names neither"),
])
def test_ab_refuses_a_budget_it_cannot_apply_before_starting(argv, said, capsys):
    """Refused on every rank alike, before any collective starts: no hang."""
    from hvd_acp.ab.__main__ import main
    assert main(argv) == 2
    assert said in capsys.readouterr().err


def test_ab_budget_must_be_a_share(capsys):
    from hvd_acp.ab.__main__ import build_parser
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--budget", bad])
    assert "a share of S-SGD's bytes in (0, 1]" in capsys.readouterr().err
