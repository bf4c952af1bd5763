"""The PyTorch adapter's Stable Diffusion families, for real: tiny SD1.5 and SD3 trained on CPU.

Everything runs in this process, which is the torch environment when the tests run under
``.venv/torch/bin/python``: each tiny recipe trains once through the adapter's entry point
(``harness.main`` with its session, what ``python -m xfw_torch`` runs: conftest.run_adapter's
``in_process``), without an interpreter start and its ~6 CPU s of imports; the cheaper checks (bf16
autocast, frozen weights, recompute) build sessions. The launcher's own path (an adapter process,
``python -m xfw_torch``) runs both families as shipped in test_parity.py (sd15_pretrain),
test_compare_both_backends.py (sd15_captions) and test_explain_both_backends.py::TestOtherFamilies
(sd3_lora); test_every_tiny_recipe.py trains sd15_lora and sd3_dreambooth as shipped on both backends.
"""

import math
from pathlib import Path

import pytest
import yaml

from xfw.contract import presets
from xfw.recipe import recipe_from_dict
from xfw.recipe.spec import resolve_spec
from xfw.contract.records import validate_record

from conftest import ROOT, run_adapter

pytestmark = pytest.mark.contract
RECIPES = ["sd15_pretrain", "sd15_lora", "sd3_dreambooth", "sd3_lora"]


def recipe(name: str, **changes) -> dict:
    data = yaml.safe_load(Path(ROOT / "recipes" / "tiny" / f"{name}.yaml").read_text())
    return {**data, **changes}


def spec_of(name: str, **changes) -> dict:
    return resolve_spec(recipe_from_dict(recipe(name, **changes)), backend="torch", run_id="t")


def expected_trainable(spec: dict) -> int:
    """Counted independently of peft: the trained parts' size (the family's facts), or r x (in + out)
    per Linear a target names in the LoRA module."""
    torch = pytest.importorskip("torch")
    from xfw.contract import families
    from xfw_torch.families import family_module
    from xfw_torch.session import lora_target

    arch = spec["model"]["arch"]
    with torch.device("meta"):
        model = family_module(spec["model"]["family"]).build(arch)
    if spec["stage"] != "lora":
        parts = families.trainable_parts(arch, spec["stage"])
        return sum(p.numel() for name, p in model.named_parameters() if families.trains(arch, parts, name))
    lora = spec["lora"]
    return sum(lora["r"] * (m.in_features + m.out_features) for name, m in lora_target(arch, model).named_modules()
               if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in lora["targets"]))


def in_process_session(spec: dict):
    pytest.importorskip("torch")
    from xfw.contract.synthetic import make_pool
    from xfw_torch.session import build_session

    session = build_session(spec)
    return session, [session.to_device(b) for b in make_pool(spec, 0)]


def steps(session, pool, num_steps: int) -> list[float]:
    accum = session.spec["derived"]["grad_accum_steps"]
    return [float(session.train_step([pool[(s * accum + i) % len(pool)] for i in range(accum)]))
            for s in range(num_steps)]


@pytest.mark.parametrize("name", RECIPES)
def test_tiny_diffusion_recipe_trains_in_fp32_and_learns(tmp_path, name):
    code, records, stderr = run_adapter("torch", tmp_path, in_process=True, **recipe(name))
    assert code == 0, stderr
    for r in records:
        assert validate_record(r) == [], r
    assert [r["kind"] for r in records] == ["start"] + ["step"] * 12 + ["window", "applied", "end"]
    losses = [r["loss"] for r in records if r["kind"] == "step"]
    assert all(math.isfinite(x) for x in losses)
    # Steps alternate between two fixed pairs of pool batches (pool 4, accumulation 2), so
    # compare like with like: the last pair of steps against the first.
    assert sum(losses[-2:]) < 0.97 * sum(losses[:2]), losses
    applied = next(r for r in records if r["kind"] == "applied")
    assert (applied["weight_dtype"], applied["compute_dtype"], applied["amp_level"]) == ("float32", "float32", "O0")
    assert applied["num_params_trainable"] == expected_trainable(spec_of(name))
    lora = expected_trainable(spec_of(name)) if name.endswith("lora") else 0  # adapters add parameters
    assert applied["num_params_total"] == presets.count_params(spec_of(name)["model"]["arch"])["total"] + lora


@pytest.mark.parametrize("preset, override", [
    ("tiny-sd15", {}),
    ("tiny-sd3", {}),
    ("tiny-sd15", {"unet": {"block_out_channels": [32, 64, 96], "layers_per_block": 2, "cross_attention_dim": 48,
                            "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D", "CrossAttnDownBlock2D"],
                            "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D", "CrossAttnUpBlock2D"]},
                   "text": {"hidden_size": 48, "num_heads": 3},
                   "vae": {"block_out_channels": [32, 64, 96], "layers_per_block": 2, "use_quant_conv": False}}),
    ("tiny-sd3", {"transformer": {"num_layers": 3, "patch_size": 4, "joint_attention_dim": 24, "pooled_projection_dim": 40},
                  "text": {"dim": 24, "pooled_dim": 40}, "vae": {"layers_per_block": 2, "use_quant_conv": True}}),
])
def test_analytic_parameter_counts_match_the_built_model(preset, override):
    torch = pytest.importorskip("torch")
    from xfw_torch.families import family_module

    arch = presets.resolve_arch(preset, override, 64, None)
    with torch.device("meta"):
        model = family_module(arch["family"]).build(arch)
    built = {name: sum(p.numel() for p in part.parameters()) for name, part in model.named_children()}
    assert {**built, "total": sum(built.values())} == presets.count_params(arch)


@pytest.mark.parametrize("name", RECIPES)
def test_tiny_diffusion_recipe_trains_under_bf16_autocast(tmp_path, name):
    pytest.importorskip("torch")
    from xfw.contract import harness, records
    from xfw_torch.session import TorchSession

    spec = spec_of(name, precision={"dtype": "bf16", "amp_level": "O1"},
                   measure={"warmup_steps": 1, "steps": 2, "timeout_s": 60})
    writer = records.RecordWriter(tmp_path / "steps.jsonl", 0)
    harness.run_training(spec, writer, TorchSession(spec))
    writer.close()
    written = records.load_records(tmp_path / "steps.jsonl")
    for r in written:
        assert validate_record(r) == [], r
    assert all(math.isfinite(r["loss"]) for r in written if r["kind"] == "step")
    applied = next(r for r in written if r["kind"] == "applied")
    assert (applied["weight_dtype"], applied["compute_dtype"], applied["amp_level"]) == ("float32", "bfloat16", "O1")


@pytest.mark.parametrize("name", ["sd15_pretrain", "sd3_lora"])
def test_bf16_o2_trains_with_low_precision_weights(name):
    session, pool = in_process_session(spec_of(name, precision={"dtype": "bf16", "amp_level": "O2"}))
    assert all(math.isfinite(x) for x in steps(session, pool, 2))
    assert session.applied()["weight_dtype"] == "bfloat16" and session.applied()["master_weights"]


@pytest.mark.parametrize("name, frozen, trained", [
    ("sd15_lora", ["unet", "vae", "text_encoder"], "unet"),
    ("sd15_pretrain", ["vae", "text_encoder"], "unet"),
    ("sd3_lora", ["transformer", "vae"], "transformer"),
    ("sd3_dreambooth", ["vae"], "transformer"),
])
def test_frozen_weights_get_no_gradient_and_do_not_change(name, frozen, trained):
    torch = pytest.importorskip("torch")

    session, pool = in_process_session(spec_of(name))
    model = session.model

    def base(part):  # the part's own weights, LoRA adapters excluded
        return {n: p for n, p in getattr(model, part).named_parameters() if "lora_" not in n}

    before = {part: {n: p.detach().clone() for n, p in base(part).items()} for part in frozen}
    trained_before = {n: p.detach().clone() for n, p in getattr(model, trained).named_parameters() if p.requires_grad}
    steps(session, pool, 1)
    for part in frozen:
        for n, p in base(part).items():
            assert not p.requires_grad and p.grad is None, f"{part}.{n}"
            assert torch.equal(before[part][n], p), f"{part}.{n} changed"
    now = dict(getattr(model, trained).named_parameters())
    unchanged = {n for n, v in trained_before.items() if torch.equal(v, now[n])}
    # LoRA's A gets no gradient while B is still zero. SD3's last block drops the text stream's
    # attention output, so its text query projection never gets a gradient (in diffusers' model too).
    last = session.spec["model"]["arch"].get("transformer", {}).get("num_layers", 0) - 1
    allowed = {n for n in trained_before if "lora_A" in n or n.startswith(f"transformer_blocks.{last}.attn.add_q_proj.")}
    assert trained_before and unchanged <= allowed, sorted(unchanged - allowed)
    if session.spec["stage"] == "lora":
        assert all("lora_" in n for n in trained_before)


def first_block(model):
    return model.unet.down_blocks[0].resnets[0] if hasattr(model, "unet") else model.transformer.transformer_blocks[0]


def run_counting_first_block(spec: dict):
    """2 steps of an in-process session: (losses, the first block's forward calls, applied recompute)."""
    session, pool = in_process_session(spec)
    calls = []
    first_block(session.model).register_forward_pre_hook(lambda *args: calls.append(1))
    return steps(session, pool, 2), len(calls), session.applied()["recompute"]


@pytest.fixture(scope="module")
def plain():
    """{name: run_counting_first_block of the recipe as shipped} (fp32, recompute off, default
    attention), for sd15_pretrain and sd3_dreambooth: the one reference the recompute,
    eager-attention and same-seed tests share, run once."""
    return {name: run_counting_first_block(spec_of(name)) for name in ("sd15_pretrain", "sd3_dreambooth")}


@pytest.mark.parametrize("name", ["sd15_pretrain", "sd3_dreambooth"])
def test_recompute_reruns_blocks_in_backward_and_changes_no_math(plain, name):
    assert spec_of(name) == spec_of(name, recompute=False)  # the shared reference is the plain run
    plain, plain_calls, plain_applied = plain[name]
    recomputed, recomputed_calls, applied = run_counting_first_block(spec_of(name, recompute=True))
    assert plain_applied is False
    assert applied is True
    # Each checkpointed block starts its forward again during backward (a pre-hook: with
    # non-reentrant checkpointing the recomputation stops early, before any forward hook).
    assert recomputed_calls == 2 * plain_calls
    assert recomputed == pytest.approx(plain, rel=1e-5)


def test_sd15_eager_attention_computes_what_sdpa_computes(plain):
    sdpa = plain["sd15_pretrain"][0]
    eager = steps(*in_process_session(spec_of("sd15_pretrain", backends={"torch": {"attn_implementation": "eager"}})), 2)
    assert eager == pytest.approx(sdpa, rel=1e-4)


def test_sd3_rejects_attention_it_cannot_run():
    pytest.importorskip("torch")
    from xfw.contract.harness import InvalidSpec

    with pytest.raises(InvalidSpec, match="attn_implementation"):
        in_process_session(spec_of("sd3_dreambooth", backends={"torch": {"attn_implementation": "eager"}}))


def test_same_seed_gives_the_same_losses(plain):
    first = plain["sd3_dreambooth"][0]
    assert steps(*in_process_session(spec_of("sd3_dreambooth")), 2) == first
