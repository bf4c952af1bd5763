"""Suites: the recipes a nightly job runs, on which backends, and when a change is a regression.

A suite is a YAML file (``suites/cpu_smoke.yaml``)::

    name: cpu-smoke
    backends: [paddle, torch]
    set: [measure.steps=8]            # applied to every entry (before the entry's own `set`)
    regression: {window: 7, ips_drop: 0.25, mem_growth: 0.10, noise_k: 3}
    slurm: {executor: slurm, partition: h800, time: 90}   # optional: where the runs go (docs/slurm.md)
    entries:
      - recipe: ../recipes/tiny/llava_sft.yaml     # relative to the suite file
      - recipe: ../recipes/tiny/sd15_lora.yaml
        set: [batch.micro=2]
        label: sd15-lora-micro2                   # default: the recipe's name
      - recipe: ../recipes/tiny/llava_json_sft.yaml
        label: llava-json-converge
        converge: {seeds: 2, steps: 40, eval_every: 20}   # optional: target, eval_samples (xfw converge's options)

A ``converge:`` entry runs ``xfw converge`` (xfw.run.commands.converge) instead of one run per backend: it needs
exactly two backends (the suite's, in its order: the second is the reference) and real data; its plan
is made here, so a bad value or a synthetic-data recipe is refused before the night starts.

``load_suite`` validates the whole file and every entry's recipe (with the suite's, the entry's
and the command line's overrides) before anything runs; a problem is one line naming the file
and the key, e.g. ``suites/x.yaml: entries[2].recipe: no such file ../recipes/tiny/nope.yaml``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from xfw.report.selfcheck import BY_NAME
from xfw.report.verdicts import RegressionPolicy
from xfw.recipe.command import command_of
from xfw.recipe.overrides import refuse_forced
from xfw.run.commands.counts import count_problem
from xfw.run.commands.converge import ConvergeError, Plan, plan
from xfw.recipe import PLAIN_NAME_RULE, Recipe, RecipeError, is_plain_name, load_recipe
from xfw.run.commands.selfcheck import FAMILY_RECIPES
from xfw.recipe.yamlfile import YamlError, load_file


class SuiteError(ValueError):
    """A suite file that cannot run; the message names the file and the key."""


@dataclass(frozen=True, kw_only=True)
class Entry:
    label: str
    """Unique within the suite: the run directory's name and the history's key."""
    recipe_path: Path
    overrides: tuple[str, ...]
    """Suite-level, then the entry's own, then the command line's ``--set``."""
    recipe: Recipe
    converge: Plan | None = None
    """A converge entry's plan (``converge:`` in the suite): both backends' learning curves, not one run each."""


@dataclass(frozen=True, kw_only=True)
class Suite:
    name: str
    path: Path
    backends: tuple[str, ...]
    entries: tuple[Entry, ...]
    regression: RegressionPolicy = field(default_factory=RegressionPolicy)
    overrides: tuple[str, ...] = ()
    """The suite's own ``set`` (applied to every entry before the entry's and the command line's)."""
    selfcheck: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    """(families, settings paths) ``xfw selfcheck`` runs before the entries (fp32 first), or None."""
    slurm: dict = field(default_factory=dict)
    """Its ``slurm:`` section (:func:`slurm_section`): where the night's runs go; the command line overrides."""


_TOP_KEYS = {"name", "backends", "set", "regression", "entries", "description", "selfcheck", "slurm"}
_ENTRY_KEYS = {"recipe", "set", "label", "converge"}
CONVERGE_DEFAULTS = {"seeds": 3, "steps": 300, "eval_every": 25, "eval_samples": None, "target": None}
"""A converge entry's keys and their defaults (``xfw converge``'s options)."""


def _str_list(value, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and "=" in v for v in value):
        raise SuiteError(f"{where}: must be a list of key.path=value strings")
    return tuple(value)


def _policy(data, source: str) -> RegressionPolicy:
    if data is None:
        return RegressionPolicy()
    if not isinstance(data, dict):
        raise SuiteError(f"{source}: regression: must be a mapping")
    known = RegressionPolicy.__dataclass_fields__
    values = {}
    for key, value in data.items():
        if key not in known:
            raise SuiteError(f"{source}: regression.{key}: unknown key (known: {', '.join(known)})")
        wanted = int if key in ("window", "min_nights") else float
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (wanted is int and not isinstance(value, int)):
            raise SuiteError(f"{source}: regression.{key}: must be a{'n integer' if wanted is int else ' number'}, "
                             f"got {value!r}")
        low = 1 if key in ("window", "min_nights") else 0
        if value < low:
            raise SuiteError(f"{source}: regression.{key}: must be >= {low}, got {value!r}")
        values[key] = wanted(value)
    return RegressionPolicy(**values)


def _converge_options(data, where: str) -> dict:
    """A converge entry's mapping checked like ``xfw converge``'s options; the error names the key."""
    if not isinstance(data, dict):
        raise SuiteError(f"{where}.converge: a mapping such as {{seeds: 2, steps: 40, eval_every: 20}}, got {data!r}")
    unknown = sorted(set(data) - set(CONVERGE_DEFAULTS), key=str)
    if unknown:
        raise SuiteError(f"{where}.converge.{unknown[0]}: unknown key (known: {', '.join(CONVERGE_DEFAULTS)})")
    values = {**CONVERGE_DEFAULTS, **data}
    for key in ("seeds", "steps", "eval_every", "eval_samples"):
        value = values[key]
        if value is None and key == "eval_samples":
            continue
        problem = count_problem(key, value, f"{where}.converge.{key}")  # the bound xfw converge's option has
        if problem:
            raise SuiteError(problem)
    if values["steps"] < values["eval_every"]:
        raise SuiteError(f"{where}.converge.steps: {values['steps']} is fewer than eval_every {values['eval_every']}: "
                         "no evaluation would happen during training")
    target = values["target"]
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                               or not math.isfinite(target)):
        raise SuiteError(f"{where}.converge.target: must be a finite number (an eval loss to reach), got {target!r}")
    return values


def _selfcheck(data, source: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """``selfcheck: true`` (every family, every path), a mapping ``{families: [...], paths: [...]}``
    (either may be left out: all), or absent / false (none)."""
    if data is None or data is False:
        return None
    if data is True:
        data = {}
    if not isinstance(data, dict) or set(data) - {"families", "paths"}:
        raise SuiteError(f"{source}: selfcheck: true, or a mapping with families and/or paths")
    chosen = []
    for key, known in (("families", tuple(FAMILY_RECIPES)), ("paths", tuple(BY_NAME))):
        values = data.get(key, list(known))
        if not isinstance(values, list) or not values or not all(v in known for v in values):
            raise SuiteError(f"{source}: selfcheck.{key}: a non-empty list of {', '.join(known)}; got {values!r}")
        chosen.append(tuple(values))
    families, paths = chosen
    return families, ("fp32", *(p for p in paths if p != "fp32"))  # fp32: what every other path is held to


def _converge_plan(data, where: str, recipe_path: str, overrides: tuple[str, ...], backends: list,
                   recipe: Recipe) -> Plan:
    """A converge entry's plan, made now (its data prepared, its split and every seed's recipe checked)."""
    options = _converge_options(data, where)
    if len(backends) != 2:
        raise SuiteError(f"{where}.converge: a converge entry compares exactly two backends; the suite runs "
                         f"{len(backends)} ({', '.join(map(str, backends))})")
    attached = [name for name in backends if command_of(recipe, name) is not None]
    if attached:
        raise SuiteError(f"{where}.converge: backends.{attached[0]}.command: converge starts both sides from one "
                         "exported model, which only xfw's own adapters do")
    if recipe.parallel.nnodes > 1:
        raise SuiteError(f"{where}.converge: a converge entry runs on one node (the recipe has parallel.nnodes "
                         f"{recipe.parallel.nnodes})")
    try:
        chosen = plan(recipe_path, list(overrides), backends=tuple(backends), seeds=options["seeds"],
                      steps=options["steps"], eval_every=options["eval_every"], eval_samples=options["eval_samples"],
                      target=options["target"])
        forced = [*chosen.seed_overrides(chosen.seeds[0]), "model.weights=EXPORT"]  # as xfw converge
        refuse_forced(chosen.recipe, forced, "a converge entry")
        return chosen
    except (ConvergeError, RecipeError, ValueError) as err:
        raise SuiteError(f"{where}.converge: {err}") from None


SLURM_KEYS = {"executor": "choice", "partition": "name", "account": "name", "qos": "name", "constraint": "name",
              "time": "count", "gpus_per_node": "count", "cpus_per_task": "count", "max_queued": "count",
              "exclusive": "flag", "sbatch_args": "list"}
"""A suite's ``slurm:`` keys (docs/slurm.md), the same as the many-run commands' options; ``time`` in minutes."""


def slurm_section(data, source: str) -> dict:
    """A suite's ``slurm:`` section as the executor options it gives (``time`` as ``time_min``); SuiteError
    names the file and the key of a bad value."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SuiteError(f"{source}: slurm: a mapping such as {{executor: slurm, partition: h800, time: 90}}")
    chosen = {}
    for key, value in data.items():
        kind, where = SLURM_KEYS.get(key), f"{source}: slurm.{key}"
        if kind is None:
            raise SuiteError(f"{where}: unknown key (known: {', '.join(sorted(SLURM_KEYS))})")
        if kind == "choice" and value not in ("local", "slurm"):
            raise SuiteError(f"{where}: local or slurm, got {value!r}")
        if kind == "name" and (not isinstance(value, str) or not value.strip() or len(value) > 200):
            raise SuiteError(f"{where}: a non-empty name, got {value!r}")
        if kind == "count" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SuiteError(f"{where}: a whole number >= 1{' (minutes)' if key == 'time' else ''}, got {value!r}")
        if kind == "flag" and not isinstance(value, bool):
            raise SuiteError(f"{where}: true or false, got {value!r}")
        if kind == "list" and (not isinstance(value, list) or not all(isinstance(v, str) and v for v in value)):
            raise SuiteError(f"{where}: a list of sbatch arguments such as [--constraint=h800], got {value!r}")
        chosen["time_min" if key == "time" else key] = tuple(value) if kind == "list" else value
    return chosen


def suite_slurm(path: str | Path) -> dict:
    """Only the ``slurm:`` section of the suite at ``path`` (the CLI builds its executor before the night
    loads its recipes); {} when the file cannot be read (load_suite then says why)."""
    try:
        data = load_file(Path(path), "suite file")
    except YamlError:
        return {}
    return slurm_section(data.get("slurm"), str(path)) if isinstance(data, dict) else {}


def load_suite(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Suite:
    """Parse and validate a suite and every entry's recipe; SuiteError lists every problem."""
    path = Path(path)
    source = str(path)
    try:
        data = load_file(path, "suite file")
    except YamlError as err:
        raise SuiteError(str(err)) from None
    if not isinstance(data, dict):
        raise SuiteError(f"{source}: a suite is a mapping with name, backends and entries")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise SuiteError(f"{source}: {unknown[0]}: unknown key (known: {', '.join(sorted(_TOP_KEYS))})")
    name = data.get("name")
    if not is_plain_name(name):
        raise SuiteError(f"{source}: name: {str(name)[:120]!r} {PLAIN_NAME_RULE}")
    backends = data.get("backends")
    if not isinstance(backends, list) or not backends or not all(isinstance(b, str) and b for b in backends):
        raise SuiteError(f"{source}: backends: must be a non-empty list of backend names, e.g. [paddle, torch]")
    if len(set(backends)) != len(backends):
        raise SuiteError(f"{source}: backends: a backend is listed twice")
    common = _str_list(data.get("set"), f"{source}: set")
    policy = _policy(data.get("regression"), source)
    raw_entries = data.get("entries")
    if not isinstance(raw_entries, list) or not raw_entries:
        raise SuiteError(f"{source}: entries: must be a non-empty list of {{recipe: PATH}}")

    entries, problems = [], []
    for i, raw in enumerate(raw_entries):
        where = f"{source}: entries[{i}]"
        if isinstance(raw, str):
            raw = {"recipe": raw}
        if not isinstance(raw, dict):
            problems.append(f"{where}: must be a mapping with a recipe key, got {raw!r}")
            continue
        bad = sorted(set(raw) - _ENTRY_KEYS)
        if bad:
            problems.append(f"{where}.{bad[0]}: unknown key (known: {', '.join(sorted(_ENTRY_KEYS))})")
            continue
        recipe_ref = raw.get("recipe")
        if not isinstance(recipe_ref, str) or not recipe_ref:
            problems.append(f"{where}.recipe: required, a path to a recipe YAML (relative to the suite file)")
            continue
        recipe_path = (path.parent / recipe_ref)
        if not recipe_path.is_file():
            problems.append(f"{where}.recipe: no such file {recipe_ref} (looked for {recipe_path})")
            continue
        try:
            entry_overrides = (*common, *_str_list(raw.get("set"), f"{where}.set"), *overrides)
            recipe = load_recipe(recipe_path, list(entry_overrides))
        except (RecipeError, SuiteError) as err:
            problems.append(f"{where}: {err}")
            continue
        label = raw.get("label", recipe.name)
        if not is_plain_name(label):
            problems.append(f"{where}.label: {str(label)[:120]!r} {PLAIN_NAME_RULE}")
            continue
        chosen = None
        if "converge" in raw:
            try:
                chosen = _converge_plan(raw["converge"], where, str(recipe_path), entry_overrides, backends, recipe)
            except SuiteError as err:
                problems.append(str(err))
                continue
        entries.append(Entry(label=label, recipe_path=recipe_path, overrides=entry_overrides, recipe=recipe,
                             converge=chosen))
    labels = [e.label for e in entries]
    clash = next((label for label in labels if labels.count(label) > 1), None)
    if clash:
        problems.append(f"{source}: entries: two entries are labelled {clash!r}; give one a distinct label")
    if problems:
        raise SuiteError("\n".join(problems))
    return Suite(name=name, path=path, backends=tuple(backends), entries=tuple(entries), regression=policy,
                 overrides=tuple(common), selfcheck=_selfcheck(data.get("selfcheck"), source),
                 slurm=slurm_section(data.get("slurm"), source))
