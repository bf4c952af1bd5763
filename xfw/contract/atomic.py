"""Atomic file writes, and the strict JSON read that goes with them.

A reader (or a process killed mid-write) sees the old file or the new one, never half of one.
Every JSON and text result xfw writes goes through here, and every JSON file xfw reads back::

    write_json_atomic(run_dir / "summary.json", result.to_dict())
    read_json_object(run_dir / "summary.json")   # {} if missing; UnreadableFile if not a JSON object

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


class UnreadableFile(ValueError):
    """A file that exists but cannot be used; the message is one line naming the file and why."""


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object in ``path``; {} when there is no such file. Garbage, a non-object, NaN or
    Infinity, or text that is not UTF-8 raise :class:`UnreadableFile` naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as err:
        raise UnreadableFile(f"{path}: cannot read ({getattr(err, 'strerror', None) or err})") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except ValueError as err:
        raise UnreadableFile(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise UnreadableFile(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data
