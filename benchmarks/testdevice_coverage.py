"""Which of the CPU test device's kernels (and dtypes) the tiny families reach (issue 43; docs/testdevice.md).

Runs every tiny family through ``xfw run --backend paddle`` on ``testcpu`` in bf16 O2 and fp16 O2 on one
process and in bf16 O2 under stage 2 and stage 3 (sliced, ``sharding_segment_size`` 1024) on two, each with
``XFW_TESTCPU_KERNEL_LOG`` set, so the device appends ``<kernel function> <dtype>`` the first time a process
calls each kernel in each dtype. Writes ``reached.json`` (registered kernel name -> dtype -> the runs that
reached it, and each run's outcome) under ``--out``. tests/contract/test_testdevice_coverage.py holds every
row of it to an independent reference case. Not part of ``make test``: about 20 runs, 15 to 30 minutes on
2 shared cores.

    .venv/torch/bin/python benchmarks/testdevice_coverage.py [--out results/cpu/testdevice-mutation]
        [--only FAMILY ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "adapters" / "paddle" / "testdevice"
XFW = ROOT / ".venv" / "torch" / "bin" / "xfw"
FAMILIES = {"llava": "recipes/tiny/llava_sft.yaml", "llava_next": "recipes/tiny/llava_next_sft.yaml",
            "qwen2vl": "recipes/tiny/qwen2vl_sft.yaml", "sd15": "recipes/tiny/sd15_pretrain.yaml",
            "sd3": "recipes/tiny/sd3_dreambooth.yaml"}
SHORT = ["measure.warmup_steps=1", "measure.steps=1", "measure.timeout_s=600", "batch.global=4", "batch.micro=2",
         "backends.paddle.device=testcpu", "backends.paddle.grad_norm=true"]
BF16 = ["precision.dtype=bf16", "precision.amp_level=O2"]
FP16 = ["precision.dtype=fp16", "precision.amp_level=O2"]
LAYOUTS = {"bf16-o2": BF16, "fp16-o2": FP16,
           "bf16-o2-stage2": [*BF16, "parallel.nproc_per_node=2", "parallel.sharding=stage2"],
           "bf16-o2-stage3": [*BF16, "parallel.nproc_per_node=2", "parallel.sharding=stage3",
                              "backends.paddle.sharding_segment_size=1024"]}


def kernel_names() -> dict[str, str]:
    """Kernel function -> the name it is registered under (PD_BUILD_PHI_KERNEL lines of the sources)."""
    names = {}
    for path in sorted(SRC.glob("kernels_*.cc")):
        for name, fn in re.findall(r"PD_BUILD_PHI_KERNEL\((\w+), testcpu, ALL_LAYOUT, (\w+),", path.read_text()):
            names[fn] = name
    return names


def registered() -> dict[str, list[str]]:
    """Registered kernel name -> the dtypes it is registered for, as the sources list them."""
    macros = {"XFW_FLOATS": ["float32", "float64", "float16", "bfloat16"]}
    macros["XFW_NUMBERS"] = macros["XFW_FLOATS"] + ["int32", "int64"]
    macros["XFW_ALL"] = macros["XFW_NUMBERS"] + ["bool", "uint8", "int8", "int16"]
    cpp = {"float": "float32", "double": "float64", "phi::dtype::float16": "float16",
           "phi::dtype::bfloat16": "bfloat16", "int32_t": "int32", "int64_t": "int64", "bool": "bool"}
    out = {}
    for path in sorted(SRC.glob("kernels_*.cc")):
        for name, types in re.findall(r"PD_BUILD_PHI_KERNEL\((\w+), testcpu, ALL_LAYOUT, \w+, ([^)]*)\)", path.read_text()):
            dtypes = []
            for t in (s.strip() for s in types.split(",")):
                dtypes += macros.get(t, [cpp.get(t, t)])
            out[name] = dtypes
    return out


def read_log(path: Path, names: dict[str, str]) -> set[tuple[str, str]]:
    hits = set()
    if path.is_file():
        for line in path.read_text().splitlines():
            fn, _, dtype = line.partition(" ")
            hits.add((names.get(fn, fn), dtype))
    return hits


def table(reached_path: Path, cases_path: Path) -> str:
    """coverage.md: every reached kernel x dtype, the runs that reached it and the cases that check it
    (``cases_path``: the JSON tests/contract/testdevice_worker.py writes in mode ``kernel_cases``)."""
    reached = json.loads(reached_path.read_text())
    cases = json.loads(cases_path.read_text())
    by = {}
    for key, meta in cases.items():
        for kernel in meta["kernels"]:
            by.setdefault((kernel, meta["dtype"]), []).append(key.split(":", 1)[1])
    elsewhere = {("adamw", "bfloat16"): ["test_testdevice_reference.py adamw_master/adamw_plain"]}
    lines = ["# Device kernels the tiny families reach, and what checks each", "",
             f"From `{reached.get('command', '')}` ({reached.get('when', '')}); settings "
             f"`{' '.join(reached.get('settings', []))}`. Runs: "
             + ", ".join(f"{r['run']} ({'ok' if r['rc'] == 0 else 'failed'})" for r in reached.get("runs", [])), "",
             "Checked by: the cases of tests/contract/test_testdevice_kernels.py (float64 references) that name the "
             "kernel, in that dtype.", "", "| kernel | dtype | reached by | checked by |", "|---|---|---|---|"]
    unchecked = 0
    for kernel, dtypes in sorted(reached["reached"].items()):
        for dtype, runs in sorted(dtypes.items()):
            checks = by.get((kernel, dtype)) or elsewhere.get((kernel, dtype)) or []
            unchecked += not checks
            lines.append(f"| {kernel} | {dtype} | {len(runs)} runs ({', '.join(sorted(runs)[:3])}"
                         f"{', ...' if len(runs) > 3 else ''}) | {', '.join(checks) or '**none**'} |")
    lines += ["", f"{unchecked} reached kernel x dtype pairs without a check."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=Path, default=None,
                    help="only write coverage.md from --out's reached.json and this kernel_cases.0.json")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "cpu" / "testdevice-mutation")
    ap.add_argument("--only", nargs="*", default=None, help="families (default: all)")
    ap.add_argument("--layouts", nargs="*", default=None, help="layouts (default: all)")
    args = ap.parse_args(argv)
    if args.table:
        (args.out / "coverage.md").write_text(table(args.out / "reached.json", args.table))
        return 0
    names = kernel_names()
    reached: dict[str, dict[str, list[str]]] = {}
    runs = []
    scratch = tempfile.mkdtemp(prefix="xfw-coverage-")  # kept when a run fails: its report says why
    if True:
        for family, recipe in FAMILIES.items():
            if args.only and family not in args.only:
                continue
            for layout, sets in LAYOUTS.items():
                if args.layouts and layout not in args.layouts:
                    continue
                log = Path(scratch, f"{family}-{layout}.log")
                env = dict(os.environ, XFW_TESTCPU_KERNEL_LOG=str(log))
                cmd = [str(XFW), "run", recipe, "--backend", "paddle", "--out", str(Path(scratch, family, layout))]
                for s in [*SHORT, *sets]:
                    cmd += ["--set", s]
                start = time.monotonic()
                done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
                hits = read_log(log, names)
                run = f"{family}/{layout}"
                runs.append({"run": run, "rc": done.returncode, "seconds": round(time.monotonic() - start, 1),
                             "kernels": len(hits), "tail": (done.stdout + done.stderr)[-600:] if done.returncode else ""})
                print(f"{run}: rc {done.returncode}, {len(hits)} kernel/dtype pairs, {runs[-1]['seconds']} s", flush=True)
                for name, dtype in hits:
                    reached.setdefault(name, {}).setdefault(dtype, []).append(run)
    if all(r["rc"] == 0 for r in runs):
        shutil.rmtree(scratch, ignore_errors=True)
    else:
        print(f"failed runs kept in {scratch}")
    result = {"command": "benchmarks/testdevice_coverage.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "settings": SHORT, "layouts": LAYOUTS,
              "runs": runs, "reached": {k: dict(sorted(v.items())) for k, v in sorted(reached.items())},
              "registered": registered()}
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "reached.json.tmp"
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(args.out / "reached.json")
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
