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
* ``log_pattern``: the fallback for commands xfw cannot hook (:mod:`xfw.run.launch.logparse`); without it
  the command runs under xfw's probe (:mod:`xfw.contract.probe`).

``--set backends.torch.command.3=--max_steps=40`` replaces one item, ``--set
backends.torch.env.NCCL_DEBUG=INFO`` sets a variable. Every check runs when the recipe loads; an
error is one line naming the key (``backends.torch.cwd: /src/LLaVA is not a directory``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from xfw.run.launch import logparse

KEYS = ("command", "cwd", "env", "log_pattern")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_ENV_VALUE_BYTES = 32 * 1024
"""Longest value of one variable a recipe sets (Linux's own limit per string is 128 KiB)."""
MAX_ENV_BYTES = 256 * 1024
"""All of one backend's variables together (the kernel's limit covers arguments and environment: ~2 MiB)."""


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


def resolve(recipe, base_dir: Path):
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


def command_of(recipe, backend: str) -> Command | None:
    """The command a backend runs in this recipe (checked when the recipe loaded), or None: xfw's adapter."""
    knobs = recipe.backends.get(backend, {})
    if "command" not in knobs:
        return None
    pattern = logparse.LogPattern.parse(knobs["log_pattern"]) if "log_pattern" in knobs else None
    return Command(argv=list(knobs["command"]), cwd=knobs["cwd"], env=dict(knobs.get("env", {})),
                   log_pattern=pattern)


def is_command(recipes: list, backend: str) -> bool:
    """Whether ``backend`` runs a command in every one of ``recipes`` (then it needs no interpreter)."""
    return bool(recipes) and all(command_of(r, backend) is not None for r in recipes)
