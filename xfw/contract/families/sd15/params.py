"""SD1.5's parameter counts, walked through diffusers' and transformers' layouts, and its LoRA linears.

Shared with SD3: :func:`count_vae` (the same AutoencoderKL)::

    >>> count_params(xfw.contract.presets.PRESETS["sd-1.5"])["unet"]
    859520964
"""

from __future__ import annotations


def _conv(cin: int, cout: int, k: int = 3) -> int:
    return k * k * cin * cout + cout


def _resnet(cin: int, cout: int, temb: int = 0) -> int:
    """ResnetBlock2D: two GroupNorm + 3x3 conv, a time projection if temb, a 1x1 shortcut if widths differ."""
    time = temb * cout + cout if temb else 0
    shortcut = _conv(cin, cout, 1) if cin != cout else 0
    return 2 * cin + _conv(cin, cout) + time + 2 * cout + _conv(cout, cout) + shortcut


def count_vae(vae: dict) -> int:
    """AutoencoderKL: encoder (DownEncoderBlock2D per level), decoder, optional quant convs."""
    c, n, z = vae["block_out_channels"], vae["layers_per_block"], vae["latent_channels"]
    mid = 2 * _resnet(c[-1], c[-1]) + 2 * c[-1] + 4 * (c[-1] * c[-1] + c[-1])  # resnets + self-attention
    encoder = _conv(3, c[0]) + mid + 2 * c[-1] + _conv(c[-1], 2 * z)
    for i, out in enumerate(c):
        cin = c[max(i - 1, 0)]
        encoder += sum(_resnet(cin if j == 0 else out, out) for j in range(n))
        encoder += _conv(out, out) if i < len(c) - 1 else 0
    rev = c[::-1]
    decoder = _conv(z, c[-1]) + mid + 2 * c[0] + _conv(c[0], 3)
    for i, out in enumerate(rev):
        cin = rev[max(i - 1, 0)]
        decoder += sum(_resnet(cin if j == 0 else out, out) for j in range(n + 1))
        decoder += _conv(out, out) if i < len(c) - 1 else 0
    quant = _conv(2 * z, 2 * z, 1) + _conv(z, z, 1) if vae["use_quant_conv"] else 0
    return encoder + decoder + quant


def _transformer_2d(ch: int, cross: int) -> int:
    """Transformer2DModel, one BasicTransformerBlock: 1x1 conv projections, self- and cross-attention, GEGLU."""
    attn1 = 3 * ch * ch + ch * ch + ch
    attn2 = ch * ch + 2 * cross * ch + ch * ch + ch
    ff = (ch * 8 * ch + 8 * ch) + (4 * ch * ch + ch)
    return 2 * ch + 2 * _conv(ch, ch, 1) + 3 * 2 * ch + attn1 + attn2 + ff


def count_unet(arch: dict) -> int:
    """UNet2DConditionModel with SD's options (cross-attention mid block, conv projections)."""
    u, z = arch["unet"], arch["vae"]["latent_channels"]
    c, n, cross, temb = u["block_out_channels"], u["layers_per_block"], u["cross_attention_dim"], 4 * u["block_out_channels"][0]
    total = _conv(z, c[0]) + (c[0] * temb + temb) + (temb * temb + temb) + 2 * c[0] + _conv(c[0], z)
    total += 2 * _resnet(c[-1], c[-1], temb) + _transformer_2d(c[-1], cross)
    for i, (kind, out) in enumerate(zip(u["down_block_types"], c)):
        cin = c[max(i - 1, 0)]
        total += sum(_resnet(cin if j == 0 else out, out, temb) for j in range(n))
        total += n * _transformer_2d(out, cross) if kind.startswith("CrossAttn") else 0
        total += _conv(out, out) if i < len(c) - 1 else 0
    rev = c[::-1]
    for i, (kind, out) in enumerate(zip(u["up_block_types"], rev)):
        prev, skip_last = rev[max(i - 1, 0)], rev[min(i + 1, len(c) - 1)]
        for j in range(n + 1):  # each resnet also takes the matching down-path skip connection
            total += _resnet((prev if j == 0 else out) + (skip_last if j == n else out), out, temb)
        total += (n + 1) * _transformer_2d(out, cross) if kind.startswith("CrossAttn") else 0
        total += _conv(out, out) if i < len(c) - 1 else 0
    return total


def attention_blocks(unet: dict) -> list[int]:
    """The width of every BasicTransformerBlock: n per cross-attention down block, one in the
    mid block, n + 1 per cross-attention up block (as :func:`count_unet` counts them)."""
    c, n = unet["block_out_channels"], unet["layers_per_block"]
    down = [w for kind, w in zip(unet["down_block_types"], c) if kind.startswith("CrossAttn") for _ in range(n)]
    up = [w for kind, w in zip(unet["up_block_types"], c[::-1]) if kind.startswith("CrossAttn") for _ in range(n + 1)]
    return down + [c[-1]] + up


def lora_linears(arch: dict) -> dict[str, list[tuple[int, int]]]:
    """(in, out) of every UNet linear each LoRA target name matches (peft matches a name as a
    suffix): per BasicTransformerBlock of width c, self-attention's four (c -> c) and
    cross-attention's, whose keys and values read the text (cross -> c). The VAE's attention has
    the same names but is not in the LoRA module."""
    cross = arch["unet"]["cross_attention_dim"]
    blocks = attention_blocks(arch["unet"])
    return {"to_q": [(c, c) for c in blocks for _ in range(2)],
            "to_k": [shape for c in blocks for shape in ((c, c), (cross, c))],
            "to_v": [shape for c in blocks for shape in ((c, c), (cross, c))],
            "to_out.0": [(c, c) for c in blocks for _ in range(2)]}


def count_text(text: dict) -> int:
    """CLIPTextModel: token and position embeddings, pre-LN blocks, final LayerNorm."""
    h, f = text["hidden_size"], text["intermediate_size"]
    block = 2 * 2 * h + 4 * (h * h + h) + (h * f + f) + (f * h + h)
    return (text["vocab_size"] + text["max_length"]) * h + text["num_layers"] * block + 2 * h


def count_params(arch: dict) -> dict[str, int]:
    """Analytic parameter counts per part (the keys of ``PARTS``)."""
    counts = {"unet": count_unet(arch), "vae": count_vae(arch["vae"]), "text_encoder": count_text(arch["text"])}
    return {**counts, "total": sum(counts.values())}
