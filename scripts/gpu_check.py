"""The driver of ``scripts/gpu_check.sh``: the CUDA path of hvd_acp, checked.

Run by ``bash scripts/gpu_check.sh [--device cpu|cuda] [--np N] [--quick]``
(which makes sure the environment exists first), or directly with the
environment's Python. It finds out what this machine and environment have
(:func:`probe`), plans the checks (:func:`plan`: each one runs, or is
skipped with its reason, or falls back to Gloo where NCCL cannot run), runs
each in its own process group with a timeout (:func:`run_check`), prints a
summary with what could not be checked and why (:func:`format_summary`) and
exits non-zero if a check failed (:func:`exit_code`; a skipped check is not a
failure).

The checks (their code is in ``scripts/gpu_check_cases.py``):

``maths``
    the per-parameter compression state on the device, float32 and float64,
    against float64 on the CPU; the Horovod front end in one process.
``replicas``
    under ``horovodrun``: bit-identical replicas and the first averaged
    gradient at matrix rank 2; full rank equal to exact S-SGD.
``swap-resnet50``
    ``hvd.DistributedOptimizer`` -> ``hvd_acp.DistributedOptimizer`` on a
    synthetic ResNet-50 step under ``horovodrun``.
``ddp-hook``
    ``hvd_acp.ddp.acp_hook`` under ``torchrun``: replicas and full rank.
``amp-horovod``, ``amp-ddp``
    ``torch.amp.GradScaler`` (and fp16 autocast on a GPU) in every front end,
    step-ahead on: a constant scale trains the unscaled run, an overflow on
    one rank is skipped on every rank.
``ab-horovod``, ``ab-ddp``
    a short A/B table of ``python -m hvd_acp.ab`` under each launcher.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "scripts" / "gpu_check_cases.py"

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

#: Seconds each check may take at most (less when the total budget runs out).
TIMEOUTS = {"maths": 120, "replicas": 180, "swap-resnet50": 240, "ddp-hook": 180,
            "amp-horovod": 180, "amp-ddp": 180, "ab-horovod": 240, "ab-ddp": 240}
#: The methods of each A/B table, those the installed hvd_acp.methods has.
AB_METHODS = {"horovod": ("ssgd", "ssgd-fp16", "powersgd", "acp"),
              "torchrun": ("ddp", "ddp-fp16", "powersgd-ddp", "acp-ddp")}
AB_CANDIDATE = {"horovod": "acp", "torchrun": "acp-ddp"}
REBUILD_HOROVOD = ("rebuild it with NCCL: .venv/bin/pip uninstall -y horovod && "
                   "bash scripts/install.sh (needs nvcc and NCCL's header)")


@dataclasses.dataclass
class Check:
    """One planned check: a command to run, or the reason it is skipped.

    Attributes:
        name: its row in the summary.
        what: one line for the reader.
        command: the command (None when skipped).
        skip: why it is skipped.
        timeout: seconds it may run.
        out: a folder it writes (the A/B tables).
    """

    name: str
    what: str
    command: Optional[List[str]] = None
    skip: Optional[str] = None
    timeout: float = 120
    out: Optional[Path] = None


@dataclasses.dataclass
class Result:
    name: str
    status: str
    seconds: float
    detail: str


# --------------------------------------------------------------------- probe
PROBE = r"""
import json, os, sys
facts = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
import torch
facts["torch"] = torch.__version__
facts["torch_cuda"] = torch.version.cuda
facts["cuda_available"] = bool(torch.cuda.is_available())
facts["gpus"] = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                 if facts["cuda_available"] else [])
import torch.distributed as dist
facts["torch_gloo"] = bool(dist.is_available() and dist.is_gloo_available())
facts["torch_nccl"] = bool(dist.is_available() and dist.is_nccl_available())
try:
    import horovod, horovod.torch as hvd
    facts["horovod"] = horovod.__version__
    facts["horovod_gloo"] = bool(hvd.gloo_built())
    facts["horovod_nccl"] = bool(hvd.nccl_built())
except Exception as e:
    facts["horovod_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
try:
    import transformers
    facts["transformers"] = transformers.__version__
except Exception as e:
    facts["transformers_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
try:
    import hvd_acp.ab
    from hvd_acp.methods import KEYS, get
    facts["ab_methods"] = {key: get(key).launcher for key in KEYS}
except Exception as e:
    facts["ab_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
print("PROBE " + json.dumps(facts))
"""


def child_env(threads: int) -> Dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    return env


def probe(python: str, timeout: float = 180) -> dict:
    """What ``python`` can do here: torch and CUDA, Horovod's builds, torch's
    backends, transformers, hvd_acp.ab and its methods."""
    status, out, _ = run_command([python, "-c", PROBE], timeout, child_env(1))
    for line in out.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[len("PROBE "):])
    raise RuntimeError(f"{python} could not import torch (exit {status}):\n{out[-3000:]}")


def nvidia_smi_gpus() -> int:
    """GPUs the driver lists (0 without nvidia-smi), to tell a CPU build of
    torch apart from a machine without GPUs."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


# ---------------------------------------------------------------------- plan
def plan(facts: dict, device: str, np: int, quick: bool, out: Path, python: str,
         horovodrun: Optional[str]) -> tuple[List[Check], List[str]]:
    """The checks to run on ``device`` with ``np`` ranks, and the notes on
    what cannot be checked here (each with its reason).

    Pure: everything it knows about the machine is in ``facts`` (see
    :data:`PROBE`).
    """
    gpus = len(facts.get("gpus", [])) if device == "cuda" else 0
    shared = device == "cuda" and np > gpus          # ranks share a GPU
    notes: List[str] = []
    if device == "cpu":
        notes.append("the CUDA path: --device cpu checks the same code on the CPU "
                     "(Gloo everywhere); run without it on a machine with a GPU")
    quick_flag = ["--quick"] if quick else []
    case = [python, str(CASES)]
    checks: List[Check] = []

    checks.append(Check("maths", "compression maths on the device vs float64 on the CPU",
                        case + ["maths", "--device", device] + quick_flag))

    # Horovod: NCCL for CUDA tensors when every rank has its own GPU and
    # Horovod has NCCL; else Gloo through host copies.
    horovod_skip = None
    if "horovod" not in facts:
        horovod_skip = f"Horovod not importable ({facts.get('horovod_error', 'not installed')})"
    elif not facts.get("horovod_gloo"):
        horovod_skip = "Horovod built without Gloo (horovodrun --gloo cannot launch)"
    elif not horovodrun:
        horovod_skip = "horovodrun not found beside the Python or on PATH"
    comm = "direct"
    if horovod_skip is None and device == "cuda":
        if shared:
            comm = "host"
            notes.append(f"Horovod's NCCL all-reduce of CUDA tensors: {gpus} GPU(s) for "
                         f"{np} ranks (NCCL needs one GPU per rank); Horovod checks ran "
                         "Gloo through host copies")
        elif not facts.get("horovod_nccl"):
            comm = "host"
            notes.append("Horovod's NCCL all-reduce of CUDA tensors: Horovod built without "
                         f"NCCL; Horovod checks ran Gloo through host copies ({REBUILD_HOROVOD})")
    launch = ([horovodrun, "-np", str(np), "-H", f"localhost:{np}", "--gloo"]
              if horovodrun else [])
    comm_args = ["--comm", comm]
    checks.append(Check("replicas", "horovodrun: bit-identical replicas, full-rank exactness",
                        None if horovod_skip else
                        launch + case + ["replicas", "--device", device] + comm_args + quick_flag,
                        horovod_skip))

    if device == "cpu":
        sizes = ["--batch-size", "2", "--image-size", "64", "--steps", "2"]
    elif quick:
        sizes = ["--batch-size", "8", "--image-size", "128", "--steps", "2"]
    else:
        sizes = ["--batch-size", "32", "--image-size", "224", "--steps", "3"]
    swap_skip = horovod_skip or (None if "transformers" in facts else
                                 f"transformers not importable "
                                 f"({facts.get('transformers_error', 'not installed')})")
    checks.append(Check("swap-resnet50", "one-line swap on a synthetic ResNet-50 step",
                        None if swap_skip else
                        launch + case + ["swap", "--device", device] + comm_args + sizes,
                        swap_skip))

    # DDP: NCCL when every rank has its own GPU; Gloo (over CUDA tensors) otherwise.
    backend, ddp_skip = "gloo", None
    if device == "cuda":
        if facts.get("torch_nccl") and not shared:
            backend = "nccl"
        else:
            why = (f"{gpus} GPU(s) for {np} ranks (NCCL needs one GPU per rank)" if shared
                   else "this torch has no NCCL backend")
            notes.append(f"DDP over NCCL: {why}; the DDP hook ran on Gloo over CUDA tensors")
    if backend == "gloo" and not facts.get("torch_gloo"):
        ddp_skip = "torch.distributed has no Gloo backend here"
    torchrun = [python, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(np)]
    checks.append(Check("ddp-hook", f"torchrun ({backend}): hvd_acp.ddp replicas and full rank",
                        None if ddp_skip else
                        torchrun + [str(CASES), "ddp", "--device", device, "--backend",
                                    backend] + quick_flag, ddp_skip))

    checks.append(Check("amp-horovod", "horovodrun: GradScaler (fp16 autocast on a GPU), "
                                       "DistributedOptimizer and PowerSGDOptimizer",
                        None if horovod_skip else
                        launch + case + ["amp", "--device", device, "--launcher", "horovod"]
                        + comm_args + quick_flag, horovod_skip))
    checks.append(Check("amp-ddp", f"torchrun ({backend}): GradScaler (fp16 autocast on a "
                                   "GPU), the DDP hook",
                        None if ddp_skip else
                        torchrun + [str(CASES), "amp", "--device", device, "--launcher",
                                    "torchrun", "--backend", backend] + quick_flag, ddp_skip))

    # The A/B tool: one GPU per rank, the same backends as a user's launch.
    model = "small" if device == "cpu" or quick else "resnet50"
    ab_common = ["--model", model, "--rounds", "2", "--steps", "3", "--warmup", "2",
                 "--device", device]
    for launcher, name in (("horovod", "ab-horovod"), ("torchrun", "ab-ddp")):
        skip, methods = ab_skip(facts, launcher, device, shared, gpus, np, horovod_skip, notes)
        folder = out / name
        command = None
        if skip is None:
            tool = ([python, "-m", "hvd_acp.ab"] if launcher == "horovod"
                    else ["-m", "hvd_acp.ab", "--ddp"])        # torchrun runs the module
            command = ((launch if launcher == "horovod" else torchrun) + tool + ab_common
                       + ["--methods", ",".join(methods), "--out", str(folder)])
        where = "horovodrun" if launcher == "horovod" else "torchrun"
        checks.append(Check(name, f"A/B table under {where}", command, skip, out=folder))
    for check in checks:
        check.timeout = TIMEOUTS[check.name]
    return checks, notes


def ab_skip(facts: dict, launcher: str, device: str, shared: bool, gpus: int, np: int,
            horovod_skip: Optional[str], notes: List[str]) -> tuple[Optional[str], List[str]]:
    """(why the A/B table of ``launcher`` cannot run, or None; its methods)."""
    if "ab_methods" not in facts:
        return "hvd_acp.ab not available", []
    known = facts["ab_methods"]
    wanted = AB_METHODS[launcher]
    methods = [key for key in wanted if known.get(key) == launcher]
    missing = [key for key in wanted if key not in methods]
    if AB_CANDIDATE[launcher] not in methods or len(methods) < 2:
        return f"hvd_acp.methods lacks {', '.join(missing)}", methods
    if missing:
        notes.append(f"A/B under {launcher}: {', '.join(missing)} not in hvd_acp.methods")
    if launcher == "horovod" and horovod_skip:
        return horovod_skip, methods
    if device == "cuda":
        if shared:
            return f"hvd-acp-ab needs one GPU per rank ({gpus} for {np} ranks)", methods
        if launcher == "horovod" and not facts.get("horovod_nccl"):
            return ("Horovod built without NCCL: hvd-acp-ab hands CUDA tensors to Horovod "
                    f"({REBUILD_HOROVOD})"), methods
        if launcher == "torchrun" and not facts.get("torch_nccl"):
            return "this torch has no NCCL backend (hvd-acp-ab --ddp uses NCCL on CUDA)", methods
    elif launcher == "torchrun" and not facts.get("torch_gloo"):
        return "torch.distributed has no Gloo backend here", methods
    return None, methods


# ----------------------------------------------------------------------- run
def run_command(command: List[str], timeout: float, env: Dict[str, str]) -> tuple[int, str, bool]:
    """(exit status, output, timed out) of ``command`` run from the
    repository in its own process group, killed whole on timeout."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -signal.SIGKILL, out, True


def detail_of(output: str) -> str:
    """The check's ``DETAIL`` line (launchers prefix it with the rank)."""
    for line in output.splitlines():
        _, _, text = line.partition(">:")
        text = (text or line).strip()
        if text.startswith("DETAIL "):
            return text[len("DETAIL "):]
    return ""


def failure_of(output: str) -> str:
    """The most telling line of a failed check's output: the first exception
    a rank raised (the launcher's own errors come after it), else the last line."""
    lines = [line.partition(">:")[2].strip() or line.strip() for line in output.splitlines()]
    for line in lines:
        if re.match(r"^[\w.]*(Error|Exception): ", line) and "ChildFailedError" not in line:
            return line[:300]
    return next((line for line in reversed(lines) if line), "no output")[:300]


def ab_detail(folder: Optional[Path]) -> tuple[Optional[str], str]:
    """(the A/B table as written by hvd_acp.ab, its recommendation)."""
    if folder is None or not (folder / "ab.md").exists():
        return None, ""
    table = (folder / "ab.md").read_text()
    line = ""
    try:
        line = json.loads((folder / "ab.json").read_text())["summary"]["recommendation"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return table, line


def run_check(check: Check, env: Dict[str, str], log_dir: Path, time_left: float,
              echo=print) -> Result:
    """Run ``check`` (or skip it) and judge it: exit 0 is PASS, anything
    else (a timeout too) FAIL. Its whole output goes to ``log_dir``."""
    if check.skip is not None:
        return Result(check.name, SKIP, 0.0, check.skip)
    if time_left < 10:
        return Result(check.name, SKIP, 0.0, "no time left of --total-timeout")
    timeout = min(check.timeout, time_left)
    echo(f"[gpu_check] {check.name}: {check.what} (timeout {timeout:.0f} s)", flush=True)
    start = time.monotonic()
    status, out, timed_out = run_command(check.command, timeout, env)
    seconds = time.monotonic() - start
    (log_dir / f"{check.name}.log").write_text(" ".join(check.command) + "\n\n" + out)
    if timed_out:
        return Result(check.name, FAIL, seconds, f"timed out after {timeout:.0f} s (a hang?); "
                                                 f"last line: {failure_of(out)}")
    if status != 0:
        return Result(check.name, FAIL, seconds, f"exit {status}: {failure_of(out)}")
    if check.out is not None:
        table, line = ab_detail(check.out)
        if table is None:
            return Result(check.name, FAIL, seconds, f"exit 0 but no ab.md in {check.out}")
        return Result(check.name, PASS, seconds, line or "table written")
    return Result(check.name, PASS, seconds, detail_of(out) or "exit 0")


# ------------------------------------------------------------------- summary
def exit_code(results: List[Result]) -> int:
    """1 if any check failed, else 0 (a skipped check is not a failure)."""
    return 1 if any(r.status == FAIL for r in results) else 0


def format_summary(results: List[Result], notes: List[str], header: str) -> str:
    """The table every run ends with: one row per check, PASS / FAIL /
    SKIP(reason), then what was not checked and why."""
    width = max(len(r.name) for r in results)
    lines = ["", f"== {header} ==", f"{'check':<{width}}  result  seconds  details"]
    for r in results:
        status = r.status if r.status != SKIP else f"SKIP({r.detail})"
        detail = "" if r.status == SKIP else r.detail
        if r.status == SKIP:
            lines.append(f"{r.name:<{width}}  {status}")
        else:
            lines.append(f"{r.name:<{width}}  {status:<6}  {r.seconds:7.1f}  {detail}")
    unchecked = [f"{r.name}: {r.detail}" for r in results if r.status == SKIP] + notes
    if unchecked:
        lines.append("Not checked, and why:")
        lines.extend(f"  - {item}" for item in unchecked)
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP)}
    lines.append(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped: "
                 + ("FAILED" if exit_code(results) else "OK"))
    return "\n".join(lines)


def describe(facts: dict, device: str, np: int) -> str:
    gpus = facts.get("gpus", [])
    cuda = (f"CUDA {facts['torch_cuda']}, {len(gpus)} GPU(s): {', '.join(sorted(set(gpus)))}"
            if gpus else "no CUDA device")
    horovod = (f"Horovod {facts['horovod']} (NCCL {'yes' if facts.get('horovod_nccl') else 'no'})"
               if "horovod" in facts else "no Horovod")
    return (f"hvd_acp GPU check: --device {device}, {np} ranks; torch {facts['torch']} "
            f"({cuda}); {horovod}")


# ---------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/gpu_check.sh",
        description="Check hvd_acp's CUDA path on this machine (or its CPU path with "
                    "--device cpu): compression maths, replicas and full-rank exactness "
                    "under Horovod, the one-line swap on ResNet-50, the DDP hook under "
                    "torchrun and a short A/B table.")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda where torch sees a GPU; otherwise it stops and "
                        "says so (use --device cpu to check the CPU path)")
    p.add_argument("--np", type=int, default=None,
                   help="ranks (default: the number of GPUs, at least 2; 2 on the CPU)")
    p.add_argument("--quick", action="store_true",
                   help="fewer steps and smaller models")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for logs, A/B tables and summary.json (default: a new "
                        "temporary folder)")
    p.add_argument("--total-timeout", type=float, default=480,
                   help="seconds for all the checks together (default 480)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    python = sys.executable
    try:
        facts = probe(python)
    except (RuntimeError, subprocess.SubprocessError, ValueError) as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return 2
    device = args.device
    if device is None:
        if not facts["cuda_available"]:
            listed = nvidia_smi_gpus()
            why = (f"nvidia-smi lists {listed} GPU(s) but torch {facts['torch']} cannot use "
                   "them (a CPU build of torch, or a driver too old for it)" if listed else
                   f"torch {facts['torch']} sees no CUDA device")
            print(f"gpu_check: {why}. Run `bash scripts/gpu_check.sh --device cpu` to check "
                  "the same code on the CPU.", file=sys.stderr)
            return 2
        device = "cuda"
    if device == "cuda" and not facts["cuda_available"]:
        print(f"gpu_check: --device cuda, but torch {facts['torch']} sees no CUDA device",
              file=sys.stderr)
        return 2
    np = args.np if args.np is not None else (max(2, len(facts["gpus"])) if device == "cuda"
                                              else 2)
    if np < 2:
        print(f"gpu_check: --np must be at least 2 (replicas are compared across ranks), "
              f"got {np}", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="hvd_acp_gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    horovodrun = Path(python).with_name("horovodrun")
    horovodrun = str(horovodrun) if horovodrun.exists() else shutil.which("horovodrun")
    checks, notes = plan(facts, device, np, args.quick, out, python, horovodrun)
    threads = 1 if device == "cpu" else max(1, (facts.get("cpus") or 1) // np)
    env = child_env(threads)
    header = describe(facts, device, np)
    print(header, flush=True)
    deadline = time.monotonic() + args.total_timeout
    results = []
    for check in checks:
        result = run_check(check, env, out, deadline - time.monotonic())
        mark = result.status if result.status != SKIP else f"SKIP({result.detail})"
        print(f"[gpu_check] {check.name}: {mark}"
              + (f" in {result.seconds:.1f} s: {result.detail}" if result.status != SKIP else ""),
              flush=True)
        results.append(result)
    for check in checks:
        table, _ = ab_detail(check.out)
        if table:
            print(f"\n-- A/B table, {check.name} ({check.out}) --\n{table.strip()}")
    print(format_summary(results, notes, header))
    print(f"Logs: {out}")
    (out / "summary.json").write_text(json.dumps(
        {"header": header, "device": device, "np": np, "facts": facts, "notes": notes,
         "results": [dataclasses.asdict(r) for r in results]}, indent=1))
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
