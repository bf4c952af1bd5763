"""Model FLOPs utilisation: analytic training FLOPs of the neutral architecture x throughput,
over the device's datasheet peak::

    mfu = flops_per_sample(arch, stage) * ips / (peak_flops(device, dtype) * num_gpus)

Model FLOPs count what the recipe must compute, not what an implementation chose to do:
activation recomputation is excluded (that would be hardware FLOPs utilisation), as in
PaLM (Chowdhery et al. 2022, appendix B). Matmul FLOPs only: 2 per multiply-add; attention
scores and values 2 x 2 x T^2 x d per layer, full (non-causal) as in PaLM's 6N + 12LHQT.

Training multipliers per part: a trained part costs 3x its forward (forward, activation
gradients, weight gradients); a frozen part that gradients must flow through (the LM under
LoRA or projector-only pretraining) 2x; a frozen part nothing upstream of it trains (the
vision tower) 1x. Each family counts its own FLOPs under these rules, with the parts its stages
train (``flops_per_sample`` in ``xfw.contract.families.<family>``); this module holds the
device peaks.
"""

from __future__ import annotations

from xfw.contract import families

# Dense (no sparsity) peak TFLOP/s by compute dtype, from NVIDIA's datasheets: H100 SXM5 and
# H800 SXM5 (same tensor cores), H200 SXM; H100 PCIe; A100 SXM4 80GB.
_PEAK_TFLOPS = [
    ("H200", {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9}),
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "tf32": 378.0, "float32": 51.2}),
    ("H100", {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9}),
    ("H800", {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9}),
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5}),
]


def peak_flops(device_name: str, compute_dtype: str, tf32: bool = False) -> float | None:
    """Peak FLOP/s of one device for a compute dtype; None for CPUs and unknown devices."""
    key = "tf32" if compute_dtype == "float32" and tf32 else compute_dtype
    for name, peaks in _PEAK_TFLOPS:
        if name in device_name:
            value = peaks.get(key)
            return value * 1e12 if value else None
    return None


def mfu(*, arch: dict, stage: str, ips: float | None, device_name: str, compute_dtype: str, tf32: bool,
        num_devices: int, trainable: list | None = None, seq_len: float | None = None) -> float | None:
    """``seq_len``: the mean sequence trained (variable-length data), else the architecture's;
    ``trainable``: the recipe's ``model.trainable``, else the stage's parts."""
    if seq_len and arch.get("data", {}).get("seq_len"):
        arch = families.with_seq_len(arch, round(seq_len))
    flops = families.flops_per_sample(arch, stage, trainable) if arch.get("family") in families.FAMILIES else None
    peak = peak_flops(device_name, compute_dtype, tf32)
    if flops is None or peak is None or not ips:
        return None
    return flops * ips / (peak * num_devices)
