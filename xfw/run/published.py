"""The two comparisons a recipe can be run as (docs/recipes.md, "Two comparisons"):

* ``like-for-like`` (the default): one algorithm on both sides, as the recipe says; the framework
  comparison. Every deliberate choice is named in the recipe and docs/recipes.md.
* ``published``: each side with the mechanisms its own benchmark script ran (sharding implementation
  and its config, attention kernel, optimizer implementation, TF32, checkpointing style, environment
  flags), read from the recipe's published-settings file, every value with its source. It reproduces
  someone's table; it is not a framework comparison.

A recipe names the seed row it stands for with ``published: llava7b_sft`` (a file in
``recipes/published/``) or a path to such a file; ``comparison: published`` (``xfw compare --as
published``) applies that file's entries as backend knobs (``backends.<side>.<key>``) and variables
(``backends.<side>.env.<NAME>``), except where the user's own ``--set`` names the same key. What a
script did that xfw does not reproduce stays in the file as a ``not_reproduced`` entry, and every
report lists it. The file format (``recipes/published/*.yaml``)::

    row: llava7b-sft
    sources: {mix_run: {repo: PaddlePaddle/PaddleMIX, commit: <40 hex>, path: tests/.../run_benchmark.sh}}
    sides:
      torch:
        - {key: sharding_impl, value: deepspeed, source: bench_run, line: 40}
        - {key: env.NCCL_ALGO, value: "Tree", source: bench_run, line: 12}
        - {not_reproduced: "what the script did and why xfw does not", source: bench_run, line: 7}
    throughput: {paddle: {definition: step_mean, skip_steps: 2, source: mix_run, line: 30}}
"""

from __future__ import annotations

import re
from pathlib import Path

from xfw.run.yamlfile import YamlError, load_file

COMPARISONS = ("like-for-like", "published")
PUBLISHED_DIR = Path(__file__).resolve().parents[2] / "recipes" / "published"
THROUGHPUT_DEFINITIONS = ("window", "step_mean", "whole_run", "rank0_times")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")


class PublishedError(ValueError):
    """A published-settings file that cannot be used; ``str()`` is one line naming file and key."""


def locate(name: str, recipe_dir: Path) -> Path:
    """``published:`` as a file: a ``.yaml`` path (relative to the recipe's directory), or a name in
    ``recipes/published/``."""
    if name.endswith((".yaml", ".yml")):
        path = Path(name).expanduser()
        return path if path.is_absolute() else (recipe_dir / path).resolve()
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise PublishedError(f"published: {name!r} is neither a name in recipes/published/ nor a .yaml path")
    return PUBLISHED_DIR / f"{name}.yaml"


def _cite(sources: dict, entry: dict, where: str) -> str:
    """``repo@commit12:path#Lline`` for an entry's source (a PublishedError when it names none)."""
    sid = entry.get("source")
    if sid not in sources:
        raise PublishedError(f"{where}.source: {sid!r} is not one of the file's sources ({', '.join(sources)})")
    src = sources[sid]
    line = entry.get("line")
    return f"{src['repo']}@{src['commit'][:12]}:{src['path']}" + (f"#L{line}" if isinstance(line, int) else "")


def load(path: Path) -> dict:
    """A published-settings file, checked: ``{row, file, sides: {side: {"set": [...], "not_reproduced":
    [...]}}, throughput: {side: {...}}}`` with every entry's source cited as text."""
    where = str(path)
    if not path.is_file():
        raise PublishedError(f"{where}: no such published-settings file")
    try:
        data = load_file(path, "published settings")
    except YamlError as err:
        raise PublishedError(str(err)) from None
    if not isinstance(data, dict) or not isinstance(data.get("row"), str):
        raise PublishedError(f"{where}: row: must name the seed row (a string)")
    sources = data.get("sources") or {}
    if not isinstance(sources, dict):
        raise PublishedError(f"{where}: sources: must be a mapping of id -> {{repo, commit, path}}")
    for sid, src in sources.items():
        if not isinstance(src, dict) or not all(isinstance(src.get(k), str) for k in ("repo", "commit", "path")):
            raise PublishedError(f"{where}: sources.{sid}: needs repo, commit and path (strings)")
        if not _COMMIT.fullmatch(src["commit"]):
            raise PublishedError(f"{where}: sources.{sid}.commit: {src['commit']!r} is not a full 40-hex commit")
    sides: dict[str, dict] = {}
    for side, entries in (data.get("sides") or {}).items():
        if not isinstance(entries, list):
            raise PublishedError(f"{where}: sides.{side}: must be a list of entries")
        out = sides[side] = {"set": [], "not_reproduced": []}
        for i, entry in enumerate(entries):
            at = f"{where}: sides.{side}.{i}"
            if not isinstance(entry, dict):
                raise PublishedError(f"{at}: must be a mapping")
            cite = _cite(sources, entry, at)
            if "not_reproduced" in entry:
                out["not_reproduced"].append({"what": str(entry["not_reproduced"]), "source": cite})
                continue
            key = entry.get("key")
            if not isinstance(key, str) or not _KEY.fullmatch(key) or "value" not in entry:
                raise PublishedError(f"{at}: needs key (a dotted name) and value, or not_reproduced")
            if key.startswith("env.") and not isinstance(entry["value"], str):
                raise PublishedError(f"{at}.value: {key} is a variable: its value must be a string")
            out["set"].append({"key": key, "value": entry["value"], "source": cite})
    throughput = {}
    for side, spec in (data.get("throughput") or {}).items():
        at = f"{where}: throughput.{side}"
        if not isinstance(spec, dict) or spec.get("definition") not in THROUGHPUT_DEFINITIONS:
            raise PublishedError(f"{at}.definition: must be one of {', '.join(THROUGHPUT_DEFINITIONS)}")
        throughput[side] = {k: v for k, v in spec.items() if k in ("definition", "skip_steps", "n")}
        throughput[side]["source"] = _cite(sources, spec, at)
    return {"row": data["row"], "file": str(path), "sides": sides, "throughput": throughput}


def apply(data: dict, published: dict, given: set[str]) -> None:
    """Put a published file's entries into plain recipe data, in place: ``backends.<side>.<key>`` for
    each entry, except keys the user's ``--set`` named (``given``: their dotted paths)."""
    backends = data.setdefault("backends", {})
    if not isinstance(backends, dict):
        return  # the recipe's own validation names the problem
    for side, entries in published["sides"].items():
        knobs = backends.setdefault(side, {})
        if not isinstance(knobs, dict) or "command" in knobs:
            continue  # an attached command runs its own script: described, never altered (described())
        for entry in entries["set"]:
            path = f"backends.{side}.{entry['key']}"
            if path in given:
                continue
            node, *parents = knobs, *entry["key"].split(".")[:-1]
            for part in parents:
                node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
            node[entry["key"].split(".")[-1]] = entry["value"]


def described(kind: str, published: dict | None, backend: str, *, attached: bool) -> dict:
    """spec.json's ``comparison`` for one backend: which comparison this run belongs to and, with a
    published file, what it set on this side (with sources), what it could not reproduce, and how
    this side's script defined throughput. In like-for-like runs the file's entries are listed as
    ``not_applied``: what the published scripts did that this comparison deliberately does not."""
    out: dict = {"kind": kind}
    if published is None:
        return out
    side = published["sides"].get(backend, {"set": [], "not_reproduced": []})
    out.update(row=published["row"], file=published["file"], not_reproduced=list(side["not_reproduced"]))
    if kind == "published" and not attached:
        out["set"] = list(side["set"])
    else:
        out["not_applied"] = list(side["set"])
        if attached and kind == "published":
            out["not_reproduced"].append({"what": "an attached command runs its own script: xfw applies none "
                                                  "of this side's published settings to it", "source": "xfw"})
    if backend in published["throughput"]:
        out["throughput"] = dict(published["throughput"][backend])
    return out
