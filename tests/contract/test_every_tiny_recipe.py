"""Every tiny recipe, as shipped, trains on both backends and both build the same model; on
real data, on bit-identical batches. Recipes another test already runs on both backends with these
checks (status, equal total and trainable counts, equal micro-batch hashes) are left to it: two
real-data ones to test_compare_both_backends.py (`xfw compare`), five to test_parity.py (as shipped
but for the shared start: every one of them ships fp32 O0 on one process, what parity forces), one
to test_explain_both_backends.py::TestOtherFamilies (test_full_size_counts.py compares every tiny
recipe's counts on both sides).

Each backend trains the recipes one after another in ONE process of its own interpreter: for each recipe the
spec the launcher writes (``launcher.spec_for``) goes through ``harness.main``, the function
``python -m xfw_<backend>`` runs, and its records are judged as the launcher judges them (``launcher.classify``,
``summarize``). Two framework starts instead of sixteen (each imports Paddle and PaddleNLP, or PyTorch,
transformers and diffusers: ~8 s of CPU, most of what a tiny run costs); the launcher's own path around an
adapter process (its subprocess, environment, timeout) is run by test_compare_both_backends.py with the same
checks."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from xfw.contract import records as rec
from xfw.recipe import load_recipe
from xfw.report.measure import summarize
from xfw.run.launch import launcher

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract
BY_COMPARE = ("llava_next_json_sft", "sd15_captions")  # run end to end by test_compare_both_backends.py
BY_PARITY = ("qwen2vl_json_sft", "llava_sft", "llava_lora", "qwen2vl_sft", "sd15_pretrain")  # identical batches
BY_EXPLAIN = ("sd3_lora",)  # test_explain_both_backends.py::TestOtherFamilies, as shipped, with these checks
ELSEWHERE = BY_COMPARE + BY_PARITY + BY_EXPLAIN
ATTACHED = ("attach_",)  # run the user's own command: tests/contract/test_attach_real.py runs them
RECIPES = [p for p in sorted((ROOT / "recipes" / "tiny").glob("*.yaml"))
           if p.stem not in ELSEWHERE and not p.stem.startswith(ATTACHED)]


# What `python -m xfw_<backend> --spec S --records R` runs (its __main__), once per (spec, records) pair given.
TRAIN_ALL = """
import importlib, json, sys
from xfw.contract import harness
adapter = importlib.import_module("xfw_" + sys.argv[1] + ".session")
codes = [harness.main(adapter.build_session, adapter.describe, ["--spec", spec, "--records", records])
         for spec, records in json.loads(sys.argv[2])]
print("exit codes: " + json.dumps(codes))
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """recipe stem -> backend -> (status, reason, measurement, applied): every recipe of RECIPES trained by one
    process per backend (module docstring), judged as the launcher judges a run."""
    root = tmp_path_factory.mktemp("every")
    recipes = {p.stem: load_recipe(p, ["measure.warmup_steps=0", "measure.steps=2"]) for p in RECIPES}
    environments = {json.dumps(launcher.run_env(r), sort_keys=True) for r in recipes.values()}
    assert len(environments) == 1, environments  # one process per backend: every recipe asks the same threads
    env = {**os.environ, **json.loads(environments.pop())}  # as the launcher starts a run's process
    out = {stem: {} for stem in recipes}
    for name in ("torch", "paddle"):
        pairs = []
        for stem, recipe in recipes.items():
            run_dir = root / stem / name
            run_dir.mkdir(parents=True)
            (run_dir / "spec.json").write_text(json.dumps(launcher.spec_for(recipe, name, run_dir)))
            pairs.append((str(run_dir / "spec.json"), str(run_dir / "steps.jsonl")))
        done = subprocess.run([str(require_interpreter(name)), "-c", TRAIN_ALL, name, json.dumps(pairs)],
                              capture_output=True, text=True, timeout=900, env=env)
        codes = next((json.loads(line.removeprefix("exit codes: ")) for line in done.stdout.splitlines()[::-1]
                      if line.startswith("exit codes: ")), None)
        assert done.returncode == 0 and codes is not None, done.stderr[-3000:]
        for (stem, recipe), code, (_, records_path) in zip(recipes.items(), codes, pairs):
            records = rec.load_records(records_path)
            status, reason = launcher.classify(exit_code=code, timed_out=False, records=records, num_processes=1,
                                               stderr_tail=done.stderr[-8192:],
                                               timeout_s=recipe.measure.timeout_s)
            out[stem][name] = (status, reason, summarize(records), rec.applied_settings(records))
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
def test_tiny_recipe_trains_on_both_backends_with_equal_parameter_counts(path: Path, trained):
    results = trained[path.stem]
    for name, (status, reason, measurement, _) in results.items():
        assert status == "ok", f"{name}: {reason}"
        assert measurement.num_measured_steps == 2
    counts = {name: (a["num_params_total"], a["num_params_trainable"]) for name, (*_, a) in results.items()}
    assert counts["torch"] == counts["paddle"]
    digests = {measurement.batch_digest for _, _, measurement, _ in results.values()}
    assert len(digests) == 1 and None not in digests  # both sides trained on the same micro-batches
