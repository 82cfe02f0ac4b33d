"""The cross-rank agreement check: the same error on every rank, or none.

A rank that raises alone leaves the others waiting in their next
collective, and ranks whose settings, models or states differ send payloads
of other sizes or names, which hangs Horovod and aborts or hangs
``torch.distributed``. Every front end therefore gathers, in one small
collective, what each rank must agree on (and any error a rank met), and
every rank raises the same error from the gathered whole.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["agree", "describe_differences"]

#: The exceptions a rank's error may be re-raised as on the other ranks.
_KINDS = {kind.__name__: kind for kind in (ValueError, TypeError, NotImplementedError,
                                           RuntimeError)}


def agree(gather: Callable[[Any], List[Any]], facts: Dict[str, Any], *,
          explain: Callable[[int, Sequence[Dict[str, Any]]], Exception],
          error: Optional[Exception] = None, rank: int = 0, context: Any = None) -> None:
    """Raise the same exception on every rank if any rank has ``error`` or
    ``facts`` that differ from rank 0's.

    Args:
        gather: a blocking collective that returns every rank's object, in
            rank order (one call).
        facts: what every rank must have equal, by name (compared with ``==``).
        explain: ``explain(rank, gathered)`` makes the exception for the first
            rank whose facts differ from rank 0's; ``gathered`` holds every
            rank's ``{"facts": ..., "context": ...}``.
        error: this rank's own error, re-raised here; the other ranks raise
            its type with ``"on rank N: "`` before its message.
        rank: this process's rank (to re-raise its own error as it is).
        context: per-rank information for ``explain`` that is not compared.
    """
    local = None if error is None else (type(error).__name__, str(error))
    gathered = gather({"error": local, "facts": facts, "context": context})
    for other, entry in enumerate(gathered):
        if entry["error"] is not None:
            if error is not None and other == rank:
                raise error
            name, message = entry["error"]
            raise _KINDS.get(name, RuntimeError)(f"on rank {other}: {message}")
    for other, entry in enumerate(gathered):
        if entry["facts"] != gathered[0]["facts"]:
            raise explain(other, gathered)


def describe_differences(reference: dict, other: dict, rank: int) -> str:
    """``"key=a on rank 0 but b on rank N; ..."`` for the keys that differ."""
    return "; ".join(f"{key}={value!r} on rank 0 but {other.get(key)!r} on rank {rank}"
                     for key, value in reference.items() if other.get(key) != value)
