"""diffusers' building blocks in Flax NNX, named as diffusers names them (``xfw_jax.names``): the ResNet
block, the attention the VAE's mid block uses, down/up-sampling, and the ``AutoencoderKL`` both SD
families use (its decoder is built, counted and loaded, never run: training encodes only).

Images are NHWC inside (Flax's convolutions); the data hands them over NCHW and :func:`nhwc` turns them.
Group and layer normalisations are computed in fp32 and cast back to the compute dtype, as torch's
autocast runs them; under fp32 that is the identity.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from xfw_jax.families.llava import _attention, _Ctx

DEFAULT_CONV = nnx.initializers.lecun_normal()


def nhwc(x):
    return jnp.transpose(x, (0, 2, 3, 1))


class Empty(nnx.Module):
    """A list slot with no parameters (diffusers' ``Dropout`` at ``to_out.1`` and ``ff.net.1``)."""

    def __call__(self, x):
        return x


def conv(c: _Ctx, n_in: int, n_out: int, k: int = 3, stride: int = 1, padding=None) -> nnx.Conv:
    pad = ((k // 2, k // 2),) * 2 if padding is None else padding
    return nnx.Conv(n_in, n_out, kernel_size=(k, k), strides=(stride, stride), padding=pad, dtype=c.dtype,
                    param_dtype=c.param_dtype, kernel_init=DEFAULT_CONV, rngs=c.rngs)


def group_norm(c: _Ctx, groups: int, n: int, eps: float) -> nnx.GroupNorm:
    """A bare ``nnx.GroupNorm`` (its ``scale``/``bias`` sit directly under the diffusers name); call with
    :func:`norm32`."""
    return nnx.GroupNorm(n, groups, epsilon=eps, dtype=jnp.float32, param_dtype=c.param_dtype,
                         use_fast_variance=False, rngs=c.rngs)


def norm32(norm, x):
    return norm(x).astype(x.dtype)


class ResnetBlock2D(nnx.Module):
    """diffusers' ResnetBlock2D (time_scale_shift "default", output scale 1)."""

    def __init__(self, c: _Ctx, n_in: int, n_out: int, groups: int, eps: float, temb: int | None):
        self.norm1 = group_norm(c, groups, n_in, eps)
        self.conv1 = conv(c, n_in, n_out)
        if temb is not None:
            self.time_emb_proj = c.linear(temb, n_out)
        self.norm2 = group_norm(c, groups, n_out, eps)
        self.conv2 = conv(c, n_out, n_out)
        if n_in != n_out:
            self.conv_shortcut = conv(c, n_in, n_out, k=1, padding="VALID")
        self.has_temb, self.shortcut = temb is not None, n_in != n_out

    def __call__(self, x, temb=None):
        h = self.conv1(jax.nn.silu(norm32(self.norm1, x)))
        if self.has_temb:
            h = h + self.time_emb_proj(jax.nn.silu(temb))[:, None, None, :]
        h = self.conv2(jax.nn.silu(norm32(self.norm2, h)))
        return (self.conv_shortcut(x) if self.shortcut else x) + h


class Downsample2D(nnx.Module):
    """A stride-2 3x3 convolution; ``padding=0`` is diffusers' asymmetric (0, 1) pad (the VAE's)."""

    def __init__(self, c: _Ctx, n: int, padding: int):
        self.conv = conv(c, n, n, stride=2, padding=((padding, padding),) * 2 if padding else ((0, 1), (0, 1)))

    def __call__(self, x):
        return self.conv(x)


class Upsample2D(nnx.Module):
    """Nearest-neighbour x2, then a 3x3 convolution."""

    def __init__(self, c: _Ctx, n: int):
        self.conv = conv(c, n, n)

    def __call__(self, x):
        return self.conv(jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2))


class VaeAttention(nnx.Module):
    """diffusers' Attention as the VAE's mid block builds it: one head, group norm, biased q/k/v, residual."""

    def __init__(self, c: _Ctx, n: int, groups: int, eps: float):
        self.group_norm = group_norm(c, groups, n, eps)
        self.to_q, self.to_k, self.to_v = c.linear(n, n), c.linear(n, n), c.linear(n, n)
        self.to_out = nnx.List([c.linear(n, n), Empty()])
        self.dtype = c.dtype

    def __call__(self, x):
        b, hh, ww, n = x.shape
        h = norm32(self.group_norm, x).reshape(b, hh * ww, 1, n)
        out = _attention(self.to_q(h), self.to_k(h), self.to_v(h), None, self.dtype or x.dtype)
        return self.to_out[0](out.reshape(b, hh, ww, n)) + x


class UNetMidBlock2D(nnx.Module):
    def __init__(self, c: _Ctx, n: int, groups: int, eps: float):
        self.attentions = nnx.List([VaeAttention(c, n, groups, eps)])
        self.resnets = nnx.List([ResnetBlock2D(c, n, n, groups, eps, None) for _ in range(2)])

    def __call__(self, x):
        x = self.resnets[0](x)
        return self.resnets[1](self.attentions[0](x))


class _CoderBlock(nnx.Module):
    def __init__(self, c: _Ctx, n_in: int, n_out: int, layers: int, groups: int, down: bool | None):
        self.resnets = nnx.List([ResnetBlock2D(c, n_in if i == 0 else n_out, n_out, groups, 1e-6, None)
                                 for i in range(layers)])
        if down is True:
            self.downsamplers = nnx.List([Downsample2D(c, n_out, 0)])
        elif down is False:
            self.upsamplers = nnx.List([Upsample2D(c, n_out)])


class Encoder(nnx.Module):
    def __init__(self, c: _Ctx, vae: dict):
        ch, g, layers = vae["block_out_channels"], vae["norm_num_groups"], vae["layers_per_block"]
        self.conv_in = conv(c, 3, ch[0])
        self.down_blocks = nnx.List([_CoderBlock(c, ch[max(i - 1, 0)], ch[i], layers, g,
                                                 True if i < len(ch) - 1 else None) for i in range(len(ch))])
        self.mid_block = UNetMidBlock2D(c, ch[-1], g, 1e-6)
        self.conv_norm_out = group_norm(c, g, ch[-1], 1e-6)
        self.conv_out = conv(c, ch[-1], 2 * vae["latent_channels"])

    def __call__(self, x):
        x = self.conv_in(x)
        for block in self.down_blocks:
            for resnet in block.resnets:
                x = resnet(x)
            if hasattr(block, "downsamplers"):
                x = block.downsamplers[0](x)
        x = self.mid_block(x)
        return self.conv_out(jax.nn.silu(norm32(self.conv_norm_out, x)))


class Decoder(nnx.Module):
    """Built for its parameters (counted, loaded, exported); training never decodes."""

    def __init__(self, c: _Ctx, vae: dict):
        ch, g, layers = vae["block_out_channels"][::-1], vae["norm_num_groups"], vae["layers_per_block"] + 1
        self.conv_in = conv(c, vae["latent_channels"], ch[0])
        self.mid_block = UNetMidBlock2D(c, ch[0], g, 1e-6)
        self.up_blocks = nnx.List([_CoderBlock(c, ch[max(i - 1, 0)], ch[i], layers, g,
                                               False if i < len(ch) - 1 else None) for i in range(len(ch))])
        self.conv_norm_out = group_norm(c, g, ch[-1], 1e-6)
        self.conv_out = conv(c, ch[-1], 3)


class AutoencoderKL(nnx.Module):
    def __init__(self, c: _Ctx, vae: dict):
        self.encoder, self.decoder = Encoder(c, vae), Decoder(c, vae)
        z = vae["latent_channels"]
        if vae["use_quant_conv"]:
            self.quant_conv = conv(c, 2 * z, 2 * z, k=1, padding="VALID")
            self.post_quant_conv = conv(c, z, z, k=1, padding="VALID")
        self.cfg, self.z = vae, z

    def latents(self, pixels_nhwc):
        """The posterior's mean (``latent_dist.mode()``), shifted and scaled, fp32, gradient stopped."""
        moments = self.encoder(pixels_nhwc)
        if self.cfg["use_quant_conv"]:
            moments = self.quant_conv(moments)
        mean = jax.lax.stop_gradient(moments[..., :self.z].astype(jnp.float32))
        return (mean - (self.cfg["shift_factor"] or 0.0)) * self.cfg["scaling_factor"]


def timestep_embedding(timesteps, dim: int):
    """diffusers' ``get_timestep_embedding`` with SD's flip_sin_to_cos=True, downscale_freq_shift=0."""
    half = dim // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    args = timesteps.astype(jnp.float32)[:, None] * freqs[None, :]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)
