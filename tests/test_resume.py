"""Resume the way users do: the checkpoint patterns of Horovod's examples and
of DDP users, each under its launcher with a timeout (a hang fails the test).

The Horovod patterns run in ``tests/workers/resume_cases.py`` (see its
docstring for what each case checks); a script in the style of Horovod's
ImageNet example runs as two real invocations in
``tests/workers/imagenet_style.py``; the DDP hook's patterns are cases of
``tests/workers/ddp_cases.py`` under ``torchrun``.
"""
import re

import pytest

from tests.hvdrun import horovodrun, rank_lines, torchrun

pytestmark = [pytest.mark.timeout(600)]

TWO_RANK_CASES = ["per_rank", "per_rank_adam", "rank0_file", "broadcast_odd", "broadcast_even",
                  "broadcast_stateless", "broadcast_adam", "broadcast_accumulation",
                  "warmup_during", "warmup_after", "warmup_per_rank", "rank0_only"]
FOUR_RANK_CASES = ["rank0_file", "broadcast_odd", "broadcast_adam", "broadcast_accumulation",
                   "rank0_only"]
#: Relative difference of the final validation loss allowed between the
#: ImageNet-style script resumed from rank 0's checkpoint and the same
#: script run without interruption (both 15 steps; measured: 4.3%).
IMAGENET_STYLE_TOLERANCE = 0.10


def reported(output, case, world):
    """The measurements of ``OK <case> <rank> ...`` lines, by rank; fails
    unless every rank reported."""
    found = {}
    for line in rank_lines(output, f"OK {case} "):
        rank, _, rest = line.partition(" ")
        found[int(rank)] = rest
    assert sorted(found) == list(range(world)), (
        f"{case!r} reported by ranks {sorted(found)} of {world}\n{output[-6000:]}")
    return found


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("resume2")
    return horovodrun("resume_cases.py", str(directory), *TWO_RANK_CASES, np=2, timeout=300,
                      check=False).stdout


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("resume4")
    return horovodrun("resume_cases.py", str(directory), *FOUR_RANK_CASES, np=4, timeout=300,
                      check=False).stdout


@pytest.mark.horovod
@pytest.mark.parametrize("case", TWO_RANK_CASES)
def test_checkpoint_pattern_at_two_ranks(two_ranks, case):
    reported(two_ranks, case, 2)


@pytest.mark.horovod
@pytest.mark.parametrize("case", FOUR_RANK_CASES)
def test_checkpoint_pattern_at_four_ranks(four_ranks, case):
    reported(four_ranks, case, 4)


@pytest.mark.horovod
@pytest.mark.parametrize("saved_at, resumed_at", [(4, 2), (2, 4)])
def test_resume_at_another_world_size(tmp_path, saved_at, resumed_at):
    first = horovodrun("resume_cases.py", str(tmp_path), "save_world", np=saved_at,
                       timeout=240).stdout
    reported(first, "save_world", saved_at)
    second = horovodrun("resume_cases.py", str(tmp_path), "resume_world", np=resumed_at,
                        timeout=240).stdout
    for rest in reported(second, "resume_world", resumed_at).values():
        assert f"from={saved_at}" in rest


def final_lines(output):
    """{rank: {field: value}} of the script's FINAL lines."""
    lines = {}
    for line in rank_lines(output, "FINAL "):
        fields = dict(item.split("=", 1) for item in line.split())
        lines[int(fields["rank"])] = fields
    return lines


@pytest.mark.horovod
def test_imagenet_style_script_resumes_from_an_odd_step(tmp_path):
    """Two invocations of a script written like Horovod's ImageNet example
    (rank 0 loads, broadcast_parameters, broadcast_optimizer_state, LR
    warm-up per batch, two backward passes per step): the first stops after
    epoch 1 (5 steps: a Q phase is next), the second resumes and finishes
    epoch 3; a third runs the 3 epochs without interruption."""
    def run(folder, epochs):
        fmt = str(tmp_path / folder / "checkpoint-{epoch}.pt")
        (tmp_path / folder).mkdir(exist_ok=True)
        return horovodrun("imagenet_style.py", "--checkpoint-format", fmt, "--epochs",
                          str(epochs), np=2, timeout=180).stdout

    run("resumed", 1)
    resumed = run("resumed", 3)
    resumes = [dict(item.split("=", 1) for item in line.split())
               for line in rank_lines(resumed, "RESUMED ")]
    assert sorted(int(r["rank"]) for r in resumes) == [0, 1], resumed[-4000:]
    assert all(r["epoch"] == "1" and r["steps"] == "5" and r["phase"] == "Q" for r in resumes)
    after = final_lines(resumed)
    assert sorted(after) == [0, 1] and after[0]["steps"] == "15"
    assert after[0]["digest"] == after[1]["digest"], "replicas differ after the resume"

    straight = final_lines(run("straight", 3))
    resumed_loss, straight_loss = float(after[0]["val_loss"]), float(straight[0]["val_loss"])
    assert resumed_loss < 1.2, "the resumed run did not learn (chance is 1.386)"
    assert abs(resumed_loss - straight_loss) <= IMAGENET_STYLE_TOLERANCE * straight_loss, (
        resumed_loss, straight_loss)


DDP_CASES = ["resume_rank0_file", "rank0_only", "attach_optimizer", "needs_optimizer",
             "same_as_horovod_front_end"]


@pytest.fixture(scope="module")
def ddp_two_ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ddp_resume")
    return torchrun("ddp_cases.py", "--dir", str(directory), *DDP_CASES, np=2, timeout=300)


@pytest.mark.ddp
@pytest.mark.parametrize("case", DDP_CASES)
def test_ddp_hook_pattern(ddp_two_ranks, case):
    found = sorted(int(r) for r in re.findall(rf"^OK {case} (\d+)$", ddp_two_ranks, re.M))
    assert found == [0, 1], ddp_two_ranks[-6000:]


@pytest.mark.ddp
def test_ddp_rank0_file_resume_at_four_ranks(tmp_path):
    out = torchrun("ddp_cases.py", "--dir", str(tmp_path), "resume_rank0_file", "rank0_only",
                   np=4, timeout=300)
    for case in ("resume_rank0_file", "rank0_only"):
        found = sorted(int(r) for r in re.findall(rf"^OK {case} (\d+)$", out, re.M))
        assert found == [0, 1, 2, 3], out[-6000:]
