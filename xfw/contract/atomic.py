"""Atomic file writes: a reader (or a process killed mid-write) sees the old file or the new
one, never half of one. Every JSON and text result xfw writes goes through here::

    write_json_atomic(run_dir / "summary.json", result.to_dict())

The data is written to a temporary file in the same directory, flushed to disk, then renamed
over the target (``os.replace`` is atomic within one file system).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o644)  # mkstemp makes 0600; results are meant to be shared
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")
