"""Qwen2-VL from the neutral architecture with transformers' Qwen2VLForConditionalGeneration.

The batch brings the M-RoPE position ids (computed by the core, see xfw.contract.families.qwen2vl),
so transformers does not rebuild them on the host inside the timed step. What each
stage trains is ``xfw.contract.families.qwen2vl.STAGE_PARTS``.
"""

from __future__ import annotations

import torch

from xfw_torch.families.llava import compile_units, enable_recompute, loss_fn  # noqa: F401 - same LM step


def build(arch: dict, *, attn_implementation: str = "sdpa") -> torch.nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    v, t = arch["vision"], arch["text"]
    config = Qwen2VLConfig(
        vision_config={
            "depth": v["depth"], "embed_dim": v["embed_dim"], "hidden_size": v["merger_out"],
            "mlp_ratio": v["mlp_ratio"], "num_heads": v["num_heads"], "patch_size": v["patch_size"],
            "spatial_merge_size": v["spatial_merge_size"], "temporal_patch_size": v["temporal_patch_size"],
        },
        text_config={
            "hidden_size": t["hidden_size"], "intermediate_size": t["intermediate_size"],
            "num_hidden_layers": t["num_layers"], "num_attention_heads": t["num_heads"],
            "num_key_value_heads": t["num_kv_heads"], "vocab_size": t["vocab_size"],
            "rms_norm_eps": t["rms_norm_eps"], "max_position_embeddings": t["max_position_embeddings"],
            "rope_parameters": {"rope_type": "default", "rope_theta": t["rope_theta"],
                                "mrope_section": list(t["mrope_section"])},
            "tie_word_embeddings": t["tie_word_embeddings"],
        },
        image_token_id=arch["image_token_id"], video_token_id=arch["video_token_id"],
        vision_start_token_id=arch["vision_start_token_id"], vision_end_token_id=arch["vision_end_token_id"],
        tie_word_embeddings=t["tie_word_embeddings"],
    )
    config._attn_implementation = attn_implementation
    return Qwen2VLForConditionalGeneration(config)


def shard_units(model: torch.nn.Module) -> list:
    """Blocks FSDP shards one by one: the decoder layers and the vision blocks."""
    return [*model.model.language_model.layers, *model.model.visual.blocks]
