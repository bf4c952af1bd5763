"""Sweeps: one recipe over the cartesian product of overridden values, one run at a time.

``xfw sweep recipes/tiny/llava_sft.yaml --set batch.micro=1,2 --set parallel.sharding=none,stage1``
validates all four points before launching anything, then runs each point on each backend as an
ordinary run directory::

    OUT/tiny-llava-sft/batch.micro-1__parallel.sharding-none/torch/{spec.json,...,summary.json}
    OUT/tiny-llava-sft/batch.micro-1__parallel.sharding-stage1/torch/...

Each run's ``summary.json`` carries its point as ``variant`` ({"batch.micro": 1, ...}), so reports
group by (recipe, variant). A value list splits only at top-level commas, so a YAML list stays
one value: ``--set lora.targets=[q_proj,v_proj],[q_proj]`` is two points.

Resuming: rerunning the same command with the same ``--out`` keeps every run that settled for
the same spec and runs the rest (:mod:`xfw.run.launch.jobs`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

from xfw.report.results import RunResult
from xfw.run.launch import launcher
from xfw.run.launch.jobs import Backends, Job, jobs_for, run_jobs
from xfw.recipe import Recipe, RecipeError, load_recipe
from xfw.recipe.yamlfile import YamlError, load_text

_OPENERS, _CLOSERS = "[{(", "]})"
MAX_LABEL_CHARS = 120  # file systems allow 255 bytes per name; leave room for humans too


def split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets and quotes: ``1,[a,b],'x,y'`` -> ``1``, ``[a,b]``, ``'x,y'``."""
    parts, depth, quote, current = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in _OPENERS:
            depth += 1
        elif ch in _CLOSERS:
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts]


@dataclass(frozen=True)
class Axis:
    key: str
    """Dotted recipe key, e.g. ``batch.micro``."""
    raw_values: tuple[str, ...]
    """Each value as typed (YAML), in the order given."""


def parse_axes(assignments: list[str], source: str) -> list[Axis]:
    """``["batch.micro=1,2", "recompute=true"]`` -> axes; one-line RecipeError naming the option."""
    axes: list[Axis] = []
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        key = key.strip()
        if not sep or not key or not all(key.split(".")):
            raise RecipeError(f"{source}: --set {assignment!r}: expected key.path=value[,value...]")
        values = split_top_level(raw)
        if any(v == "" for v in values):
            raise RecipeError(f"{source}: --set {key}: empty value in {raw!r}")
        if len(set(values)) != len(values):
            raise RecipeError(f"{source}: --set {key}: a value is given twice in {raw!r}")
        if any(a.key == key for a in axes):
            raise RecipeError(f"{source}: --set {key}: the key is set twice (give all its values in one --set)")
        axes.append(Axis(key, tuple(values)))
    return axes


def _parse_value(raw: str, key: str, source: str):
    try:
        return load_text(raw, f"{source}: --set {key}: value {raw[:80]!r}")
    except YamlError as err:
        raise RecipeError(str(err)) from None


def point_label(variant: dict) -> str:
    """A directory name for a point: ``batch.micro-2__lora.targets-q_proj_v_proj``; ``base`` for {}."""
    if not variant:
        return "base"
    parts = []
    for key, value in variant.items():
        text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
        text = re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_") or "_"
        parts.append(f"{key}-{text}")
    label = "__".join(parts)
    if len(label) > MAX_LABEL_CHARS:  # keep it unique and readable: a prefix and a digest of the whole point
        digest = hashlib.sha1(json.dumps(variant, sort_keys=True).encode()).hexdigest()[:10]
        label = f"{label[:MAX_LABEL_CHARS - 11]}-{digest}"
    return label


@dataclass(frozen=True)
class Point:
    variant: dict
    """Dotted key -> parsed value, in the order of the --set options."""
    overrides: tuple[str, ...]
    """The ``key=value`` assignments that make this point."""
    recipe: Recipe
    label: str


def plan(recipe_path: str, assignments: list[str], fixed: list[str] = ()) -> list[Point]:
    """Every point of the sweep, validated (a bad point raises before anything launches).

    ``fixed`` overrides (e.g. ``measure.repeat=3`` from ``--repeat``) apply to every point and are
    not part of its variant."""
    source = str(recipe_path)
    axes = parse_axes(assignments, source)
    points, problems = [], []
    for combo in itertools.product(*(axis.raw_values for axis in axes)):
        overrides = tuple(f"{axis.key}={raw}" for axis, raw in zip(axes, combo))
        variant = {axis.key: _parse_value(raw, axis.key, source) for axis, raw in zip(axes, combo)}
        try:
            recipe = load_recipe(recipe_path, [*fixed, *overrides])
        except RecipeError as err:
            problems.append(f"{err} (point {', '.join(overrides)})")
            continue
        points.append(Point(variant, overrides, recipe, point_label(variant)))
    if problems:
        raise RecipeError("\n".join(problems))
    labels = [p.label for p in points]
    clash = next((label for label in labels if labels.count(label) > 1), None)
    if clash:
        raise RecipeError(f"{source}: two sweep points share the directory name {clash!r}; use distinct values")
    return points


def sweep_jobs(points: list[Point], backend_names: list[str], out_dir: Path) -> list[Job]:
    """Every (point, repeat, backend), in order: ``OUT/<recipe>/<point label>/<backend>[-r<k>]``."""
    return [job for p in points
            for job in jobs_for(p.recipe, backend_names, out_dir, (p.recipe.name, p.label), variant=p.variant,
                                label=p.label)]


def run_sweep(points: list[Point], backends: Backends, out_dir: Path,
              progress: launcher.Progress | None = None, log=print, *, force: bool = False) -> list[RunResult]:
    """Run every (point, repeat, backend) one at a time, keeping settled runs; returns all results."""
    return run_jobs(sweep_jobs(points, list(backends), out_dir), backends, resume=True, force=force,
                    progress=progress, log=log)[0]
