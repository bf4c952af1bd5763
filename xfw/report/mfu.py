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
vision tower) 1x.
"""

from __future__ import annotations

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


def _decoder_forward(text: dict, seq_len: int, with_head: bool = True) -> float:
    h, f, layers = text["hidden_size"], text["intermediate_size"], text["num_layers"]
    kv = h // text["num_heads"] * text["num_kv_heads"]
    linear = 2 * seq_len * (2 * h * h + 2 * h * kv + 3 * h * f)
    attention = 2 * 2 * seq_len * seq_len * h
    head = 2 * seq_len * h * text["vocab_size"] if with_head else 0
    return layers * (linear + attention) + head


def _vit_forward(num_tokens: int, hidden: int, mlp: int, layers: int) -> float:
    return layers * (2 * num_tokens * (4 * hidden * hidden + 2 * hidden * mlp) + 2 * 2 * num_tokens ** 2 * hidden)


def _lm_multiplier(stage: str) -> int:
    return {"sft": 3, "lora": 2, "pretrain": 2}.get(stage, 3)


def _llava(arch: dict, stage: str) -> float:
    from xfw.contract.families.llava import num_tiles

    v, t = arch["vision"], arch["text"]
    patches = (v["image_size"] // v["patch_size"]) ** 2
    tiles = num_tiles(arch)
    vision = tiles * (_vit_forward(patches + 1, v["hidden_size"], v["intermediate_size"], v["num_layers"])
                      + 2 * patches * 3 * v["patch_size"] ** 2 * v["hidden_size"])
    projector = tiles * 2 * patches * (v["hidden_size"] * t["hidden_size"] + t["hidden_size"] ** 2)
    lm = _decoder_forward(t, arch["data"]["seq_len"])
    return vision + 3 * projector + _lm_multiplier(stage) * lm


def _qwen2vl(arch: dict, stage: str) -> float:
    v, t = arch["vision"], arch["text"]
    d, side = v["embed_dim"], arch["data"]["image_size"] // v["patch_size"]
    patches, merge = side * side, v["spatial_merge_size"] ** 2
    vision = _vit_forward(patches, d, d * v["mlp_ratio"], v["depth"])
    vision += 2 * patches * 3 * v["temporal_patch_size"] * v["patch_size"] ** 2 * d
    merged = d * merge
    merger = 2 * (patches // merge) * (merged * merged + merged * v["merger_out"])
    return vision + 3 * merger + _lm_multiplier(stage) * _decoder_forward(t, arch["data"]["seq_len"])


_FAMILIES = {"llava": _llava, "qwen2vl": _qwen2vl}


def flops_per_sample(arch: dict, stage: str) -> float | None:
    """Model training FLOPs for one sample; None for families without an analytic count yet."""
    fn = _FAMILIES.get(arch.get("family"))
    return fn(arch, stage) if fn else None


def mfu(*, arch: dict, stage: str, ips: float | None, device_name: str, compute_dtype: str, tf32: bool,
        num_devices: int) -> float | None:
    flops = flops_per_sample(arch, stage)
    peak = peak_flops(device_name, compute_dtype, tf32)
    if flops is None or peak is None or not ips:
        return None
    return flops * ips / (peak * num_devices)
