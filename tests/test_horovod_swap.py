"""The one-line swap holds for what Horovod's own optimizer tests check.

Each test launches ``tests/workers/swap_cases.py`` under ``horovodrun --gloo``;
the worker asserts the behaviour on every rank (often against
``hvd.DistributedOptimizer`` on a copy of the model) and prints
``OK <case> <rank>``.
"""
import pytest

from tests.hvdrun import horovodrun, rank_lines

pytestmark = pytest.mark.horovod

TIMEOUT_S = 300


def run(case, np=2, env=None, timeout=TIMEOUT_S):
    result = horovodrun("swap_cases.py", case, np=np, timeout=timeout, env=env)
    assert sorted(int(line.split()[-1]) for line in rank_lines(result.stdout, "OK " + case)) \
        == list(range(np)), result.stdout[-4000:]
    return result


def test_frozen_integer_parameter_is_carried_and_its_state_broadcast():
    run("frozen_int")


def test_step_after_synchronize_warns_like_horovod_without_sending_again():
    run("step_warning")


def test_generated_parameter_names_are_horovods():
    run("parameter_names")


def test_sparse_gradients_reach_the_optimizer_sparse_both_ways():
    run("sparse")


def test_rank_outside_the_process_set_steps_locally():
    run("process_set")


def test_construction_runs_no_collective_outside_the_process_set():
    run("process_set_construction", np=3)


def test_broadcast_state_and_options_of_every_torch_optimizer():
    result = run("broadcast_state", timeout=540)      # fourteen optimizers
    for line in rank_lines(result.stdout, "BROADCAST "):
        assert "SparseAdam" in line and "Muon" in line, line


def test_names_checked_on_every_rank_and_requires_grad_may_change():
    run("names_and_requires_grad")
