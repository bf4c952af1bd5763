"""Every seed recipe's FLOPs ledger against PyTorch's FLOP counter: one real training step.

One PyTorch adapter process counts every case (``--count-flops FILE --spec ... --spec ...``,
:mod:`xfw_torch.flops`): the recipe's model built on the meta device as ``--count-params`` builds
it (stage freezing, LoRA adapters, and activation checkpointing when the recipe asks), its first
micro-batch through the loss, forward and backward, under ``torch.utils.flop_counter.FlopCounterMode``,
each product attributed to a ledger term (the family's parts, ``lora``) and a phase (forward and
backward are model FLOPs; a forward rerun in backward is recompute, hardware FLOPs only).

The family's analytic ledger (``xfw.contract.families.count_flops``, what MFU divides by) must give
the counted total and every term within 3%; a failure names every term that differs. The seeds are
counted at micro-batch 1 (FLOPs per sample; one tiny recipe is also counted at its own micro-batch
to show that a sample's FLOPs do not depend on it). Built on meta, a 13B model costs shapes, not
memory, but every operation of its 40 layers still passes through Python dispatch (about 95 CPU s for
the 12 seeds). So a seed's layer stacks are counted at 2 layers and at 3 layers in each stack, one stack
at a time (its widths, sequence, images and stage unchanged), and its full-depth count is their exact
linear extrapolation, per term: count(2) + (layers - 2) x (count(3 in that stack) - count(2)). The
stacks' layers are identical (no layer differs from its neighbours but SD3's last, pre-only block,
which stays last at every depth; LLaVA's feature layer is counted from the end, so the layers added
are used ones), so this is the full-depth count, not an estimate: the ledger at the seed's full depth
is held to it exactly as before. SD1.5's UNet has no layer stack and is counted whole; the tiny
recipes are counted as shipped. The module runs in about 25 CPU s.
"""

import copy
import json
import subprocess

import pytest

from xfw.contract import families
from xfw.recipe import load_recipe
from xfw.recipe.spec import resolve_spec

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract
TOLERANCE = 0.03
RECIPES = ROOT / "recipes"
PER_SAMPLE = ["batch.micro=1", "batch.global=1", "parallel.nproc_per_node=1", "parallel.nnodes=1",
              "parallel.sharding=none"]


def _lora(targets: str) -> str:
    return f"lora={{r: 4, alpha: 8, dropout: 0.0, targets: [{targets}]}}"


# (id, recipe, --set overrides): the seed's 12 rows at micro-batch 1; every tiny recipe; recompute
# on the families whose seeds do not use it; LoRA on every target a family lets a recipe name.
CASES = [(p.stem, p, PER_SAMPLE) for p in sorted(RECIPES.glob("*.yaml"))]
CASES += [(f"tiny/{p.stem}", p, []) for p in sorted((RECIPES / "tiny").glob("*.yaml"))]
CASES += [
    ("tiny/llava_next_lora_micro1", RECIPES / "tiny" / "llava_next_lora.yaml", PER_SAMPLE),
    ("tiny/sd3_dreambooth_recompute", RECIPES / "tiny" / "sd3_dreambooth.yaml", ["recompute=true"]),
    ("tiny/sd3_lora_all_targets_recompute", RECIPES / "tiny" / "sd3_lora.yaml",
     ["recompute=true", _lora(", ".join(families.family_module("sd3").LORA_TARGETS))]),
    ("tiny/qwen2vl_lora_all_targets_recompute", RECIPES / "tiny" / "qwen2vl_sft.yaml",
     ["stage=lora", "recompute=true", _lora(", ".join(families.family_module("qwen2vl").LORA_TARGETS))]),
]
IDS = [c[0] for c in CASES]
# The layer stacks per family, (arch section, key): a seed is counted at BASE layers in every stack,
# then once per stack at BASE + 1 (the module docstring). BASE 2: SD3's pre-only last block and
# LLaVA's feature layer -2 need two.
STACKS = {"llava": (("text", "num_layers"), ("vision", "num_layers")),
          "qwen2vl": (("text", "num_layers"), ("vision", "depth")),
          "sd3": (("transformer", "num_layers"),)}
BASE = 2


def spec_of(case) -> dict:
    _, path, overrides = case
    key = (str(path), tuple(overrides))
    if key not in _SPECS:  # each is asked for several times (depth counts, extrapolation, ledger)
        _SPECS[key] = resolve_spec(load_recipe(path, overrides), backend="torch", run_id="flops")
    return copy.deepcopy(_SPECS[key])


_SPECS: dict = {}


def test_every_seed_row_every_family_and_recompute_are_covered():
    seeds = [c for c in CASES if c[1].parent == RECIPES]
    assert len(seeds) == 12
    specs = [spec_of(c) for c in CASES]
    assert {(s["model"]["family"], s["stage"]) for s in specs} == \
        {(f, stage) for f in families.FAMILIES for stage in families.family_module(f).STAGE_PARTS}
    assert {s["model"]["family"] for s in specs if s["recompute"]} == set(families.FAMILIES)


def depth_counts(case) -> list[tuple[str, object, list[str], dict]]:
    """What is counted for ``case``: [(id, recipe, overrides, {stack: layers added})], the case
    itself for a tiny recipe or a family without a layer stack, else the seed at BASE layers in
    every stack and at BASE + 1 in each stack in turn."""
    cid, path, overrides = case
    stacks = STACKS.get(spec_of(case)["model"]["family"]) if path.parent == RECIPES else None
    if not stacks:
        return [(cid, path, overrides, {})]
    base = [f"model.arch.{section}.{key}={BASE}" for section, key in stacks]
    out = [(f"{cid}@{BASE}", path, overrides + base, {})]
    for i, (section, key) in enumerate(stacks):
        more = base[:i] + [f"model.arch.{section}.{key}={BASE + 1}"] + base[i + 1:]
        out.append((f"{cid}@{section}+1", path, overrides + more, {(section, key): 1}))
    return out


def full_depth(case, counts: dict[str, dict]) -> tuple[dict, list[dict]]:
    """(the case's count at its full depth, the adapter's counts it comes from): extrapolated per
    term from the depth counts (module docstring); the case's own count when it is counted whole."""
    parts = depth_counts(case)
    raw = [counts[p[0]] for p in parts]
    if len(parts) == 1 or any("status" in r for r in raw):
        return raw[0], raw
    arch = spec_of(case)["model"]["arch"]
    base = raw[0]
    assert all(r["samples"] == base["samples"] and r["seq_len"] == base["seq_len"] for r in raw), raw
    full = {"samples": base["samples"], "seq_len": base["seq_len"], "total": base["total"],
            "terms": dict(base["terms"]), "recompute": dict(base["recompute"])}
    for (_, _, _, added), r in zip(parts[1:], raw[1:]):
        ((section, key), one), = added.items()
        extra = arch[section][key] - BASE
        full["total"] += extra * (r["total"] - base["total"]) // one
        for phase in ("terms", "recompute"):
            for term in set(r[phase]) | set(base[phase]):
                full[phase][term] = full[phase].get(term, 0) + \
                    extra * (r[phase].get(term, 0) - base[phase].get(term, 0)) // one
    return full, raw


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict:
    """{counted id: the adapter's count}, one PyTorch adapter process for every case's counts
    (:func:`depth_counts`)."""
    python = require_interpreter("torch")
    directory = tmp_path_factory.mktemp("flops")
    args, ids = [], []
    for cid, path, overrides, _ in (part for case in CASES for part in depth_counts(case)):
        spec = directory / f"{cid.replace('/', '_')}.json"
        spec.write_text(json.dumps(spec_of((cid, path, overrides))))
        args += ["--spec", str(spec)]
        ids.append(cid)
    result = directory / "flops.json"
    proc = subprocess.run([str(python), "-m", "xfw_torch", "--count-flops", str(result), *args],
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert result.exists(), f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return dict(zip(ids, json.loads(result.read_text())["counts"]))


def differences(counted: dict, analytic: families.flops.FlopCount) -> list[tuple[str, float, float]]:
    """(term, counted, analytic) per sample for every model and recompute term where they differ."""
    samples = counted["samples"]
    out = []
    for phase, mine, theirs in (("model", counted["terms"], analytic.terms),
                                ("recompute", counted["recompute"], analytic.recompute)):
        for term in sorted(set(mine) | set(theirs)):
            got, want = mine.get(term, 0) / samples, theirs.get(term, 0.0)
            if abs(got - want) > 1e-9 * max(abs(want), 1.0):
                out.append((f"{phase} {term}", got, want))
    return out


def _line(term: str, got: float, want: float) -> str:
    rel = f"{(got - want) / want:+.2%}" if want else "analytic 0"
    return f"{term}: counted {got:.4e}, ledger {want:.4e} ({rel})"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_ledger_is_the_flop_counters_count_within_3_percent(counted, case):
    entry, raw = full_depth(case, counted)
    for r in raw:
        assert "status" not in r, f"{r['status']}: {r['message']}"
        assert r["total"] == sum(r["terms"].values()) + sum(r["recompute"].values())
    spec = spec_of(case)
    # The ledger at the positions the counted micro-batch ran (variable-length text is padded to
    # its longest sample), for the parts the recipe trains.
    arch = spec["model"]["arch"]
    if entry["seq_len"] is not None:
        arch = families.with_seq_len(arch, entry["seq_len"])
    analytic = families.count_flops(arch, spec["stage"], spec["lora"], recompute=spec["recompute"],
                                    trainable=spec["model"].get("trainable"))
    # Every FLOP the counter saw is in a term: FlopCounterMode's total is the terms' sum.
    assert entry["total"] == sum(entry["terms"].values()) + sum(entry["recompute"].values())
    total = entry["total"] / entry["samples"]
    differ = differences(entry, analytic)
    message = f"{case[0]}: total counted {total:.4e}, ledger {analytic.hardware:.4e}; terms that differ:\n" + \
        "\n".join(_line(*d) for d in differ)
    assert total == pytest.approx(analytic.hardware, rel=TOLERANCE), message
    for term, got, want in differ:
        assert got == pytest.approx(want, rel=TOLERANCE), message
    assert "unattributed" not in entry["terms"] and "other" not in entry["terms"], message
