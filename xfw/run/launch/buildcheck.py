"""What a build is checked with (docs/builds.md): a wheel given as an instance must be the framework
its adapter pins (:func:`wheel_problem`, before anything is built), and a failed ``pip install`` is
told by pip's one useful line (:func:`pip_error`)."""

from __future__ import annotations

import re
from pathlib import Path

WHEEL_NAME = re.compile(r"(?P<dist>[A-Za-z0-9_.]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl")
"""A wheel's file name: DIST-VERSION(-BUILD)-PYTHON-ABI-PLATFORM.whl."""


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_problem(wheel: str, package: str) -> str | None:
    """Why the wheel file cannot stand for the adapter's framework ``package`` (its pinned distribution,
    ``torch``, ``paddlepaddle``), or None: the name in its own metadata (``*.dist-info/METADATA``,
    ``Name:``) must be that distribution or a variant of it (``paddlepaddle-gpu``), and the file name
    must say the same. A wheel of anything else would be measured as that framework."""
    import zipfile

    try:
        with zipfile.ZipFile(wheel) as archive:
            metadata = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(metadata) != 1:
                return f"{wheel} holds {len(metadata)} .dist-info/METADATA files (a wheel has one); not a wheel"
            with archive.open(metadata[0]) as f:
                head = f.read(1 << 20).decode("utf-8", "replace")
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        return f"{wheel} cannot be read as a wheel ({err})"
    name = next((line.partition(":")[2].strip() for line in head.splitlines() if line.lower().startswith("name:")), "")
    want = _normal(package)
    if not name or not (_normal(name) == want or _normal(name).startswith(f"{want}-")):
        return (f"{wheel} is the wheel of {name or 'no named distribution'!r}, not of {package} (the framework "
                "this adapter pins); give a wheel of the framework")
    file_dist = WHEEL_NAME.fullmatch(Path(wheel).name)
    if file_dist and _normal(file_dist.group("dist")) != _normal(name):
        return f"{wheel}: the file name says {file_dist.group('dist')!r}, its metadata {name!r}"
    return None


def pip_error(lines: list[str]) -> str:
    """pip's one line that says why, not its log: of its ERROR lines, the one that names what exists
    (``Could not find a version that satisfies the requirement torch==9.9.9 (from versions: ...)``, its
    list cut to the newest), else the first that is not a pointer to pip's help (``ResolutionImpossible:
    for help visit ...``), with what conflicts where pip says so (``The user requested torch==9.9.9; The user
    requested (constraint) torch<=2.14.1; no distribution of torch available here``)."""
    errors = [line.strip() for line in lines if line.startswith("ERROR:")]
    told = [e for e in errors if "for help visit" not in e and "ResolutionImpossible" not in e]
    found = next((e for e in told if "(from versions:" in e), None)
    if found:
        head, _, versions = found.partition("(from versions:")
        names = [v.strip() for v in versions.rstrip(")").split(",") if v.strip()]
        shown = ", ".join(names[-12:]) if names else "none"
        return f"{head.strip()} (versions that exist here: {'..., ' if len(names) > 12 else ''}{shown})"[:400]
    if told and "conflicting dependencies" in told[0]:  # say what conflicts (a constraint in pip's own config, say)
        causes = _indented_after(lines, "The conflict is caused by:")
        missing = _indented_after(lines, "no matching distributions available")
        return (told[0].removesuffix(".") + (": " + "; ".join(causes) if causes else "")
                + (f"; no distribution of {', '.join(missing)} available here" if missing else ""))[:400]
    return (told[0] if told else errors[-1] if errors else
            (lines[-1].strip() if lines else "pip printed nothing"))[:300]


def _indented_after(lines: list[str], heading: str) -> list[str]:
    """The indented lines pip prints under a line containing ``heading``."""
    out: list[str] = []
    for i, line in enumerate(lines):
        if heading in line:
            for item in lines[i + 1:]:
                if not item.startswith((" ", "\t")) or not item.strip():
                    break
                out.append(item.strip())
            break
    return out
