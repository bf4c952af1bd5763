"""Synthetic batches: seeded numpy arrays, identical for every backend.

The core makes the data and each adapter only converts it (``torch.from_numpy``,
``paddle.to_tensor``), so both frameworks see bit-identical inputs. A batch depends only on
(seed, rank, index), never on a framework RNG::

    >>> pool = make_pool(spec, rank=0)          # spec: the resolved spec.json dict
    >>> batch = pool[(step * accum + micro) % len(pool)]
    >>> sorted(batch)
    ['attention_mask', 'input_ids', 'labels', 'pixel_values']

The pool is generated before the timed window and cycled through it, so data generation is
never timed.
"""

from __future__ import annotations

import numpy as np

from xfw import presets

IGNORE_INDEX = -100
BOS_ID = 1
FIRST_TEXT_ID = 2  # ids 0 and 1 are pad and BOS


def _rng(seed: int, rank: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, rank, index])


def llava_batch(arch: dict, micro: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One LLaVA micro-batch: [BOS, <image> x N, text...]; loss on the text tokens only."""
    image_size, seq_len = arch["data"]["image_size"], arch["data"]["seq_len"]
    num_image = presets.num_image_tokens(arch, image_size)
    image_id, vocab = arch["image_token_id"], arch["text"]["vocab_size"]
    # Already-normalised pixels, as a CLIP image processor would hand them over.
    pixel_values = rng.standard_normal((micro, 3, image_size, image_size), dtype=np.float32)
    text = rng.integers(FIRST_TEXT_ID, vocab - 1, size=(micro, seq_len - 1 - num_image), dtype=np.int64)
    text[text >= image_id] += 1  # never draw the image token as text
    input_ids = np.concatenate(
        [np.full((micro, 1), BOS_ID, np.int64), np.full((micro, num_image), image_id, np.int64), text], axis=1)
    labels = input_ids.copy()
    labels[:, : 1 + num_image] = IGNORE_INDEX
    return {
        "pixel_values": pixel_values,
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": np.ones_like(input_ids),
    }


_MAKERS = {"llava": llava_batch}


def make_batch(spec: dict, rank: int, index: int) -> dict[str, np.ndarray]:
    """Micro-batch number ``index`` of process ``rank`` for a resolved spec."""
    arch = spec["model"]["arch"]
    maker = _MAKERS.get(arch["family"])
    if maker is None:
        raise NotImplementedError(f"synthetic data for family {arch['family']!r}")
    return maker(arch, spec["batch"]["micro"], _rng(spec["data"]["seed"], rank, index))


def make_pool(spec: dict, rank: int) -> list[dict[str, np.ndarray]]:
    """The cycled pool of micro-batches one process trains on."""
    return [make_batch(spec, rank, i) for i in range(spec["data"]["pool_size"])]


def num_tokens(batch: dict[str, np.ndarray]) -> int:
    """Sequence positions the language model processes (image tokens included); 0 if none."""
    ids = batch.get("input_ids")
    return int(ids.size) if ids is not None else 0
