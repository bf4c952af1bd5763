"""A Hugging Face checkpoint directory saved by older transformers (LLaVA's ``language_model.model.*``,
``vision_tower.*``...; Qwen2-VL's ``model.layers.*``, ``visual.*``) loads on both sides.

The checkpoint is a tiny model's own start, renamed to the old layout by the table below (written
out here, independently of ``xfw.contract.hf_names``) and saved as an HF-style directory with numpy alone:
``config.json`` + ``model.safetensors``, or bf16 shards + ``model.safetensors.index.json``.
"""

import json

import numpy as np
import pytest

from conftest import ROOT, require_interpreter
from test_parity_roundtrip import assert_bit_identical, export_paddle, export_torch
from xfw.run.commands import parity
from xfw.contract import weights

pytestmark = pytest.mark.contract

# current prefix -> the prefix transformers < 4.52 saved (its _checkpoint_conversion_mapping, reversed)
OLD_LAYOUT = {
    "llava": [("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
              ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."),
              ("model.image_newline", "image_newline")],
    "qwen2vl": [("model.language_model.", "model."), ("model.visual.", "visual.")],
}


def old_name(family: str, name: str) -> str:
    for new, old in OLD_LAYOUT[family]:
        if name.startswith(new):
            return old + name[len(new):]
    return name


def to_bf16_bits(array: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, truncating (exactly representable values stay exact)."""
    return (np.ascontiguousarray(array, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def write_old_checkpoint(state: dict, family: str, directory, *, bf16_shards: bool) -> dict:
    """Save ``state`` under the old names as an HF directory; returns what a loader should read back."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["old layout"], "torch_dtype": "float32"}))
    old = {old_name(family, n): v for n, v in state.items()}
    assert set(old) != set(state)
    if not bf16_shards:
        weights.save_file(old, directory / weights.WEIGHTS_FILE)
        return state
    names = sorted(old)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        weights.save_file({n: to_bf16_bits(old[n]) for n in part}, directory / file, bf16=set(part))
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (directory / weights.INDEX_FILE).write_text(json.dumps(index))
    return {n: weights.bf16_to_float32(to_bf16_bits(v)) for n, v in state.items()}


@pytest.mark.parametrize("recipe,family,bf16", [("llava_next_sft", "llava", False), ("qwen2vl_sft", "qwen2vl", True)])
def test_an_old_layout_checkpoint_loads_on_both_sides_under_the_current_names(tmp_path, recipe, family, bf16):
    original = export_torch(recipe, None, tmp_path / "start")
    expected = write_old_checkpoint(original, family, tmp_path / "hf", bf16_shards=bf16)
    assert_bit_identical(export_torch(recipe, tmp_path / "hf", tmp_path / "torch"), expected)
    assert_bit_identical(export_paddle(recipe, tmp_path / "hf", tmp_path / "paddle"), expected)


def test_parity_from_an_old_layout_checkpoint_passes_at_step_0(tmp_path):
    require_interpreter("paddle")
    recipe = ROOT / "recipes" / "tiny" / "llava_next_sft.yaml"
    write_old_checkpoint(export_torch("llava_next_sft", None, tmp_path / "start"), "llava", tmp_path / "hf",
                         bf16_shards=False)
    report = parity.run_parity(str(recipe), [f"model.weights={tmp_path / 'hf'}"], 2, tmp_path / "parity", {},
                               backends=("torch", "paddle"))
    assert report.passed and report.steps[0].rel_diff <= 1e-5, report.markdown()
