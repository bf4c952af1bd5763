"""Neutral weight files: safetensors written and read with numpy alone."""

import json
import struct

import numpy as np
import pytest

from xfw.contract import weights


def sample() -> dict:
    rng = np.random.default_rng(0)
    return {"model.layers.0.q_proj.weight": rng.standard_normal((8, 4)).astype(np.float32),
            "model.embed.weight": rng.standard_normal((3, 2)).astype(np.float16),
            "bf16.weight": np.array([[0x3F80, 0x4000]], dtype=np.uint16),
            "steps": np.array([1, 2, 3], dtype=np.int64), "scalar": np.float32(2.5).reshape(())}


def test_a_round_trip_returns_every_tensor_bit_exact_with_its_dtype(tmp_path):
    path = tmp_path / "model.safetensors"
    weights.save_file(sample(), path, bf16={"bf16.weight"}, metadata={"format": "pt"})
    got = weights.load_file(path)
    assert set(got) == set(sample())
    for name, value in sample().items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape
        assert got[name].tobytes() == value.tobytes()
    assert not list(tmp_path.glob(".*tmp*"))  # the temporary file was renamed into place


def test_the_file_follows_the_safetensors_layout(tmp_path):
    path = tmp_path / "model.safetensors"
    weights.save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, path)
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    assert header["w"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert (8 + size) % 8 == 0 and raw[8 + size:] == np.arange(6, dtype="<f4").tobytes()


def test_listing_reads_the_header_alone(tmp_path):
    path = tmp_path / "model.safetensors"
    weights.save_file(sample(), path, bf16={"bf16.weight"})
    with open(path, "r+b") as f:  # cut off the data: the header is still enough
        (size,) = struct.unpack("<Q", f.read(8))
        f.truncate(8 + size)
    listed = weights.list_tensors(path)
    assert listed["model.layers.0.q_proj.weight"] == ("F32", (8, 4))
    assert listed["bf16.weight"] == ("BF16", (1, 2)) and listed["scalar"] == ("F32", ())
    with pytest.raises(weights.WeightsError, match="data offsets"):
        weights.load_file(path)


@pytest.mark.parametrize("content", [b"", b"\x05\x00\x00\x00\x00\x00\x00\x00{nope", b"\xff" * 16,
                                     struct.pack("<Q", 2) + b"[]"])
def test_a_corrupt_file_gives_one_line_naming_the_file(tmp_path, content):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    for read in (weights.load_file, weights.list_tensors):
        with pytest.raises(weights.WeightsError) as err:
            read(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_missing_file_names_the_key_and_the_directory(tmp_path):
    with pytest.raises(weights.WeightsError, match=r"model\.weights: .* holds no model\.safetensors"):
        weights.Checkpoint(tmp_path, family="llava")


def test_a_strict_check_names_missing_extra_and_misshapen_tensors(tmp_path):
    path = tmp_path / "model.safetensors"
    weights.save_file({"a": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32)}, path)
    listed = {n: shape for n, (_, shape) in weights.list_tensors(path).items()}
    weights.check_shapes({"a": (2, 3), "b": (2,)}, listed, path)
    with pytest.raises(weights.WeightsError) as err:
        weights.check_shapes({"a": (3, 2), "c": (1,)}, listed, path)
    message = str(err.value)
    assert "1 parameters missing (e.g. c)" in message and "1 unexpected tensors (e.g. b)" in message
    assert "a: model [3, 2], file [2, 3]" in message


def test_the_harness_hands_export_weights_to_the_adapter_and_trains_nothing(tmp_path):
    import json as _json

    from xfw.contract import harness

    spec = tmp_path / "spec.json"
    spec.write_text(_json.dumps({"model": {"weights": "random"}}))
    calls = []

    def refuse(_spec):
        raise AssertionError("no session is built for an export")

    argv = ["--export-weights", str(tmp_path / "out"), "--spec", str(spec)]
    assert harness.main(refuse, dict, argv, export_weights=lambda s, d: calls.append((s, d))) == harness.EXIT_OK
    assert calls == [({"model": {"weights": "random"}}, str(tmp_path / "out"))]
    assert harness.main(refuse, dict, argv) == harness.EXIT_UNSUPPORTED  # an adapter without the hook


def test_several_starts_are_exported_by_one_process_in_order_and_a_failure_does_not_stop_the_next(tmp_path):
    """converge exports every seed's start in one adapter process (the framework imported once)."""
    import json as _json

    import pytest

    from xfw.contract import harness

    argv, calls = [], []
    for seed in (0, 1, 2):
        (tmp_path / f"s{seed}.json").write_text(_json.dumps({"seed": seed}))
        argv += ["--export-weights", str(tmp_path / f"w{seed}"), "--spec", str(tmp_path / f"s{seed}.json")]

    def export(spec, directory):
        calls.append((spec["seed"], directory))
        if spec["seed"] == 1:
            raise harness.InvalidSpec("model.weights: nope")

    assert harness.main(None, dict, argv, export_weights=export) == harness.EXIT_INVALID  # the first failure's code
    assert calls == [(s, str(tmp_path / f"w{s}")) for s in (0, 1, 2)]  # seed 2 still exported after seed 1 failed
    with pytest.raises(SystemExit):  # a DIR without its spec
        harness.main(None, dict, argv[:-2], export_weights=export)


def test_an_adapter_rejecting_the_weights_exits_invalid(tmp_path):
    from xfw.contract import harness

    spec = tmp_path / "spec.json"
    spec.write_text("{}")

    def reject(_spec, _dir):
        raise harness.InvalidSpec("model.weights: nope")

    argv = ["--export-weights", str(tmp_path), "--spec", str(spec)]
    assert harness.main(None, dict, argv, export_weights=reject) == harness.EXIT_INVALID


def test_older_transformers_names_map_to_the_current_ones_and_current_names_stay():
    from xfw.contract.hf_names import canonical_name

    assert canonical_name("llava", "language_model.model.layers.0.mlp.up_proj.weight") == \
        "model.language_model.layers.0.mlp.up_proj.weight"
    assert canonical_name("llava", "language_model.lm_head.weight") == "lm_head.weight"
    assert canonical_name("llava", "vision_tower.vision_model.embeddings.class_embedding") == \
        "model.vision_tower.vision_model.embeddings.class_embedding"
    assert canonical_name("llava", "multi_modal_projector.linear_1.bias") == "model.multi_modal_projector.linear_1.bias"
    assert canonical_name("llava", "image_newline") == "model.image_newline"
    assert canonical_name("qwen2vl", "model.layers.0.self_attn.q_proj.bias") == \
        "model.language_model.layers.0.self_attn.q_proj.bias"
    assert canonical_name("qwen2vl", "model.embed_tokens.weight") == "model.language_model.embed_tokens.weight"
    assert canonical_name("qwen2vl", "visual.merger.mlp.0.weight") == "model.visual.merger.mlp.0.weight"
    for family, name in (("llava", "model.language_model.norm.weight"), ("llava", "lm_head.weight"),
                         ("qwen2vl", "model.language_model.norm.weight"),
                         ("qwen2vl", "model.visual.blocks.0.attn.qkv.bias"),
                         ("qwen2vl", "lm_head.weight"), ("sd15", "unet.conv_in.weight")):
        assert canonical_name(family, name) == name  # already current: unchanged


def test_a_checkpoint_directory_reads_old_names_bf16_and_shards_under_the_canonical_names(tmp_path):
    bits = np.array([[0x3F80, 0xC000]], dtype=np.uint16)  # bf16 1.0, -2.0
    weights.save_file({"language_model.model.norm.weight": np.ones(4, np.float32)}, tmp_path / "a.safetensors")
    weights.save_file({"vision_tower.w": bits, "language_model.model.layers.0.q_proj.lora_A.weight":
                       np.zeros((2, 4), np.float32)}, tmp_path / "b.safetensors", bf16={"vision_tower.w"})
    (tmp_path / weights.INDEX_FILE).write_text(json.dumps({"weight_map": {
        "language_model.model.norm.weight": "a.safetensors", "vision_tower.w": "b.safetensors"}}))
    ckpt = weights.Checkpoint(tmp_path, family="llava")
    assert ckpt.shapes(lora=False) == {"model.language_model.norm.weight": (4,), "model.vision_tower.w": (1, 2)}
    assert ckpt.names(lora=True) == ["model.language_model.layers.0.q_proj.lora_A.weight"]
    state = ckpt.load(["model.vision_tower.w", "model.language_model.norm.weight"])
    assert state["model.vision_tower.w"].dtype == np.float32 and state["model.vision_tower.w"].tolist() == [[1.0, -2.0]]
    ckpt.check({"model.language_model.norm.weight": (4,), "model.vision_tower.w": (1, 2)}, lora=False)
    with pytest.raises(weights.WeightsError, match=r"1 parameters missing \(e\.g\. extra\)"):
        ckpt.check({"model.language_model.norm.weight": (4,), "model.vision_tower.w": (1, 2), "extra": (1,)},
                   lora=False)


def test_two_tensors_that_are_one_name_in_the_current_layout_are_rejected(tmp_path):
    weights.save_file({"vision_tower.w": np.ones(2, np.float32), "model.vision_tower.w": np.ones(2, np.float32)},
                      tmp_path / weights.WEIGHTS_FILE)
    with pytest.raises(weights.WeightsError, match="are both 'model.vision_tower.w' in the current layout"):
        weights.Checkpoint(tmp_path, family="llava")
    with pytest.raises(weights.WeightsError, match=r"model\.weights: .* holds no model\.safetensors"):
        weights.Checkpoint(tmp_path / "empty", family="llava")


def test_peft_parameter_names_are_made_canonical():
    from xfw.contract.hf_names import is_lora, peft_to_canonical

    assert peft_to_canonical("m.layers.0.q_proj.base_layer.weight") == "m.layers.0.q_proj.weight"
    assert peft_to_canonical("m.layers.0.q_proj.lora_A.default.weight") == "m.layers.0.q_proj.lora_A.weight"
    assert peft_to_canonical("unet.attn1.to_out.0.lora_B.default.weight") == "unet.attn1.to_out.0.lora_B.weight"
    assert is_lora("m.q_proj.lora_B.weight") and not is_lora("m.q_proj.weight")


def test_lora_adapters_are_refused_outside_a_lora_stage(tmp_path):
    weights.save_file({"q_proj.weight": np.zeros((4, 4), np.float32),
                       "q_proj.lora_A.weight": np.zeros((2, 4), np.float32)}, tmp_path / weights.WEIGHTS_FILE)
    checkpoint = weights.Checkpoint(tmp_path, family="llava")
    checkpoint.check_stage("lora")
    with pytest.raises(weights.WeightsError, match=r"holds LoRA adapters \(e\.g\. q_proj\.lora_A\.weight\) "
                                                   r"but the stage is 'sft'"):
        checkpoint.check_stage("sft")
