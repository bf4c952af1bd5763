"""Seed recipes on ONE GPU at the largest micro-batch that fits, with the OOM edge recorded.

For each ``RECIPE:m1,m2,...`` the micro-batches are tried from largest to smallest, each in
its own process through xfw's launcher (an OOM in one probe cannot poison the next); the
first that runs is the largest that fits, and the one above it is kept as the OOM edge.
Every probe is an ordinary run directory. The seed's 8-GPU settings are reduced to one GPU:
nproc 1, no sharding, global batch = micro batch.

    python benchmarks/gpu_maxbatch.py --out runs/h100 --steps 10 --warmup 3 \\
        recipes/qwen2vl2b_sft.yaml:32,16,8 recipes/llava7b_lora.yaml:16,8,4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from xfw import launcher
from xfw.recipe import load_recipe
from xfw.results import write_json_atomic


def probe(path: str, micro: int, args, backend, description) -> dict:
    overrides = [f"batch.micro={micro}", f"batch.global={micro}", "parallel.nproc_per_node=1",
                 "parallel.sharding=none", f"measure.warmup_steps={args.warmup}", f"measure.steps={args.steps}",
                 f"measure.timeout_s={args.timeout}", *args.set]
    recipe = load_recipe(path, overrides)
    run_dir = Path(args.out) / recipe.name / f"micro{micro}" / backend.name
    result = launcher.launch(recipe, backend, run_dir, description=description)
    m = result.measurement
    line = {"recipe": recipe.name, "micro": micro, "status": result.status, "reason": result.reason,
            "ips": m.ips, "tokens_per_s": m.tokens_per_s, "mfu": result.mfu,
            "mem_alloc_peak_bytes": m.mem_alloc_peak_bytes, "mem_reserved_peak_bytes": m.mem_reserved_peak_bytes,
            "step_time_median_s": m.step_time_median_s, "run_dir": str(run_dir), "overrides": overrides}
    print(json.dumps(line), flush=True)
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jobs", nargs="+", help="RECIPE:MICRO,MICRO,... largest first")
    parser.add_argument("--out", required=True)
    parser.add_argument("--python", default=sys.executable, help="interpreter that has xfw_torch")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--set", action="append", default=[], help="extra recipe override for every probe")
    args = parser.parse_args()
    backend = launcher.Backend("torch", args.python)
    description = launcher.describe_backend(backend)
    lines = []
    for job in args.jobs:
        path, _, micros = job.partition(":")
        for micro in sorted((int(m) for m in micros.split(",")), reverse=True):
            line = probe(path, micro, args, backend, description)
            lines.append(line)
            if line["status"] == "ok":
                break
    write_json_atomic(Path(args.out) / "maxbatch.json", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
