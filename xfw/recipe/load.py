"""Loading a recipe: what to train, never how a framework does it.

Given a YAML file and the ``--set`` assignments; returns a validated :class:`~xfw.recipe.sections.Recipe`. In order:
the file is read (:mod:`xfw.recipe.yamlfile`, bounded, strict), each ``--set`` applied to the plain data
(:mod:`xfw.recipe.assign`), paths made absolute, the published row applied (:mod:`xfw.recipe.published`), each
backend's override put in its canonical form (:mod:`xfw.recipe.overrides`), the sections built and checked
(:mod:`xfw.recipe.sections`), attached commands checked (:mod:`xfw.recipe.command`), and the data section checked
against its files without writing anything (:func:`check_data`; ``xfw.run.data.prepare_data`` prepares it).
Every error is one line naming the file and the dotted key::

    recipes/tiny/llava_sft.yaml: batch.global: 6 is not divisible by micro (4) x processes (1)

``xfw.recipe.spec.resolve_spec(recipe)`` turns the result into the JSON-ready ``spec.json`` an adapter reads.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from xfw.contract import presets
from xfw.recipe import command
from xfw.recipe import overrides as per_backend
from xfw.recipe import published as published_settings
from xfw.recipe.assign import SetError, apply_override
from xfw.recipe.data_section import DATA_PATHS
from xfw.recipe.schema import FieldError, build
from xfw.recipe.sections import Recipe, RecipeError
from xfw.recipe.yamlfile import YamlError, load_file


def recipe_from_dict(data: Any, source: str = "<recipe>") -> Recipe:
    """Validate plain data into a Recipe; errors read ``source: key.path: message``. Each backend's
    override (``backends.<name>.override``, :mod:`xfw.recipe.overrides`) is put in its canonical form and
    the recipe with it applied validated too, errors naming the override's key."""
    data = per_backend.canonical(data, source)
    try:
        recipe = build(Recipe, data, "")
    except FieldError as err:
        raise RecipeError(f"{source}: {err.key}: {err}") from None
    for backend in per_backend.backend_overrides(recipe):
        per_backend.effective(recipe, backend, source)
    return recipe


def _absolute_paths(data: dict, overrides: list[str], recipe_dir: Path) -> None:
    """``data.<path key>`` made absolute in place (:data:`DATA_PATHS`): from the current directory
    when a ``--set`` gave it, else from the recipe's own directory."""
    section = data.get("data")
    if not isinstance(section, dict):
        return
    given = {a.split("=", 1)[0].strip() for a in overrides}
    for key in DATA_PATHS:
        value = section.get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            from_cli = f"data.{key}" in given or "data" in given
            section[key] = str(((Path.cwd() if from_cli else recipe_dir) / value).resolve())
        elif isinstance(value, str) and value:
            section[key] = str(Path(value).expanduser())


def _apply_published(data: dict, overrides, recipe_dir: Path, source: str) -> None:
    """``published:`` made an absolute file path (checked), and with ``comparison: published`` its
    entries applied as backend knobs and variables where no ``--set`` named the same key."""
    name = data.get("published")
    if name is None:
        return
    if not isinstance(name, str):
        raise RecipeError(f"{source}: published: must be a name in recipes/published/ or a .yaml path, got {name!r}")
    try:
        path = published_settings.locate(name, recipe_dir)
        table = published_settings.load(path)
    except published_settings.PublishedError as err:
        raise RecipeError(f"{source}: {err}") from None
    data["published"] = str(path)
    if data.get("comparison") == "published":
        given = {a.split("=", 1)[0].strip() for a in overrides}
        published_settings.apply(data, table, given)


def check_data(recipe: Recipe, arch: dict, source: str) -> None:
    """What the data section asks of the architecture, and real data checked without writing anything
    (``xfw.run.data.check``): every problem a one-line RecipeError naming the file and the key or sample."""
    from xfw.contract import families

    try:
        if recipe.model.trainable is not None:
            families.check_parts(arch, recipe.model.trainable, recipe.stage)
        tokens = recipe.data.text_tokens
        if tokens is not None:
            longest = families.fixed_tokens(arch) + tokens.max
            if longest > arch["data"]["seq_len"]:
                raise families.ArchError("data.text_tokens.max", f"{tokens.max} text tokens after "
                                         f"{families.fixed_tokens(arch)} others exceed data.seq_len {arch['data']['seq_len']}")
    except families.ArchError as err:
        raise RecipeError(f"{source}: {err.key}: {err}") from None
    if recipe.data.kind != "synthetic":
        from xfw.run import data as real

        try:
            real.check(recipe, arch)  # reads the data, writes nothing: preparing it is real.prepare_data's
        except real.DataError as err:
            raise RecipeError(f"{source}: {err}") from None


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """Read, override and validate one recipe file; real data is checked (its files read, nothing written:
    ``xfw.run.data.prepare_data`` is the step that prepares it), so bad data is refused before anything
    launches. Raises RecipeError with a one-line message."""
    source = str(path)
    try:
        data = load_file(path, "recipe")
    except YamlError as err:
        raise RecipeError(str(err)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: (top level): must be a mapping, got {type(data).__name__}")
    _absolute_paths(data, [], Path(path).resolve().parent)
    per_backend.nest(data, source)  # so a --set of an override's key replaces the file's, whatever its form
    try:
        for assignment in overrides:
            apply_override(data, assignment, source)
    except SetError as err:
        raise RecipeError(str(err)) from None
    _absolute_paths(data, list(overrides), Path(path).resolve().parent)
    per_backend.nest(data, source)
    per_backend.absolute_paths(data, {a.split("=", 1)[0].strip() for a in overrides}, Path(path).resolve().parent)
    _apply_published(data, overrides, Path(path).resolve().parent, source)
    recipe = recipe_from_dict(data, source)
    _check_weights_dir(recipe.model.weights, source)
    try:
        arch = presets.resolve_arch(recipe.model.preset, recipe.model.arch, recipe.data.image_size, recipe.data.seq_len)
        recipe = command.resolve(recipe, Path(path).parent)  # backends that run a command (xfw.recipe.command)
    except (presets.ArchError, command.CommandError) as err:
        raise RecipeError(f"{source}: {err.key}: {err}") from None
    check_data(recipe, arch, source)
    for backend, own in per_backend.backend_overrides(recipe).items():
        if any(key.split(".")[0] in ("model", "data") for key in own):  # its model or its data differ: checked too
            try:
                _check_effective(per_backend.effective(recipe, backend, source), source)
            except RecipeError as err:  # "source: key: message" named by the override's key
                key, _, message = str(err).removeprefix(f"{source}: ").partition(": ")
                if not re.fullmatch(r"[a-z_]+(\.[A-Za-z0-9_]+)*", key):
                    key, message = "", str(err).removeprefix(f"{source}: ")
                raise per_backend.named(key, message, backend, list(own), source) from None
    return recipe


def _check_effective(recipe: Recipe, source: str) -> None:
    """A backend's effective recipe through the checks beyond the schema: checkpoint directory,
    architecture, real data (that backend's own, checked here)."""
    _check_weights_dir(recipe.model.weights, source)
    try:
        arch = presets.resolve_arch(recipe.model.preset, recipe.model.arch, recipe.data.image_size, recipe.data.seq_len)
    except presets.ArchError as err:
        raise RecipeError(f"{source}: {err.key}: {err}") from None
    check_data(recipe, arch, source)


def _check_weights_dir(weights: str, source: str) -> None:
    """``model.weights`` names a directory holding a checkpoint (a single file or Hugging Face shards)."""
    if weights == "random":
        return
    path = Path(weights)
    if not path.is_dir():
        raise RecipeError(f"{source}: model.weights: {weights} is not a directory (give a checkpoint directory, "
                          "or 'random')")
    if not any((path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        raise RecipeError(f"{source}: model.weights: {weights} holds no model.safetensors "
                          "(nor model.safetensors.index.json)")
