"""A command xfw runs, started under a guard that ends it when xfw ends.

xfw's adapters run the lifeline themselves (:mod:`xfw.contract.lifeline`); a user's command does
not, and may not be Python at all. So the launcher starts the guard as the leader of the run's
process group, and the guard starts the command in that group::

    python -c "...; from xfw.run.launch.guard import main; ..." -- torchrun --nproc_per_node=8 train.py ...

The guard watches the xfw process (the lifeline: it ends the whole group within seconds of xfw's
death, SIGKILL included), waits for the command and exits as it did (the same code, or the same
signal). The guard is the subreaper of everything below it (``prctl(PR_SET_CHILD_SUBREAPER)``): when
the command has ended, whatever it left running, a daemon in its own session included, is ended
too (SIGTERM, then SIGKILL), so no process outlives ``xfw run``. The launcher's SIGTERM on timeout reaches the command directly (one group); the guard
keeps waiting for it so the launcher's wait covers the command's shutdown, and SIGKILL after the
grace period ends both.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

from xfw.contract import lifeline


END_GRACE_S = 3.0
"""How long what the command left running gets after SIGTERM before SIGKILL (under the launcher's 10 s)."""


ESCAPED_KILL_S = 6.0
"""After the launcher's SIGTERM (a timeout, a stop), descendants outside the group get SIGKILL this much
later, before the launcher's SIGKILL (10 s) ends the group and this guard with it."""


def _signal_escaped(sig: int) -> None:
    """``sig`` to every descendant that left this process group (the launcher's signals reach only the group)."""
    group = os.getpgrp()
    for pid in lifeline.descendants():
        with contextlib.suppress(OSError):
            if os.getpgid(pid) != group:
                os.kill(pid, sig)


def _on_term(signum, frame) -> None:
    _signal_escaped(signal.SIGTERM)
    timer = threading.Timer(ESCAPED_KILL_S, _signal_escaped, (signal.SIGKILL,))
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "--" or len(args) < 2:
        print("usage: guard -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    lifeline.become_subreaper()  # a daemon the command forks (setsid, double fork) stays below this process
    lifeline.watch_parent()
    signal.signal(signal.SIGTERM, _on_term)  # the command got it too (one group); wait for it
    try:
        proc = subprocess.Popen(args[1:])  # same directory, environment, stdio and process group
    except OSError as err:
        print(f"cannot start {args[1]}: {err.strerror or err}", file=sys.stderr)
        return 127
    code = proc.wait()
    # The command is over: nothing it started may outlive it (a child in its own group or session
    # included); the launcher's wait covers this, within its grace period.
    lifeline.end_descendants(grace_s=END_GRACE_S)
    if code < 0:  # killed by a signal: end the same way, so the launcher sees which
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code
