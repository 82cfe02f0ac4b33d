"""``hvd_acp.integrations``: ACP-SGD under PyTorch Lightning, Hugging Face
Accelerate and the Transformers ``Trainer``.

Each framework trains the digits MLP on 2 CPU processes (Gloo) under its own
launcher (``tests/workers/<framework>_train.py``): plain DDP, ACP-SGD, and a
resume through the framework's own checkpoints. The tests read what every
rank measured:

- the hook is registered: each rank sent exactly ACP-SGD's payload, about
  15x less than the full gradient (a hook silently not registered sends 0);
- replicas stay bit-identical across ranks (all_gather of the parameters);
- training works: the loss falls and the accuracy is within ACCURACY_GAP of
  the plain-DDP run of the same task, seeds and steps;
- a resume continues: step count and factors as saved, residuals installed
  only on the rank that saved them, replicas identical (and, where every
  rank saves its own file, the very weights of the uninterrupted run).

Then single-process checks of the refusals (FSDP, DeepSpeed, one process).
"""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.hvdrun import WORKERS, run_with_timeout, torchrun

#: Largest accepted drop of ACP-SGD's test accuracy below plain DDP after 72
#: steps (seen: 0.3 to 1.4 points, 3.7 after Lightning's resume, which restarts
#: rank 1's residual from zero; a shift baked into the weights by a missed
#: step-ahead restore breaks the replica check first).
ACCURACY_GAP = 0.06
#: Largest accepted excess of ACP-SGD's test loss over plain DDP's.
LOSS_GAP = 0.2
#: The loss must fall at least this much (the first evaluation is ~2.31).
LOSS_FALLS_TO = 0.3
STEPS, SAVED_STEP = 72, 48


def results(directory: Path, framework: str, output: str) -> list:
    """Every rank's results, or a test failure showing the output."""
    found = []
    for rank in (0, 1):
        path = directory / f"result.{framework}.{rank}.json"
        if not path.is_file():
            pytest.fail(f"{framework}: rank {rank} wrote no results\n{output[-8000:]}")
        found.append(json.loads(path.read_text()))
    return found


def hf_env(tmp_path: Path) -> dict:
    """No user config (e.g. an ``accelerate config`` choosing DeepSpeed), no hub."""
    return {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def lightning_results(tmp_path_factory):
    pytest.importorskip("lightning", reason="pip install hvd_acp[lightning]")
    directory = tmp_path_factory.mktemp("lightning")
    # Lightning's own launcher starts rank 1 (devices=2, strategy="ddp").
    out = run_with_timeout([sys.executable, str(WORKERS / "lightning_train.py"),
                            "--dir", str(directory)], 300, "lightning_train.py")
    return results(directory, "lightning", out)


@pytest.fixture(scope="module")
def accelerate_results(tmp_path_factory):
    pytest.importorskip("accelerate", reason="pip install hvd_acp[accelerate]")
    directory = tmp_path_factory.mktemp("accelerate")
    launcher = Path(sys.executable).with_name("accelerate")
    out = run_with_timeout(
        [str(launcher), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend", "no",
         str(WORKERS / "accelerate_train.py"), "--dir", str(directory)],
        300, "accelerate launch accelerate_train.py", env=hf_env(directory))
    return results(directory, "accelerate", out)


@pytest.fixture(scope="module")
def transformers_results(tmp_path_factory):
    pytest.importorskip("transformers", reason="pip install hvd_acp[transformers]")
    directory = tmp_path_factory.mktemp("transformers")
    out = torchrun("trainer_train.py", "--dir", str(directory), np=2, timeout=300,
                   env=hf_env(directory))
    return results(directory, "transformers", out)


def launch_amp(framework: str, directory: Path) -> str:
    """``tests/workers/integration_amp.py`` under the framework's own launcher."""
    worker = [str(WORKERS / "integration_amp.py"), framework, "--dir", str(directory)]
    if framework == "lightning":
        return run_with_timeout([sys.executable, *worker], 300, "integration_amp.py lightning")
    if framework == "accelerate":
        launcher = Path(sys.executable).with_name("accelerate")
        return run_with_timeout(
            [str(launcher), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
             "1", "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend",
             "no", *worker], 300, "accelerate launch integration_amp.py",
            env=hf_env(directory))
    return torchrun(*worker, np=2, timeout=300, env=hf_env(directory))


FRAMEWORKS = [pytest.param("lightning", marks=pytest.mark.lightning),
              pytest.param("accelerate", marks=pytest.mark.accelerate),
              pytest.param("transformers", marks=pytest.mark.transformers)]


@pytest.fixture
def ranks(request, framework):
    return request.getfixturevalue(f"{framework}_results")


# ------------------------------------------------------------ several ranks
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_hook_sends_acp_payloads(ranks):
    """Every step sent ACP-SGD's payload, with step-ahead's optimizer attached."""
    for result in ranks:
        acp = result["acp"]
        assert acp["steps"] == STEPS and acp["allreduces"] == STEPS, acp
        assert acp["bytes_sent"] == acp["expected_bytes"], acp
        per_step = acp["bytes_sent"] / acp["steps"]
        assert per_step < result["dense_bytes"] / 10, (per_step, result["dense_bytes"])
        assert acp["optimizer_attached"] and result["resumed"]["optimizer_attached"]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_replicas_bit_identical(ranks):
    for result in ranks:
        for run in ("plain", "acp", "resumed"):
            assert result[run]["identical"], (run, result["rank"])


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_trains_like_plain_ddp(ranks):
    plain, acp = ranks[0]["plain"], ranks[0]["acp"]
    assert acp["final"]["loss"] < LOSS_FALLS_TO * acp["initial"]["loss"], acp
    assert acp["final"]["accuracy"] >= plain["final"]["accuracy"] - ACCURACY_GAP, (acp, plain)
    assert acp["final"]["loss"] <= plain["final"]["loss"] + LOSS_GAP, (acp, plain)
    resumed = ranks[0]["resumed"]["final"]
    assert resumed["accuracy"] >= plain["final"]["accuracy"] - ACCURACY_GAP, (resumed, plain)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_resume_continues_step_count_and_factors(ranks, framework):
    for result in ranks:
        resumed = result["resumed"]
        assert result["saved_step"] == SAVED_STEP
        assert resumed["start_step"] == SAVED_STEP, resumed
        assert resumed["factors_continue"], resumed
        assert resumed["steps"] == STEPS and resumed["allreduces"] == STEPS - SAVED_STEP
        if framework == "lightning":
            # One checkpoint, written by rank 0: its residual goes back to rank
            # 0 only; the other ranks restart theirs from zero.
            expected = result["saved_residual"] if result["rank"] == 0 else 0.0
            assert resumed["start_residual"] == expected, (result["rank"], resumed)
        else:
            # A file per rank: each rank gets its own residual back, and the
            # resumed run retraces the uninterrupted one bit for bit.
            assert result["rank_file"]
            assert resumed["start_residual"] == result["saved_residual"] > 0, resumed
            assert resumed["same_as_uninterrupted"], resumed


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_frameworks_fp16_switch_trains_at_the_defaults(framework, tmp_path):
    """The framework's own fp16 mixed precision (its GradScaler from 65536,
    autocast, its clipping after unscale_), ACP-SGD at default settings with
    SGD and momentum: it trains as the run without mixed precision does, the
    shift in the scaler's units (before the fix: NaN, the scale driven to 0)."""
    pytest.importorskip({"lightning": "lightning", "accelerate": "accelerate",
                         "transformers": "transformers"}[framework])
    output = launch_amp(framework, tmp_path)
    for rank in (0, 1):
        path = tmp_path / f"result.{framework}-amp.{rank}.json"
        if not path.is_file():
            pytest.fail(f"{framework}: rank {rank} wrote no results\n{output[-8000:]}")
        result = json.loads(path.read_text())
        plain, amp = result["plain"], result["amp"]
        for run in (plain, amp):
            assert run["finite"] and run["identical"] and run["steps"] == STEPS, run
            assert run["final"]["loss"] < LOSS_FALLS_TO * run["initial"]["loss"], run
        assert amp["final"]["accuracy"] >= plain["final"]["accuracy"] - ACCURACY_GAP, result
        assert amp["final"]["loss"] <= plain["final"]["loss"] + LOSS_GAP, result
        # The scaler was not driven down, and the shift read its units.
        assert amp["scale"] >= 2.0 ** 8, amp
        assert plain["unit"] == 1.0 and amp["unit"] * amp["scale"] == 1.0, result


# --------------------------------------------------------------- one process
class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_torch_optimizer_behind_wrappers():
    from hvd_acp.integrations._common import torch_optimizer
    opt = torch.optim.SGD(TwoLayers().parameters(), lr=0.1)
    assert torch_optimizer(opt) is opt
    assert torch_optimizer(types.SimpleNamespace(optimizer=opt)) is opt      # Accelerate's
    assert torch_optimizer(types.SimpleNamespace(_optimizer=opt)) is opt     # Lightning's
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer .* got list"):
        torch_optimizer([])


@pytest.mark.lightning
def test_lightning_refusals():
    pytest.importorskip("lightning", reason="pip install hvd_acp[lightning]")
    import lightning.pytorch as L
    from lightning.pytorch.strategies import (DDPStrategy, DeepSpeedStrategy, FSDPStrategy,
                                              SingleDeviceStrategy)

    from hvd_acp.ddp import acp_hook
    from hvd_acp.integrations.lightning import ACPCallback, _check_strategy

    with pytest.raises(ValueError, match="matrix_rank must be a positive int, got 0"):
        ACPCallback(matrix_rank=0)
    with pytest.raises(ValueError, match="step_ahead must be a finite number >= 0"):
        ACPCallback(step_ahead=-1)
    # Strategies without a DDP module (built bare: FSDP and DeepSpeed would
    # want a process group or the deepspeed package).
    for cls, match in ((FSDPStrategy, "FSDPStrategy: FSDP reduce-scatters.*strategy='ddp'"),
                       (DeepSpeedStrategy, "DeepSpeedStrategy: DeepSpeed runs its own.*'ddp'")):
        with pytest.raises(ValueError, match=match):
            _check_strategy(cls.__new__(cls))
    with pytest.raises(ValueError, match="ddp_comm_hook already"):
        _check_strategy(DDPStrategy(ddp_comm_hook=acp_hook))
    _check_strategy(DDPStrategy())

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = TwoLayers()

        def training_step(self, batch, index):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(torch.randn(4, 8))
            return torch.utils.data.DataLoader(data, batch_size=2)

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[ACPCallback()])
    assert isinstance(trainer.strategy, SingleDeviceStrategy)
    with pytest.raises(ValueError, match=r"SingleDeviceStrategy has none \(one process"):
        trainer.fit(Module())


@pytest.mark.accelerate
def test_accelerate_refusals():
    pytest.importorskip("accelerate", reason="pip install hvd_acp[accelerate]")
    from accelerate.utils import DistributedType

    from hvd_acp.integrations.accelerate import register_acp

    model = TwoLayers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kind, match in ((DistributedType.NO, "NO: a single process .*accelerate launch"),
                        (DistributedType.FSDP, "FSDP: FSDP reduce-scatters"),
                        (DistributedType.DEEPSPEED, "DEEPSPEED: DeepSpeed runs its own")):
        accelerator = types.SimpleNamespace(distributed_type=kind, process_index=0)
        with pytest.raises(ValueError, match=f"distributed_type={match}"):
            register_acp(accelerator, model, opt)
    accelerator = types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU,
                                        process_index=0)
    with pytest.raises(ValueError, match="model must be the DistributedDataParallel module "
                                         "that accelerator.prepare.. returned, got TwoLayers"):
        register_acp(accelerator, model, opt)
    with pytest.raises(ValueError, match="matrix_rank must be a positive int"):
        register_acp(accelerator, model, opt, matrix_rank=-1)


@pytest.mark.transformers
def test_trainer_refusals(tmp_path):
    pytest.importorskip("transformers", reason="pip install hvd_acp[transformers]")
    from transformers import Trainer, TrainingArguments

    from hvd_acp.integrations.transformers import register_acp

    class Classifier(TwoLayers):
        def forward(self, x, labels=None):
            return {"loss": super().forward(x).sum()}

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = Trainer(model=Classifier(), args=args)
    with pytest.raises(ValueError, match="parallel_mode=not_parallel: a single process .* "
                                         "torchrun"):
        register_acp(trainer)
    for flag, match in (("is_deepspeed_enabled", "DeepSpeed: DeepSpeed runs its own"),
                        ("is_fsdp_enabled", "FSDP: FSDP reduce-scatters")):
        fake = types.SimpleNamespace(is_deepspeed_enabled=False, is_fsdp_enabled=False,
                                     args=args)
        setattr(fake, flag, True)
        with pytest.raises(ValueError, match=f"cannot train with {match}"):
            register_acp(fake)
