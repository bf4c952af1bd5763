"""A command backend run under xfw (:mod:`xfw.recipe.command` holds what the recipe declares): what the
launcher starts (:func:`invocation`: the command under xfw's guard, with the probe's variables), how its
records are verified as the probe's own (:func:`verify_records`), when it has ended (:class:`Ending`), and
what its outcome is called (:func:`refine`). Given a checked :class:`~xfw.recipe.command.Command`;
returns what the launcher runs and records."""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from xfw.contract import probe
from xfw.contract.atomic import write_text_atomic
from xfw.recipe.command import Command
from xfw.run.launch import logparse

PROJECT_ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True, kw_only=True)
class Invocation:
    """What the launcher starts: the argument list, variables added to its environment, where, and
    what env.json records about it."""

    argv: list[str]
    facts: dict
    """env.json's ``backend``: an adapter's ``--describe`` answer, or the command, cwd and env."""
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    log: logparse.LogPattern | None = None
    interpreter: str | None = None
    attached: bool = False
    """A command xfw attached to (else xfw's own adapter)."""


def probe_env(spec_path: Path, records_path: Path, pythonpath: str, root: Path = PROJECT_ROOT) -> dict[str, str]:
    """The variables that start xfw's probe in every Python process of a command: its site directory
    first on PYTHONPATH, then xfw and each adapter's directory (its framework hooks), then ``pythonpath``."""
    hooks = sorted(root.glob("adapters/*/xfw_*/probe.py"))
    paths = [str(probe.SITE_DIR), str(root), *(str(h.parent.parent) for h in hooks)]
    # Absolute: the command runs in its own directory, not in xfw's.
    return {probe.ENV_SPEC: str(spec_path.resolve()), probe.ENV_RECORDS: str(records_path.resolve()),
            probe.ENV_HOOKS: ",".join(f"{h.parent.name}.probe" for h in hooks),
            probe.ENV_TOKEN: secrets.token_hex(16),  # this run's: records without it are not the probe's
            "PYTHONPATH": os.pathsep.join(paths + ([pythonpath] if pythonpath else []))}


GUARD = ("import sys; sys.path.insert(0, {root!r}); from xfw.run.launch.guard import main; sys.exit(main())")


def invocation(command: Command, spec_path: Path, records_path: Path) -> Invocation:
    """The command under xfw's guard (:mod:`xfw.run.launch.guard`: it ends with xfw), with the probe's
    variables unless a log pattern replaces the probe."""
    env = dict(command.env)
    if command.log_pattern is None:
        env.update(probe_env(spec_path, records_path, env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))))
    argv = [sys.executable, "-c", GUARD.format(root=str(PROJECT_ROOT)), "--", *command.argv]
    facts = {"command": command.argv, "cwd": command.cwd, "env": command.env,
             "measured_by": logparse.NOTE if command.log_pattern else "xfw's probe in the command's processes"}
    return Invocation(argv=argv, facts=facts, env=env, cwd=command.cwd, log=command.log_pattern, attached=True)


def _stamped(line: str, token: str | None) -> dict | None:
    """The record on ``line`` without its stamp if the probe wrote it with ``token``, else None;
    ``token`` None: any record (an adapter's own, which carries no stamp)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if token is None:
        return record if isinstance(record, dict) else None
    if not isinstance(record, dict) or not token or not secrets.compare_digest(str(record.pop(probe.STAMP, "")), token):
        return None
    return record


def verify_records(records_path: Path, token: str) -> None:
    """Keep only the records xfw's probe wrote in this run (stamped with its token), stamps removed;
    any other line in the file (a command writing records of its own) makes the run ``invalid``."""
    try:
        lines = records_path.read_bytes().decode("utf-8", "replace").split("\n")
    except FileNotFoundError:
        return
    kept, foreign = [], 0
    for line in lines:
        if not line.strip():
            continue
        record = _stamped(line, token)
        if record is None:
            foreign += 1
        else:
            kept.append(json.dumps(record, separators=(",", ":")))
    if foreign:
        kept.insert(0, json.dumps({"schema": 1, "kind": "error", "rank": 0, "status": "invalid", "message": (
            f"{foreign} line(s) in {records_path.name} were not written by xfw's probe (no token of this run): "
            "something else in the command writes to XFW_PROBE_RECORDS; nothing it wrote is reported")},
            separators=(",", ":")))
    write_text_atomic(records_path, "".join(line + "\n" for line in kept))


ENDED_GRACE_S = 10.0
"""How long a command may go on after every rank's probe wrote ``end`` before xfw stops it (its
``finally`` blocks and ``atexit`` handlers run in that time; a script that catches SystemExit and
trains on does not run on)."""


ADAPTER_EXIT_GRACE_S = 60.0
"""How long an adapter's launcher may go on after every local rank wrote its ``end`` record before xfw
stops it: long enough for any teardown, short of a launcher that waits on something that will not
come (torchrun's exit barrier waiting up to 300 s for another node's agent; gloo aborting at exit)."""


class Ending:
    """Whether a run is due to be stopped: every rank wrote its ``end`` (or an error) at least
    ``grace_s`` ago (:data:`ENDED_GRACE_S` for a probed command, whose records carry ``token``). The
    launcher polls it, as the log counter."""

    def __init__(self, records_path: Path, token: str | None, num_ranks: int, grace_s: float | None = None):
        self.path, self.token, self.num_ranks = records_path, token, num_ranks
        self.grace_s = ENDED_GRACE_S if grace_s is None else grace_s
        self._offset, self._partial, self._ended, self._since = 0, "", set(), None

    def due(self) -> bool:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(1 << 20)
                self._offset = f.tell()
        except OSError:
            return False
        lines = (self._partial + chunk.decode("utf-8", "replace")).split("\n")
        self._partial = lines.pop()[-65536:]
        for line in lines:
            record = _stamped(line, self.token)
            if record and record.get("kind") in ("end", "error") and isinstance(record.get("rank"), int):
                self._ended.add(record["rank"])
        if self._since is None and len(self._ended) >= self.num_ranks:
            self._since = time.monotonic()
        return self._since is not None and time.monotonic() - self._since >= self.grace_s


def ending(run: Invocation, records_path: Path, num_ranks: int) -> Ending | None:
    """The launcher's check that stops a run once every rank ended: a probed command's soon after, an
    adapter's launcher after :data:`ADAPTER_EXIT_GRACE_S`; None for a command whose log xfw counts."""
    token = run.env.get(probe.ENV_TOKEN)
    if run.attached:
        return Ending(records_path, token, num_ranks) if token else None
    return Ending(records_path, None, num_ranks, grace_s=ADAPTER_EXIT_GRACE_S)


def verified(run: Invocation, records_path: Path) -> None:
    """After a probed command ended: only its probe's records stay (:func:`verify_records`)."""
    token = run.env.get(probe.ENV_TOKEN)
    if run.attached and token:
        verify_records(records_path, token)


def refine(status: str, reason: str, *, exit_code: int | None, records: list[dict], stderr_line: str,
           stopped: bool) -> tuple[str, str]:
    """The launcher's classification of a command run, said for a command: a log-parsed run xfw
    stopped is plainly ok; a command that exited cleanly before any step xfw could see says so; a
    command that failed after some steps is ``crashed`` with its own last words, not ``invalid``."""
    if status == "ok" and stopped:
        return "ok", ""
    if status == "crashed" and exit_code == 0 and not records:
        return "crashed", ("the command exited (code 0) before xfw saw an optimizer step: not a Python training "
                           "command, or one whose steps the probe cannot see (docs/attach.md; "
                           "log_pattern is the fallback)")
    if status == "invalid" and reason.startswith("the command ended after") and exit_code not in (0, None):
        return "crashed", f"{stderr_line or 'no stderr'} (exit code {exit_code}; {reason.split(';')[0]})"
    return status, reason
