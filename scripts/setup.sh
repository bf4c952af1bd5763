#!/usr/bin/env bash
# Create the environments xfw needs, from nothing, and skip what is already up to date.
#   .venv/torch   PyTorch stack + the xfw core with its CLI/reporting extras + xfw_torch
#   .venv/paddle  Paddle stack (numpy<=1.26, docs/design.md §3) + the bare xfw core + xfw_paddle
#   .venv/jax     scripts/setup_jax.sh (its own script and stamp; not with --gpu)
# The stacks cannot share one environment: paddlenlp pins numpy<=1.26, pandas 3 needs numpy 2.
# They are built side by side, each line of output prefixed with its environment's name: installing is
# CPU-bound (unpacking, compiling bytecode) and one pip uses one core (272 s one after another, 202 s side by side, on a
# clean 2-core machine with pip's cache off). Only the editable installs of this tree take turns (.venv/.editable.lock): each
# writes the project's egg-info here.
# scripts/setup.sh --gpu CUDA_VERSION builds the same two environments for a CUDA node instead (docs/gpu.md):
#   requirements-gpu.txt per adapter (no CPU pins), torch's CUDA build, Paddle's CUDA wheel from Paddle's index.
set -euo pipefail
cd "$(dirname "$0")/.."

GPU_CUDA=""  # empty: the CPU environments, exactly as without the flag
if [ "${1:-}" = "--gpu" ]; then
  GPU_CUDA=${2:-}
  case "$GPU_CUDA" in
    12.6|12.9|13.0) ;;
    *) echo "scripts/setup.sh: --gpu CUDA_VERSION must be 12.6, 12.9 or 13.0 (the CUDA builds both Paddle and PyTorch publish for the pinned versions), not '$GPU_CUDA'" >&2; exit 2 ;;
  esac
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "scripts/setup.sh: --gpu $GPU_CUDA: no nvidia-smi here, so no NVIDIA driver; refusing to replace .venv/torch and .venv/paddle with CUDA builds" >&2; exit 2
  fi
elif [ $# -gt 0 ]; then
  echo "scripts/setup.sh: unknown argument '$1' (usage: scripts/setup.sh [--gpu CUDA_VERSION])" >&2; exit 2
fi

. scripts/python.sh  # $PYTHON: which interpreter the environments are built from

quiet_pip() {  # pip's progress lines, without the index's repetitive location warnings
  "$@" 2>&1 | sed -u '/is ignored: it is neither a file nor a directory/d; /^Requirement already satisfied/d'
}

LOCK=.venv/.editable.lock
mkdir -p .venv

make_env() {  # make_env NAME REQUIREMENTS [INDEX OPTIONS...] -e EDITABLE...
  local name=$1; shift
  local requirements=$1; shift
  local index=()
  while [ $# -gt 0 ] && [ "$1" != "-e" ]; do index+=("$1"); shift; done
  local dir=.venv/$name
  local stamp="$dir/.xfw-setup-stamp"
  local want
  local late=${requirements%.txt}-no-build-isolation.txt
  want=$( { cat "$requirements" pyproject.toml adapters/"$name"/pyproject.toml scripts/setup.sh scripts/python.sh \
           $( [ -f "$late" ] && echo "$late"); printf %s "$GPU_CUDA $PYTHON"; } | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$dir/bin/python" -c "import xfw_$name" 2>/dev/null; then
    echo "==> .venv/$name is up to date"
    return
  fi
  echo "==> creating .venv/$name (about 2 minutes on a fresh machine)"
  rm -rf "$dir"
  "$PYTHON" -m venv "$dir"
  quiet_pip "$dir/bin/python" -m pip install --progress-bar off --upgrade pip
  quiet_pip "$dir/bin/python" -m pip install --progress-bar off -r "$requirements" "${index[@]}"
  (flock 9 && quiet_pip "$dir/bin/python" -m pip install --progress-bar off "${index[@]}" "$@") 9>"$LOCK"
  if [ -f "$late" ]; then  # packages that must build against this environment's torch (see the file)
    quiet_pip env DS_BUILD_OPS=0 "$dir/bin/python" -m pip install --progress-bar off --no-build-isolation -r "$late"
  fi
  "$dir/bin/python" -c "import xfw_$name"
  echo "$want" > "$stamp"
  echo "==> .venv/$name ready"
}

pids=()
beside() {  # beside NAME COMMAND...: run it in the background, its lines prefixed with "[NAME] "
  local name=$1; shift
  (set -o pipefail; "$@" 2>&1 | sed -u "s/^/[$name] /") &
  pids+=($!)
}
torch_and_op() {
  make_env torch "$@"
  # DeepSpeed's CPU shared-memory op (deepspeed.comm on CPU), compiled into torch's extension cache here, not by the
  # first DeepSpeed run inside its timeout (70 CPU s; a rank killed mid-build left the cache locked). Checked every
  # time, not stamped: that cache (~/.cache/torch_extensions) is shared by every checkout on the machine, and a build
  # for another checkout's environment is rebuilt at the next load (measured: a 178 s test, the build inside it).
  # Loading a built op is a few CPU seconds.
  if [ -z "$GPU_CUDA" ]; then
    echo "==> DeepSpeed's CPU shared-memory op: loading it, or compiling it (about 1 minute) if this environment has no build"
    if .venv/torch/bin/python -c "from deepspeed.comm.torch import build_shm_op; assert build_shm_op()" \
         >.venv/torch/deepspeed-op.log 2>&1; then
      echo "==> DeepSpeed's CPU shared-memory op is built"
    else  # not fatal: DeepSpeed compiles it at its first CPU run, as it does without this step
      echo "warning: DeepSpeed's CPU shared-memory op did not compile (.venv/torch/deepspeed-op.log); its first run will try"
    fi
  fi
}
paddle_and_device() {
  make_env paddle "$@"
  bash scripts/build_testdevice.sh  # the CPU test device for Paddle (docs/testdevice.md), into .venv/paddle
}

if [ -z "$GPU_CUDA" ]; then
  beside torch torch_and_op adapters/torch/requirements.txt -e ".[cli,test]" -e adapters/torch
  beside paddle paddle_and_device adapters/paddle/requirements.txt -e . -e adapters/paddle
  beside jax bash scripts/setup_jax.sh
else
  cu=cu${GPU_CUDA/./}
  torch_index=()  # torch 2.13.0's wheel on the default index is the CUDA 13.0 build; others from PyTorch's index
  [ "$GPU_CUDA" = 13.0 ] || torch_index=(--extra-index-url "https://download.pytorch.org/whl/$cu")
  beside torch torch_and_op adapters/torch/requirements-gpu.txt "${torch_index[@]}" -e ".[cli,test]" -e adapters/torch
  beside paddle paddle_and_device adapters/paddle/requirements-gpu.txt \
    --extra-index-url "https://www.paddlepaddle.org.cn/packages/stable/$cu/" -e . -e adapters/paddle
fi
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
if [ "$failed" != 0 ]; then echo "scripts/setup.sh: an environment failed to build (its lines above say which and why)" >&2; exit 1; fi
