"""Every tiny recipe, as shipped, trains on both backends and both build the same model; on
real data, on bit-identical batches. Recipes another test already runs on both backends with these
checks (status, equal total and trainable counts, equal micro-batch hashes) are left to it: two
real-data ones to test_compare_both_backends.py (`xfw compare`), five to test_parity.py (as shipped
but for the shared start: every one of them ships fp32 O0 on one process, what parity forces), one
to test_explain_both_backends.py::TestOtherFamilies (test_full_size_counts.py compares every tiny
recipe's counts on both sides)."""

from pathlib import Path

import pytest

from xfw.run.launch import launcher
from xfw.recipe import load_recipe

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract
BY_COMPARE = ("llava_next_json_sft", "sd15_captions")  # run end to end by test_compare_both_backends.py
BY_PARITY = ("qwen2vl_json_sft", "llava_sft", "llava_lora", "qwen2vl_sft", "sd15_pretrain")  # identical batches
BY_EXPLAIN = ("sd3_lora",)  # test_explain_both_backends.py::TestOtherFamilies, as shipped, with these checks
ELSEWHERE = BY_COMPARE + BY_PARITY + BY_EXPLAIN
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


def test_the_recipes_left_to_other_tests_are_run_there_as_shipped():
    """Parity forces fp32 O0 on one process: a recipe it runs stands for the shipped one only if it ships that."""
    from test_explain_both_backends import TestOtherFamilies
    from test_parity import RECIPES as PARITY

    assert set(BY_PARITY) == {Path(p).stem for p in PARITY.values()} - {"llava_next_json_sft"}
    assert set(BY_EXPLAIN) <= set(TestOtherFamilies.FAMILIES)
    compared = (Path(__file__).parent / "test_compare_both_backends.py").read_text()
    assert all(f'"recipes/tiny/{name}.yaml"' in compared for name in BY_COMPARE)
    for name in BY_PARITY:
        recipe = load_recipe(ROOT / "recipes" / "tiny" / f"{name}.yaml")
        assert (recipe.precision.dtype, recipe.precision.amp_level) == ("fp32", "O0"), name
        assert (recipe.parallel.nproc_per_node, recipe.parallel.nnodes, recipe.parallel.sharding) == (1, 1, "none")


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
