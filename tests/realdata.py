"""Tiny real data made by the tests themselves: a word-level tokenizer built with ``tokenizers``,
a few generated pictures, a LLaVA conversation JSON and an image-folder metadata.jsonl.

    paths = make_llava_data(tmp_path)        # {"json", "images", "tokenizer"}
    recipe = llava_json_recipe(paths, tmp_path / "cache", seq_len=128)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VICUNA = ("A chat between a curious human and an artificial intelligence assistant. The assistant gives helpful, "
          "detailed, and polite answers to the human's questions. USER: ASSISTANT: system user assistant "
          "You are a helpful assistant. a picture of")
SAMPLES = [
    ("0.png", (40, 64), "What is shown?", "A red disc."),
    ("1.png", (64, 40), "Which colour?", "Mostly blue."),
    ("2.png", (56, 56), "Describe it.", "Green squares on grey."),
    (None, None, "Say hello.", "Hello there."),
]


def make_tokenizer(directory: Path, corpus: str, *, specials=("<unk>", "<s>", "</s>"), bos: str | None = "<s>",
                   config: dict | None = None) -> Path:
    """A word-level tokenizer over ``corpus``'s words and punctuation, the specials first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(specials)}
    for piece, _ in pre_tokenizers.Whitespace().pre_tokenize_str(corpus):
        vocab.setdefault(piece, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(specials))
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config or {"bos_token": "<s>", "eos_token": "</s>"}))
    return directory


def picture(path: Path, size: tuple[int, int], seed: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)


def make_llava_data(root: Path, samples=SAMPLES) -> dict:
    """A conversation JSON over generated pictures, and a tokenizer that knows every word in it."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    records, words = [], VICUNA
    for i, (name, size, question, answer) in enumerate(samples):
        record = {"id": f"s{i}", "conversations": [{"from": "human", "value": ("<image>\n" if name else "") + question},
                                                   {"from": "gpt", "value": answer}]}
        if name:
            picture(root / "images" / name, size, i)
            record["image"] = f"images/{name}"
        records.append(record)
        words += f" {question} {answer}"
    (root / "data.json").write_text(json.dumps(records))
    return {"json": root / "data.json", "images": root / "images", "tokenizer": make_tokenizer(root / "tok", words)}


def make_captions(root: Path, count: int = 4) -> dict:
    (root / "pics").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        picture(root / "pics" / f"{i}.png", (40 + 8 * i, 48), i)
        lines.append(json.dumps({"file_name": f"{i}.png", "text": f"a picture of thing {i}"}))
    (root / "pics" / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    words = "a picture of thing " + " ".join(str(i) for i in range(count))
    tokenizer = make_tokenizer(root / "clip", words, specials=("<|startoftext|>", "<|endoftext|>"),
                               bos=None, config={"pad_token": "<|endoftext|>"})
    return {"jsonl": root / "pics" / "metadata.jsonl", "tokenizer": tokenizer}


def llava_json_recipe(paths: dict, cache: Path, **data) -> dict:
    """Sections for conftest's TINY_RECIPE (tiny-llava SFT) reading ``paths``' data."""
    return {"data": {"kind": "llava_json", "path": str(paths["json"]), "tokenizer": str(paths["tokenizer"]),
                     "seq_len": 128, "cache": str(cache), **data}}
