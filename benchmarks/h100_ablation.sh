#!/usr/bin/env bash
# Device call: what each PyTorch setting is worth, as ratios measured side by side in one call.
# Qwen2-VL-2B SFT, one GPU, micro 8 (its OOM edge), 3 warm-up + 8 measured steps per variant.
set -u
export PYTHONPATH=$PWD:$PWD/adapters/torch PYTHONUNBUFFERED=1
PY=$(command -v python3)
base=(--set batch.micro=8 --set batch.global=8 --set parallel.nproc_per_node=1 --set parallel.sharding=none
      --set measure.warmup_steps=3 --set measure.steps=8 --set measure.timeout_s=150)
variant() {
  name=$1; shift
  [ $SECONDS -lt $(( ${BUDGET_S:-380} - 60 )) ] || { echo "skip $name: out of budget"; return; }
  $PY -m xfw.cli run recipes/qwen2vl2b_sft.yaml --backend torch --python torch=$PY --out runs/h100/ablation/$name \
    "${base[@]}" "$@" 2>&1 | grep -E "^\[torch\].*(ok|OOM|CRASHED|TIMEOUT|INVALID|UNSUPPORTED)"
}
variant baseline                                               # bf16 O2, recompute, fused AdamW, SDPA
variant o1 --set precision.amp_level=O1                        # autocast over fp32 weights
variant foreach_adamw --set "backends={torch: {fused_optimizer: false}}"
variant compile --set "backends={torch: {compile: true}}"
tar czf "$OUT/ablation.tgz" runs/h100/ablation
