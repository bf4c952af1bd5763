"""Parity across the real adapters: the same start, the same batches, the same losses.

Each tiny recipe trains 3 steps on both backends from one exported weight file
(``xfw.run.parity.run_parity``); a weight changed on one side only is caught at step 0. When the
changed weight is the final RMSNorm's, the module probe names that module. The round trip
torch → file → Paddle → file → torch, every family: test_parity_roundtrip.py.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, require_interpreter
from xfw.run import launcher, parity
from xfw.contract import weights
from xfw.report.results import RunResult
from xfw.run.recipe import load_recipe

pytestmark = pytest.mark.contract

STEPS = 3
BACKENDS = ("torch", "paddle")  # the reference (exports the start) first
RECIPES = {"llava": "recipes/tiny/llava_sft.yaml", "qwen2vl": "recipes/tiny/qwen2vl_sft.yaml",
           "sd15": "recipes/tiny/sd15_pretrain.yaml", "llava-lora": "recipes/tiny/llava_lora.yaml",
           # Real batches (llava_json): LLaVA-1.6 grids mixed in one micro-batch, unpadding, a text-only
           # sample, padding to the longest, clipping at 1.0; Qwen2-VL patch grids mixed likewise.
           "llava-next-json": "recipes/tiny/llava_next_json_sft.yaml", "qwen2vl-json": "recipes/tiny/qwen2vl_json_sft.yaml"}


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    require_interpreter("torch")
    require_interpreter("paddle")
    out = tmp_path_factory.mktemp("parity")
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
    # ... on bit-identical batches: every micro-batch's hash equal on both sides.
    digests = {RunResult.load(ROOT / d).measurement.batch_digest for d in report.run_dirs.values()}
    assert len(digests) == 1 and None not in digests


def test_lora_runs_start_from_the_same_adapters_so_every_step_matches_to_rounding(parity_runs):
    """LoRA B starts at zero, so step 0 cannot tell whose A each side holds; from step 1 the
    update of B goes through A. Had either side kept its own seeded A, step 1 would differ by far
    more than fp32 rounding (measured 7.6e-8 with shared adapters)."""
    report = parity_runs["llava-lora"]
    assert all(s.rel_diff <= 1e-6 for s in report.steps[1:]), report.markdown()
    saved = weights.load_file(f"{report.weights_dir}/model.safetensors")
    assert any(n.endswith(".lora_A.weight") and np.abs(v).max() > 0 for n, v in saved.items())


def launch_paddle(recipe_path: str, weights_dir, run_dir):
    backend = launcher.resolve_backend("paddle", {})
    recipe = load_recipe(recipe_path, parity.forced_overrides(STEPS, weights_dir))
    return launcher.launch(recipe, backend, run_dir, description=parity.describe_backend(backend))


def test_a_weight_changed_on_one_side_fails_parity_at_step_0_and_the_module_is_named(parity_runs, tmp_path):
    report = parity_runs["llava"]
    state = weights.load_file(f"{report.weights_dir}/model.safetensors")
    state["model.language_model.norm.weight"] = state["model.language_model.norm.weight"] * np.float32(1.01)
    weights.save_file(state, tmp_path / "changed" / "model.safetensors")

    result = launch_paddle(str(ROOT / RECIPES["llava"]), tmp_path / "changed", tmp_path / "paddle")
    assert result.ok, result.reason
    torch_losses = parity.measured_losses(ROOT / report.run_dirs["torch"])
    steps = parity.compare_losses(torch_losses, parity.measured_losses(tmp_path / "paddle"))
    assert not steps[0].passed and steps[0].rel_diff > 1e-5
    probes = [parity.probe(launcher.resolve_backend(name, {}), run_dir, 120)
              for name, run_dir in (("torch", ROOT / report.run_dirs["torch"]), ("paddle", tmp_path / "paddle"))]
    assert parity.first_differing_module(*probes) == "model.language_model.norm"


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
