"""MFU: each family's model FLOPs (tests/unit/test_flops.py) over datasheet peaks by device."""

import pytest

from xfw.contract import families, presets
from xfw.report import mfu


def arch(name):
    return presets.resolve_arch(name, {}, None, None)


def test_llava_7b_sft_is_about_a_hundred_teraflops_per_sample():
    flops = families.flops_per_sample(arch("llava-1.6-vicuna-7b"), "sft")
    assert 8e13 < flops < 1.2e14


def test_peaks_come_from_the_datasheet_table():
    assert mfu.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == pytest.approx(989.4e12)
    assert mfu.peak_flops("NVIDIA H800", "float16") == pytest.approx(989.4e12)
    assert mfu.peak_flops("NVIDIA H100 PCIe", "bfloat16") == pytest.approx(756e12)
    assert mfu.peak_flops("NVIDIA H100 80GB HBM3", "float32", tf32=True) == pytest.approx(494.7e12)
    assert mfu.peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16") == pytest.approx(312e12)
    assert mfu.peak_flops("AMD EPYC", "float32") is None
    assert mfu.peak_flops("NVIDIA H100 NVL", "bfloat16") is None  # not in the table: never the SXM's peak


def test_every_peak_names_its_device_dtype_and_datasheet():
    label = mfu.find_peak("NVIDIA H100 80GB HBM3", "bfloat16").label()
    assert label == "NVIDIA H100 SXM5 bfloat16 dense 989.4 TFLOP/s (NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column)"
    for _, _, peaks, source in mfu._PEAKS:
        assert "datasheet" in source and set(peaks) == {"bfloat16", "float16", "tf32", "float32"}


def test_mfu_divides_model_flops_by_peak_over_all_devices():
    a = arch("qwen2-vl-2b")
    flops = families.flops_per_sample(a, "sft")
    value = mfu.mfu(arch=a, stage="sft", ips=10.0, device_name="NVIDIA H100 80GB HBM3", compute_dtype="bfloat16",
                    tf32=False, num_devices=2)
    assert value == pytest.approx(flops * 10.0 / (2 * 989.4e12))


@pytest.mark.parametrize("preset,stage", [("sd-1.5", "pretrain"), ("sd-1.5", "lora"), ("sd-3-medium", "dreambooth"),
                                          ("sd-3-medium", "lora")])
def test_every_family_has_an_mfu_on_a_known_gpu(preset, stage):
    lora = {"r": 4, "targets": ["to_q", "to_k", "to_v", "to_out.0"]}
    u = mfu.utilisation(arch=arch(preset), stage=stage, lora=lora, ips=40.0, device="cuda:0",
                        device_name="NVIDIA H100 80GB HBM3", compute_dtype="bfloat16", tf32=False, num_devices=1)
    assert 0 < u.mfu < 1 and u.flops_per_sample == families.flops_per_sample(arch(preset), stage, lora)
    assert "989.4 TFLOP/s" in u.peak


def test_no_mfu_on_a_cpu_and_an_unknown_device_says_so_rather_than_guessing():
    a = arch("tiny-llava")
    cpu = mfu.utilisation(arch=a, stage="sft", lora=None, ips=10.0, device="cpu", device_name="AMD EPYC",
                          compute_dtype="float32", tf32=False, num_devices=1)
    assert cpu.mfu is None and cpu.peak.startswith("CPU: no MFU") and cpu.flops_per_sample > 0
    odd = mfu.utilisation(arch=a, stage="sft", lora=None, ips=10.0, device="gpu:0", device_name="Tesla V100-SXM2",
                          compute_dtype="float16", tf32=False, num_devices=1)
    assert odd.mfu is None and "no datasheet peak for Tesla V100-SXM2 at float16" in odd.peak
