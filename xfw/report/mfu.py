"""Model FLOPs utilisation: the family's model FLOPs per sample x throughput, over the device's
datasheet peak, with the peak named and cited so a reader can check it::

    mfu = model_flops_per_sample(arch, stage, lora) * ips / (peak(device, dtype) * num_devices)

    >>> utilisation(arch=a, stage="sft", lora=None, ips=10.0, device="cuda:0",
    ...             device_name="NVIDIA H100 80GB HBM3", compute_dtype="bfloat16", tf32=False, num_devices=8)
    Utilisation(mfu=0.113, flops_per_sample=8.9e13, peak="NVIDIA H100 SXM5 bfloat16 dense 989.4 TFLOP/s ...")

Model FLOPs are the family's ledger (``xfw.contract.families.count_flops``, checked against PyTorch's
FLOP counter by tests/contract/test_flop_counter.py): what the recipe must compute, forward and
backward, recomputation excluded (that would be hardware FLOPs utilisation; PaLM, Chowdhery et al.
2022, appendix B). Both backends' runs of one recipe divide by the same count, computed here from
the spec, so their MFU columns are comparable. No MFU on a CPU, nor on a device the peak table does
not list: the report says which, never a guessed peak.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from xfw.contract import families

# Dense (no sparsity) peak TFLOP/s by compute dtype. NVIDIA's datasheets print tensor-core peaks
# "with sparsity"; the dense figure is half of it. Each row: the device names it covers (a regex over
# the name the framework reports), the datasheet's name for it, its peaks, and the datasheet.
_H100_SXM = {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9}
_PEAKS = [
    (r"\bH200\b(?!.*\bNVL\b)", "NVIDIA H200 SXM", _H100_SXM,
     "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column"),
    (r"\bH100\b.*\bPCIe\b", "NVIDIA H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "tf32": 378.0, "float32": 51.2},
     "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column"),
    (r"\bH100\b(?!.*\b(PCIe|NVL)\b)", "NVIDIA H100 SXM5", _H100_SXM,
     "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column"),
    (r"\bH800\b(?!.*\b(PCIe|NVL)\b)", "NVIDIA H800 SXM5", _H100_SXM,
     "NVIDIA H800 datasheet: the H100 SXM's tensor cores"),
    (r"\bA100\b", "NVIDIA A100", {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5},
     "NVIDIA A100 Tensor Core GPU datasheet (SXM and PCIe alike)"),
]


@dataclass(frozen=True, kw_only=True)
class Peak:
    """The peak an MFU divides by, and where it comes from."""

    device: str
    """The datasheet's name for the device."""
    dtype: str
    """The compute dtype the peak is for (``tf32`` for float32 on TF32 tensor cores)."""
    flops: float
    """Dense peak, FLOP/s."""
    source: str

    def label(self) -> str:
        return f"{self.device} {self.dtype} dense {self.flops / 1e12:g} TFLOP/s ({self.source})"


@dataclass(frozen=True, kw_only=True)
class Utilisation:
    mfu: float | None
    flops_per_sample: float | None
    """Model FLOPs of one sample (the family's ledger); None where the family keeps none."""
    peak: str
    """What ``mfu`` divided by (:meth:`Peak.label`), or why there is no MFU."""


def find_peak(device_name: str, compute_dtype: str, tf32: bool = False) -> Peak | None:
    """The datasheet peak of one device for a compute dtype; None for devices the table does not list."""
    key = "tf32" if compute_dtype == "float32" and tf32 else compute_dtype
    for pattern, device, peaks, source in _PEAKS:
        if re.search(pattern, device_name) and key in peaks:
            return Peak(device=device, dtype=key, flops=peaks[key] * 1e12, source=source)
    return None


def peak_flops(device_name: str, compute_dtype: str, tf32: bool = False) -> float | None:
    """Peak FLOP/s of one device for a compute dtype; None for CPUs and unknown devices."""
    peak = find_peak(device_name, compute_dtype, tf32)
    return peak.flops if peak else None


def utilisation(*, arch: dict, stage: str, lora: dict | None, ips: float | None, device: str, device_name: str,
                compute_dtype: str, tf32: bool, num_devices: int, trainable: list | None = None,
                seq_len: float | None = None) -> Utilisation:
    """MFU of one run, with the FLOPs and the peak behind it (module docstring). ``device``: the
    applied device (``cpu``, ``cuda:0``, ``gpu:0``); ``trainable``: the recipe's ``model.trainable``,
    else the stage's parts; ``seq_len``: the mean sequence trained (variable-length data), else the
    architecture's."""
    if seq_len and arch.get("data", {}).get("seq_len"):
        arch = families.with_seq_len(arch, round(seq_len))
    known = arch.get("family") in families.FAMILIES
    flops = families.flops_per_sample(arch, stage, lora, trainable) if known else None
    if device == "cpu" or not device or "CPU test device" in device:  # Paddle's testcpu runs on the CPU
        return Utilisation(mfu=None, flops_per_sample=flops, peak="CPU: no MFU (no datasheet peak for a CPU)")
    peak = find_peak(device_name, compute_dtype, tf32)
    if peak is None:
        return Utilisation(mfu=None, flops_per_sample=flops,
                           peak=f"no datasheet peak for {device_name or 'this device'} at {compute_dtype} in "
                                "xfw's table (xfw/report/mfu.py): no MFU rather than a guess")
    if flops is None:
        return Utilisation(mfu=None, flops_per_sample=None, peak=f"no FLOPs ledger for the {arch.get('family')} family")
    value = flops * ips / (peak.flops * num_devices) if ips else None
    return Utilisation(mfu=value, flops_per_sample=flops, peak=peak.label())


def mfu(*, arch: dict, stage: str, ips: float | None, device_name: str, compute_dtype: str, tf32: bool,
        num_devices: int, lora: dict | None = None, trainable: list | None = None,
        seq_len: float | None = None) -> float | None:
    """The MFU alone, for a GPU run (:func:`utilisation`)."""
    return utilisation(arch=arch, stage=stage, lora=lora, ips=ips, device="cuda", device_name=device_name,
                       compute_dtype=compute_dtype, tf32=tf32, num_devices=num_devices, trainable=trainable,
                       seq_len=seq_len).mfu
