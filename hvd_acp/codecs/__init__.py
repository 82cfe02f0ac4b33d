"""The codecs: what each kind of step sends and makes of the average.

:mod:`.base` says what a codec is; hvd_acp's own:

- :class:`Dense`: warm-up and auto-rank probes, every gradient whole;
- :class:`PCodec`, :class:`QCodec` (:mod:`.alternating`): ACP-SGD's P and Q in turn;
- :class:`PQCodec` (:mod:`.both`): both factors every step;
- :class:`Int8PQCodec` (:mod:`.int8`): both factors as 8-bit levels (``int8_factors``);
- :class:`PowerSGDFirst`, :class:`PowerSGDSecond` (:mod:`.powersgd`): Power-SGD's two rounds.

:data:`SCHEMES` names the cycles of codecs a compressed run goes through;
:class:`hvd_acp.Settings` picks one.
"""
from __future__ import annotations

from typing import Dict, Tuple

from ..compression import Phase
from .alternating import PCodec, QCodec
from .base import Codec
from .both import PQCodec
from .int8 import Int8PQCodec
from .powersgd import PowerSGDFirst, PowerSGDSecond

__all__ = ["Codec", "Dense", "PCodec", "QCodec", "PQCodec", "Int8PQCodec", "PowerSGDFirst",
           "PowerSGDSecond",
           "DENSE", "SCHEMES", "as_codec", "codec_of"]


class Dense(Codec):
    """Exact averaging: every tensor sends its gradient whole."""

    name, phase = "dense", Phase.DENSE
    compressed = False


DENSE = Dense()
#: The cycles of codecs of a compressed run, by scheme name.
SCHEMES: Dict[str, Tuple[Codec, ...]] = {
    "alternating": (PCodec(), QCodec()),
    "both": (PQCodec(),),
}


def codec_of(phase) -> Codec:
    """hvd_acp's codec of a :class:`~hvd_acp.compression.Phase` (the planner's
    and tests' way to name one)."""
    for codec in (DENSE, *SCHEMES["alternating"], *SCHEMES["both"]):
        if codec.phase is phase:
            return codec
    raise ValueError(f"no codec for {phase!r}")


def as_codec(kind) -> Codec:
    """``kind`` itself if a codec, else the codec of that Phase."""
    return kind if isinstance(kind, Codec) else codec_of(kind)
