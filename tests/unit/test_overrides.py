"""Per-backend overrides (``backends.<name>.override``, xfw.recipe.overrides): one deliberate difference
between the sides, validated like the key itself, run by that side alone, recorded in its spec.json and
shown in every report. The runs here use the fake adapters (tests/fakes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from xfw import cli
from xfw.report import contrast
from xfw.report.compare import compare_runs
from xfw.report.nodes import load_runs
from xfw.report.table import to_csv, to_html
from xfw.run.launch import jobs
from xfw.recipe.overrides import backend_overrides, backend_recipe, describe
from xfw.run.commands.parity import recipe_fingerprint
from xfw.recipe import RecipeError, load_recipe, recipe_from_dict
from xfw.recipe.spec import resolve_spec

from conftest import ROOT, TINY_RECIPE

LR = "backends.paddle.override.optimizer.lr"
LINE = "Deliberate difference (backends.fake.override): optimizer.lr = 0.0001 on fake, 0.001 on fake2"


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


def fakes(fake_backend):
    return ["--python", f"fake={fake_backend['fake']}", "--python", f"fake2={fake_backend['fake2']}"]


def error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


# --- parsing: one canonical form ------------------------------------------------------------------

@pytest.mark.parametrize("override", [{"optimizer": {"lr": 1.0e-4}}, {"optimizer.lr": 1.0e-4}])
def test_nested_and_dotted_overrides_in_a_recipe_are_one_canonical_form(override):
    recipe = recipe_from_dict({**TINY_RECIPE, "backends": {"paddle": {"override": override}, "torch": {}}})
    assert recipe.backends["paddle"]["override"] == {"optimizer.lr": 1.0e-4}
    assert backend_overrides(recipe) == {"paddle": {"optimizer.lr": 1.0e-4}}


def test_a_set_override_replaces_the_files_and_an_empty_one_is_none(write_recipe):
    path = write_recipe(backends={"paddle": {"override": {"optimizer.lr": 1.0e-4, "measure": {"steps": 2}}}})
    recipe = load_recipe(path, [f"{LR}=2.0e-4", "backends.torch.override.precision={dtype: bf16, amp_level: O1}"])
    assert backend_overrides(recipe) == {"paddle": {"measure.steps": 2, "optimizer.lr": 2.0e-4},
                                         "torch": {"precision.amp_level": "O1", "precision.dtype": "bf16"}}
    assert backend_overrides(load_recipe(path, ["backends.paddle.override={}"])) == {}
    assert backend_overrides(load_recipe(write_recipe())) == {}


# --- validation: like the key itself, one line naming the override's key ------------------------

@pytest.mark.parametrize("assignment, expected", [
    (f"{LR}=-1.0", "backends.paddle.override.optimizer.lr: -1.0 is outside [1e-12, 10]"),
    ("backends.paddle.override.optimizer.lrr=1.0", "backends.paddle.override.optimizer.lrr: unknown key (expected one of"),
    ("backends.paddle.override.nope=1", "backends.paddle.override.nope: unknown key"),
    ("backends.paddle.override.name=other", "backends.paddle.override.name: cannot differ between backends"),
    ("backends.paddle.override.comparison=published", "backends.paddle.override.comparison: cannot differ"),
    ("backends.paddle.override.published=x", "backends.paddle.override.published: cannot differ"),
    ("backends.paddle.override.backends.torch.x=1", "backends.paddle.override.backends.torch.x: cannot differ"),
    ("backends.paddle.override.batch.micro=3",
     "backends.paddle.override.batch.micro: with this override, batch.global: 4 is not divisible by micro (3)"),
    ("backends.paddle.override.precision.dtype=bf16",
     "backends.paddle.override.precision.dtype: with this override, precision.amp_level: dtype bf16 needs amp_level"),
    ("backends.paddle.override.optimizer.betas.5=0.5", "backends.paddle.override.optimizer.betas.5: optimizer.betas is "
                                                       "a list of 2 items"),
    ("backends.paddle.override.model.weights=/no/such/dir",
     "backends.paddle.override.model.weights: /no/such/dir is not a directory"),
    ("backends.paddle.override=3", "backends.paddle.override: must be a mapping"),
])
def test_a_bad_override_is_refused_naming_its_key(write_recipe, assignment, expected):
    path = write_recipe()
    with pytest.raises(RecipeError) as err:
        load_recipe(path, [assignment])
    assert str(err.value).startswith(f"{path}: {expected}") and "\n" not in str(err.value)


def test_a_key_given_twice_and_a_command_backend_are_refused():
    with pytest.raises(RecipeError, match=r"x.yaml: backends.paddle.override.optimizer.lr: given twice"):
        recipe_from_dict({**TINY_RECIPE, "backends": {"paddle": {"override": {"optimizer.lr": 1.0e-4,
                                                                              "optimizer": {"lr": 2.0e-4}}}}}, "x.yaml")
    with pytest.raises(RecipeError, match=r"backends.mine.override: backends.mine runs a command"):
        recipe_from_dict({**TINY_RECIPE, "backends": {"mine": {"command": ["python3"],
                                                               "override": {"optimizer.lr": 1.0e-4}}}})


def test_the_cli_refuses_a_bad_override_in_one_line_launching_nothing(write_recipe, tmp_path, fake_backend):
    out = tmp_path / "out"
    line = error_line(invoke("compare", write_recipe(), "--backends", "fake,fake2", "--out", out,
                             "--set", "backends.fake.override.optimizer.lr=-1.0", *fakes(fake_backend)))
    assert "backends.fake.override.optimizer.lr: -1.0 is outside" in line
    assert not list(out.rglob("spec.json"))
    assert "backends.fake.override.name: cannot differ" in error_line(
        invoke("validate", write_recipe(), "--set", "backends.fake.override.name=x"))


# --- each backend's effective recipe and its spec ------------------------------------------------

def test_each_backend_runs_its_own_effective_recipe_and_its_spec_records_the_override(write_recipe):
    recipe = load_recipe(write_recipe(backends={"torch": {"fused_optimizer": True}}),
                         [f"{LR}=1.0e-4", "backends.paddle.override.measure.steps=2"])
    paddle, torch = backend_recipe(recipe, "paddle"), backend_recipe(recipe, "torch")
    assert (paddle.optimizer.lr, paddle.measure.steps, torch.optimizer.lr, torch.measure.steps) == (1.0e-4, 2, 1.0e-3, 4)
    assert backend_recipe(paddle, "paddle") == paddle  # applying it again changes nothing
    assert "paddle" not in torch.backends  # another side's override is not part of this side's run
    spec = resolve_spec(recipe, backend="paddle", run_id="r")
    assert spec["overrides"] == {"measure.steps": 2, "optimizer.lr": 1.0e-4}
    assert spec["overridden"] == {"measure.steps": 4, "optimizer.lr": 1.0e-3}
    assert (spec["optimizer"]["lr"], spec["measure"]["steps"], spec["backend_knobs"]) == (1.0e-4, 2, {})
    assert "override" not in json.dumps(spec["backends"])  # never a knob, anywhere in the spec
    torch_spec = resolve_spec(recipe, backend="torch", run_id="r")
    assert "overrides" not in torch_spec and torch_spec["optimizer"]["lr"] == 1.0e-3
    assert torch_spec["backend_knobs"] == {"fused_optimizer": True}
    # Without any override the spec is what it always was: no new keys, the same fingerprint.
    plain = load_recipe(write_recipe())
    assert "overrides" not in resolve_spec(plain, backend="paddle", run_id="r")
    assert torch_spec == resolve_spec(load_recipe(write_recipe(backends={"torch": {"fused_optimizer": True}})),
                                      backend="torch", run_id="r")  # the other side's run is the plain recipe's


def test_an_override_of_the_real_data_prepares_that_sides_own_data():
    recipe = load_recipe(ROOT / "recipes/tiny/llava_json_sft.yaml", ["backends.paddle.override.data.max_samples=8"])
    paddle, torch = (resolve_spec(recipe, backend=b, run_id="r")["data"] for b in ("paddle", "torch"))
    assert paddle["num_samples"] == 8 and torch["num_samples"] > 8 and paddle["prepared"] != torch["prepared"]


def test_repeats_and_runs_follow_each_backends_recipe(write_recipe, tmp_path):
    recipe = load_recipe(write_recipe(), ["backends.paddle.override.measure.repeat=2"])
    todo = jobs.jobs_for(recipe, ["paddle", "torch"], tmp_path, ("r",))
    assert [job.run_dir.name for job in todo] == ["paddle-r0", "torch", "paddle-r1"]


def test_validate_prints_the_deliberate_difference(write_recipe):
    result = invoke("validate", write_recipe(), "--set", f"{LR}=1.0e-4")
    assert result.exit_code == 0, result.output
    assert ("Deliberate difference (backends.paddle.override): optimizer.lr = 0.0001 on paddle, 0.001 on the other "
            "backends") in result.output
    assert describe(load_recipe(write_recipe())) == []


def test_an_override_is_part_of_the_parity_fingerprint(write_recipe):
    path = write_recipe()
    plain = recipe_fingerprint(load_recipe(path))
    assert recipe_fingerprint(load_recipe(path, [f"{LR}=1.0e-4"])) != plain
    assert recipe_fingerprint(load_recipe(path, ["measure.steps=9"])) == plain  # as before: measure is not the model


# --- runs and reports ---------------------------------------------------------------------------

def test_a_compare_with_an_override_shows_it_in_every_report_and_again_from_the_run_directories(
        write_recipe, tmp_path, fake_backend):
    out = tmp_path / "out"
    result = invoke("compare", write_recipe(), "--backends", "fake,fake2", "--out", out,
                    "--set", "backends.fake.override.optimizer.lr=1.0e-4", *fakes(fake_backend))
    assert result.exit_code == 0, result.output
    fake = json.loads((out / "tiny-test" / "fake" / "spec.json").read_text())
    assert fake["overrides"] == {"optimizer.lr": 1.0e-4} and fake["optimizer"]["lr"] == 1.0e-4
    assert "override" not in fake["backend_knobs"]
    assert "overrides" not in json.loads((out / "tiny-test" / "fake2" / "spec.json").read_text())
    for name in ("report.md", "report.html"):
        assert LINE in (out / name).read_text(), name
    assert "deliberate difference" in (out / "report.md").read_text().split("|")[0]  # said before the table
    csv = (out / "report.csv").read_text()
    assert "deliberate_differences" in csv.splitlines()[0] and LINE in csv
    assert "| override.optimizer.lr | 0.0001 | 0.001 | deliberate (backends.fake.override) |" in \
        (out / "report.md").read_text()
    (out / "report.md").unlink()
    assert invoke("report", out).exit_code == 0 and LINE in (out / "report.md").read_text()


def test_a_precision_override_keeps_the_sides_paired_when_read_back(write_recipe, tmp_path, fake_backend):
    out = tmp_path / "out"
    result = invoke("compare", write_recipe(), "--backends", "fake,fake2", "--out", out,
                    "--set", "backends.fake2.override.precision={dtype: bf16, amp_level: O1}", *fakes(fake_backend))
    assert result.exit_code == 0, result.output
    (row,) = compare_runs(load_runs([out]), ["fake", "fake2"])  # one row: the same configuration, deliberately apart
    assert row.variant == {} and row.contrast is not None
    assert row.deliberate == [
        "Deliberate difference (backends.fake2.override): precision.amp_level = O0 on fake, O1 on fake2",
        "Deliberate difference (backends.fake2.override): precision.dtype = fp32 on fake, bf16 on fake2"]


def test_runs_of_other_overrides_read_together_are_not_taken_for_repeats(write_recipe, tmp_path, fake_backend):
    recipe = write_recipe()
    for name, lr in (("a", "1.0e-3"), ("b", "1.0e-4")):
        assert invoke("compare", recipe, "--backends", "fake", "--out", tmp_path / name,
                      "--set", f"backends.fake.override.optimizer.lr={lr}", *fakes(fake_backend)[:2]).exit_code == 0
    rows = compare_runs(load_runs([tmp_path / "a", tmp_path / "b"]), ["fake"])
    assert sorted(json.dumps(r.variant) for r in rows) == [
        '{"backends.fake.override.optimizer.lr": 0.0001}', '{"backends.fake.override.optimizer.lr": 0.001}']


def test_a_sweep_over_an_override_runs_each_point_and_reports_each(write_recipe, tmp_path, fake_backend):
    out = tmp_path / "sweep"
    result = invoke("sweep", write_recipe(), "--backends", "fake,fake2", "--out", out,
                    "--set", "backends.fake.override.optimizer.lr=1.0e-3,1.0e-4", *fakes(fake_backend))
    assert result.exit_code == 0, result.output
    lrs = sorted(json.loads(p.read_text())["optimizer"]["lr"] for p in out.rglob("fake/spec.json"))
    assert lrs == [1.0e-4, 1.0e-3]
    report = (out / "report.md").read_text()
    assert LINE in report and "optimizer.lr = 0.001 on fake, 0.001 on fake2" in report
    html = to_html(contrast.contrast_page(compare_runs(load_runs([out]), ["fake", "fake2"]), ["fake", "fake2"]))
    assert 'id=deliberate' in html and LINE in html
    assert "deliberate_differences" in to_csv(contrast.contrast_page(compare_runs(load_runs([out]), ["fake", "fake2"]),
                                                                     ["fake", "fake2"]))


def test_a_recipe_file_override_reaches_the_run(tmp_path, fake_backend):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**TINY_RECIPE, "backends": {"fake": {"override": {"optimizer": {"lr": 1.0e-4}}}}}))
    out = tmp_path / "out"
    assert invoke("run", path, "--backend", "fake", "--out", out, *fakes(fake_backend)[:2]).exit_code == 0
    spec = json.loads((out / "tiny-test" / "fake" / "spec.json").read_text())
    assert spec["overrides"] == {"optimizer.lr": 1.0e-4} and Path(out / "report.md").exists()
