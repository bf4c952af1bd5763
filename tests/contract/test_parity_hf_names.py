"""A Hugging Face checkpoint directory saved by older transformers (LLaVA's ``language_model.model.*``,
``vision_tower.*``...; Qwen2-VL's ``model.layers.*``, ``visual.*``) loads on both sides.

The checkpoint is a tiny model's own start, renamed to the old layout by the table below (written
out here, independently of ``xfw.contract.hf_names``) and saved as an HF-style directory with numpy alone:
``config.json`` + ``model.safetensors``, or bf16 shards + ``model.safetensors.index.json``. Each is
made once per module (``old_checkpoints``): both are read by Paddle in one adapter process, and the
parity run starts from the LLaVA one.
"""

import json

import numpy as np
import pytest

from conftest import ROOT, require_interpreter
from test_parity import torch_exports_in_this_process
from test_parity_roundtrip import assert_bit_identical, export_paddle_all, export_torch
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


CASES = {"llava": ("llava_next_sft", False), "qwen2vl": ("qwen2vl_sft", True)}  # family -> (recipe, bf16 shards)


@pytest.fixture(scope="module")
def old_checkpoints(tmp_path_factory):
    """family -> (its HF directory, what a loader should read back, torch's export from it, Paddle's): the
    tiny model's start saved in the old layout; both Paddle exports in one adapter process."""
    made = {}
    for family, (recipe, bf16) in CASES.items():
        directory = tmp_path_factory.mktemp(family)
        original = export_torch(recipe, None, directory / "start")
        expected = write_old_checkpoint(original, family, directory / "hf", bf16_shards=bf16)
        made[family] = (directory, expected, export_torch(recipe, directory / "hf", directory / "torch"))
    through_paddle = export_paddle_all([(CASES[f][0], d / "hf", d / "paddle") for f, (d, _, _) in made.items()])
    return {f: (d / "hf", expected, torch, paddle)
            for (f, (d, expected, torch)), paddle in zip(made.items(), through_paddle)}


@pytest.mark.parametrize("family", CASES)
def test_an_old_layout_checkpoint_loads_on_both_sides_under_the_current_names(old_checkpoints, family):
    _, expected, torch, paddle = old_checkpoints[family]
    assert_bit_identical(torch, expected)
    assert_bit_identical(paddle, expected)


def test_parity_from_an_old_layout_checkpoint_passes_at_step_0(old_checkpoints, tmp_path):
    require_interpreter("paddle")
    recipe = ROOT / "recipes" / "tiny" / "llava_next_sft.yaml"
    hf = old_checkpoints["llava"][0]  # the tiny LLaVA-1.6 start in the old layout, one model.safetensors
    with torch_exports_in_this_process():  # the start converted to the neutral file by torch's export, here
        report = parity.run_parity(str(recipe), [f"model.weights={hf}"], 2, tmp_path / "parity", {},
                                   backends=("torch", "paddle"))
    assert report.passed and report.steps[0].rel_diff <= 1e-5, report.markdown()
