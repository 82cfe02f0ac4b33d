#!/usr/bin/env bash
# Create .venv and install everything hvd_acp needs, idempotently:
#   torch (pinned; an existing torch in the venv is kept), Horovod built from
#   PyPI against that torch with Gloo (and NCCL where CUDA and NCCL exist),
#   the run-time and test dependencies, and hvd_acp itself in editable mode.
# A second run finds Horovod's PyTorch ops importable and rebuilds nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
VENV=${VENV:-$ROOT/.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
HOROVOD_SPEC=${HOROVOD_SPEC:-horovod==0.28.1}

log() { printf '[install] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment in $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

if ! "$PY" -c "import torch" 2>/dev/null; then
  log "installing $TORCH_SPEC"
  "${PIP[@]}" install "$TORCH_SPEC"
else
  log "keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
fi

# Build requirements of Horovod's setup.py (built without isolation so that
# it compiles against the torch installed above, not a fresh download).
"${PIP[@]}" install -q "setuptools<81" wheel "cmake>=3.13,<4" packaging \
  cloudpickle psutil pyyaml numpy

if "$PY" -c "import horovod.torch as h; assert h.gloo_built()" 2>/dev/null; then
  log "Horovod with PyTorch ops already importable: not rebuilding"
else
  log "building $HOROVOD_SPEC against torch (several minutes on 2 cores)"
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1
  export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
  # MPI only where an MPI compiler wrapper exists; Gloo is always built.
  if ! command -v mpicxx >/dev/null 2>&1; then export HOROVOD_WITHOUT_MPI=1; fi
  # NCCL ops where this torch is a CUDA build, nvcc exists and NCCL's
  # header can be found (set HOROVOD_NCCL_HOME for a non-standard prefix).
  if [ -z "${HOROVOD_GPU_OPERATIONS:-}" ] \
     && "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" \
     && command -v nvcc >/dev/null 2>&1 \
     && { [ -n "${HOROVOD_NCCL_HOME:-}" ] || [ -e /usr/include/nccl.h ] \
          || [ -e /usr/local/cuda/include/nccl.h ]; }; then
    log "CUDA torch, nvcc and NCCL found: building NCCL GPU operations"
    export HOROVOD_GPU_OPERATIONS=NCCL
  fi
  export HVD_ACP_REAL_CXX=${CXX:-g++}
  export CXX="$ROOT/scripts/cxx17.sh"
  export CMAKE_POLICY_VERSION_MINIMUM=3.5
  export MAKEFLAGS="-j$(nproc)"
  # pip keeps the wheel it builds in its cache: a later install reuses it.
  "${PIP[@]}" install --no-build-isolation "$HOROVOD_SPEC"
  "$PY" -c "import horovod.torch as h; assert h.gloo_built(), 'Horovod built without Gloo'"
fi

log "installing hvd_acp (editable) with its extras"
# The extras (Lightning, Accelerate, Transformers among them) must never
# replace the torch installed above (nor pull a CUDA build): pin it.
TORCH_PIN=$(mktemp)
trap 'rm -f "$TORCH_PIN"' EXIT
"$PY" -c 'import torch; print("torch==" + torch.__version__)' > "$TORCH_PIN"
"${PIP[@]}" install -q -c "$TORCH_PIN" -e ".[horovod,examples,bench,test]"
log "done: $("$PY" -c 'import torch, horovod; print("torch", torch.__version__, "horovod", horovod.__version__)')"
