"""A tiny LLaVA in plain transformers, and seeded synthetic image-text samples: what a training
script would build before its loop. No xfw here: the scripts beside this one are what
``recipes/tiny/attach_*.yaml`` run, unmodified, under xfw's probe.

The sizes are xfw's ``tiny-llava`` preset (xfw/contract/presets.py), so xfw's own adapter trains
the very same network (190,656 parameters; the vision tower is frozen, as LLaVA's fine-tuning
stage does): benchmarks/attach_overhead.py compares the two.
"""

import numpy as np
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

IMAGE_SIZE, PATCH, SEQ_LEN, VOCAB, IMAGE_TOKEN = 56, 14, 64, 512, 500
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2


def build_model() -> LlavaForConditionalGeneration:
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH, hidden_act="quick_gelu", layer_norm_eps=1e-5)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=VOCAB, rms_norm_eps=1e-5, max_position_embeddings=256,
                       tie_word_embeddings=False)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                         projector_hidden_act="gelu", vision_feature_layer=-2,
                         vision_feature_select_strategy="default", image_seq_length=NUM_IMAGE_TOKENS,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    model = LlavaForConditionalGeneration(config)
    for p in model.model.vision_tower.parameters():  # fine-tuning: the vision tower stays frozen
        p.requires_grad_(False)
    return model


class SyntheticImageText(torch.utils.data.Dataset):
    """[BOS, <image> x 16, text ...]; the loss on the text only."""

    def __init__(self, num_samples: int, seed: int = 0):
        self.num_samples, self.seed = num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        rng = np.random.default_rng([self.seed, index])
        text = rng.integers(2, IMAGE_TOKEN, size=SEQ_LEN - 1 - NUM_IMAGE_TOKENS)
        ids = np.concatenate([[1], np.full(NUM_IMAGE_TOKENS, IMAGE_TOKEN), text]).astype(np.int64)
        labels = ids.copy()
        labels[: 1 + NUM_IMAGE_TOKENS] = -100
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "attention_mask": torch.ones(SEQ_LEN, dtype=torch.int64),
                "pixel_values": torch.from_numpy(rng.standard_normal((3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32))}
