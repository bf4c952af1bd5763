"""Neutral presets: the published configs resolve, and the analytic parameter count is right."""

import pytest

from xfw.contract import presets


def test_every_published_preset_is_present():
    for name in ("llava-1.6-vicuna-7b", "llava-1.6-vicuna-13b", "qwen2-vl-2b", "qwen2-vl-7b", "sd-1.5",
                 "sd-3-medium", "tiny-llava"):
        assert name in presets.PRESETS
        assert presets.PRESETS[name]["family"] in presets.FAMILY_STAGES


def test_tiny_llava_parameter_count_matches_a_hand_count():
    # vision: conv 32*3*14*14 + cls 32 + pos 17*32 + 2 LNs 128 + 2 layers * (4*(32*32+32) + 128 + 64*32+64 + 32*64+32)
    vision = 18816 + 32 + 544 + 128 + 2 * (4224 + 128 + 2112 + 2080)
    projector = 32 * 64 + 64 + 64 * 64 + 64
    text = 512 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64 + 512 * 64
    counts = presets.count_params(presets.resolve_arch("tiny-llava", {}, None, None))
    assert counts == {"vision": vision, "projector": projector, "newline": 0, "text": text,
                      "total": vision + projector + text}  # no AnyRes, so no image newline


def test_llava_7b_parameter_count_is_about_seven_billion():
    total = presets.count_params(presets.resolve_arch("llava-1.6-vicuna-7b", {}, None, None))["total"]
    # Published llava-v1.6-vicuna-7b: 7.06 B parameters.
    assert 7.0e9 < total < 7.1e9


def test_grouped_query_attention_shrinks_key_and_value_projections():
    full = presets.count_params(presets.resolve_arch("tiny-llava", {}, None, None))["text"]
    gqa = presets.count_params(presets.resolve_arch("tiny-llava", {"text": {"num_kv_heads": 2}}, None, None))["text"]
    assert full - gqa == 2 * 2 * 64 * 32  # layers x (k, v) x hidden x halved kv width


def test_image_size_must_match_the_vision_tower():
    with pytest.raises(presets.ArchError) as info:
        presets.resolve_arch("tiny-llava", {}, 112, None)
    assert info.value.key == "data.image_size"


def test_display_names_follow_seed_003():
    assert presets.display_name("llava-1.6-vicuna-7b") == "LLaVA1.6 7B"
    assert presets.display_name("unknown-thing") == "unknown-thing"
