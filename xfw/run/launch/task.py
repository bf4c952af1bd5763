"""A short subprocess xfw starts for a check or a build (an interpreter's ``--describe``, an export,
``python -m venv``, ``pip install``): it runs under xfw's guard (:mod:`xfw.run.launch.guard`) as the leader
of a process group of its own, so that whatever it starts ends with it::

    code, out, err = run_task([python, "-m", "xfw_paddle", "--describe"], timeout_s=180)

* a timeout, an exception or Ctrl-C in xfw: SIGTERM to the whole group, SIGKILL 2 s later;
* xfw killed (SIGKILL included): the guard's lifeline ends the group within about a second;
* the task ended: whatever it left in its group, or below it elsewhere (the guard is their subreaper),
  is ended before :func:`run_task` returns.

:class:`TaskTimeout` says the task ran past ``timeout_s`` (nothing of it is left running).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[3]
_GUARD = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from xfw.run.launch.guard import main; sys.exit(main())"
TERM_GRACE_S = 2.0
"""After SIGTERM, how long the group gets before SIGKILL."""


class TaskTimeout(Exception):
    """The task ran past its time and was ended with everything it started."""


def end_group(proc: subprocess.Popen, grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM then (after ``grace_s``, if anything is left) SIGKILL to ``proc``'s process group."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return


def run_task(cmd: list[str], *, timeout_s: float, env: dict[str, str] | None = None,
             on_line: Callable[[str], None] | None = None) -> tuple[int, str, str]:
    """Run ``cmd`` (stdin closed) and return (exit code, stdout, stderr); with ``on_line``, stderr is
    merged into stdout and each line goes to ``on_line`` as it comes. OSError when it cannot start;
    :class:`TaskTimeout` past ``timeout_s``."""
    from xfw.contract import lifeline

    env = {**(os.environ if env is None else env), lifeline.ENV: lifeline.identity()}  # the guard watches xfw
    proc = subprocess.Popen([sys.executable, "-c", _GUARD, "--", *cmd], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if on_line else subprocess.PIPE,
                            text=True, errors="replace", env=env, start_new_session=True)
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        end_group(proc)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    try:
        if on_line is not None:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                on_line(line)
            out, err = "".join(lines), ""
        else:
            out, err = proc.communicate()
        code = proc.wait()
    finally:
        timer.cancel()
        end_group(proc, grace_s=0.5)  # anything the task left in its group (or all of it, on an exception)
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()
    if expired.is_set():
        raise TaskTimeout(f"`{' '.join(cmd)[:200]}` took over {timeout_s:g} s; it was ended with everything it started")
    said = (err or out).strip()
    if code == 127 and said.startswith("cannot start "):  # the guard could not start the command
        raise OSError(said.splitlines()[0])
    return code, out, err
