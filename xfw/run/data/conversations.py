"""``data.kind: llava_json``: LLaVA's conversation format, for LLaVA and Qwen2-VL models.

The data file is a JSON list of samples (LLaVA's and PaddleMIX's format; ScienceQA and ChartQA
exports come this way)::

    [{"id": "sqa-1", "image": "images/1.png",
      "conversations": [{"from": "human", "value": "<image>\\nWhich is bigger?"},
                        {"from": "gpt", "value": "The left one."}]}, ...]

``image`` is a path relative to ``data.image_root`` (default: the file's directory), a list of
them, or absent (a text-only sample); the conversation holds one ``<image>`` per image. Each
sample is prepared for the model's family:

* LLaVA: each ``<image>`` becomes the image's tokens, ``image_token_id`` repeated: one CLIP tile
  (square mode, the preset without ``anyres``) or LLaVA-1.6's AnyRes base tile + unpadded grid;
  ``pixel_values`` holds its tiles.
* Qwen2-VL: each ``<image>`` becomes ``<|vision_start|>`` + one ``<|image_pad|>`` per merged 2x2
  patch + ``<|vision_end|>``; ``images`` holds the resized image, ``image_grid_thw`` its grid.

Text follows ``data.template`` (``xfw.run.data.text``) and is cut at ``data.seq_len`` (never into
an image) when ``data.truncation`` is on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from xfw.contract.families import llava as llava_facts
from xfw.run.data.files import DataError, file_digest, image_path, is_text, leaves_root
from xfw.run.data import images as img
from xfw.run.data import text as txt
from xfw.run.data.cache import CacheWriter

QWEN_SPECIALS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass
class Plan:
    recipe: object
    arch: dict
    path: Path
    records: list
    image_root: Path
    tokenizer: txt.Tokenizer
    template: str
    images: list[list[Path]] = field(default_factory=list)
    fingerprints: dict = field(default_factory=dict)

    outside_root: int = 0
    """Images read through a symbolic link that leads outside the image root (in the statistics)."""

    def where(self, i: int) -> str:
        sample_id = self.records[i].get("id") if isinstance(self.records[i], dict) else None
        if not (is_text(sample_id) or type(sample_id) is int):
            return f"data.path: {self.path}: sample #{i}"
        return f"data.path: {self.path}: sample #{i} (id {str(sample_id)[:80]!r})"


def load_tokenizer(directory: str | None, arch: dict) -> tuple[txt.Tokenizer, dict]:
    """The tokenizer directory's tokenizer, checked against the model's vocabulary, and its files' digests."""
    if not directory:
        raise DataError("data.tokenizer: is required for this data")
    where = Path(directory)
    if not (where / "tokenizer.json").is_file():
        raise DataError(f"data.tokenizer: {where}: no tokenizer.json there (a Hugging Face tokenizer directory)")
    try:
        tokenizer = txt.Tokenizer.load(where)
    except Exception as err:  # noqa: BLE001 - tokenizers raises its own exception types
        raise DataError(f"data.tokenizer: {where}: cannot load ({str(err).splitlines()[0][:200]})") from None
    vocab = arch["text"]["vocab_size"]
    if tokenizer.vocab_size > vocab:
        raise DataError(f"data.tokenizer: {where / 'tokenizer.json'} holds {tokenizer.vocab_size} tokens, more than "
                        f"the model's vocabulary of {vocab} (model.arch.text.vocab_size)")
    digests = {name: file_digest(where / name) for name in ("tokenizer.json", "tokenizer_config.json")
               if (where / name).is_file()}
    return tokenizer, digests


def _image_paths(record, i: int, plan: Plan) -> list[Path]:
    value = record.get("image")
    names = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise DataError(f"{plan.where(i)}: 'image' must be a path or a list of paths, got {repr(value)[:80]}")
    paths = []
    for name in names:
        try:
            found = image_path(plan.image_root, name)
        except ValueError as err:
            raise DataError(f"{plan.where(i)}: image {name!r} {err}") from None
        if not found.is_file():
            raise DataError(f"{plan.where(i)}: image {name!r} not found under {plan.image_root}")
        plan.outside_root += leaves_root(plan.image_root, found)
        paths.append(found)
    return paths


def plan(recipe, arch: dict) -> Plan:
    """Read the file and check every sample that can be checked without preprocessing; fingerprint
    the data file, every image and the tokenizer."""
    data = recipe.data
    path = Path(data.path)
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DataError(f"data.path: {path}: not a readable JSON file ({str(err)[:200]})") from None
    except RecursionError:
        raise DataError(f"data.path: {path}: nested too deep to be LLaVA conversations") from None
    if not isinstance(records, list):
        raise DataError(f"data.path: {path}: must hold a JSON list of samples, got {type(records).__name__}")
    records = records[: data.max_samples] if data.max_samples else records
    if not records:
        raise DataError(f"data.path: {path}: holds no samples")
    tokenizer, tokenizer_digests = load_tokenizer(data.tokenizer, arch)
    image_root = Path(data.image_root) if data.image_root else path.parent
    if not image_root.is_dir():
        raise DataError(f"data.image_root: {image_root}: no such directory")
    template = txt.choose_template(data.template, arch["family"], recipe.stage, tokenizer)
    if template == "tokenizer" and not isinstance(tokenizer.config.get("chat_template"), str):
        raise DataError(f"data.template: tokenizer, but {Path(data.tokenizer) / 'tokenizer_config.json'} has no chat_template")
    if template == "tokenizer":
        try:
            txt.bounded.compile_chat_template(tokenizer.config["chat_template"], fail=txt.TemplateError)
        except txt.TemplateError as err:
            raise DataError(f"data.tokenizer: {Path(data.tokenizer) / 'tokenizer_config.json'}: {err}") from None
    result = Plan(recipe=recipe, arch=arch, path=path, records=records, image_root=image_root, tokenizer=tokenizer,
                  template=template)
    digest = hashlib.sha256()
    for i, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
            raise DataError(f"{result.where(i)}: must be an object with a 'conversations' list")
        paths = _image_paths(record, i, result)
        try:
            turns = txt.roles(record["conversations"])
        except txt.TemplateError as err:
            raise DataError(f"{result.where(i)}: {err}") from None
        bad = next((k for k, (_, value) in enumerate(turns) if not is_text(value)), None)
        if bad is not None:
            raise DataError(f"{result.where(i)}: turn {bad} holds a lone surrogate (e.g. \\ud800), not text")
        marks = sum(value.count(txt.IMAGE) for _, value in turns)
        if marks != len(paths):
            raise DataError(f"{result.where(i)}: {marks} '<image>' in its conversation but {len(paths)} image(s)")
        result.images.append(paths)
        for p in paths:
            digest.update(f"{p.relative_to(image_root) if p.is_relative_to(image_root) else p}:{file_digest(p)}\n".encode())
    result.fingerprints = {"data": file_digest(path), "images": digest.hexdigest(), "tokenizer": tokenizer_digests,
                           "template": template}
    return result


# -- one sample per family ---------------------------------------------------------------------------

def _llava_images(plan: Plan, paths: list[Path]) -> tuple[dict, list[list[int]]]:
    arch = plan.arch
    tile = arch["vision"]["image_size"]
    pixels, tiles, sizes, token_ids = [], [], [], []
    for p in paths:
        image = img.load_rgb(p)
        hw = (image.size[1], image.size[0])
        if arch.get("anyres"):
            best = llava_facts.select_best_resolution(hw, [list(x) for x in arch["anyres"]["grid_pinpoints"]])
            layout = llava_facts.anyres_layout(arch, hw)
            pixels.append(img.anyres_tiles(image, tile, best))
            tiles.append(layout["tiles"])
            sizes.append(hw)
        else:
            pixels.append(img.clip_image(image, tile)[None])
        token_ids.append([arch["image_token_id"]] * llava_facts.image_tokens_for(arch, hw))
    stored = {"pixel_values": np.concatenate(pixels) if pixels else np.zeros((0, 3, tile, tile), np.float32)}
    if arch.get("anyres"):
        stored["tiles"] = np.asarray(tiles, np.int64)
        stored["image_sizes"] = np.asarray(sizes, np.int64).reshape(-1, 2)
    return stored, token_ids


def _qwen2vl_images(plan: Plan, paths: list[Path]) -> tuple[dict, list[list[int]]]:
    arch, data = plan.arch, plan.recipe.data
    v = arch["vision"]
    patch, merge = v["patch_size"], v["spatial_merge_size"]
    flat, grids, token_ids = [], [], []
    for p in paths:
        resized = img.qwen2vl_image(img.load_rgb(p), factor=patch * merge, min_pixels=data.min_pixels,
                                    max_pixels=data.max_pixels, max_side=data.max_image_side)
        gh, gw = resized.shape[1] // patch, resized.shape[2] // patch
        flat.append(resized.ravel())
        grids.append((1, gh, gw))
        token_ids.append([arch["vision_start_token_id"]] + [arch["image_token_id"]] * (gh // merge) * (gw // merge)
                         + [arch["vision_end_token_id"]])
    stored = {"images": np.concatenate(flat) if flat else np.zeros(0, np.float32),
              "image_grid_thw": np.asarray(grids, np.int64).reshape(-1, 3)}
    return stored, token_ids


def _special_ids(arch: dict) -> set[int]:
    if arch["family"] == "llava":
        return {arch["image_token_id"]}
    return {arch[k] for k in QWEN_SPECIALS}


def prepare_sample(plan: Plan, i: int) -> tuple[dict, dict]:
    """(stored fields, facts for the statistics) of sample ``i``; DataError names it."""
    arch, data = plan.arch, plan.recipe.data
    paths = plan.images[i]
    try:
        stored, image_ids = (_llava_images if arch["family"] == "llava" else _qwen2vl_images)(plan, paths)
    except (OSError, ValueError) as err:
        raise DataError(f"{plan.where(i)}: cannot preprocess its image ({err})") from None
    turns = txt.roles(plan.records[i]["conversations"])
    try:
        ids, labels, _ = txt.encode(plan.tokenizer, turns, plan.template, lambda k: image_ids[k])
    except txt.TemplateError as err:
        raise DataError(f"{plan.where(i)}: {err}") from None
    special = _special_ids(arch)
    image_positions = {pos for pos, token in enumerate(ids) if token in special}
    expected = sum(len(t) for t in image_ids)
    if len(image_positions) != expected:  # a text token took an image id: the model could not tell them apart
        raise DataError(f"{plan.where(i)}: its text tokenizes to the model's image token ids {sorted(special)}; "
                        f"choose other ids (model.arch) or a tokenizer without them")
    cap, truncated = arch["data"]["seq_len"], False
    if len(ids) > cap:
        if not data.truncation:
            raise DataError(f"{plan.where(i)}: {len(ids)} tokens, more than data.seq_len {cap} "
                            f"(data.truncation is off)")
        last_image = max(image_positions, default=-1)
        if last_image >= cap:
            raise DataError(f"{plan.where(i)}: its image tokens reach position {last_image}, past data.seq_len {cap}")
        ids, labels, truncated = ids[:cap], labels[:cap], True
    answer = sum(1 for label in labels if label != txt.IGNORE_INDEX)
    if not answer:
        raise DataError(f"{plan.where(i)}: no answer token left to train on"
                        + (f" within data.seq_len {cap}" if truncated else ""))
    stored = {"input_ids": np.asarray(ids, np.int64), "labels": np.asarray(labels, np.int64), **stored}
    return stored, {"length": len(ids), "images": len(paths), "image_tokens": expected, "answer": answer,
                    "truncated": truncated}


def build(plan: Plan, directory: Path) -> dict:
    """Prepare every sample into ``directory`` (atomically); returns its index."""
    writer = CacheWriter(directory)
    facts = []
    try:
        for i in range(len(plan.records)):
            stored, fact = prepare_sample(plan, i)
            writer.add(stored)
            facts.append(fact)
    except BaseException:
        writer.abandon()
        raise
    lengths = [f["length"] for f in facts]
    stats = {"num_samples": len(facts), "num_images": sum(f["images"] for f in facts),
             "samples_without_image": sum(1 for f in facts if not f["images"]),
             "mean_seq_len": float(np.mean(lengths)), "max_seq_len": int(max(lengths)), "min_seq_len": int(min(lengths)),
             "mean_image_tokens": float(np.mean([f["image_tokens"] for f in facts])),
             "mean_answer_tokens": float(np.mean([f["answer"] for f in facts])),
             "truncated": sum(1 for f in facts if f["truncated"]), "template": plan.template,
             "images_outside_root": plan.outside_root}
    writer.finish({"family": plan.arch["family"], "kind": "llava_json", "source": str(plan.path), "stats": stats})
    return {"stats": stats}
