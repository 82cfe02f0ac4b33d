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

# HOROVOD_NCCL_HOME for the NCCL of PyPI's nvidia-nccl package (what CUDA
# builds of torch depend on): its header, and its libnccl.so.2 under the
# name the linker looks for, linked into $VENV/nccl.
use_pip_nccl() {
  local dir
  dir=$("$PY" -c "import importlib.util as u; s = u.find_spec('nvidia.nccl'); \
print(list(s.submodule_search_locations)[0] if s else '')" 2>/dev/null) || return 0
  if [ -n "$dir" ] && [ -e "$dir/include/nccl.h" ] && [ -e "$dir/lib/libnccl.so.2" ]; then
    mkdir -p "$VENV/nccl/lib"
    ln -sfn "$dir/include" "$VENV/nccl/include"
    ln -sf "$dir/lib/libnccl.so.2" "$VENV/nccl/lib/libnccl.so"
    log "using the NCCL of PyPI's nvidia-nccl package ($dir)"
    export HOROVOD_NCCL_HOME="$VENV/nccl" HOROVOD_NCCL_LINK=SHARED
  fi
}

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
  # header can be found (set HOROVOD_NCCL_HOME for a non-standard prefix;
  # the NCCL that CUDA builds of torch install from PyPI is found too).
  # HVD_ACP_WITHOUT_NCCL=1 builds Gloo only.
  NCCL_BUILD=0
  if [ -z "${HOROVOD_GPU_OPERATIONS:-}" ] && [ "${HVD_ACP_WITHOUT_NCCL:-0}" != 1 ] \
     && "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" \
     && command -v nvcc >/dev/null 2>&1; then
    if [ -z "${HOROVOD_NCCL_HOME:-}" ] && [ ! -e /usr/include/nccl.h ] \
       && [ ! -e /usr/local/cuda/include/nccl.h ]; then
      use_pip_nccl
    fi
    if [ -n "${HOROVOD_NCCL_HOME:-}" ] || [ -e /usr/include/nccl.h ] \
       || [ -e /usr/local/cuda/include/nccl.h ]; then
      log "CUDA torch, nvcc and NCCL found: building NCCL GPU operations"
      export HOROVOD_GPU_OPERATIONS=NCCL
      NCCL_BUILD=1
    fi
  fi
  export HVD_ACP_REAL_CXX=${CXX:-g++}
  export CXX="$ROOT/scripts/cxx17.sh"
  export CMAKE_POLICY_VERSION_MINIMUM=3.5
  export MAKEFLAGS="-j$(nproc)"
  if [ "$NCCL_BUILD" = 1 ]; then
    # Not from pip's cache, which may hold a wheel built without NCCL. If
    # the NCCL build fails, Horovod is built with Gloo only: it then reduces
    # host tensors only (scripts/gpu_check.sh says so and copies CUDA
    # tensors through host memory, docs/gpu.md).
    if ! "${PIP[@]}" install --no-build-isolation --no-cache-dir "$HOROVOD_SPEC"; then
      log "NOTE: building Horovod with NCCL failed (above); building it with Gloo only," \
          "which does not reduce CUDA tensors"
      unset HOROVOD_GPU_OPERATIONS HOROVOD_NCCL_HOME HOROVOD_NCCL_LINK
      "${PIP[@]}" install --no-build-isolation --no-cache-dir "$HOROVOD_SPEC"
    fi
  else
    # pip keeps the wheel it builds in its cache: a later install reuses it.
    "${PIP[@]}" install --no-build-isolation "$HOROVOD_SPEC"
  fi
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
