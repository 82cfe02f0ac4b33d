"""matrix_rank="auto" at 2 and 4 real ranks: every rank chooses the same ranks,
replicas stay bit-identical, and checkpoints bring the ranks back
(tests/workers/autorank_cases.py under horovodrun, tests/workers/autorank_ddp.py
under torchrun)."""
import json

import pytest

from tests.hvdrun import horovodrun, rank_lines, torchrun

CASES = ("agree", "per_rank", "broadcast")


@pytest.mark.parametrize("np", [2, 4])
def test_every_rank_chooses_the_same_ranks_and_checkpoints_keep_them(np, tmp_path):
    out = horovodrun("autorank_cases.py", str(tmp_path), *CASES, np=np, timeout=300).stdout
    for case in CASES:
        lines = rank_lines(out, f"OK {case}")
        assert sorted(int(line.split()[0]) for line in lines) == list(range(np)), out[-4000:]
        results = [json.loads(line.split(maxsplit=1)[1]) for line in lines]
        assert all(r == results[0] for r in results)
        ranks = results[0]["ranks"]
        # Chosen below the largest rank that still compresses each matrix (8, 13, 2).
        assert set(ranks) == {"0.weight", "2.weight", "4.weight"}
        assert ranks["0.weight"] < 8 and ranks["2.weight"] < 13 and 1 <= ranks["4.weight"] <= 2


@pytest.mark.parametrize("np", [2, 4])
def test_the_ddp_hook_chooses_the_same_ranks_on_every_rank(np):
    out = torchrun("autorank_ddp.py", np=np, timeout=300)
    lines = rank_lines(out, "OK ddp")
    assert sorted(int(line.split()[0]) for line in lines) == list(range(np)), out[-4000:]
    assert len({line.split(maxsplit=1)[1] for line in lines}) == 1
