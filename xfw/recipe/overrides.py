"""Per-backend overrides: one deliberate, reported difference between the sides of a comparison.

A recipe says what both sides train. To show that a check can tell a difference (one side's
learning rate lowered, its precision changed), a backend may override any recipe key for itself::

    backends: {paddle: {override: {optimizer.lr: 1.0e-4}}}        # or {override: {optimizer: {lr: 1.0e-4}}}
    xfw compare RECIPE --set backends.torch.override.precision.dtype=bf16 \\
                       --set backends.torch.override.precision.amp_level=O2
    xfw sweep RECIPE --set backends.paddle.override.optimizer.lr=1e-3,1e-4

Inside a :class:`~xfw.recipe.Recipe` an override is held in one canonical form, dotted keys
and plain values, sorted: ``recipe.backends["paddle"]["override"] == {"optimizer.lr": 0.0001}``.
It is validated like the key itself: the recipe with that backend's override applied passes every
check the recipe does, and an error names the override's key
(``recipes/x.yaml: backends.paddle.override.optimizer.lr: -1.0 is outside [1e-12, 10]``). Keys that
define the comparison itself (:data:`FIXED`) cannot be overridden, nor can a backend that runs a
command (xfw cannot change its script's settings).

Each backend runs its own effective recipe (:func:`backend_recipe`): ``spec.json`` is resolved from
it (``xfw.recipe.spec.resolve_spec``) and records the override as ``overrides`` (``{"optimizer.lr":
0.0001}``) beside ``overridden`` (the recipe's own values at those keys); the adapter never sees an
``override`` knob. Every report shows each override as a deliberate difference
(``xfw.report.compare.deliberate_differences``), and ``xfw validate`` prints it (:func:`describe`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from xfw.report.compare import fmt_deliberate
from xfw.recipe.sections import Recipe, RecipeError
from xfw.recipe.schema import FieldError, build, to_dict

OVERRIDE = "override"
"""The key under ``backends.<name>`` that holds that backend's overrides."""
FIXED = {
    "name": "names the run directories of both sides",
    "backends": "holds the overrides themselves and each side's knobs (set backends.<name>.<knob> directly)",
    "comparison": "says which comparison both sides belong to",
    "published": "names the seed row both sides stand for",
    "parallel.nnodes": "is the one rendezvous both sides' nodes join (docs/multinode.md)",
}
"""Keys an override may not touch, and why: they define the comparison itself."""


def _prefix(backend: str, key: str = "") -> str:
    return f"backends.{backend}.{OVERRIDE}" + (f".{key}" if key else "")


def _flatten(mapping: dict, backend: str, parent: str = "") -> dict[str, Any]:
    """``{optimizer: {lr: 1}, precision.dtype: bf16}`` -> ``{"optimizer.lr": 1, "precision.dtype": "bf16"}``;
    a key given twice (nested and dotted) is refused."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise FieldError(_prefix(backend, f"{parent}{key}"), "must be a dotted recipe key (text)")
        path = f"{parent}{key}"
        if not all(part.strip() for part in path.split(".")):
            raise FieldError(_prefix(backend, path), "empty key (expected a dotted recipe key such as optimizer.lr)")
        leaves = _flatten(value, backend, f"{path}.") if isinstance(value, dict) and value else {path: value}
        for leaf, leaf_value in leaves.items():
            clash = next((k for k in out if k == leaf or k.startswith(f"{leaf}.") or leaf.startswith(f"{k}.")), None)
            if clash is not None:
                raise FieldError(_prefix(backend, leaf), "given twice (once nested, once as a dotted key)" if clash == leaf
                                 else f"overlaps {_prefix(backend, clash)} (give one of them)")
            out[leaf] = leaf_value
    return out


def _check_key(backend: str, key: str) -> None:
    fixed = next((f for f in FIXED if key == f or key.startswith(f"{f}.")), None)
    if fixed is not None:
        raise FieldError(_prefix(backend, key), f"cannot differ between backends: {fixed} {FIXED[fixed]}")


def nest(data: Any, source: str) -> None:
    """Each ``backends.<name>.override`` of plain recipe data as nested mappings (dotted keys split),
    in place, so that a later ``--set backends.<name>.override.<key>=...`` replaces the file's value
    of the same key, whichever form the file used. Leaves what is not a mapping to :func:`canonical`."""
    for name, knobs in _backend_items(data):
        override = knobs.get(OVERRIDE)
        if not isinstance(override, dict):
            continue
        try:
            flat = _flatten(override, name)
        except FieldError as err:
            raise RecipeError(f"{source}: {err.key}: {err}") from None
        nested: dict = {}
        for key, value in flat.items():
            *parents, last = key.split(".")
            node = nested
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = copy.deepcopy(value)
        knobs[OVERRIDE] = nested


def _backend_items(data: Any):
    backends = data.get("backends") if isinstance(data, dict) else None
    if not isinstance(backends, dict):
        return []
    return [(name, knobs) for name, knobs in backends.items() if isinstance(knobs, dict)]


def canonical(data: Any, source: str) -> Any:
    """Plain recipe data with every override in the canonical form (dotted keys, sorted; an empty
    one dropped) and its keys checked (not :data:`FIXED`, not on a command backend); a copy where
    anything changed. One-line RecipeError naming the override's key."""
    if not _backend_items(data) or not any(OVERRIDE in knobs for _, knobs in _backend_items(data)):
        return data
    data = {**data, "backends": {name: dict(knobs) if isinstance(knobs, dict) else knobs
                                 for name, knobs in data["backends"].items()}}
    for name, knobs in _backend_items(data):
        if OVERRIDE not in knobs:
            continue
        override = knobs[OVERRIDE]
        try:
            if not isinstance(override, dict):
                raise FieldError(_prefix(name), f"must be a mapping of recipe keys to values, got {override!r}")
            if "command" in knobs and override:
                raise FieldError(_prefix(name), f"backends.{name} runs a command: xfw cannot change its script's "
                                 "settings (override only a backend that runs xfw's adapter)")
            flat = _flatten(override, name)
            for key in flat:
                _check_key(name, key)
        except FieldError as err:
            raise RecipeError(f"{source}: {err.key}: {err}") from None
        if flat:
            knobs[OVERRIDE] = {k: copy.deepcopy(flat[k]) for k in sorted(flat)}
        else:
            del knobs[OVERRIDE]
    return data


def _set(data: dict, key: str, value: Any) -> None:
    """``data[a][b]... = value`` for ``a.b...`` (a number indexes a list: ``optimizer.betas.0``);
    FieldError(key prefix, why) where the path cannot be followed."""
    parts = key.split(".")
    node: Any = data
    for i, part in enumerate(parts):
        here = ".".join(parts[:i])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise FieldError(key, f"{here} is a list of {len(node)} items; {part!r} is not one of its indices")
            part = int(part)
        elif not isinstance(node, dict):
            raise FieldError(key, f"{here} is {node!r}, not a mapping")
        if i == len(parts) - 1:
            node[part] = copy.deepcopy(value)
            return
        child = node[part] if isinstance(node, list) else node.get(part)
        if child is None:
            child = node[part] = {}
        node = child


def _lookup(data: Any, key: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key in plain data."""
    for part in key.split("."):
        if isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            return False, None
    return True, data


def named(key: str, message: str, backend: str, keys: list[str], source: str) -> RecipeError:
    """A problem (``key: message``) of a backend's effective recipe as one line naming the override's
    key: the key itself when the problem is about it (or a part of it), else the override in the same
    section (or the first), then the key; ``key`` "" for a problem without one (a data sample)."""
    if key and any(key == k or key.startswith(f"{k}.") or k.startswith(f"{key}.") for k in keys):
        return RecipeError(f"{source}: {_prefix(backend, key)}: {message}")
    near = next((k for k in keys if key and k.split(".")[0] == key.split(".")[0]), keys[0])
    return RecipeError(f"{source}: {_prefix(backend, near)}: with this override, {f'{key}: ' if key else ''}{message}")


def _error(err: FieldError, backend: str, keys: list[str], source: str) -> RecipeError:
    return named(err.key, str(err), backend, keys, source)


def effective(recipe: Recipe, backend: str, source: str) -> Recipe:
    """:func:`backend_recipe`, with errors naming ``source`` (the recipe file)."""
    overrides = backend_overrides(recipe)
    if not overrides:
        return recipe
    own = overrides.get(backend, {})
    data = to_dict(recipe)
    for name in [n for n, knobs in data["backends"].items() if n != backend and OVERRIDE in knobs]:
        del data["backends"][name][OVERRIDE]  # another side's: not this backend's recipe
        if not data["backends"][name]:
            del data["backends"][name]  # an entry only the override made: as if it had never been given
    try:
        for key, value in own.items():
            _set(data, key, value)
        return build(Recipe, data, "")
    except FieldError as err:
        raise _error(err, backend, list(own), source) from None


def backend_recipe(recipe: Recipe, backend: str) -> Recipe:
    """The effective recipe one backend runs: ``recipe`` with ``backends.<backend>.override``
    applied, validated (one-line RecipeError naming the override's key). It keeps this backend's
    override (so applying it again changes nothing) and drops the other backends' (they are not part
    of this side's run). Without any override: ``recipe`` itself.

    Give ``xfw.recipe.spec.resolve_spec`` (and a ``Job``) the recipe as loaded, not this: the spec records
    the recipe's own values at the overridden keys (``overridden``), which this recipe no longer has."""
    return effective(recipe, backend, recipe.name)


def backend_overrides(recipe: Recipe) -> dict[str, dict[str, object]]:
    """``{backend: {dotted key: value}}`` for each backend with an override (canonical: sorted dotted
    keys, plain values); {} when there is none."""
    return {name: dict(knobs[OVERRIDE]) for name, knobs in recipe.backends.items()
            if isinstance(knobs, dict) and knobs.get(OVERRIDE)}


def recipe_values(recipe: Recipe, keys: list[str]) -> dict[str, object]:
    """The recipe's own values at dotted ``keys`` (before any override), as the spec records them
    (``overridden``): from the recipe, else (``model.arch.*``) from the preset's architecture; None
    where the recipe has no value (a section it leaves out)."""
    data = to_dict(recipe)
    arch = None
    out = {}
    for key in keys:
        found, value = _lookup(data, key)
        if not found and key.startswith("model.arch."):
            if arch is None:
                from xfw.contract import presets

                try:
                    arch = presets.resolve_arch(recipe.model.preset, recipe.model.arch, recipe.data.image_size,
                                                recipe.data.seq_len)
                except presets.ArchError:
                    arch = {}
            found, value = _lookup(arch, key.removeprefix("model.arch."))
        out[key] = value if found else None
    return out


def describe(recipe: Recipe) -> list[str]:
    """One line per overridden key, as every report shows it (``xfw validate`` prints these)::

        Deliberate difference (backends.paddle.override): optimizer.lr = 0.0001 on paddle, 0.001 on the other backends
    """
    overrides = backend_overrides(recipe)
    keys = sorted({k for own in overrides.values() for k in own})
    base = recipe_values(recipe, keys)
    lines = []
    for key in keys:
        by = [name for name, own in overrides.items() if key in own]
        values = {name: overrides[name][key] for name in by}
        lines.append(fmt_deliberate(by, key, {**values, "the other backends": base[key]}))
    return lines


def absolute_paths(data: Any, given: set[str], recipe_dir: Path) -> None:
    """An override's ``data.<path key>`` made absolute in place, as the recipe's own are
    (``xfw.recipe``): from the current directory when a ``--set`` gave it, else from the recipe's
    directory. ``given``: the dotted keys the ``--set`` options named."""
    from xfw.recipe.data_section import DATA_PATHS

    for name, knobs in _backend_items(data):
        override = knobs.get(OVERRIDE)
        section = override.get("data") if isinstance(override, dict) else None
        if not isinstance(section, dict):
            continue
        for key in DATA_PATHS:
            value = section.get(key)
            if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
                from_cli = any(g in given for g in (f"{_prefix(name)}.data.{key}", f"{_prefix(name)}.data", _prefix(name)))
                section[key] = str(((Path.cwd() if from_cli else recipe_dir) / value).resolve())
            elif isinstance(value, str) and value:
                section[key] = str(Path(value).expanduser())


def forced_keys(forced: list[str]) -> list[str]:
    """The recipe keys a command forces on both sides, from the ``KEY=VALUE`` overrides it applies
    (its declaration: e.g. ``xfw.run.commands.converge.Plan.forced``); a backend's own knob (``backends.*``) is
    not a recipe key."""
    keys = [item.partition("=")[0].strip() for item in forced]
    return list(dict.fromkeys(k for k in keys if k and not k.startswith("backends.")))


def refuse_forced(recipe: Recipe, forced: list[str], command: str) -> None:
    """RecipeError (one line naming the override and why) when a backend's override touches a key
    ``command`` forces on both sides (``forced``: its ``KEY=VALUE`` overrides): the command would set
    it on one side while the other side's override won, and its report would claim both shared it."""
    keys = forced_keys(forced)
    for name, own in backend_overrides(recipe).items():
        for key in own:
            hit = next((k for k in keys if key == k or key.startswith(f"{k}.") or k.startswith(f"{key}.")), None)
            if hit is not None:
                raise RecipeError(f"{recipe.name}: {_prefix(name, key)}: {command} sets {hit} itself, the same on "
                                  "both sides (that is what it compares); a per-backend value cannot apply here")

