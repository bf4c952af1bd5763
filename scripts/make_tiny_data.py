"""Make the tiny real-data fixtures under recipes/tiny/data/ (committed; run again to remake them).

    .venv/torch/bin/python scripts/make_tiny_data.py [--out recipes/tiny/data]

What it writes, all from this file alone (no download):

* ``images/*.png``: small generated pictures (gradients, stripes, discs) of different sizes and
  aspect ratios, so LLaVA-1.6's AnyRes picks different grids and Qwen2-VL different patch grids;
* ``conversations.json``: LLaVA conversation samples over those images (one and two turns, one
  sample without an image), for ``data.kind: llava_json``;
* ``images/metadata.jsonl``: a caption per image, for ``data.kind: image_captions``;
* ``tokenizers/{llava,qwen2vl,clip}/``: byte-level BPE tokenizers trained on that text with the
  ``tokenizers`` library (vocabularies small enough for the tiny presets), each with a
  tokenizer_config.json naming its special tokens; Qwen2-VL's carries a ChatML chat template.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SIZES = [(64, 40), (40, 64), (56, 56), (90, 30), (30, 84), (72, 48), (48, 48), (100, 60)]  # (width, height)
SUBJECTS = ["a red disc", "blue stripes", "a green square", "a yellow sunset", "a purple wave", "an orange sky",
            "a grey field", "a pink flower"]
QUESTIONS = ["What is in the picture?", "Describe the image briefly.", "Which colour stands out?",
             "Is there a shape in this image?"]
CHATML = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
          "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
          "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VICUNA_SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the human's questions.")


def picture(index: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(index)
    y, x = np.mgrid[0:height, 0:width]
    base = rng.integers(0, 256, size=3)
    image = np.zeros((height, width, 3), np.float64)
    for c in range(3):
        image[..., c] = (base[c] + 255 * (x / width if c % 2 else y / height)) % 256
    stripes = (x // max(1, width // 6) + y // max(1, height // 5)) % 2 == 0
    image[stripes] = 0.6 * image[stripes]
    cy, cx, r = height * rng.uniform(0.3, 0.7), width * rng.uniform(0.3, 0.7), min(width, height) / 4
    image[(y - cy) ** 2 + (x - cx) ** 2 < r * r] = rng.integers(0, 256, size=3)
    return Image.fromarray(image.astype(np.uint8))


def samples() -> list[dict]:
    out = []
    for i, subject in enumerate(SUBJECTS):
        first = [{"from": "human", "value": f"<image>\n{QUESTIONS[i % 4]}"}, {"from": "gpt", "value": f"It shows {subject}."}]
        if i % 3 == 1:
            first += [{"from": "human", "value": "Anything else?"}, {"from": "gpt", "value": "Only soft colours."}]
        out.append({"id": f"tiny-{i}", "image": f"images/{i}.png", "conversations": first})
    out.append({"id": "tiny-text", "conversations": [{"from": "human", "value": "Say hello."},
                                                     {"from": "gpt", "value": "Hello there."}]})
    return out


def train_tokenizer(corpus: list[str], specials: list[str], vocab_size: int, template: str | None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    if template:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[(t, tokenizer.token_to_id(t)) for t in specials if t in template])
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "recipes" / "tiny" / "data")
    out = parser.parse_args().out
    (out / "images").mkdir(parents=True, exist_ok=True)
    for i, (width, height) in enumerate(SIZES):
        picture(i, width, height).save(out / "images" / f"{i}.png")
    data = samples()
    (out / "conversations.json").write_text(json.dumps(data, indent=1) + "\n")
    captions = [{"file_name": f"{i}.png", "text": f"a picture of {s}"} for i, s in enumerate(SUBJECTS)]
    (out / "images" / "metadata.jsonl").write_text("".join(json.dumps(c) + "\n" for c in captions))

    words = [t["value"].replace("<image>\n", "") for s in data for t in s["conversations"]]
    corpus = [VICUNA_SYSTEM, "USER: ASSISTANT:", "You are a helpful assistant.", "system user assistant",
              *words, *(c["text"] for c in captions)] * 4
    kinds = {
        "llava": (["<unk>", "<s>", "</s>"], 496, "<s> $A",
                  {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>"}),
        "qwen2vl": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 496, None,
                    {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}),
        "clip": (["<|startoftext|>", "<|endoftext|>"], 600, "<|startoftext|> $A <|endoftext|>",
                 {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}),
    }
    for name, (specials, size, template, config) in kinds.items():
        directory = out / "tokenizers" / name
        directory.mkdir(parents=True, exist_ok=True)
        train_tokenizer(corpus, specials, size, template).save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
