"""FLOPs ledgers (xfw.contract.families.flops): the conventions, checked on arithmetic a reader can
redo; tests/contract/test_flop_counter.py holds every family's ledger to PyTorch's FLOP counter."""

import pytest

from xfw.contract import families, presets
from xfw.contract.families import flops
from xfw.contract.families.decoder import DECODER_LINEARS


def arch(name):
    return presets.resolve_arch(name, {}, None, None)


ALL_LORA = {"r": 128, "targets": list(DECODER_LINEARS)}


def test_a_product_costs_its_forward_once_more_per_operand_that_needs_a_gradient():
    forward = 2 * 10 * 4 * 8
    assert flops.tally([flops.linear("x", 10, 4, 8, trains=False, grad_in=False)]).model == forward
    assert flops.tally([flops.linear("x", 10, 4, 8, trains=True, grad_in=False)]).model == 2 * forward
    assert flops.tally([flops.linear("x", 10, 4, 8, trains=False, grad_in=True)]).model == 2 * forward
    assert flops.tally([flops.linear("x", 10, 4, 8, trains=True, grad_in=True)]).model == 3 * forward
    assert flops.tally([flops.attention("x", 10, 10, 8, grad=True)]).model == 3 * 4 * 10 * 10 * 8


def test_lora_adds_two_trained_products_per_adapted_linear_and_keeps_the_linear_frozen():
    ledger = flops.adapted("text", 10, 64, 32, trains=False, grad_in=True, lora_r=4)
    count = flops.tally(ledger)
    assert count.terms == {"text": 2 * (2 * 10 * 64 * 32), "lora": 3 * (2 * 10 * 64 * 4) + 3 * (2 * 10 * 4 * 32)}


def test_recompute_is_hardware_flops_never_model_flops():
    a = arch("llava-1.6-vicuna-7b")
    plain, recomputed = families.count_flops(a, "sft"), families.count_flops(a, "sft", recompute=True)
    assert recomputed.model == plain.model == families.flops_per_sample(a, "sft")
    assert recomputed.hardware > plain.hardware == plain.model
    # Each decoder layer's forward again, but its down_proj (the early stop), and never the head.
    t, s = a["text"], a["data"]["seq_len"]
    layer = 2 * s * (2 * t["hidden_size"] ** 2 + 2 * t["hidden_size"] ** 2 + 2 * t["hidden_size"] * t["intermediate_size"]) \
        + 4 * s * s * t["hidden_size"]
    assert recomputed.recompute == {"text": t["num_layers"] * layer}


def test_sft_language_model_flops_are_six_n_t_plus_attention_plus_the_rotary_table():
    a = arch("llava-1.6-vicuna-7b")
    t, seq = a["text"], a["data"]["seq_len"]
    counts = presets.count_params(a)
    norms = (2 * t["num_layers"] + 1) * t["hidden_size"]
    matmul_params = counts["text"] - t["vocab_size"] * t["hidden_size"] - norms  # linears and head
    rotary = 2 * (t["hidden_size"] // t["num_heads"] // 2) * seq  # inverse frequencies x positions, forward only
    expected = 6 * matmul_params * seq + 3 * 4 * t["num_layers"] * seq * seq * t["hidden_size"] + rotary
    assert families.count_flops(a, "sft").terms["text"] == expected


def test_stages_cost_what_they_train():
    a = arch("llava-1.6-vicuna-7b")
    sft, lora, pretrain = (families.flops_per_sample(a, s, ALL_LORA) for s in ("sft", "lora", "pretrain"))
    assert pretrain < lora < sft
    assert 0.65 < pretrain / sft < 0.72  # frozen linears 2x instead of 3x; attention 3x in both


@pytest.mark.parametrize("preset", sorted(presets.PRESETS))
def test_every_family_counts_every_stage_and_the_parts_are_its_terms(preset):
    a = arch(preset)
    facts = families.family_module(a["family"])
    for stage in facts.STAGE_PARTS:
        lora = {"r": 4, "targets": list(facts.LORA_TARGETS)}
        count = families.count_flops(a, stage, lora, recompute=True)
        assert count.model > 0 and count.hardware >= count.model
        assert set(count.terms) <= {*facts.PARTS, families.LORA}, stage
        assert (families.LORA in count.terms) == (stage == "lora"), stage


def test_frozen_encoders_run_forward_only():
    sd15 = families.count_flops(arch("sd-1.5"), "pretrain")
    vae = flops.tally(families.family_module("sd15").flops.vae_encoder_ledger(arch("sd-1.5")["vae"], 512))
    assert vae.model == sd15.terms["vae"] and all(m.grads == 0 for m in
                                                  families.family_module("sd15").flops.text_encoder_ledger(
                                                      arch("sd-1.5")["text"]))
    assert 3.4e12 < sd15.model < 3.7e12  # per 512 px sample: UNet 2.4, VAE encoder 1.1, text 0.013 TFLOPs


def test_a_module_belongs_to_its_part_and_adapters_to_lora():
    a = arch("tiny-llava")
    assert families.flop_term(a, "lm_head") == "text"
    assert families.flop_term(a, "model.vision_tower.vision_model.encoder.layers.0.mlp.fc1") == "vision"
    assert families.flop_term(a, "model.language_model.layers.0.self_attn.q_proj.lora_A.default") == "lora"
    assert families.flop_term(a, "") == "other" and families.flop_term(a, "model") == "other"
