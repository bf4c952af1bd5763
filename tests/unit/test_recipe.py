"""The recipe schema: defaults, derived values, overrides, and one-line errors naming file and key."""

import pytest
import yaml

from xfw.recipe import RecipeError, load_recipe, recipe_from_dict
from xfw.recipe.spec import resolve_spec

from conftest import ROOT, TINY_RECIPE


def error_of(write_recipe, overrides=(), **sections) -> str:
    path = write_recipe(**sections)
    with pytest.raises(RecipeError) as info:
        load_recipe(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path) + ": ")
    return message


def test_tiny_recipe_loads_with_defaults_and_derived_accumulation(write_recipe):
    recipe = load_recipe(write_recipe())
    assert recipe.precision.dtype == "fp32" and recipe.precision.amp_level == "O0"
    assert recipe.parallel.nproc_per_node == 1 and recipe.parallel.sharding == "none"
    assert recipe.grad_accum_steps == 2
    assert recipe.measure.repeat == 1


def test_every_recipe_file_in_the_repository_validates():
    paths = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "published" not in p.parts)
    assert paths, "no recipes found"
    for path in paths:
        load_recipe(path)
        if load_recipe(path).published is not None:  # and as its seed row's published comparison
            load_recipe(path, ["comparison=published"])


def test_unknown_key_is_named_with_its_dotted_path(write_recipe):
    message = error_of(write_recipe, batch={"global": 4, "micro": 2, "mirco": 1})
    assert "batch.mirco: unknown key" in message


def test_missing_required_key_is_named(write_recipe):
    assert "batch.micro: is required" in error_of(write_recipe, batch={"global": 4})


def test_wrong_type_is_named_with_the_value(write_recipe):
    message = error_of(write_recipe, measure={"steps": "many"})
    assert "measure.steps: must be an integer, got 'many'" in message


def test_batch_that_does_not_split_into_micro_batches_is_rejected(write_recipe):
    message = error_of(write_recipe, batch={"global": 6, "micro": 4})
    assert "batch.global: 6 is not divisible by micro (4) x processes (1)" in message


def test_global_batch_must_also_divide_over_processes(write_recipe):
    message = error_of(write_recipe, batch={"global": 4, "micro": 2}, parallel={"nproc_per_node": 4})
    assert "batch.global" in message and "processes (4)" in message


def test_lora_section_on_a_non_lora_stage_is_rejected(write_recipe):
    message = error_of(write_recipe, lora={"r": 8, "alpha": 16, "targets": ["q_proj"]})
    assert "lora: a lora section only applies to stage 'lora', not 'sft'" in message


def test_lora_stage_without_lora_section_is_rejected(write_recipe):
    assert "lora: stage 'lora' needs a lora section" in error_of(write_recipe, stage="lora")


def test_stage_the_family_does_not_have_is_rejected(write_recipe):
    assert "stage: llava models support pretrain, sft, lora, not 'dreambooth'" in error_of(
        write_recipe, stage="dreambooth")


def test_amp_level_must_match_dtype(write_recipe):
    assert "precision.amp_level: O2 needs dtype bf16 or fp16" in error_of(
        write_recipe, precision={"dtype": "fp32", "amp_level": "O2"})
    assert "precision.amp_level: dtype bf16 needs amp_level O1 or O2" in error_of(
        write_recipe, precision={"dtype": "bf16"})


def test_unknown_preset_lists_the_known_ones(write_recipe):
    message = error_of(write_recipe, model={"preset": "llava-99b"})
    assert "model.preset: unknown preset 'llava-99b'" in message and "tiny-llava" in message


def test_architecture_override_of_unknown_field_is_named(write_recipe):
    message = error_of(write_recipe, model={"preset": "tiny-llava", "arch": {"text": {"hiden_size": 8}}})
    assert "model.arch.text.hiden_size: unknown architecture field" in message


def test_sequence_too_short_for_the_image_tokens_is_rejected(write_recipe):
    message = error_of(write_recipe, data={"seq_len": 10})
    assert "data.seq_len: 10 leaves no room for text after 16 image tokens" in message


def test_override_sets_nested_values_parsed_as_yaml(write_recipe):
    recipe = load_recipe(write_recipe(), ["batch.micro=1", "precision.dtype=bf16", "precision.amp_level=O1",
                                          "model.arch={text: {num_layers: 3}}", "recompute=true"])
    assert recipe.batch.micro == 1 and recipe.grad_accum_steps == 4
    assert recipe.precision.dtype == "bf16" and recipe.recompute is True
    assert recipe.model.arch == {"text": {"num_layers": 3}}


def test_override_with_unknown_key_is_an_error_naming_it(write_recipe):
    assert "batch.size: unknown key" in error_of(write_recipe, overrides=["batch.size=3"])


def test_override_without_equals_sign_is_an_error(write_recipe):
    assert "--set 'batch.micro': expected key.path=value" in error_of(write_recipe, overrides=["batch.micro"])


def test_invalid_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nmodel: {preset: tiny-llava\nstage: sft\n")
    with pytest.raises(RecipeError, match=r"bad.yaml: line \d+: invalid YAML"):
        load_recipe(path)


def test_missing_file_is_a_one_line_error(tmp_path):
    with pytest.raises(RecipeError, match="cannot read recipe"):
        load_recipe(tmp_path / "nope.yaml")


def test_yaml_is_loaded_safely_so_python_tags_are_rejected(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("name: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(RecipeError, match="invalid YAML"):
        load_recipe(path)


def test_resolved_spec_fills_every_default_and_expands_the_preset():
    recipe = recipe_from_dict(dict(TINY_RECIPE))
    spec = resolve_spec(recipe, backend="torch", run_id="r")
    assert spec["model"]["family"] == "llava"
    assert spec["model"]["arch"]["text"]["hidden_size"] == 64
    assert spec["data"]["image_size"] == 56 and spec["data"]["seq_len"] == 64
    assert spec["derived"] == {"num_processes": 1, "grad_accum_steps": 2}
    assert spec["batch"] == {"global": 4, "micro": 2}
    assert spec["backend"] == "torch" and spec["backend_knobs"] == {}
    assert yaml.safe_load(yaml.safe_dump(spec)) == spec  # plain data only


def test_backend_knobs_are_passed_only_to_their_backend():
    recipe = recipe_from_dict({**TINY_RECIPE, "backends": {"torch": {"fused_optimizer": True}, "paddle": {}}})
    assert resolve_spec(recipe, backend="torch", run_id="r")["backend_knobs"] == {"fused_optimizer": True}
    assert resolve_spec(recipe, backend="paddle", run_id="r")["backend_knobs"] == {}


def test_lora_target_that_is_not_a_decoder_linear_is_rejected_before_launch(write_recipe):
    message = error_of(write_recipe, stage="lora", lora={"r": 4, "alpha": 8, "targets": ["q_proj", "embed_tokens"]})
    assert "lora.targets: 'embed_tokens' is not a module LoRA can target in llava models" in message
