"""LLaVA (CLIP ViT vision tower + 2-layer projector + Llama): checks, data, and the model's facts.

The facts both adapters and the report layer read (see ``xfw.contract.families``): the parts by
transformers' parameter names, what each stage trains, where LoRA goes, parameter counts,
FLOPs and activation bytes::

    >>> arch = xfw.contract.presets.resolve_arch("tiny-llava", {}, None, None)
    >>> num_image_tokens(arch, 56), count_params(arch)["total"], STAGE_PARTS["pretrain"]
    (16, 190656, ('projector', 'newline'))

With AnyRes (LLaVA-1.6) the learned ``image_newline`` vector, which joins the projected image
features, trains with the projector in every stage, pretrain included.
"""

from __future__ import annotations

import numpy as np

from xfw.contract.families import decoder, flops
from xfw.contract.families import ArchError

IGNORE_INDEX = -100
BOS_ID = 1
FIRST_TEXT_ID = 2  # ids 0 and 1 are pad and BOS

# Parts by prefix of transformers' parameter names (LlavaForConditionalGeneration and
# LlavaNextForConditionalGeneration, transformers >= 4.52 layout); "newline" exists with AnyRes only.
PARTS = {
    "vision": ("model.vision_tower.",),
    "projector": ("model.multi_modal_projector.",),
    "newline": ("model.image_newline",),
    "text": ("model.language_model.", "lm_head."),
}
# What each stage trains; the vision tower is always frozen. Stage lora adds adapters on LORA_MODULE.
STAGE_PARTS = {
    "pretrain": ("projector", "newline"),
    "sft": ("projector", "newline", "text"),
    "lora": ("projector", "newline"),
}
LORA_MODULE = "model.language_model"  # the decoder, without lm_head
LORA_TARGETS = decoder.DECODER_LINEARS


def pad_id(arch: dict) -> int:
    """The id padding positions carry: 0 (LLaVA pads with Llama's <unk>), or 1 where 0 is the image
    placeholder. Padding is masked out of attention and loss, so only its difference from the
    image token matters (transformers finds image positions by id)."""
    return 1 if arch["image_token_id"] == 0 else 0


# Keys whose length varies per sample (xfw.contract.families.collate): the sequence, and with AnyRes
# the tiles of each image (an image's grid depends on its size).
PAD = {"input_ids": (1, pad_id), "labels": (1, IGNORE_INDEX), "attention_mask": (1, 0), "pixel_values": (1, 0.0)}


def fixed_tokens(arch: dict) -> int:
    """Positions of a synthetic sample that are not text: BOS and the image tokens."""
    return 1 + num_image_tokens(arch, arch["data"]["image_size"])


def select_best_resolution(image_hw: tuple[int, int], pinpoints: list) -> tuple[int, int]:
    """The grid pinpoint (height, width) an image of ``image_hw`` is resized to (LLaVA-1.6, and
    transformers' ``select_best_resolution``): the most effective resolution kept after downscaling,
    ties broken by the least wasted area."""
    height, width = image_hw
    best, best_effective, best_wasted = None, 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = ph * pw - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (ph, pw), effective, wasted
    return best


def anyres_layout(arch: dict, image_hw: tuple[int, int]) -> dict:
    """Where an image of (height, width) lands with AnyRes (LLaVA-1.6's "spatial_unpad"): its tile
    grid, and the rows and columns of the grid's patch map kept once the padding the resize added
    is cut away again (transformers' ``unpad_image``)::

        {"rows": R, "cols": C, "tiles": 1 + R*C, "keep_rows": (r0, r1), "keep_cols": (c0, c1),
         "tokens": g*g + (r1 - r0) * (c1 - c0 + 1)}      # base tile, then each kept row + newline
    """
    v = arch["vision"]
    tile, g = v["image_size"], v["image_size"] // v["patch_size"]
    height, width = image_hw
    best_h, best_w = select_best_resolution((height, width), [list(p) for p in arch["anyres"]["grid_pinpoints"]])
    rows, cols = -(-best_h // tile), -(-best_w // tile)
    cur_h, cur_w = rows * g, cols * g
    keep_rows, keep_cols = (0, cur_h), (0, cur_w)
    if width / height > cur_w / cur_h:
        padding = (cur_h - int(round(height * (cur_w / width), 7))) // 2
        keep_rows = (padding, cur_h - padding)
    else:
        padding = (cur_w - int(round(width * (cur_h / height), 7))) // 2
        keep_cols = (padding, cur_w - padding)
    newline = 1 if arch["anyres"]["image_newline"] else 0
    tokens = g * g + (keep_rows[1] - keep_rows[0]) * (keep_cols[1] - keep_cols[0] + newline)
    return {"rows": rows, "cols": cols, "tiles": 1 + rows * cols, "keep_rows": keep_rows, "keep_cols": keep_cols,
            "tokens": tokens}


def image_tokens_for(arch: dict, image_hw: tuple[int, int]) -> int:
    """Image tokens one image of (height, width) puts in the sequence: one tile's patches, or with
    AnyRes the base tile plus its unpadded grid (:func:`anyres_layout`)."""
    if arch.get("anyres"):
        return anyres_layout(arch, image_hw)["tokens"]
    return num_image_tokens(arch, arch["vision"]["image_size"])


def num_tiles(arch: dict) -> int:
    """Vision-tower passes per image: 1, or with AnyRes the base tile plus the grid's tiles."""
    if not arch.get("anyres"):
        return 1
    height, width = arch["data"]["anyres_image_hw"]
    tile = arch["vision"]["image_size"]
    return 1 + (height // tile) * (width // tile)


def num_image_tokens(arch: dict, image_size: int) -> int:
    """Image tokens in the language sequence for one image.

    Single tile: one token per patch (plus CLS unless dropped). AnyRes (LLaVA-1.6): the base
    tile's tokens, then the grid's patch rows each followed by one image-newline token. The
    synthetic image is exactly one of the grid pinpoints, so no padding is removed.
    """
    vision = arch["vision"]
    per_tile = (image_size // vision["patch_size"]) ** 2 + (0 if vision["drop_cls"] else 1)
    if not arch.get("anyres"):
        return per_tile
    height, width = arch["data"]["anyres_image_hw"]
    rows, cols = height // vision["patch_size"], width // vision["patch_size"]
    return per_tile + rows * (cols + (1 if arch["anyres"]["image_newline"] else 0))


def check(arch: dict) -> None:
    vision, text, data = arch["vision"], arch["text"], arch["data"]
    for part, cfg in (("vision", vision), ("text", text)):
        if cfg["hidden_size"] % cfg["num_heads"]:
            raise ArchError(f"model.arch.{part}.num_heads",
                            f"{cfg['num_heads']} does not divide hidden_size {cfg['hidden_size']}")
    if text["num_heads"] % text["num_kv_heads"]:
        raise ArchError("model.arch.text.num_kv_heads",
                        f"{text['num_kv_heads']} does not divide num_heads {text['num_heads']}")
    if data["image_size"] != vision["image_size"]:
        raise ArchError("data.image_size", f"{data['image_size']} differs from the vision tower's input "
                        f"(model.arch.vision.image_size = {vision['image_size']}); set both")
    if data["image_size"] % vision["patch_size"]:
        raise ArchError("data.image_size", f"{data['image_size']} is not a multiple of patch_size {vision['patch_size']}")
    if not 0 <= arch["image_token_id"] < text["vocab_size"]:
        raise ArchError("model.arch.image_token_id", f"{arch['image_token_id']} is outside the vocabulary")
    if not -vision["num_layers"] <= vision["feature_layer"] < 0:
        raise ArchError("model.arch.vision.feature_layer", f"must be in [-num_layers, -1], got {vision['feature_layer']}")
    if arch.get("anyres"):
        pinpoints = [list(p) for p in arch["anyres"]["grid_pinpoints"]]
        if list(data.get("anyres_image_hw") or []) not in pinpoints:
            raise ArchError("model.arch.data.anyres_image_hw",
                            f"{data.get('anyres_image_hw')} must be one of the grid pinpoints {pinpoints}")
    needed = num_image_tokens(arch, data["image_size"]) + 2  # BOS + image + at least one text token
    if data["seq_len"] < needed:
        raise ArchError("data.seq_len", f"{data['seq_len']} leaves no room for text after "
                        f"{needed - 2} image tokens (need at least {needed})")
    if data["seq_len"] > text["max_position_embeddings"]:
        raise ArchError("data.seq_len", f"{data['seq_len']} exceeds max_position_embeddings {text['max_position_embeddings']}")



def make_batch(arch: dict, micro: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One micro-batch: [BOS, <image> x N, text...]; loss on the text tokens only."""
    image_size, seq_len = arch["data"]["image_size"], arch["data"]["seq_len"]
    num_image = num_image_tokens(arch, image_size)
    image_id, vocab = arch["image_token_id"], arch["text"]["vocab_size"]
    # Already-normalised pixels, as a CLIP image processor would hand them over.
    tiles = num_tiles(arch)
    shape = (micro, tiles, 3, image_size, image_size) if arch.get("anyres") else (micro, 3, image_size, image_size)
    pixel_values = rng.standard_normal(shape, dtype=np.float32)
    text = rng.integers(FIRST_TEXT_ID, vocab - 1, size=(micro, seq_len - 1 - num_image), dtype=np.int64)
    text[text >= image_id] += 1  # never draw the image token as text
    input_ids = np.concatenate(
        [np.full((micro, 1), BOS_ID, np.int64), np.full((micro, num_image), image_id, np.int64), text], axis=1)
    labels = input_ids.copy()
    labels[:, : 1 + num_image] = IGNORE_INDEX
    batch = {
        "pixel_values": pixel_values,
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": np.ones_like(input_ids),
    }
    if arch.get("anyres"):
        batch["image_sizes"] = np.tile(np.asarray(arch["data"]["anyres_image_hw"], np.int64), (micro, 1))
    return batch


def from_prepared(arch: dict, stored: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A prepared sample (``xfw.run.data``: ``input_ids``, ``labels``, ``pixel_values`` of all its
    images, with AnyRes ``tiles`` and ``image_sizes`` per image) as a batch of one, in the layout
    :func:`make_batch` gives: pixel values ``[images, 3, S, S]``, or with AnyRes
    ``[images, tiles, 3, S, S]`` zero-padded to the sample's largest grid."""
    ids = stored["input_ids"].astype(np.int64)[None]
    batch = {"input_ids": ids, "labels": stored["labels"].astype(np.int64)[None], "attention_mask": np.ones_like(ids)}
    pixels = np.asarray(stored["pixel_values"], dtype=np.float32)
    if arch.get("anyres"):
        tiles = [int(t) for t in stored["tiles"]]
        packed = np.zeros((len(tiles), max(tiles, default=1), *pixels.shape[1:]), np.float32)
        for i, (start, count) in enumerate(zip(np.cumsum([0, *tiles[:-1]]), tiles)):
            packed[i, :count] = pixels[start:start + count]
        batch["pixel_values"] = packed
        batch["image_sizes"] = stored["image_sizes"].astype(np.int64).reshape(-1, 2)
    else:
        batch["pixel_values"] = pixels
    return batch


def count_params(arch: dict) -> dict[str, int]:
    """Analytic parameter counts per part (transformers' LlavaForConditionalGeneration layout)."""
    v, t = arch["vision"], arch["text"]
    h, f = v["hidden_size"], v["intermediate_size"]
    num_positions = (v["image_size"] // v["patch_size"]) ** 2 + 1
    vision = (h * 3 * v["patch_size"] ** 2  # patch conv, no bias
              + h + num_positions * h  # class embedding, position embedding
              + 2 * h * 2  # pre- and post-layernorm
              + v["num_layers"] * (4 * (h * h + h) + 2 * 2 * h + (h * f + f) + (f * h + h)))
    th, tf = t["hidden_size"], t["intermediate_size"]
    kv = th // t["num_heads"] * t["num_kv_heads"]
    text = (t["vocab_size"] * th
            + t["num_layers"] * (2 * th * th + 2 * th * kv + 3 * th * tf + 2 * th)
            + th
            + (0 if t["tie_word_embeddings"] else t["vocab_size"] * th))
    projector = h * th + th + th * th + th
    newline = th if arch.get("anyres") and arch["anyres"].get("image_newline") else 0
    return {"vision": vision, "projector": projector, "newline": newline, "text": text,
            "total": vision + projector + newline + text}



def lora_linears(arch: dict) -> dict[str, list[tuple[int, int]]]:
    """(in, out) of every linear under LORA_MODULE that each LoRA target name matches."""
    return decoder.decoder_lora_linears(arch["text"])


def flop_ledger(arch: dict, trained: tuple[str, ...], lora: dict | None, recompute: bool) -> list[flops.Matmul]:
    """Every product of one sample's step (``xfw.contract.families.flops``) when the parts ``trained``
    train: each tile through the vision tower (all its layers run, the feature layer's successors
    included: transformers collects the hidden states of a full pass; frozen unless a recipe's
    ``model.trainable`` names it) and the projector (the CLS token dropped first), then the language
    model over the whole sequence. Where the projector trains (every stage's default) a gradient
    reaches the language model's input; its first linear, fed by a frozen tower, computes no input
    gradient."""
    v, t = arch["vision"], arch["text"]
    patches = (v["image_size"] // v["patch_size"]) ** 2
    tokens = patches + (0 if v["drop_cls"] else 1)
    sees = "vision" in trained
    tower = [flops.conv("vision", patches, v["patch_size"] ** 2, 3, v["hidden_size"], trains=sees, grad_in=False),
             *decoder.vit_ledger("vision", patches + 1, v["hidden_size"], v["intermediate_size"], v["num_layers"],
                                 trains=sees)]
    projects = "projector" in trained or sees
    projector = [flops.linear("projector", tokens, v["hidden_size"], t["hidden_size"], trains="projector" in trained,
                              grad_in=sees),
                 flops.linear("projector", tokens, t["hidden_size"], t["hidden_size"], trains="projector" in trained,
                              grad_in=projects)]
    lm = decoder.decoder_ledger(t, arch["data"]["seq_len"], term="text", trains="text" in trained, grad_in=projects,
                                lora=lora, recompute=recompute)
    return num_tiles(arch) * (tower + projector) + lm


def activation_bytes(arch: dict, micro: int, *, dtype: str, recompute: bool) -> float:
    """Stored activations at the peak: the language model's (``decoder``'s docstring)."""
    return decoder.decoder_activation_bytes(arch["text"], arch["data"]["seq_len"], micro, dtype=dtype,
                                            recompute=recompute)
