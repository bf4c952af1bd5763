"""The Paddle adapter's vision-language rows: LLaVA-1.6 AnyRes, Qwen2-VL and LoRA, for real.

Paddle runs only as a subprocess of ``.venv/paddle/bin/python``, exactly as the launcher runs
it; transformers (the reference the Paddle models claim to be) runs in the test interpreter.
"""

import json

import numpy as np
import pytest

from xfw.contract import families, presets

from conftest import TINY_RECIPE, applied, losses, run_adapter, save_neutral_weights, spread_weights
from test_paddle_adapter import run_in_paddle

pytestmark = pytest.mark.contract
QWEN = {"model": {"preset": "tiny-qwen2-vl"}}
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def counts(**sections) -> dict:
    """(the family's analytic counts for the recipe, its spec)."""
    from xfw.recipe import recipe_from_dict
    from xfw.recipe.spec import resolve_spec

    spec = resolve_spec(recipe_from_dict({**TINY_RECIPE, **sections}), backend="paddle", run_id="t")
    return families.analytic_counts(spec["model"]["arch"], spec["stage"], spec["lora"]), spec


@pytest.fixture(scope="module")
def qwen_sft_run(tmp_path_factory):
    code, records, stderr = run_adapter("paddle", tmp_path_factory.mktemp("qwen"), **QWEN,
                                        measure={"warmup_steps": 2, "steps": 6})
    assert code == 0, stderr[-3000:]
    return records


def test_qwen2vl_sft_counts_match_the_neutral_architecture_and_it_learns(qwen_sft_run):
    expected, _ = counts(**QWEN)
    a = applied(qwen_sft_run)
    assert a["num_params_total"] == expected["total"] == 186624
    assert a["num_params_trainable"] == expected["trainable"] == expected["parts"]["merger"] + expected["parts"]["text"]
    first, last = losses(qwen_sft_run)[:2], losses(qwen_sft_run)[-2:]
    assert sum(last) / 2 < sum(first) / 2 - 0.1  # lr 1e-3, 8 steps on a fixed pool: it must learn


def test_qwen2vl_recompute_per_decoder_block_is_applied_and_changes_memory_not_math(qwen_sft_run, tmp_path):
    code, records, stderr = run_adapter("paddle", tmp_path, **QWEN, recompute=True,
                                        measure={"warmup_steps": 0, "steps": 3})
    assert code == 0, stderr[-3000:]
    assert applied(records)["recompute"] is True
    assert losses(records) == pytest.approx(losses(qwen_sft_run)[:3], rel=1e-5)


@pytest.mark.parametrize("model, targets", [
    ({"preset": "tiny-qwen2-vl"}, ALL_LINEARS),
    ({"preset": "tiny-llava-next"}, ALL_LINEARS),
    ({"preset": "tiny-llava"}, ["q_proj", "v_proj", "down_proj"]),
], ids=["qwen2-vl-all-linears", "llava-next-all-linears", "llava-three-linears"])
def test_lora_adds_the_adapters_peft_adds_and_trains_them_with_the_projector(tmp_path, model, targets):
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "targets": targets}
    expected, spec = counts(model=model, stage="lora", lora=lora)
    code, records, stderr = run_adapter("paddle", tmp_path, model=model, stage="lora", lora=lora,
                                        measure={"warmup_steps": 0, "steps": 2})
    assert code == 0, stderr[-3000:]
    a = applied(records)
    assert a["num_params_total"] == expected["total"]  # adapters included
    assert a["num_params_trainable"] == expected["trainable"]  # adapters + projector (+ image newline) or merger
    assert "text" not in expected["trainable_parts"]


def test_llava_next_sft_counts_match_and_the_image_newline_trains(tmp_path):
    expected, _ = counts(model={"preset": "tiny-llava-next"})
    code, records, stderr = run_adapter("paddle", tmp_path, model={"preset": "tiny-llava-next"},
                                        measure={"warmup_steps": 0, "steps": 2})
    assert code == 0, stderr[-3000:]
    a = applied(records)
    assert a["num_params_total"] == expected["total"] == 190336
    assert a["num_params_trainable"] == expected["trainable"]
    assert expected["trainable_parts"]["newline"] == 64


SAME_WEIGHTS_QWEN = """
    import importlib, json, sys
    import numpy as np
    import paddle
    from xfw_paddle.families import qwen2vl
    from xfw_paddle.model import canonical_names, load_weights
    from xfw_paddle.session import device_batch

    def load(model, family, directory, lora=False):
        # The production path: a neutral weight file under canonical names, converted and checked strictly.
        load_weights(model, canonical_names(importlib.import_module("xfw_paddle.families." + family), model),
                     directory, family=family, lora=lora)

    # Every variant in this one process (one Paddle start, not one each): a fresh model per variant.
    for arch, weights, batch, out, attn in json.loads(sys.argv[1]):
        batch = np.load(batch)
        model = qwen2vl.build(arch, use_sdpa=attn == "sdpa", recompute=False)
        model.eval()
        load(model, "qwen2vl", weights)
        # The production path for a batch too: numpy in, the family's host-side inputs (grids' patches) added.
        b = device_batch(qwen2vl, arch, {k: batch[k] for k in batch.files}, gpu=False)
        with paddle.no_grad():
            logits = model(b["pixel_values"], b["input_ids"], b["position_ids"], b["vision_positions"],
                           b["vision_lengths"])
            loss = qwen2vl.causal_lm_loss(logits, b["labels"])
        np.savez(out, logits=logits.numpy(), loss=loss.numpy())
"""


def transformers_qwen2vl(arch: dict):
    """transformers' Qwen2VLForConditionalGeneration from the neutral fields (the config of
    adapters/torch/xfw_torch/families/qwen2vl.py, written out here to test the Paddle claim alone)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    v, t = arch["vision"], arch["text"]
    config = Qwen2VLConfig(
        vision_config={"depth": v["depth"], "embed_dim": v["embed_dim"], "hidden_size": v["merger_out"],
                       "mlp_ratio": v["mlp_ratio"], "num_heads": v["num_heads"], "patch_size": v["patch_size"],
                       "spatial_merge_size": v["spatial_merge_size"],
                       "temporal_patch_size": v["temporal_patch_size"]},
        text_config={"hidden_size": t["hidden_size"], "intermediate_size": t["intermediate_size"],
                     "num_hidden_layers": t["num_layers"], "num_attention_heads": t["num_heads"],
                     "num_key_value_heads": t["num_kv_heads"], "vocab_size": t["vocab_size"],
                     "rms_norm_eps": t["rms_norm_eps"], "max_position_embeddings": t["max_position_embeddings"],
                     "rope_parameters": {"rope_type": "default", "rope_theta": t["rope_theta"],
                                         "mrope_section": list(t["mrope_section"])},
                     "tie_word_embeddings": t["tie_word_embeddings"]},
        image_token_id=arch["image_token_id"], video_token_id=arch["video_token_id"],
        vision_start_token_id=arch["vision_start_token_id"], vision_end_token_id=arch["vision_end_token_id"],
        tie_word_embeddings=t["tie_word_embeddings"])
    return Qwen2VLForConditionalGeneration(config)


# The tiny preset (GQA 4:2, tied), and a variant with untied embeddings, plain multi-head
# attention, other M-RoPE sections and RoPE base, a deeper tower and a larger image (4x4 merged).
QWEN_VARIANTS = {
    "tiny-qwen2-vl": ({}, None, "sdpa"),
    "untied-mha-other-mrope-eager": ({"text": {"tie_word_embeddings": False, "num_kv_heads": 4,
                                               "mrope_section": [4, 2, 2], "rope_theta": 10000.0},
                                      "vision": {"depth": 3}}, 112, "eager"),
    "larger-image": ({}, 168, "sdpa"),
}


@pytest.fixture(scope="module")
def same_weights_qwen(tmp_path_factory):
    """Every variant's transformers reference, built and run here, and the Paddle model loaded with its
    weights, all variants in one Paddle process: variant -> (Paddle's logits and loss, transformers' output,
    transformers' parameter count, the architecture)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from xfw.contract.synthetic import make_pool

    jobs, expected = [], {}
    for variant, (overrides, image_size, attn) in QWEN_VARIANTS.items():
        data = {"image_size": image_size, "seq_len": 96} if image_size else {}
        _, spec = counts(model={"preset": "tiny-qwen2-vl", "arch": overrides}, **({"data": data} if data else {}))
        arch = spec["model"]["arch"]
        torch.manual_seed(0)
        model = transformers_qwen2vl(arch).eval()
        spread_weights(model)
        batch = make_pool(spec, 0)[0]
        with torch.no_grad():
            output = model(**{k: torch.from_numpy(v) for k, v in batch.items()})
        expected[variant] = (output, sum(p.numel() for p in model.parameters()), arch)
        directory = tmp_path_factory.mktemp(variant)
        save_neutral_weights(model, directory)
        np.savez(directory / "batch.npz", **batch)
        jobs.append([arch, str(directory), str(directory / "batch.npz"), str(directory / "paddle.npz"), attn])
    run_in_paddle(SAME_WEIGHTS_QWEN, json.dumps(jobs), timeout_s=300)
    return {variant: (np.load(job[3]), *expected[variant]) for variant, job in zip(QWEN_VARIANTS, jobs)}


@pytest.mark.parametrize("variant", QWEN_VARIANTS)
def test_paddle_qwen2vl_computes_transformers_logits_and_loss_from_the_same_weights(same_weights_qwen, variant):
    got, expected, numel, arch = same_weights_qwen[variant]
    assert numel == presets.count_params(arch)["total"]
    np.testing.assert_allclose(got["logits"], expected.logits.numpy(), atol=1e-5, rtol=0)
    assert float(got["loss"]) == pytest.approx(float(expected.loss), abs=1e-5)


SAME_WEIGHTS_LORA = """
    import importlib, json, sys
    import numpy as np
    import paddle
    from xfw_paddle.model import apply_lora, lora_target
    from xfw_paddle.session import device_batch

    from xfw_paddle.model import canonical_names, load_weights

    def load(model, family, directory, lora=False):
        # The production path: a neutral weight file under canonical names, converted and checked strictly.
        load_weights(model, canonical_names(importlib.import_module("xfw_paddle.families." + family), model),
                     directory, family=family, lora=lora)

    # Every case in this one process (one Paddle start, not one each): a fresh model per case.
    for name, arch, lora, weights, batch, out in json.loads(sys.argv[1]):
        family, batch = importlib.import_module("xfw_paddle.families." + name), np.load(batch)
        model = family.build(arch, use_sdpa=True, recompute=False)
        load(model, name, weights)
        apply_lora(lora_target(arch, model), lora)
        load(model, name, weights, lora=True)
        model.eval()
        b = device_batch(family, arch, {k: batch[k] for k in batch.files}, gpu=False)
        with paddle.no_grad():
            logits = (model(b["pixel_values"], b["input_ids"], b["position_ids"], b["vision_positions"],
                            b["vision_lengths"])
                      if name == "qwen2vl" else
                      model(b["pixel_values"], b["input_ids"], b["attention_mask"], anyres_tiles=b.get("anyres_tiles"),
                            anyres_features=b.get("anyres_features")))
        np.savez(out, logits=logits.numpy())
"""


LORA_CASES = {"qwen2-vl-all-linears": ("tiny-qwen2-vl", ALL_LINEARS),
              "llava-next-three-linears": ("tiny-llava-next", ["q_proj", "o_proj", "up_proj"])}


@pytest.fixture(scope="module")
def same_weights_lora(tmp_path_factory):
    """Adapters on the same linears with the same scaling (alpha / r), B non-zero: each case's transformers +
    peft logits, and the Paddle model + paddlenlp.peft's, all cases in one Paddle process: case -> (Paddle's
    logits, transformers + peft's)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from peft import LoraConfig, inject_adapter_in_model

    from test_paddle_adapter import transformers_llava
    from xfw.contract.synthetic import make_pool

    jobs, expected = [], {}
    for case, (preset, targets) in LORA_CASES.items():
        lora = {"r": 4, "alpha": 12, "dropout": 0.0, "targets": targets}  # scaling 3, not 1 or 2
        _, spec = counts(model={"preset": preset}, stage="lora", lora=lora)
        arch, family = spec["model"]["arch"], spec["model"]["family"]
        torch.manual_seed(0)
        model = (transformers_qwen2vl if family == "qwen2vl" else transformers_llava)(arch).eval()
        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=12, lora_dropout=0.0, target_modules=targets),
                                model.model.language_model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.5)
        batch = make_pool(spec, 0)[0]
        with torch.no_grad():
            expected[case] = model(**{k: torch.from_numpy(v) for k, v in batch.items()}).logits.numpy()
        directory = tmp_path_factory.mktemp(case)
        save_neutral_weights(model, directory)  # peft's base_layer and adapter names, canonical
        np.savez(directory / "batch.npz", **batch)
        jobs.append([family, arch, spec["lora"], str(directory), str(directory / "batch.npz"),
                     str(directory / "paddle.npz")])
    run_in_paddle(SAME_WEIGHTS_LORA, json.dumps(jobs), timeout_s=300)
    return {case: (np.load(job[-1])["logits"], expected[case]) for case, job in zip(LORA_CASES, jobs)}


@pytest.mark.parametrize("case", LORA_CASES)
def test_paddlenlp_lora_computes_what_peft_computes_from_the_same_weights(same_weights_lora, case):
    """Adapters on the same linears with the same scaling (alpha / r): with B non-zero, the
    logits of transformers + peft and of the Paddle model + paddlenlp.peft agree."""
    got, expected = same_weights_lora[case]
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
