"""Qwen2-VL (ViT with 2-D rotary + 2x2 patch merger, Qwen2 decoder with M-RoPE): checks and data.

A batch carries everything the step needs, computed here once in numpy so both frameworks
get the same values: flattened patches as Qwen2-VL's image processor emits them, the grid,
and the 3-D M-RoPE position ids (temporal, height, width) that transformers would otherwise
recompute on the host at every step::

    [<vision_start>, <image_pad> x (h/2)(w/2), <vision_end>, text ...]   loss on the text only

It also owns the model's facts (see ``xfw.contract.families``): parts by transformers' parameter
names, e.g. ``model.visual.merger.mlp.0.weight`` is part ``merger``, which trains in every stage
while the rest of the vision tower stays frozen; parameter counts, FLOPs and activation bytes.
"""

from __future__ import annotations

import numpy as np

from xfw.contract.families import decoder, flops
from xfw.contract.families import ArchError

IGNORE_INDEX = -100
FIRST_TEXT_ID = 2
BATCH_AXES = {"position_ids": 1}  # [3, batch, seq]: samples stack on axis 1

# Parts by prefix of transformers' Qwen2VLForConditionalGeneration parameter names (lm_head only
# when the embeddings are untied).
PARTS = {
    "vision": ("model.visual.patch_embed.", "model.visual.blocks."),
    "merger": ("model.visual.merger.",),
    "text": ("model.language_model.", "lm_head."),
}
STAGE_PARTS = {"sft": ("merger", "text"), "lora": ("merger",)}  # stage lora adds adapters on LORA_MODULE
LORA_MODULE = "model.language_model"  # the decoder, without lm_head
LORA_TARGETS = decoder.DECODER_LINEARS
PAD_ID = 0
# Keys whose length varies per sample (xfw.contract.families.collate); images' patches concatenate.
PAD = {"input_ids": (1, PAD_ID), "labels": (1, IGNORE_INDEX), "attention_mask": (1, 0), "position_ids": (2, 0)}


def fixed_tokens(arch: dict) -> int:
    """Positions of a synthetic sample that are not text: vision start, image tokens, vision end."""
    return 2 + num_image_tokens(arch, arch["data"]["image_size"])


def patchify(image: np.ndarray, arch: dict) -> np.ndarray:
    """One resized, normalised still image ``[3, H, W]`` as Qwen2-VL's image processor flattens it:
    repeated to fill one temporal patch, then ``[t*h*w, 3*T*P*P]`` patches in 2x2-merge-window order
    (Qwen2VLImageProcessor's reshape and transpose, nothing computed)."""
    v = arch["vision"]
    p, m, tp = v["patch_size"], v["spatial_merge_size"], v["temporal_patch_size"]
    channels, height, width = image.shape
    gh, gw = height // p, width // p
    frames = np.broadcast_to(image[None], (tp, channels, height, width))
    patches = frames.reshape(1, tp, channels, gh // m, m, p, gw // m, m, p)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(patches.reshape(gh * gw, channels * tp * p * p), dtype=np.float32)


def rope_index(arch: dict, input_ids: np.ndarray, grids: np.ndarray) -> np.ndarray:
    """M-RoPE ids ``[3, len]`` of one unpadded sample with any number of images (transformers'
    ``get_rope_index``): text counts up on all three axes; each image's tokens take (t, row, col)
    offset by the position after the text before them; text after an image resumes at the
    largest id so far + 1. ``grids``: ``[images, 3]`` (t, h, w) in patches."""
    merge = arch["vision"]["spatial_merge_size"]
    image_positions = np.flatnonzero(input_ids == arch["image_token_id"])
    pieces, start, next_id = [], 0, 0
    for t, h, w in np.asarray(grids, np.int64).reshape(-1, 3):
        gh, gw = h // merge, w // merge
        first = image_positions[image_positions >= start][0]
        text = first - start
        pieces.append(np.broadcast_to(np.arange(text) + next_id, (3, text)))
        tt, rows, cols = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pieces.append(np.stack([tt.ravel(), rows.ravel(), cols.ravel()]) + next_id + text)
        next_id = int(pieces[-1].max()) + 1
        start = first + t * gh * gw
    rest = len(input_ids) - start
    pieces.append(np.broadcast_to(np.arange(rest) + next_id, (3, rest)))
    return np.concatenate(pieces, axis=1).astype(np.int64)


def grid(arch: dict) -> tuple[int, int, int]:
    """(t, h, w) patches of one image: a still image is one temporal patch."""
    size, patch = arch["data"]["image_size"], arch["vision"]["patch_size"]
    return 1, size // patch, size // patch


def num_image_tokens(arch: dict, image_size: int) -> int:
    merge = arch["vision"]["spatial_merge_size"]
    side = image_size // arch["vision"]["patch_size"]
    return (side // merge) ** 2


def check(arch: dict) -> None:
    v, t, data = arch["vision"], arch["text"], arch["data"]
    if t["hidden_size"] % t["num_heads"]:
        raise ArchError("model.arch.text.num_heads", f"{t['num_heads']} does not divide hidden_size {t['hidden_size']}")
    if t["num_heads"] % t["num_kv_heads"]:
        raise ArchError("model.arch.text.num_kv_heads", f"{t['num_kv_heads']} does not divide num_heads {t['num_heads']}")
    half = t["hidden_size"] // t["num_heads"] // 2
    if sum(t["mrope_section"]) != half:
        raise ArchError("model.arch.text.mrope_section", f"{t['mrope_section']} must sum to head_dim / 2 = {half}")
    if v["embed_dim"] % v["num_heads"]:
        raise ArchError("model.arch.vision.num_heads", f"{v['num_heads']} does not divide embed_dim {v['embed_dim']}")
    if v["merger_out"] != t["hidden_size"]:
        raise ArchError("model.arch.vision.merger_out", f"{v['merger_out']} must equal text.hidden_size {t['hidden_size']}")
    step = v["patch_size"] * v["spatial_merge_size"]
    if data["image_size"] % step:
        raise ArchError("data.image_size", f"{data['image_size']} is not a multiple of patch x merge = {step}")
    ids = [arch[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")]
    if len(set(ids)) != 4 or not all(FIRST_TEXT_ID <= i < t["vocab_size"] for i in ids):
        raise ArchError("model.arch.image_token_id", f"special token ids {ids} must be distinct and inside the vocabulary")
    needed = num_image_tokens(arch, data["image_size"]) + 3
    if data["seq_len"] < needed:
        raise ArchError("data.seq_len", f"{data['seq_len']} leaves no room for text after "
                        f"{needed - 3} image tokens (need at least {needed})")


def rope_positions(arch: dict, seq_len: int) -> np.ndarray:
    """M-RoPE ids [3, seq_len] for [vision_start, image..., rest]: the rule of Qwen2-VL's
    ``get_rope_index``: text counts up on all three axes; image tokens take (t, row, col)
    offset by the text before them; text after resumes at the largest id + 1."""
    merge = arch["vision"]["spatial_merge_size"]
    _, gh, gw = grid(arch)
    h, w = gh // merge, gw // merge
    pos = np.zeros((3, seq_len), np.int64)
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    image = slice(1, 1 + h * w)
    pos[0, image] = 1
    pos[1, image] = 1 + rows.ravel()
    pos[2, image] = 1 + cols.ravel()
    start = 1 + max(h - 1, w - 1) + 1
    rest = seq_len - (1 + h * w)
    pos[:, 1 + h * w:] = start + np.arange(rest)
    return pos


def make_batch(arch: dict, micro: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    v, seq_len, vocab = arch["vision"], arch["data"]["seq_len"], arch["text"]["vocab_size"]
    t, gh, gw = grid(arch)
    patch_dim = 3 * v["temporal_patch_size"] * v["patch_size"] ** 2
    num_image = num_image_tokens(arch, arch["data"]["image_size"])
    pixel_values = rng.standard_normal((micro * t * gh * gw, patch_dim), dtype=np.float32)
    special = {arch[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    text = rng.integers(FIRST_TEXT_ID, vocab, size=(micro, seq_len - 2 - num_image), dtype=np.int64)
    for token in sorted(special):  # never draw a special token as text
        text[text == token] = FIRST_TEXT_ID
    input_ids = np.concatenate([
        np.full((micro, 1), arch["vision_start_token_id"], np.int64),
        np.full((micro, num_image), arch["image_token_id"], np.int64),
        np.full((micro, 1), arch["vision_end_token_id"], np.int64),
        text,
    ], axis=1)
    labels = input_ids.copy()
    labels[:, : 2 + num_image] = IGNORE_INDEX
    return {
        "pixel_values": pixel_values,
        "image_grid_thw": np.tile(np.array([[t, gh, gw]], np.int64), (micro, 1)),
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": np.ones_like(input_ids),
        "position_ids": np.repeat(rope_positions(arch, seq_len)[:, None, :], micro, axis=1),
    }


def from_prepared(arch: dict, stored: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A prepared sample (``xfw.run.data``: ``input_ids``, ``labels``, its resized and normalised
    images flattened one after another in ``images``, their ``image_grid_thw``) as a batch of one in
    :func:`make_batch`'s layout: every image's patches (:func:`patchify`), the grids, and the
    sample's M-RoPE ids (:func:`rope_index`)."""
    ids = stored["input_ids"].astype(np.int64)
    grids = stored["image_grid_thw"].astype(np.int64).reshape(-1, 3)
    patch, flat, start, patches = arch["vision"]["patch_size"], stored["images"], 0, []
    for _, h, w in grids:
        size = 3 * h * patch * w * patch
        patches.append(patchify(np.asarray(flat[start:start + size], np.float32).reshape(3, h * patch, w * patch), arch))
        start += size
    v = arch["vision"]
    patch_dim = 3 * v["temporal_patch_size"] * patch ** 2
    return {
        "pixel_values": np.concatenate(patches) if patches else np.zeros((0, patch_dim), np.float32),
        "image_grid_thw": grids,
        "input_ids": ids[None],
        "labels": stored["labels"].astype(np.int64)[None],
        "attention_mask": np.ones((1, len(ids)), np.int64),
        "position_ids": rope_index(arch, ids, grids)[:, None, :],
    }


def count_params(arch: dict) -> dict[str, int]:
    """Analytic counts in transformers' Qwen2VLForConditionalGeneration layout."""
    v, t = arch["vision"], arch["text"]
    d, p, tp = v["embed_dim"], v["patch_size"], v["temporal_patch_size"]
    mlp = d * v["mlp_ratio"]
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * mlp + mlp) + (mlp * d + d)
    merged = d * v["spatial_merge_size"] ** 2
    merger = 2 * d + (merged * merged + merged) + (merged * v["merger_out"] + v["merger_out"])
    vision = 3 * tp * p * p * d + v["depth"] * block
    th, tf = t["hidden_size"], t["intermediate_size"]
    kv = th // t["num_heads"] * t["num_kv_heads"]
    layer = (th * th + th) + 2 * (th * kv + kv) + th * th + 3 * th * tf + 2 * th  # q/k/v have biases
    text = t["vocab_size"] * th + t["num_layers"] * layer + th
    head = 0 if t["tie_word_embeddings"] else t["vocab_size"] * th
    return {"vision": vision, "merger": merger, "text": text + head, "total": vision + merger + text + head}


def lora_linears(arch: dict) -> dict[str, list[tuple[int, int]]]:
    """(in, out) of every linear under LORA_MODULE that each LoRA target name matches."""
    return decoder.decoder_lora_linears(arch["text"])


def flop_ledger(arch: dict, trained: tuple[str, ...], lora: dict | None, recompute: bool) -> list[flops.Matmul]:
    """Every product of one sample's step (``xfw.contract.families.flops``) when the parts ``trained``
    train: the patch embedding (a t x p x p convolution per patch) and the vision blocks (fused qkv;
    frozen unless a recipe's ``model.trainable`` names them), the 2x2 merger (where it trains, its
    LayerNorm trains too, so even its first linear computes an input gradient; PaddleMIX's
    ``freeze_vit`` freezes it with the tower), then the language model over the whole sequence with
    M-RoPE's three rotary tables."""
    v, t = arch["vision"], arch["text"]
    d, side = v["embed_dim"], arch["data"]["image_size"] // v["patch_size"]
    patches, merged = side * side, d * v["spatial_merge_size"] ** 2
    sees = "vision" in trained
    tower = [flops.conv("vision", patches, v["temporal_patch_size"] * v["patch_size"] ** 2, 3, d, trains=sees,
                        grad_in=False),
             *decoder.vit_ledger("vision", patches, d, d * v["mlp_ratio"], v["depth"], qkv_fused=True, trains=sees)]
    trains_merger = "merger" in trained
    merges = trains_merger or sees  # a gradient leaves the merger
    tokens = patches // v["spatial_merge_size"] ** 2
    merger = [flops.linear("merger", tokens, merged, merged, trains=trains_merger, grad_in=merges),  # after ln_q
              flops.linear("merger", tokens, merged, v["merger_out"], trains=trains_merger, grad_in=merges)]
    lm = decoder.decoder_ledger(t, arch["data"]["seq_len"], term="text", trains="text" in trained, grad_in=merges,
                                lora=lora, recompute=recompute, rope_axes=3)
    return tower + merger + lm


def activation_bytes(arch: dict, micro: int, *, dtype: str, recompute: bool) -> float:
    """Stored activations at the peak: the language model's (``decoder``'s docstring)."""
    return decoder.decoder_activation_bytes(arch["text"], arch["data"]["seq_len"], micro, dtype=dtype,
                                            recompute=recompute)
