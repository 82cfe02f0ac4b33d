"""Run a training script and print how well the last average predicts a rank's next
factors: a study, not a setting.

Every rank holds the factors averaged in the step before (``tensor.p``, ``tensor.q``). If a
rank's new factor ``P_i = A Qh`` were close to that average, its levels could carry the
difference ``P_i - P_prev`` on a finer step for the same bytes. Every 100 calls of
``Int8PQCodec.encode_`` (10 steps of a model with 10 compressed matrices), rank 0 prints,
over those calls and both factors, the median of

- ``norm``: ``||P_i - P_prev|| / ||P_i||`` per tensor (0: predicted exactly; about
  ``sqrt(1 + (||P_prev|| / ||P_i||)^2)`` for an average unrelated to the new factor);
- ``max``: a column's largest ``|P_i - P_prev|`` over its largest ``|P_i|`` (below 1: the
  difference would take finer steps);
- ``prev``: the last average's column maximum over the new factor's::

    PREDICT calls=300 norm=1.286 max=1.306 prev=0.823

The levels sent are the library's, unchanged. ``SUMMARY=path.json`` also writes every
printed line's numbers there (rank 0). Under ``torchrun``::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 scripts/lab/int8_predict.py \\
        scripts/trainer_lm.py --method acp --int8-factors --matrix-rank 0.2 --seed 0 ...
"""
import atexit
import json
import os
import statistics

import torch

import hvd_acp.codecs as codecs
import hvd_acp.codecs.int8 as int8
from hvd_acp.compression import compress_both_
from run_script import run_script

_SEEN = {"norm": [], "max": [], "prev": []}
_LINES = []
_CALLS = [0]


def _rank_zero() -> bool:
    """Rank 0 of torchrun or horovodrun, read from the launcher's environment (the
    process group may be gone when the summary is written)."""
    return os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "0")) == "0"


class PredictedInt8PQCodec(int8.Int8PQCodec):
    def encode_(self, tensor, basis, out):
        fresh = torch.empty_like(out)
        compress_both_(None, tensor.error, basis[0], basis[1], fresh)
        n = tensor.layout.n
        tiny = torch.finfo(out.dtype).tiny
        for new, before in ((fresh[:n], tensor.p), (fresh[n:], tensor.q)):
            largest = new.abs().amax(dim=0).clamp_min(tiny)
            _SEEN["norm"].append(float((new - before).norm() / new.norm().clamp_min(tiny)))
            _SEEN["max"].append(float(((new - before).abs().amax(dim=0) / largest).median()))
            _SEEN["prev"].append(float((before.abs().amax(dim=0) / largest).median()))
        _CALLS[0] += 1
        if _CALLS[0] % 100 == 0:
            line = {"calls": _CALLS[0], **{key: statistics.median(values)
                                           for key, values in _SEEN.items()}}
            if _rank_zero():
                print(f"PREDICT calls={line['calls']} norm={line['norm']:.3f} "
                      f"max={line['max']:.3f} prev={line['prev']:.3f}", flush=True)
            _LINES.append(line)
            for values in _SEEN.values():
                values.clear()
        return super().encode_(tensor, basis, out)


def _write_summary() -> None:
    if os.environ.get("SUMMARY") and _rank_zero() and _LINES:
        with open(os.environ["SUMMARY"], "w") as handle:
            json.dump(_LINES, handle, indent=1)


codecs.Int8PQCodec = PredictedInt8PQCodec        # the settings make the codec by this name
atexit.register(_write_summary)
run_script()
