"""Adapters die with the xfw command that started them.

The launcher starts every adapter in a process group of its own (so a timeout can stop torchrun
and all its workers at once) and names itself in the environment::

    XFW_PARENT=<pid>:<start time in clock ticks>      (set by xfw.run.launch.launcher)

:func:`watch_parent` (called by every process an adapter runs: the harness's entry point, each
rank included) starts a daemon thread that looks once a second whether that process still exists;
when it is gone — killed by SIGKILL, by the OOM killer, by a node agent — the thread sends SIGTERM
to its whole process group (and to every descendant that left the group), then SIGKILL. No orphan keeps training and no resumed command measures
beside one. The check reads ``/proc``: no host sync, no cost inside a training step beyond a
thread waking once a second.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

ENV = "XFW_PARENT"
POLL_S = 1.0
GRACE_S = 5.0


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); None if
    there is no such process or it has ended (a zombie waiting to be reaped). With the pid it names
    one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    if len(fields) <= 19 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def identity(pid: int | None = None) -> str:
    """``pid:start`` of this process (or ``pid``), the value of :data:`ENV`."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{process_start_time(pid)}"


def is_alive(ident: str) -> bool:
    """Whether the process named by ``pid:start`` still runs (the same process, not a reused pid)."""
    pid, _, start = ident.partition(":")
    try:
        return str(process_start_time(int(pid))) == start
    except ValueError:
        return False


def descendants(pid: int | None = None) -> list[int]:
    """Every living process below ``pid`` (default: this one) by parent links in ``/proc``, whatever
    process group or session it moved to (a daemon's ``setsid()``), zombies left out. Orphans of a
    dead child are found only while this process is their subreaper (:func:`become_subreaper`)."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its descendants' orphans (Linux ``prctl``): a child that forks a
    daemon and exits leaves the daemon below this process, where :func:`descendants` finds it, instead
    of under init. False where the kernel refuses (not Linux)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def end_descendants(grace_s: float = 2.0) -> int:
    """SIGTERM every descendant of this process, SIGKILL those left after ``grace_s``; reaps what it
    can. Returns how many there were."""
    first = descendants()
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        left = descendants()
        if not left:
            break
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and descendants():
            _reap()
            time.sleep(0.05)
    _reap()
    return len(first)


def _reap() -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _end_group() -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in descendants():  # those that left the group (setsid) first: the group's end ends this one
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        try:
            os.killpg(os.getpgrp(), sig)
        except OSError:
            return
        time.sleep(GRACE_S)


def watch_parent(environ: dict | None = None) -> threading.Thread | None:
    """Start the watch if the environment names an xfw parent; returns the thread (None if not).
    A parent already gone (killed while this process was starting) ends the group at once."""
    ident = (environ if environ is not None else os.environ).get(ENV)
    if not ident:
        return None

    def watch() -> None:
        while is_alive(ident):
            time.sleep(POLL_S)
        _end_group()

    thread = threading.Thread(target=watch, name="xfw-lifeline", daemon=True)
    thread.start()
    return thread
