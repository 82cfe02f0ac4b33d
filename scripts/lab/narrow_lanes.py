"""Run a training script with ``int8_factors``' lanes narrower than 8 bits: a study, not a
setting.

hvd_acp.lanes packs four 8-bit balanced digits to an int32 word, so N ranks have
``127 // N`` levels each and an element costs a byte. With LANE_BITS=b the same code packs
``32 // b`` digits of b bits to a word (6 bits: five a word, 6.4 bits an element; 5 bits: six,
5.33 bits), each digit's sum within ``2^(b-1) - 1``, so a rank has ``(2^(b-1) - 1) // N``
levels (6 bits at 4 ranks: 7) and a higher rank fits the same bytes. The scripts count the
int32 words sent, so their bytes (and the tables' shares of S-SGD's) are the narrow lanes'
own: ``32 / (32 // b)`` bits an element. Under any launcher::

    LANE_BITS=6 .venv/bin/horovodrun -np 4 -H localhost:4 --gloo .venv/bin/python \\
        scripts/lab/narrow_lanes.py scripts/user_lm.py --optimizer acp --int8-factors \\
        --matrix-rank 0.25 ...

With LANE_DIGITS=d instead, a word carries d balanced digits of the largest even base B
whose digit sums within ``B / 2 - 1`` keep the word within int32 (d = 5: base 84, so a
rank has ``41 // N`` levels, 20, 10 and 5 at 2, 4 and 8 ranks, where 6-bit digits leave
15, 7 and 3, at the same 6.4 bits an element): hvd_acp.lanes reads balanced digits of any
base, so only the base changes.
"""
import os

import hvd_acp.lanes as lanes
from run_script import run_script


def word_fits(base: int, digits: int) -> bool:
    """Whether ``digits`` balanced digits of ``base`` whose sums stay within
    ``base / 2 - 1`` keep an int32 word within range."""
    return (base // 2 - 1) * sum(base ** k for k in range(digits)) < 2 ** 31


if "LANE_DIGITS" in os.environ:
    lanes.LANES_PER_WORD = int(os.environ["LANE_DIGITS"])
    lanes._BASE = max(base for base in range(4, 2 ** 16, 2)
                      if word_fits(base, lanes.LANES_PER_WORD))
else:
    bits = int(os.environ["LANE_BITS"])
    lanes.LANES_PER_WORD = 32 // bits
    lanes._BASE = 2 ** bits
lanes.DIGIT_MAX = lanes._BASE // 2 - 1
assert word_fits(lanes._BASE, lanes.LANES_PER_WORD)

run_script()
