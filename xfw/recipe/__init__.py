"""Recipes: a YAML file in, a validated :class:`Recipe` and its ``spec.json`` out. Nothing here writes a file.

The modules import one way only, each from those above it in this list:

* :mod:`~xfw.recipe.yamlfile`  a file (or a ``--set`` value) read: bounded, strict YAML -> plain data
* :mod:`~xfw.recipe.names`  what may name a directory (a recipe, a suite, an instance label)
* :mod:`~xfw.recipe.schema`  plain data -> a frozen, typed, range-checked section (every error names its key)
* :mod:`~xfw.recipe.data_section`, :mod:`~xfw.recipe.command`  the data section; a backend's attached command
* :mod:`~xfw.recipe.assign`  one ``--set key.path=value`` applied to plain data
* :mod:`~xfw.recipe.published`  a published row (``recipes/published/*.yaml``) read and applied as knobs
* :mod:`~xfw.recipe.sections`  the :class:`Recipe` dataclasses and their cross-section checks
* :mod:`~xfw.recipe.overrides`  per-backend overrides: a backend's own effective Recipe
* :mod:`~xfw.recipe.load`  ``load_recipe(path, overrides)``: the whole line above, plus the data checked (not prepared)
* :mod:`~xfw.recipe.spec`  ``resolve_spec(recipe, backend=..., run_id=...)``: the JSON an adapter reads

This package sits beside :mod:`xfw.run` (it may read :mod:`xfw.report` and :mod:`xfw.contract`); no module in it
imports this package itself, so these names are only the door for callers outside it.
"""

from xfw.recipe.load import load_recipe, recipe_from_dict  # noqa: F401 - the public door
from xfw.recipe.names import PLAIN_NAME_RULE, is_plain_name  # noqa: F401
from xfw.recipe.sections import Recipe, RecipeError  # noqa: F401
