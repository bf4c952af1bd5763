"""Make the tiny real-data fixtures under recipes/tiny/data/ (committed; run again to remake them).

    .venv/torch/bin/python scripts/make_tiny_data.py [--out recipes/tiny/data]

What it writes, all from this file alone (no download), the same bytes on every run:

* ``images/*.png``: 200 small pictures, each drawn from three discrete attributes: a shape (disc,
  square, triangle, stripes) in one of six colours on one of three backgrounds (4 x 6 x 3 = 72
  kinds), with a little seeded jitter of the shape's place and size, in eight sizes and aspect
  ratios from 30 x 84 to 100 x 60 pixels, so LLaVA-1.6's AnyRes picks different grids and Qwen2-VL
  different patch grids. The shape sits near the centre, so a centre crop keeps it;
* ``images/metadata.jsonl``: a caption per picture stating exactly its attributes ("a red disc on a
  white background"), for ``data.kind: image_captions``;
* ``conversations.json``: 240 LLaVA conversation samples, for ``data.kind: llava_json``: 232 over
  those pictures (one and two turns; each answer states the attributes asked for: the whole
  description, the shape, its colour or the background's) and 8 without an image (every 30th;
  the one at index 0 is in the third step of data.seed 0's order, so a 3-step parity run trains
  one). Every sample differs from every other in its picture or its text, and the jitter keeps
  them apart after the tiny recipes' crops and resizes too (checked: no two prepared samples of
  the five tiny real-data recipes are equal), so a held-out split never repeats a training sample;
* ``tokenizers/{llava,qwen2vl,clip}/``: byte-level BPE tokenizers trained on that text with the
  ``tokenizers`` library (vocabularies small enough for the tiny presets), each with a
  tokenizer_config.json naming its special tokens; Qwen2-VL's carries a ChatML chat template.

A model learns the text from the picture: the answers and captions are a function of the picture's
attributes (and the question), nothing else.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SIZES = [(64, 40), (40, 64), (56, 56), (90, 30), (30, 84), (72, 48), (48, 48), (100, 60)]  # (width, height)
SHAPES = ["disc", "square", "triangle", "stripes"]
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 230), "yellow": (240, 220, 30),
           "purple": (150, 50, 190), "orange": (250, 140, 20)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15), "grey": (128, 128, 128)}
NUM_PICTURES, NUM_CONVERSATIONS, TEXT_ONLY_EVERY = 200, 240, 30
DESCRIBE = ["What is in the picture?", "Describe the image briefly.", "What do you see?"]
ASK = {"shape": "What shape is it?", "colour": "What colour is the shape?",
       "background": "What colour is the background?"}
TEXT_ONLY = [("Say hello.", "Hello there."),
             ("Which shapes can a picture show?", "A disc, a square, a triangle or stripes."),
             ("Which colours can a shape have?", "Red, green, blue, yellow, purple or orange."),
             ("Which backgrounds are there?", "White, black or grey."), ("How many shapes are there?", "Four."),
             ("How many colours are there?", "Six."), ("How many backgrounds are there?", "Three."),
             ("Say goodbye.", "Goodbye.")]
CHATML = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
          "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
          "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VICUNA_SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the human's questions.")


def picture_kinds() -> list[tuple[int, str, str, str]]:
    """Every picture's (size index, shape, colour, background): each of the 72 kinds in turn (in a
    seeded order), its size stepping on each time round, so no two pictures share kind and size."""
    combos = list(itertools.product(SHAPES, COLOURS, BACKGROUNDS))
    order = np.random.default_rng(7).permutation(len(combos))
    out = []
    for i in range(NUM_PICTURES):
        shape, colour, background = combos[order[i % len(combos)]]
        out.append(((i + i // len(combos)) % len(SIZES), shape, colour, background))
    assert len(set(out)) == len(out)
    return out


def picture(index: int, width: int, height: int, shape: str, colour: str, background: str) -> Image.Image:
    """One flat-coloured shape near the centre of a flat background (jitter seeded by ``index``)."""
    rng = np.random.default_rng(index)
    y, x = np.mgrid[0:height, 0:width] + 0.5
    short = min(width, height)
    cx = width / 2 + short * rng.uniform(-0.06, 0.06)
    cy = height / 2 + short * rng.uniform(-0.06, 0.06)
    r = short * rng.uniform(0.36, 0.44)  # half the shape's extent
    if shape == "disc":
        mask = (x - cx) ** 2 + (y - cy) ** 2 < r * r
    elif shape == "square":
        mask = (abs(x - cx) < r * 0.85) & (abs(y - cy) < r * 0.85)
    elif shape == "triangle":  # pointing up: the width grows from the apex to the base
        top, bottom = cy - r, cy + r
        mask = (y > top) & (y < bottom) & (abs(x - cx) < (y - top) / (bottom - top) * r * 1.1)
    else:  # stripes: horizontal bands across the whole picture
        period = max(4, round(short / 4))
        mask = ((y - 0.5 + rng.integers(0, period)) // (period / 2)) % 2 == 0
    image = np.empty((height, width, 3), np.uint8)
    image[...] = BACKGROUNDS[background]
    image[mask] = COLOURS[colour]
    return Image.fromarray(image)


def caption(shape: str, colour: str, background: str) -> str:
    article = "an" if colour[0] in "aeiou" else "a"
    thing = f"{colour} stripes" if shape == "stripes" else f"{article} {colour} {shape}"
    return f"{thing} on a {background} background"


def answer(kind: str, shape: str, colour: str, background: str) -> str:
    if kind == "describe":
        text = caption(shape, colour, background)
    elif kind == "shape":
        text = "stripes" if shape == "stripes" else f"a {shape}"
    else:
        text = colour if kind == "colour" else background
    return text[0].upper() + text[1:] + "."


def samples(pictures: list[tuple[int, str, str, str]]) -> list[dict]:
    """NUM_CONVERSATIONS samples: every TEXT_ONLY_EVERY-th one without an image, the others over the
    pictures in turn (the first few pictures twice). Each asks, in a seeded draw, for the whole
    description (half of them) or one attribute, and a third add a second turn asking for another
    attribute; a picture's second sample is drawn again until it differs from its first."""
    rng = np.random.default_rng(11)
    out, seen, text_only, k = [], set(), iter(TEXT_ONLY), 0
    for i in range(NUM_CONVERSATIONS):
        if i % TEXT_ONLY_EVERY == 0:
            question, reply = next(text_only)
            out.append({"id": f"tiny-text-{i // TEXT_ONLY_EVERY}", "conversations": [
                {"from": "human", "value": question}, {"from": "gpt", "value": reply}]})
            continue
        p = k % len(pictures)
        _, *attributes = pictures[p]
        turns = None
        while turns is None or (p, json.dumps(turns)) in seen:
            first = str(rng.choice(["describe"] * 3 + list(ASK)))
            question = DESCRIBE[rng.integers(len(DESCRIBE))] if first == "describe" else ASK[first]
            turns = [{"from": "human", "value": f"<image>\n{question}"},
                     {"from": "gpt", "value": answer(first, *attributes)}]
            if rng.random() < 1 / 3:
                second = str(rng.choice([a for a in ASK if a != first]))
                turns += [{"from": "human", "value": ASK[second]},
                          {"from": "gpt", "value": answer(second, *attributes)}]
        seen.add((p, json.dumps(turns)))
        out.append({"id": f"tiny-{i}", "image": f"images/{p}.png", "conversations": turns})
        k += 1
    content = [(s.get("image"), json.dumps(s["conversations"])) for s in out]
    assert len(set(content)) == len(content), "two samples alike"
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
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    for stale in images.glob("*.png"):  # a remake with fewer pictures leaves none behind
        stale.unlink()
    pictures = picture_kinds()
    for i, (size, *attributes) in enumerate(pictures):
        picture(i, *SIZES[size], *attributes).save(images / f"{i}.png", optimize=True)
    data = samples(pictures)
    (out / "conversations.json").write_text(json.dumps(data, indent=1) + "\n")
    captions = [{"file_name": f"{i}.png", "text": caption(*attributes)} for i, (_, *attributes) in enumerate(pictures)]
    (images / "metadata.jsonl").write_text("".join(json.dumps(c) + "\n" for c in captions))

    words = [t["value"].replace("<image>\n", "") for s in data for t in s["conversations"]]
    # The templates' words come with every sample: weighted so, they merge into few tokens.
    corpus = [VICUNA_SYSTEM, "USER: ASSISTANT:", "You are a helpful assistant.", "system user assistant"] * len(data)
    corpus += [*words, *(c["text"] for c in captions)]
    tokenizers = {
        "llava": (["<unk>", "<s>", "</s>"], 496, "<s> $A",
                  {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>"}),
        "qwen2vl": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 496, None,
                    {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}),
        "clip": (["<|startoftext|>", "<|endoftext|>"], 600, "<|startoftext|> $A <|endoftext|>",
                 {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}),
    }
    for name, (specials, size, template, config) in tokenizers.items():
        directory = out / "tokenizers" / name
        directory.mkdir(parents=True, exist_ok=True)
        train_tokenizer(corpus, specials, size, template).save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    print(f"wrote {out}: {len(pictures)} pictures and captions, {len(data)} conversations")


if __name__ == "__main__":
    main()
