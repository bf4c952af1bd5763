"""Each family's facts (parts, what a stage trains, LoRA) and the harness's --count-params side task,
without a framework. tests/contract/test_full_size_counts.py holds both adapters to the same facts."""

import json

import pytest

from xfw.contract import families, harness, presets


def arch(name: str) -> dict:
    return presets.resolve_arch(name, {}, None, None)


ALL_PRESETS = sorted(presets.PRESETS)


def test_anyres_llava_trains_its_image_newline_in_every_stage():
    a = arch("tiny-llava-next")
    for stage in presets.FAMILY_STAGES["llava"]:
        assert families.trains(a, families.trainable_parts(a, stage), "model.image_newline"), stage
    assert not families.trains(a, families.trainable_parts(a, "pretrain"), "model.language_model.norm.weight")
    assert families.trains(a, (), "model.language_model.layers.0.self_attn.q_proj.lora_A.weight")  # adapters always


def test_a_parameter_in_no_part_is_an_error_naming_it():
    with pytest.raises(KeyError, match="model.something_new.weight"):
        families.part_of(arch("tiny-qwen2-vl"), "model.something_new.weight")


def test_the_stages_a_recipe_may_name_are_the_stages_the_family_says_what_they_train():
    for name in families.FAMILIES:
        assert presets.FAMILY_STAGES[name] == tuple(families.family_module(name).STAGE_PARTS)


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_parts_count_what_their_prefixes_hold_and_stages_name_only_parts(preset):
    a = arch(preset)
    facts = families.family_module(a["family"])
    counts = presets.count_params(a)
    assert set(counts) == {*facts.PARTS, "total"} and sum(counts.values()) == 2 * counts["total"]
    for stage, parts in facts.STAGE_PARTS.items():
        assert set(parts) <= set(facts.PARTS), stage
    assert families.part_of(a, facts.LORA_MODULE + ".x")  # adapters go inside a part
    assert set(facts.lora_linears(a)) == set(facts.LORA_TARGETS)


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_a_tally_of_the_parts_analytic_sizes_is_the_analytic_count(preset):
    a = arch(preset)
    facts = families.family_module(a["family"])
    lora = {"r": 4, "targets": list(facts.LORA_TARGETS)}
    for stage in facts.STAGE_PARTS:
        trained = families.trainable_parts(a, stage)
        # One parameter per part, named by its first prefix, as big as the part.
        params = [(prefixes[0] + "w", presets.count_params(a)[part], part in trained)
                  for part, prefixes in facts.PARTS.items()]
        params += [("x.lora_A.weight", families.count_lora_params(a, lora), True)] if stage == "lora" else []
        expected = families.analytic_counts(a, stage, lora if stage == "lora" else None)
        assert families.tally(a, [p for p in params if p[1]]) == expected, stage


def test_lora_counts_r_times_in_plus_out_per_targeted_linear():
    sd15 = arch("sd-1.5")
    # peft's count for SD1.5's UNet at rank 4 on to_q/to_k/to_v/to_out.0 (diffusers' LoRA example;
    # the H100 run reported it too: results/h100/sd15-lora/micro96/torch).
    assert families.count_lora_params(sd15, {"r": 4, "targets": ["to_q", "to_k", "to_v", "to_out.0"]}) == 797_184
    t = arch("tiny-sd3")["transformer"]
    d = t["num_heads"] * t["head_dim"]
    # to_add_out: every joint block but the last, whose text stream is only read.
    assert families.count_lora_params(arch("tiny-sd3"), {"r": 2, "targets": ["to_add_out"]}) == 2 * 2 * d * (
        t["num_layers"] - 1)
    llava = arch("tiny-llava")
    h, layers = llava["text"]["hidden_size"], llava["text"]["num_layers"]
    assert families.count_lora_params(llava, {"r": 8, "targets": ["q_proj"]}) == 8 * 2 * h * layers


def test_count_params_side_task_counts_every_spec_in_one_process_and_records_failures(tmp_path):
    specs = []
    for i, family in enumerate(("llava", "sd3", "oops")):
        path = tmp_path / f"spec{i}.json"
        path.write_text(json.dumps({"family": family}))
        specs += ["--spec", str(path)]

    def count(spec):
        if spec["family"] == "oops":
            raise harness.Unsupported("no such family here")
        return {"total": 3, "trainable": 1, "parts": {"a": 3}, "trainable_parts": {"a": 1}}

    def refuse(_spec):
        raise AssertionError("no session is built for a count")

    out = tmp_path / "counts.json"
    assert harness.main(refuse, dict, ["--count-params", str(out), *specs], count_params=count) == harness.EXIT_UNSUPPORTED
    counts = json.loads(out.read_text())["counts"]
    assert [c["spec"] for c in counts] == specs[1::2]
    assert counts[0] == {"spec": specs[1], "total": 3, "trainable": 1, "parts": {"a": 3}, "trainable_parts": {"a": 1}}
    assert counts[2] == {"spec": specs[5], "status": "unsupported", "message": "no such family here"}
    assert harness.main(refuse, dict, ["--count-params", str(out), *specs]) == harness.EXIT_UNSUPPORTED  # no hook
    with pytest.raises(SystemExit):  # several specs are for --count-params only
        harness.main(refuse, dict, ["--export-weights", str(tmp_path), *specs], export_weights=lambda s, d: None)
