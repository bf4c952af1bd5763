"""One command at a time per output directory (and one build of an environment at a time: :func:`wait_for`).

Every command that writes runs (run, compare, sweep, maxbatch, parity, nightly) holds an exclusive
lock on its output directory for as long as it lives; a second command aimed at the same directory
refuses at once and says who holds it::

    with hold(Path("runs/demo"), "xfw compare recipes/tiny/llava_sft.yaml"):
        ...
    # meanwhile, elsewhere:
    # LockedError: runs/demo is in use by pid 4242 (xfw compare recipes/tiny/llava_sft.yaml), since 2026-11-23T17:40:02Z

The lock is ``fcntl.flock`` on ``DIR/.xfw.lock``: the kernel releases it when the holder exits,
however it exits (SIGKILL included), so a stale lock never blocks the next command. The file also
records the holder (pid, command, start) for that message.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Callable, Iterator

LOCK_FILE = ".xfw.lock"


class LockedError(RuntimeError):
    """Another command holds the directory; the message names it."""


class OutError(LockedError):
    """The directory cannot be created or written (a file of that name, no permission, a name too long)."""


@contextlib.contextmanager
def hold(directory: Path, command: str | None = None, *, node_rank: int | None = None) -> Iterator[None]:
    """Hold ``directory`` (created if missing) until the block ends; LockedError if another holds it.
    ``command`` names the holder in the other's message (default: this process's command line).
    ``node_rank``: one node of a multi-node run, whose nodes share the directory (a shared filesystem)
    and each hold their own lock (``.xfw.lock.node-R``), never a single-node command's."""
    command = command or shlex.join(["xfw", *sys.argv[1:]])
    path = directory / (LOCK_FILE if node_rank is None else f"{LOCK_FILE}.node-{node_rank}")
    with _out_error(directory):
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LockedError(f"{directory} is in use by {_holder(path)}; wait for it to finish or choose "
                              "another --out") from None
        _record_holder(fd, command)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def wait_for(path: Path, waiting: Callable[[str], None]) -> Iterator[None]:
    """Hold the lock file ``path`` (created, with its directory, if missing) until the block ends, waiting
    for another holder to finish; ``waiting`` is told once, naming the holder, when it has to wait. For
    work a second command must not repeat or undo (two commands building one environment)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waiting(_holder(path))
            fcntl.flock(fd, fcntl.LOCK_EX)
        _record_holder(fd, shlex.join(["xfw", *sys.argv[1:]]))
        yield
    finally:
        os.close(fd)  # releases the lock


def _record_holder(fd: int, command: str) -> None:
    """Write who holds the lock (pid, command, since) into its file, for the message of whoever waits."""
    holder = {"pid": os.getpid(), "command": command,
              "since": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)


@contextlib.contextmanager
def _out_error(directory: Path) -> Iterator[None]:
    try:
        yield
    except (OSError, ValueError) as err:  # a file there, read-only, a name too long, a NUL
        why = ("a file, not a directory" if isinstance(err, FileExistsError) else
               "a file where a directory should be" if isinstance(err, NotADirectoryError) else
               getattr(err, "strerror", None) or err)
        raise OutError(f"{directory}: cannot be used as an output directory ({why})") from None


def writable_dir(directory: Path) -> Path:
    """``directory``, created if missing and checked writable (a command that writes reports without
    holding the lock: ``xfw report --out``); OutError naming why not."""
    with _out_error(directory):
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    return directory


def held_by(directory: Path) -> str | None:
    """Who holds ``directory``'s lock now (a live command writing runs there), else None. Checked with a
    shared ``flock`` that is released at once; a directory without a lock file is not held."""
    path = directory / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(path)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def _holder(path: Path) -> str:
    from xfw.contract.atomic import UnreadableFile, read_bounded

    try:
        data = json.loads(read_bounded(path, 1 << 16).decode("utf-8"))
        return f"pid {data['pid']} ({data['command']}), since {data['since']}"
    except (OSError, ValueError, KeyError, TypeError, UnreadableFile):
        return "another xfw command"
