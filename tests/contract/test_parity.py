"""Parity across the real adapters: the same start, the same batches, the same losses.

Each tiny recipe trains 3 steps on both backends from one exported weight file
(``xfw.run.commands.parity.run_parity``; the torch adapter's export of each start in this process:
``torch_exports_in_this_process``). The final RMSNorm's weight negated on one side (``xfw parity
--weights paddle=DIR``) fails step 0, and the module probe names that module by comparing outputs
element by element (the negated output keeps its norm). The round trip
torch → file → Paddle → file → torch, every family: test_parity_roundtrip.py.

Explain on SD1.5 and Qwen2-VL profiles these parity runs (each side's ``--explain`` process, as
``xfw explain`` starts it after its own runs), held to test_explain_both_backends.py's family checks:
training those two families twice more for it would only repeat these runs.
"""

import contextlib
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, require_interpreter
from xfw.run.commands import parity
from xfw.contract import weights
from xfw.report.results import RunResult
from xfw.recipe import load_recipe

pytestmark = pytest.mark.contract

STEPS = 3
BACKENDS = ("torch", "paddle")  # the reference (exports the start) first
RECIPES = {"llava": "recipes/tiny/llava_sft.yaml", "qwen2vl": "recipes/tiny/qwen2vl_sft.yaml",
           "sd15": "recipes/tiny/sd15_pretrain.yaml", "llava-lora": "recipes/tiny/llava_lora.yaml",
           # Real batches (llava_json): LLaVA-1.6 grids mixed in one micro-batch, unpadding, a text-only
           # sample, padding to the longest, clipping at 1.0; Qwen2-VL patch grids mixed likewise.
           "llava-next-json": "recipes/tiny/llava_next_json_sft.yaml", "qwen2vl-json": "recipes/tiny/qwen2vl_json_sft.yaml"}


@contextlib.contextmanager
def torch_exports_in_this_process():
    """run_parity's export of the start (``export_initial_weights``: the recipe loaded, its spec.json written),
    with the torch adapter's ``--export-weights`` called in this process (the test interpreter is the torch
    environment, its framework imported once) instead of a process per recipe; every other adapter task, and
    the runs, as ever (test_parity_hf_names.py's parity run too). The export's own process is run by
    test_a_negated_weight_on_one_side_is_located_by_xfw_parity (``xfw parity``)."""
    from xfw.run.launch import launcher

    real = launcher.adapter_task

    def task(backend, args, **kwargs):
        if backend.name != "torch" or args[:1] != ["--export-weights"]:
            return real(backend, args, **kwargs)
        from xfw.contract import harness
        from xfw_torch.side_tasks import export_weights
        from xfw_torch.session import build_session, describe

        # what `python -m xfw_torch --export-weights DIR --spec SPEC ...` runs (xfw_torch/__main__.py)
        code = harness.main(build_session, describe, args, export_weights=export_weights)
        if code != harness.EXIT_OK:
            raise launcher.BackendError(f"backend 'torch': {kwargs.get('failed')} (exit {code})")
        return ""

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launcher, "adapter_task", task)
        yield


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    require_interpreter("torch")
    require_interpreter("paddle")
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("parity")
    with torch_exports_in_this_process():
        return {name: parity.run_parity(str(ROOT / path), [], STEPS, out / name, {}, backends=BACKENDS)
                for name, path in RECIPES.items()}


@pytest.mark.parametrize("family", RECIPES)
def test_both_backends_train_the_same_model_from_the_same_weights(parity_runs, family):
    report = parity_runs[family]
    assert report.passed, report.markdown()
    assert [s.step for s in report.steps] == list(range(STEPS))
    assert report.steps[0].rel_diff <= 1e-5 and all(s.rel_diff <= 1e-3 for s in report.steps)
    # Both sides recorded a gradient norm every step, within the tolerance (measured ≤ 1e-5).
    assert all(s.grad_norm_reference > 0 and s.grad_norm_rel_diff <= 1e-3 for s in report.steps)
    saved = parity.ParityReport.load(Path(report.weights_dir).parent)
    assert saved.to_dict() == report.to_dict() and saved.passed
    assert "— PASS" in report.markdown() and report.markdown().count("✓") == STEPS
    for run_dir in report.run_dirs.values():  # every side ran fp32 O0 from the shared export
        spec = json.loads((ROOT / run_dir / "spec.json").read_text())
        assert spec["model"]["weights"] == report.weights_dir and spec["precision"]["amp_level"] == "O0"
    # ... on bit-identical batches: every micro-batch's hash equal on both sides; and both built the same model,
    # every parameter and every trainable one (test_every_tiny_recipe.py leaves these recipes to this check).
    results = [RunResult.load(ROOT / d) for d in report.run_dirs.values()]
    digests = {r.measurement.batch_digest for r in results}
    assert len(digests) == 1 and None not in digests
    counts = {(r.applied["num_params_total"], r.applied["num_params_trainable"]) for r in results}
    assert len(counts) == 1, counts


def test_lora_runs_start_from_the_same_adapters_so_every_step_matches_to_rounding(parity_runs):
    """LoRA B starts at zero, so step 0 cannot tell whose A each side holds; from step 1 the
    update of B goes through A. Had either side kept its own seeded A, step 1 would differ by far
    more than fp32 rounding (measured 7.6e-8 with shared adapters)."""
    report = parity_runs["llava-lora"]
    assert all(s.rel_diff <= 1e-6 for s in report.steps[1:]), report.markdown()
    saved = weights.load_file(f"{report.weights_dir}/model.safetensors")
    assert any(n.endswith(".lora_A.weight") and np.abs(v).max() > 0 for n, v in saved.items())


def test_a_negated_weight_on_one_side_is_located_by_xfw_parity(parity_runs, tmp_path):
    """The final norm's weight negated on the Paddle side (``xfw parity --weights paddle=DIR``): its
    output keeps its norm, so only an element-wise comparison can name the module."""
    report = parity_runs["llava"]
    state = weights.load_file(f"{report.weights_dir}/model.safetensors")
    state["model.language_model.norm.weight"] = -state["model.language_model.norm.weight"]
    weights.save_file(state, tmp_path / "negated" / "model.safetensors")

    python = require_interpreter("torch")
    out = tmp_path / "parity"
    result = subprocess.run([str(python), "-m", "xfw.cli", "parity", RECIPES["llava"], "--steps", "2", "--out", str(out),
                             "--backends", ",".join(BACKENDS), "--weights", f"paddle={tmp_path / 'negated'}"], capture_output=True, text=True,
                            cwd=ROOT, timeout=600)
    assert result.returncode == 1, result.stderr[-2000:]
    saved = json.loads((out / "parity.json").read_text())
    assert saved["first_failing_step"] == 0 and saved["first_differing_module"] == "model.language_model.norm"
    assert saved["module_difference"]["compared"] == "elements" and saved["module_difference"]["rel_diff"] > 1.9
    assert "First module whose output differs" in result.stdout and "`model.language_model.norm`" in result.stdout
    assert f"paddle started from {tmp_path / 'negated'}" in result.stdout


def test_parity_refuses_weights_for_a_backend_it_does_not_compare(tmp_path):
    python = require_interpreter("torch")
    result = subprocess.run([str(python), "-m", "xfw.cli", "parity", RECIPES["llava"], "--out", str(tmp_path / "p"),
                             "--weights", f"jax={tmp_path}"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2 and "--weights jax=" in result.stderr and "not one of the compared" in result.stderr
    result = subprocess.run([str(python), "-m", "xfw.cli", "parity", RECIPES["llava"], "--out", str(tmp_path / "p"),
                             "--weights", f"paddle={tmp_path}"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2 and "holds no model.safetensors" in result.stderr


def test_a_weight_file_that_does_not_fit_is_rejected_naming_the_key(tmp_path):
    """In process (the test interpreter is the torch environment); the Paddle side runs the
    same strict check (xfw.contract.weights.check_shapes) on its converted shapes."""
    torch = pytest.importorskip("torch")
    from xfw.contract.harness import InvalidSpec
    from xfw_torch.session import load_weights

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    state = {n: p.detach().numpy() for n, p in model.named_parameters()}
    weights.save_file({**state, "0.weight": np.zeros((3, 2), np.float32)}, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(InvalidSpec, match=r"model\.weights: .* shapes differ \(e\.g\. 0\.weight: model \[2, 3\]"):
        load_weights(model, str(tmp_path / "bad"))
    del state["1.bias"]
    weights.save_file(state, tmp_path / "short" / "model.safetensors")
    with pytest.raises(InvalidSpec, match=r"1 parameters missing \(e\.g\. 1\.bias\)"):
        load_weights(model, str(tmp_path / "short"))
    with pytest.raises(InvalidSpec, match="holds no model.safetensors"):
        load_weights(model, str(tmp_path))


EXPLAINED = {"sd15": ("unet.", False), "qwen2vl": ("model.visual.", True)}  # family -> (its part, a tied LM head)


@pytest.mark.parametrize("family", EXPLAINED)
def test_explain_on_the_parity_runs_of_other_families(parity_runs, family):
    """SD1.5's diffusion loss calling the model's parts, Qwen2-VL's own vision tower and tied head: each side's
    adapter profiles the parity run's spec (explain_runs, as ``xfw explain`` does after its measured runs), and
    the rows cover the step and align (test_explain_both_backends.py's SD3 LoRA case runs ``xfw explain``)."""
    from test_explain_both_backends import assert_family_explained
    from xfw.contract.explain import read_explain
    from xfw.run.commands.explain import explain_runs
    from xfw.run.launch import launcher

    run_dirs = {b: ROOT / d for b, d in parity_runs[family].run_dirs.items()}
    results = [RunResult.load(d) for d in run_dirs.values()]
    found = explain_runs(results, {b: (launcher.resolve_backend(b, {}), {}) for b in run_dirs})
    assert all(path is not None for path, _ in found.values()), found
    explains = {r.backend: read_explain(str(found[r.run_dir][0])) for r in results}
    part, tied_head = EXPLAINED[family]
    # a run measured over 3 steps (STEPS) is explained over as many of each kind (explain_steps)
    assert_family_explained(explains, run_dirs, part, steps=STEPS, tied_head=tied_head)
