"""Parity's comparison and report, without any backend."""

import json
import math

import numpy as np

from xfw.contract import weights
from xfw.report import parity
from xfw.run.commands import parity as run_parity
from xfw.recipe import load_recipe


def test_losses_within_tolerance_pass_and_the_first_step_has_the_tighter_one():
    steps = parity.compare_losses([2.0, 2.0, 2.0], [2.0 + 1e-6, 2.0 + 1e-3, 2.0 + 1e-2])
    assert [s.passed for s in steps] == [True, True, False]
    assert steps[0].abs_diff == abs((2.0 + 1e-6) - 2.0) and math.isclose(steps[2].rel_diff, 5e-3)
    assert [s.tolerance_rel for s in steps] == [1e-5, 1e-3, 1e-3]
    assert not parity.compare_losses([2.0], [2.0 + 1e-4])[0].passed  # 5e-5 relative: over step 0's 1e-5


def test_a_missing_or_non_finite_loss_fails_its_step():
    steps = parity.compare_losses([1.0, 1.0, float("nan")], [1.0, None, 1.0])
    assert [s.passed for s in steps] == [True, False, False]
    assert steps[1].abs_diff is None and steps[1].loss_other is None


def report(other: list) -> parity.ParityReport:
    return parity.ParityReport(recipe="tiny", num_steps=2, weights_dir="w", run_dirs={"torch": "t", "paddle": "p"},
                               tolerances=parity.Tolerances(), steps=parity.compare_losses([3.0, 2.5], other))


def test_the_report_round_trips_through_json_and_says_pass_or_fail(tmp_path):
    good, bad = report([3.0, 2.5]), report([3.1, 2.5])
    assert good.passed and good.first_failing_step is None and "— PASS" in good.markdown()
    assert not bad.passed and bad.first_failing_step == 0
    assert "— FAIL" in bad.markdown() and "First step outside tolerance: 0." in bad.markdown()
    bad.save(tmp_path)
    loaded = parity.ParityReport.load(tmp_path)
    assert loaded.to_dict() == bad.to_dict() and loaded.to_dict()["passed"] is False


def test_a_short_run_fails_even_when_every_step_it_has_agrees():
    short = parity.ParityReport(recipe="tiny", num_steps=3, weights_dir="w", run_dirs={},
                                tolerances=parity.Tolerances(), steps=parity.compare_losses([1.0], [1.0]))
    assert not short.passed


def test_parity_forces_fp32_one_process_no_warmup_and_the_shared_weights():
    forced = run_parity.forced_overrides(10, "out/weights")
    for setting in ("precision.dtype=fp32", "precision.amp_level=O0", "parallel.nproc_per_node=1",
                    "measure.warmup_steps=0", "measure.steps=10", "model.weights=out/weights"):
        assert setting in forced
    assert not any(s.startswith("model.weights") for s in run_parity.forced_overrides(10))


def probe(outputs: dict) -> parity.Probe:
    """A side's probe: modules in call order with their outputs."""
    return [{"name": n, "norm": float(np.linalg.norm(v)), "shape": list(v.shape)} for n, v in outputs.items()], outputs


def test_the_first_module_whose_output_differs_is_named_in_forward_order():
    x = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4)
    ours = probe({"embed": x, "pos": x, "norm": x * 2, "head": x * 3})
    theirs = probe({"embed": x + 1e-7, "head": x * 3.5, "norm": x * 2.1})
    assert parity.first_differing_module(ours, theirs)["name"] == "norm"  # "pos" is only a module on one side
    assert parity.first_differing_module(probe({"embed": x}), theirs) is None
    assert parity.first_differing_module(probe({"x": x}), probe({"x": x * np.nan}))["name"] == "x"


def test_a_negated_output_keeps_its_norm_and_is_still_found_element_by_element():
    x = np.linspace(-1.0, 2.0, 12, dtype=np.float32).reshape(3, 4)
    found = parity.first_differing_module(probe({"a": x, "norm": x}), probe({"a": x, "norm": -x}))
    assert found["name"] == "norm" and found["compared"] == "elements"
    assert found["num_differing"] == 12 and math.isclose(found["rel_diff"], 2.0, rel_tol=1e-6)
    # The rounding identical weights give (≤ 7.0e-6 of the largest magnitude, measured) is not a difference.
    assert parity.first_differing_module(probe({"a": x}), probe({"a": x + np.float32(2e-6)})) is None


def test_outputs_of_different_shapes_or_an_old_probe_fall_back_to_the_norm():
    x = np.ones((2, 3), np.float32)
    old_theirs = ([{"name": "a", "norm": 2.0}], {})  # written before outputs were kept
    assert parity.first_differing_module(probe({"a": x}), old_theirs)["compared"] == "norm"
    assert parity.first_differing_module(probe({"a": x}), probe({"a": x.reshape(3, 2)})) is None
    batched = parity.first_differing_module(probe({"a": x}), probe({"a": -x.reshape(2, 1, 3)}))  # same elements
    assert batched["compared"] == "elements" and batched["num_differing"] == 6


def test_a_failed_step_always_says_which_module_or_why_none_could_be_named():
    x = np.ones((2, 3), np.float32)
    failed = report([3.1, 2.5])
    failed.locate(probe({"a": x}), probe({"a": x}))
    assert failed.first_differing_module is None and "no module could be named" in failed.module_note
    assert "no module could be named: none of the 1 modules" in failed.markdown()
    failed.locate(probe({"a": x}), probe({"a": -x}))
    assert "`a`: 6 of 6 elements beyond tolerance" in failed.markdown()
    unprobed = report([3.1, 2.5])
    assert "No module could be named." in unprobed.markdown()


def test_gradient_norms_are_compared_per_step_and_fail_a_step_beyond_their_tolerance():
    grads = ([1.0, 2.0, 4.0], [1.0 + 1e-7, 2.0 + 1e-2, 4.0])
    steps = parity.compare_losses([3.0, 2.5, 2.0], [3.0, 2.5, 2.0], grad_norms=grads)
    assert [s.passed for s in steps] == [True, False, True]  # 5e-3 relative at step 1: over 1e-3
    assert math.isclose(steps[1].grad_norm_rel_diff, 5e-3) and steps[1].grad_norm_other == 2.01
    step0 = parity.compare_losses([3.0], [3.0], grad_norms=([1.0], [1.0 + 3e-4]))
    assert not step0[0].passed  # 3e-4 at step 0: over its 1e-5 (a LoRA A of its own measured 3.1e-4)
    report_only = parity.compare_losses([3.0, 2.5, 2.0], [3.0, 2.5, 2.0],
                                        parity.Tolerances(grad_norm_step0_rel=None, grad_norm_rel=None),
                                        grad_norms=grads)
    assert all(s.passed for s in report_only) and report_only[1].grad_norm_rel_diff is not None
    nan = parity.compare_losses([3.0], [3.0], grad_norms=([1.0], [float("nan")]))
    assert not nan[0].passed
    missing = parity.compare_losses([3.0], [3.0], grad_norms=([None], [None]))  # runs that did not record them
    assert missing[0].passed and missing[0].grad_norm_rel_diff is None


def test_the_report_shows_gradient_norms_and_the_worst_differences(tmp_path):
    r = parity.ParityReport(recipe="tiny", num_steps=2, weights_dir="w", run_dirs={}, tolerances=parity.Tolerances(),
                            steps=parity.compare_losses([3.0, 2.5], [3.0, 2.5 + 2.5e-6],
                                                        grad_norms=([1.0, 2.0], [1.0 + 3e-6, 2.0])))
    text = r.markdown()
    assert "| torch grad norm |" not in text and "| reference grad norm | other grad norm |" in text
    assert "Worst relative difference: loss 1.00e-06 (step 1), gradient norm 3.00e-06 (step 0)." in text
    r.save(tmp_path)
    saved = json.loads((tmp_path / "parity.json").read_text())
    assert saved["worst"] == {"loss_rel_diff": r.steps[1].rel_diff, "loss_step": 1,
                              "grad_norm_rel_diff": r.steps[0].grad_norm_rel_diff, "grad_norm_step": 0}
    assert parity.ParityReport.load(tmp_path).to_dict() == r.to_dict()


def test_parity_asks_every_backend_for_gradient_norms():
    forced = run_parity.forced_overrides(3, None, ("torch", "paddle"))
    assert "backends.torch.grad_norm=true" in forced and "backends.paddle.grad_norm=true" in forced


def test_a_compare_finds_the_parity_run_of_the_same_recipe_by_fingerprint(write_recipe, tmp_path):
    recipe = load_recipe(write_recipe(), [])
    assert run_parity.recipe_fingerprint(recipe) == run_parity.recipe_fingerprint(
        load_recipe(write_recipe(), run_parity.forced_overrides(10, None, ("torch",))))  # what parity forces is ignored
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    weights.save_file({"w": np.ones(3, np.float32)}, checkpoint / weights.WEIGHTS_FILE)
    from_checkpoint = load_recipe(write_recipe(), [f"model.weights={checkpoint}"])
    assert run_parity.recipe_fingerprint(from_checkpoint) != run_parity.recipe_fingerprint(recipe)  # another start
    other = load_recipe(write_recipe(), ["batch.micro=4"])
    assert run_parity.recipe_fingerprint(other) != run_parity.recipe_fingerprint(recipe)
    assert run_parity.find_parity(recipe, [tmp_path]) == {"status": "none", "path": None, "note": ""}

    r = report([3.1, 2.5])
    r.recipe, r.recipe_fingerprint = recipe.name, run_parity.recipe_fingerprint(recipe)
    (tmp_path / "parity-tiny").mkdir()
    r.save(tmp_path / "parity-tiny")
    found = run_parity.find_parity(recipe, [tmp_path])  # one level below a search directory
    assert found["status"] == "failed" and found["num_steps"] == 2 and found["first_failing_step"] == 0
    assert found["path"] == str((tmp_path / "parity-tiny" / "parity.json").resolve())
    assert found["worst"]["loss_step"] == 0
    elsewhere = run_parity.find_parity(other, [tmp_path / "parity-tiny"])
    assert elsewhere["status"] == "none" and "is for another configuration of tiny-test" in elsewhere["note"]
