"""The core optimizer on several real processes (horovodrun --gloo).

Each world size is one launch of ``tests/workers/core_cases.py`` (starting
horovodrun costs several seconds); the checks it runs are reported on one
line per rank, and each test below asserts its own lines. The worker does
the numerical comparisons itself, see its docstring.
"""
import pytest

from tests.hvdrun import horovodrun, rank_lines

pytestmark = [pytest.mark.horovod, pytest.mark.timeout(300)]

LAUNCH_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def two_ranks():
    return horovodrun("core_cases.py", "two", np=2, timeout=LAUNCH_TIMEOUT_S, check=False)


@pytest.fixture(scope="module")
def three_ranks():
    return horovodrun("core_cases.py", "three", np=3, timeout=LAUNCH_TIMEOUT_S, check=False)


def reports(result, tag):
    """{rank: rest of the line} of the lines ``<tag> rank=<rank> ...``."""
    found = {}
    for line in rank_lines(result.stdout, tag + " "):
        field, _, rest = line.partition(" ")
        assert field.startswith("rank="), line
        found[int(field[len("rank="):])] = rest
    return found


def assert_reported(result, tag, world):
    found = reports(result, tag)
    assert sorted(found) == list(range(world)), (
        f"{tag!r} reported by ranks {sorted(found)} of {world}; exit code "
        f"{result.returncode}\n{result.stdout[-6000:]}")
    return found


@pytest.mark.parametrize("launch, world", [("two_ranks", 2), ("three_ranks", 3)])
def test_every_rank_completes(launch, world, request):
    result = request.getfixturevalue(launch)
    assert_reported(result, "DONE", world)
    assert result.returncode == 0, result.stdout[-6000:]


@pytest.fixture(scope="module")
def four_ranks():
    return horovodrun("core_cases.py", "four", np=4, timeout=LAUNCH_TIMEOUT_S, check=False)


@pytest.mark.parametrize("launch, world", [("two_ranks", 2), ("three_ranks", 3),
                                           ("four_ranks", 4)])
def test_replicas_stay_bit_identical(launch, world, request):
    # 32 steps of a Conv2d/Linear model with biases, SGD with momentum and
    # different inputs per rank; the first four steps' gradients are also
    # compared with ACP-SGD recomputed from every rank's inputs, each at
    # that rank's step-ahead weights.
    found = assert_reported(request.getfixturevalue(launch), "PASS replicas", world)
    assert len(set(found.values())) == 1, found     # same steps and all-reduce count


@pytest.mark.parametrize("launch, world", [("two_ranks", 2), ("three_ranks", 3)])
def test_full_rank_square_layers_match_horovod_distributed_optimizer(launch, world, request):
    assert_reported(request.getfixturevalue(launch), "PASS exact_vs_horovod", world)


@pytest.mark.parametrize("launch, world", [("two_ranks", 2), ("three_ranks", 3)])
def test_rank_dependent_unused_parameter_neither_hangs_nor_diverges(launch, world, request):
    assert_reported(request.getfixturevalue(launch), "PASS unused_branch", world)


def test_broadcast_parameters_and_optimizer_state_through_the_wrapper(two_ranks):
    assert_reported(two_ranks, "PASS broadcast", 2)


def test_models_that_differ_between_ranks_raise_on_every_rank(two_ranks):
    found = assert_reported(two_ranks, "CAUGHT models_differ", 2)
    for message in found.values():
        assert message.startswith("ValueError:"), message
        assert "differs between ranks" in message and "'2." in message, message
    assert found[0] == found[1]


def test_bad_argument_on_one_rank_raises_on_every_rank(two_ranks):
    found = assert_reported(two_ranks, "CAUGHT bad_on_one_rank", 2)
    assert found[1].startswith("ValueError: matrix_rank"), found[1]
    assert found[0].startswith("ValueError: on rank 1: matrix_rank"), found[0]
    assert all("got 0" in message for message in found.values()), found


def test_settings_that_differ_between_ranks_raise_on_every_rank(two_ranks):
    found = assert_reported(two_ranks, "CAUGHT settings_differ", 2)
    for message in found.values():
        assert message.startswith("ValueError:"), message
        assert "matrix_rank=4 on rank 0 but 2 on rank 1" in message, message


def test_a_rank_waiting_for_another_sleeps_instead_of_spinning(two_ranks):
    # Rank 1 starts its backward 1 s late; rank 0's training thread spends
    # under a third of its step() in CPU time (hvd.synchronize spins: ~all).
    assert_reported(two_ranks, "PASS waiting_is_idle", 2)


def test_training_works_after_construction_errors(two_ranks):
    assert_reported(two_ranks, "PASS recovered", 2)


@pytest.mark.parametrize("launch, world", [("two_ranks", 2), ("four_ranks", 4)])
def test_adam_defaults_send_both_factors_of_0_3_of_each_matrix_in_fp16(
        launch, world, request):
    # AdamW, no ACP setting: both factors every step at ranks ceil(0.3 min(n, m)),
    # 2 bytes per element sent, fp32 when compression=hvd.Compression.none;
    # P and Q in turn at ceil(min(n, m) / 2) with both_factors=False; replicas identical.
    assert_reported(request.getfixturevalue(launch), "PASS adaptive_defaults", world)
