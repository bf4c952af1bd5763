"""The data's files, read safely: given a data set's root and the names its samples give, the path each names (never
outside the root), whether a value is text, a file's content digest; :class:`DataError` is the one-line refusal.
The package (:mod:`xfw.run.data`) and each data kind's builder read these; they import nothing else of xfw's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


class DataError(ValueError):
    """Data a run cannot use; ``str()`` is one line starting with the recipe key (``data.path: ...``)."""


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
