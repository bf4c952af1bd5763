"""Backend instances: several builds of one adapter in one command (docs/builds.md).

A backend is written ``ADAPTER`` (the default environment, ``.venv/ADAPTER``) or ``ADAPTER@LABEL``:

* ``paddle@3.2.0`` -- a version: xfw builds ``.venv/builds/paddle@3.2.0`` once, from the adapter's own
  requirements with the framework's one pin (the line marked ``# xfw: framework``) replaced;
* ``paddle@/wheels/paddlepaddle-3.2.0-....whl`` or ``paddle@mine=/wheels/x.whl`` -- a wheel file, built the same way;
* ``paddle@nightly-1102=/opt/nightly/bin/python`` -- an interpreter the user gives (or a wrapper script that
  sets variables and execs a Python), used as it is.

The instance's name (``paddle@3.2.0``) is the backend's name everywhere: run directories, reports,
CSV columns, chart legends, ``backends.<name>`` in a recipe. An instance takes its adapter's knobs
(``backends.paddle``) with its own (``backends."paddle@3.2.0"``) on top (:func:`fold`).

A built environment is an overlay: a virtual environment of its own whose ``site-packages`` comes
first and the default environment's after it (one ``.pth`` line), so pip installs only what differs
from the default environment (the framework's wheel and whatever it needs in other versions) and
never touches the default environment (pip does not uninstall outside its own environment).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from xfw.contract.atomic import write_json_atomic
from xfw.recipe.names import MAX_NAME_CHARS
from xfw.run.launch.buildcheck import WHEEL_NAME, pip_error, wheel_problem
from xfw.run.launch.lock import wait_for
from xfw.run.launch.task import TaskTimeout, run_task

PROJECT_ROOT = Path(__file__).resolve().parents[3]
BUILDS_DIR = Path(".venv") / "builds"
"""Where built environments live, under the project root: one directory per instance name."""
BUILD_FILE = "xfw-build.json"
"""In a built environment: what it was built from (requirement, wheel hash, versions, size)."""
FRAMEWORK_MARK = "# xfw: framework"
"""Marks the line of an adapter's requirements.txt that an instance replaces."""
PIP_TIMEOUT_S = 1800

_ADAPTER = re.compile(r"[a-z][a-z0-9_]*")
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_VERSION = re.compile(r"\d+(\.\d+)*([a-z]+\d*)?(\.post\d+)?(\.dev\d+)?(\+[A-Za-z0-9.]+)?")


class InstanceError(ValueError):
    """A backend written wrongly, or an environment that cannot be built; one line."""


@dataclass(frozen=True)
class Instance:
    name: str
    """What every report calls it: ``paddle@3.2.0``; ``paddle`` for the default environment."""
    adapter: str
    """Whose adapter runs it: ``paddle`` (the package ``xfw_paddle``)."""
    label: str = ""
    version: str = ""
    """A framework version xfw builds an environment for."""
    wheel: str = ""
    """A wheel file xfw builds an environment from (absolute)."""
    python: str = ""
    """An interpreter the user gave (absolute): used as it is."""

    @property
    def built(self) -> bool:
        """Whether xfw builds this instance's environment (a version or a wheel)."""
        return bool(self.version or self.wheel)

    @property
    def source(self) -> str:
        """Where it comes from, in words: ``version 3.2.0``, ``wheel /w/x.whl``, ``interpreter /opt/.../python``."""
        if self.version:
            return f"version {self.version}"
        if self.wheel:
            return f"wheel {self.wheel}"
        if self.python:
            return f"interpreter {self.python}"
        return f"the default environment (.venv/{self.adapter})"


def adapter_of(name: str) -> str:
    """``paddle@3.2.0`` -> ``paddle``; a bare name is its own adapter."""
    return name.partition("@")[0]


def parse(text: str, *, flag: str = "--backends") -> Instance:
    """One backend as written on the command line or in a build list; InstanceError names ``flag``."""
    text = text.strip()
    head, at, rest = text.partition("@")
    if not _ADAPTER.fullmatch(head):
        raise InstanceError(f"{flag} {text!r}: {head!r} is not an adapter name (lowercase letters, digits, _)")
    if not at:
        return Instance(name=head, adapter=head)
    label, eq, path = rest.partition("=")
    if not eq and label.endswith(".whl"):  # paddle@/w/paddlepaddle-3.2.0-...whl: named by the wheel's version
        wheel = _wheel_path(label, text, flag)
        label = WHEEL_NAME.fullmatch(wheel.name).group("version")
        _check_length(head, label, text, flag)
        return Instance(name=f"{head}@{label}", adapter=head, label=label, wheel=str(wheel))
    _check_length(head, label, text, flag)
    if not _LABEL.fullmatch(label):
        raise InstanceError(f"{flag} {text!r}: the label {label!r} after @ must be letters, digits and . _ + - "
                            "(a version such as 3.2.0, or a name such as nightly-1102=PATH)")
    name = f"{head}@{label}"
    if eq:
        if not path:
            raise InstanceError(f"{flag} {text!r}: nothing after '=' (give a wheel file or an interpreter)")
        if path.endswith(".whl"):
            return Instance(name=name, adapter=head, label=label, wheel=str(_wheel_path(path, text, flag)))
        python = Path(path).expanduser()
        if not python.exists():
            raise InstanceError(f"{flag} {text!r}: no such interpreter {path}")
        if not python.is_file() or not os.access(python, os.X_OK):
            raise InstanceError(f"{flag} {text!r}: {path} is not an executable file")
        return Instance(name=name, adapter=head, label=label, python=str(python.absolute()))
    if not _VERSION.fullmatch(label):
        raise InstanceError(f"{flag} {text!r}: {label!r} is not a version; give the build as {name}=PATH "
                            "(a wheel file or an interpreter)")
    return Instance(name=name, adapter=head, label=label, version=label)


def _check_length(head: str, label: str, text: str, flag: str) -> None:
    """An instance's name names its run directories and its built environment: at most
    :data:`~xfw.recipe.names.MAX_NAME_CHARS` characters, like a recipe's name."""
    size = len(head) + 1 + len(label)
    if size > MAX_NAME_CHARS:
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise InstanceError(f"{flag} {shown!r}: the name {head}@{label[:20]}... is {size} characters; at most "
                            f"{MAX_NAME_CHARS} (it names directories): give a shorter label, e.g. {head}@mine=PATH")


def _wheel_path(path: str, text: str, flag: str) -> Path:
    wheel = Path(path).expanduser()
    if not WHEEL_NAME.fullmatch(wheel.name):
        raise InstanceError(f"{flag} {text!r}: {wheel.name!r} is not a wheel file name (DIST-VERSION-...-PLATFORM.whl)")
    if not wheel.is_file():
        raise InstanceError(f"{flag} {text!r}: no such wheel file {path}")
    return wheel.absolute()


def parse_list(text: str, *, flag: str = "--backends") -> list[Instance]:
    """A comma-separated list; no name twice."""
    out = [parse(part, flag=flag) for part in text.split(",") if part.strip()]
    names = [i.name for i in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InstanceError(f"{flag} {text!r}: {twice[0]!r} is named twice (give each instance its own label)")
    return out


def fold(recipe, name: str):
    """The recipe as the instance ``name`` runs it: ``backends.<adapter>`` with ``backends.<name>`` on
    top (a mapping value, ``env`` or ``override``, merged key by key). A bare adapter name: the recipe itself."""
    adapter = adapter_of(name)
    if adapter == name or adapter not in recipe.backends:
        return recipe
    base, own = recipe.backends[adapter], recipe.backends.get(name, {})
    merged = {**base, **own}
    for key in ("env", "override"):
        if isinstance(base.get(key), dict) and isinstance(own.get(key), dict):
            merged[key] = {**base[key], **own[key]}
    return dataclasses.replace(recipe, backends={**recipe.backends, name: merged})


# --- built environments --------------------------------------------------------------------------

Log = Callable[[str], None]


def env_dir(instance: Instance, root: Path = PROJECT_ROOT) -> Path:
    return root / BUILDS_DIR / instance.name


def read_build(directory: Path) -> dict | None:
    """A built environment's record (``xfw-build.json``), or None when there is none or it is unreadable."""
    try:
        data = json.loads((directory / BUILD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def size_on_disk(directory: Path) -> int:
    total = 0
    for folder, _, files in os.walk(directory):
        for f in files:
            try:
                total += os.lstat(os.path.join(folder, f)).st_size
            except OSError:
                pass
    return total


def fmt_size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.0f} MiB"


def requirements_for(instance: Instance, root: Path = PROJECT_ROOT) -> tuple[str, str, str]:
    """(the adapter's requirements.txt with the framework's line replaced by this instance's build,
    the framework's package, the line that replaced it)."""
    path = root / "adapters" / instance.adapter / "requirements.txt"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        raise InstanceError(f"{instance.name}: no requirements for adapter {instance.adapter!r} ({path})") from None
    marked = [i for i, line in enumerate(lines) if FRAMEWORK_MARK in line]
    if len(marked) != 1:
        raise InstanceError(f"{instance.name}: {path} marks {len(marked)} lines with {FRAMEWORK_MARK!r} (needs one)")
    package = re.split(r"[=<>!~ ;\[]", lines[marked[0]].strip(), maxsplit=1)[0]
    lines[marked[0]] = instance.wheel if instance.wheel else f"{package}=={instance.version}"
    return "\n".join(lines) + "\n", package, lines[marked[0]]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _want(instance: Instance, requirements: str) -> str:
    """What a built environment must have been built from to be reused (the requirements, the wheel's bytes)."""
    key = requirements + (_sha256(instance.wheel) if instance.wheel else "")
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _framework_hash(report: Path, package: str) -> str | None:
    """The sha256 of the archive pip installed for ``package``, from pip's installation report."""
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for item in data.get("install", []):
        meta, info = item.get("metadata", {}), item.get("download_info", {})
        if str(meta.get("name", "")).lower().replace("_", "-") == package.lower().replace("_", "-"):
            found = (info.get("archive_info") or {}).get("hashes", {}).get("sha256") or \
                (info.get("archive_info") or {}).get("hash", "").removeprefix("sha256=")
            return found or None
    return None


def ensure_env(instance: Instance, log: Log, root: Path = PROJECT_ROOT) -> Path:
    """The interpreter of this instance's built environment, building it first when it is missing or
    was built from something else. Progress goes to ``log``; InstanceError (pip's one line) if it fails."""
    base = root / ".venv" / instance.adapter / "bin" / "python"
    if not base.exists():
        raise InstanceError(f"{instance.name}: builds on the default environment .venv/{instance.adapter}, which "
                            "does not exist; run `make setup` first")
    requirements, package, line = requirements_for(instance, root)
    if instance.wheel:
        problem = wheel_problem(instance.wheel, package)
        if problem:
            raise InstanceError(f"{instance.name}: {problem}")
    want = _want(instance, requirements)
    target = env_dir(instance, root)
    if _built_from(target, want):
        return target / "bin" / "python"
    # One build of an instance at a time: a second command would build it again and, finishing later,
    # replace the environment the first one's runs are importing from (a run then fails to import).
    with wait_for(target.with_name(f".{target.name}.lock"),
                  lambda holder: log(f"{instance.name}: waiting for {holder}, which is building it")):
        if _built_from(target, want):
            log(f"{instance.name}: built by that command meanwhile; using it")
            return target / "bin" / "python"
        return _build_into(instance, base, requirements, package, line, want, log, root)


def _built_from(target: Path, want: str) -> bool:
    old = read_build(target)
    return bool(old and old.get("want") == want and (target / "bin" / "python").exists())


def _build_into(instance: Instance, base: Path, requirements: str, package: str, line: str, want: str,
                log: Log, root: Path) -> Path:
    target = env_dir(instance, root)
    old = read_build(target)
    if old:
        log(f"{instance.name}: rebuilding {target} (it was built from something else)")
    log(f"{instance.name}: building an environment from {instance.source} on .venv/{instance.adapter} "
        f"(once; later commands reuse it)")
    started = time.monotonic()
    for stale in abandoned_builds(root):  # a build killed earlier (any instance) left its scratch directory
        log(f"removing {stale.name}, left by a build that was killed ({fmt_size(size_on_disk(stale))})")
        shutil.rmtree(stale, ignore_errors=True)
    scratch = target.with_name(f".{target.name}{SCRATCH_MARK}{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        _build(instance, base, requirements, scratch, log)
        description = _describe(scratch / "bin" / "python", instance)
        size = size_on_disk(scratch)
        record = {"instance": instance.name, "adapter": instance.adapter, "source": instance.source,
                  "want": want, "requirement": line,
                  "wheel_sha256": _sha256(instance.wheel) if instance.wheel else
                  _framework_hash(scratch / "pip-report.json", package),
                  "framework_version": description.get("framework_version"),
                  "framework_commit": description.get("framework_commit"),
                  "base": str(base.parent.parent), "size_bytes": size,
                  "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "build_s": round(time.monotonic() - started, 1)}
        write_json_atomic(scratch / BUILD_FILE, record)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(scratch, target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    log(f"{instance.name}: built in {record['build_s']:.0f} s, {fmt_size(size)} on disk ({target}): "
        f"{instance.adapter} {record['framework_version']}")
    return target / "bin" / "python"


def _step(instance: Instance, cmd: list[str], timeout_s: float, what: str, on_line=None) -> tuple[int, str]:
    """One step of a build (xfw.run.launch.task: its own process group, ended with xfw and with everything it
    started); InstanceError in one line when it cannot start, runs past ``timeout_s`` or (without
    ``on_line``) fails."""
    try:
        code, out, err = run_task(cmd, timeout_s=timeout_s, on_line=on_line)
    except (OSError, TaskTimeout) as problem:
        raise InstanceError(f"{instance.name}: {what}: {problem}") from None
    if code != 0 and on_line is None:
        last = (err.strip().splitlines() or out.strip().splitlines() or ["no output"])[-1][:300]
        raise InstanceError(f"{instance.name}: {what} failed (exit {code}: {last})")
    return code, out


def _build(instance: Instance, base: Path, requirements: str, scratch: Path, log: Log) -> None:
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    _step(instance, [str(base), "-m", "venv", str(scratch)], 300, "creating its virtual environment")
    site = _step(instance, [str(base), "-c", purelib], 60, "reading the default environment's site-packages")[1].strip()
    own = _step(instance, [str(scratch / "bin" / "python"), "-c", purelib], 60,
                "reading its own site-packages")[1].strip()
    # Read after the environment's own site-packages: what pip installs here comes first.
    Path(own, "zz-xfw-base.pth").write_text(f"import site; site.addsitedir({site!r})\n", encoding="utf-8")
    (scratch / "xfw-requirements.txt").write_text(requirements, encoding="utf-8")
    cmd = [str(scratch / "bin" / "python"), "-m", "pip", "install", "--progress-bar", "off", "--disable-pip-version-check",
           "--report", str(scratch / "pip-report.json"), "-r", str(scratch / "xfw-requirements.txt")]
    lines: list[str] = []

    def seen(line: str) -> None:
        lines.append(line)
        if line.startswith(("Collecting", "Downloading", "Installing", "Successfully")) or \
                line.lstrip().startswith("Downloading"):
            log(f"{instance.name}: {line.strip()[:160]}")

    code, _ = _step(instance, cmd, PIP_TIMEOUT_S, "pip install", on_line=seen)
    if code != 0:
        raise InstanceError(f"{instance.name}: pip could not install {instance.source}: {pip_error(lines)}")


def _describe(python: Path, instance: Instance) -> dict:
    """The adapter's own description in the new environment; InstanceError if it cannot import."""
    try:
        code, stdout, stderr = run_task([str(python), "-m", f"xfw_{instance.adapter}", "--describe"], timeout_s=300)
    except (OSError, TaskTimeout) as problem:
        raise InstanceError(f"{instance.name}: installed, but its --describe check failed: {problem}") from None
    found = [line for line in stdout.splitlines() if line.startswith("{")]
    if code != 0 or not found:
        last = (stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise InstanceError(f"{instance.name}: installed, but xfw_{instance.adapter} does not import there ({last})")
    description = json.loads(found[-1])
    if instance.version and description.get("framework_version", "").split("+")[0] != instance.version.split("+")[0]:
        raise InstanceError(f"{instance.name}: asked for {instance.adapter} {instance.version}, the environment "
                            f"imports {description.get('framework_version')}")
    return description


SCRATCH_MARK = ".building-"
"""A build works in ``.NAME.building-PID`` beside its target and renames it into place when done."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def abandoned_builds(root: Path = PROJECT_ROOT) -> list[Path]:
    """Scratch directories of builds whose process is gone (xfw killed mid-build: a real Paddle build
    leaves hundreds of MiB): ``xfw env`` lists them, ``xfw env --clean`` and the next build remove them.
    One whose process still runs (a build in another command) is never touched."""
    folder = root / BUILDS_DIR
    found = []
    for d in sorted(folder.iterdir()) if folder.is_dir() else []:
        head, mark, pid = d.name.rpartition(SCRATCH_MARK)
        if mark and head.startswith(".") and pid.isdigit() and d.is_dir() and not d.is_symlink() \
                and not _alive(int(pid)):
            found.append(d)
    return found


def clean_builds(root: Path = PROJECT_ROOT) -> list[str]:
    """Remove every abandoned build (``xfw env --clean``); one line each saying what was freed."""
    lines = []
    for d in abandoned_builds(root):
        size = size_on_disk(d)
        shutil.rmtree(d, ignore_errors=True)
        lines.append(f"removed {d} ({fmt_size(size)}), left by a build that was killed")
    return lines or [f"nothing to clean in {root / BUILDS_DIR}"]


def built_envs(root: Path = PROJECT_ROOT) -> list[tuple[Path, dict | None]]:
    """Every built environment (``xfw env``), with its record (None: unreadable or half built)."""
    folder = root / BUILDS_DIR
    if not folder.is_dir():
        return []
    return [(d, read_build(d)) for d in sorted(folder.iterdir()) if d.is_dir() and not d.name.startswith(".")]


def remove_env(name: str, root: Path = PROJECT_ROOT) -> str:
    """Delete one built environment (``xfw env --remove NAME``); one line saying what was freed."""
    target = root / BUILDS_DIR / name
    if "/" in name or name in ("", ".", "..") or not target.is_dir():
        known = ", ".join(d.name for d, _ in built_envs(root)) or "none"
        raise InstanceError(f"--remove {name!r}: no built environment of that name (built: {known})")
    size = size_on_disk(target)
    shutil.rmtree(target)
    return f"removed {target} ({fmt_size(size)})"


def known_adapters(root: Path = PROJECT_ROOT) -> list[str]:
    """The adapters this project has (``adapters/NAME/xfw_NAME``)."""
    return sorted(p.parent.name for p in root.glob("adapters/*/xfw_*") if p.name == f"xfw_{p.parent.name}")


def env_backends(root: Path = PROJECT_ROOT) -> list[str]:
    """What ``xfw env`` describes when not told: paddle and torch (said NOT AVAILABLE when missing), then
    every other adapter whose environment ``.venv/NAME`` exists (jax once scripts/setup_jax.sh made it)."""
    return ["paddle", "torch"] + [name for name in known_adapters(root)
                                  if name not in ("paddle", "torch") and (root / ".venv" / name).is_dir()]
