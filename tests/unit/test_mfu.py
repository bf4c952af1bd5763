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
