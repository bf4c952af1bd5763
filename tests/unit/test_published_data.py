"""recipes/published/*.yaml: each seed row's settings as its own benchmark scripts ran them (data only).

Read with the project's strict YAML loader, without the code that applies them, so that a malformed file is
caught here before `xfw compare --as published` reads it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from xfw.recipe.yamlfile import load_file
from xfw.recipe.published import MECHANISMS

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
PUBLISHED = ROOT / "recipes" / "published"

TORCH_KNOBS = {
    "sharding_impl": {"fsdp2", "fsdp1", "deepspeed", "zero1"},
    "attn_implementation": {"eager", "sdpa", "flash_attention_2"},
    "tf32": {True, False},
    "tf32_conv": {True, False},
    "compile": {True, False},
    "optimizer_impl": {"fused", "foreach", "for_loop"},
    "checkpointing": {"reentrant", "non_reentrant"},
    "recompute": {True, False},
}
PADDLE_KNOBS = {"find_unused_parameters": {True, False}, "attn_implementation": {"eager", "sdpa"},
                "stage2_overlap": {True, False}}
DEFINITIONS = {"window", "step_mean", "whole_run", "rank0_times"}
SIDES = {"paddle": PADDLE_KNOBS, "torch": TORCH_KNOBS}
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _published(recipe: Path) -> Path:
    return PUBLISHED / recipe.name


def _problems(path: Path, recipe_name: str) -> list[str]:
    """Every rule a published file breaks, as one line each (empty: the file is sound)."""
    data = load_file(path)
    bad = []
    if set(data) != {"row", "sources", "sides", "throughput"}:
        bad.append(f"top-level keys {sorted(data)}")
    if data.get("row") != recipe_name:
        bad.append(f"row {data.get('row')!r} is not the recipe's name {recipe_name!r}")
    sources = data.get("sources") or {}
    for sid, src in sources.items():
        if set(src) != {"repo", "commit", "path"}:
            bad.append(f"source {sid}: keys {sorted(src)}")
            continue
        if not re.fullmatch(r"[0-9a-f]{40}", str(src["commit"])):
            bad.append(f"source {sid}: commit {src['commit']!r} is not 40 hex digits")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", str(src["repo"])) or not src["path"]:
            bad.append(f"source {sid}: repo/path {src['repo']!r} {src['path']!r}")
    cited = set()

    def cite(where: str, entry: dict):
        cited.add(entry.get("source"))
        if entry.get("source") not in sources:
            bad.append(f"{where}: source {entry.get('source')!r} is not in sources")
        if not isinstance(entry.get("line"), int) or isinstance(entry.get("line"), bool) or entry["line"] < 1:
            bad.append(f"{where}: line {entry.get('line')!r} is not a positive integer")

    sides = data.get("sides") or {}
    if set(sides) != set(SIDES):
        bad.append(f"sides {sorted(sides)}")
    for side, entries in sides.items():
        knobs = SIDES.get(side, {})
        seen = set()
        for i, entry in enumerate(entries or []):
            where = f"sides.{side}[{i}]"
            cite(where, entry)
            if "not_reproduced" in entry:
                if set(entry) != {"not_reproduced", "source", "line"} or not str(entry["not_reproduced"]).strip():
                    bad.append(f"{where}: a not_reproduced entry holds one sentence, a source and a line")
                continue
            if "recorded" in entry:  # recorded, never set: a mechanism both frameworks have (published.MECHANISMS)
                if set(entry) != {"key", "value", "recorded", "source", "line"} or \
                        entry["recorded"] not in ("default", "script") or entry["key"] not in MECHANISMS:
                    bad.append(f"{where}: a recorded entry is key (a mechanism), value, recorded, source and line")
                if entry.get("key") in seen:
                    bad.append(f"{where}: {entry.get('key')} given twice")
                seen.add(entry.get("key"))
                continue
            if set(entry) != {"key", "value", "source", "line"}:
                bad.append(f"{where}: keys {sorted(entry)}")
                continue
            key, value = entry["key"], entry["value"]
            if key in seen:
                bad.append(f"{where}: {key} given twice")
            seen.add(key)
            if key.startswith("env."):
                if not ENV_NAME.match(key[4:]):
                    bad.append(f"{where}: {key} is not an environment variable name")
                if not isinstance(value, str):
                    bad.append(f"{where}: {key} value {value!r} is not a string")
            elif side == "torch" and key.startswith("deepspeed."):
                if not ENV_NAME.match(key[len("deepspeed."):]):
                    bad.append(f"{where}: {key} is not a DeepSpeed config key")
            elif key not in knobs:
                bad.append(f"{where}: {key} is not a {side} knob")
            elif value not in knobs[key]:
                bad.append(f"{where}: {key}={value!r} is not one of {sorted(map(str, knobs[key]))}")
    throughput = data.get("throughput") or {}
    if set(throughput) != set(SIDES):
        bad.append(f"throughput sides {sorted(throughput)}")
    for side, spec in throughput.items():
        where = f"throughput.{side}"
        cite(where, spec)
        definition = spec.get("definition")
        if definition not in DEFINITIONS:
            bad.append(f"{where}: definition {definition!r}")
        if definition == "rank0_times" and spec.get("n") != 8:
            bad.append(f"{where}: rank0_times needs n: 8")
        if definition == "step_mean" and not isinstance(spec.get("skip_steps"), int):
            bad.append(f"{where}: step_mean needs skip_steps")
        extra = set(spec) - {"definition", "skip_steps", "n", "source", "line"}
        if extra:
            bad.append(f"{where}: unknown keys {sorted(extra)}")
    unused = set(sources) - cited
    if unused:
        bad.append(f"sources never cited: {sorted(unused)}")
    return bad


def test_every_seed_recipe_has_a_published_file_and_no_file_is_orphaned():
    assert len(RECIPES) == 12
    missing = [r.name for r in RECIPES if not _published(r).is_file()]
    assert missing == []
    orphans = {p.name for p in PUBLISHED.glob("*.yaml")} - {r.name for r in RECIPES}
    assert orphans == set()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_published_file_is_sound(recipe):
    assert _problems(_published(recipe), load_file(recipe)["name"]) == []


def test_the_checks_catch_a_broken_file(tmp_path):
    good = (PUBLISHED / "llava7b_sft.yaml").read_text()
    assert _problems(PUBLISHED / "llava7b_sft.yaml", "llava7b-sft") == []
    broken = (good.replace("value: \"1\", source: mix_run, line: 119", "value: 1, source: mix_run, line: 119")
              .replace("value: flash_attention_2", "value: flash3")
              .replace("source: bench_mem, line: 4", "source: nowhere, line: 4")
              .replace("00be7c0a54da85019287e1c5a7ac83f939c69733", "00be7c0")
              .replace("definition: whole_run", "definition: mean_of_something"))
    path = tmp_path / "llava7b_sft.yaml"
    path.write_text(broken)
    found = "\n".join(_problems(path, "llava7b-sft"))
    for expected in ("FLAGS_cudnn_deterministic value 1 is not a string", "flash3", "'nowhere' is not in sources",
                     "not 40 hex digits", "mean_of_something", "never cited: ['bench_mem']"):
        assert expected in found
    assert _problems(PUBLISHED / "llava7b_sft.yaml", "llava7b-pretrain") != []
