"""Synthetic batches: seeded numpy arrays, identical for every backend.

The core makes the data and each adapter only converts it (``torch.from_numpy``,
``paddle.to_tensor``), so both frameworks see bit-identical inputs. A batch depends only on
its place in the global batch (seed, pool slot, sample index), never on a rank or a
framework RNG::

    >>> pool = make_pool(spec, rank=0)          # spec: the resolved spec.json dict
    >>> batch = pool[(step % pool_size) * accum + micro]
    >>> sorted(batch)
    ['attention_mask', 'input_ids', 'labels', 'pixel_values']

The pool is generated before the timed window and cycled through it, so data generation is
never timed.

With ``data.text_tokens: {dist: uniform, min, max}`` every sample draws its own number of text
tokens (seeded by its place, like the rest of it), and a micro-batch is padded to its longest
sample (``xfw.contract.families.collate``): a stand-in for real data's length spread when the
data itself is not at hand.
"""

from __future__ import annotations

import numpy as np

from xfw.contract.batches import MicroBatches, token_counts
from xfw.contract.families import collate, family_module, fixed_tokens, with_seq_len
from xfw.contract.families.llava import IGNORE_INDEX  # noqa: F401 - re-exported for adapters and tests

DISTRIBUTIONS = ("uniform",)


def text_length(spec: dict, slot: int, index: int) -> int | None:
    """The sample's number of text tokens under ``data.text_tokens`` (None: the fixed ``seq_len``),
    drawn from its own stream, so the rest of the sample is drawn as without a distribution."""
    dist = spec["data"].get("text_tokens")
    if not dist:
        return None
    rng = np.random.default_rng([spec["data"]["seed"], slot, index, 1])
    return int(rng.integers(dist["min"], dist["max"] + 1))


def sample(spec: dict, slot: int, index: int) -> dict[str, np.ndarray]:
    """Sample ``index`` of the global batch of pool slot ``slot``: seeded by its place in the
    global batch, never by rank, so 1 process x 8 micro-batches and 8 processes x 1 see the
    very same samples in every optimizer step."""
    arch = spec["model"]["arch"]
    text = text_length(spec, slot, index)
    if text is not None:
        arch = with_seq_len(arch, fixed_tokens(arch) + text)
    rng = np.random.default_rng([spec["data"]["seed"], slot, index])
    return family_module(arch["family"]).make_batch(arch, 1, rng)


def make_pool(spec: dict, rank: int) -> list[dict[str, np.ndarray]]:
    """The micro-batches one process trains on: ``pool_size`` optimizer steps' worth, cycled.

    Entry ``slot * accum + i`` is micro-batch ``i`` of this rank in step slot ``slot``; it
    holds global samples ``(rank * accum + i) * micro`` onwards.
    """
    arch = spec["model"]["arch"]
    micro, accum = spec["batch"]["micro"], spec["derived"]["grad_accum_steps"]
    pool = []
    for slot in range(spec["data"]["pool_size"]):
        for i in range(accum):
            first = (rank * accum + i) * micro
            pool.append(collate(arch, [sample(spec, slot, first + k) for k in range(micro)]))
    return pool


def num_tokens(batch: dict[str, np.ndarray]) -> int:
    """Sequence positions the language model trains on (image tokens included, padding not); 0 if
    none. Only batches with LM labels count: SD1.5's input_ids are CLIP prompt ids, not trained tokens."""
    return token_counts(batch)[0]


def first_batch(spec: dict) -> dict[str, np.ndarray]:
    """Rank 0's first micro-batch, synthetic or prepared (what the module probe runs on)."""
    if spec["data"]["kind"] == "synthetic":
        return make_pool(spec, 0)[0]
    return MicroBatches(spec, 0)[0][0]
