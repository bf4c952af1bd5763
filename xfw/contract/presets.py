"""Neutral architectures: the one source of truth both adapters build their models from.

A preset is plain data (it crosses the process boundary inside spec.json). Each adapter maps
these fields to its framework's classes, so both sides build the same network, and
:func:`count_params` gives the parameter count both must report::

    >>> arch = resolve_arch("tiny-llava", {}, None, None)
    >>> arch["text"]["hidden_size"], arch["data"]["seq_len"]
    (64, 64)

Published sizes are taken from the model cards' config.json
(llava-hf/llava-v1.6-vicuna-7b-hf and -13b-hf, Qwen/Qwen2-VL-2B-Instruct and -7B-Instruct,
runwayml/stable-diffusion-v1-5, stabilityai/stable-diffusion-3-medium-diffusers).
"""

from __future__ import annotations

import copy
from typing import Any

from xfw.contract.families import FAMILIES, ArchError, family_module  # noqa: F401 - ArchError: presets.ArchError

# The stages each family supports: the stages its family module says what they train.
FAMILY_STAGES = {name: tuple(family_module(name).STAGE_PARTS) for name in FAMILIES}

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
_TINY_CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4, "patch_size": 14,
              "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5, "feature_layer": -2, "drop_cls": True}
_TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4,
               "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
               "tie_word_embeddings": False}
_QWEN2VL_SPECIAL_IDS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
                        "vision_end_token_id": 151653}  # Qwen/Qwen2-VL-2B-Instruct config.json
_ANYRES = {"grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]], "image_newline": True}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llava": {
        "family": "llava",
        "vision": {**_TINY_CLIP, "image_size": 56},
        "projector": {"hidden_act": "gelu"},
        "text": dict(_TINY_LLAMA),
        "image_token_id": 500,
        "anyres": None,
        "data": {"image_size": 56, "seq_len": 64},
    },
    "tiny-llava-next": {  # LLaVA-1.6's AnyRes path at toy size: 3 tiles, 4 + 2 x (4 + 1) = 14 image tokens
        "family": "llava",
        "vision": {**_TINY_CLIP, "image_size": 28},
        "projector": {"hidden_act": "gelu"},
        "text": dict(_TINY_LLAMA),
        "image_token_id": 500,
        "anyres": {"grid_pinpoints": [[28, 56], [56, 28], [56, 56]], "image_newline": True},
        "data": {"image_size": 28, "seq_len": 64, "anyres_image_hw": [28, 56]},
    },
    "llava-1.6-vicuna-7b": {
        "family": "llava",
        "vision": dict(_CLIP_L_336),
        "projector": {"hidden_act": "gelu"},
        "text": dict(_VICUNA_7B),
        "image_token_id": 32000,
        "anyres": copy.deepcopy(_ANYRES),
        # A 336x672 image: base tile + 1x2 grid = 3 tiles, 576 + 24 x (48 + 1) = 1752 image tokens.
        "data": {"image_size": 336, "seq_len": 2048, "anyres_image_hw": [336, 672]},
    },
    "llava-1.6-vicuna-13b": {
        "family": "llava",
        "vision": dict(_CLIP_L_336),
        "projector": {"hidden_act": "gelu"},
        "text": {**_VICUNA_7B, "hidden_size": 5120, "intermediate_size": 13824, "num_layers": 40,
                 "num_heads": 40, "num_kv_heads": 40},
        "image_token_id": 32000,
        "anyres": copy.deepcopy(_ANYRES),
        # A 336x672 image: base tile + 1x2 grid = 3 tiles, 576 + 24 x (48 + 1) = 1752 image tokens.
        "data": {"image_size": 336, "seq_len": 2048, "anyres_image_hw": [336, 672]},
    },
    "tiny-qwen2-vl": {
        "family": "qwen2vl",
        "vision": {"depth": 2, "embed_dim": 32, "num_heads": 4, "mlp_ratio": 2, "patch_size": 14,
                   "temporal_patch_size": 2, "spatial_merge_size": 2, "merger_out": 64},
        "text": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
                 "num_kv_heads": 2, "vocab_size": 512, "rope_theta": 1000000.0,
                 "mrope_section": [2, 3, 3], "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                 "max_position_embeddings": 512},
        "image_token_id": 500, "video_token_id": 501, "vision_start_token_id": 502, "vision_end_token_id": 503,
        "data": {"image_size": 112, "seq_len": 64},  # 8x8 patches -> 16 merged image tokens
    },
    "qwen2-vl-2b": {
        "family": "qwen2vl",
        "vision": {"depth": 32, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4, "patch_size": 14,
                   "temporal_patch_size": 2, "spatial_merge_size": 2, "merger_out": 1536},
        "text": {"hidden_size": 1536, "intermediate_size": 8960, "num_layers": 28, "num_heads": 12,
                 "num_kv_heads": 2, "vocab_size": 151936, "rope_theta": 1000000.0,
                 "mrope_section": [16, 24, 24], "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                 "max_position_embeddings": 32768},
        **_QWEN2VL_SPECIAL_IDS,
        "data": {"image_size": 448, "seq_len": 2048},  # 32x32 patches -> 256 merged image tokens
    },
    "qwen2-vl-7b": {
        "family": "qwen2vl",
        "vision": {"depth": 32, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4, "patch_size": 14,
                   "temporal_patch_size": 2, "spatial_merge_size": 2, "merger_out": 3584},
        "text": {"hidden_size": 3584, "intermediate_size": 18944, "num_layers": 28, "num_heads": 28,
                 "num_kv_heads": 4, "vocab_size": 152064, "rope_theta": 1000000.0,
                 "mrope_section": [16, 24, 24], "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                 "max_position_embeddings": 32768},
        **_QWEN2VL_SPECIAL_IDS,
        "data": {"image_size": 448, "seq_len": 2048},
    },
    # runwayml/stable-diffusion-v1-5: unet/, vae/, text_encoder/ (openai/clip-vit-large-patch14's text
    # tower) and scheduler/ config.json. UNet in/out channels are the VAE's latent_channels; the VAE
    # is diffusers' AutoencoderKL with DownEncoderBlock2D / UpDecoderBlock2D at every level.
    "sd-1.5": {
        "family": "sd15",
        "unet": {"sample_size": 64, "block_out_channels": [320, 640, 1280, 1280], "layers_per_block": 2,
                 "cross_attention_dim": 768, "attention_head_dim": 8, "norm_num_groups": 32,
                 "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
                 "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3},
        "vae": {"block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "norm_num_groups": 32,
                "latent_channels": 4, "scaling_factor": 0.18215, "shift_factor": None, "use_quant_conv": True},
        "text": {"hidden_size": 768, "intermediate_size": 3072, "num_layers": 12, "num_heads": 12,
                 "vocab_size": 49408, "max_length": 77, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
        "scheduler": {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
                      "beta_schedule": "scaled_linear"},
        "data": {"image_size": 512, "seq_len": None},
    },
    # stabilityai/stable-diffusion-3-medium-diffusers: transformer/, vae/ and scheduler/ config.json
    # (FlowMatchEulerDiscreteScheduler, shift 3.0). Text: CLIP-L + CLIP-G (77 tokens, pooled 768 + 1280)
    # and T5-XXL (77 tokens, 4096) joined as the pipeline does: [b, 154, 4096] + pooled [b, 2048].
    "sd-3-medium": {
        "family": "sd3",
        "transformer": {"sample_size": 128, "num_layers": 24, "num_heads": 24, "head_dim": 64, "patch_size": 2,
                        "in_channels": 16, "out_channels": 16, "joint_attention_dim": 4096,
                        "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "pos_embed_max_size": 192},
        "vae": {"block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "norm_num_groups": 32,
                "latent_channels": 16, "scaling_factor": 1.5305, "shift_factor": 0.0609, "use_quant_conv": False},
        "text": {"precomputed": True, "seq_len": 154, "dim": 4096, "pooled_dim": 2048},
        "scheduler": {"num_train_timesteps": 1000, "shift": 3.0, "timestep_sampling": "logit_normal",
                      "logit_mean": 0.0, "logit_std": 1.0},
        "data": {"image_size": 512, "seq_len": None},
    },
    "tiny-sd15": {  # SD1.5's structure at toy size: 2 UNet levels (cross-attn + plain), 32-px images
        "family": "sd15",
        "unet": {"sample_size": 16, "block_out_channels": [32, 64], "layers_per_block": 1,
                 "cross_attention_dim": 32, "attention_head_dim": 2, "norm_num_groups": 8,
                 "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
                 "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"]},
        "vae": {"block_out_channels": [32, 64], "layers_per_block": 1, "norm_num_groups": 8,
                "latent_channels": 4, "scaling_factor": 0.18215, "shift_factor": None, "use_quant_conv": True},
        "text": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2,
                 "vocab_size": 1000, "max_length": 16, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
        "scheduler": {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
                      "beta_schedule": "scaled_linear"},
        "data": {"image_size": 32, "seq_len": None},
    },
    "tiny-sd3": {  # SD3's MMDiT at toy size: 2 joint blocks of 2 heads x 16, 16-channel latents, 32-px images
        "family": "sd3",
        "transformer": {"sample_size": 16, "num_layers": 2, "num_heads": 2, "head_dim": 16, "patch_size": 2,
                        "in_channels": 16, "out_channels": 16, "joint_attention_dim": 32,
                        "caption_projection_dim": 32, "pooled_projection_dim": 32, "pos_embed_max_size": 16},
        "vae": {"block_out_channels": [32, 64], "layers_per_block": 1, "norm_num_groups": 8,
                "latent_channels": 16, "scaling_factor": 1.5305, "shift_factor": 0.0609, "use_quant_conv": False},
        "text": {"precomputed": True, "seq_len": 16, "dim": 32, "pooled_dim": 32},
        "scheduler": {"num_train_timesteps": 1000, "shift": 3.0, "timestep_sampling": "logit_normal",
                      "logit_mean": 0.0, "logit_std": 1.0},
        "data": {"image_size": 32, "seq_len": None},
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


def resolve_arch(preset: str, override: dict, image_size: int | None, seq_len: int | None) -> dict:
    """The preset with the recipe's overrides and data sizes applied, validated."""
    arch = _merge(PRESETS[preset], override or {}, "model.arch")
    arch["preset"] = preset
    if image_size is not None:
        arch["data"]["image_size"] = image_size
    if seq_len is not None:
        arch["data"]["seq_len"] = seq_len
    try:
        module = family_module(arch["family"])
    except ModuleNotFoundError:
        return arch  # a family the core has no module for yet: adapters will say unsupported
    module.check(arch)
    return arch


def count_params(arch: dict) -> dict[str, int]:
    """Analytic parameter counts per component, from the neutral fields alone.

    Both adapters must report exactly these totals for the same preset: a mismatch means
    the two sides did not build the same architecture. Raises NotImplementedError for
    families without an analytic count (the adapters' counts are still compared).
    """
    module = family_module(arch["family"])
    if not hasattr(module, "count_params"):
        raise NotImplementedError(f"parameter count for family {arch['family']!r}")
    return module.count_params(arch)


def num_image_tokens(arch: dict, image_size: int) -> int:
    """Image tokens in the language sequence for one image (families with images in text)."""
    return family_module(arch["family"]).num_image_tokens(arch, image_size)


_DISPLAY_NAMES = {
    "tiny-llava": "Tiny LLaVA", "llava-1.6-vicuna-7b": "LLaVA1.6 7B", "llava-1.6-vicuna-13b": "LLaVA1.6 13B",
    "qwen2-vl-2b": "Qwen2VL 2B", "tiny-qwen2-vl": "Tiny Qwen2VL", "tiny-llava-next": "Tiny LLaVA1.6", "qwen2-vl-7b": "Qwen2VL 7B", "sd-1.5": "Stable Diffusion 1.5",
    "sd-3-medium": "Stable Diffusion 3", "tiny-sd15": "Tiny SD1.5", "tiny-sd3": "Tiny SD3",
}


def display_name(preset: str) -> str:
    """The model's name as seed 003's table writes it."""
    return _DISPLAY_NAMES.get(preset, preset)
