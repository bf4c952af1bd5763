"""Each adapter's knobs, declared in a data file beside it: ``adapters/<name>/xfw_<name>/knobs.json``.

The file is the one list: the adapter reads it (its ``KNOBS``) and xfw's core reads it to check a
recipe's ``backends.<name>`` before anything launches, without importing the adapter or its
framework (``xfw validate``)::

    {"knobs": {"attn_implementation": ["sdpa", "eager"], "loader_workers": null}}

A list gives the values accepted; ``null`` leaves the value to the adapter's own check, except for
the type the optional ``"types"`` mapping gives it (``"bool"``, ``"positive_int"``), which xfw checks
too, so ``xfw validate`` refuses what the adapter would (``{"types": {"tf32": "bool"}}``). Keys every
backend takes (``env``) and a command's keys (``command``, ``cwd``, ...: ``xfw.recipe.command``) are not
knobs and are not declared.
"""

from __future__ import annotations

import json
from pathlib import Path

from xfw.contract import harness

KNOBS_FILE = "knobs.json"
COMMON_KEYS = ("env",)
"""Keys of ``backends.<name>`` every backend accepts besides its knobs."""


def read_declaration(path: str | Path) -> dict[str, tuple | None]:
    """knob -> the values accepted (a tuple) or None (any value the adapter checks itself)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    knobs = data["knobs"]
    return {name: None if values is None else tuple(values) for name, values in knobs.items()}


TYPES = {"bool": ("true or false", lambda v: isinstance(v, bool)),
         "positive_int": ("a positive integer (at most 2**62)",
                          lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 2**62)}


def read_spec(path: str | Path) -> dict:
    """``{"knobs": <read_declaration>, "types": {knob: type name}}`` of a declaration file."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    types = {k: t for k, t in (data.get("types") or {}).items() if t in TYPES}
    return {"knobs": read_declaration(path), "types": types}


def adapter_declaration(package_file: str | Path) -> dict[str, tuple | None]:
    """An adapter's own declaration, from any module of its package (``__file__``)."""
    return read_declaration(Path(package_file).with_name(KNOBS_FILE))


def check(backend: str, knobs: dict, declared: dict[str, tuple | None], types: dict | None = None) -> str | None:
    """The first knob ``declared`` does not accept (or of the wrong declared ``types``), as one line
    naming the key and the accepted names (or values); None when every knob is accepted."""
    for name, value in knobs.items():
        if name in COMMON_KEYS:
            continue
        if name not in declared:
            return f"backends.{backend}.{name}: unknown knob (accepted: {', '.join(sorted(declared))}, env)"
        if name in (types or {}):
            words, accepts = TYPES[types[name]]
            if not accepts(value):
                return f"backends.{backend}.{name}: {str(value)[:80]!r} is not {words}"
        allowed = declared[name]
        if allowed is not None and not any(value == a and type(value) is type(a) for a in allowed):
            return f"backends.{backend}.{name}: {value!r} is not one of {', '.join(map(repr, allowed))}"
    if any(name in knobs for name in harness.LOADER_KNOBS):  # declared null: the harness's own check
        try:
            harness.loader_settings({"backend_knobs": knobs, "backend": backend})
        except harness.InvalidSpec as err:
            return str(err)
    return None
