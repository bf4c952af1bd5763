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

from xfw.families import family_module
from xfw.families.llava import IGNORE_INDEX  # noqa: F401 - re-exported for adapters and tests


def _rng(seed: int, rank: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, rank, index])


def make_batch(spec: dict, rank: int, index: int) -> dict[str, np.ndarray]:
    """Micro-batch number ``index`` of process ``rank`` for a resolved spec."""
    arch = spec["model"]["arch"]
    return family_module(arch["family"]).make_batch(arch, spec["batch"]["micro"],
                                                    _rng(spec["data"]["seed"], rank, index))


def make_pool(spec: dict, rank: int) -> list[dict[str, np.ndarray]]:
    """The cycled pool of micro-batches one process trains on."""
    return [make_batch(spec, rank, i) for i in range(spec["data"]["pool_size"])]


def num_tokens(batch: dict[str, np.ndarray]) -> int:
    """Sequence positions the language model trains on (image tokens included); 0 if none.
    Only batches with LM labels count: SD1.5's input_ids are CLIP prompt ids, not trained tokens."""
    ids = batch.get("input_ids") if "labels" in batch else None
    return int(ids.size) if ids is not None else 0
