"""Every recipe's model, full size, built on both backends without its weights: both sides hold
the same parameters, and exactly what the family's facts say (``xfw.contract.families``).

One adapter process per backend counts every spec (``--count-params FILE --spec ... --spec ...``,
``xfw.contract.harness``): PyTorch builds on the meta device, Paddle under ``paddle.LazyGuard``,
each with the stage's freezing and LoRA adapters applied exactly as a run applies them. So a 13B
model costs shapes, not memory, and the whole module runs in well under a minute on a CPU.
Compared per part, trainable included: a part one side trains and the other freezes (the
Paddle side once froze LLaVA-1.6's image newline in pretrain) fails here, before any GPU run.
"""

import json
import subprocess

import pytest

from xfw.contract import families
from xfw.recipe import load_recipe
from xfw.recipe.spec import resolve_spec

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract
BACKENDS = ("torch", "paddle")
KEYS = ("total", "trainable", "parts", "trainable_parts")


def _lora(targets: str) -> str:
    return f"lora={{r: 4, alpha: 8, dropout: 0.0, targets: [{targets}]}}"


RECIPES = ROOT / "recipes"
# (id, recipe, --set overrides): every seed row and every tiny recipe as shipped, plus LoRA on every
# target a family lets a recipe name, so each target's analytic count is checked on both sides.
ATTACHED = ("attach_",)  # recipes whose backends run the user's own command: xfw builds no model for them
CASES = [(str(p.relative_to(RECIPES).with_suffix("")), p, [])
         for p in sorted(RECIPES.glob("*.yaml")) + sorted((RECIPES / "tiny").glob("*.yaml"))
         if not p.stem.startswith(ATTACHED)]
CASES += [
    ("tiny/qwen2vl_lora_all_targets", RECIPES / "tiny" / "qwen2vl_sft.yaml",
     ["stage=lora", _lora(", ".join(families.family_module("qwen2vl").LORA_TARGETS))]),
    ("tiny/sd3_lora_all_targets", RECIPES / "tiny" / "sd3_lora.yaml",
     [_lora(", ".join(families.family_module("sd3").LORA_TARGETS))]),
    ("qwen2vl7b_lora", RECIPES / "qwen2vl7b_sft.yaml", ["stage=lora", "model.trainable=null", _lora("q_proj, v_proj")]),
]
IDS = [c[0] for c in CASES]


def spec_of(case, backend: str) -> dict:
    _, path, overrides = case
    return resolve_spec(load_recipe(path, overrides), backend=backend, run_id="count")


def test_every_seed_row_and_family_is_covered():
    assert len([c for c in CASES if c[1].parent == RECIPES and not c[2]]) == 12  # the seed's 12 rows
    covered = {(s["model"]["family"], s["stage"], bool(s["model"]["arch"].get("anyres")))
               for s in (spec_of(c, "torch") for c in CASES)}
    assert {("llava", "pretrain", True), ("llava", "pretrain", False)} <= covered
    assert {(f, stage) for f, stage, _ in covered} == {(f, stage) for f in families.FAMILIES
                                                       for stage in families.family_module(f).STAGE_PARTS}


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict:
    """{backend: {case id: that backend's counts}}, one adapter process per backend."""
    out = {}
    for backend in BACKENDS:
        python = require_interpreter(backend)
        directory = tmp_path_factory.mktemp(f"count-{backend}")
        args = []
        for case in CASES:
            path = directory / f"{case[0].replace('/', '_')}.json"
            path.write_text(json.dumps(spec_of(case, backend)))
            args += ["--spec", str(path)]
        result = directory / "counts.json"
        proc = subprocess.run([str(python), "-m", f"xfw_{backend}", "--count-params", str(result), *args],
                              capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert result.exists(), f"{backend}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        entries = json.loads(result.read_text())["counts"]
        out[backend] = {cid: entry for cid, entry in zip(IDS, entries)}
    return out


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_both_backends_hold_the_familys_parameters(counted, case):
    cid = case[0]
    spec = spec_of(case, "torch")
    expected = families.analytic_counts(spec["model"]["arch"], spec["stage"], spec["lora"], spec["model"]["trainable"])
    got = {backend: counted[backend][cid] for backend in BACKENDS}
    for backend, entry in got.items():
        assert "status" not in entry, f"{backend}: {entry['status']}: {entry['message']}"
    assert {k: got["paddle"][k] for k in KEYS} == {k: got["torch"][k] for k in KEYS}
    for backend, entry in got.items():
        assert {k: entry[k] for k in KEYS} == expected, backend
