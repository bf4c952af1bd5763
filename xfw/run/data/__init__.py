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
from pathlib import Path

from xfw.contract.batches import INDEX_FILE
from xfw.run.data.cache import discard, read_stats, verify

PREP_VERSION = 1
"""Bump when a change to this package changes what a preparation writes."""
ENV_CACHE = "XFW_CACHE_DIR"


class DataError(ValueError):
    """Data a run cannot use; ``str()`` is one line starting with the recipe key (``data.path: ...``)."""


def cache_root(data) -> Path:
    """``data.cache``, else $XFW_CACHE_DIR, else ~/.cache/xfw/data."""
    if data.cache:
        return Path(data.cache)
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    return Path.home() / ".cache" / "xfw" / "data"


def image_path(root: Path, name: str) -> Path:
    """The image ``name`` names under ``root``. A name is a relative path inside the root: an absolute
    path, a ``..`` component, a NUL or a lone surrogate is refused (ValueError saying which), so a data
    file cannot make xfw read files elsewhere by naming them. A symbolic link inside the root is
    followed wherever it leads (the root's owner made it; data sets often link their image folders in):
    :func:`leaves_root` counts those, and the count is in the preparation's statistics."""
    if not is_text(name) or "\x00" in name:
        raise ValueError("is not a file name")
    pure = Path(name)
    if pure.is_absolute() or name.startswith("~"):
        raise ValueError("is an absolute path; image paths are relative to the image root")
    if ".." in pure.parts:
        raise ValueError("holds '..'; image paths must stay inside the image root")
    return root / pure


def leaves_root(root: Path, path: Path) -> bool:
    """Whether ``path`` (under ``root``) resolves, through symbolic links, to a file outside it."""
    try:
        return not path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a symlink loop
        return True


def is_text(value) -> bool:
    """A str that is text: encodable as UTF-8 (no lone surrogate such as ``"\\ud800"``, which JSON
    allows and no tokenizer or file system takes)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_DIGESTS: dict[tuple, str] = {}


def file_digest(path: Path) -> str:
    """sha256 of a file's content, remembered per (path, size, mtime) for this process."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


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


def prepare(recipe, arch: dict) -> dict:
    """The recipe's data prepared (or found prepared): ``{"directory": str, "stats": dict}``.
    Raises DataError for data the run cannot use."""
    from xfw.run.data import captions, conversations

    data = recipe.data
    builder = {"llava_json": conversations, "image_captions": captions}[data.kind]
    for key in ("path", "image_root", "tokenizer", "cache"):
        if "\x00" in (getattr(data, key) or ""):
            raise DataError(f"data.{key}: {getattr(data, key)!r} holds a NUL character")
    path = Path(data.path)
    if not path.is_file():
        raise DataError(f"data.path: {path}: no such file")
    # Within one command (one process) a preparation is looked up once; images are not stat'ed again.
    watched = [path] + ([Path(data.tokenizer) / n for n in ("tokenizer.json", "tokenizer_config.json")]
                        if data.tokenizer else [])
    stamps = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in watched if p.is_file()]
    memo = json.dumps([settings_key(recipe, arch), stamps, data.image_root, data.tokenizer, str(cache_root(data))],
                      sort_keys=True, default=str)
    if memo in _PREPARED:
        return _PREPARED[memo]
    plan = builder.plan(recipe, arch)  # reads the data file, checks what needs no preprocessing
    key_source = {"settings": settings_key(recipe, arch), "files": plan.fingerprints}
    key = hashlib.sha256(json.dumps(key_source, sort_keys=True).encode()).hexdigest()[:24]
    directory = cache_root(data) / f"{data.kind}-{key}"
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
        try:
            index = builder.build(plan, directory)
        except OSError as err:
            raise DataError(f"data.cache: cannot write the prepared data to {directory.parent} "
                            f"({err.strerror or err})") from None
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
