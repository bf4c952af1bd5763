"""Micro-batches of prepared real data, read with numpy alone, identical for every backend.

The core prepares a data set once, before any launch (``xfw.run.data``), into a directory both
adapters read (``spec["data"]["prepared"]``)::

    DIR/index.json                 format, family, samples, fields, the preparation's statistics
    DIR/<field>.npy                every sample's values of one field, flattened and concatenated
    DIR/<field>.offsets.npy        int64 [samples + 1]: where each sample's values start
    DIR/<field>.shapes.npy         int64 [samples, ndim]: each sample's shape of that field

The ``.npy`` files are memory-mapped, so a data set larger than memory costs only what a batch
reads. :class:`MicroBatches` is a map-style data set of one rank's micro-batches in training order:
item ``k`` is micro-batch ``k % accum`` of optimizer step ``k // accum``, and holds global
positions ``step * global + (rank * accum + i) * micro`` onwards, the same rule the synthetic data
follows (``xfw.contract.synthetic``): a sample depends on its place in the global batch, never on
the rank, so 1 process x 8 micro-batches and 8 processes x 1 train on the same samples. Positions
walk through the data set epoch by epoch, each epoch in an order drawn from ``data.seed``.
Samples are padded to the micro-batch's longest (``xfw.contract.families.collate``)::

    dataset = MicroBatches(spec, rank=0)
    batch, meta = dataset[0]          # numpy arrays; meta: tokens, padding, longest, hash
    # each adapter iterates it with its own framework's DataLoader, inside the timed loop

Every micro-batch, synthetic or prepared, is described by :func:`describe` (an int64 array that
crosses a framework's DataLoader as a tensor): its trained tokens (padding excluded), its padded
positions, its longest sample and a hash of its bytes, so a report can show that both sides
trained on bit-identical batches.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from xfw.contract.families import collate, family_module

FORMAT = 1
INDEX_FILE = "index.json"
META_LEN = 5
"""describe() -> int64 [tokens, padded tokens, longest sample, hash bytes 0-7, hash bytes 8-15]."""


# -- describing a micro-batch ------------------------------------------------------------------------

def batch_hash(batch: dict[str, np.ndarray]) -> str:
    """A 128-bit hex digest of a micro-batch: every key's name, dtype, shape and bytes, in key order."""
    digest = hashlib.blake2b(digest_size=16)
    for key in sorted(batch):
        value = np.asarray(batch[key], order="C")
        digest.update(f"{key}|{value.dtype.str}|{value.shape}|".encode())
        digest.update(value.data if value.size else b"")
    return digest.hexdigest()


def token_counts(batch: dict[str, np.ndarray]) -> tuple[int, int, int]:
    """(trained tokens, padded positions, longest sample) of a language-model batch; zeros for
    batches without LM labels (SD1.5's input_ids are CLIP prompt ids, not trained tokens)."""
    if "labels" not in batch or "input_ids" not in batch:
        return 0, 0, 0
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    lengths = mask.sum(axis=1) if mask is not None else np.full(ids.shape[0], ids.shape[1])
    return int(lengths.sum()), int(ids.size), int(lengths.max()) if lengths.size else 0


def describe(batch: dict[str, np.ndarray]) -> np.ndarray:
    """The micro-batch's int64 description (:data:`META_LEN`): what the harness records for it."""
    digest = np.frombuffer(bytes.fromhex(batch_hash(batch)), dtype=np.int64)
    return np.array([*token_counts(batch), *digest], dtype=np.int64)


def unpack(meta) -> tuple[int, int, int, str]:
    """(tokens, padded, longest, hash) from :func:`describe`'s array (or a list of its values)."""
    values = np.asarray(meta, dtype=np.int64).reshape(-1)
    return int(values[0]), int(values[1]), int(values[2]), values[3:5].tobytes().hex()


# -- the prepared cache --------------------------------------------------------------------------------

class PreparedError(ValueError):
    """A prepared directory that is missing or not of this format; one line naming it."""


def read_index(directory: str | os.PathLike) -> dict:
    path = Path(directory) / INDEX_FILE
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise PreparedError(f"{path}: cannot read the prepared data's index ({err})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise PreparedError(f"{path}: not a prepared data set of format {FORMAT}")
    return index


class PreparedData:
    """One prepared directory: ``len()`` samples, ``sample(i)`` a dict of numpy arrays (views of the
    memory-mapped files). Files are opened on first use, so the object crosses a fork cheaply."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.index = read_index(self.directory)
        self.fields = list(self.index["fields"])
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None

    def __len__(self) -> int:
        return int(self.index["num_samples"])

    def _open(self) -> dict:
        if self._arrays is None:
            arrays = {}
            for name in self.fields:
                load = lambda suffix: np.load(self.directory / f"{name}{suffix}", mmap_mode="r")  # noqa: E731
                arrays[name] = (load(".npy"), np.load(self.directory / f"{name}.offsets.npy"),
                                np.load(self.directory / f"{name}.shapes.npy"))
            self._arrays = arrays
        return self._arrays

    def modalities(self) -> tuple[np.ndarray, np.ndarray]:
        """Per sample: its length (``input_ids`` elements) and whether it holds an image, from the
        stored shapes alone (no sample is read)."""
        arrays = self._open()
        lengths = np.prod(arrays["input_ids"][2], axis=1) if "input_ids" in arrays else np.zeros(len(self), np.int64)
        has_image = np.zeros(len(self), dtype=bool)
        for name in IMAGE_FIELDS:
            if name in arrays:
                has_image |= np.prod(arrays[name][2], axis=1) > 0
        return lengths, has_image

    def sample(self, i: int) -> dict[str, np.ndarray]:
        out = {}
        for name, (values, offsets, shapes) in self._open().items():
            out[name] = np.asarray(values[offsets[i]:offsets[i + 1]]).reshape(tuple(shapes[i]))
        return out

    def __getstate__(self):  # a DataLoader worker started by spawn reopens the files itself
        return {"directory": self.directory, "index": self.index, "fields": self.fields, "_arrays": None}

    def __setstate__(self, state):
        self.__dict__.update(state)


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order samples are visited in during ``epoch``: a permutation drawn from (seed, epoch)."""
    if not shuffle:
        return np.arange(num_samples)
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


IMAGE_FIELDS = ("pixel_values", "image_grid_thw")


def modality_order(lengths: np.ndarray, has_image: np.ndarray, group: int, seed: int, epoch: int) -> np.ndarray:
    """An epoch's order with samples grouped by modality, as LLaVA's trainer groups them
    (``group_by_modality_length``): the samples with images and those without are each shuffled and
    cut into groups of ``group`` (micro-batch x processes, LLaVA's "megabatch"), each group sorted
    longest first; the groups are shuffled together, and the two incomplete last groups go last,
    merged. So a micro-batch holds one modality, except those of the final merged group and any
    that straddle an epoch's end."""
    rng = np.random.default_rng([seed, epoch, 1])
    groups, rest = [], []
    for mask in (has_image, ~has_image):
        members = np.flatnonzero(mask)
        members = members[rng.permutation(members.size)]
        cut = [members[i:i + group] for i in range(0, members.size, group)]
        cut = [g[np.argsort(-lengths[g], kind="stable")] for g in cut]
        if cut and cut[-1].size < group:
            rest.append(cut.pop())
        groups += cut
    ordered = [groups[i] for i in rng.permutation(len(groups))]
    if rest:
        ordered.append(np.sort(np.concatenate(rest)))
    return np.concatenate(ordered) if ordered else np.arange(0)


EVAL_SPLIT_SEED = 0x5E1EC7
"""Seeds which samples are held out (:func:`held_out`): fixed, so every run seed shares one split."""
EVAL_DRAW_SEED = 0xE7A1
"""Seeds the held-out samples' random draws (diffusion noise, timesteps): the same at every evaluation
and for every run seed, so eval losses differ only by what the model learned."""


def held_out(num_samples: int, eval_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(training sample indices, held-out sample indices), both sorted: ``eval_samples`` drawn once
    from a fixed seed (:data:`EVAL_SPLIT_SEED`), never from a run's seed; (all, none) for 0."""
    if not 0 <= eval_samples < num_samples:
        raise ValueError(f"data.eval_samples: {eval_samples} must be at least 0 and below the data set's "
                         f"{num_samples} samples")
    if eval_samples == 0:
        return np.arange(num_samples), np.arange(0)
    chosen = np.random.default_rng(EVAL_SPLIT_SEED).permutation(num_samples)
    return np.sort(chosen[eval_samples:]), np.sort(chosen[:eval_samples])


class MicroBatches:
    """One rank's micro-batches of a prepared data set, in training order (module docstring).
    ``len()`` = (warm-up + measured steps) x accumulation; item ``k`` -> (batch, :func:`describe`).
    With ``data.eval_samples`` the held-out samples (:func:`held_out`) are never trained on: epochs
    walk the rest."""

    def __init__(self, spec: dict, rank: int):
        self.arch = spec["model"]["arch"]
        self.data = PreparedData(spec["data"]["prepared"])
        self.family = family_module(self.arch["family"])
        self.train_ids, _ = held_out(len(self.data), int(spec["data"].get("eval_samples") or 0))
        self.seed, self.shuffle = spec["data"]["seed"], bool(spec["data"].get("shuffle", True))
        self.by_modality = bool(spec["data"].get("group_by_modality", False))
        self.micro, self.accum = spec["batch"]["micro"], spec["derived"]["grad_accum_steps"]
        self.global_size, self.rank = spec["batch"]["global"], rank
        self.num_steps = spec["measure"]["warmup_steps"] + spec["measure"]["steps"]
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_steps * self.accum

    def positions(self, k: int) -> range:
        """Global positions (places in the run's stream of samples) of micro-batch ``k``."""
        step, i = divmod(k, self.accum)
        first = step * self.global_size + (self.rank * self.accum + i) * self.micro
        return range(first, first + self.micro)

    def sample_index(self, position: int) -> int:
        epoch, j = divmod(position, len(self.train_ids))
        if epoch not in self._orders:
            if self.by_modality:
                lengths, has_image = self.data.modalities()
                group = self.micro * (self.global_size // (self.micro * self.accum))  # micro x processes
                order = modality_order(lengths[self.train_ids], has_image[self.train_ids], group, self.seed, epoch)
            else:
                order = epoch_order(len(self.train_ids), self.seed, epoch, self.shuffle)
            self._orders = {epoch: order}
        return int(self.train_ids[self._orders[epoch][j]])

    def sample(self, position: int) -> dict[str, np.ndarray]:
        """The prepared sample at ``position`` as a batch of one, with every random draw of its step
        (diffusion noise, timesteps) seeded by its place: (seed, step, index in the global batch)."""
        step, index = divmod(position, self.global_size)
        rng = np.random.default_rng([self.seed, step, index])
        return self.family.from_prepared(self.arch, self.data.sample(self.sample_index(position)), rng)

    def __getitem__(self, k: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        if not 0 <= k < len(self):
            raise IndexError(k)
        batch = collate(self.arch, [self.sample(p) for p in self.positions(k)])
        return batch, describe(batch)


class EvalBatches:
    """The held-out samples (:func:`held_out`) as micro-batches of ``batch.micro``, in index order, the
    last one possibly smaller; every rank reads all of them (an evaluation is the whole split, the same
    on every rank, so sharded models run the same collectives). Item ``k`` -> (batch, :func:`describe`);
    ``sizes[k]`` is its number of samples."""

    def __init__(self, spec: dict):
        self.arch = spec["model"]["arch"]
        self.data = PreparedData(spec["data"]["prepared"])
        self.family = family_module(self.arch["family"])
        _, self.ids = held_out(len(self.data), int(spec["data"].get("eval_samples") or 0))
        micro = spec["batch"]["micro"]
        self.chunks = [self.ids[i:i + micro] for i in range(0, len(self.ids), micro)]
        self.sizes = [len(c) for c in self.chunks]

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, k: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        if not 0 <= k < len(self):
            raise IndexError(k)
        samples = [self.family.from_prepared(self.arch, self.data.sample(int(i)),
                                             np.random.default_rng([EVAL_DRAW_SEED, int(i)])) for i in self.chunks[k]]
        batch = collate(self.arch, samples)
        return batch, describe(batch)
