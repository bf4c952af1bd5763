"""Stable Diffusion 1.5 (CLIP text encoder + VAE + UNet, epsilon prediction) in Flax NNX.

Native NNX, not diffusers' Flax classes: diffusers' Flax UNet/VAE are linen modules (not NNX), are not
in this environment, and the torch side's diffusers 0.42 names its parameters differently from them. So
the module tree here mirrors diffusers' ``UNet2DConditionModel`` and ``AutoencoderKL`` and transformers'
``CLIPTextModel`` attribute for attribute (``unet`` / ``vae`` / ``text_encoder``, as the PyTorch adapter
holds them), and one exported safetensors start loads into both (``xfw_jax.names``).

The step is the PyTorch adapter's (``xfw_torch.families.sd15``), its randomness taken from the batch::

    latents = VAE mean(pixels) x scaling_factor          # frozen: stop_gradient
    text    = CLIP text(input_ids).last_hidden_state      # frozen: not differentiated
    noisy   = sqrt(a_t) latents + sqrt(1 - a_t) noise     # a from xfw.contract.families.sd15
    loss    = MSE(UNet(noisy, t, text), noise)

What each stage trains is ``xfw.contract.families.sd15.STAGE_PARTS`` (applied by ``xfw_jax.model``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xfw.contract.families import sd15 as core
from xfw_jax.families.diffusion import (AutoencoderKL, Downsample2D, Empty, ResnetBlock2D, Upsample2D, conv,
                                        group_norm, nhwc, norm32, timestep_embedding)
from xfw_jax.families.llava import INIT, CLIPEncoder, _attention, _Ctx


# -- text encoder (transformers' CLIPTextModel) ------------------------------------------------------
class CLIPTextEmbeddings(nnx.Module):
    def __init__(self, t: dict, c: _Ctx):
        kw = dict(dtype=c.dtype, param_dtype=c.param_dtype, embedding_init=INIT, rngs=c.rngs)
        self.token_embedding = nnx.Embed(t["vocab_size"], t["hidden_size"], **kw)
        self.position_embedding = nnx.Embed(t["max_length"], t["hidden_size"], **kw)

    def __call__(self, ids):
        return self.token_embedding(ids) + self.position_embedding(jnp.arange(ids.shape[1]))


class CLIPTextTransformer(nnx.Module):
    def __init__(self, t: dict, c: _Ctx):
        self.embeddings = CLIPTextEmbeddings(t, c)
        self.encoder = CLIPEncoder(t, c)
        self.final_layer_norm = c.layer_norm(t["hidden_size"], t["layer_norm_eps"])

    def __call__(self, ids):
        x = self.embeddings(ids)
        causal = jnp.tril(jnp.ones((ids.shape[1], ids.shape[1]), bool))[None, None]
        for layer in self.encoder.layers:
            x = layer(x, causal)
        return self.final_layer_norm(x).astype(x.dtype)


class CLIPTextModel(nnx.Module):
    def __init__(self, t: dict, c: _Ctx):
        self.text_model = CLIPTextTransformer(t, c)


# -- UNet (diffusers' UNet2DConditionModel, SD1.5's defaults) ----------------------------------------
class Attention(nnx.Module):
    """Self- (``context`` None) or cross-attention: q/k/v without bias, ``to_out.0`` with."""

    def __init__(self, c: _Ctx, n: int, heads: int, context_dim: int | None = None):
        kv = context_dim or n
        self.to_q, self.to_k, self.to_v = c.linear(n, n, bias=False), c.linear(kv, n, bias=False), \
            c.linear(kv, n, bias=False)
        self.to_out = nnx.List([c.linear(n, n), Empty()])
        self.heads, self.dtype = heads, c.dtype

    def __call__(self, x, context=None):
        context = x if context is None else context
        b, s, n = x.shape
        split = lambda t: t.reshape(b, t.shape[1], self.heads, n // self.heads)  # noqa: E731
        out = _attention(split(self.to_q(x)), split(self.to_k(context)), split(self.to_v(context)), None,
                         self.dtype or x.dtype)
        return self.to_out[0](out.reshape(b, s, n))


class GEGLU(nnx.Module):
    def __init__(self, c: _Ctx, n: int, inner: int):
        self.proj = c.linear(n, 2 * inner)

    def __call__(self, x):
        hidden, gate = jnp.split(self.proj(x), 2, axis=-1)
        return hidden * jax.nn.gelu(gate, approximate=False)


class FeedForward(nnx.Module):
    def __init__(self, c: _Ctx, n: int):
        self.net = nnx.List([GEGLU(c, n, 4 * n), Empty(), c.linear(4 * n, n)])

    def __call__(self, x):
        return self.net[2](self.net[0](x))


class BasicTransformerBlock(nnx.Module):
    def __init__(self, c: _Ctx, n: int, heads: int, context_dim: int):
        self.norm1, self.norm2, self.norm3 = (c.layer_norm(n, 1e-5) for _ in range(3))
        self.attn1, self.attn2 = Attention(c, n, heads), Attention(c, n, heads, context_dim)
        self.ff = FeedForward(c, n)

    def __call__(self, x, context):
        x = x + self.attn1(norm32(self.norm1, x))
        x = x + self.attn2(norm32(self.norm2, x), context)
        return x + self.ff(norm32(self.norm3, x))


class Transformer2DModel(nnx.Module):
    """Group norm, 1x1 ``proj_in`` (use_linear_projection False), the blocks over H*W tokens, ``proj_out``."""

    def __init__(self, c: _Ctx, n: int, heads: int, groups: int, context_dim: int):
        self.norm = group_norm(c, groups, n, 1e-6)
        self.proj_in = conv(c, n, n, k=1, padding="VALID")
        self.transformer_blocks = nnx.List([BasicTransformerBlock(c, n, heads, context_dim)])
        self.proj_out = conv(c, n, n, k=1, padding="VALID")

    def __call__(self, x, context):
        b, hh, ww, n = x.shape
        h = self.proj_in(norm32(self.norm, x)).reshape(b, hh * ww, n)
        for block in self.transformer_blocks:
            h = block(h, context)
        return self.proj_out(h.reshape(b, hh, ww, n)) + x


def _checkpointed(module, policy, *args):
    """``module(*args)``, under ``nnx.remat`` with ``policy`` when recompute is on (diffusers checkpoints
    each ResNet and each transformer block)."""
    if policy is None:
        return module(*args)
    return nnx.remat(lambda m, *a: m(*a), policy=policy)(module, *args)


class UNetBlock(nnx.Module):
    """One down, mid or up block: ``resnets``, ``attentions`` where cross-attention, a sampler."""

    def __init__(self, c: _Ctx, ins: list[int], n_out: int, attn: bool, u: dict, temb: int,
                 down: bool | None = None, mid: bool = False):
        g, heads, ctx = u["norm_num_groups"], u["attention_head_dim"], u["cross_attention_dim"]
        self.resnets = nnx.List([ResnetBlock2D(c, n_in, n_out, g, 1e-5, temb) for n_in in ins])
        if attn:
            self.attentions = nnx.List([Transformer2DModel(c, n_out, heads, g, ctx)
                                        for _ in range(1 if mid else len(ins))])
        if down is True:
            self.downsamplers = nnx.List([Downsample2D(c, n_out, 1)])
        elif down is False:
            self.upsamplers = nnx.List([Upsample2D(c, n_out)])
        self.attn, self.mid, self.policy = attn, mid, None

    def __call__(self, x, temb, context, skips=None):
        """``x`` after this block; a down block also returns each resnet's output (the skips); an up
        block takes its skips from the end of ``skips`` (a list it pops)."""
        if self.mid:
            x = _checkpointed(self.resnets[0], self.policy, x, temb)
            x = _checkpointed(self.attentions[0], self.policy, x, context)
            return _checkpointed(self.resnets[1], self.policy, x, temb)
        outputs = []
        for i, resnet in enumerate(self.resnets):
            if skips is not None:
                x = jnp.concatenate([x, skips.pop()], axis=-1)
            x = _checkpointed(resnet, self.policy, x, temb)
            if self.attn:
                x = _checkpointed(self.attentions[i], self.policy, x, context)
            outputs.append(x)
        if hasattr(self, "downsamplers"):
            x = self.downsamplers[0](x)
            outputs.append(x)
        if hasattr(self, "upsamplers"):
            x = self.upsamplers[0](x)
        return x, outputs


class TimestepEmbedding(nnx.Module):
    def __init__(self, c: _Ctx, n_in: int, n: int):
        self.linear_1, self.linear_2 = c.linear(n_in, n), c.linear(n, n)

    def __call__(self, x):
        return self.linear_2(jax.nn.silu(self.linear_1(x)))


class UNet2DConditionModel(nnx.Module):
    def __init__(self, c: _Ctx, arch: dict):
        u, z = arch["unet"], arch["vae"]["latent_channels"]
        ch, layers, g = u["block_out_channels"], u["layers_per_block"], u["norm_num_groups"]
        temb = 4 * ch[0]
        self.conv_in = conv(c, z, ch[0])
        self.time_embedding = TimestepEmbedding(c, ch[0], temb)
        last = len(ch) - 1
        self.down_blocks = nnx.List([
            UNetBlock(c, [ch[max(i - 1, 0)]] + [ch[i]] * (layers - 1), ch[i], kind.startswith("CrossAttn"), u, temb,
                      down=True if i < last else None)
            for i, kind in enumerate(u["down_block_types"])])
        self.mid_block = UNetBlock(c, [ch[-1], ch[-1]], ch[-1], True, u, temb, mid=True)
        rev = ch[::-1]
        ups = []
        for i, kind in enumerate(u["up_block_types"]):
            prev, out, skip_in = rev[max(i - 1, 0)], rev[i], rev[min(i + 1, last)]
            ins = [(prev if j == 0 else out) + (skip_in if j == layers else out) for j in range(layers + 1)]
            ups.append(UNetBlock(c, ins, out, kind.startswith("CrossAttn"), u, temb, down=False if i < last else None))
        self.up_blocks = nnx.List(ups)
        self.conv_norm_out = group_norm(c, g, ch[0], 1e-5)
        self.conv_out = conv(c, ch[0], z)
        self.time_dim = ch[0]

    def __call__(self, sample, timesteps, context):
        """``sample`` NHWC latents; the predicted noise, NHWC."""
        temb = self.time_embedding(timestep_embedding(timesteps, self.time_dim).astype(sample.dtype))
        x = self.conv_in(sample)
        skips = [x]
        for block in self.down_blocks:
            x, outputs = block(x, temb, context)
            skips.extend(outputs)
        x = self.mid_block(x, temb, context)
        for block in self.up_blocks:
            x, _ = block(x, temb, context, skips)
        return self.conv_out(jax.nn.silu(norm32(self.conv_norm_out, x)))


class StableDiffusion15(nnx.Module):
    def __init__(self, arch: dict, *, dtype=None, param_dtype=jnp.float32, seed: int = 0):
        c = _Ctx(dtype, param_dtype, nnx.Rngs(params=seed))
        self.unet = UNet2DConditionModel(c, arch)
        self.vae = AutoencoderKL(c, arch["vae"])
        self.text_encoder = CLIPTextModel(arch["text"], c)
        self.alphas_cumprod = np.asarray(core.alphas_cumprod(arch["scheduler"]), np.float32)  # static, not a Param
        self.dtype = dtype


def build(arch: dict, *, dtype=None, param_dtype=jnp.float32, seed: int = 0) -> StableDiffusion15:
    return StableDiffusion15(arch, dtype=dtype, param_dtype=param_dtype, seed=seed)


def loss_fn(model: StableDiffusion15, batch: dict):
    compute = model.dtype or jnp.float32
    latents = model.vae.latents(nhwc(batch["pixel_values"]).astype(compute))
    text = jax.lax.stop_gradient(model.text_encoder.text_model(batch["input_ids"]))
    noise, timesteps = nhwc(batch["noise"]), batch["timesteps"]
    alpha = jnp.asarray(model.alphas_cumprod)[timesteps][:, None, None, None]
    noisy = jnp.sqrt(alpha) * latents + jnp.sqrt(1.0 - alpha) * noise
    pred = model.unet(noisy.astype(compute), timesteps, text)
    return jnp.mean((pred.astype(jnp.float32) - noise.astype(jnp.float32)) ** 2)


def enable_recompute(model: StableDiffusion15, policy) -> None:
    """Each ResNet and transformer block of the UNet under ``nnx.remat`` with ``policy`` (diffusers'
    ``enable_gradient_checkpointing`` checkpoints the same units)."""
    for block in [*model.unet.down_blocks, model.unet.mid_block, *model.unet.up_blocks]:
        block.policy = policy
