"""Adapters die with the xfw command that started them.

The launcher starts every adapter in a process group of its own (so a timeout can stop torchrun
and all its workers at once) and names itself in the environment::

    XFW_PARENT=<pid>:<start time in clock ticks>      (set by xfw.run.launcher)

:func:`watch_parent` (called by every process an adapter runs: the harness's entry point, each
rank included) starts a daemon thread that looks once a second whether that process still exists;
when it is gone — killed by SIGKILL, by the OOM killer, by a node agent — the thread sends SIGTERM
to its whole process group, then SIGKILL. No orphan keeps training and no resumed command measures
beside one. The check reads ``/proc``: no host sync, no cost inside a training step beyond a
thread waking once a second.
"""

from __future__ import annotations

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


def _end_group() -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
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
