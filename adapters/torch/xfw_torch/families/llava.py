"""LLaVA from the neutral architecture, with transformers' own classes.

``build(arch)`` maps the fields of ``xfw.contract.presets`` (family ``llava``) one-to-one onto
``CLIPVisionConfig`` + ``LlamaConfig`` and a ``LlavaConfig`` (single tile, LLaVA-1.5 style)
or ``LlavaNextConfig`` (AnyRes tiles + image newline, LLaVA-1.6), randomly initialised.
What each stage trains is ``xfw.contract.families.llava.STAGE_PARTS`` (the vision tower is
always frozen; with AnyRes the image newline trains with the projector).
"""

from __future__ import annotations

import torch

from xfw.contract.harness import Unsupported


def _configs(arch: dict):
    from transformers import CLIPVisionConfig, LlamaConfig

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
    return vision, text


def build(arch: dict, *, attn_implementation: str = "sdpa") -> torch.nn.Module:
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaNextConfig, LlavaNextForConditionalGeneration

    vision, text = _configs(arch)
    v = arch["vision"]
    common = dict(
        vision_config=vision, text_config=text, image_token_index=arch["image_token_id"],
        projector_hidden_act=arch["projector"]["hidden_act"], vision_feature_layer=v["feature_layer"],
        vision_feature_select_strategy="default" if v["drop_cls"] else "full",
        tie_word_embeddings=arch["text"]["tie_word_embeddings"],
    )
    if arch.get("anyres"):
        if not arch["anyres"]["image_newline"]:
            raise Unsupported("LLaVA-NeXT without the image-newline parameter")
        config = LlavaNextConfig(image_grid_pinpoints=arch["anyres"]["grid_pinpoints"], **common)
        cls = LlavaNextForConditionalGeneration
    else:
        config = LlavaConfig(image_seq_length=(v["image_size"] // v["patch_size"]) ** 2, **common)
        cls = LlavaForConditionalGeneration
    config._attn_implementation = attn_implementation
    return cls(config)


IMAGE_KEYS = ("pixel_values", "image_sizes", "image_grid_thw")


def loss_fn(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Causal-LM loss over the answer tokens (transformers shifts labels inside). A micro-batch of
    text-only samples (real data may have some) goes in without image inputs, and a zero image runs
    through the vision tower and projector first, added as 0 x their sum (:func:`idle_vision`)."""
    if "pixel_values" in batch and batch["pixel_values"].shape[0] == 0:
        idle = idle_vision(model, batch)
        return model(**{k: v for k, v in batch.items() if k not in IMAGE_KEYS}).loss + idle
    return model(**batch).loss


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return [t for v in values for t in _tensors(v)]


def idle_vision(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """0 x the sum of a zero image's features (vision tower, projector, LLaVA-NeXT's image_newline): what
    LLaVA's own trainer does for text-only samples. Every rank of a sharded run (FSDP, ZeRO-3, Paddle's
    stage 2/3) then runs the same collectives in the same order, and every trained vision-side parameter
    gets a gradient (zero) on every rank; without it a rank whose micro-batch had no image skipped the
    tower and the ranks' reductions no longer matched (found by xfw converge: FSDP2 stage 2 crashed)."""
    inner, pixels = model.model, batch["pixel_values"]
    if "image_grid_thw" in batch:  # Qwen2-VL: one grid of merge x merge patches (one merged token)
        merge = model.config.vision_config.spatial_merge_size
        grid = torch.tensor([[1, merge, merge]], device=pixels.device)
        out = inner.get_image_features(pixel_values=pixels.new_zeros(merge * merge, pixels.shape[-1]),
                                       image_grid_thw=grid)
    elif pixels.dim() == 5:  # LLaVA-NeXT: one square image of one tile's side, in the tiles AnyRes gives it
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        side = pixels.shape[-1]
        tiles = image_size_to_num_patches((side, side), model.config.image_grid_pinpoints, side)
        out = inner.get_image_features(pixel_values=pixels.new_zeros(1, tiles, *pixels.shape[2:]),
                                       image_sizes=torch.tensor([[side, side]], device=pixels.device))
    else:
        out = inner.get_image_features(pixel_values=pixels.new_zeros(1, *pixels.shape[1:]))
    parts = _tensors(out) + ([inner.image_newline] if getattr(inner, "image_newline", None) is not None else [])
    return 0.0 * sum(t.float().sum() for t in parts if t.is_floating_point())


def enable_recompute(model: torch.nn.Module, reentrant: bool = False) -> None:
    """transformers' per-layer activation checkpointing, non-reentrant. ``gradient_checkpointing_enable``
    also hooks every input embedding, the frozen vision tower's patch embedding included, to make its
    output require a gradient: reentrant checkpointing needs that, non-reentrant does not, and left
    on it sends a gradient back through the frozen vision tower, a backward pass nothing uses (found
    by the FLOP counter, tests/contract/test_flop_counter.py: +0.8 TFLOPs a sample on Qwen2-VL-2B).
    The hooks go; every stage's language model gets its gradient from a trained part anyway.
    ``reentrant``: the style LLaVA's own PyTorch training ran (reentrant, input gradients enabled
    with ``enable_input_require_grads``, so the hooks stay: reentrant checkpointing needs them)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()
    else:
        model.disable_input_require_grads()


def shard_units(model: torch.nn.Module) -> list:
    """Blocks FSDP shards one by one: the decoder layers and the vision encoder layers."""
    inner = model.model
    return [*inner.language_model.layers, *inner.vision_tower.vision_model.encoder.layers]


def compile_units(model: torch.nn.Module) -> list:
    """Blocks torch.compile compiles: the decoder layers only. transformers collects the vision
    tower's hidden states with hooks on its layers, which a compiled layer does not fire."""
    return list(model.model.language_model.layers)
