"""Render the max-batch runs of benchmarks/gpu_maxbatch.py as a markdown table, from the run
directories themselves (statistics recomputed from steps.jsonl, never copied by hand).

    python benchmarks/maxbatch_table.py results/h100 > results/h100/README-table.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from xfw.report.results import RunResult

GIB = 1024**3


def row(run_dir: Path) -> list[str]:
    r = RunResult.load(run_dir)
    spec = json.loads((run_dir / "spec.json").read_text())
    m = r.measurement
    mem = (f"{m.mem_alloc_peak_bytes / GIB:.1f} / {m.mem_reserved_peak_bytes / GIB:.1f}"
           if m.mem_alloc_peak_bytes and m.mem_reserved_peak_bytes else "–")
    ok = r.status == "ok"
    return [
        r.recipe, str(spec["batch"]["micro"]), r.status if ok else f"**{r.status}**",
        f"{m.ips:.2f}" if ok else "–", f"{m.tokens_per_s:,.0f}" if ok and m.tokens_per_s else "–",
        f"{m.step_time_median_s:.3f}" if ok else "–", f"{r.mfu:.1%}" if r.mfu is not None else "–", mem,
        f"{r.applied.get('num_params_trainable', 0):,} / {r.applied.get('num_params_total', 0):,}" if r.applied else "–",
        f"{spec['precision']['dtype']} {spec['precision']['amp_level']}" + (", recompute" if spec["recompute"] else ""),
    ]


def main(root: str) -> None:
    header = ["Recipe", "Micro-batch", "Status", "ips", "tokens/s", "Step (s, median)", "MFU",
              "Memory alloc / reserved (GiB)", "Trainable / total params", "Precision"]
    runs = sorted(p.parent for p in Path(root).glob("*/micro*/torch/spec.json"))
    runs.sort(key=lambda d: (d.parts[-3], -int(d.parts[-2].removeprefix("micro"))))
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for run_dir in runs:
        print("| " + " | ".join(row(run_dir)) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
