"""The codecs: what each kind of step sends and makes of the average.

:mod:`.base` says what a codec is; hvd_acp's own:

- :class:`Dense`: warm-up and auto-rank probes, every gradient whole;
- :class:`PCodec`, :class:`QCodec` (:mod:`.alternating`): ACP-SGD's P and Q in turn;
- :class:`PQCodec` (:mod:`.both`): both factors every step;
- :class:`CoreCodec` (:mod:`.core`): the r x r core on both bases, between refreshes;
- :class:`PowerSGDFirst`, :class:`PowerSGDSecond` (:mod:`.powersgd`): Power-SGD's two rounds.

:data:`SCHEMES` names the cycles of codecs a compressed run goes through;
:class:`hvd_acp.Settings` picks one (:func:`cycle_of`).
"""
from __future__ import annotations

from typing import Dict, Tuple

from ..compression import Phase
from .alternating import PCodec, QCodec
from .base import Codec
from .both import PQCodec
from .core import CoreCodec
from .powersgd import PowerSGDFirst, PowerSGDSecond

__all__ = ["Codec", "Dense", "PCodec", "QCodec", "PQCodec", "CoreCodec", "PowerSGDFirst",
           "PowerSGDSecond", "DENSE", "CORE", "SCHEMES", "as_codec", "codec_of", "cycle_of"]


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


CORE = CoreCodec()


def cycle_of(scheme: str, refresh_period: int = 1) -> Tuple[Codec, ...]:
    """The codecs of a compressed run: ``scheme``'s, each followed by
    ``refresh_period - 1`` core steps on the bases it left."""
    return tuple(step for codec in SCHEMES[scheme]
                 for step in (codec,) + (CORE,) * (refresh_period - 1))


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
