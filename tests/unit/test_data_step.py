"""Data preparation is a step of its own (issue 44): loading a recipe checks its data and writes nothing;
``xfw.run.data.prepare_data`` is the one writer of the cache, which every workflow calls before it launches;
``xfw validate`` says whether the data is prepared and ``--prepare`` prepares it; bad data found only while
preparing is still refused before anything launches."""

import json

import pytest
import yaml
from click.testing import CliRunner

from xfw import cli
from xfw.contract import presets
from xfw.recipe import RecipeError, load_recipe
from xfw.run import data as real

from conftest import TINY_RECIPE
from realdata import llava_json_recipe, make_llava_data


def _files(root):
    return sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*") if p.is_file())


@pytest.fixture
def recipe_path(tmp_path):
    data = make_llava_data(tmp_path / "d")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**TINY_RECIPE, **llava_json_recipe(data, tmp_path / "cache")}))
    return path


def _arch(recipe):
    return presets.resolve_arch(recipe.model.preset, recipe.model.arch, recipe.data.image_size, recipe.data.seq_len)


def test_loading_a_recipe_writes_nothing_and_prepare_data_is_the_step_that_does(tmp_path, recipe_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = _files(tmp_path)
    recipe = load_recipe(recipe_path, ["data.eval_samples=1"])
    assert _files(tmp_path) == before and not (tmp_path / "cache").exists()
    assert real.find_prepared(recipe, _arch(recipe))[0] is None
    lines = []
    prepared = real.prepare_data(recipe, log=lines.append)
    assert (tmp_path / "cache").is_dir() and prepared["stats"]["num_samples"] == 4
    assert len(lines) == 1 and lines[0].startswith(f"data: 4 samples of {tmp_path / 'd' / 'data.json'} prepared in ")
    real._PREPARED.clear()  # a later command (another process): found on disk, not prepared again
    assert real.find_prepared(recipe, _arch(recipe))[0]["directory"] == prepared["directory"]
    again = []
    assert real.prepare_data(recipe, log=again.append)["directory"] == prepared["directory"] and again == []


def test_an_impossible_split_is_refused_when_the_recipe_loads(recipe_path):
    with pytest.raises(RecipeError, match=r"data.eval_samples: 4 held out of a data set of 4 samples leaves none"):
        load_recipe(recipe_path, ["data.eval_samples=4"])


def test_validate_says_whether_the_data_is_prepared_and_prepare_prepares_it(tmp_path, recipe_path):
    result = CliRunner().invoke(cli.main, ["validate", str(recipe_path)])
    assert result.exit_code == 0, result.output
    assert f"data: not prepared (checked; xfw validate --prepare writes it to {tmp_path / 'cache'}" in result.output
    assert not (tmp_path / "cache").exists()
    result = CliRunner().invoke(cli.main, ["validate", "--prepare", str(recipe_path)])
    assert result.exit_code == 0, result.output
    assert f"data: 4 samples, 3 images" in result.output and f"prepared in {tmp_path / 'cache'}" in result.output


def test_data_that_fails_only_while_preparing_is_refused_before_anything_launches(tmp_path, recipe_path):
    records = json.loads((tmp_path / "d" / "data.json").read_text())
    broken = tmp_path / "d" / records[0]["image"]
    broken.write_bytes(b"not a picture at all")  # exists (the check passes), cannot be decoded (preparing fails)
    load_recipe(recipe_path)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli.main, ["run", str(recipe_path), "--backend", "torch", "--out", str(out)])
    assert result.exit_code == 2, result.output
    problem = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(problem) == 1 and "sample #0 (id 's0')" in problem[0] and str(recipe_path) in problem[0]
    assert not out.exists() or not any(out.rglob("spec.json"))
