#!/usr/bin/env bash
# One device call (H100, image's own PyTorch): a smoke run of every tiny torch recipe on the GPU,
# the harness-overhead ratio, then the seed rows at their largest micro-batch on one GPU.
# Everything lands in $OUT/h100.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD:$PWD/adapters/torch${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=$(command -v python3)
mkdir -p runs/h100
pack() { tar czf "$OUT/h100.tgz" runs/h100; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > runs/h100/nvidia-smi.csv
$PY -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)" | tee runs/h100/versions.txt
for r in recipes/tiny/llava_sft.yaml recipes/tiny/llava_next_lora.yaml recipes/tiny/qwen2vl_sft.yaml; do
  timeout 120 $PY -m xfw.cli run "$r" --backend torch --python torch=$PY --out runs/h100/smoke \
     --set precision.dtype=bf16 --set precision.amp_level=O2 --set measure.warmup_steps=2 --set measure.steps=5 \
     > /dev/null 2>> runs/h100/smoke.log
  tail -n 2 runs/h100/smoke.log
done
pack
timeout 150 $PY benchmarks/harness_overhead.py recipes/qwen2vl2b_sft.yaml --set batch.micro=4 --set batch.global=4 \
  --set parallel.nproc_per_node=1 --set parallel.sharding=none --steps 8 --rounds 3 --out runs/h100/harness_overhead.json \
  2>&1 | tail -n 12
pack
timeout $(( ${BUDGET_S:-560} - SECONDS )) $PY benchmarks/gpu_maxbatch.py --out runs/h100 --steps 10 --warmup 3 --timeout 300 "$@"
pack
