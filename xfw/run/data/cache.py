"""Writing a prepared data set in the format ``xfw.contract.batches`` reads, atomically.

Samples are appended one at a time (each field's values to a raw file, so a data set larger than
memory streams through); :meth:`CacheWriter.finish` turns each raw file into a ``.npy`` (header,
then the raw bytes), writes the offsets, shapes and ``index.json``, and renames the whole
temporary directory into place. A directory that is there is complete: a killed preparation
leaves only a ``.tmp-*`` directory, which the next one ignores and a later one removes.
"""

from __future__ import annotations

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
        self.tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
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
        """Complete the directory and move it into place; returns the target."""
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
        write_json_atomic(self.tmp / INDEX_FILE, {"format": FORMAT, "num_samples": self.count,
                                                   "fields": {n: {"dtype": f["dtype"]} for n, f in self.fields.items()},
                                                   **index})
        try:
            os.rename(self.tmp, self.target)
        except OSError:
            if not (self.target / INDEX_FILE).exists():
                raise
            shutil.rmtree(self.tmp, ignore_errors=True)  # another preparation of the same key won
        return self.target

    def abandon(self) -> None:
        for field in self.fields.values():
            field["raw"].close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def read_stats(directory: Path) -> dict | None:
    """The index of a complete prepared directory, or None if it is not there (or not complete)."""
    try:
        return json.loads((directory / INDEX_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
