"""The JAX adapter, for real: tiny LLaVA and SD1.5 in Flax NNX beside PyTorch, through the commands a user runs.

JAX runs only as a subprocess of ``.venv/jax/bin/python`` (skipped when that is missing: scripts/setup_jax.sh
makes it). XLA compiles every program before its first step (seconds on CPU), so each test runs as few
steps as shows its point, and the runs share what they can: one compare of one process (:func:`compared`) is
both the documented compare's check and the one-process reference the two FSDP ranks are held to (the same
recipe, the same 1 + 2 steps), and the other one-process LLaVA runs keep its batch shapes, so XLA's persistent
compilation cache (tests/conftest.py) hands them its gradient program instead of compiling it again.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from xfw.contract import presets
from xfw.contract.records import load_records, validate_record
from xfw.run.launch import launcher

from conftest import ROOT, applied, kinds, require_interpreter, run_adapter

pytestmark = pytest.mark.contract
RECIPE = "recipes/tiny/llava_sft.yaml"
SHORT = ("--set", "measure.warmup_steps=1", "--set", "measure.steps=2")  # every jax,torch compare here
LLAVA_BATCH = {"global": 8, "micro": 4}  # RECIPE's: the one-process runs share its compiled gradient program
COUNTS = presets.count_params(presets.resolve_arch("tiny-llava", {}, None, None))


def xfw(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xfw.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout_s)


def test_describe_names_the_framework_and_xfw_env_lists_it():
    python = require_interpreter("jax")
    # `python -m xfw_jax --describe`, as every command asks it (kept for this session's next command: xfw env)
    described = launcher.describe_backend(launcher.Backend("jax", str(python)))
    assert described["framework"] == "jax" and described["versions"]["flax"]
    assert described["launcher"][:3] == ["{python}", "-m", "xfw_jax.launch"]  # one process per rank
    assert {"llava", "sd15"} <= set(described["families"])
    assert {"qwen2vl", "sd3"} <= set(described["unsupported"])  # what is not ported, each with its reason
    assert "MMDiT" in described["unsupported"]["sd3"]
    env = xfw("env", "--backends", "jax", timeout_s=120)
    assert env.returncode == 0 and "jax " in env.stdout and "flax" in env.stdout, env.stdout + env.stderr


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """docs/jax.md's compare of RECIPE on one process each (1 + 2 steps): checked by the test below, and the
    one process accumulating two micro-batches that the two FSDP ranks are held to."""
    require_interpreter("jax")
    out = tmp_path_factory.mktemp("compare") / "cmp"
    result = xfw("compare", RECIPE, "--backends", "jax,torch", *SHORT, "--out", str(out))
    return out, result


def test_compare_jax_torch_runs_both_with_equal_parameter_counts(compared):
    out, result = compared
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    sides = {b: load_records(out / "tiny-llava-sft" / b / "steps.jsonl") for b in ("jax", "torch")}
    for records in sides.values():
        assert all(validate_record(r) == [] for r in records)
        assert kinds(records) == ["start"] + ["step"] * 3 + ["window", "applied", "end"]
    jax_applied, torch_applied = applied(sides["jax"]), applied(sides["torch"])
    assert jax_applied["num_params_total"] == torch_applied["num_params_total"] == COUNTS["total"]
    assert jax_applied["num_params_trainable"] == torch_applied["num_params_trainable"]
    # jit's compile time is its own field, measured outside every step
    assert jax_applied["compile_time_s"] > 0 and jax_applied["mem_source"] == "peak_rss"
    assert "jax" in (out / "report.md").read_text()


def test_parity_jax_torch_ten_fp32_steps_pass(tmp_path):
    require_interpreter("jax")
    out = tmp_path / "parity"
    result = xfw("parity", RECIPE, "--backends", "jax,torch", "--steps", "10", "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    report = json.loads((out / "parity.json").read_text())
    assert report["passed"] is True and len(report["steps"]) == 10
    assert report["backends"][0] == "jax"  # the reference: the JAX side exported the shared start


# The JAX model's canonical names and shapes, traced abstractly (nnx.eval_shape: no storage, no compile; the
# very functions --export-weights writes the file with). Building SD1.5's values eagerly takes 45-50 s.
JAX_NAMES = """
import json, sys
from flax import nnx
from xfw_jax import model, names
spec = json.load(open(sys.argv[1]))
abstract = nnx.eval_shape(lambda: model.build_model(spec, weights=False))
shapes = {names.canonical(p): names.canonical_shape(p, v.get_value().shape) for p, v in model.params(abstract)}
print(json.dumps(shapes))
"""


def test_sd15_lora_has_the_very_names_and_shapes_diffusers_has(tmp_path):
    """Tiny SD1.5 in Flax NNX (UNet, VAE, CLIP text, peft's adapters on to_q/to_k/to_v/to_out.0) holds every
    tensor the PyTorch adapter's diffusers/transformers/peft model exports, under the same name and shape, so
    one file starts both (the losses' parity over 10 steps: results/cpu/jax/parity_sd15_*; not run here: XLA
    compiles the UNet's gradient program in 70-80 s on 2 loaded cores)."""
    from safetensors.numpy import load_file

    from xfw.recipe import load_recipe
    from xfw.recipe.spec import resolve_spec

    specs = {}
    for backend in ("jax", "torch"):
        specs[backend] = tmp_path / f"{backend}.json"
        spec = resolve_spec(load_recipe(str(ROOT / "recipes/tiny/sd15_lora.yaml"), []), backend=backend, run_id="t")
        specs[backend].write_text(json.dumps(spec))
    out = subprocess.run([str(require_interpreter("torch")), "-m", "xfw_torch", "--export-weights",
                          str(tmp_path / "torch"), "--spec", str(specs["torch"])], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    torch_names = {k: list(v.shape) for k, v in load_file(str(tmp_path / "torch" / "model.safetensors")).items()}
    out = subprocess.run([str(require_interpreter("jax")), "-c", JAX_NAMES, str(specs["jax"])], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    jax_names = {k: list(v) for k, v in json.loads(out.stdout).items()}
    assert jax_names == torch_names
    assert any(k.endswith("to_out.0.lora_A.weight") for k in jax_names)  # peft's suffix rule reached to_out.0
    sd15 = presets.count_params(presets.resolve_arch("tiny-sd15", {}, None, None))
    assert sum(int(np.prod(v)) for k, v in jax_names.items() if "lora_" not in k) == sd15["total"]


def test_explain_times_the_step_by_its_parts(tmp_path):
    """--explain on JAX: no module hooks inside jit, so the rows are the gradient program and the optimizer;
    the categories come from JAX's own profiler trace."""
    from xfw.recipe import recipe_from_dict
    from xfw.recipe.spec import resolve_spec
    from conftest import TINY_RECIPE

    python = require_interpreter("jax")
    spec = resolve_spec(recipe_from_dict({**TINY_RECIPE, "batch": LLAVA_BATCH,
                                          "measure": {"warmup_steps": 1, "steps": 2}}), backend="jax", run_id="test")
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = subprocess.run([str(python), "-m", "xfw_jax", "--explain", str(tmp_path / "explain.json"), "--spec",
                          str(tmp_path / "spec.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    explained = json.loads((tmp_path / "explain.json").read_text())
    rows = explained["modules"]
    assert rows["forward + backward (one XLA program)"]["fwd_s"] > 0 and rows["optimizer"]["bwd_s"] > 0
    assert sum(explained["categories"].values()) > 0 and (tmp_path / "trace.json").is_file()


def test_bf16_with_remat_and_clipping_is_recorded_as_applied(tmp_path):
    # one micro-batch a step: a gradient program of one forward and backward, half of what two unroll to compile
    code, records, stderr = run_adapter(
        "jax", tmp_path, batch={"global": 2, "micro": 2}, measure={"warmup_steps": 1, "steps": 2, "timeout_s": 120},
        precision={"dtype": "bf16", "amp_level": "O1"}, recompute=True,
        optimizer={"lr": 1.0e-3, "max_grad_norm": 1.0})
    assert code == 0, stderr[-3000:]
    a = applied(records)
    assert (a["weight_dtype"], a["compute_dtype"], a["recompute"]) == ("float32", "bfloat16", True)
    assert a["mechanisms"]["checkpointing"] == "nnx.remat (nothing_saveable)"
    assert "clip_by_global_norm(1)" in a["notes"]


@pytest.mark.parametrize("sections, reason", [
    ({"model": {"preset": "tiny-sd3"}, "stage": "dreambooth"}, "Stable Diffusion 3"),
    ({"precision": {"dtype": "fp16", "amp_level": "O1"}}, "loss scaler"),
])
def test_what_is_not_ported_is_unsupported_with_its_reason(tmp_path, sections, reason):
    code, records, stderr = run_adapter("jax", tmp_path, **sections)
    assert code == 3, stderr[-2000:]
    error = records[-1]
    assert error["kind"] == "error" and error["status"] == "unsupported" and reason in error["message"]


def test_two_ranks_fsdp_train_the_same_losses_as_one_process_accumulating(tmp_path, compared):
    """stage3 on two processes (xfw_jax.launch, jax.distributed over Gloo, parameters sharded over the mesh)
    against one process accumulating the same two micro-batches (the one-process compare of the same recipe and
    steps, :func:`compared`): one seeded start, the same samples. The two processes run as docs/jax.md's compare
    writes it (PyTorch's FSDP2 beside them; that command is not run again by test_documented_commands)."""
    require_interpreter("jax")
    out = tmp_path / "fsdp"
    short = SHORT  # test_documented_commands' COVERED table looks for this call's text, `*short` included
    result = xfw("compare", RECIPE, "--backends", "jax,torch", "--set", "parallel.nproc_per_node=2",
                 "--set", "parallel.sharding=stage3", *short, "--out", str(out))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert json.loads((out / "tiny-llava-sft" / "torch" / "summary.json").read_text())["status"] == "ok"
    records = load_records(out / "tiny-llava-sft" / "jax" / "steps.jsonl")
    assert sorted({r["rank"] for r in records if r["kind"] == "end"}) == [0, 1]
    a = applied(records)
    assert (a["sharding_impl"], a["num_processes"], a["grad_accum_steps"]) == ("jax_fsdp", 2, 1)
    one_dir, one_result = compared
    assert one_result.returncode == 0, one_result.stdout[-2000:] + one_result.stderr[-2000:]
    single = load_records(one_dir / "tiny-llava-sft" / "jax" / "steps.jsonl")
    assert (applied(single)["num_processes"], applied(single)["grad_accum_steps"]) == (1, 2)
    two = [r["loss"] for r in records if r["kind"] == "step" and r["rank"] == 0]
    one = [r["loss"] for r in single if r["kind"] == "step"]
    assert len(two) == 3 and two == pytest.approx(one, rel=1e-5)
