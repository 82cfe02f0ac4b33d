"""The planner's input files: what a profile must hold for :mod:`.timeline`,
and reading JSON with clear errors (pure, no torch)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["check_profile", "read_json"]

_TOP = ("format", "matrix_rank", "forward_s", "backward_s", "optimizer_s", "params", "buckets",
        "ddp_buckets", "orthonormalize_s")
_PARAM = ("name", "bytes", "ready_s", "compressed", "ddp_compressed")


def check_profile(profile: dict, where: str = "profile") -> None:
    """Raise ``ValueError`` naming the first missing or malformed field."""
    if not isinstance(profile, dict):
        raise ValueError(f"{where}: a profile is a JSON object, got {type(profile).__name__}")
    missing = [k for k in _TOP if k not in profile]
    if missing:
        raise ValueError(f"{where}: not a hvd-acp-plan profile (missing {', '.join(missing)})")
    if profile["format"] != 1:
        raise ValueError(f"{where}: profile format {profile['format']!r}, this version reads 1")
    if not profile["params"]:
        raise ValueError(f"{where}: the profile lists no parameters")
    for p in profile["params"]:
        gone = [k for k in _PARAM if k not in p]
        if gone:
            raise ValueError(f"{where}: parameter {p.get('name')!r} lacks {', '.join(gone)}")
    for key in ("acp_p", "acp_q", "psgd_p", "psgd_q"):
        if key not in profile["buckets"]:
            raise ValueError(f"{where}: buckets lack {key!r}")


def read_json(path, what: str) -> Any:
    """The JSON in ``path``; ``FileNotFoundError`` or ``ValueError`` naming ``what``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {str(path)!r} not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} file {str(path)!r} is not JSON: {exc}") from None
