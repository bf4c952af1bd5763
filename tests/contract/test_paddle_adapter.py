"""The Paddle adapter, for real: tiny LLaVA trained on CPU through its own interpreter.

The test interpreter is the PyTorch environment; Paddle runs only as a subprocess of
``.venv/paddle/bin/python`` (skipped when that is missing), exactly as the launcher runs it.
"""

import json
import math
import subprocess
import textwrap

import numpy as np
import pytest

from xfw.contract import presets
from xfw.contract.records import validate_record

from conftest import (TINY_RECIPE, applied, kinds, losses, require_interpreter, run_adapter, save_neutral_weights,
                      spread_weights)

pytestmark = pytest.mark.contract
ARCH = presets.resolve_arch("tiny-llava", {}, None, None)
COUNTS = presets.count_params(ARCH)


def run_in_paddle(code: str, *args, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Run a snippet in the Paddle interpreter (for what the record format does not show)."""
    python = require_interpreter("paddle")
    proc = subprocess.run([str(python), "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """One tiny SFT run shared by the tests that only read its records: 2 warm-up + 8 measured steps."""
    code, records, stderr = run_adapter("paddle", tmp_path_factory.mktemp("sft"),
                                        measure={"warmup_steps": 2, "steps": 8})
    assert code == 0, stderr[-3000:]
    return records


def test_tiny_sft_writes_valid_records_in_protocol_order_and_learns(sft_run):
    for r in sft_run:
        assert validate_record(r) == [], r
    assert kinds(sft_run) == ["start"] + ["step"] * 10 + ["window", "applied", "end"]
    steps = [r for r in sft_run if r["kind"] == "step"]
    assert [r["phase"] for r in steps] == ["warmup"] * 2 + ["measure"] * 8
    assert [r["step"] for r in steps] == list(range(10))
    assert all(r["samples"] == 4 and r["tokens"] == 4 * 64 for r in steps)
    assert all(r["step_time_s"] > 0 and r["mem_alloc_peak_bytes"] > 0 for r in steps)
    assert all(math.isfinite(x) for x in losses(sft_run))
    # Steps alternate between two pairs of pool batches, so compare the same pairs.
    first, last = losses(sft_run)[:2], losses(sft_run)[-2:]
    assert sum(last) / 2 < sum(first) / 2 - 0.3  # lr 1e-3 on a fixed pool: it must learn


def test_sft_parameter_counts_match_the_neutral_architecture(sft_run):
    a = applied(sft_run)
    assert a["num_params_total"] == COUNTS["total"] == 190656
    assert a["num_params_trainable"] == COUNTS["projector"] + COUNTS["text"]  # vision frozen


def test_fp32_run_reports_what_it_applied(sft_run):
    a = applied(sft_run)
    assert (a["framework"], a["device"], a["mem_source"]) == ("paddle", "cpu", "host_allocator")
    assert (a["weight_dtype"], a["compute_dtype"], a["amp_level"], a["master_weights"]) == (
        "float32", "float32", "O0", False)
    assert (a["attention_impl"], a["tf32"], a["recompute"], a["grad_accum_steps"]) == ("sdpa", False, False, 2)
    assert a["version_paddlepaddle"] == a["framework_version"] and "version_paddlenlp" in a


@pytest.fixture(scope="module")
def bf16_pretrain(tmp_path_factory):
    """One pretrain run that asks for bf16 O2, 1 + 2 steps, read by two tests: what trains in pretrain (the
    precision asked for does not choose which parameters train) and that bf16 O2 on a CPU runs fp32 and says
    so: one adapter start instead of two."""
    code, records, stderr = run_adapter("paddle", tmp_path_factory.mktemp("bf16_pretrain"), stage="pretrain",
                                        precision={"dtype": "bf16", "amp_level": "O2"},
                                        measure={"warmup_steps": 1, "steps": 2})
    assert code == 0, stderr[-3000:]
    return records


def test_pretrain_trains_only_the_projector(bf16_pretrain):
    a = applied(bf16_pretrain)
    assert a["num_params_total"] == COUNTS["total"]
    assert a["num_params_trainable"] == COUNTS["projector"]


def test_bf16_o2_on_cpu_reports_fp32_o0_with_a_note_never_bf16(bf16_pretrain):
    a = applied(bf16_pretrain)
    assert (a["weight_dtype"], a["compute_dtype"], a["amp_level"], a["master_weights"]) == (
        "float32", "float32", "O0", False)
    assert "requested bf16 O2" in a["notes"] and "ran fp32" in a["notes"]
    assert "bfloat16" not in json.dumps(a)


def test_recompute_is_applied_and_changes_memory_not_math(sft_run, tmp_path):
    code, records, stderr = run_adapter("paddle", tmp_path, recompute=True, measure={"warmup_steps": 0, "steps": 3})
    assert code == 0, stderr[-3000:]
    assert applied(records)["recompute"] is True
    assert losses(records) == pytest.approx(losses(sft_run)[:3], rel=1e-5)  # same seed, same batches


def test_an_unknown_lora_target_exits_invalid_naming_the_key(tmp_path):
    code, records, _ = run_adapter("paddle", tmp_path, stage="lora", lora={"r": 4, "alpha": 8, "targets": ["q_proj"]},
                                   edit_spec=lambda spec: spec["lora"].update(targets=["q_proj", "qkv_proj"]))
    assert code == 2
    assert records[-1]["status"] == "invalid" and records[-1]["message"].startswith("lora.targets: ")
    assert validate_record(records[-1]) == []


def test_an_unknown_backend_knob_exits_invalid_naming_the_key(tmp_path):
    code, records, _ = run_adapter("paddle", tmp_path, backends={"paddle": {"bogus": 1}})
    assert code == 2
    assert records[-1]["status"] == "invalid" and "backends.paddle.bogus" in records[-1]["message"]


def test_describe_prints_json_with_versions_and_the_multi_process_launcher():
    python = require_interpreter("paddle")
    out = subprocess.run([str(python), "-m", "xfw_paddle", "--describe"], capture_output=True, text=True,
                         check=True, timeout=120)
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert (info["backend"], info["framework"], info["device"]) == ("paddle", "paddle", "cpu")
    assert set(info["versions"]) >= {"paddlepaddle", "paddlenlp", "numpy"}
    assert "{nproc}" in info["launcher"] and info["launcher"][-1].endswith("xfw_paddle/__main__.py")


FROZEN_CHECK = """
    import json, sys
    import numpy as np
    from xfw.recipe import recipe_from_dict
    from xfw.recipe.spec import resolve_spec
    from xfw.contract.synthetic import make_pool
    from xfw_paddle.session import build_session

    spec = resolve_spec(recipe_from_dict(json.loads(sys.argv[1])), backend="paddle", run_id="t")
    session = build_session(spec)
    vision = session.model.vision_tower.parameters()
    before = [p.numpy().copy() for p in vision]
    projector_before = session.model.multi_modal_projector.linear_1.weight.numpy().copy()
    session.train_step([session.to_device(b) for b in make_pool(spec, 0)[:2]])
    print(json.dumps({
        "vision_frozen": all(p.stop_gradient and p.grad is None for p in vision),
        "vision_unchanged": all(np.array_equal(a, p.numpy()) for a, p in zip(before, vision)),
        "projector_changed": not np.array_equal(projector_before,
                                                session.model.multi_modal_projector.linear_1.weight.numpy()),
    }))
"""


LEAN_LLAMA = """
    import sys
    from xfw_paddle import nlp
    llama = nlp.load("paddlenlp.transformers.llama.modeling")
    lean = sorted(m for m in ("paddlenlp.taskflow", "paddlenlp.datasets", "sklearn") if m in sys.modules)
    peft = nlp.load("paddlenlp.peft")
    import paddlenlp.transformers.llama.modeling as again
    print(lean, getattr(sys.modules["paddlenlp"], "xfw_shell", False), again is llama,
          peft.LoRAModel.__module__, sys.modules["paddlenlp"].__version__)
"""


@pytest.fixture(scope="module")
def lean_then_frozen():
    """One Paddle process for two checks (one start, not two): first, in the fresh process, PaddleNLP's
    modules as xfw_paddle.nlp loads them (LEAN_LLAMA, its line); then FROZEN_CHECK's session (its line)."""
    lines = run_in_paddle(textwrap.dedent(LEAN_LLAMA) + textwrap.dedent(FROZEN_CHECK),
                          json.dumps(TINY_RECIPE)).stdout.strip().splitlines()
    return lines[-2], lines[-1]


def test_frozen_vision_tower_gets_no_gradient_and_does_not_change(lean_then_frozen):
    assert json.loads(lean_then_frozen[1]) == {
        "vision_frozen": True, "vision_unchanged": True, "projector_changed": True}


SAME_WEIGHTS_LOGITS = """
    import importlib, json, sys
    import numpy as np
    import paddle
    from xfw_paddle.families import llava
    from xfw_paddle.model import canonical_names, load_weights
    from xfw_paddle.session import device_batch

    def load(model, family, directory, lora=False):
        # The production path: a neutral weight file under canonical names, converted and checked strictly.
        load_weights(model, canonical_names(importlib.import_module("xfw_paddle.families." + family), model),
                     directory, family=family, lora=lora)

    # Every variant in this one process (one Paddle start, not one each): a fresh model per variant.
    for arch, weights, batch, out in json.loads(sys.argv[1]):
        batch = np.load(batch)
        model = llava.build(arch, use_sdpa=True, recompute=False)
        model.eval()
        load(model, "llava", weights)
        # The production path for a batch too: numpy in, the family's host-side inputs (AnyRes indices) added.
        b = device_batch(llava, arch, {k: batch[k] for k in batch.files}, gpu=False)
        with paddle.no_grad():
            logits = model(b["pixel_values"], b["input_ids"], b["attention_mask"],
                           anyres_tiles=b.get("anyres_tiles"), anyres_features=b.get("anyres_features"))
            loss = llava.causal_lm_loss(logits, b["labels"])
        np.savez(out, logits=logits.numpy(), loss=loss.numpy())
"""


def transformers_llava(arch: dict):
    """transformers' LlavaForConditionalGeneration (LlavaNext for AnyRes) from the neutral fields:
    the reference the Paddle model claims to be (built here, not through the PyTorch adapter,
    to test that claim alone)."""
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaNextConfig, LlavaNextForConditionalGeneration)

    v, t = arch["vision"], arch["text"]
    vision = CLIPVisionConfig(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                              num_hidden_layers=v["num_layers"], num_attention_heads=v["num_heads"],
                              image_size=v["image_size"], patch_size=v["patch_size"], hidden_act=v["hidden_act"],
                              layer_norm_eps=v["layer_norm_eps"])
    text = LlamaConfig(hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
                       num_hidden_layers=t["num_layers"], num_attention_heads=t["num_heads"],
                       num_key_value_heads=t["num_kv_heads"], vocab_size=t["vocab_size"],
                       rms_norm_eps=t["rms_norm_eps"], rope_theta=t["rope_theta"],
                       max_position_embeddings=t["max_position_embeddings"],
                       tie_word_embeddings=t["tie_word_embeddings"])
    common = dict(vision_config=vision, text_config=text, image_token_index=arch["image_token_id"],
                  projector_hidden_act=arch["projector"]["hidden_act"], vision_feature_layer=v["feature_layer"],
                  vision_feature_select_strategy="default" if v["drop_cls"] else "full",
                  tie_word_embeddings=t["tie_word_embeddings"])
    if arch.get("anyres"):
        return LlavaNextForConditionalGeneration(
            LlavaNextConfig(image_grid_pinpoints=arch["anyres"]["grid_pinpoints"], **common))
    return LlavaForConditionalGeneration(LlavaConfig(**common))


# The tiny presets (LLaVA-1.5, and LLaVA-1.6 AnyRes on a 1x2 and a 2x2 grid), and a variant exercising
# grouped-query attention, another RoPE base, another feature layer and the CLS token kept.
ARCH_VARIANTS = {
    "tiny-llava": ("tiny-llava", {}),
    "gqa-rope-last-layer-cls": ("tiny-llava", {"text": {"num_kv_heads": 2, "rope_theta": 500.0},
                                               "vision": {"num_layers": 3, "feature_layer": -1, "drop_cls": False,
                                                          "layer_norm_eps": 1e-6}}),
    "tiny-llava-next": ("tiny-llava-next", {}),
    "tiny-llava-next-2x2": ("tiny-llava-next", {"data": {"anyres_image_hw": [56, 56]}}),
}


@pytest.fixture(scope="module")
def same_weights_llava(tmp_path_factory):
    """Every variant's transformers reference, built and run here, and the Paddle model loaded with its
    weights, all variants in one Paddle process: variant -> (Paddle's logits and loss, transformers' output)."""
    torch = pytest.importorskip("torch")  # in-process: the test interpreter is the torch environment
    pytest.importorskip("transformers")
    from xfw.recipe import recipe_from_dict
    from xfw.recipe.spec import resolve_spec
    from xfw.contract.synthetic import make_pool

    jobs, expected = [], {}
    for variant, (preset, overrides) in ARCH_VARIANTS.items():
        recipe = {**TINY_RECIPE, "model": {"preset": preset, "arch": overrides}}
        if not overrides.get("vision", {}).get("drop_cls", True):
            recipe["data"] = {"seq_len": 66}  # room for the CLS token's extra image token
        spec = resolve_spec(recipe_from_dict(recipe), backend="paddle", run_id="t")
        arch = spec["model"]["arch"]
        torch.manual_seed(0)
        model = transformers_llava(arch).eval()
        spread_weights(model)
        batch = make_pool(spec, 0)[0]
        with torch.no_grad():
            expected[variant] = model(**{k: torch.from_numpy(v) for k, v in batch.items()})
        directory = tmp_path_factory.mktemp(variant)
        save_neutral_weights(model, directory)
        np.savez(directory / "batch.npz", **batch)
        jobs.append([arch, str(directory), str(directory / "batch.npz"), str(directory / "paddle.npz")])
    run_in_paddle(SAME_WEIGHTS_LOGITS, json.dumps(jobs), timeout_s=300)
    return {variant: (np.load(job[3]), expected[variant]) for variant, job in zip(ARCH_VARIANTS, jobs)}


@pytest.mark.parametrize("variant", ARCH_VARIANTS)
def test_paddle_llava_computes_transformers_logits_and_loss_from_the_same_weights(same_weights_llava, variant):
    """Same architecture, checked numerically: transformers' model and the Paddle model loaded
    with its weights (names mapped, Linear weights transposed) agree on one synthetic batch."""
    got, expected = same_weights_llava[variant]
    # fp32 rounding over logits of magnitude ~4 (the scaled weights): ~1e-5 is seen, 3e-5 allowed.
    np.testing.assert_allclose(got["logits"], expected.logits.numpy(), atol=3e-5, rtol=0)
    assert float(got["loss"]) == pytest.approx(float(expected.loss), abs=3e-5)


def test_paddlenlp_modules_load_without_the_rest_of_paddlenlp_and_lora_takes_the_same_classes(lean_then_frozen):
    # xfw_paddle.nlp: a Llama needs paddlenlp.transformers, not Taskflow, datasets or scikit-learn (4 s a start);
    # LoRA afterwards (peft) must find the very modules the model was built from, not a second import of them.
    # LEAN_LLAMA runs first in its process (the frozen check after it shares the start, not the modules).
    out = lean_then_frozen[0]
    assert out.startswith("[] True True paddlenlp.peft.lora.lora_model 3."), out


def test_the_sd_families_import_ppdiffusers_without_the_rest_of_paddlenlp():
    # xfw_paddle.nlp.load_ppdiffusers: ppdiffusers' patches import PaddleNLP's CLAP model module, which would run the
    # package's eager __init__ (3.7 s a start); an SD1.5 model built through the family has ppdiffusers and none
    # of Taskflow, datasets or scikit-learn (losses bit-identical: the issue-44 commit); LoRA afterwards (peft pulls
    # PaddleNLP's trainer, and with it those) takes the same PaddleNLP package.
    out = run_in_paddle("""
        import sys
        from xfw.contract import presets
        from xfw_paddle.families import _sd_common, sd15
        model = sd15.build(presets.resolve_arch("tiny-sd15", {}, None, None))
        lean = sorted(m for m in ("paddlenlp.taskflow", "paddlenlp.datasets", "sklearn") if m in sys.modules)
        _sd_common.apply_lora(model.unet, {"targets": ["to_q", "to_v"], "r": 4, "alpha": 4, "dropout": 0.0})
        lora = sum("lora_A" in name for name, _ in model.unet.named_parameters())
        print(lean, getattr(sys.modules["paddlenlp"], "xfw_shell", False), "ppdiffusers" in sys.modules, lora > 0)
    """).stdout.strip().splitlines()[-1]
    assert out == "[] True True True", out
