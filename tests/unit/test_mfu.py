"""MFU: analytic FLOPs (each family's) cross-checked against the parameter count, datasheet peaks by device."""

import pytest

from xfw.contract import families, presets
from xfw.contract.families.decoder import decoder_forward_flops
from xfw.report import mfu


def arch(name):
    return presets.resolve_arch(name, {}, None, None)


def test_language_model_flops_are_six_n_t_plus_attention_for_sft():
    a = arch("llava-1.6-vicuna-7b")
    t, seq = a["text"], a["data"]["seq_len"]
    counts = presets.count_params(a)
    # Matmul parameters: the text part minus the embedding table and the RMSNorm weights.
    norms = (2 * t["num_layers"] + 1) * t["hidden_size"]
    matmul_params = counts["text"] - t["vocab_size"] * t["hidden_size"] - norms
    expected_lm = 6 * matmul_params * seq + 3 * 4 * t["num_layers"] * seq * seq * t["hidden_size"]
    lm = 3 * decoder_forward_flops(t, seq)
    assert lm == expected_lm


def test_stages_that_freeze_the_language_model_cost_less():
    a = arch("llava-1.6-vicuna-7b")
    sft, lora, pretrain = (families.flops_per_sample(a, s) for s in ("sft", "lora", "pretrain"))
    assert pretrain == lora < sft
    assert 0.6 < lora / sft < 0.7  # 2x instead of 3x on the dominant LM term


def test_llava_7b_sft_is_about_a_hundred_teraflops_per_sample():
    flops = families.flops_per_sample(arch("llava-1.6-vicuna-7b"), "sft")
    assert 8e13 < flops < 1.2e14


def test_peaks_come_from_the_datasheet_table():
    assert mfu.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == pytest.approx(989.4e12)
    assert mfu.peak_flops("NVIDIA H800", "float16") == pytest.approx(989.4e12)
    assert mfu.peak_flops("NVIDIA H100 PCIe", "bfloat16") == pytest.approx(756e12)
    assert mfu.peak_flops("NVIDIA H100 80GB HBM3", "float32", tf32=True) == pytest.approx(494.7e12)
    assert mfu.peak_flops("AMD EPYC", "float32") is None


def test_mfu_divides_achieved_by_peak_over_all_devices():
    a = arch("qwen2-vl-2b")
    flops = families.flops_per_sample(a, "sft")
    value = mfu.mfu(arch=a, stage="sft", ips=10.0, device_name="NVIDIA H100 80GB HBM3", compute_dtype="bfloat16",
                    tf32=False, num_devices=2)
    assert value == pytest.approx(flops * 10.0 / (2 * 989.4e12))


def test_no_mfu_on_cpu_or_for_families_without_a_count():
    a = arch("tiny-llava")
    assert mfu.mfu(arch=a, stage="sft", ips=10.0, device_name="AMD EPYC", compute_dtype="float32", tf32=False,
                   num_devices=1) is None
    assert families.flops_per_sample({"family": "sd15"}, "pretrain") is None
