"""How much does xfw's harness cost? The adapter's throughput against a bare hand-written
loop on the same model, optimizer and batches, alternated in one process (A B A B ...) so
drift hits both sides alike. The target is a ratio within 2% of 1.

    python benchmarks/harness_overhead.py recipes/qwen2vl2b_sft.yaml --set batch.micro=4 ... --out r.json

The bare loop is nanoGPT-bench style: synchronise, N optimizer steps, synchronise, time. It
uses O1 (autocast over fp32 weights) so it needs no master-weight bookkeeping: the recipe's
precision is forced to bf16 O1 on both sides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from xfw.contract import harness
from xfw.report.measure import summarize
from xfw.run.recipe import load_recipe, resolve_spec
from xfw.contract.records import RecordWriter, load_records
from xfw.contract.synthetic import make_pool
from xfw_torch.session import build_session


def bare_loop(session, pool, accum: int, steps: int) -> float:
    """Samples per second of a hand-written loop over the session's model and optimizer."""
    model, optimizer, micro = session.model, session.optimizer, pool[0]["input_ids"].shape[0]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in range(steps):
        for i in range(accum):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**pool[(step * accum + i) % len(pool)]).loss / accum
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return steps * accum * micro / (time.perf_counter() - t0)


def harness_loop(spec: dict, session, steps: int) -> float:
    run_spec = {**spec, "measure": {**spec["measure"], "warmup_steps": 0, "steps": steps}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "steps.jsonl"
        writer = RecordWriter(path, 0)
        harness.run_training(run_spec, writer, session)
        writer.close()
        return summarize(load_records(path)).ips


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    overrides = args.overrides + ["precision.dtype=bf16", "precision.amp_level=O1"]
    spec = resolve_spec(load_recipe(args.recipe, overrides), backend="torch", run_id="overhead")
    session = build_session(spec)
    accum = spec["derived"]["grad_accum_steps"]
    pool = [session.to_device(b) for b in make_pool(spec, 0)]
    bare_loop(session, pool, accum, 3)  # warm-up: kernels, allocator, autotuning
    bare, harnessed = [], []
    for _ in range(args.rounds):
        bare.append(bare_loop(session, pool, accum, args.steps))
        harnessed.append(harness_loop(spec, session, args.steps))
    result = {
        "recipe": args.recipe, "overrides": overrides, "steps_per_round": args.steps, "rounds": args.rounds,
        "bare_ips": bare, "harness_ips": harnessed,
        "ratio_harness_over_bare": statistics.median(harnessed) / statistics.median(bare),
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
