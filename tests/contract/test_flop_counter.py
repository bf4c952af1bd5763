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
memory: the module runs in about a minute on 2 cores.
"""

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


def spec_of(case) -> dict:
    _, path, overrides = case
    return resolve_spec(load_recipe(path, overrides), backend="torch", run_id="flops")


def test_every_seed_row_every_family_and_recompute_are_covered():
    seeds = [c for c in CASES if c[1].parent == RECIPES]
    assert len(seeds) == 12
    specs = [spec_of(c) for c in CASES]
    assert {(s["model"]["family"], s["stage"]) for s in specs} == \
        {(f, stage) for f in families.FAMILIES for stage in families.family_module(f).STAGE_PARTS}
    assert {s["model"]["family"] for s in specs if s["recompute"]} == set(families.FAMILIES)


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict:
    """{case id: the adapter's count}, one PyTorch adapter process for every case."""
    python = require_interpreter("torch")
    directory = tmp_path_factory.mktemp("flops")
    args = []
    for case in CASES:
        path = directory / f"{case[0].replace('/', '_')}.json"
        path.write_text(json.dumps(spec_of(case)))
        args += ["--spec", str(path)]
    result = directory / "flops.json"
    proc = subprocess.run([str(python), "-m", "xfw_torch", "--count-flops", str(result), *args],
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert result.exists(), f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return dict(zip(IDS, json.loads(result.read_text())["counts"]))


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
    entry = counted[case[0]]
    assert "status" not in entry, f"{entry['status']}: {entry['message']}"
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
