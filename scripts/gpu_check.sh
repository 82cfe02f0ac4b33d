#!/usr/bin/env bash
# Check hvd_acp's CUDA path on this machine in one command (docs/gpu.md):
#
#   bash scripts/gpu_check.sh                  # every GPU: NCCL where it can run
#   bash scripts/gpu_check.sh --device cpu     # the same checks on the CPU (Gloo)
#   bash scripts/gpu_check.sh --quick --np 4   # fewer steps, 4 ranks
#
# It makes sure the environment exists first (`make install`: torch, Horovod
# built against it, with NCCL where CUDA torch, nvcc and NCCL are found, and
# hvd_acp), then runs scripts/gpu_check.py, which runs each check in its own
# process with a timeout, prints PASS / FAIL / SKIP(reason) per check and
# what it could not check and why, and exits 1 if a check failed (a skipped
# check is not a failure; 2 when it cannot start at all).
#
# Options of this wrapper (the others go to scripts/gpu_check.py, --help):
#   --skip-install  use .venv as it is (or GPU_CHECK_SKIP_INSTALL=1)
#   --python PY     run the checks with PY and install nothing (or
#                   GPU_CHECK_PYTHON=PY), e.g. an image's own Python with CUDA torch
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VENV:-$ROOT/.venv}
PY=${GPU_CHECK_PYTHON:-}
SKIP_INSTALL=${GPU_CHECK_SKIP_INSTALL:-0}
HELP=0
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-install) SKIP_INSTALL=1 ;;
    --python) PY=${2:?--python needs an interpreter}; shift ;;
    --python=*) PY=${1#--python=} ;;
    -h|--help) HELP=1; ARGS+=("$1") ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done

note() { printf '[gpu_check] %s\n' "$*" >&2; }

# Everything the checks import: torch, transformers (ResNet-50), Horovod with
# Gloo (horovodrun --gloo) and hvd_acp from this checkout.
ready() {
  [ -x "$1" ] && PYTHONPATH="$ROOT" "$1" -c "import torch, transformers, hvd_acp
import horovod.torch as h
assert h.gloo_built()" >/dev/null 2>&1
}

has_torch() { command -v "$1" >/dev/null 2>&1 && "$1" -c "import torch" >/dev/null 2>&1; }

if [ "$HELP" = 1 ]; then
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  SKIP_INSTALL=1
fi

if [ -n "$PY" ]; then
  note "running the checks with $PY as it is (--python): nothing installed"
elif [ "$SKIP_INSTALL" = 1 ]; then
  PY=$VENV/bin/python
elif ready "$VENV/bin/python"; then
  PY=$VENV/bin/python
  note "environment ready in $VENV: nothing to install"
else
  note "installing into $VENV with make install (builds Horovod the first time:" \
       "several minutes)"
  if ! make -C "$ROOT" install >&2; then
    note "make install failed (above); the checks run with what is there and skip" \
         "what it lacks"
  fi
  PY=$VENV/bin/python
fi

if ! has_torch "$PY"; then
  for candidate in python3 python; do
    if has_torch "$candidate"; then
      note "no torch in $PY: running the checks with $(command -v "$candidate")" \
           "instead; checks that need what it lacks are skipped"
      PY=$(command -v "$candidate")
      break
    fi
  done
fi
if ! has_torch "$PY"; then
  note "no Python with torch found ($PY); install with make install, or pass --python PY"
  exit 2
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" "$ROOT/scripts/gpu_check.py" ${ARGS[@]+"${ARGS[@]}"}
