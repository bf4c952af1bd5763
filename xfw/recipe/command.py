"""Backends that run a training command instead of one of xfw's models.

A recipe may give a backend a command; ``model``, ``stage``, ``batch`` and ``measure`` still
describe the workload (labels, MFU, the expected world size, warm-up and measured steps)::

    backends:
      paddle: {command: [/opt/pd/bin/python, tools/supervised_finetune.py, cfg.json], cwd: /src/PaddleMIX,
               env: {FLAGS_use_cuda_managed_memory: "1"}}
      torch:  {command: [torchrun, --nproc_per_node=8, llava/train/train_mem.py, ...], cwd: /src/LLaVA}
      other:  {command: [./train.sh], log_pattern: {ips: 'ips: ([0-9.]+)'}}

* ``command``: the argument list, run as is (no shell). A first item with a ``/`` is a path
  relative to ``cwd``; a bare name is looked up on ``PATH``. Either must exist when the recipe loads.
* ``cwd``: where it runs; relative to the recipe file; default: the recipe file's directory.
* ``env``: variables added to xfw's environment (strings only; ``PYTHONPATH`` is kept behind xfw's
  probe directories; names beginning with ``XFW_`` are xfw's).
* ``log_pattern``: the fallback for commands xfw cannot hook (:mod:`xfw.run.logparse`); without it
  the command runs under xfw's probe (:mod:`xfw.contract.probe`).

``--set backends.torch.command.3=--max_steps=40`` replaces one item, ``--set
backends.torch.env.NCCL_DEBUG=INFO`` sets a variable. Every check runs when the recipe loads; an
error is one line naming the key (``backends.torch.cwd: /src/LLaVA is not a directory``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from xfw.contract import probe
from xfw.contract.atomic import write_text_atomic
from xfw.run import logparse

if TYPE_CHECKING:
    from xfw.run.recipe import Recipe

KEYS = ("command", "cwd", "env", "log_pattern")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_ENV_VALUE_BYTES = 32 * 1024
"""Longest value of one variable a recipe sets (Linux's own limit per string is 128 KiB)."""
MAX_ENV_BYTES = 256 * 1024
"""All of one backend's variables together (the kernel's limit covers arguments and environment: ~2 MiB)."""
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class CommandError(ValueError):
    """A command backend's setting that cannot run; ``key`` is its dotted path in the recipe."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True, kw_only=True)
class Command:
    """A command backend's settings, checked (``cwd`` absolute)."""

    argv: list[str]
    cwd: str
    env: dict[str, str] = field(default_factory=dict)
    log_pattern: logparse.LogPattern | None = None


def takes_text(keys: list[str]) -> bool:
    """Whether a ``--set`` path names one item of a command or one of its variables, whose value
    is the text as typed: ``backends.torch.command.3`` or ``backends.torch.env.NCCL_DEBUG``."""
    return len(keys) == 4 and keys[0] == "backends" and keys[2] in ("command", "env")


def _text(value, key: str) -> str:
    if not isinstance(value, str) or not value or "\0" in value:
        raise CommandError(key, f"must be a non-empty string, got {value!r}")
    return value


def _executable(argv0: str, cwd: Path, env: dict[str, str], key: str) -> None:
    if "/" in argv0:
        path = cwd / argv0
        if not path.is_file() or not os.access(path, os.X_OK):
            raise CommandError(key, f"{argv0}: no executable file there (looked for {path})")
    elif shutil.which(argv0, path=env.get("PATH", os.environ.get("PATH"))) is None:
        raise CommandError(key, f"no executable {argv0!r} on PATH")


def check_env(prefix: str, env) -> dict[str, str]:
    """``backends.NAME.env``: variable names a recipe may set (never xfw's own ``XFW_*``), string values."""
    if not isinstance(env, dict):
        raise CommandError(f"{prefix}.env", f"must be a mapping of NAME: \"value\", got {env!r}")
    for key, value in env.items():
        if not isinstance(key, str) or not ENV_NAME.fullmatch(key) or key.startswith("XFW_"):
            raise CommandError(f"{prefix}.env", f"{key!r} is not a variable name a recipe may set")
        if not isinstance(value, str) or "\0" in value:
            raise CommandError(f"{prefix}.env.{key}", f"must be a string, got {str(value)[:80]!r} "
                                                      f"(quote it: \"{str(value)[:80]}\")")
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError as err:
            raise CommandError(f"{prefix}.env.{key}", f"holds {value[err.start]!r} at {err.start}, a lone surrogate: "
                                                      "not text a process environment can carry") from None
        if size > MAX_ENV_VALUE_BYTES:
            raise CommandError(f"{prefix}.env.{key}", f"{size:,} bytes long; a variable is at most "
                                                      f"{MAX_ENV_VALUE_BYTES:,} (Linux refuses longer ones at launch)")
    total = sum(len(k) + len(v.encode("utf-8")) + 2 for k, v in env.items())
    if total > MAX_ENV_BYTES:
        raise CommandError(f"{prefix}.env", f"{total:,} bytes of variables; at most {MAX_ENV_BYTES:,}")
    return dict(env)


def check(name: str, knobs: dict, base_dir: Path) -> dict:
    """A command backend's knobs, validated, with ``cwd`` made absolute (what spec.json records)."""
    prefix = f"backends.{name}"
    unknown = sorted(set(knobs) - set(KEYS))
    if unknown:
        raise CommandError(f"{prefix}.{unknown[0]}", f"unknown key (a command backend takes: {', '.join(KEYS)})")
    argv = knobs["command"]
    if not isinstance(argv, list) or not argv:
        raise CommandError(f"{prefix}.command", f"must be a non-empty list of strings, got {argv!r}")
    argv = [_text(item, f"{prefix}.command.{i}") for i, item in enumerate(argv)]
    cwd = Path(_text(knobs.get("cwd", "."), f"{prefix}.cwd")).expanduser()
    cwd = (base_dir / cwd).resolve()
    if not cwd.is_dir():
        raise CommandError(f"{prefix}.cwd", f"{cwd} is not a directory")
    env = check_env(prefix, knobs.get("env", {}))
    _executable(argv[0], cwd, env, f"{prefix}.command.0")
    out = {"command": argv, "cwd": str(cwd), "env": dict(env)}
    if "log_pattern" in knobs:
        try:
            logparse.LogPattern.parse(knobs["log_pattern"])
        except logparse.PatternError as err:
            raise CommandError(f"{prefix}.log_pattern{'.' + err.key if err.key else ''}", str(err)) from None
        out["log_pattern"] = knobs["log_pattern"]
    return out


def resolve(recipe: "Recipe", base_dir: Path) -> "Recipe":
    """The recipe with every command backend checked and its ``cwd`` absolute; CommandError otherwise."""
    backends = dict(recipe.backends)
    for name, knobs in recipe.backends.items():
        stray = [k for k in ("cwd", "log_pattern") if k in knobs]
        if "command" not in knobs:
            if stray:
                raise CommandError(f"backends.{name}.{stray[0]}", "only with backends.{name}.command".format(name=name))
            if "env" in knobs:  # xfw's own adapter's variables (the launcher passes them to every rank)
                check_env(f"backends.{name}", knobs["env"])
            continue
        backends[name] = check(name, knobs, base_dir)
        if "log_pattern" not in knobs and recipe.measure.warmup_steps < 1:
            raise CommandError("measure.warmup_steps", f"must be at least 1 with backends.{name}.command: the "
                               "measured window opens at the end of a warm-up step")
    return dataclasses.replace(recipe, backends=backends)


def command_of(recipe: "Recipe", backend: str) -> Command | None:
    """The command a backend runs in this recipe (checked when the recipe loaded), or None: xfw's adapter."""
    knobs = recipe.backends.get(backend, {})
    if "command" not in knobs:
        return None
    pattern = logparse.LogPattern.parse(knobs["log_pattern"]) if "log_pattern" in knobs else None
    return Command(argv=list(knobs["command"]), cwd=knobs["cwd"], env=dict(knobs.get("env", {})),
                   log_pattern=pattern)


def is_command(recipes: list["Recipe"], backend: str) -> bool:
    """Whether ``backend`` runs a command in every one of ``recipes`` (then it needs no interpreter)."""
    return bool(recipes) and all(command_of(r, backend) is not None for r in recipes)


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


GUARD = ("import sys; sys.path.insert(0, {root!r}); from xfw.run.guard import main; sys.exit(main())")


def invocation(command: Command, spec_path: Path, records_path: Path) -> Invocation:
    """The command under xfw's guard (:mod:`xfw.run.guard`: it ends with xfw), with the probe's
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
