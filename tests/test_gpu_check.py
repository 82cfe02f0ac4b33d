"""scripts/gpu_check.sh: its CPU run for real, and the driver's planning and
verdicts in one process.

No GPU here: the plans for one GPU, several GPUs and a Horovod without NCCL
are checked from made-up probe results, and the host-staged Horovod path
that one GPU uses runs for real on CPU tensors.
"""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.hvdrun import REPO, horovodrun, rank_lines, run_status

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

CHECKS = ["maths", "replicas", "swap-resnet50", "ddp-hook", "amp-horovod", "amp-ddp",
          "ab-horovod", "ab-ddp"]
AB_METHODS = {"ssgd": "horovod", "ssgd-fp16": "horovod", "powersgd": "horovod",
              "acp": "horovod", "ddp": "torchrun", "ddp-fp16": "torchrun",
              "powersgd-ddp": "torchrun", "acp-ddp": "torchrun"}


def facts(gpus=0, horovod_nccl=False, torch_nccl=False, **changes):
    found = {"torch": "2.13.0", "torch_cuda": "12.8" if gpus else None,
             "cuda_available": gpus > 0, "gpus": ["NVIDIA H200"] * gpus, "cpus": 16,
             "torch_gloo": True, "torch_nccl": torch_nccl, "horovod": "0.28.1",
             "horovod_gloo": True, "horovod_nccl": horovod_nccl, "transformers": "5.24.0",
             "ab_methods": dict(AB_METHODS)}
    found.update(changes)
    return {k: v for k, v in found.items() if v is not None or k == "torch_cuda"}


def planned(found, device="cuda", np=2, tmp=Path("/tmp/x")):
    checks, notes = gpu_check.plan(found, device, np, False, tmp, "py", "horovodrun")
    assert [c.name for c in checks] == CHECKS
    return {c.name: c for c in checks}, notes


# ------------------------------------------------------- plans, in one process
def test_two_gpus_with_nccl_run_everything_on_nccl():
    checks, notes = planned(facts(gpus=2, horovod_nccl=True, torch_nccl=True))
    assert all(c.skip is None for c in checks.values()), checks
    assert checks["replicas"].command[:6] == ["horovodrun", "-np", "2", "-H", "localhost:2",
                                              "--gloo"]
    assert checks["replicas"].command[-3:] == ["cuda", "--comm", "direct"]
    assert "--backend" in checks["ddp-hook"].command
    assert checks["ddp-hook"].command[-1] == "nccl"
    ab = checks["ab-ddp"].command
    assert ab[ab.index("--methods") + 1] == "ddp,ddp-fp16,powersgd-ddp,acp-ddp"
    assert ab[ab.index("--device") + 1] == "cuda" and ab[ab.index("--model") + 1] == "resnet50"
    assert notes == []


def test_one_gpu_runs_gloo_over_cuda_tensors_and_says_what_it_could_not_check():
    checks, notes = planned(facts(gpus=1, horovod_nccl=True, torch_nccl=True))
    assert checks["replicas"].command[-2:] == ["--comm", "host"]
    assert checks["swap-resnet50"].command[checks["swap-resnet50"].command.index("--comm") + 1] \
        == "host"
    assert checks["ddp-hook"].command[-1] == "gloo"
    for name in ("ab-horovod", "ab-ddp"):
        assert checks[name].skip == "hvd-acp-ab needs one GPU per rank (1 for 2 ranks)"
    assert any(n.startswith("Horovod's NCCL all-reduce of CUDA tensors: 1 GPU(s) for 2 ranks")
               for n in notes), notes
    assert any(n.startswith("DDP over NCCL: 1 GPU(s) for 2 ranks") for n in notes), notes


def test_horovod_without_nccl_falls_back_and_names_the_rebuild():
    checks, notes = planned(facts(gpus=4, horovod_nccl=False, torch_nccl=True), np=4)
    assert checks["replicas"].command[-2:] == ["--comm", "host"]
    assert checks["ddp-hook"].command[-1] == "nccl"
    assert checks["ab-horovod"].skip.startswith("Horovod built without NCCL")
    assert checks["ab-ddp"].skip is None
    assert any("Horovod built without NCCL" in n and "pip uninstall -y horovod" in n
               for n in notes), notes


def test_missing_pieces_become_skips_with_their_reason():
    checks, _ = planned(facts(horovod=None, horovod_error="ImportError: no horovod",
                              transformers=None, ab_methods=None), device="cpu")
    reason = "Horovod not importable (ImportError: no horovod)"
    assert checks["replicas"].skip == reason and checks["swap-resnet50"].skip == reason
    assert checks["ab-horovod"].skip == checks["ab-ddp"].skip == "hvd_acp.ab not available"
    assert checks["maths"].skip is None and checks["ddp-hook"].skip is None
    checks, notes = planned(facts(ab_methods={"acp": "horovod", "ssgd": "horovod"}),
                            device="cpu")
    assert checks["ab-horovod"].skip is None
    assert checks["ab-ddp"].skip == "hvd_acp.methods lacks ddp, ddp-fp16, powersgd-ddp, acp-ddp"
    assert any("ssgd-fp16, powersgd not in hvd_acp.methods" in n for n in notes), notes


# --------------------------------------------------- verdicts, in one process
def test_a_failed_check_fails_the_run_and_a_skipped_one_does_not(tmp_path):
    env = gpu_check.child_env(1)
    failing = gpu_check.Check("maths", "fails", [sys.executable, "-c",
                                                 "print('DETAIL no'); raise ValueError('boom')"])
    passing = gpu_check.Check("replicas", "passes", [sys.executable, "-c",
                                                     "print('[0]<stdout>:DETAIL all good')"])
    hanging = gpu_check.Check("ddp-hook", "hangs", [sys.executable, "-c",
                                                    "import time; time.sleep(60)"], timeout=2)
    skipped = gpu_check.Check("ab-ddp", "skipped", skip="hvd_acp.ab not available")
    results = [gpu_check.run_check(c, env, tmp_path, 100, echo=lambda *a, **k: None)
               for c in (failing, passing, hanging, skipped)]
    assert [r.status for r in results] == ["FAIL", "PASS", "FAIL", "SKIP"]
    assert results[0].detail == "exit 1: ValueError: boom"
    assert results[1].detail == "all good"
    assert results[2].detail.startswith("timed out after 2 s") and results[2].seconds < 30
    assert (tmp_path / "maths.log").read_text().endswith("ValueError: boom\n")
    assert gpu_check.exit_code(results) == 1
    assert gpu_check.exit_code(results[1:2] + results[3:]) == 0
    text = gpu_check.format_summary(results, ["the CUDA path: no GPU"], "header")
    assert "ab-ddp    SKIP(hvd_acp.ab not available)" in text
    assert "  - ab-ddp: hvd_acp.ab not available\n  - the CUDA path: no GPU" in text
    assert text.endswith("1 passed, 2 failed, 1 skipped: FAILED")
    late = gpu_check.run_check(passing, env, tmp_path, 5)
    assert (late.status, late.detail) == ("SKIP", "no time left of --total-timeout")


# --------------------------------------------------------------- real runs
@pytest.mark.horovod
def test_host_staged_horovod_path_on_cpu_tensors():
    # The path two ranks sharing one GPU take: every collective through host copies.
    out = horovodrun(str(REPO / "scripts" / "gpu_check_cases.py"), "replicas", "--device",
                     "cpu", "--comm", "host", "--quick", timeout=180).stdout
    details = rank_lines(out, "DETAIL")
    assert len(details) == 1 and "(Gloo through host copies): replicas bit-identical" \
        in details[0], out[-3000:]


def test_without_a_gpu_it_stops_and_suggests_cpu():
    status, out = run_status(["bash", "scripts/gpu_check.sh", "--skip-install"], 120,
                             "gpu_check.sh without --device")
    assert status == 2, out[-2000:]
    assert "Run `bash scripts/gpu_check.sh --device cpu`" in out


@pytest.mark.horovod
@pytest.mark.ddp
def test_gpu_check_device_cpu_is_green(tmp_path):
    status, out = run_status(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--out",
                              str(tmp_path)], 600, "gpu_check.sh --device cpu",
                             env={"GPU_CHECK_SKIP_INSTALL": "1"})
    assert status == 0, out[-6000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    results = {r["name"]: r for r in summary["results"]}
    assert list(results) == CHECKS
    for name in ("maths", "replicas", "swap-resnet50", "ddp-hook", "amp-horovod", "amp-ddp"):
        assert results[name]["status"] == "PASS", results[name]
    for name in ("ab-horovod", "ab-ddp"):
        # The A/B tool is optional: a table, or a skip that says it is missing.
        r = results[name]
        assert r["status"] == "PASS" or (r["status"] == "SKIP" and (
            r["detail"] == "hvd_acp.ab not available"
            or r["detail"].startswith("hvd_acp.methods lacks"))), r
        if r["status"] == "PASS":
            assert (tmp_path / name / "ab.md").exists()
    assert "replicas bit-identical" in results["replicas"]["detail"]
    assert "full rank float64" in results["ddp-hook"]["detail"]
    for name, front_ends in (("amp-horovod", ("DistributedOptimizer", "PowerSGDOptimizer")),
                             ("amp-ddp", ("DDP hook",))):
        for label in front_ends:
            assert f"{label}: constant scale 0.0e+00 from unscaled" in results[name]["detail"]
    assert "== hvd_acp GPU check: --device cpu, 2 ranks;" in out
    assert "0 failed" in out and out.rstrip().splitlines()[-2].endswith(": OK")
    assert "the CUDA path: --device cpu checks the same code on the CPU" in out
