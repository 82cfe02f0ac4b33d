"""Production contract under horovodrun --gloo: checkpoints, accumulation, AMP,
Horovod's other arguments, several optimizers, process sets."""
import pytest

from tests.hvdrun import horovodrun, rank_lines

pytestmark = pytest.mark.horovod


def ok_ranks(output, case):
    return sorted(int(line.split()[-1]) for line in rank_lines(output, "OK " + case))


@pytest.mark.parametrize("case", ["accumulation", "amp", "dtypes", "horovod_args", "several"])
def test_contract_case(case):
    result = horovodrun("contract_cases.py", case, np=2, timeout=240)
    assert ok_ranks(result.stdout, case) == [0, 1]


def test_checkpoints_resume_and_load_at_other_world_size(tmp_path):
    result = horovodrun("contract_cases.py", "checkpoint", str(tmp_path), np=2, timeout=240)
    assert ok_ranks(result.stdout, "checkpoint") == [0, 1]
    assert (tmp_path / "ckpt.0.pt").exists() and (tmp_path / "ckpt.1.pt").exists()
    result = horovodrun("contract_cases.py", "load_other_world", str(tmp_path), np=3,
                        timeout=240)
    assert ok_ranks(result.stdout, "load_other_world") == [0, 1, 2]


def test_two_process_sets_train_two_models():
    result = horovodrun("contract_cases.py", "process_sets", np=4, timeout=300)
    assert ok_ranks(result.stdout, "process_sets") == [0, 1, 2, 3]
