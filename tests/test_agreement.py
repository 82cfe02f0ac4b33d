"""The cross-rank agreement check (hvd_acp/agreement.py): in one process
with a gather that plays several ranks, then every setting that changes
what is sent or how it is named, different between ranks under horovodrun."""
import pytest

from hvd_acp.agreement import agree
from tests.hvdrun import horovodrun, rank_lines

#: Every setting of hvd_acp.DistributedOptimizer that changes what a rank
#: sends or how its all-reduces are named (tests/workers/agreement_cases.py).
SETTINGS = ("matrix_rank", "min_compression_rate", "warmup_steps", "seed", "step_ahead",
            "fusion_threshold_bytes", "backward_passes_per_step", "num_groups", "groups",
            "sparse_as_dense", "compression", "op", "gradient_predivide_factor")


def gather_as(rank, others):
    """A gather on rank ``rank`` that returns ``others`` with this rank's entry in place."""
    def gather(mine):
        everyone = list(others)
        everyone[rank] = mine
        return everyone
    return gather


def entry(facts, error=None):
    return {"facts": facts, "error": error, "context": None}


def explain(rank, gathered):
    return ValueError(f"rank {rank} has {gathered[rank]['facts']}")


def test_equal_facts_pass_and_differing_ones_raise_the_same_error():
    ranks = [entry({"a": 1}), entry({"a": 1}), entry({"a": 2})]
    agree(gather_as(0, ranks[:2]), {"a": 1}, explain=explain)
    for rank in range(3):
        with pytest.raises(ValueError, match=r"^rank 2 has \{'a': 2\}$"):
            agree(gather_as(rank, ranks), ranks[rank]["facts"], explain=explain, rank=rank)


def test_an_error_on_one_rank_is_raised_on_every_rank():
    ranks = [entry({}), entry({}, ("TypeError", "seed must be an int, got '0'"))]
    with pytest.raises(TypeError, match="^seed must be an int"):
        agree(gather_as(1, ranks), {}, explain=explain, rank=1,
              error=TypeError("seed must be an int, got '0'"))
    with pytest.raises(TypeError, match="^on rank 1: seed must be an int"):
        agree(gather_as(0, ranks), {}, explain=explain, rank=0)


@pytest.mark.horovod
@pytest.mark.parametrize("np", [2, 4])
def test_every_setting_that_differs_between_ranks_raises_on_every_rank(np):
    out = horovodrun("agreement_cases.py", np=np, timeout=300).stdout
    caught = {line.split()[0] for line in rank_lines(out, "CAUGHT ")}
    assert caught == set(SETTINGS), caught
    for setting in SETTINGS:
        found = {}
        for line in rank_lines(out, f"CAUGHT {setting} "):
            rank, message = line.split(" ", 1)
            found[int(rank.split("=")[1])] = message
        assert sorted(found) == list(range(np)), (setting, out[-4000:])
        assert len(set(found.values())) == 1, found      # the same error everywhere
        message = found[0]
        assert "differ between ranks" in message and f"{setting}=" in message, message
        assert "on rank 1" in message, message
    trained = sorted(int(line.split("=")[1]) for line in rank_lines(out, "OK trained "))
    assert trained == list(range(np)), out[-4000:]
