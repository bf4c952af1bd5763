"""A backend's ``--describe`` answer kept for the next command that asks the same question — only when
``XFW_DESCRIBE_CACHE`` names a directory (the test suite sets one per test run: its ~300 xfw commands would
otherwise start every framework once more per command only to hear the same description).

The answer is reused only for the same question: the same interpreter path and adapter module, the same
adapter source files (path, size, mtime of every file), the same installed packages (the environment's
site-packages directory's mtime changes when one is added or removed) and the same process environment
(every variable but :data:`VOLATILE`: pytest's names for the test and for the worker running it). Anything else
asks the adapter again. Without the variable, nothing is kept and every command describes afresh (what users get).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from xfw.contract.atomic import write_json_atomic

VARIABLE = "XFW_DESCRIBE_CACHE"
VOLATILE = frozenset({"PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER"})


def _stat_line(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return f"{path} missing"
    return f"{path} {st.st_size} {st.st_mtime_ns}"


def key(python: str, module: str, adapter_dir: Path) -> str:
    """The question, as one digest (module docstring)."""
    interpreter = Path(python).absolute()
    parts = [str(interpreter), module, _stat_line(interpreter)]
    parts += [_stat_line(p) for p in sorted(interpreter.parent.parent.glob("lib/python*/site-packages"))]
    parts += [_stat_line(p) for p in sorted(adapter_dir.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    parts += [f"{k}={v}" for k, v in sorted(os.environ.items()) if k not in VOLATILE]
    return hashlib.sha256("\n".join(parts).encode("utf-8", "surrogateescape")).hexdigest()


def cache_file(python: str, module: str, adapter_dir: Path) -> Path | None:
    """Where this question's answer is kept, or None when no cache is asked for."""
    where = os.environ.get(VARIABLE)
    return Path(where) / f"{key(python, module, adapter_dir)}.json" if where else None


def recall(path: Path | None) -> dict | None:
    """The kept answer, or None (none kept, or unreadable: then the adapter is asked again)."""
    if path is None:
        return None
    try:
        answer = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return answer if isinstance(answer, dict) else None


def keep(path: Path | None, description: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, description)
