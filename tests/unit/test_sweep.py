"""Sweeps: points are the cartesian product, each a run directory; a sweep resumes where it stopped."""

import json

import pytest
from click.testing import CliRunner

from xfw import cli
from xfw.run.commands import sweep
from xfw.report.compare import compare_runs
from xfw.recipe import RecipeError
from xfw.report.nodes import load_runs


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)


def python_args(fake_backend):
    return ["--python", f"fake={fake_backend['fake']}"]  # the sweeps here run the fake backend only


def test_values_split_only_at_top_level_commas():
    assert sweep.split_top_level("1,2") == ["1", "2"]
    assert sweep.split_top_level("[q_proj,v_proj],[q_proj]") == ["[q_proj,v_proj]", "[q_proj]"]
    assert sweep.split_top_level("{a: 1, b: 2},'x,y'") == ["{a: 1, b: 2}", "'x,y'"]


def test_a_sweep_is_the_cartesian_product_in_option_order(write_recipe):
    points = sweep.plan(str(write_recipe()), ["batch.micro=1,2", "recompute=false,true"])
    assert [p.variant for p in points] == [
        {"batch.micro": 1, "recompute": False}, {"batch.micro": 1, "recompute": True},
        {"batch.micro": 2, "recompute": False}, {"batch.micro": 2, "recompute": True}]
    assert points[1].label == "batch.micro-1__recompute-true"
    assert points[3].recipe.batch.micro == 2 and points[3].recipe.recompute is True


def test_a_yaml_list_value_is_one_point_not_two(write_recipe):
    path = write_recipe(stage="lora", lora={"r": 4, "alpha": 8, "targets": ["q_proj"]})
    points = sweep.plan(str(path), ["lora.targets=[q_proj,v_proj],[q_proj]"])
    assert [p.recipe.lora.targets for p in points] == [["q_proj", "v_proj"], ["q_proj"]]
    assert points[0].label == "lora.targets-q_proj_v_proj"


def test_every_bad_point_is_named_before_anything_launches(write_recipe):
    path = write_recipe()
    with pytest.raises(RecipeError) as err:
        sweep.plan(str(path), ["batch.micro=1,3"])  # global 4 is not divisible by 3
    assert f"{path}: batch.global: 4 is not divisible by micro (3)" in str(err.value)
    assert "(point batch.micro=3)" in str(err.value)


@pytest.mark.parametrize("option,message", [("batch.micro", "expected key.path=value"),
                                            ("batch.micro=1,,2", "empty value"),
                                            ("batch.micro=1,1", "given twice")])
def test_malformed_set_options_are_one_line_errors(write_recipe, option, message):
    with pytest.raises(RecipeError, match=message):
        sweep.plan(str(write_recipe()), [option])


def test_sweep_runs_every_point_records_its_variant_and_reports_a_row_per_point(write_recipe, tmp_path,
                                                                               fake_backend):
    recipe = write_recipe(backends={"fake": {"ips": 120}, "fake2": {"ips": 100}})
    out = tmp_path / "sweep"
    result = invoke("sweep", recipe, "--set", "batch.micro=1,2", "--backends", "fake,fake2", "--out", out,
                    *python_args(fake_backend), "--python", f"fake2={fake_backend['fake2']}")
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "tiny-test" / "batch.micro-2" / "fake" / "summary.json").read_text())
    assert summary["variant"] == {"batch.micro": 2} and summary["status"] == "ok"
    assert "| Tiny LLaVA | SFT | batch.micro=1 | 120 (one run, no spread) | +20% (one run, no spread) | 100 (one run, no spread) |" in result.output
    assert "| SFT | batch.micro=2 | 120 (one run, no spread) | +20% (one run, no spread) | 100 (one run, no spread) |" in result.output
    assert "[4/4] batch.micro-2 / fake2" in result.output


def test_an_interrupted_sweep_resumes_and_reruns_only_unfinished_runs(write_recipe, tmp_path, fake_backend):
    recipe = write_recipe(backends={"fake": {"ips": 120}})
    out = tmp_path / "sweep"
    args = ["sweep", recipe, "--set", "batch.micro=1,2", "--backends", "fake", "--out", out,
            *python_args(fake_backend)]
    assert invoke(*args).exit_code == 0
    killed = out / "tiny-test" / "batch.micro-2" / "fake"
    (killed / "summary.json").unlink()  # as if the sweep was killed mid-run
    kept = out / "tiny-test" / "batch.micro-1" / "fake" / "summary.json"
    before = kept.stat().st_mtime_ns
    again = invoke(*args)
    assert again.exit_code == 0
    assert "[1/2] batch.micro-1 / fake: ok, kept from an earlier run" in again.output
    assert kept.stat().st_mtime_ns == before
    assert json.loads((killed / "summary.json").read_text())["status"] == "ok"


def test_a_changed_recipe_is_refused_and_with_force_reruns_the_point(write_recipe, tmp_path, fake_backend):
    out = tmp_path / "sweep"
    base = ["--set", "batch.micro=1", "--backends", "fake", "--out", out, *python_args(fake_backend)]
    invoke("sweep", write_recipe(backends={"fake": {"ips": 120}}), *base)
    refused = invoke("sweep", write_recipe(backends={"fake": {"ips": 60}}), *base)
    assert refused.exit_code == 2 and "holds a run of other settings" in refused.output and "--force" in refused.output
    assert load_runs([out])[0].measurement.ips == pytest.approx(120.0)  # nothing replaced
    again = invoke("sweep", write_recipe(backends={"fake": {"ips": 60}}), *base, "--force")
    assert "kept from an earlier run" not in again.output
    (run,) = load_runs([out])
    assert run.measurement.ips == pytest.approx(60.0)


def test_repeats_of_one_variant_collapse_to_their_median_and_variants_stay_apart(write_recipe, tmp_path,
                                                                                fake_backend):
    recipe = write_recipe(backends={"fake": {"ips": 120}}, measure={"warmup_steps": 0, "steps": 2, "repeat": 2})
    out = tmp_path / "sweep"
    invoke("sweep", recipe, "--set", "batch.micro=1,2", "--backends", "fake", "--out", out, *python_args(fake_backend))
    runs = load_runs([out])
    assert len(runs) == 4
    rows = compare_runs(runs, ["fake"])
    assert [r.variant for r in rows] == [{"batch.micro": 1}, {"batch.micro": 2}]
    assert all(r.sides["fake"].num_repeats == 2 for r in rows)


def test_a_sweep_with_a_bad_point_launches_nothing(write_recipe, tmp_path, fake_backend):
    result = invoke("sweep", write_recipe(), "--set", "batch.micro=1,3", "--backends", "fake", "--out",
                    tmp_path / "out", *python_args(fake_backend))
    assert result.exit_code == 2 and "not divisible by micro (3)" in result.output
    assert not (tmp_path / "out").exists()


def test_keys_every_point_shares_are_recorded_but_not_shown_as_a_difference(write_recipe, tmp_path, fake_backend):
    recipe = write_recipe(backends={"fake": {"ips": 120}})
    out = tmp_path / "sweep"
    result = invoke("sweep", recipe, "--set", "batch.micro=1,2", "--set", "measure.steps=2", "--backends", "fake",
                    "--out", out, *python_args(fake_backend))
    assert "| Tiny LLaVA | SFT | batch.micro=1 | 120 (one run, no spread) |" in result.output
    assert {tuple(sorted(r.variant)) for r in load_runs([out])} == {("batch.micro", "measure.steps")}


def test_sweep_repeat_runs_every_point_k_times_without_making_it_a_variant(write_recipe, tmp_path, fake_backend):
    out = tmp_path / "sweep"
    result = invoke("sweep", write_recipe(backends={"fake": {"ips": 120}}), "--set", "batch.micro=1,2", "--repeat",
                    "2", "--backends", "fake", "--out", out, *python_args(fake_backend))
    assert result.exit_code == 0
    runs = load_runs([out])
    assert len(runs) == 4 and all(set(r.variant) == {"batch.micro"} for r in runs)


def test_a_long_point_gets_a_short_unique_directory_name():
    long_a = {"lora.targets": [f"module_{i}" for i in range(40)]}
    long_b = {"lora.targets": [f"module_{i}" for i in range(41)]}
    a, b = sweep.point_label(long_a), sweep.point_label(long_b)
    assert len(a) <= sweep.MAX_LABEL_CHARS and a != b and a.startswith("lora.targets-module_0_module_1")
