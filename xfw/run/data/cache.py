"""Writing a prepared data set in the format ``xfw.contract.batches`` reads, atomically.

Samples are appended one at a time (each field's values to a raw file, so a data set larger than
memory streams through); :meth:`CacheWriter.finish` turns each raw file into a ``.npy`` (header,
then the raw bytes), writes the offsets, shapes and ``index.json``, and renames the whole
temporary directory into place. A directory that is there is complete: a killed preparation
leaves only a ``.tmp-*`` directory, which the next preparation in the same cache removes (a
temporary directory is locked, ``flock`` on the directory itself, while its preparation lives, so
a preparation running beside it is never disturbed); one that fails (a full disk) removes its own.

``index.json`` records every file's size and sha256 as the preparation wrote it (``files``);
:func:`verify` checks them before a run trusts the directory, so a file overwritten, truncated or
removed since (NaN written into ``pixel_values.npy``, half the entry deleted) is found, and the
entry is prepared again (:func:`xfw.run.data.prepare`) instead of trained on.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from xfw.contract.atomic import write_json_atomic
from xfw.contract.batches import FORMAT, INDEX_FILE


class CacheWriter:
    def __init__(self, target: Path):
        self.target = target
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned(target.parent)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-", dir=target.parent))
        self._lock = os.open(self.tmp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX)  # held until the directory is renamed or removed
        except OSError:  # a file system without locks: the cleaner cannot lock it either, and leaves it
            pass
        self.fields: dict[str, dict] = {}
        self.count = 0

    def add(self, sample: dict[str, np.ndarray]) -> None:
        if self.fields and set(sample) != set(self.fields):
            raise ValueError(f"sample {self.count} has fields {sorted(sample)}, the others {sorted(self.fields)}")
        for name, value in sample.items():
            value = np.asarray(value, order="C")  # ascontiguousarray would make a 0-d value 1-d
            if name not in self.fields:
                self.fields[name] = {"dtype": value.dtype.str, "ndim": value.ndim, "offsets": [0], "shapes": [],
                                     "raw": open(self.tmp / f"{name}.raw", "wb")}
            field = self.fields[name]
            if value.dtype.str != field["dtype"] or value.ndim != field["ndim"]:
                raise ValueError(f"sample {self.count}: field {name!r} is {value.dtype}/{value.ndim}-D, "
                                 f"the others {field['dtype']}/{field['ndim']}-D")
            field["raw"].write(value.tobytes())
            field["offsets"].append(field["offsets"][-1] + value.size)
            field["shapes"].append(value.shape)
        self.count += 1

    def finish(self, index: dict) -> Path:
        """Complete the directory and move it into place; returns the target. A failure (a full
        disk) removes the temporary directory and raises."""
        try:
            return self._finish(index)
        except BaseException:
            self.abandon()
            raise

    def _finish(self, index: dict) -> Path:
        for name, field in self.fields.items():
            field["raw"].close()
            raw = self.tmp / f"{name}.raw"
            header = {"descr": field["dtype"], "fortran_order": False, "shape": (field["offsets"][-1],)}
            with open(self.tmp / f"{name}.npy", "wb") as out, open(raw, "rb") as src:
                np.lib.format.write_array_header_1_0(out, header)
                shutil.copyfileobj(src, out, 1 << 24)
                out.flush()
                os.fsync(out.fileno())
            raw.unlink()
            np.save(self.tmp / f"{name}.offsets.npy", np.asarray(field["offsets"], np.int64))
            np.save(self.tmp / f"{name}.shapes.npy", np.asarray(field["shapes"], np.int64).reshape(self.count,
                                                                                                field["ndim"]))
        files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(self.tmp.iterdir())}
        content = {"format": FORMAT, "num_samples": self.count,
                   "fields": {n: {"dtype": f["dtype"]} for n, f in self.fields.items()}, "files": files, **index}
        write_json_atomic(self.tmp / INDEX_FILE, {**content, INDEX_DIGEST: _index_digest(content)})
        try:
            os.rename(self.tmp, self.target)
        except OSError:
            if read_stats(self.target) is None:
                raise
            shutil.rmtree(self.tmp, ignore_errors=True)  # another preparation of the same key won
        os.close(self._lock)
        self._lock = None
        return self.target

    def abandon(self) -> None:
        for field in self.fields.values():
            field["raw"].close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


TMP_PREFIX = ".tmp-"


def remove_abandoned(cache: Path) -> list[Path]:
    """Remove the ``.tmp-*`` directories in ``cache`` that no living preparation holds (killed ones,
    SIGKILL or a power cut); returns them."""
    removed = []
    for tmp in cache.glob(f"{TMP_PREFIX}*"):
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a preparation is writing it (or locks do not work here: left alone)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
        finally:
            os.close(fd)
    return removed


def discard(directory: Path) -> None:
    """Remove a prepared directory: renamed away first (one step, so no reader sees half of it), then deleted."""
    doomed = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}discarded-{directory.name}-", dir=directory.parent))
    try:
        os.rename(directory, doomed / directory.name)
    finally:
        shutil.rmtree(doomed, ignore_errors=True)


INDEX_DIGEST = "index_sha256"
"""The key of index.json holding the sha256 of the rest of it (its counts and statistics are checked too)."""


def _index_digest(content: dict) -> str:
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_stats(directory: Path) -> dict | None:
    """The index of a complete prepared directory, or None if it is not there (or not complete)."""
    try:
        index = json.loads((directory / INDEX_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return index if isinstance(index, dict) else None


def verify(directory: Path, index: dict) -> str | None:
    """Why the directory is not what its preparation wrote (a file missing, of another size, or of
    another sha256 than ``index["files"]`` records; an index without that record), or None.
    Reads every file once (sha256 at disk speed; about 1 s per GB here)."""
    files = index.get("files")
    if not isinstance(files, dict) or not files or not isinstance(index.get("stats"), dict):
        return f"{INDEX_FILE} records no file digests (written by an older xfw, or not by xfw)"
    if index.get(INDEX_DIGEST) != _index_digest({k: v for k, v in index.items() if k != INDEX_DIGEST}):
        return f"{INDEX_FILE} differs from what its preparation wrote ({INDEX_DIGEST})"
    for name, facts in sorted(files.items()):
        path = directory / name
        if not isinstance(facts, dict) or "/" in name or name in ("", ".", ".."):
            return f"{INDEX_FILE}: files.{name} is malformed"
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != facts.get("bytes"):
            return f"{name} holds {size} bytes, its preparation wrote {facts.get('bytes')}"
        if _sha256(path) != facts.get("sha256"):
            return f"{name} differs from what its preparation wrote (sha256)"
    return None
