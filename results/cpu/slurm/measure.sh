#!/usr/bin/env bash
# Local vs the two-node loopback Slurm cluster, back to back: the tiny nightly suite and a 2-seed converge.
# Usage: results/cpu/slurm/measure.sh OUTDIR   (from the checkout; the cluster up: scripts/setup_slurm.sh)
set -u
OUT=${1:?OUTDIR}; X=.venv/torch/bin/xfw; mkdir -p "$OUT"
t() { local name=$1; shift; local t0=$(date +%s.%N); "$@" > "$OUT/$name.stdout" 2> "$OUT/$name.stderr"; local rc=$?;
      echo "$name rc=$rc wall_s=$(echo "$(date +%s.%N) - $t0" | bc)" | tee -a "$OUT/walls.txt"; }
t nightly-local  $X nightly suites/cpu_smoke.yaml --history "$OUT/h-local" --night m1
t nightly-slurm  $X nightly suites/cpu_smoke.yaml --history "$OUT/h-slurm" --night m1 --executor slurm --partition debug
t converge-local $X converge recipes/tiny/llava_json_sft.yaml --backends paddle,torch --seeds 2 --steps 20 --eval-every 10 --out "$OUT/c-local"
t converge-slurm $X converge recipes/tiny/llava_json_sft.yaml --backends paddle,torch --seeds 2 --steps 20 --eval-every 10 --out "$OUT/c-slurm" --executor slurm --partition debug
