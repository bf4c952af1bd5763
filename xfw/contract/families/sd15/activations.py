"""SD1.5's stored activations: a UNet is no stack of equal layers, so it is walked block by block.

Bytes saved for backward, per pixel (per token) and sample, counted tensor by tensor as in
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
Sec. 4.1, for diffusers' blocks. Under autocast (bf16/fp16) convs and linears keep a
low-precision copy of their input (act = 2 bytes) while GroupNorm, LayerNorm and the SiLU after a
GroupNorm run in fp32 (4 bytes): CUDA autocast's fp32 op list. In fp32, act = 4 and inputs a cast
would have copied are shared. The peak (:func:`activation_bytes`) is the larger of the UNet's
backward (:func:`unet_activation_bytes`) and the frozen VAE encoder's transient pass
(:func:`vae_encoder_bytes`), which at 512 px is the larger::

    >>> resnet_per_px(320, 320, act=2, autocast=True)   # GroupNorm + SiLU inputs in fp32, conv input in bf16
    6400

Checked against what autograd saves in a real diffusers UNet: tests/contract/test_estimate_unet.py.
"""

from __future__ import annotations

GIB = 1024**3


def _act(dtype: str) -> tuple[int, bool]:
    """(bytes per activation a conv or linear keeps, autocast?) for a precision dtype."""
    return (4, False) if dtype == "fp32" else (2, True)


def activation_bytes(arch: dict, micro: int, *, dtype: str, recompute: bool) -> float:
    """The peak: in the UNet's backward or, for large images, the frozen VAE encoder."""
    act, autocast = _act(dtype)
    return max(unet_activation_bytes(arch, micro, act=act, autocast=autocast, recompute=recompute),
               vae_encoder_bytes(arch, micro, act=act, autocast=autocast))


def activation_note(arch: dict, micro: int, *, dtype: str, recompute: bool) -> str:
    """What :func:`activation_bytes` took the larger of, for a report."""
    act, autocast = _act(dtype)
    unet = unet_activation_bytes(arch, micro, act=act, autocast=autocast, recompute=recompute)
    vae = vae_encoder_bytes(arch, micro, act=act, autocast=autocast)
    return (f"activations = the larger of the UNet's backward ({unet / GIB:.2f} GiB) and the frozen VAE "
            f"encoder's pass ({vae / GIB:.2f} GiB); gradients are counted although set_to_none frees them "
            "before the VAE runs")


def resnet_per_px(c_in: int, c_out: int, act: int, autocast: bool) -> int:
    """ResnetBlock2D: per side GroupNorm input (4c), SiLU input (4c), conv input (act c); the 1x1
    shortcut keeps the block input where the width changes (shared with the norm's in fp32)."""
    return (8 + act) * (c_in + c_out) + (act * c_in if autocast and c_in != c_out else 0)


def attention_block_per_token(d: int, act: int, autocast: bool) -> int:
    """BasicTransformerBlock (SD1.5: self-attention, cross-attention over 77 text tokens, GEGLU MLP
    of width 4d), fused SDPA (no score matrix): 3 LayerNorm inputs (12d); self-attention's q/k/v
    inputs (3 autocast copies, else one), q, k, v, output and to_out input (5 act d); cross-attention
    q input, q, output, to_out input (4 act d); MLP input, GEGLU projection (8d), GELU output (4d),
    product (4d) (17 act d)."""
    return 12 * d + (3 if autocast else 1) * act * d + 26 * act * d


def unet_activation_bytes(arch: dict, micro: int, *, act: int, autocast: bool, recompute: bool) -> float:
    """SD1.5 UNet activations at the start of backward, for one micro-batch.

    Recompute is diffusers' gradient checkpointing: each ResnetBlock2D and each
    BasicTransformerBlock keeps only its input (act bytes per element) and is run again in
    backward; the Transformer2DModel around a block (GroupNorm 4c, proj_in and proj_out inputs),
    the down/upsampler convs and the output head are not checkpointed. The backward then holds
    one recomputed unit on top, the largest."""
    unet = arch["unet"]
    widths, num_layers = unet["block_out_channels"], unet["layers_per_block"]
    side = arch["data"]["image_size"] // 2 ** (len(arch["vae"]["block_out_channels"]) - 1)
    saved, largest = 0.0, 0.0

    def resnet(c_in: int, c_out: int, px: int) -> None:
        nonlocal saved, largest
        full = resnet_per_px(c_in, c_out, act, autocast) * px
        saved += act * c_in * px if recompute else full
        largest = max(largest, full)

    def attention(c: int, px: int) -> None:
        nonlocal saved, largest
        full = attention_block_per_token(c, act, autocast) * px
        saved += (4 + 2 * act) * c * px + (act * c * px if recompute else full)
        largest = max(largest, full)

    skips, c_prev = [widths[0]], widths[0]  # conv_in's output is the first skip
    for i, kind in enumerate(unet["down_block_types"]):
        px = (side >> i) ** 2
        for _ in range(num_layers):
            resnet(c_prev, widths[i], px)
            c_prev = widths[i]
            if kind.startswith("CrossAttn"):
                attention(c_prev, px)
            skips.append(c_prev)
        if i < len(widths) - 1:  # Downsample2D: a stride-2 conv keeps its input
            saved += act * c_prev * px
            skips.append(c_prev)
    mid_px = (side >> (len(widths) - 1)) ** 2
    resnet(c_prev, c_prev, mid_px), attention(c_prev, mid_px), resnet(c_prev, c_prev, mid_px)
    for j, kind in enumerate(unet["up_block_types"]):
        level = len(widths) - 1 - j
        px, c_out = (side >> level) ** 2, widths[level]
        for _ in range(num_layers + 1):
            resnet(c_prev + skips.pop(), c_out, px)  # the concatenation is the resnet's input
            c_prev = c_out
            if kind.startswith("CrossAttn"):
                attention(c_prev, px)
        if level > 0:  # Upsample2D: nearest 2x, then a conv keeping its (4x larger) input
            saved += act * c_prev * 4 * px
    saved += (8 + act) * widths[0] * side**2  # conv_norm_out (4c), SiLU (4c), conv_out input
    return micro * (saved + (largest if recompute else 0))


def vae_encoder_bytes(arch: dict, micro: int, *, act: int, autocast: bool) -> float:
    """The frozen VAE encoder's transient peak (no grad: nothing is kept for backward, but a UNet-sized
    batch at full resolution is large). It sits in norm2 of the first block's second ResnetBlock2D,
    at full resolution and the first width c: the block's input (held by the Encoder's loop), the
    resnet's input (the first resnet's output, held for the residual), conv1's output (act c each),
    its fp32 copy for GroupNorm (autocast only) and the fp32 GroupNorm output (4c each); plus the
    fp32 pixels. At 512 px this exceeds the checkpointed UNet: SD1.5's H100 OOMs at micro 128 failed
    there."""
    vae = arch["vae"]
    c, px = vae["block_out_channels"][0], arch["data"]["image_size"] ** 2
    held = act if vae["layers_per_block"] > 1 else 0  # with one resnet the block input is its input
    per_element = held + 2 * act + (4 if autocast else 0) + 4
    return micro * px * (per_element * c + 3 * 4)
