"""SD1.5's training FLOPs: every product of one sample's step, walked through diffusers' blocks.

The step (``xfw_torch.families.sd15``): the frozen VAE encoder and CLIP text encoder run forward
only (no gradient, nothing upstream trains), then the UNet forward and backward. Products follow
``xfw.contract.families.flops`` (its conventions, and why one costs 1x, 2x or 3x its forward)::

    >>> count = tally(flop_ledger(xfw.contract.presets.PRESETS["sd-1.5"] | {"data": {"image_size": 512}},
    ...                           "pretrain", None, False))
    >>> round(count.model / 1e12, 2), sorted(count.terms)
    (...)

Which products need which gradients, so the UNet is walked with a flag per activation (does a
gradient reach it): in stage pretrain the UNet's first convolution and its time embedding's first
linear are fed by data (no input gradient), and cross-attention's keys and values read the frozen
text encoder's states (none either). In stage lora only the adapters train: nothing before the
first adapted attention needs a gradient, and the time-embedding path never does. Recompute is
diffusers' gradient checkpointing: each ResnetBlock2D and each BasicTransformerBlock a gradient
reaches runs forward again in backward, up to its last product (the mid block's first resnet is
not checkpointed; nor are the convolutions around the blocks).
"""

from __future__ import annotations

from xfw.contract.families.flops import Matmul, adapted, attention, conv, linear, lora_rank


def vae_encoder_ledger(vae: dict, image_size: int) -> list[Matmul]:
    """AutoencoderKL's encoder, frozen and fed by data (forward only): per level its resnets (two
    3x3 convolutions, a 1x1 shortcut where the width changes) and a stride-2 downsampler, the mid
    block's resnets around a single-head self-attention, then conv_out (and quant_conv)."""
    c, z = vae["block_out_channels"], vae["latent_channels"]
    px = [(image_size >> i) ** 2 for i in range(len(c))]
    out = [conv("vae", px[0], 9, 3, c[0], trains=False, grad_in=False)]

    def resnet(c_in: int, c_out: int, pixels: int) -> None:
        out.extend(conv("vae", pixels, 9, a, b, trains=False, grad_in=False) for a, b in ((c_in, c_out), (c_out, c_out)))
        if c_in != c_out:
            out.append(conv("vae", pixels, 1, c_in, c_out, trains=False, grad_in=False))

    for i, width in enumerate(c):
        for j in range(vae["layers_per_block"]):
            resnet(c[max(i - 1, 0)] if j == 0 else width, width, px[i])
        if i < len(c) - 1:
            out.append(conv("vae", px[i + 1], 9, width, width, trains=False, grad_in=False))
    last, pixels = c[-1], px[-1]
    resnet(last, last, pixels)
    out += [linear("vae", pixels, last, last, trains=False, grad_in=False)] * 4  # q, k, v, out
    out.append(attention("vae", pixels, pixels, last, grad=False))
    resnet(last, last, pixels)
    out.append(conv("vae", pixels, 9, last, 2 * z, trains=False, grad_in=False))
    if vae["use_quant_conv"]:
        out.append(conv("vae", pixels, 1, 2 * z, 2 * z, trains=False, grad_in=False))
    return out


def text_encoder_ledger(text: dict) -> list[Matmul]:
    """CLIPTextModel over the padded prompt, frozen (forward only)."""
    h, f, length = text["hidden_size"], text["intermediate_size"], text["max_length"]
    layer = [*[linear("text_encoder", length, h, h, trains=False, grad_in=False)] * 4,
             attention("text_encoder", length, length, h, grad=False),
             linear("text_encoder", length, h, f, trains=False, grad_in=False),
             linear("text_encoder", length, f, h, trains=False, grad_in=False)]
    return layer * text["num_layers"]


class _UNetWalk:
    """The UNet in forward order, a flag per activation: does a gradient reach it."""

    def __init__(self, arch: dict, trains: bool, lora: dict | None, recompute: bool):
        self.u, self.trains, self.lora, self.recompute = arch["unet"], trains, lora, recompute
        self.cross, self.text_len = self.u["cross_attention_dim"], arch["text"]["max_length"]
        self.latent_channels = arch["vae"]["latent_channels"]
        self.out: list[Matmul] = []
        self.temb_grad = trains  # the time embedding's second linear trains: its output carries one

    def needs_backward(self, grad_in: bool, lora_names: tuple[str, ...] = ()) -> bool:
        return grad_in or self.trains or any(lora_rank(self.lora, n) for n in lora_names)

    def conv(self, pixels: int, kernel: int, c_in: int, c_out: int, grad_in: bool, rec: bool = False) -> bool:
        self.out.append(conv("unet", pixels, kernel, c_in, c_out, trains=self.trains, grad_in=grad_in, recomputed=rec))
        return grad_in or self.trains

    def resnet(self, c_in: int, c_out: int, pixels: int, grad_in: bool, checkpointed: bool = True) -> bool:
        """ResnetBlock2D: conv1, the time projection (added), conv2, a 1x1 shortcut where widths
        differ. Recompute stops before the last convolution (``flops``: early stop)."""
        rec = checkpointed and self.recompute and (self.needs_backward(grad_in) or self.temb_grad)
        shortcut = c_in != c_out
        h = self.conv(pixels, 9, c_in, c_out, grad_in, rec)
        self.out.append(linear("unet", 1, 4 * self.u["block_out_channels"][0], c_out, trains=self.trains,
                               grad_in=self.temb_grad, recomputed=rec))
        h = self.conv(pixels, 9, c_out, c_out, h or self.temb_grad or self.trains, rec and shortcut)
        if shortcut:
            self.conv(pixels, 1, c_in, c_out, grad_in)
        return h or grad_in

    def attend(self, c: int, q_tokens: int, kv_tokens: int, kv_width: int, q_grad: bool, kv_grad: bool,
               rec: bool) -> bool:
        """One diffusers Attention: to_q, to_k, to_v (with adapters when targeted), the products, to_out.0."""
        def proj(name: str, tokens: int, width: int, flows: bool) -> bool:
            self.out.extend(adapted("unet", tokens, width, c, trains=self.trains, grad_in=flows,
                                    lora_r=lora_rank(self.lora, name), recomputed=rec))
            return flows or self.trains or bool(lora_rank(self.lora, name))

        grads = [proj("to_q", q_tokens, c, q_grad), proj("to_k", kv_tokens, kv_width, kv_grad),
                 proj("to_v", kv_tokens, kv_width, kv_grad)]
        self.out.append(attention("unet", q_tokens, kv_tokens, c, grad=any(grads), recomputed=rec))
        return proj("to_out.0", q_tokens, c, any(grads))

    def transformer(self, c: int, pixels: int, grad_in: bool) -> bool:
        """Transformer2DModel (SD1.5: 1x1 conv projections) around one BasicTransformerBlock:
        self-attention, cross-attention over the text states, GEGLU feed-forward."""
        h = self.conv(pixels, 1, c, c, grad_in)  # proj_in
        rec = self.recompute and self.needs_backward(h, ("to_q", "to_k", "to_v", "to_out.0"))
        h = self.attend(c, pixels, pixels, c, h, h, rec) or h
        h = self.attend(c, pixels, self.text_len, self.cross, h, False, rec) or h
        self.out.append(linear("unet", pixels, c, 8 * c, trains=self.trains, grad_in=h, recomputed=rec))
        self.out.append(linear("unet", pixels, 4 * c, c, trains=self.trains, grad_in=h or self.trains))  # ends it
        h = h or self.trains
        return self.conv(pixels, 1, c, c, h)  # proj_out

    def walk(self, side: int) -> list[Matmul]:
        u, z = self.u, self.latent_channels
        c, n = u["block_out_channels"], u["layers_per_block"]
        px = [(side >> i) ** 2 for i in range(len(c))]
        temb = 4 * c[0]
        self.out += [linear("unet", 1, c[0], temb, trains=self.trains, grad_in=False),
                     linear("unet", 1, temb, temb, trains=self.trains, grad_in=self.trains)]
        h = self.conv(px[0], 9, z, c[0], False)
        skips = [(c[0], h)]
        width = c[0]
        for i, kind in enumerate(u["down_block_types"]):
            for _ in range(n):
                h = self.resnet(width, c[i], px[i], h)
                width = c[i]
                if kind.startswith("CrossAttn"):
                    h = self.transformer(width, px[i], h)
                skips.append((width, h))
            if i < len(c) - 1:
                h = self.conv(px[i + 1], 9, width, width, h)
                skips.append((width, h))
        h = self.resnet(width, width, px[-1], h, checkpointed=False)  # diffusers' mid block checkpoints only the others
        h = self.transformer(width, px[-1], h)
        h = self.resnet(width, width, px[-1], h)
        for j, kind in enumerate(u["up_block_types"]):
            level = len(c) - 1 - j
            for _ in range(n + 1):
                skip_width, skip_grad = skips.pop()
                h = self.resnet(width + skip_width, c[level], px[level], h or skip_grad)
                width = c[level]
                if kind.startswith("CrossAttn"):
                    h = self.transformer(width, px[level], h)
            if level > 0:
                h = self.conv(px[level - 1], 9, width, width, h)  # Upsample2D: nearest 2x, then a conv
        self.conv(px[0], 9, c[0], z, h)
        return self.out


def flop_ledger(arch: dict, trained: tuple[str, ...], lora: dict | None, recompute: bool) -> list[Matmul]:
    """Every product of one sample's step: VAE encoder and text encoder forward, the UNet trained
    (stage pretrain) or adapted (stage lora: only the adapters on its attention linears train)."""
    from xfw.contract.families.sd15.latents import latent_shape

    walk = _UNetWalk(arch, "unet" in trained, lora, recompute)
    unet = walk.walk(latent_shape(arch, 1)[-1])
    return vae_encoder_ledger(arch["vae"], arch["data"]["image_size"]) + text_encoder_ledger(arch["text"]) + unet
