"""A recipe's ``data`` section: what a run trains on (synthetic batches or real data prepared
once by :mod:`xfw.run.data`), checked when the recipe is loaded (:mod:`xfw.recipe.schema`).
"""

from __future__ import annotations

from dataclasses import dataclass

from xfw.recipe.schema import FieldError, bounded

DATA_KINDS = ("synthetic", "llava_json", "image_captions")
TEMPLATES = ("auto", "vicuna_v1", "plain", "chatml", "tokenizer")
INTERPOLATIONS = ("bilinear", "bicubic", "lanczos")
DATA_FAMILIES = {"llava_json": ("llava", "qwen2vl"), "image_captions": ("sd15", "sd3")}
"""The model families each kind of real data feeds."""
DATA_PATHS = ("path", "image_root", "tokenizer", "cache")
"""Data keys that name files or directories: relative ones are taken from the recipe's directory
(from the current directory when given with --set), and the resolved spec holds them absolute."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TextTokensSpec:
    dist: str = "uniform"
    """How each synthetic sample's text length is drawn (seeded by its place): ``uniform`` in [min, max]."""
    min: int = bounded(1, 1 << 20)
    max: int = bounded(1, 1 << 20)

    def __post_init__(self):
        if self.dist != "uniform":
            raise FieldError("dist", f"only 'uniform' is supported, got {self.dist!r}")
        if self.min > self.max:
            raise FieldError("max", f"{self.max} is below min {self.min}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSpec:
    kind: str = "synthetic"
    """``synthetic``: seeded numpy batches made by the core. ``llava_json``: LLaVA's conversation JSON
    (LLaVA, Qwen2-VL). ``image_captions``: an image folder's metadata.jsonl (SD1.5, SD3). Real data
    is prepared once by the core (``xfw.run.data``) and read by both backends (docs/data.md)."""
    image_size: int | None = bounded(1, 16384, default=None)
    """Square image side in pixels (defaults to the preset's); for real data the tile / target size."""
    seq_len: int | None = bounded(1, 1 << 20, default=None)
    """Language sequence length in tokens, image tokens included: exact for synthetic data without
    ``text_tokens``, else the cap (real samples longer than it are cut, or refused without ``truncation``)."""
    pool_size: int = bounded(1, 1024, default=4)
    """Synthetic: optimizer steps' worth of distinct data generated before the timed window and cycled."""
    seed: int = bounded(0, 2**32 - 1, default=0)
    """Seeds synthetic samples, and real data's epoch order and per-step draws (noise, timesteps)."""
    text_tokens: TextTokensSpec | None = None
    """Synthetic only: text tokens per sample drawn from a seeded distribution (variable lengths,
    micro-batches padded to their longest); None: every sample exactly ``seq_len``."""
    path: str | None = None
    """llava_json: the conversation JSON; image_captions: the metadata.jsonl."""
    image_root: str | None = None
    """Directory the samples' image paths are relative to (default: the data file's directory)."""
    tokenizer: str | None = None
    """A directory with a Hugging Face ``tokenizer.json`` (and ``tokenizer_config.json`` where it has one)."""
    template: str = "auto"
    """llava_json: how a conversation becomes text: ``vicuna_v1`` (LLaVA SFT), ``plain`` (LLaVA
    pretraining: image + caption), ``chatml`` (Qwen2-VL), ``tokenizer`` (the chat template in
    tokenizer_config.json); ``auto``: the tokenizer's template if it has one, else the family's."""
    truncation: bool = True
    """Cut samples longer than ``seq_len`` (never into their image tokens); false: refuse them."""
    shuffle: bool = True
    """Visit real data in a seeded order per epoch (false: file order)."""
    group_by_modality: bool = False
    """llava_json: group samples with and without images into separate micro-batches, each sorted by
    length, in a seeded order (LLaVA's ``group_by_modality_length``; ``xfw.contract.batches``)."""
    max_samples: int | None = bounded(1, 1 << 31, default=None)
    """Use only the data file's first N samples."""
    eval_samples: int = bounded(0, 1 << 31, default=0)
    """Real data: samples held out of training, the same ones for every seed and both sides
    (``xfw.contract.batches.held_out``), evaluated with ``measure.eval_every`` (xfw converge). 0: none."""
    max_image_side: int | None = bounded(1, 1 << 16, default=None)
    """Qwen2-VL: first shrink (nearest) so the longer side is at most this (PaddleMIX: image_resolution 512)."""
    min_pixels: int = bounded(1, 1 << 40, default=3136)
    """Qwen2-VL smart resize: the fewest pixels an image keeps (Qwen2VLImageProcessor's min_pixels)."""
    max_pixels: int = bounded(1, 1 << 40, default=12845056)
    """Qwen2-VL smart resize: the most pixels an image keeps (Qwen2VLImageProcessor's max_pixels)."""
    interpolation: str = "bilinear"
    """image_captions: the resize filter (diffusers' scripts: bilinear; PaddleMIX's laion pretraining: lanczos)."""
    cache: str | None = None
    """Where prepared data is kept (default: $XFW_CACHE_DIR, else ~/.cache/xfw/data)."""

    def __post_init__(self):
        if self.kind not in DATA_KINDS:
            raise FieldError("kind", f"must be one of {', '.join(DATA_KINDS)}, got {self.kind!r}")
        for name in ("image_size", "seq_len", "pool_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise FieldError(name, f"must be positive, got {value}")
        if self.template not in TEMPLATES:
            raise FieldError("template", f"must be one of {', '.join(TEMPLATES)}, got {self.template!r}")
        if self.interpolation not in INTERPOLATIONS:
            raise FieldError("interpolation", f"must be one of {', '.join(INTERPOLATIONS)}, got {self.interpolation!r}")
        if self.min_pixels > self.max_pixels:
            raise FieldError("max_pixels", f"{self.max_pixels} is below min_pixels {self.min_pixels}")
        needed = {"synthetic": (), "llava_json": ("path", "tokenizer"), "image_captions": ("path",)}[self.kind]
        for name in needed:
            if not getattr(self, name):
                raise FieldError(name, f"is required for data kind {self.kind!r}")
        if self.kind == "synthetic":
            stray = [n for n in ("path", "image_root", "tokenizer") if getattr(self, n)]
            if stray:
                raise FieldError(stray[0], "only applies to real data (kind llava_json or image_captions)")
        if self.eval_samples < 0:
            raise FieldError("eval_samples", f"must be >= 0, got {self.eval_samples}")
        if self.eval_samples and self.kind == "synthetic":
            raise FieldError("eval_samples", "only applies to real data (kind llava_json or image_captions): "
                             "synthetic batches are a cycled pool with nothing to hold out")
        if self.group_by_modality and self.kind != "llava_json":
            raise FieldError("group_by_modality", f"only applies to llava_json data, not kind {self.kind!r}")
        if self.kind != "synthetic" and self.text_tokens is not None:
            raise FieldError("text_tokens", f"only applies to synthetic data (real data has its own lengths), "
                             f"not kind {self.kind!r}")
