"""Typed read-back: every document xfw writes and later reads again (converge.json, bisect.json,
ab.json, the nightly verdicts ``nightly.json``) is loaded through :func:`read_checked`, which reads it
with the one bounded reader (``xfw.contract.atomic.read_json_object``: a regular file, at most 64 MiB,
a JSON object, no NaN) and then checks it against a declared shape, so a hand-edited or damaged file is
one line naming the file and the key, never an AttributeError or TypeError further down::

    from xfw.report.readback import Maybe, read_checked
    SHAPE = {"schema": int, "decisions": [{"name": str, "verdict": Maybe(str), "ratio?": Maybe(float)}]}
    data = read_checked(out_dir / "bisect.json", SHAPE)     # {} when the file does not exist
    # a damaged file raises ShapeError (an UnreadableFile, a ValueError):
    #   ".../bisect.json: decisions[2].verdict: expected text or null, found a list; edited by hand? give --force"

A shape is plain Python data:

* ``str`` ``int`` ``float`` ``bool``: that JSON type. ``int`` refuses a bool and a float; ``float`` takes
  any finite number (an int too, never a bool; ``1e400`` reads as infinity and is refused).
* ``None``: null only. ``object``: anything.
* ``Maybe(shape)``: the shape, or null. ``OneOf("a", "b")``: one of those values.
  ``Either(shape1, shape2, ...)``: the first shape that fits.
* ``[shape]``: a list, every item of that shape. ``Pair(shape1, shape2, ...)``: a list of exactly
  those items (a curve point ``[step, samples, loss]``: ``Pair(int, int, Maybe(float))``).
* ``{"key": shape, "other?": shape}``: an object with these keys; a key ending in ``?`` may be absent;
  any other key is refused (a writer's own file never has one) unless the shape holds ``...: object``.
* ``{str: shape}``: an object used as a mapping: any text keys, every value of that shape.

:func:`check` is the checker alone (``None`` when ``value`` fits, else the problem with its key path);
:func:`checked` applies it to data already in hand. Shapes of the documents xfw writes are declared
beside their writers; this module holds the shapes only of documents no module owns (:data:`VERDICTS`,
:data:`AB`, :data:`CONVERGE`, kept in step with their dataclasses by the round-five tests).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from xfw.contract.atomic import UnreadableFile, read_json_object


class ShapeError(UnreadableFile):
    """A document that is JSON but not of its declared shape; the message is one line naming the
    file and the key."""


class Maybe:
    """``shape`` or null."""

    def __init__(self, shape: Any):
        self.shape = shape


class OneOf:
    """One of the given values (compared with ``==``, of the same type)."""

    def __init__(self, *values: Any):
        self.values = values


class Either:
    """The first of the shapes that fits."""

    def __init__(self, *shapes: Any):
        self.shapes = shapes


class Pair:
    """A list of exactly these items (a tuple written as a JSON list)."""

    def __init__(self, *shapes: Any):
        self.shapes = shapes


_NAMES = {str: "text", int: "an integer", float: "a number", bool: "true or false", type(None): "null",
          dict: "an object", list: "a list"}


def _found(value: Any) -> str:
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, float) and not math.isfinite(value):
        return "a number out of range"
    return {str: "text", int: "an integer", float: "a number", type(None): "null", dict: "an object",
            list: "a list"}.get(type(value), type(value).__name__)


def _wanted(shape: Any) -> str:
    if shape is None:
        return "null"
    if isinstance(shape, type):
        return _NAMES.get(shape, shape.__name__)
    if isinstance(shape, Maybe):
        return f"{_wanted(shape.shape)} or null"
    if isinstance(shape, OneOf):
        return "one of " + ", ".join(repr(v) for v in shape.values)
    if isinstance(shape, Either):
        return " or ".join(_wanted(s) for s in shape.shapes)
    if isinstance(shape, Pair):
        return f"a list of {len(shape.shapes)}"
    return "a list" if isinstance(shape, list) else "an object"


def _join(where: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def check(value: Any, shape: Any, where: str = "") -> str | None:
    """``None`` when ``value`` fits ``shape``; otherwise the first problem, as ``key.path: expected
    ..., found ...`` (``where`` is the path of ``value`` itself; empty at the document's top)."""
    at = f"{where}: " if where else ""
    if shape is object:
        return None
    if shape is None:
        return None if value is None else f"{at}expected null, found {_found(value)}"
    if isinstance(shape, Maybe):
        problem = None if value is None else check(value, shape.shape, where)
        inner = f"{at}expected {_wanted(shape.shape)},"
        return f"{at}expected {_wanted(shape)}," + problem[len(inner):] if problem and problem.startswith(inner) \
            else problem
    if isinstance(shape, OneOf):
        if any(type(value) is type(v) and value == v for v in shape.values):
            return None
        shown = repr(value)[:60] if isinstance(value, (str, int, float)) else _found(value)
        return f"{at}expected {_wanted(shape)}, found {shown}"
    if isinstance(shape, Either):
        if any(check(value, s, where) is None for s in shape.shapes):
            return None
        return f"{at}expected {_wanted(shape)}, found {_found(value)}"
    if isinstance(shape, type):
        fits = (isinstance(value, float) and math.isfinite(value) or type(value) is int if shape is float
                else type(value) is shape)
        return None if fits else f"{at}expected {_wanted(shape)}, found {_found(value)}"
    if isinstance(shape, (list, Pair)):
        if not isinstance(value, list):
            return f"{at}expected {_wanted(shape)}, found {_found(value)}"
        if isinstance(shape, Pair):
            if len(value) != len(shape.shapes):
                return f"{at}expected {_wanted(shape)}, found a list of {len(value)}"
            items = zip(value, shape.shapes)
        else:
            items = ((item, shape[0]) for item in value)
        for i, (item, item_shape) in enumerate(items):
            problem = check(item, item_shape, _join(where, i))
            if problem:
                return problem
        return None
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return f"{at}expected an object, found {_found(value)}"
        if str in shape:
            for key, item in value.items():
                problem = check(item, shape[str], _join(where, key))
                if problem:
                    return problem
            return None
        declared = {k.removesuffix("?"): (k.endswith("?"), s) for k, s in shape.items() if isinstance(k, str)}
        for key, (optional, item_shape) in declared.items():
            if key not in value:
                if not optional:
                    return f"{_join(where, key)}: missing"
                continue
            problem = check(value[key], item_shape, _join(where, key))
            if problem:
                return problem
        if ... not in shape:
            extra = [k for k in value if k not in declared]
            if extra:
                return f"{_join(where, extra[0][:60])}: not a key this file has"
        return None
    raise TypeError(f"not a shape: {shape!r}")  # a programming error, never a user's


def checked(data: Any, shape: Any, name: str | Path, hint: str = "edited by hand?") -> Any:
    """``data`` unchanged when it fits ``shape``; :class:`ShapeError` naming ``name`` and the key
    otherwise (``hint``: what the user can do, e.g. ``give --force``)."""
    problem = check(data, shape)
    if problem:
        raise ShapeError(f"{name}: {problem}" + (f"; {hint}" if hint else ""))
    return data


def read_checked(path: str | Path, shape: Any, hint: str = "edited by hand?") -> dict:
    """The JSON object in ``path`` checked against ``shape``; ``{}`` when there is no such file.
    :class:`UnreadableFile` (one line naming the file) when it cannot be read or is no JSON object;
    :class:`ShapeError` (one line naming the file and the key) when it is not of ``shape``."""
    data = read_json_object(path)
    if not data and not os.path.lexists(path):
        return {}
    return checked(data, shape, path, hint)


# --- documents no single module owns ------------------------------------------------------------

Number = Maybe(float)

VERDICT = {"entry": str, "backend": str, "metric": str, "verdict": str, "value?": Number, "baseline?": Number,
           "baseline_nights?": int, "change?": Number, "tolerance?": Number, "noise?": Number,
           "noise_source?": str, "mem_source?": str, "note?": str, "flagged?": bool,
           "decision?": Maybe({str: object})}
"""One ``xfw.report.verdicts.Verdict`` as ``xfw nightly`` writes it (``asdict`` and ``flagged``)."""

VERDICTS = {"night?": str, "suite?": str, "policy?": {"window?": int, ...: object}, "verdicts": [VERDICT]}
"""A night's ``nightly.json`` (``xfw.run.commands.nightly``)."""

AB_VERDICT = {"recipe": str, "first": str, "second": str, "verdict": str, "pairs": int,
              "ratios?": [Number], "ratio?": Number, "low?": Number, "high?": Number, "p_value?": Number,
              "detectable?": Number, "alpha?": float, "changed?": bool, "text?": str, "margin?": float,
              "failed?": {str: int}, "decision?": Maybe({str: object}), ...: object}
"""One recipe's A/B in ``ab.json`` (``xfw.report.ab.ABResult.to_dict`` and its text); other keys allowed,
so the A/B's own fields can grow."""

AB = {"schema": int, "verdicts": [AB_VERDICT]}
"""``ab.json`` beside an ``xfw compare --ab`` report (``xfw.workflow.base.ab_blocks``)."""

_POINT = Pair(int, int, Maybe(float))
_SEED_RUN = {"status": str, "reason?": str, "run_dir?": str, "train?": [_POINT], "eval?": [_POINT]}
_SPEED = {"status": str, "reason?": str, "run_dir?": str, "ips?": Number, "window_s?": Number, "ips_low?": Number,
          "ips_high?": Number, "spread?": str}
_POINT_STATS = {"step": int, "samples": int, "mean": {str: Number}, "std": {str: Number}, "n": {str: int},
                "diff?": Number, "rel_diff?": Number, "t?": Number, "df?": Number, "p?": Number, "verdict?": str,
                "worse?": Maybe(str), "separated?": bool, "context?": str, "decision?": Maybe({str: object}),
                "diverged?": {str: [int]}}
_SEED_TARGET = {"seed": int, "samples": Number, "time_s?": Number, "final_eval_loss?": Number, "reached?": bool}
_SIDE_TARGET = {"backend": str, "ips": Number, "seeds?": [_SEED_TARGET], "mean_samples?": Number,
                "time_s?": Number, "time_reason?": str, "curve_samples?": Number, "curve_time_s?": Number,
                "reached?": int, "time_low?": Number, "time_high?": Number}

CONVERGE = {"schema?": int, "recipe": str, "comparison": str, "backends": Pair(str, str), "steps": int,
            "eval_every": int, "samples_per_step": int, "level?": float, "test?": str,
            "curves?": {str: {str: _SEED_RUN}}, "speed?": {str: _SPEED}, "points?": [_POINT_STATS],
            "target?": Number, "target_source?": str, "targets?": {str: _SIDE_TARGET}, "ips_contrast?": Number,
            "time_contrast?": Number, "curve_time_contrast?": Number, "headline?": [str],
            "settings_differences?": [str], "notes?": [str], "final_verdict?": Maybe(str),
            "first_separation?": Maybe({"step": int, "samples": int, "p?": Number}), "margin?": float,
            "direction?": str, "look?": int, "max_looks?": int, "time_contrast_low?": Number,
            "time_contrast_high?": Number, "deliberate?": {str: [str]}, "final_outcome?": Maybe(str), ...: object}
"""``converge.json`` (``xfw.report.converge.ConvergeReport.to_dict``). Other keys are allowed (a newer
writer's); ``ConvergeReport.from_dict`` takes only its own fields."""
