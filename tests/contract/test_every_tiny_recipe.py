"""Every tiny recipe, as shipped, trains on both backends and both build the same model; on
real data, on bit-identical batches. Three real-data recipes are left to the tests that already run
them on both backends with these checks: two to test_compare_both_backends.py (`xfw compare`), one
to test_parity.py (test_full_size_counts.py compares every tiny recipe's counts on both sides)."""

from pathlib import Path

import pytest

from xfw.run.launch import launcher
from xfw.recipe import load_recipe

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract
ELSEWHERE = ("llava_next_json_sft", "sd15_captions",  # run end to end by test_compare_both_backends.py
             "qwen2vl_json_sft")  # by test_parity.py, identical batches checked there too
ATTACHED = ("attach_",)  # run the user's own command: tests/contract/test_attach_real.py runs them
RECIPES = [p for p in sorted((ROOT / "recipes" / "tiny").glob("*.yaml"))
           if p.stem not in ELSEWHERE and not p.stem.startswith(ATTACHED)]


@pytest.fixture(scope="module")
def backends():
    out = {}
    for name in ("torch", "paddle"):
        backend = launcher.Backend(name, str(require_interpreter(name)))
        out[name] = (backend, launcher.describe_backend(backend))
    return out


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_tiny_recipe_trains_on_both_backends_with_equal_parameter_counts(path: Path, backends, tmp_path):
    recipe = load_recipe(path, ["measure.warmup_steps=0", "measure.steps=2"])
    results = {name: launcher.launch(recipe, backend, tmp_path / name, description=description)
               for name, (backend, description) in backends.items()}
    for name, result in results.items():
        assert result.status == "ok", f"{name}: {result.reason}"
        assert result.measurement.num_measured_steps == 2
    counts = {name: (r.applied["num_params_total"], r.applied["num_params_trainable"]) for name, r in results.items()}
    assert counts["torch"] == counts["paddle"]
    digests = {r.measurement.batch_digest for r in results.values()}
    assert len(digests) == 1 and None not in digests  # both sides trained on the same micro-batches
