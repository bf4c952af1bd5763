"""Atomic file writes, and the strict JSON read that goes with them.

A reader (or a process killed mid-write) sees the old file or the new one, never half of one.
Every JSON and text result xfw writes goes through here, and every JSON file xfw reads back::

    write_json_atomic(run_dir / "summary.json", result.to_dict())
    read_json_object(run_dir / "summary.json")   # {} if missing; UnreadableFile if not a JSON object

The data is written to a temporary file in the same directory, flushed to disk, then renamed
over the target (``os.replace`` is atomic within one file system).

Every file xfw reads (results, specs, records, recipes, published files, locks) comes through
:func:`read_bounded`: at most a given size, a regular file only (a FIFO would block, ``/dev/zero``
never ends), and a symbolic link only where it stays inside the file's own directory (or the
``within`` directory given). Anything else is one :class:`UnreadableFile` line naming the file.
"""

from __future__ import annotations

import json
import os
import stat
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


def write_json_atomic(path: str | os.PathLike, data: Any, *, compact: bool = False) -> None:
    """``data`` as JSON, indented for a reader, or ``compact`` (a profiler trace of tens of MB: half the
    size, and json's C encoder instead of its pure-Python indenting one)."""
    text = json.dumps(data, separators=(",", ":")) if compact else json.dumps(data, indent=2)
    write_text_atomic(path, text + "\n")


class UnreadableFile(ValueError):
    """A file that exists but cannot be used; the message is one line naming the file and why."""


MAX_READ_BYTES = 64 << 20
"""Largest JSON document read back (a spec, a summary, a selfcheck: each well under 1 MiB)."""


def _size(limit: int) -> str:
    return f"{limit // (1 << 20)} MiB" if limit >= 1 << 20 else f"{limit // 1024} KiB" if limit >= 1024 else f"{limit} B"


def open_checked(path: str | os.PathLike, within: str | os.PathLike | None = None) -> int:
    """A read-only descriptor of ``path``, checked: a regular file (never a FIFO, device or socket,
    opened without blocking), reached through no symbolic link leading out of ``within`` (default:
    the file's own directory). FileNotFoundError when it does not exist; UnreadableFile otherwise."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as err:
        raise UnreadableFile(f"{path}: cannot read ({getattr(err, 'strerror', None) or err})") from None
    if stat.S_ISLNK(st.st_mode):
        base = Path(os.path.realpath(within if within is not None else path.parent))
        try:
            target = Path(os.path.realpath(path, strict=True))
        except FileNotFoundError:
            raise
        except (OSError, RuntimeError) as err:  # a loop (ELOOP)
            raise UnreadableFile(f"{path}: cannot read ({getattr(err, 'strerror', None) or err})") from None
        if not target.is_relative_to(base):
            raise UnreadableFile(f"{path}: a symbolic link out of {base} (to {target}); not read")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as err:
        raise UnreadableFile(f"{path}: cannot read ({getattr(err, 'strerror', None) or err})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise UnreadableFile(f"{path}: {kind}, not a regular file; not read")
    os.set_blocking(fd, True)
    return fd


def read_bounded(path: str | os.PathLike, limit: int = MAX_READ_BYTES, *,
                 within: str | os.PathLike | None = None) -> bytes:
    """The bytes of ``path``, at most ``limit`` of them, through :func:`open_checked`.
    FileNotFoundError when it does not exist; UnreadableFile (one line) for anything else."""
    fd = open_checked(path, within)
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit + 1)
    except OSError as err:
        raise UnreadableFile(f"{path}: cannot read ({err.strerror or err})") from None
    if len(data) > limit:
        raise UnreadableFile(f"{path}: larger than {_size(limit)}; not read")
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object in ``path``; {} when there is no such file. Garbage, a non-object, NaN or
    Infinity, or text that is not UTF-8 raise :class:`UnreadableFile` naming the file."""
    path = Path(path)
    try:
        text = read_bounded(path).decode("utf-8")
    except FileNotFoundError:
        return {}
    except UnicodeDecodeError as err:
        raise UnreadableFile(f"{path}: cannot read ({err})") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except ValueError as err:
        raise UnreadableFile(f"{path}: not valid JSON ({err})") from None
    except RecursionError:
        raise UnreadableFile(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise UnreadableFile(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data
