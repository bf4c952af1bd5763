"""Seed recipes on ONE GPU at the largest micro-batch that fits, with the OOM edge recorded.

For each ``RECIPE:m1,m2,...`` the micro-batches are tried from largest to smallest, each in
its own process through xfw's launcher (an OOM in one probe cannot poison the next); the
first that runs is the largest that fits, and the one above it is kept as the OOM edge.
Every probe is an ordinary run directory. The seed's 8-GPU settings are reduced to one GPU:
nproc 1, no sharding, global batch = micro batch. The search itself is ``xfw.run.commands.maxbatch`` (what
``xfw maxbatch --candidates`` runs); this script keeps the one-GPU reduction and the
``maxbatch.json`` lines the H100 runs in results/h100 were made with.

    python benchmarks/gpu_maxbatch.py --out runs/h100 --steps 10 --warmup 3 \\
        recipes/qwen2vl2b_sft.yaml:32,16,8 recipes/llava7b_lora.yaml:16,8,4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from xfw.run.launch import launcher
from xfw.run.commands import maxbatch
from xfw.report.results import RunResult
from xfw.contract.atomic import write_json_atomic


def one_gpu_overrides(args) -> list[str]:
    return ["parallel.nproc_per_node=1", "parallel.sharding=none", f"measure.warmup_steps={args.warmup}",
            f"measure.steps={args.steps}", f"measure.timeout_s={args.timeout}", *args.set]


def lines_for(found: maxbatch.MaxBatch, overrides: list[str]) -> list[dict]:
    """One line per probe, as this script always wrote them."""
    lines = []
    for p in found.probes:
        r = RunResult.load(p.run_dir)
        m = r.measurement
        line = {"recipe": found.recipe, "micro": p.micro, "status": p.status, "reason": p.reason,
                "ips": m.ips, "tokens_per_s": m.tokens_per_s, "mfu": r.mfu,
                "mem_alloc_peak_bytes": m.mem_alloc_peak_bytes, "mem_reserved_peak_bytes": m.mem_reserved_peak_bytes,
                "step_time_median_s": m.step_time_median_s, "run_dir": p.run_dir,
                "overrides": [f"batch.micro={p.micro}", f"batch.global={p.micro}", *overrides]}
        print(json.dumps(line), flush=True)
        lines.append(line)
    return lines


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
    overrides, lines = one_gpu_overrides(args), []
    for job in args.jobs:
        path, _, micros = job.partition(":")
        found = maxbatch.search(path, backend, description, Path(args.out),
                                candidates=maxbatch.parse_candidates(micros), overrides=overrides,
                                log=lambda text: print(text, file=sys.stderr, flush=True))
        lines += lines_for(found, overrides)
    write_json_atomic(Path(args.out) / "maxbatch.json", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
