"""``data.kind: image_captions``: an image folder with captions, for SD1.5 and SD3.

The Hugging Face image-folder convention: ``metadata.jsonl`` with one ``{"file_name", "text"}``
per line, the file names relative to ``data.image_root`` (default: the metadata file's
directory). Each image is resized (shorter side to ``data.image_size``, ``data.interpolation``),
centre-cropped and scaled to [-1, 1] (``xfw.run.data.images.sd_image``). The caption:

* SD1.5: its CLIP token ids from ``data.tokenizer`` (BOS and EOS as the tokenizer adds them),
  cut to the text encoder's ``max_length`` keeping the last (EOS), padded with the pad token;
  the text encoder runs in the step, as in the training scripts.
* SD3: the text encoders are no part of the trained system (the scripts precompute the embeddings
  once), so a digest of the caption seeds its stand-in embeddings
  (``xfw.contract.families.sd3.from_prepared``); no tokenizer is needed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from xfw.run.data.files import DataError, file_digest, image_path, is_text, leaves_root
from xfw.run.data import images as img
from xfw.run.data.cache import CacheWriter
from xfw.run.data.conversations import load_tokenizer


@dataclass
class Plan:
    recipe: object
    arch: dict
    path: Path
    lines: list[dict]
    numbers: list[int]
    image_root: Path
    tokenizer: object = None
    fingerprints: dict = field(default_factory=dict)
    outside_root: int = 0
    """Images read through a symbolic link that leads outside the image root (in the statistics)."""

    def where(self, i: int) -> str:
        return f"data.path: {self.path}: line {self.numbers[i]}"


def plan(recipe, arch: dict) -> Plan:
    data = recipe.data
    path = Path(data.path)
    image_root = Path(data.image_root) if data.image_root else path.parent
    if not image_root.is_dir():
        raise DataError(f"data.image_root: {image_root}: no such directory")
    lines, numbers = [], []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"data.path: {path}: cannot read ({err})") from None
    # JSON lines end at \n only: str.splitlines would also split at U+2028, U+0085, \x0c, ... inside a caption
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            raise DataError(f"data.path: {path}: line {number} is not JSON") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("file_name"), str) or not isinstance(entry.get("text"), str):
            raise DataError(f'data.path: {path}: line {number} must be {{"file_name": "...", "text": "..."}}')
        if not is_text(entry["text"]) or not is_text(entry["file_name"]):
            raise DataError(f"data.path: {path}: line {number} holds a lone surrogate (e.g. \\ud800), not text")
        lines.append(entry)
        numbers.append(number)
        if data.max_samples and len(lines) == data.max_samples:
            break
    if not lines:
        raise DataError(f"data.path: {path}: holds no samples")
    result = Plan(recipe=recipe, arch=arch, path=path, lines=lines, numbers=numbers, image_root=image_root)
    tokenizer_digests = {}
    if arch["family"] == "sd15":
        result.tokenizer, tokenizer_digests = load_tokenizer(data.tokenizer, arch)
    digest = hashlib.sha256()
    for i, entry in enumerate(lines):
        try:
            image = image_path(image_root, entry["file_name"])
        except ValueError as err:
            raise DataError(f"{result.where(i)}: image {entry['file_name']!r} {err}") from None
        if not image.is_file():
            raise DataError(f"{result.where(i)}: image {entry['file_name']!r} not found under {image_root}")
        result.outside_root += leaves_root(image_root, image)
        digest.update(f"{entry['file_name']}:{file_digest(image)}\n".encode())
    result.fingerprints = {"data": file_digest(path), "images": digest.hexdigest(), "tokenizer": tokenizer_digests}
    return result


def clip_ids(plan: Plan, text: str, i: int) -> np.ndarray:
    """The caption's CLIP ids, exactly the text encoder's ``max_length`` long."""
    length = plan.arch["text"]["max_length"]
    tokenizer = plan.tokenizer
    ids, _ = tokenizer.encode(text, first=True)
    if len(ids) > length:
        ids = ids[: length - 1] + ids[-1:]  # keep the closing EOS, as truncating with special tokens does
    pad_name = tokenizer.special("pad_token") or tokenizer.special("eos_token") or "<|endoftext|>"
    pad = tokenizer.token_id(pad_name)
    if pad is None:
        raise DataError(f"data.tokenizer: {tokenizer.directory}: no pad token {pad_name!r} in its vocabulary")
    return np.asarray(ids + [pad] * (length - len(ids)), np.int64)


def build(plan: Plan, directory: Path) -> dict:
    data, arch = plan.recipe.data, plan.arch
    writer = CacheWriter(directory)
    try:
        for i, entry in enumerate(plan.lines):
            try:
                pixels = img.sd_image(img.load_rgb(image_path(plan.image_root, entry["file_name"])), arch["data"]["image_size"],
                                      data.interpolation)
            except (OSError, ValueError) as err:
                raise DataError(f"{plan.where(i)}: cannot preprocess image {entry['file_name']!r} ({err})") from None
            stored = {"pixel_values": pixels}
            if arch["family"] == "sd15":
                stored["input_ids"] = clip_ids(plan, entry["text"], i)
            else:
                seed = int.from_bytes(hashlib.sha256(entry["text"].encode()).digest()[:8], "little") >> 1
                stored["text_seed"] = np.asarray(seed, np.int64)
            writer.add(stored)
    except BaseException:
        writer.abandon()
        raise
    stats = {"num_samples": len(plan.lines), "num_images": len(plan.lines), "max_seq_len": 0,
             "distinct_captions": len({e["text"] for e in plan.lines}), "images_outside_root": plan.outside_root}
    writer.finish({"family": arch["family"], "kind": "image_captions", "source": str(plan.path), "stats": stats})
    return {"stats": stats}
