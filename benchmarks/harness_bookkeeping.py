"""What the harness itself costs per step on synthetic data, before and after a change: the
training loop of a git revision (default ``main``) against this checkout's, each driving a
framework-free session whose step does nothing, alternated round by round in one process
(A B A B ...) so drift hits both alike. Any difference is the harness's own bookkeeping.

    .venv/torch/bin/python benchmarks/harness_bookkeeping.py --against main --out results/cpu/harness_bookkeeping.json

The session's step returns at once, so the numbers are microseconds of pure overhead per
optimizer step, inside the measured window (what a measurement pays) and for the whole call (the
pool, its hashes, the records written after the window); a real step takes milliseconds (CPU) to
seconds (GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import tempfile
import time
import types
from pathlib import Path

from xfw.contract import harness
from xfw.contract.records import RecordWriter, load_records
from xfw.recipe import load_recipe
from xfw.recipe.spec import resolve_spec

ROOT = Path(__file__).resolve().parents[1]


class NoopSession:
    rank, num_ranks = 0, 1

    def to_device(self, batch):
        return batch

    def train_step(self, micro_batches):
        return 0.0

    loss_token = loss_value = staticmethod(lambda x: x)
    timestamp = staticmethod(time.perf_counter)
    is_done = staticmethod(lambda stamp: True)
    elapsed_s = staticmethod(lambda start, end: end - start)
    synchronize = staticmethod(lambda: None)
    memory_peaks = staticmethod(lambda: (None, None))

    def applied(self):
        return {"framework": "none", "framework_version": "0", "device": "cpu", "device_name": "none",
                "weight_dtype": "float32", "compute_dtype": "float32", "amp_level": "O0", "master_weights": False,
                "sharding_impl": "none", "attention_impl": "none", "tf32": False, "fused_optimizer": False,
                "recompute": False, "num_params_total": 1, "num_params_trainable": 1, "num_processes": 1,
                "grad_accum_steps": 1, "mem_source": "peak_rss", "notes": ""}


def loop_of(revision: str, directory: Path) -> types.ModuleType:
    """``xfw/contract/harness.py`` as it is at ``revision``, imported from a copy in ``directory``;
    it runs against this checkout's contract (records, synthetic data)."""
    source = subprocess.run(["git", "show", f"{revision}:xfw/contract/harness.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = directory / f"harness_{revision.replace('/', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_step_us(module, spec: dict, steps: int) -> tuple[float, float]:
    """(microseconds per step inside the measured window, per step for the whole call: pool, records)."""
    with tempfile.TemporaryDirectory() as tmp:
        writer = RecordWriter(Path(tmp) / "steps.jsonl", 0)
        t0 = time.perf_counter()
        module.run_training(spec, writer, NoopSession())
        elapsed = time.perf_counter() - t0
        writer.close()
        window = next(r for r in load_records(Path(tmp) / "steps.jsonl") if r["kind"] == "window")
    return window["window_time_s"] / steps * 1e6, elapsed / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="main")
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "tiny" / "llava_sft.yaml"))
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    spec = resolve_spec(load_recipe(args.recipe, ["measure.warmup_steps=0", f"measure.steps={args.steps}"]),
                        backend="none", run_id="bookkeeping")
    spec["backend_knobs"] = {}
    timings = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        old, new = loop_of(args.against, Path(tmp)), harness
        for _ in range(args.rounds):
            timings["before"].append(per_step_us(old, spec, args.steps))
            timings["after"].append(per_step_us(new, spec, args.steps))
    median = {k: [statistics.median(t[i] for t in v) for i in (0, 1)] for k, v in timings.items()}
    result = {"recipe": args.recipe, "steps_per_round": args.steps, "rounds": args.rounds, "against": args.against,
              "window_us_per_step_before": [t[0] for t in timings["before"]],
              "window_us_per_step_after": [t[0] for t in timings["after"]],
              "median_window_us_before": median["before"][0], "median_window_us_after": median["after"][0],
              "window_ratio_after_over_before": median["after"][0] / median["before"][0],
              "median_call_us_before": median["before"][1], "median_call_us_after": median["after"][1],
              "machine": platform.processor() or platform.machine(), "python": platform.python_version()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
