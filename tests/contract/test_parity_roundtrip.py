"""The neutral weight file survives torch → file → Paddle → file → torch bit for bit, for every
family and for LoRA adapters, so parity starts both sides from one model, adapters included.

The PyTorch exports run in this process (the test interpreter is the torch environment: one
framework import for the whole module); the Paddle exports run in ONE adapter subprocess, given
``--export-weights DIR --spec spec.json`` once per export (the harness exports each in turn: one Paddle
import for the module, not one per family).
"""

import json
import subprocess

import numpy as np
import pytest

from conftest import ROOT, require_interpreter
from xfw.run.commands import parity
from xfw.contract import weights
from xfw.recipe import load_recipe
from xfw.recipe.spec import resolve_spec

pytestmark = pytest.mark.contract

RECIPES = {"llava": "llava_sft", "llava-next": "llava_next_sft", "qwen2vl": "qwen2vl_sft", "sd15": "sd15_pretrain",
           "sd3": "sd3_dreambooth", "llava-lora": "llava_lora", "sd3-lora": "sd3_lora"}


def spec_for(backend: str, recipe: str, weights_dir) -> dict:
    path = ROOT / "recipes" / "tiny" / f"{recipe}.yaml"
    return resolve_spec(load_recipe(str(path), parity.forced_overrides(1, weights_dir)), backend=backend, run_id="t")


def export_torch(recipe: str, weights_dir, out_dir) -> dict:
    pytest.importorskip("torch")
    from xfw_torch.side_tasks import export_weights

    export_weights(spec_for("torch", recipe, weights_dir), str(out_dir))
    return weights.load_file(out_dir / weights.WEIGHTS_FILE)


def export_paddle_all(exports: list) -> list[dict]:
    """Each (recipe, model.weights, out_dir) exported by the Paddle adapter, all in one process."""
    python = require_interpreter("paddle")
    argv = [str(python), "-m", "xfw_paddle"]
    for recipe, weights_dir, out_dir in exports:
        spec_path = out_dir.parent / f"{out_dir.name}.spec.json"
        spec_path.write_text(json.dumps(spec_for("paddle", recipe, weights_dir)))
        argv += ["--export-weights", str(out_dir), "--spec", str(spec_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180 + 60 * len(exports))
    assert done.returncode == 0, done.stderr[-2000:]
    return [weights.load_file(out_dir / weights.WEIGHTS_FILE) for _, _, out_dir in exports]


def assert_bit_identical(state: dict, original: dict) -> None:
    assert sorted(state) == sorted(original)
    for name, value in original.items():
        assert state[name].dtype == value.dtype and state[name].tobytes() == value.tobytes(), name


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """family -> (torch's export, Paddle's export of it, torch's export of that, their directory), and ``"own"``:
    Paddle's export of the LoRA recipe's own seeded start (no file). Made once per module: every torch export in
    this process, every Paddle export in one adapter process."""
    directories = {family: tmp_path_factory.mktemp(family) for family in RECIPES}
    originals = {family: export_torch(RECIPES[family], None, d / "torch0") for family, d in directories.items()}
    own = tmp_path_factory.mktemp("own") / "paddle"
    *through, own_start = export_paddle_all([(RECIPES[f], d / "torch0", d / "paddle") for f, d in directories.items()]
                                            + [("llava_lora", None, own)])
    done = {"own": own_start}
    for (family, directory), through_paddle in zip(directories.items(), through):
        back = export_torch(RECIPES[family], directory / "paddle", directory / "torch1")
        done[family] = (originals[family], through_paddle, back, directory)
    return done


@pytest.mark.parametrize("family", RECIPES)
def test_weights_round_trip_torch_file_paddle_file_torch_bit_exact(round_trip, family):
    original, through_paddle, back, _ = round_trip[family]
    assert_bit_identical(through_paddle, original)
    assert_bit_identical(back, original)
    if family.endswith("-lora"):
        adapters = [n for n in original if n.endswith(".lora_A.weight")]
        assert adapters and all(np.abs(original[n]).max() > 0 for n in adapters)  # A starts random, not zero
        assert all(original[n.replace("lora_A", "lora_B")].shape[1] == original[n].shape[0] for n in adapters)


def test_the_paddle_side_takes_the_files_adapters_not_its_own_seeded_ones(round_trip):
    """Without this the round trip above could pass with adapters the file never set: Paddle's
    own seeded LoRA A differs from PyTorch's, so only a real load makes the exports equal."""
    own = round_trip["own"]  # Paddle's export of its own seeded start
    torch_start, loaded, _, _ = round_trip["llava-lora"]  # Paddle's export of torch's file
    a = "model.language_model.layers.0.self_attn.q_proj.lora_A.weight"
    assert own[a].shape == torch_start[a].shape and not np.array_equal(own[a], torch_start[a])
    assert loaded[a].tobytes() == torch_start[a].tobytes()


def test_adapters_in_the_file_of_a_stage_without_lora_are_rejected(round_trip):
    pytest.importorskip("torch")
    from xfw.contract.harness import InvalidSpec
    from xfw_torch.session import build_model

    lora = round_trip["llava-lora"][3] / "torch0"  # torch's export of the LoRA recipe
    import torch

    with pytest.raises(InvalidSpec, match=r"model\.weights: .* holds LoRA adapters .* stage is 'sft'"):
        build_model(spec_for("torch", "llava_sft", lora), torch.device("cpu"), "sdpa")
