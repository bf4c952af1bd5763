"""Neutral architectures: the one source of truth both adapters build their models from.

A preset is plain data (it crosses the process boundary inside spec.json). Each adapter maps
these fields to its framework's classes, so both sides build the same network, and
:func:`count_params` gives the parameter count both must report::

    >>> arch = resolve_arch("tiny-llava", {}, None, None)
    >>> arch["text"]["hidden_size"], arch["data"]["seq_len"]
    (64, 64)

Published sizes are the ones in shared/DESIGN.md §4, taken from the model cards' config.json
(llava-hf/llava-v1.6-vicuna-7b-hf and -13b-hf, Qwen/Qwen2-VL-2B-Instruct and -7B-Instruct,
runwayml/stable-diffusion-v1-5, stabilityai/stable-diffusion-3-medium-diffusers).
"""

from __future__ import annotations

import copy
from typing import Any


class ArchError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


FAMILY_STAGES = {
    "llava": ("pretrain", "sft", "lora"),
    "qwen2vl": ("sft", "lora"),
    "sd15": ("pretrain", "lora"),
    "sd3": ("dreambooth", "lora"),
}

_CLIP_L_336 = {  # openai/clip-vit-large-patch14-336, the LLaVA-1.5/1.6 vision tower
    "hidden_size": 1024, "intermediate_size": 4096, "num_layers": 24, "num_heads": 16,
    "image_size": 336, "patch_size": 14, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
    "feature_layer": -2, "drop_cls": True,
}
_VICUNA_7B = {
    "hidden_size": 4096, "intermediate_size": 11008, "num_layers": 32, "num_heads": 32,
    "num_kv_heads": 32, "vocab_size": 32064, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
}
_ANYRES = {"grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]], "image_newline": True}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llava": {
        "family": "llava",
        "vision": {
            "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
            "image_size": 56, "patch_size": 14, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
            "feature_layer": -2, "drop_cls": True,
        },
        "projector": {"hidden_act": "gelu"},
        "text": {
            "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
            "num_kv_heads": 4, "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 256, "tie_word_embeddings": False,
        },
        "image_token_id": 500,
        "anyres": None,
        "data": {"image_size": 56, "seq_len": 64},
    },
    "llava-1.6-vicuna-7b": {
        "family": "llava",
        "vision": dict(_CLIP_L_336),
        "projector": {"hidden_act": "gelu"},
        "text": dict(_VICUNA_7B),
        "image_token_id": 32000,
        "anyres": copy.deepcopy(_ANYRES),
        "data": {"image_size": 336, "seq_len": 2048},
    },
    "llava-1.6-vicuna-13b": {
        "family": "llava",
        "vision": dict(_CLIP_L_336),
        "projector": {"hidden_act": "gelu"},
        "text": {**_VICUNA_7B, "hidden_size": 5120, "intermediate_size": 13824, "num_layers": 40,
                 "num_heads": 40, "num_kv_heads": 40},
        "image_token_id": 32000,
        "anyres": copy.deepcopy(_ANYRES),
        "data": {"image_size": 336, "seq_len": 2048},
    },
    "qwen2-vl-2b": {
        "family": "qwen2vl",
        "vision": {"depth": 32, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4, "patch_size": 14,
                   "temporal_patch_size": 2, "spatial_merge_size": 2, "merger_out": 1536},
        "text": {"hidden_size": 1536, "intermediate_size": 8960, "num_layers": 28, "num_heads": 12,
                 "num_kv_heads": 2, "vocab_size": 151936, "rope_theta": 1000000.0,
                 "mrope_section": [16, 24, 24], "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
        "data": {"image_size": 448, "seq_len": 2048},
    },
    "qwen2-vl-7b": {
        "family": "qwen2vl",
        "vision": {"depth": 32, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4, "patch_size": 14,
                   "temporal_patch_size": 2, "spatial_merge_size": 2, "merger_out": 3584},
        "text": {"hidden_size": 3584, "intermediate_size": 18944, "num_layers": 28, "num_heads": 28,
                 "num_kv_heads": 4, "vocab_size": 152064, "rope_theta": 1000000.0,
                 "mrope_section": [16, 24, 24], "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
        "data": {"image_size": 448, "seq_len": 2048},
    },
    "sd-1.5": {
        "family": "sd15",
        "unet": {"sample_size": 64, "block_out_channels": [320, 640, 1280, 1280], "layers_per_block": 2,
                 "cross_attention_dim": 768, "attention_head_dim": 8,
                 "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
                 "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3},
        "vae": {"block_out_channels": [128, 256, 512, 512], "latent_channels": 4, "scaling_factor": 0.18215},
        "text": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "vocab_size": 49408, "max_length": 77},
        "data": {"image_size": 512, "seq_len": None},
    },
    "sd-3-medium": {
        "family": "sd3",
        "transformer": {"num_layers": 24, "num_heads": 24, "head_dim": 64, "patch_size": 2,
                        "in_channels": 16, "out_channels": 16, "joint_attention_dim": 4096,
                        "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "pos_embed_max_size": 192},
        "vae": {"latent_channels": 16, "scaling_factor": 1.5305, "shift_factor": 0.0609},
        "text": {"precomputed": True, "seq_len": 154, "dim": 4096, "pooled_dim": 2048},
        "data": {"image_size": 512, "seq_len": None},
    },
}


def _merge(base: dict, override: dict, path: str) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        where = f"{path}.{key}"
        if key not in out:
            raise ArchError(where, f"unknown architecture field (expected one of: {', '.join(out)})")
        if isinstance(out[key], dict) and isinstance(value, dict):
            out[key] = _merge(out[key], value, where)
        else:
            out[key] = copy.deepcopy(value)
    return out


def num_image_tokens(arch: dict, image_size: int) -> int:
    """LLaVA image tokens in the language sequence for one image (single tile)."""
    vision = arch["vision"]
    return (image_size // vision["patch_size"]) ** 2 + (0 if vision["drop_cls"] else 1)


def _check_llava(arch: dict) -> None:
    vision, text, data = arch["vision"], arch["text"], arch["data"]
    for part, cfg in (("vision", vision), ("text", text)):
        if cfg["hidden_size"] % cfg["num_heads"]:
            raise ArchError(f"model.arch.{part}.num_heads",
                            f"{cfg['num_heads']} does not divide hidden_size {cfg['hidden_size']}")
    if text["num_heads"] % text["num_kv_heads"]:
        raise ArchError("model.arch.text.num_kv_heads",
                        f"{text['num_kv_heads']} does not divide num_heads {text['num_heads']}")
    if data["image_size"] != vision["image_size"]:
        raise ArchError("data.image_size", f"{data['image_size']} differs from the vision tower's input "
                        f"(model.arch.vision.image_size = {vision['image_size']}); set both")
    if data["image_size"] % vision["patch_size"]:
        raise ArchError("data.image_size", f"{data['image_size']} is not a multiple of patch_size {vision['patch_size']}")
    if not 0 <= arch["image_token_id"] < text["vocab_size"]:
        raise ArchError("model.arch.image_token_id", f"{arch['image_token_id']} is outside the vocabulary")
    if not -vision["num_layers"] <= vision["feature_layer"] < 0:
        raise ArchError("model.arch.vision.feature_layer", f"must be in [-num_layers, -1], got {vision['feature_layer']}")
    needed = num_image_tokens(arch, data["image_size"]) + 2  # BOS + image + at least one text token
    if data["seq_len"] < needed:
        raise ArchError("data.seq_len", f"{data['seq_len']} leaves no room for text after "
                        f"{needed - 2} image tokens (need at least {needed})")
    if data["seq_len"] > text["max_position_embeddings"]:
        raise ArchError("data.seq_len", f"{data['seq_len']} exceeds max_position_embeddings {text['max_position_embeddings']}")


def resolve_arch(preset: str, override: dict, image_size: int | None, seq_len: int | None) -> dict:
    """The preset with the recipe's overrides and data sizes applied, validated."""
    arch = _merge(PRESETS[preset], override or {}, "model.arch")
    arch["preset"] = preset
    if image_size is not None:
        arch["data"]["image_size"] = image_size
    if seq_len is not None:
        arch["data"]["seq_len"] = seq_len
    if arch["family"] == "llava":
        _check_llava(arch)
    return arch


def count_params(arch: dict) -> dict[str, int]:
    """Analytic parameter counts per component, from the neutral fields alone.

    Both adapters must report exactly these totals for the same preset: a mismatch means
    the two sides did not build the same architecture.
    """
    if arch["family"] != "llava":
        raise NotImplementedError(f"parameter count for family {arch['family']!r}")
    v, t = arch["vision"], arch["text"]
    h, f = v["hidden_size"], v["intermediate_size"]
    num_positions = (v["image_size"] // v["patch_size"]) ** 2 + 1
    vision = (h * 3 * v["patch_size"] ** 2  # patch conv, no bias
              + h + num_positions * h  # class embedding, position embedding
              + 2 * h * 2  # pre- and post-layernorm
              + v["num_layers"] * (4 * (h * h + h) + 2 * 2 * h + (h * f + f) + (f * h + h)))
    th, tf = t["hidden_size"], t["intermediate_size"]
    kv = th // t["num_heads"] * t["num_kv_heads"]
    text = (t["vocab_size"] * th
            + t["num_layers"] * (2 * th * th + 2 * th * kv + 3 * th * tf + 2 * th)
            + th
            + (0 if t["tie_word_embeddings"] else t["vocab_size"] * th))
    projector = h * th + th + th * th + th
    newline = th if arch.get("anyres") and arch["anyres"].get("image_newline") else 0
    return {"vision": vision, "projector": projector + newline, "text": text,
            "total": vision + projector + newline + text}


_DISPLAY_NAMES = {
    "tiny-llava": "Tiny LLaVA", "llava-1.6-vicuna-7b": "LLaVA1.6 7B", "llava-1.6-vicuna-13b": "LLaVA1.6 13B",
    "qwen2-vl-2b": "Qwen2VL 2B", "qwen2-vl-7b": "Qwen2VL 7B", "sd-1.5": "Stable Diffusion 1.5",
    "sd-3-medium": "Stable Diffusion 3",
}


def display_name(preset: str) -> str:
    """The model's name as seed 003's table writes it."""
    return _DISPLAY_NAMES.get(preset, preset)
