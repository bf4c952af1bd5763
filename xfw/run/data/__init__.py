"""Real data, prepared once in the CLI's process before any launch, read by both backends.

``prepare(recipe, arch)`` turns a recipe's ``data`` section (kind ``llava_json`` or
``image_captions``, docs/data.md) into a directory of memory-mappable numpy files
(``xfw.contract.batches``): token ids with labels masked to the answers, images preprocessed for
the model (CLIP square, LLaVA-1.6 AnyRes tiles, Qwen2-VL's dynamic resolution, SD's resize and
crop). Both adapters read that directory, so both train on bit-identical batches, and neither
does any preprocessing of its own::

    prepared = prepare(recipe, arch)   # {"directory": ".../<key>", "stats": {...}, "fingerprint": key}
    # ~/.cache/xfw/data/llava_json-3f2a.../{index.json, input_ids.npy, ...}

The directory's name is a key over everything the result depends on: the content of the data
file, of every image it names and of the tokenizer's files (sha256), the preprocessing settings
and the architecture's image and token facts, and :data:`PREP_VERSION`. Any change gives a new
key, so a stale preparation is never read; an unchanged one is found and reused. It is written
atomically (``xfw.run.data.cache``).

Bad data is refused with one line naming the file and the sample (:class:`DataError`): a missing
or unreadable image, a ``<image>`` count that differs from the sample's images, a sample longer
than ``data.seq_len`` with truncation off, a tokenizer whose vocabulary is larger than the model's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from xfw.contract.batches import INDEX_FILE
from xfw.run.data.cache import discard, read_stats, verify
from xfw.run.data.files import DataError, file_digest, image_path, is_text, leaves_root  # noqa: F401

PREP_VERSION = 1
"""Bump when a change to this package changes what a preparation writes."""
ENV_CACHE = "XFW_CACHE_DIR"


def cache_root(data) -> Path:
    """``data.cache``, else $XFW_CACHE_DIR, else ~/.cache/xfw/data."""
    if data.cache:
        return Path(data.cache)
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    return Path.home() / ".cache" / "xfw" / "data"


def settings_key(recipe, arch: dict) -> dict:
    """What a preparation depends on besides files' contents: the data settings that change its
    output and the architecture's image and token facts (not its layer counts)."""
    data = recipe.data
    keep = ("kind", "image_size", "seq_len", "template", "truncation", "max_samples", "max_image_side",
            "min_pixels", "max_pixels", "interpolation")
    facts = {k: arch.get(k) for k in ("family", "vision", "anyres", "image_token_id", "video_token_id",
                                      "vision_start_token_id", "vision_end_token_id")}
    text = arch.get("text", {})
    facts["text"] = {k: text.get(k) for k in ("vocab_size", "max_length", "seq_len", "dim", "pooled_dim")}
    facts["data"] = arch["data"]
    return {"prep": PREP_VERSION, "data": {k: getattr(data, k) for k in keep}, "stage": recipe.stage,
            "arch": facts}


_PREPARED: dict[str, dict] = {}
_SPLITS: set[tuple[str, int]] = set()


def _builder(recipe):
    """The data kind's builder, once the section's paths are plain text and its file exists."""
    from xfw.run.data import captions, conversations

    data = recipe.data
    for key in ("path", "image_root", "tokenizer", "cache"):
        if "\x00" in (getattr(data, key) or ""):
            raise DataError(f"data.{key}: {getattr(data, key)!r} holds a NUL character")
    if not Path(data.path).is_file():
        raise DataError(f"data.path: {data.path}: no such file")
    return {"llava_json": conversations, "image_captions": captions}[data.kind]


def check(recipe, arch: dict) -> int:
    """The recipe's data checked without writing anything (what loading a recipe does): its paths exist, its file
    holds samples the kind can read (every check that needs no preprocessing: the data kind's ``plan``), and the
    split is possible (``data.eval_samples`` leaves samples to train on). Returns the number of samples; raises
    DataError. Preparing it is :func:`prepare_data`'s."""
    plan = _builder(recipe).plan(recipe, arch)
    total = len(getattr(plan, "records", None) or getattr(plan, "lines", None) or [])
    wanted = recipe.data.eval_samples
    if wanted and total and wanted >= total:
        raise DataError(f"data.eval_samples: {wanted} held out of a data set of {total} samples leaves none to "
                        f"train on (hold out fewer than {total})")
    return total


def prepare_data(recipe, *, log=None) -> dict | None:
    """The one step that writes prepared data: the recipe's real data (and that of each backend whose override
    changes its model or data) prepared, or found prepared, then its eval split checked against the prepared
    samples (:func:`check_split`). Each workflow calls it once, before anything launches; ``log`` (default: stderr)
    hears one line when a preparation ends (none when it was found prepared; a refusal stays the one line it is).
    Returns the recipe's ``{"directory", "stats", "fingerprint"}`` (None for synthetic data); raises
    DataError."""
    from xfw.contract import presets
    from xfw.recipe import overrides as per_backend

    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    own = [per_backend.effective(recipe, name, recipe.name)
           for name, keys in per_backend.backend_overrides(recipe).items()
           if any(key.split(".")[0] in ("model", "data") for key in keys)]
    first = None
    for each in [recipe, *own]:
        if each.data.kind == "synthetic":
            continue
        arch = presets.resolve_arch(each.model.preset, each.model.arch, each.data.image_size, each.data.seq_len)
        prepared = prepare(each, arch, log=say)
        if (prepared["directory"], each.data.eval_samples) not in _SPLITS:  # reads every sample: once per process
            check_split(each, prepared)
            _SPLITS.add((prepared["directory"], each.data.eval_samples))
        first = prepared if first is None else first
    return first


def _locate(builder, recipe, arch: dict):
    """(the data kind's plan, the preparation's key, its directory): reads the data, writes nothing."""
    plan = builder.plan(recipe, arch)  # reads the data file, checks what needs no preprocessing
    key_source = {"settings": settings_key(recipe, arch), "files": plan.fingerprints}
    key = hashlib.sha256(json.dumps(key_source, sort_keys=True).encode()).hexdigest()[:24]
    return plan, key, cache_root(recipe.data) / f"{recipe.data.kind}-{key}"


def find_prepared(recipe, arch: dict) -> tuple[dict | None, str]:
    """Whether the recipe's data is prepared, without writing anything (``xfw validate``): (``{"directory",
    "stats", "fingerprint"}`` when an intact preparation is there, else None; the directory it has or would have)."""
    plan, key, directory = _locate(_builder(recipe), recipe, arch)
    index = read_stats(directory)
    if index is None or verify(directory, index):
        return None, str(directory)
    return {"directory": str(directory), "stats": index["stats"], "fingerprint": key}, str(directory)


def prepare(recipe, arch: dict, *, log=None) -> dict:
    """The recipe's data prepared (or found prepared): ``{"directory": str, "stats": dict}``.
    Raises DataError for data the run cannot use. Called through :func:`prepare_data`, the step a workflow takes."""
    data = recipe.data
    builder = _builder(recipe)
    path = Path(data.path)
    # Within one command (one process) a preparation is looked up once; images are not stat'ed again.
    watched = [path] + ([Path(data.tokenizer) / n for n in ("tokenizer.json", "tokenizer_config.json")]
                        if data.tokenizer else [])
    stamps = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in watched if p.is_file()]
    memo = json.dumps([settings_key(recipe, arch), stamps, data.image_root, data.tokenizer, str(cache_root(data))],
                      sort_keys=True, default=str)
    if memo in _PREPARED:
        return _PREPARED[memo]
    plan, key, directory = _locate(builder, recipe, arch)
    index = read_stats(directory)
    damage = verify(directory, index) if index is not None else \
        f"{INDEX_FILE} is missing or unreadable" if directory.exists() else None
    if damage:  # tampered with, or half deleted, since it was prepared: never trained on, prepared again
        with contextlib.suppress(OSError):  # a closed stderr must not stop the preparation
            print(f"data.cache: {directory}: {damage}; preparing it again", file=sys.stderr)
        try:
            discard(directory)
        except FileNotFoundError:
            pass  # another command found the damage first and removed it
        except OSError as err:
            raise DataError(f"data.cache: {directory}: {damage}, and it cannot be removed "
                            f"({err.strerror or err}); remove it, or choose another data.cache") from None
        index = None
    if index is None:
        started = time.monotonic()
        try:
            index = builder.build(plan, directory)
        except OSError as err:
            raise DataError(f"data.cache: cannot write the prepared data to {directory.parent} "
                            f"({err.strerror or err})") from None
        if log is not None:
            log(f"data: {index['stats']['num_samples']} samples of {path} prepared in {directory} "
                f"({time.monotonic() - started:.1f} s)")
    result = {"directory": str(directory), "stats": index["stats"], "fingerprint": key}
    _PREPARED[memo] = result
    return result


def check_split(recipe, prepared: dict) -> None:
    """``data.eval_samples`` against the prepared data set: fewer than its samples, with room left to
    train on, and no held-out sample identical in content to a training sample (a held-out loss would
    then measure memory, not learning). Raises DataError naming the key."""
    from xfw.contract.batches import PreparedData, batch_hash, held_out

    wanted, total = recipe.data.eval_samples, int(prepared["stats"]["num_samples"])
    if not wanted:
        return
    if wanted >= total:
        raise DataError(f"data.eval_samples: {wanted} held out of a data set of {total} samples leaves none to "
                        f"train on (hold out fewer than {total})")
    train, held = held_out(total, wanted)
    data = PreparedData(prepared["directory"])
    seen = {batch_hash(data.sample(int(i))): int(i) for i in train}
    twins = [(int(i), seen[h]) for i in held if (h := batch_hash(data.sample(int(i)))) in seen]
    if twins:
        (held_id, train_id), more = twins[0], len(twins) - 1
        raise DataError(f"data.eval_samples: held-out sample {held_id} is identical to training sample {train_id}"
                        + (f" (and {more} more pairs)" if more else "")
                        + ": the eval split overlaps the training split; remove the duplicates from the data")
