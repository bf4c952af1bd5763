"""Issue 32's acceptance check, as a newcomer would run it: a slowdown planted in one module on one side through an
ordinary, reported setting, then ``xfw compare RECIPE --explain``; does the report name that module first, its
size within 25% of the plant, in the right category, on an unloaded and on a loaded machine (another xfw training
beside it), or say that it cannot? ::

    python benchmarks/explain_planted.py --out results/cpu/explain-planted          # every tiny family, both loads
    python benchmarks/explain_planted.py --families llava --loads unloaded --sides paddle --repeat 3

The plant: ``backends.<side>.env.PYTHONPATH`` (``--sides``: torch by default, paddle, or both in turn) names a
directory whose ``sitecustomize.py`` wraps one module class's forward on that side (the family's table below) so
that each call first multiplies two 136×136 matrices n times (n calibrated on the first call to about ``--plant-ms``
per call): matrix products of no gradient, so the work is *matmul* and lands in that module's own row (forward).
Each call's own duration is logged (per process), so the planted cost per step is the plant's measured time in the
explain process (median per call × calls per step), under whatever load the host had, not the nominal target. The
other side runs as it is.

Per family, load and side it records the first ranked row and its difference (explain.csv), the planted
module's row, the category the report's map put the plant's own operators in (the trace's events of exactly the
plant's shapes, as annotated by explain), the category table's largest difference toward the planted side (for
reading; on SD1.5 Paddle's matmul row is larger than PyTorch's by more than the plant) and the reliability
verdict (explain.md), and judges: **pass** when the report ranks the planted module first, within ±25% of the
plant's cost in the hooked steps, and the plant's operators count in *matmul* only; **pass (says it cannot)** when
it does not but the report says the explanation is unreliable here; **fail** when it calls itself reliable and
ranks something else first, misses the size or the category. Writes ``OUT/explain_planted.json`` (every figure,
the commands, the environment), ``OUT/results.md`` and each check's ``explain.md`` / ``explain.csv`` in
``OUT/<family>-<load>-<side>/``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv" / "torch" / "bin" / "python"
TOLERANCE = 0.25

FAMILIES = {  # family: (recipe, recipe's name, the planted module's canonical row, {side: (module, its class)})
    "llava": ("recipes/tiny/llava_sft.yaml", "tiny-llava-sft", "model.multi_modal_projector",
              {"torch": ("transformers.models.llava.modeling_llava", "LlavaMultiModalProjector"),
               "paddle": ("xfw_paddle.families.llava", "LlavaMultiModalProjector")}),
    "llava_next": ("recipes/tiny/llava_next_sft.yaml", "tiny-llava-next-sft", "model.multi_modal_projector",
                   {"torch": ("transformers.models.llava_next.modeling_llava_next", "LlavaNextMultiModalProjector"),
                    "paddle": ("xfw_paddle.families.llava", "LlavaMultiModalProjector")}),
    "qwen2vl": ("recipes/tiny/qwen2vl_sft.yaml", "tiny-qwen2vl-sft", "model.visual.merger",
                {"torch": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "PatchMerger"),
                 "paddle": ("xfw_paddle.families.qwen2vl", "PatchMerger")}),
    "sd15": ("recipes/tiny/sd15_pretrain.yaml", "tiny-sd15-pretrain", "unet.time_embedding",
             {"torch": ("diffusers.models.embeddings", "TimestepEmbedding"),
              "paddle": ("ppdiffusers.models.embeddings", "TimestepEmbedding")}),
    "sd3": ("recipes/tiny/sd3_lora.yaml", "tiny-sd3-lora", "transformer.time_text_embed",
            {"torch": ("diffusers.models.embeddings", "CombinedTimestepTextProjEmbeddings"),
             "paddle": ("ppdiffusers.models.embeddings", "CombinedTimestepTextProjEmbeddings")}),
}
WORK = {  # per framework: how to make the two matrices, multiply them, and switch gradients off
    "torch": ("import torch; from torch.profiler import record_function as _span", "torch.randn([136, 136])",
              "torch.no_grad()"),
    "paddle": ("import paddle; from paddle.profiler import RecordEvent as _span", "paddle.randn([136, 136])",
               "paddle.no_grad()"),
}
CATEGORY = "matmul"
"""The plant's work: products of two 136×136 matrices (rank 2: a matmul, not attention), inside a profiler span
named :data:`PLANT_SPAN` (not an operator: no category counts it), so the trace's operators inside it are the
plant's."""
PLANT_SPAN = "xfw plant"

SITECUSTOMIZE = """
import importlib, json, os, statistics, time
_LOG, _TARGET_S = {log!r}, {target_s!r}
_mod = importlib.import_module({module!r})
_cls = getattr(_mod, {cls!r})
_forward = _cls.forward
_state = {{}}

def _work(n):
    a, b = _state["a"], _state["b"]
    for _ in range(n):
        a @ b

def _slow(self, *args, **kwargs):
    {imports}
    with {no_grad}:
        if "n" not in _state:  # calibrate once, on the first call (a warm-up step)
            _state["a"], _state["b"] = {randn}, {randn}
            _work(200)  # past the first products' set-up (Paddle's are slow)
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                _work(40)
                times.append((time.perf_counter() - t0) / 40)
            _state["n"] = max(1, round(_TARGET_S / statistics.median(times)))
        t0 = time.perf_counter()
        with _span({span!r}):
            _work(_state["n"])
        spent = time.perf_counter() - t0
    with open(_LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps({{"pid": os.getpid(), "s": spent}}) + "\\n")
    return _forward(self, *args, **kwargs)

_cls.forward = _slow
"""


def plant(directory: Path, family: str, side: str, target_s: float) -> tuple[Path, Path]:
    """(the directory to put on ``side``'s PYTHONPATH, the plant's log)."""
    module, cls = FAMILIES[family][3][side]
    imports, randn, no_grad = WORK[side]
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "plant.jsonl"
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE.format(
        log=str(log), target_s=target_s, module=module, cls=cls, imports=imports, randn=randn, no_grad=no_grad,
        span=PLANT_SPAN))
    return directory, log


def planted_per_step(log: Path, explain_jsons: list[Path], warmup: int) -> dict:
    """The plant's cost per step in the explain processes (the log's last pids, one per run): each one's median
    per call in its hooked steps (the calls after the warm-up's and the plain steps', in order: the steps the
    module rows are timed in) × calls per step, and over several runs the median of those (as the report takes
    each row); every call's median beside it."""
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    pids = list(dict.fromkeys(r["pid"] for r in records))
    explained, measured = pids[-len(explain_jsons):], pids[:-len(explain_jsons)]
    per_run = []
    for pid, path in zip(explained, explain_jsons):
        explain = json.loads(path.read_text())
        steps = max(warmup, 1) + len(explain["plain_steps_s"]) + len(explain["hooked_steps_s"]) \
            + len(explain["profiler_steps_s"])
        mine = [r["s"] for r in records if r["pid"] == pid]
        calls = round(len(mine) / steps)
        start = (max(warmup, 1) + len(explain["plain_steps_s"])) * calls
        hooked = mine[start:start + len(explain["hooked_steps_s"]) * calls] or mine
        per_run.append({"per_call_s": statistics.median(mine), "hooked_per_call_s": statistics.median(hooked),
                        "calls_per_step": calls, "per_step_s": statistics.median(hooked) * calls,
                        "all_calls_per_step_s": statistics.median(mine) * calls, "calls": len(mine), "steps": steps})
    return {"per_step_s": statistics.median(r["per_step_s"] for r in per_run), "explain_runs": per_run,
            "measured_runs_per_call_s": [statistics.median([r["s"] for r in records if r["pid"] == pid])
                                         for pid in measured]}


def start_load(work: Path) -> subprocess.Popen:
    """Another xfw training beside the check: tiny LLaVA on Paddle, two threads, until stopped."""
    cmd = [str(PYTHON), "-m", "xfw.cli", "run", "recipes/tiny/llava_sft.yaml", "--backend", "paddle",
           "--set", "measure.steps=1000000", "--set", "measure.cpu_threads=2", "--set", "measure.timeout_s=36000",
           "--out", str(work / "load")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    time.sleep(20)  # past its start-up, into its training steps
    return proc


def stop_load(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the group this script started (xfw ends its adapter on SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def plant_categories(run_dirs: list[Path]) -> dict[str, float]:
    """{category the report's map put the plant's operators in: their seconds per profiled step}, from each run's
    annotated trace.json: the outermost counted operators inside a :data:`PLANT_SPAN` span (their nested ones count
    in theirs); over several runs, the mean."""
    found: dict[str, float] = {}
    for d in run_dirs:
        trace = json.loads((d / "trace.json").read_text())
        events = [e for e in (trace["traceEvents"] if isinstance(trace, dict) else trace)
                  if isinstance(e, dict) and e.get("ph") == "X" and isinstance(e.get("dur"), (int, float))]
        steps = len(json.loads((d / "explain.json").read_text())["profiler_steps_s"])
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if str(e.get("name", "")).startswith(PLANT_SPAN))
        inside = sorted((e for e in events if (e.get("args") or {}).get("xfw category")
                         and any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in spans)),
                        key=lambda e: (e["ts"], -e["dur"]))
        end = -1.0
        for e in inside:
            if e["ts"] >= end:  # outermost: not inside the previous outermost one
                category = e["args"]["xfw category"]
                found[category] = found.get(category, 0.0) + e["dur"] * 1e-6 / steps / len(run_dirs)
                end = e["ts"] + e["dur"]
    return found


def categories(run_dirs: dict[str, list[Path]]) -> dict[str, dict[str, float]]:
    """Each side's categories (ms per step; over several runs, the median: as the report takes them)."""
    from xfw.report.explain import load_side

    return {b: {c: v * 1e3 for c, v in load_side([str(d) for d in dirs])["categories"].items()}
            for b, dirs in run_dirs.items()}


def check(family: str, load: str, side: str, work: Path, args: argparse.Namespace) -> dict:
    recipe, name, row, _ = FAMILIES[family]
    other = "paddle" if side == "torch" else "torch"
    out = work / f"{family}-{load}-{side}"
    plant_dir, log = plant(work / f"plant-{family}-{load}-{side}", family, side, args.plant_ms / 1e3)
    overrides = [f"measure.warmup_steps={args.warmup}", f"measure.steps={args.steps}",
                 f"backends.{side}.env.PYTHONPATH={plant_dir}"]
    cmd = [str(PYTHON), "-m", "xfw.cli", "compare", recipe, "--backends", "paddle,torch", "--explain",
           "--out", str(out), *(["--repeat", str(args.repeat)] if args.repeat > 1 else []),
           *[a for o in overrides for a in ("--set", o)]]
    loader = start_load(work) if load == "loaded" else None
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    finally:
        if loader is not None:
            stop_load(loader)
    wall = time.perf_counter() - t0
    result = {"family": family, "load": load, "planted_side": side, "recipe": recipe, "planted_row": row,
              "command": cmd[1:],
              "exit_code": done.returncode, "wall_s": round(wall, 1), "loadavg_before": load_before,
              "loadavg_after": os.getloadavg()}
    if done.returncode != 0:
        return result | {"judgement": "fail", "why": f"compare exited {done.returncode}: {done.stderr[-800:]}"}
    sides = {b: sorted(p for p in (out / name).iterdir() if p.is_dir() and p.name.split("-r")[0] == b)
             for b in ("paddle", "torch")}
    planted = planted_per_step(log, [d / "explain.json" for d in sides[side]], args.warmup)
    with open(out / "explain.csv", encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    first = next((r for r in rows if r.get("rank") == "1"), None)  # none under an unreliable verdict: nothing ranked
    mine = next((r for r in rows if r.get("module") == row), None)
    md = (out / "explain.md").read_text()
    kept = args.out / f"{family}-{load}-{side}"
    kept.mkdir(parents=True, exist_ok=True)
    for name_ in ("explain.md", "explain.csv"):
        (kept / name_).write_text((out / name_).read_text())
    reliable = "**The explanation is unreliable here**" not in md
    why = md.split("**The explanation is unreliable here**, because ")[1].split(". The rows are listed")[0] \
        if not reliable else ""
    cats = categories(sides)
    more = {c: cats[side].get(c, 0.0) - cats[other].get(c, 0.0) for c in cats[side]}
    top_category = max(more, key=more.get)
    plant_cats = plant_categories(sides[side])
    sign = -1.0 if side == "torch" else 1.0  # the rows are paddle − torch: a plant on torch makes them negative
    size = sign * float(first["diff_s"]) if first else None
    named = first is not None and first["module"] == row
    size_ok = named and abs(size - planted["per_step_s"]) <= TOLERANCE * planted["per_step_s"]
    category_ok = set(plant_cats) == {CATEGORY}
    ranks_right = named and size_ok and category_ok
    judgement = "pass" if ranks_right else "pass (says it cannot)" if not reliable else "fail"
    return result | {
        "planted": planted, "first_row": first and first["module"], "first_rank_diff_ms": size and size * 1e3,
        "planted_row_diff_ms": mine and sign * float(mine["diff_s"]) * 1e3, "planted_row_rank": mine and mine["rank"],
        "size_error": size and planted["per_step_s"] and (size - planted["per_step_s"]) / planted["per_step_s"],
        "named_first": named, "size_within_25%": size_ok, "top_category": top_category,
        "plant_categories_s_per_step": plant_cats,
        "planted_row": {k: mine.get(k) for k in ("paddle_fwd_s", "paddle_bwd_s", "torch_fwd_s", "torch_bwd_s",
                                                   "rank", "diff_s")} if mine else None,
        "category_right": category_ok, "planted_minus_other_ms_by_category": more, "reliable": reliable,
        "unreliable_because": why, "ranks_right": ranks_right, "judgement": judgement,
        "rests_on": next((line for line in md.splitlines() if line.startswith("Rows rest on")), "")}


def environment() -> dict:
    versions = {}
    for backend, module in (("torch", "torch"), ("paddle", "paddle")):
        python = ROOT / ".venv" / backend / "bin" / "python"
        got = subprocess.run([str(python), "-c", f"import {module}; print({module}.__version__)"],
                             capture_output=True, text=True, check=False)
        versions[backend] = got.stdout.strip() or got.stderr[-200:]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
            "versions": versions, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def table(results: list[dict]) -> str:
    lines = ["| family | load | planted on | first ranked row | its size (ms) | planted (ms/step, hooked steps) | "
             "error | the plant's operators counted in (ms/step) | category table: largest difference toward the "
             "planted side | verdict | judgement |",
             "|---|---|---|---|---:|---:|---:|---|---|---|---|"]
    for r in results:
        if "planted" not in r:
            lines.append(f"| {r['family']} | {r['load']} | {r['planted_side']} | – | – | – | – | – | – | – | "
                         f"{r['judgement']}: {r['why'][:80]} |")
            continue
        size = "–" if r["first_rank_diff_ms"] is None else f"{r['first_rank_diff_ms']:.2f}"
        error = "–" if r["size_error"] is None else f"{r['size_error']:+.0%}"
        verdict = "reliable" if r["reliable"] else "unreliable: " + r["unreliable_because"][:90]
        counted = ", ".join(f"{c} {v * 1e3:.1f}" for c, v in r["plant_categories_s_per_step"].items()) or "none found"
        lines.append(f"| {r['family']} | {r['load']} | {r['planted_side']} | {r['first_row'] or '–'} | {size} | "
                     f"{r['planted']['per_step_s'] * 1e3:.2f} | {error} | {counted} | {r['top_category']} | {verdict} | "
                     f"{r['judgement']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--loads", default="unloaded,loaded")
    parser.add_argument("--sides", default="torch", help="the side(s) the slowdown is planted on: torch, paddle")
    parser.add_argument("--plant-ms", type=float, default=15.0, help="the plant's target per call (ms)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "cpu" / "explain-planted")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT)]
    results = []
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="explain-planted-") as tmp:
        for family, load, side in [(f, lo, s) for f in args.families.split(",") for lo in args.loads.split(",")
                                   for s in args.sides.split(",")]:
                result = check(family, load, side, Path(tmp), args)
                results.append(result)
                print(f"{family} {load} {side}: {result['judgement']} (first {result.get('first_row')}, "
                      f"{result.get('first_rank_diff_ms')} ms against "
                      f"{(result.get('planted') or {}).get('per_step_s', 0) * 1e3:.2f} planted; "
                      f"{'reliable' if result.get('reliable') else result.get('unreliable_because', '')[:120]})",
                      flush=True)
                record = {"command": sys.argv, "args": {k: str(v) for k, v in vars(args).items()},
                          "environment": environment() if len(results) == 1 else None, "results": results}
                (args.out / "explain_planted.json").write_text(json.dumps(record, indent=1, default=str))
    env = environment()
    record = {"command": sys.argv, "args": {k: str(v) for k, v in vars(args).items()}, "environment": env,
              "results": results}
    (args.out / "explain_planted.json").write_text(json.dumps(record, indent=1, default=str))
    (args.out / "results.md").write_text(
        f"# Planted slowdown, explained ({env['date']})\n\n`{' '.join(sys.argv)}` on {env['cpu']} "
        f"({env['cores']} cores), torch {env['versions']['torch']}, paddle {env['versions']['paddle']}.\n\n"
        + table(results) + "\n")
    print(table(results))
    sys.exit(0 if all(r["judgement"].startswith("pass") for r in results) else 1)


if __name__ == "__main__":
    main()
