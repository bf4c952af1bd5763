#!/usr/bin/env bash
# Second device call: the diffusion seed rows at their largest micro-batch on one H100.
# The image has no diffusers: carry it as wheels (`carry: [.whl]`, see results/h100/README.md).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/adapters/torch PYTHONUNBUFFERED=1
PY=$(command -v python3)
mkdir -p runs/h100
$PY -c "import diffusers; print('diffusers', diffusers.__version__)"
timeout $(( ${BUDGET_S:-560} - SECONDS )) $PY benchmarks/gpu_maxbatch.py --out runs/h100 --steps 8 --warmup 3 \
  --timeout 200 "$@"
tar czf "$OUT/h100.tgz" runs/h100
