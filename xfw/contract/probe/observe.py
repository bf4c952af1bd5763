"""What the probe reads off a script's objects without knowing its framework: batch sizes and
token counts from a batch's shapes, the process's peak RSS, whether an error is an OOM.

Shapes only: reading a tensor's shape never touches its data, so counting a batch adds no host
sync. A batch is whatever a DataLoader yields: a mapping of tensors (a transformers or PaddleNLP
collator's output), a tuple or list of them, or one tensor::

    >>> batch_counts({"input_ids": ids_8x64, "labels": labels_8x64, "pixel_values": pix})
    (8, 512)
"""

from __future__ import annotations

import math
import resource
from collections.abc import Mapping, Sequence
from typing import Any

PREFERRED_KEYS = ("input_ids", "pixel_values", "labels", "attention_mask")
"""Keys whose first dimension is the batch, tried first (an image list or a scalar may come first)."""


def _shape(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    try:
        return tuple(int(d) for d in shape) if shape is not None else None
    except (TypeError, ValueError):  # a symbolic or unknown dimension
        return None


def _leading(values: list[Any]) -> int | None:
    for value in values:
        shape = _shape(value)
        if shape:  # at least one dimension
            return shape[0]
    return None


def batch_counts(batch: Any) -> tuple[int, int] | None:
    """(samples, tokens) of one batch, or None when no tensor in it shows a batch dimension.
    Tokens are the ``input_ids`` positions when the batch also has ``labels`` (what
    :func:`xfw.contract.synthetic.num_tokens` counts for xfw's own runs), else 0."""
    if isinstance(batch, Mapping):
        values = [batch[k] for k in PREFERRED_KEYS if k in batch] + list(batch.values())
        samples = _leading(values)
        ids = _shape(batch.get("input_ids")) if "labels" in batch else None
        tokens = math.prod(ids) if ids else 0
    elif isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        samples, tokens = _leading(list(batch)), 0
    else:
        samples, tokens = _leading([batch]), 0
    return None if samples is None else (samples, tokens)


def peak_rss_bytes() -> int:
    """The whole process's peak resident set (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def looks_like_oom(error: BaseException) -> bool:
    """Out of memory as PyTorch (``OutOfMemoryError``) and Paddle (``MemoryError``,
    ``ResourceExhaustedError``) report it."""
    text = f"{type(error).__name__}: {error}".lower()
    return isinstance(error, MemoryError) or "out of memory" in text or "outofmemory" in text \
        or "resourceexhausted" in text


def majority(counts: dict[str, int]) -> str:
    """The key with the largest count ("float32" for a model mostly in fp32); "unknown" if none."""
    return max(counts, key=counts.get) if counts else "unknown"


def forward_counts(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """(samples, tokens) of what one forward call received: the first positional tensor's leading
    dimension (a UNet's latents), else a batch passed whole as the first argument (``model(batch)``),
    else the keyword arguments as a batch (a transformers model called with ``**batch``); tokens
    from ``input_ids`` when ``labels`` are passed too."""
    positional = _leading(list(args)) if args else None
    named = batch_counts(kwargs) if kwargs else None
    if positional is None and args and isinstance(args[0], (Mapping, list, tuple)):
        return batch_counts(args[0])  # the whole batch as one argument: model(batch)
    if positional is None:
        return named
    return positional, named[1] if named else 0
