"""The CLI's terminal: what it prints may go nowhere, and a signal may come before anything runs.

* A reader of stdout or stderr that goes away (``xfw run ... | head -n1``) must not touch a run:
  :func:`echo` and :class:`Display` send what is still written there to /dev/null instead of
  raising BrokenPipeError into the launcher's loop (which would record a healthy run as crashed).
* Ctrl-C or SIGTERM before anything launched (data preparation, recipe checks) ends the command
  with one line and exit 130, as documented, not click's "Aborted!" with 1 or SIGTERM's silent 143:
  :func:`sigterm_is_interrupt` makes SIGTERM a KeyboardInterrupt, :func:`exit_interrupted` says so.

Imported by ``xfw.cli`` at start-up, so it needs nothing but click.
"""

from __future__ import annotations

import os
import signal
import sys

import click


def closed(fd: int) -> None:
    """What is still written to ``fd`` (1 stdout, 2 stderr) goes to /dev/null: its reader went away."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def echo(text: str, *, err: bool = False) -> None:
    try:
        click.echo(text, err=err)
    except BrokenPipeError:
        closed(2 if err else 1)


class Display:
    """A progress display (xfw.run.launch.launcher.Progress) that a closed stderr cannot break."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        method = getattr(self._inner, name)

        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except BrokenPipeError:
                closed(2)
        return call


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def sigterm_is_interrupt() -> None:
    """From now until the click context closes, SIGTERM (cron's timeout, Slurm) is Ctrl-C: a preparation
    it cuts removes its temporary directory (xfw.workflow.guarded keeps it so during runs)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    click.get_current_context().call_on_close(lambda: signal.signal(signal.SIGTERM, previous))


def exit_interrupted() -> None:
    """One line and exit 130: Ctrl-C or SIGTERM outside a run."""
    try:
        click.echo("interrupted (Ctrl-C or SIGTERM)", err=True)
    except OSError:
        pass
    sys.exit(130)
