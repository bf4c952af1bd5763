"""Frozen dataclasses built from plain (YAML) data, every error naming its dotted key.

A section is a frozen dataclass whose fields are typed (``int``, ``float``, ``str``, ``bool``,
``dict``, lists, optional values, nested sections); :func:`build` checks every value against its
type and its :func:`bounded` range, rejects unknown keys and names missing ones, and a section's
own ``__post_init__`` raises :class:`FieldError` with a key local to it::

    build(BatchSpec, {"global": 8, "micro": 0}, "batch")   # FieldError: batch.micro: 0 is outside [1, 1.04858e+06]

Recipes (:mod:`xfw.recipe`) and suites are written in it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import field
from typing import Any


class FieldError(ValueError):
    """Raised inside a section's validation; the loader prefixes the section's key path."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def field_key(f: dataclasses.Field) -> str:
    """The YAML key of a dataclass field (``global`` is a Python keyword, so it is renamed)."""
    return f.metadata.get("key", f.name)


def bounded(low: float, high: float, **kwargs) -> Any:
    """A numeric field checked against ``[low, high]`` when a recipe is loaded (metadata ``bounds``);
    the bounds keep typos such as ``steps: 1e41`` or ``timeout_s: 1e9`` from launching anything."""
    metadata = {**kwargs.pop("metadata", {}), "bounds": (low, high)}
    return field(metadata=metadata, **kwargs)


_SCALARS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a mapping"}


def _check_type(value: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _check_type(value, args[0], path)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise FieldError(path, f"must be a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [_check_type(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value) if abs(value) < 1e300 else math.inf
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise FieldError(path, f"must be a finite number, got {value!r}")
    if hint in _SCALARS:
        ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
        if not ok:
            raise FieldError(path, f"must be {_SCALARS[hint]}, got {value!r}")
        return value
    raise AssertionError(f"unhandled type hint {hint!r} at {path}")


def build(cls: type, data: Any, path: str) -> Any:
    """``data`` checked into ``cls`` (module docstring); ``path``: the key path of this section."""
    prefix = f"{path}." if path else ""
    if not isinstance(data, dict):
        raise FieldError(path or "(top level)", f"must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {field_key(f): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise FieldError(f"{prefix}{unknown[0]}", f"unknown key (expected one of: {', '.join(fields)})")
    kwargs = {}
    for key, f in fields.items():
        if key in data:
            kwargs[f.name] = _check_type(data[key], hints[f.name], f"{prefix}{key}")
            low, high = f.metadata.get("bounds", (None, None))
            value = kwargs[f.name]
            if low is not None and value is not None and not low <= value <= high:
                raise FieldError(f"{prefix}{key}", f"{value!r} is outside [{low:g}, {high:g}]")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise FieldError(f"{prefix}{key}", "is required")
    try:
        return cls(**kwargs)
    except FieldError as err:  # raised by __post_init__ with a key local to this section
        raise FieldError(f"{prefix}{err.key}", str(err)) from None


def to_dict(obj: Any) -> Any:
    """A dataclass tree back to plain data, with YAML key names."""
    if dataclasses.is_dataclass(obj):
        return {field_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
