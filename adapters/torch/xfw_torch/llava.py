"""LLaVA from the neutral architecture, with transformers' own classes.

``build_llava(arch)`` maps the fields of ``xfw.presets`` (family ``llava``) one-to-one onto
``CLIPVisionConfig`` + ``LlamaConfig`` + ``LlavaConfig`` and returns a randomly initialised
``LlavaForConditionalGeneration``; ``trainable_parts(model, stage)`` says what a stage trains
(DESIGN.md §4: pretrain = projector, sft = projector + LM, vision always frozen).
"""

from __future__ import annotations

import torch

from xfw.harness import Unsupported


def build_llava(arch: dict, attn_implementation: str = "sdpa") -> torch.nn.Module:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    if arch.get("anyres"):
        # LLaVA-1.6 AnyRes tiling (LlavaNext) comes with the seed recipes in a later issue.
        raise Unsupported("LLaVA-1.6 AnyRes presets are not built by this adapter yet; use a single-tile preset")
    v, t = arch["vision"], arch["text"]
    vision = CLIPVisionConfig(
        hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
        num_hidden_layers=v["num_layers"], num_attention_heads=v["num_heads"],
        image_size=v["image_size"], patch_size=v["patch_size"], hidden_act=v["hidden_act"],
        layer_norm_eps=v["layer_norm_eps"],
    )
    text = LlamaConfig(
        hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
        num_hidden_layers=t["num_layers"], num_attention_heads=t["num_heads"],
        num_key_value_heads=t["num_kv_heads"], vocab_size=t["vocab_size"], rms_norm_eps=t["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": t["rope_theta"]},
        max_position_embeddings=t["max_position_embeddings"], tie_word_embeddings=t["tie_word_embeddings"],
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=arch["image_token_id"],
        projector_hidden_act=arch["projector"]["hidden_act"], vision_feature_layer=v["feature_layer"],
        vision_feature_select_strategy="default" if v["drop_cls"] else "full",
        image_seq_length=(v["image_size"] // v["patch_size"]) ** 2, tie_word_embeddings=t["tie_word_embeddings"],
    )
    config._attn_implementation = attn_implementation
    return LlavaForConditionalGeneration(config)


def trainable_parts(model: torch.nn.Module, stage: str) -> list[torch.nn.Module]:
    inner = model.model
    if stage == "pretrain":
        return [inner.multi_modal_projector]
    if stage == "sft":
        return [inner.multi_modal_projector, inner.language_model, model.lm_head]
    raise Unsupported(f"stage {stage!r} for LLaVA is not built by this adapter yet")


def loss_fn(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Causal-LM loss over the text tokens (transformers shifts labels inside)."""
    return model(**batch).loss
