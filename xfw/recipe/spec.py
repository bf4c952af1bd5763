"""The spec an adapter reads: a validated :class:`~xfw.recipe.Recipe` resolved into the
JSON-ready ``spec.json``, with every default filled in, the preset expanded into the neutral
architecture, real data prepared and the comparison (``xfw.recipe.published``) described per backend."""

from __future__ import annotations

import functools
from pathlib import Path

from xfw.contract import presets
from xfw.contract import weights as neutral_weights
from xfw.recipe import overrides as per_backend
from xfw.recipe import published as published_settings
from xfw.recipe.sections import Recipe, RecipeError
from xfw.recipe.schema import to_dict

SPEC_SCHEMA = 1


@functools.lru_cache(maxsize=64)
def _weights_fingerprint(directory: str) -> str:
    return neutral_weights.fingerprint(directory)


def published_table(recipe: Recipe) -> dict | None:
    """The recipe's published-settings file, loaded (None when it names none)."""
    if recipe.published is None:
        return None
    try:
        # load_recipe made it a path; a Recipe built from a dict may still hold a row's name
        return published_settings.load(published_settings.locate(recipe.published, Path.cwd()))
    except published_settings.PublishedError as err:
        raise RecipeError(f"{recipe.name}: {err}") from None


def longest_sample(recipe: Recipe, arch: dict, prepared: dict | None) -> int | None:
    """The longest sequence a run can train (image tokens included): synthetic data's fixed length
    or fixed part + the most text tokens, real data's longest prepared sample; None without a sequence."""
    from xfw.contract import families

    if arch["data"].get("seq_len") is None:
        return None
    if prepared is not None:
        return prepared["stats"]["max_seq_len"] or None
    tokens = recipe.data.text_tokens
    return arch["data"]["seq_len"] if tokens is None else families.fixed_tokens(arch) + tokens.max


def resolve_spec(recipe: Recipe, *, backend: str, run_id: str) -> dict:
    """The fully resolved spec.json an adapter reads: every default filled, preset expanded, real
    data's prepared directory in ``data.prepared`` (through ``xfw.run.data.prepare_data``: found prepared, or
    prepared now for a recipe derived after the workflow's own step).

    ``recipe`` is the recipe as loaded: the spec is resolved from ``backend``'s effective recipe
    (its ``backends.<backend>.override`` applied: :func:`xfw.recipe.overrides.backend_recipe`), and records
    that override as ``overrides`` (dotted keys, plain values) with the recipe's own values at those
    keys as ``overridden``; both are absent without one. No ``override`` reaches the adapter's knobs."""
    own = per_backend.backend_overrides(recipe).get(backend, {})
    replaced = per_backend.recipe_values(recipe, list(own))
    recipe = per_backend.backend_recipe(recipe, backend)
    arch = presets.resolve_arch(recipe.model.preset, recipe.model.arch, recipe.data.image_size, recipe.data.seq_len)
    spec = to_dict(recipe)
    spec["model"]["family"] = arch["family"]
    spec["model"]["arch"] = arch
    # Provenance: which checkpoint a run started from, by content (reports show it; parity matches on it).
    spec["model"]["weights_fingerprint"] = None if recipe.model.weights == "random" else \
        _weights_fingerprint(recipe.model.weights)
    spec["data"]["image_size"] = arch["data"]["image_size"]
    spec["data"]["seq_len"] = arch["data"]["seq_len"]
    prepared = None
    if recipe.data.kind != "synthetic":
        from xfw.run import data as real

        try:  # a lookup once the workflow's prepare_data ran; a recipe derived since (a sweep point) is prepared here
            prepared = real.prepare_data(recipe)
        except real.DataError as err:
            raise RecipeError(f"{recipe.name}: {err}") from None
        spec["data"]["prepared"] = prepared["directory"]
        spec["data"]["stats"] = prepared["stats"]
        # Provenance (the compare report's data line): the preparation's content key and size.
        spec["data"]["fingerprint"] = prepared["fingerprint"]
        spec["data"]["num_samples"] = prepared["stats"]["num_samples"]
    spec["data"]["longest"] = longest_sample(recipe, arch, prepared)
    spec["derived"] = {"num_processes": recipe.num_processes, "grad_accum_steps": recipe.grad_accum_steps}
    spec["backend"] = backend
    spec["backends"] = {name: {k: v for k, v in knobs.items() if k != per_backend.OVERRIDE}
                        for name, knobs in spec["backends"].items() if set(knobs) != {per_backend.OVERRIDE}}
    knobs = dict(spec["backends"].get(backend, {}))
    attached = "command" in knobs
    # An adapter's variables reach its processes through the launcher; the adapter sees its knobs only.
    spec["backend_env"] = dict(knobs.get("env", {}))
    spec["backend_knobs"] = knobs if attached else {k: v for k, v in knobs.items() if k != "env"}
    spec["comparison"] = published_settings.described(recipe.comparison, published_table(recipe), backend,
                                                      attached=attached, knobs=knobs)
    if own:  # a deliberate difference: every report shows it (xfw.report.compare.deliberate_differences)
        spec["overrides"], spec["overridden"] = dict(own), replaced
    spec["run_id"] = run_id
    spec["schema"] = SPEC_SCHEMA
    return spec
