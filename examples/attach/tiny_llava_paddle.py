"""A tiny LLaVA in Paddle + PaddleNLP, and seeded synthetic image-text samples: what a training
script would build before its loop. No xfw here.

PaddleNLP has no trainable LLaVA (PaddleMIX does); this one is composed the way PaddleMIX's is:
PaddleNLP's CLIP vision tower (second-to-last layer, CLS dropped), a two-layer GELU projector, and
PaddleNLP's Llama, with the image features in place of the image tokens (one image at the start
of every sample, so they are concatenated). The sizes are xfw's ``tiny-llava`` preset: 190,656
parameters, the vision tower frozen, as in ``tiny_llava_torch.py``.
"""

import numpy as np
import paddle
from paddle import nn
from paddlenlp.transformers import CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlamaForCausalLM

IMAGE_SIZE, PATCH, SEQ_LEN, VOCAB, IMAGE_TOKEN = 56, 14, 64, 512, 500
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2


class TinyLlava(nn.Layer):
    def __init__(self):
        super().__init__()
        self.vision_tower = CLIPVisionModel(CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            image_size=IMAGE_SIZE, patch_size=PATCH, hidden_act="quick_gelu", layer_norm_eps=1e-5))
        self.projector = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
        self.language_model = LlamaForCausalLM(LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=VOCAB, rms_norm_eps=1e-5, max_position_embeddings=256,
            tie_word_embeddings=False))
        for p in self.vision_tower.parameters():  # fine-tuning: the vision tower stays frozen
            p.stop_gradient = True

    def forward(self, input_ids, labels, pixel_values, attention_mask=None):
        hidden = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True).hidden_states[-2]
        image = self.projector(hidden[:, 1:])  # CLS dropped, as LLaVA's "default" feature selection
        embed = self.language_model.get_input_embeddings()
        embeds = paddle.concat([embed(input_ids[:, :1]), image, embed(input_ids[:, 1 + NUM_IMAGE_TOKENS:])], axis=1)
        out = self.language_model(inputs_embeds=embeds, attention_mask=attention_mask, labels=labels, return_dict=True)
        return (out.loss,)


def build_model() -> TinyLlava:
    paddle.seed(0)
    return TinyLlava()


class SyntheticImageText(paddle.io.Dataset):
    """[BOS, <image> x 16, text ...]; the loss on the text only."""

    def __init__(self, num_samples: int, seed: int = 0):
        super().__init__()
        self.num_samples, self.seed = num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        rng = np.random.default_rng([self.seed, index])
        text = rng.integers(2, IMAGE_TOKEN, size=SEQ_LEN - 1 - NUM_IMAGE_TOKENS)
        ids = np.concatenate([[1], np.full(NUM_IMAGE_TOKENS, IMAGE_TOKEN), text]).astype(np.int64)
        labels = ids.copy()
        labels[: 1 + NUM_IMAGE_TOKENS] = -100
        return {"input_ids": ids, "labels": labels, "attention_mask": np.ones(SEQ_LEN, dtype=np.int64),
                "pixel_values": rng.standard_normal((3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)}
