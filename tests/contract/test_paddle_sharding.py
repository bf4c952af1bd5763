"""Paddle's master gradients and ZeRO stages as PaddleNLP's Trainer applies them, run for real and
compared, not just run (xfw_paddle.parallel; issues 22 and 27).

* Plain CPU, DataParallel over two processes with bf16 O2 asked for: Paddle's CPU build ignores AMP
  (fp32), but the master-gradient machinery runs — the optimizer applies fp32 ``main_grad`` (seen, not
  assumed) all-reduced after the last micro-batch — and the losses and gradient norms equal one process's
  on the same global batch, Paddle's and PyTorch's from the same exported weights (fp32); DataParallel with
  plain fp32 gradients and fleet's stage 1 with master gradients equal the same one process (one run for
  all three).
* The CPU test device (``backends.paddle.device: testcpu``; skipped where it is not built): stage 2 and
  stage 3 through ``group_sharded_parallel`` over two processes equal one process on the same global batch,
  fp32 and bf16 O2 with fp32 ``main_grad``, for LLaVA; for every other tiny family stage 3 at bf16 O2 equals
  one process and stage 2 at fp32 PyTorch's FSDP2 stage 2 (SD1.5, SD3, Qwen2-VL) or PyTorch's one process
  (LLaVA-Next: :data:`FSDP2_FAMILIES`) (so each runs both stages and both precisions, each stage x precision
  path runs on LLaVA); and
  ``paddle.amp.decorate(master_grad=True)`` under stage 2 — the route the adapter no longer takes —
  diverges where ``MixPrecisionLayer`` does not (:func:`test_decorate_master_grad_under_sharding_diverges`).
* bf16 O2 across frameworks (issue 35): LLaVA's and Qwen2-VL's bf16 O2 on the test device against PyTorch's
  bf16 O2 from the same exported start, step by step, within a bound made of PyTorch's own bf16-vs-fp32 spread
  (:func:`test_llava_bf16_o2_on_testcpu_follows_pytorchs_bf16_o2`).

Tolerances: fp32, relative 1e-5 on the loss and 1e-4 on the gradient norm (reduction order only;
measured ~1e-7); Paddle against PyTorch 1e-4 / 1e-3 (the parity bounds); bf16 O2 sharded against one
process 1e-6 on the loss and 1e-6 on the norm (:data:`BF16`: derived in docs/testdevice.md, "Tolerances of the
bf16 sharding comparisons"; the earlier 2e-2 / 5e-2 were over 10^5 times the measured spread).
Every run: 1 warm-up + 2 measured steps (1 for SD1.5 and SD3) on the recipe's shipped shapes, global batch 4
in micro-batches of 2 (SD1.5 and SD3 on the test device: 2 in micro-batches of 1, and 16-px images instead of
their recipes' 32: :data:`SMALL`). The plain-CPU refusal of stage 2/3 is test_paddle_parallel.py's. Process starts, not steps,
are most of this file's CPU: starts to PyTorch are exported by one process per scope (:func:`export_starts_of`),
and a reference run is launched once and shared by name (:class:`Runs`).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import ROOT, require_interpreter
from xfw.contract.records import load_records
from xfw.run.launch import launcher
from xfw.run.commands.parity import export_starts
from xfw.recipe import load_recipe
from xfw.recipe.spec import resolve_spec

pytestmark = pytest.mark.contract

SHORT = ["measure.warmup_steps=1", "measure.steps=2", "measure.timeout_s=400", "batch.global=4", "batch.micro=2"]
BF16_O2 = ["precision.dtype=bf16", "precision.amp_level=O2"]
FP32 = {"loss": 1e-5, "norm": 1e-4}
# bf16 O2 sharded against one process. Global batch 4 in micro-batches of 2 (SD1.5 and SD3: 2 in 1) on 2 ranks:
# each rank runs the micro-batch the one process runs as one of its two accumulation steps, with the same bf16
# weights and kernels, so every bf16 value is the same; the one process's fp32 main_grad is g0 + g1, the ranks' reduction g0 + g1
# (fp32 addition of two terms commutes), halved (exact in binary). So the weights stay bit for bit the one
# process's, and the runs can differ only in how the logged loss is averaged (a few fp32 ulps, 2**-21
# relative) and in the order of the squares summed into the global norm. Measured, every family, stage 2 and 3,
# two starts (2026-11-27): loss at most 5.2e-8 relative (under an ulp), norm at most 6.1e-8 (bit-equal but for
# SD1.5's stage 2). The bound: 1e-6 relative on both (8 ulps). Only a rounding order changed (micro-batches of
# 1 instead of 2 on one process) moves LLaVA's loss by 8.3e-6 relative at step 1, 8 times the bound; rank 1
# reusing stale gathered parameters under stage 3 (mutation stale_gather_rank1) by 5.4e-4 at step 0. The loss
# itself fails. Valid for this layout only: more ranks or micro-batches reorder the fp32 sums (measure again).
BF16 = {"loss": 1e-6, "norm": 1e-6}
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


def export_starts_of(tmp_path_factory, recipes: dict[str, tuple[str, list[str]]]) -> dict[str, str]:
    """The torch side's initial weights of each named (recipe, overrides), written by ONE torch process
    (``export_starts``: the framework imported once), as a ``model.weights=...`` override each: every
    comparison with PyTorch starts from them."""
    pairs, done = [], {}
    for name, (recipe, overrides) in recipes.items():
        directory = tmp_path_factory.mktemp(f"{name}-start")
        spec = resolve_spec(load_recipe(ROOT / recipe, [*SHORT, *overrides]), backend="torch", run_id=f"{name}/export")
        pairs.append((directory, spec))
        done[name] = f"model.weights={directory}"
    export_starts(launcher.Backend("torch", str(require_interpreter("torch"))), pairs, 300)
    return done


@pytest.fixture(scope="module")
def llava_start(tmp_path_factory):
    return export_starts_of(tmp_path_factory, {"llava": (LLAVA, [])})["llava"]


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
    assert len(got) == len(want) >= 2
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
        assert loss == pytest.approx(ref_loss, rel=tol["loss"]), f"step {step}: loss {loss} vs {ref_loss}"
        if norms:
            assert norm is not None and math.isfinite(norm)
            assert norm == pytest.approx(ref_norm, rel=tol["norm"]), f"step {step}: gradient norm {norm} vs {ref_norm}"


# -- plain CPU: DataParallel with master gradients ------------------------------------------------

def test_data_parallel_with_fp32_main_grad_equals_one_process_and_pytorch(runs, llava_start):
    norm = "backends.paddle.grad_norm=true"
    one = runs.get("cpu-one", LLAVA, "paddle", [llava_start, norm])
    # find_unused_parameters (a knob the published settings set: PaddleNLP's Trainer passes True for a
    # plain nn.Layer such as SD1.5's) taken here too: it must not change a step.
    dp = runs.get("cpu-dp-main-grad", LLAVA, "paddle", [llava_start, norm, "parallel.nproc_per_node=2", *BF16_O2,
                                                        "backends.paddle.find_unused_parameters=true"])
    mech = dp.applied["mechanisms"]
    assert dp.applied["amp_level"] == "O0" and "requested bf16 O2, ran fp32 O0" in dp.applied["notes"]
    assert mech["master_grads"] == "fp32 main_grad (MixPrecisionLayer); held: float32 main_grad"
    assert mech["sharding_impl"] == "data_parallel" and mech["grad_reduce_dtype"] == "float32"
    assert mech["sharding_detail"] == "paddle.DataParallel(find_unused_parameters=True)"
    assert "find_unused_parameters=True" in dp.applied["notes"]
    assert one.applied["mechanisms"]["master_grads"] == "none; held: float32 grad"
    assert_same_steps(dp, one, FP32)
    # Against PyTorch's one process on the same global batch (the run test_llava_stage2_equals_pytorch_stage2_at_fp32
    # holds Paddle's stage 2 to): losses and, as PyTorch records norms on one process only, gradient norms too.
    # PyTorch's DDP equals its one process (test_torch_parallel.py), so a DDP run here would add a launch, not a check.
    torch_one = runs.get("torch-one-norm", LLAVA, "torch", [llava_start, "backends.torch.grad_norm=true"])
    assert_same_steps(dp, torch_one, {"loss": 1e-4, "norm": 1e-3})


def test_data_parallel_with_plain_fp32_grads_equals_one_process(runs, llava_start):
    """DataParallel without master gradients (fp32 asked for: plain ``.grad`` all-reduced) equals one process
    on the same global batch, losses and gradient norms. Moved from test_paddle_parallel.py (issue 44): there
    it had a one-process run of its own; here it shares ``cpu-one`` with the two tests beside it."""
    one = runs.get("cpu-one", LLAVA, "paddle", [llava_start, NORM])
    dp = runs.get("cpu-dp-plain", LLAVA, "paddle", [llava_start, NORM, "parallel.nproc_per_node=2"])
    assert dp.applied["sharding_impl"] == "data_parallel" and dp.applied["num_processes"] == 2
    assert dp.measurement.num_ranks == 2
    assert dp.applied["mechanisms"]["master_grads"] == one.applied["mechanisms"]["master_grads"] == \
        "none; held: float32 grad"
    assert_same_steps(dp, one, FP32)


def test_fleet_stage1_with_fp32_main_grad_equals_one_process(runs, llava_start):
    """Stage 1 (fleet's DygraphShardingOptimizer, gloo) with master gradients: each rank applies its own
    share, so the gradient norm is summed over the sharding group."""
    norm = "backends.paddle.grad_norm=true"
    one = runs.get("cpu-one", LLAVA, "paddle", [llava_start, norm])
    run = runs.get("cpu-stage1-main-grad", LLAVA, "paddle", [llava_start, norm, "parallel.nproc_per_node=2",
                                                             "parallel.sharding=stage1", *BF16_O2])
    assert run.applied["mechanisms"]["sharding_impl"] == "zero1"
    assert run.applied["sharding_impl"] == "fleet_sharding_stage1" and run.applied["num_processes"] == 2
    assert run.measurement.num_ranks == 2
    assert run.applied["mechanisms"]["master_grads"] == "fp32 main_grad (MixPrecisionLayer); held: float32 main_grad"
    assert_same_steps(run, one, FP32)


# -- the CPU test device: group_sharded_parallel stage 2/3, fp32 and bf16 O2 -----------------------

TESTCPU = "backends.paddle.device=testcpu"
NORM = "backends.paddle.grad_norm=true"
# Which family gets which check: LLaVA every stage and precision, and PyTorch's stage 2; every other family
# stage 3 in bf16 O2 against one process and stage 2 in fp32 against PyTorch's (TestEveryFamily),
# one warm-up and one measured step for the slower diffusion families.
FAMILY_RECIPES = {"llava_next": "recipes/tiny/llava_next_sft.yaml", "qwen2vl": "recipes/tiny/qwen2vl_sft.yaml",
                  "sd15": "recipes/tiny/sd15_pretrain.yaml", "sd3": "recipes/tiny/sd3_dreambooth.yaml"}
# The diffusion families' steps are the slow ones on the device's bf16 kernels: global batch 2 in micro-batches
# of 1 (two accumulation steps on one process, one per rank on two: the layout :data:`BF16` is derived for, with
# half the samples; issue 44), on 16-px images instead of the recipes' 32 (8-px latents: every VAE and UNet/MMDiT
# level still runs, at 4 and 2 px below it; SD1.5's one-process bf16 run 17 -> 13 CPU s; no check here asserts
# a shape, and :data:`BF16`'s argument is about the batch layout, not the image).
SMALL = ["measure.steps=1", "batch.global=2", "batch.micro=1", "data.image_size=16"]
FAMILY_STEPS = {"sd15": SMALL, "sd3": SMALL}
PRECISIONS = {"fp32": ([], FP32), "bf16-o2": (BF16_O2, BF16)}
SEGMENT = 1024  # stage 3 slices every parameter of at least this many elements (LLaVA's matrices, embeddings)
CROSS_FAMILIES = ["qwen2vl"]  # bf16 O2 against PyTorch's in the suite besides LLaVA (two PyTorch runs each)
# The families whose stage 2 at fp32 is held to PyTorch's FSDP2 stage 2 on two processes: those whose blocks no
# other test wraps in FSDP2 (xfw_torch's sd15, sd3 and qwen2vl shard_units). LLaVA-Next is held to PyTorch's one
# process instead (loss and gradient norm: stricter; issue 44, a launch of three PyTorch processes fewer): its
# FSDP2 blocks are LLaVA's (llava.shard_units, wrapped by test_llava_stage2_equals_pytorch_stage2_at_fp32).
FSDP2_FAMILIES = ("sd15", "sd3", "qwen2vl")


@pytest.fixture(scope="module")
def testcpu():
    if not _testdevice_available():
        pytest.skip("the CPU test device is not built (scripts/build_testdevice.sh; make setup does it)")


def sharded(runs, start, recipe, name, stage, precision):
    overrides, _ = PRECISIONS[precision]
    parallel = ["parallel.nproc_per_node=2", f"parallel.sharding={stage}"] if stage != "one" else []
    if stage == "stage3":  # below Paddle's default segment_size (2**20) nothing of a tiny model is sliced
        parallel.append(f"backends.paddle.sharding_segment_size={SEGMENT}")
    return runs.get(f"testcpu-{name}-{stage}-{precision}", recipe, "paddle",
                    [*start, TESTCPU, NORM, *overrides, *parallel])


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_llava_stages_on_two_processes_equal_one_process(testcpu, runs, llava_start, stage, precision):
    one = sharded(runs, [llava_start], LLAVA, "llava", "one", precision)
    run = sharded(runs, [llava_start], LLAVA, "llava", stage, precision)
    applied, mech = run.applied, run.applied["mechanisms"]
    assert applied["device"].startswith("testcpu (CPU test device") and mech["device"] == "testcpu"
    assert mech["sharding_impl"] == {"stage2": "zero2", "stage3": "zero3"}[stage]
    assert mech["sharding_detail"] == ("group_sharded_parallel os_g" if stage == "stage2" else
                                       f"group_sharded_parallel p_g_os segment_size={SEGMENT}")
    assert "timings and memory are a CPU's" in applied["notes"]
    if precision == "bf16-o2":  # AMP ran bf16 on the device, master gradients in fp32 main_grad
        assert applied["amp_level"] == "O2" and applied["compute_dtype"] == "bfloat16"
        assert applied["weight_dtype"] == "bfloat16" and mech["master_grads"].endswith("held: float32 main_grad")
        assert mech["grad_reduce_dtype"] == "float32"
    assert_same_steps(run, one, PRECISIONS[precision][1])


def test_llava_stage2_overlap_is_applied_recorded_and_changes_no_step(testcpu, runs, llava_start):
    """``stage2_overlap`` (PaddleNLP's ``enable_stage2_overlap``): asynchronous reduces and post-step broadcasts,
    recorded as a mechanism; the same steps as one process, as without it (bf16 O2, fp32 main_grad)."""
    one = sharded(runs, [llava_start], LLAVA, "llava", "one", "bf16-o2")
    plain = sharded(runs, [llava_start], LLAVA, "llava", "stage2", "bf16-o2")
    overlap = runs.get("testcpu-llava-stage2-overlap", LLAVA, "paddle", [
        llava_start, TESTCPU, NORM, *BF16_O2, "parallel.nproc_per_node=2", "parallel.sharding=stage2",
        "backends.paddle.stage2_overlap=true"])
    assert plain.applied["mechanisms"]["comm_overlap"].startswith("none: stage 2 reduces each gradient bucket")
    mech = overlap.applied["mechanisms"]
    assert mech["comm_overlap"].startswith("overlapped: asynchronous gradient reduces")
    assert mech["sharding_detail"] == "group_sharded_parallel os_g with reduce and broadcast overlap"
    assert one.applied["mechanisms"]["comm_overlap"] == "n/a (one process)"
    assert_same_steps(overlap, one, BF16)


def test_llava_stage2_equals_pytorch_stage2_at_fp32(testcpu, runs, llava_start):
    """Losses against FSDP2 stage 2; gradient norms (which the PyTorch side records on one process only)
    against PyTorch's one process on the same global batch: gradients summed over the ranks instead of
    averaged double the norm while AdamW leaves the loss as it was."""
    paddle_run = sharded(runs, [llava_start], LLAVA, "llava", "stage2", "fp32")
    torch_run = runs.get("torch-fsdp2-stage2", LLAVA, "torch", [llava_start, "parallel.nproc_per_node=2",
                                                                "parallel.sharding=stage2"])
    assert torch_run.applied["sharding_impl"] == "fsdp2"
    assert_same_steps(paddle_run, torch_run, {"loss": 1e-4}, norms=False)
    torch_one = runs.get("torch-one-norm", LLAVA, "torch", [llava_start, "backends.torch.grad_norm=true"])
    assert_same_steps(paddle_run, torch_one, {"loss": 1e-4, "norm": 1e-3})


def bf16_cross_bounds(pt16, pt32, pd32) -> list[tuple[float, float]]:
    """Per step, how far Paddle's bf16 O2 may be from PyTorch's bf16 O2 (loss, gradient norm; absolute):
    ``2 * E + |pd32_t - pt32_t|``, where E is PyTorch's own bf16 error envelope, the largest distance over the
    run's steps of its bf16 O2 run from its fp32 run. Why: a correct bf16 O2 implementation errs from its own
    fp32 run by bf16 rounding carried through this model and these steps, whose size PyTorch's run measures
    (E); if Paddle's errs by no more, the triangle inequality through the two fp32 runs (held to each other by
    parity) gives this bound. It is computed from PyTorch's runs only, so a Paddle bf16 bug cannot widen it.
    docs/testdevice.md, "bf16 across frameworks", has the measured numbers."""
    a, b, c = steps_of(pt16), steps_of(pt32), steps_of(pd32)
    assert len(a) == len(b) == len(c)
    envelope = [max(abs(x[k] - y[k]) for x, y in zip(a, b)) for k in (0, 1)]
    return [tuple(2 * envelope[k] + abs(p[k] - t[k]) for k in (0, 1)) for p, t in zip(c, b)]


def test_llava_bf16_o2_on_testcpu_follows_pytorchs_bf16_o2(testcpu, runs, llava_start):
    """Issue 35, point 3: the device's bf16 (its kernels, Paddle's AMP O2 lists, MixPrecision master weights)
    against an independent bf16 O2, PyTorch's on its own CPU kernels, from the same exported start on the same
    batches, every step, loss and gradient norm. Only PyTorch's bf16 run is new here (the other three are the
    runs above). Measured 2026-11-27 (3 steps): loss at most 9.5e-5 against a bound of 2.6e-4, norm at most
    9.0e-4 against 5.5e-3; with the device's bf16 stores truncating instead of rounding to nearest even (the
    mutation ``bf16_store_truncates``) the loss is 5.2e-4 off at step 1 and the norm 3.3e-2 at step 0; with the
    bf16 matmul truncating (``matmul_truncate``) the norm 2.0e-2 at step 0, the loss within its bound."""
    pd16 = sharded(runs, [llava_start], LLAVA, "llava", "one", "bf16-o2")
    pd32 = sharded(runs, [llava_start], LLAVA, "llava", "one", "fp32")
    pt32 = runs.get("torch-one-norm", LLAVA, "torch", [llava_start, "backends.torch.grad_norm=true"])
    pt16 = runs.get("torch-one-bf16-o2-norm", LLAVA, "torch", [llava_start, "backends.torch.grad_norm=true", *BF16_O2])
    assert_bf16_follows_pytorch(pd16, pd32, pt16, pt32)


def assert_bf16_follows_pytorch(pd16, pd32, pt16, pt32) -> None:
    """Paddle's bf16 O2 run within :func:`bf16_cross_bounds` of PyTorch's at every step, loss and norm;
    ``pd32``/``pt32`` are the fp32 runs from the same start (the first must equal the second: parity)."""
    assert pt16.applied["amp_level"] == "O2" and pt16.applied["compute_dtype"] == "bfloat16"
    assert pd16.applied["amp_level"] == "O2" and pd16.applied["compute_dtype"] == "bfloat16"
    assert_same_steps(pd32, pt32, {"loss": 1e-4, "norm": 1e-3})  # the fp32 runs the bound goes through agree
    bounds = bf16_cross_bounds(pt16, pt32, pd32)
    # bf16 really ran on both sides: each moved off its fp32 run (else the bound is fp32 parity's alone).
    assert steps_of(pt16) != steps_of(pt32) and steps_of(pd16) != steps_of(pd32)
    assert len(steps_of(pd16)) == len(steps_of(pt16)) == len(bounds) >= 2
    for step, ((loss, norm), (ref_loss, ref_norm), (loss_bound, norm_bound)) in enumerate(
            zip(steps_of(pd16), steps_of(pt16), bounds)):
        assert abs(loss - ref_loss) <= loss_bound, f"step {step}: bf16 loss {loss} vs PyTorch's {ref_loss} (bound {loss_bound:.2e})"
        assert abs(norm - ref_norm) <= norm_bound, f"step {step}: bf16 norm {norm} vs PyTorch's {ref_norm} (bound {norm_bound:.2e})"


@pytest.fixture(scope="class")
def family_starts(testcpu, tmp_path_factory):
    """Each family's start (TestEveryFamily's): ``model.weights`` from one export (torch imported once for all
    four: three processes fewer), then its size overrides; every run of a family, Paddle's and PyTorch's,
    starts from it."""
    weights = export_starts_of(tmp_path_factory, {family: (recipe, FAMILY_STEPS.get(family, []))
                                                  for family, recipe in FAMILY_RECIPES.items()})
    return {family: [weights[family], *FAMILY_STEPS.get(family, [])] for family in FAMILY_RECIPES}


class TestEveryFamily:
    """Every other tiny family runs stage 2 and stage 3, fp32 and bf16 O2, in two checks: stage 3 at bf16 O2
    (slicing, gathering and fp32 ``main_grad``: the seed rows' precision) equals one process to fp32 rounding
    (:data:`BF16`), and stage 2 at fp32 equals PyTorch from the same exported start (FSDP2 stage 2 for SD1.5,
    SD3 and Qwen2-VL; PyTorch's one process, loss and norm, for LLaVA-Next: :data:`FSDP2_FAMILIES`). The
    other two stage x precision cases are LLaVA's only (issue 44: two launches of two processes fewer a
    family): stage 2 at bf16 O2 against one process is
    ``test_llava_stages_on_two_processes_equal_one_process[stage2-bf16-o2]`` (and the overlap test), stage 3
    at fp32 ``...[stage3-fp32]``; each family's own stage 2 path is its fp32 test here, its stage 3 path its
    bf16 test. A class: ``make test``'s ``--dist loadscope`` runs it in the other worker than the LLaVA tests
    above. The four families' starts are exported by one PyTorch process (:func:`family_starts`)."""

    @pytest.mark.parametrize("family", FAMILY_RECIPES)
    def test_stage3_at_bf16_o2_equals_one_process(self, testcpu, runs, family_starts, family):
        start = family_starts[family]  # the fp32 tests' start
        one = sharded(runs, start, FAMILY_RECIPES[family], f"{family}-from-torch", "one", "bf16-o2")
        run = sharded(runs, start, FAMILY_RECIPES[family], f"{family}-from-torch", "stage3", "bf16-o2")
        mech = run.applied["mechanisms"]
        assert run.applied["amp_level"] == "O2" and mech["master_grads"].endswith("held: float32 main_grad")
        assert mech["sharding_impl"] == "zero3"
        assert mech["sharding_detail"] == f"group_sharded_parallel p_g_os segment_size={SEGMENT}"
        assert_same_steps(run, one, BF16)

    @pytest.mark.parametrize("family", FAMILY_RECIPES)
    def test_stage2_at_fp32_equals_pytorch(self, testcpu, runs, family_starts, family):
        """Against FSDP2 stage 2 on the loss (:data:`FSDP2_FAMILIES`), or against PyTorch's one process on the
        loss and the gradient norm (what test_llava_stage2_equals_pytorch_stage2_at_fp32 does for LLaVA with
        both)."""
        start = family_starts[family]
        paddle_run = sharded(runs, start, FAMILY_RECIPES[family], f"{family}-from-torch", "stage2", "fp32")
        assert paddle_run.applied["mechanisms"]["sharding_impl"] == "zero2"
        if family in FSDP2_FAMILIES:
            torch_run = runs.get(f"torch-fsdp2-stage2-{family}", FAMILY_RECIPES[family], "torch",
                                 [*start, "parallel.nproc_per_node=2", "parallel.sharding=stage2"])
            assert torch_run.applied["sharding_impl"] == "fsdp2"
            assert_same_steps(paddle_run, torch_run, {"loss": 1e-4}, norms=False)
        else:  # LLaVA-Next: PyTorch's one process
            torch_one = runs.get(f"torch-one-norm-{family}", FAMILY_RECIPES[family], "torch",
                                 [*start, "backends.torch.grad_norm=true"])
            assert_same_steps(paddle_run, torch_one, {"loss": 1e-4, "norm": 1e-3})

    @pytest.mark.parametrize("family", CROSS_FAMILIES)
    def test_bf16_o2_on_testcpu_follows_pytorchs_bf16_o2(self, testcpu, runs, family_starts, family):
        """LLaVA's cross-framework bf16 check (above) for another architecture (Qwen2-VL: its vision tower,
        M-RoPE, tied LM head): two PyTorch runs on one process, fp32 and bf16 O2, from the exported start.
        Paddle's fp32 side is the stage-2 run above (stage 2 equals one process: LLaVA's stage tests), and
        PyTorch's fp32 run the one that test holds it to (loss and gradient norm). Measured 2026-11-27: loss at most 1.0e-4 against 1.7e-4, norm
        1.5e-3 against 7.6e-3. The other families were measured by hand only (docs/testdevice.md)."""
        start = family_starts[family]
        pd16 = sharded(runs, start, FAMILY_RECIPES[family], f"{family}-from-torch", "one", "bf16-o2")
        pd32 = sharded(runs, start, FAMILY_RECIPES[family], f"{family}-from-torch", "stage2", "fp32")
        pt32 = runs.get(f"torch-one-norm-{family}", FAMILY_RECIPES[family], "torch", [*start, "backends.torch.grad_norm=true"])
        pt16 = runs.get(f"torch-one-bf16-o2-norm-{family}", FAMILY_RECIPES[family], "torch",
                        [*start, "backends.torch.grad_norm=true", *BF16_O2])
        assert_bf16_follows_pytorch(pd16, pd32, pt16, pt32)


def test_decorate_master_grad_under_sharding_diverges(testcpu, tmp_path):
    """Why the adapter takes PaddleNLP's route: under stage 2, ``decorate(master_grad=True)`` leaves an
    fp32 gradient that ``clear_grad()`` does not clear (seen: the first layer's weight gradient the same
    after clear_grad, 4.6e24 one step later, NaN after), while ``MixPrecisionLayer``/
    ``MixPrecisionOptimizer`` follows the one-process run within bf16's tolerance
    (paddle_master_grad_routes.py). Shown on the CPU test device; unconfirmed on a GPU."""
    import json
    import os
    import subprocess

    python = require_interpreter("paddle")
    env = json.loads(subprocess.run([str(python), "-c", "import json; from xfw_paddle import testdevice; "
                                     "print(json.dumps(testdevice.env()))"], capture_output=True, text=True,
                                    timeout=120, check=True).stdout)
    out = tmp_path / "routes.json"
    script = Path(__file__).with_name("paddle_master_grad_routes.py")
    done = subprocess.run([str(python), "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
                           str(tmp_path / "log"), str(script), str(out)], capture_output=True, text=True,
                          timeout=400, env={**os.environ, **env, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    losses = json.loads(out.read_text())
    reference, main_grad, decorate = losses["reference"], losses["main_grad"], losses["decorate"]
    # MixPrecisionLayer's route follows one process at every step within `bound` (absolute; measured on the
    # test device 2026-11-27: at most 1.6e-3, 1.5% of the loss at step 5 of 8: the ranks round their half
    # batches' bf16 activations and losses apart from the one-process run); the first step is the same
    # model and data for all three, so equal.
    bound = 5e-3
    assert len(main_grad) == len(reference) == len(decorate) == 8
    assert all(abs(x - r) <= bound for x, r in zip(main_grad, reference)), losses
    assert abs(decorate[0] - reference[0]) <= bound, losses
    # decorate(master_grad=True) drifts away: some step off by 100 times that bound, or not finite (measured:
    # 4.50 against 0.41 at step 3, 19.2 against 0.06 at step 8; NaN with some fills).
    assert any(not math.isfinite(x) or abs(x - r) > 100 * bound for x, r in zip(decorate, reference)), losses


def test_sd3_fp16_o2_with_a_loss_scaler_data_parallel_equals_one_process(testcpu, runs):
    """fp16 O2 (SD3's seed rows): the GradScaler patched by MixPrecisionScaler unscales the fp32 main_grad;
    DataParallel over two processes equals one process (gradient norms unscaled on both)."""
    fp16 = [TESTCPU, NORM, "precision.dtype=fp16", "precision.amp_level=O2", *SMALL]
    one = runs.get("testcpu-sd3-one-fp16", FAMILY_RECIPES["sd3"], "paddle", fp16)
    dp = runs.get("testcpu-sd3-dp-fp16", FAMILY_RECIPES["sd3"], "paddle", [*fp16, "parallel.nproc_per_node=2"])
    assert dp.applied["compute_dtype"] == "float16" and "GradScaler" in dp.applied["notes"]
    assert dp.applied["mechanisms"]["master_grads"].endswith("held: float32 main_grad")
    assert_same_steps(dp, one, {"loss": 1e-2, "norm": 2e-2})
