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
      paddle:
        - {key: checkpointing, value: non_reentrant, recorded: default, source: nlp_config, line: 271}
        - {key: tf32, value: false, recorded: script, source: mix_run, line: 120}
    throughput: {paddle: {definition: step_mean, skip_steps: 2, source: mix_run, line: 30}}

A ``recorded`` entry is a mechanism the side ran that xfw records but does not set (no knob of that side's adapter
carries it, or another entry already does): ``recorded: default`` — not set by the script, the framework's default,
read at its source; ``recorded: script`` — the script's own value (a variable above it sets it, or a flag xfw's adapter
runs the same way). Every key in :data:`MECHANISMS` that one side of a row records is recorded on the other
(:func:`one_sided_mechanisms`; tests/unit/test_reports_round4.py holds every published file to it).
"""

from __future__ import annotations

import re
from pathlib import Path

from xfw.recipe.yamlfile import YamlError, load_file
from xfw.run.launch import instances

COMPARISONS = ("like-for-like", "published")
MECHANISMS = ("attn_implementation", "checkpointing", "optimizer_impl", "recompute", "tf32", "tf32_conv")
"""The mechanisms both frameworks have, so a row that records one for one side records it for the other. A
sharding implementation's own configuration (``sharding_impl``, ``deepspeed.*``, Paddle's ``stage2_overlap``), a
framework's variables (``env.*``) and PyTorch's ``compile`` and ``fused_optimizer`` belong to one side."""
RECORDED = {"default": "not set by the script — the framework's default, {value}, from {source}",
            "script": "the script's own value, {value} ({source}), recorded: no knob of xfw's adapter sets it"}
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
        try:
            path = Path(name).expanduser()
            return path if path.is_absolute() else (recipe_dir / path).resolve()
        except (OSError, RuntimeError, ValueError) as err:  # a symlink loop, a NUL
            raise PublishedError(f"published: {name[:200]!r}: cannot be resolved "
                                 f"({getattr(err, 'strerror', None) or err})") from None
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise PublishedError(f"published: {name!r} is neither a name in recipes/published/ nor a .yaml path")
    return PUBLISHED_DIR / f"{name}.yaml"


NOT_SETTABLE = ("command", "cwd", "log_pattern", "override")
"""Keys of ``backends.<side>`` that are no setting of a benchmark script: a published file never sets them."""
MAX_TEXT = 4096
"""Longest text a published file gives (a not_reproduced note, a row name)."""
MAX_STEPS = 1_000_000
MAX_N = 1_000_000


def declared_knobs(side: str) -> dict | None:
    """The knobs ``side``'s adapter declares (``adapters/*/xfw_<side>/knobs.json``), None where none does."""
    from xfw.contract import knobs as declaration

    found = sorted(PUBLISHED_DIR.parents[1].glob(f"adapters/*/xfw_{side}/{declaration.KNOBS_FILE}")) \
        if re.fullmatch(r"[a-z][a-z0-9_]*", side) else []
    return declaration.read_spec(found[0]) if found else None


def _entry_problem(side: str, key: str, value, declared: dict | None) -> str | None:
    """Why a published ``key: value`` for ``side`` cannot be set, or None: a published file sets only
    what a benchmark script's row can have, its side's declared knobs and variables."""
    from xfw.contract import knobs as declaration
    from xfw.recipe.command import CommandError, check_env

    head = key.split(".")[0]
    if head == "env":
        parts = key.split(".")
        if len(parts) != 2:
            return f"key: {key!r}: a variable is env.NAME"
        try:
            check_env(f"backends.{side}", {parts[1]: value})
        except CommandError as err:
            return f"key: {key!r}: {err}"
        return None
    if head in NOT_SETTABLE:
        return (f"key: {key!r} is not a setting a published row can have (a published file is cited data: it sets "
                "knobs and variables, never a command or an override)")
    if declared is None:
        return None  # a backend that declares nothing here: its adapter checks its knobs
    if head not in declared["knobs"]:
        return f"key: {key!r}: not a knob of backends.{side} (accepted: {', '.join(sorted(declared['knobs']))}, env.NAME)"
    if key == head:
        problem = declaration.check(side, {key: value}, declared["knobs"], declared["types"])
        if problem:
            return f"value: {problem}"
    return None


def _int_in(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _cite(sources: dict, entry: dict, where: str) -> str:
    """``repo@commit12:path#Lline`` for an entry's source (a PublishedError when it names none)."""
    sid = entry.get("source")
    if not isinstance(sid, str) or sid not in sources:
        raise PublishedError(f"{where}.source: {str(sid)[:80]!r} is not one of the file's sources "
                             f"({', '.join(sources)})")
    src = sources[sid]
    line = entry.get("line")
    if line is not None and not _int_in(line, 1, 10**9):
        raise PublishedError(f"{where}.line: {str(line)[:80]!r} is not a line number")
    return f"{src['repo']}@{src['commit'][:12]}:{src['path']}" + (f"#L{line}" if isinstance(line, int) else "")


def load(path: Path) -> dict:
    """A published-settings file, checked: ``{row, file, sides: {side: {"set": [...], "not_reproduced":
    [...]}}, throughput: {side: {...}}}`` with every entry's source cited as text."""
    where = str(path)
    try:
        exists = path.is_file()
    except OSError as err:  # a symlink loop on Pythons whose is_file raises
        raise PublishedError(f"{where}: cannot read published settings ({err.strerror or err})") from None
    if not exists:
        raise PublishedError(f"{where}: no such published-settings file")
    try:
        data = load_file(path, "published settings")
    except YamlError as err:
        raise PublishedError(str(err)) from None
    if not isinstance(data, dict) or not isinstance(data.get("row"), str) or len(data["row"]) > MAX_TEXT:
        raise PublishedError(f"{where}: row: must name the seed row (a string)")
    unknown = sorted(set(data) - {"row", "sources", "sides", "throughput"})
    if unknown:
        raise PublishedError(f"{where}: {unknown[0]}: unknown key (a published file has row, sources, sides, "
                             "throughput)")
    sources = data.get("sources") or {}
    if not isinstance(sources, dict):
        raise PublishedError(f"{where}: sources: must be a mapping of id -> {{repo, commit, path}}")
    for sid, src in sources.items():
        if not isinstance(src, dict) or not all(isinstance(src.get(k), str) for k in ("repo", "commit", "path")):
            raise PublishedError(f"{where}: sources.{sid}: needs repo, commit and path (strings)")
        if not _COMMIT.fullmatch(src["commit"]):
            raise PublishedError(f"{where}: sources.{sid}.commit: {src['commit'][:80]!r} is not a full 40-hex commit")
    sides: dict[str, dict] = {}
    all_sides = data.get("sides") or {}
    if not isinstance(all_sides, dict):
        raise PublishedError(f"{where}: sides: must be a mapping of backend -> list of entries")
    for side, entries in all_sides.items():
        if not isinstance(entries, list):
            raise PublishedError(f"{where}: sides.{side}: must be a list of entries")
        declared = declared_knobs(side)
        out = sides[side] = {"set": [], "not_reproduced": [], "recorded": []}
        for i, entry in enumerate(entries):
            at = f"{where}: sides.{side}.{i}"
            if not isinstance(entry, dict):
                raise PublishedError(f"{at}: must be a mapping")
            cite = _cite(sources, entry, at)
            if "not_reproduced" in entry:
                what = entry["not_reproduced"]
                if not isinstance(what, str) or not what.strip() or len(what) > MAX_TEXT:
                    raise PublishedError(f"{at}.not_reproduced: must be text (at most {MAX_TEXT} characters)")
                out["not_reproduced"].append({"what": " ".join(what.split()), "source": cite})
                continue
            key = entry.get("key")
            if not isinstance(key, str) or not _KEY.fullmatch(key) or "value" not in entry:
                raise PublishedError(f"{at}: needs key (a dotted name) and value, or not_reproduced")
            if key.startswith("env.") and not isinstance(entry["value"], str):
                raise PublishedError(f"{at}.value: {key} is a variable: its value must be a string")
            if "recorded" in entry:
                if entry["recorded"] not in RECORDED or key.startswith("env."):
                    raise PublishedError(f"{at}.recorded: must be one of {', '.join(RECORDED)} (a mechanism, not a "
                                         "variable)")
                out["recorded"].append({"key": key, "value": entry["value"], "source": cite, "how": entry["recorded"],
                                        "text": RECORDED[entry["recorded"]].format(value=entry["value"], source=cite)})
                continue
            problem = _entry_problem(side, key, entry["value"], declared)
            if problem:
                raise PublishedError(f"{at}.{problem}")
            out["set"].append({"key": key, "value": entry["value"], "source": cite})
    throughput = {}
    all_throughput = data.get("throughput") or {}
    if not isinstance(all_throughput, dict):
        raise PublishedError(f"{where}: throughput: must be a mapping of backend -> definition")
    for side, spec in all_throughput.items():
        at = f"{where}: throughput.{side}"
        if not isinstance(spec, dict) or spec.get("definition") not in THROUGHPUT_DEFINITIONS:
            raise PublishedError(f"{at}.definition: must be one of {', '.join(THROUGHPUT_DEFINITIONS)}")
        problem = throughput_problem(spec)
        if problem:
            raise PublishedError(f"{at}.{problem}")
        throughput[side] = {k: v for k, v in spec.items() if k in ("definition", "skip_steps", "n")}
        throughput[side]["source"] = _cite(sources, spec, at)
    return {"row": data["row"], "file": str(path), "sides": sides, "throughput": throughput}


def one_sided_mechanisms(published: dict) -> list[str]:
    """Each :data:`MECHANISMS` key a loaded published file records (set or ``recorded``) for one side and not the
    other, as ``"<key>: <side> only"``; [] when every mechanism is on both sides or neither."""
    keys = {side: {e["key"] for kind in ("set", "recorded") for e in entries[kind]} & set(MECHANISMS)
            for side, entries in published["sides"].items()}
    out = []
    for side, mine in sorted(keys.items()):
        for key in sorted(mine):
            missing = [other for other, theirs in sorted(keys.items()) if key not in theirs]
            if missing:
                out.append(f"{key}: {side} only (not on {', '.join(missing)})")
    return out


def throughput_problem(spec: dict) -> str | None:
    """Why a throughput definition's ``skip_steps`` or ``n`` cannot be used ("key: why"), or None."""
    if "skip_steps" in spec and not _int_in(spec["skip_steps"], 0, MAX_STEPS):
        return f"skip_steps: {str(spec['skip_steps'])[:80]!r} is not a whole number of steps in [0, {MAX_STEPS}]"
    if "n" in spec and not _int_in(spec["n"], 1, MAX_N):
        return f"n: {str(spec['n'])[:80]!r} is not a whole number in [1, {MAX_N}] (the processes it multiplies by)"
    return None


def _given(path: str, given: set[str]) -> bool:
    """Whether a ``--set`` named ``path`` or a mapping above it (``backends.torch={tf32: false}``)."""
    parts = path.split(".")
    return any(".".join(parts[:i]) in given for i in range(1, len(parts) + 1))


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
            if _given(path, given):
                continue
            node, *parents = knobs, *entry["key"].split(".")[:-1]
            for part in parents:
                node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
            node[entry["key"].split(".")[-1]] = entry["value"]


_MISSING = object()


def _value_at(knobs: dict, key: str):
    node = knobs
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def described(kind: str, published: dict | None, backend: str, *, attached: bool, knobs: dict | None = None) -> dict:
    """spec.json's ``comparison`` for one backend: which comparison this run belongs to and, with a
    published file, what it set on this side (with sources), what it could not reproduce, and how
    this side's script defined throughput (``knobs``: this side's ``backends.<backend>`` as it runs; a
    published entry it does not hold, a ``--set`` replaced, is listed as ``replaced`` with the value
    that ran, never as set). In like-for-like runs the file's entries are listed as
    ``not_applied``: what the published scripts did that this comparison deliberately does not."""
    out: dict = {"kind": kind}
    if published is None:
        return out
    backend = instances.adapter_of(backend)  # an instance (paddle@3.2.0) is its framework's side
    side = published["sides"].get(backend, {"set": [], "not_reproduced": [], "recorded": []})
    out.update(row=published["row"], file=published["file"], not_reproduced=list(side["not_reproduced"]),
               recorded=list(side.get("recorded", [])))
    if kind == "published" and not attached:
        out["set"], out["replaced"] = [], []
        for entry in side["set"]:
            ran = _value_at(knobs or {}, entry["key"])
            if ran == entry["value"] and type(ran) is type(entry["value"]):
                out["set"].append(dict(entry))
            else:  # the user's --set (or a mapping above it) gave this key: what ran is the run's own value
                out["replaced"].append({**entry, "ran": None if ran is _MISSING else ran})
    else:
        out["not_applied"] = list(side["set"])
        if attached and kind == "published":
            out["not_reproduced"].append({"what": "an attached command runs its own script: xfw applies none "
                                                  "of this side's published settings to it", "source": "xfw"})
    if backend in published["throughput"]:
        out["throughput"] = dict(published["throughput"][backend])
    return out
