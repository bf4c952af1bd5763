"""LLaVA-1.5 (CLIP ViT vision tower + 2-layer projector + Llama) in Flax NNX, from the neutral architecture.

The module tree mirrors transformers' ``LlavaForConditionalGeneration`` attribute for attribute, so a
parameter's NNX path is its canonical name (``xfw_jax.names``: ``kernel``/``embedding``/``scale`` are
``weight``, a linear's kernel transposed) and the same safetensors start loads into both. What it
computes is what the PyTorch adapter's model computes: the vision tower's ``feature_layer`` hidden
state with the CLS token dropped, a GELU projector, the projected features put in place of the image
tokens in order, a Llama decoder (RMSNorm in fp32, rotary embeddings, causal + padding mask), and the
causal-LM loss over the shifted labels, averaged over the tokens that are not ``-100``. AnyRes (LLaVA-1.6)
is not ported: :func:`build` says so.

``dtype``: the compute dtype (Flax's ``dtype``); ``param_dtype``: the parameters' (``param_dtype``).
Normalisations, softmax, rotary tables and the loss are computed in fp32, as transformers does.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from xfw.contract.harness import Unsupported

IGNORE_INDEX = -100
INIT = nnx.initializers.normal(0.02)  # transformers' initializer_range for Llama and the projector


def _act(name: str):
    if name == "quick_gelu":
        return lambda x: x * jax.nn.sigmoid(1.702 * x)
    if name == "gelu":
        return lambda x: jax.nn.gelu(x, approximate=False)
    if name in ("silu", "swish"):
        return jax.nn.silu
    raise Unsupported(f"activation {name!r} is not ported to the JAX adapter")


class _Ctx:
    """The settings every layer is built with."""

    def __init__(self, dtype, param_dtype, rngs: nnx.Rngs):
        self.dtype, self.param_dtype, self.rngs = dtype, param_dtype, rngs

    def linear(self, n_in: int, n_out: int, bias: bool = True) -> nnx.Linear:
        return nnx.Linear(n_in, n_out, use_bias=bias, dtype=self.dtype, param_dtype=self.param_dtype,
                          kernel_init=INIT, rngs=self.rngs)

    def layer_norm(self, n: int, eps: float) -> nnx.LayerNorm:
        # use_fast_variance=False: E[(x - mean)^2], as torch's layer_norm computes it
        return nnx.LayerNorm(n, epsilon=eps, dtype=jnp.float32, param_dtype=self.param_dtype,
                             use_fast_variance=False, rngs=self.rngs)


def _attention(q, k, v, mask, dtype):
    """Scaled dot-product attention; q/k/v [B, S, heads, d]; ``mask`` [B, 1, S, S] (True: attend) or None.
    Scores and softmax in fp32."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


# -- vision tower (transformers' CLIPVisionModel) ----------------------------------------------------
class CLIPAttention(nnx.Module):
    def __init__(self, v: dict, c: _Ctx):
        h = v["hidden_size"]
        self.heads = v["num_heads"]
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (c.linear(h, h) for _ in range(4))
        self.dtype = c.dtype

    def __call__(self, x, mask=None):  # mask [B or 1, 1, S, S], True: attend (the text encoder's causal mask)
        b, s, h = x.shape
        split = lambda t: t.reshape(b, s, self.heads, h // self.heads)  # noqa: E731
        out = _attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)), mask,
                         self.dtype or x.dtype)
        return self.out_proj(out.reshape(b, s, h))


class CLIPMLP(nnx.Module):
    def __init__(self, v: dict, c: _Ctx):
        self.fc1 = c.linear(v["hidden_size"], v["intermediate_size"])
        self.fc2 = c.linear(v["intermediate_size"], v["hidden_size"])
        self.act = _act(v["hidden_act"])

    def __call__(self, x):
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nnx.Module):
    def __init__(self, v: dict, c: _Ctx):
        self.self_attn = CLIPAttention(v, c)
        self.layer_norm1 = c.layer_norm(v["hidden_size"], v["layer_norm_eps"])
        self.mlp = CLIPMLP(v, c)
        self.layer_norm2 = c.layer_norm(v["hidden_size"], v["layer_norm_eps"])

    def __call__(self, x, mask=None):
        x = x + self.self_attn(self.layer_norm1(x).astype(x.dtype), mask)
        return x + self.mlp(self.layer_norm2(x).astype(x.dtype))


class CLIPEncoder(nnx.Module):
    def __init__(self, v: dict, c: _Ctx):
        self.layers = nnx.List([CLIPEncoderLayer(v, c) for _ in range(v["num_layers"])])


class CLIPEmbeddings(nnx.Module):
    def __init__(self, v: dict, c: _Ctx):
        h, p = v["hidden_size"], v["patch_size"]
        self.class_embedding = nnx.Param(INIT(c.rngs.params(), (h,), c.param_dtype))
        self.patch_embedding = nnx.Conv(3, h, kernel_size=(p, p), strides=(p, p), padding="VALID", use_bias=False,
                                        dtype=c.dtype, param_dtype=c.param_dtype, kernel_init=INIT, rngs=c.rngs)
        positions = (v["image_size"] // p) ** 2 + 1
        self.position_embedding = nnx.Embed(positions, h, dtype=c.dtype, param_dtype=c.param_dtype,
                                            embedding_init=INIT, rngs=c.rngs)

    def __call__(self, pixels):  # [B, 3, H, W], as the data hands them over
        patches = self.patch_embedding(jnp.transpose(pixels, (0, 2, 3, 1)))  # NHWC -> [B, g, g, h]
        b, gh, gw, h = patches.shape
        patches = patches.reshape(b, gh * gw, h)
        cls = jnp.broadcast_to(self.class_embedding[...].astype(patches.dtype), (b, 1, h))
        x = jnp.concatenate([cls, patches], axis=1)
        return x + self.position_embedding(jnp.arange(x.shape[1]))


class CLIPVisionTransformer(nnx.Module):
    def __init__(self, v: dict, c: _Ctx):
        self.embeddings = CLIPEmbeddings(v, c)
        self.pre_layrnorm = c.layer_norm(v["hidden_size"], v["layer_norm_eps"])  # transformers' spelling
        self.encoder = CLIPEncoder(v, c)
        self.post_layernorm = c.layer_norm(v["hidden_size"], v["layer_norm_eps"])  # counted, unused by LLaVA

    def feature(self, pixels, layer: int):
        """The hidden state ``layer`` (negative: from the end; the embeddings' output is state 0)."""
        x = self.embeddings(pixels)
        x = self.pre_layrnorm(x).astype(x.dtype)
        states = [x]
        for block in self.encoder.layers:
            x = block(x)
            states.append(x)
        return states[layer]


class CLIPVisionModel(nnx.Module):
    def __init__(self, v: dict, c: _Ctx):
        self.vision_model = CLIPVisionTransformer(v, c)


class LlavaMultiModalProjector(nnx.Module):
    def __init__(self, arch: dict, c: _Ctx):
        self.linear_1 = c.linear(arch["vision"]["hidden_size"], arch["text"]["hidden_size"])
        self.linear_2 = c.linear(arch["text"]["hidden_size"], arch["text"]["hidden_size"])
        self.act = _act(arch["projector"]["hidden_act"])

    def __call__(self, x):
        return self.linear_2(self.act(self.linear_1(x)))


# -- language model (transformers' LlamaModel) -------------------------------------------------------
class LlamaRMSNorm(nnx.Module):
    def __init__(self, n: int, eps: float, c: _Ctx):
        self.weight = nnx.Param(jnp.ones((n,), c.param_dtype))
        self.eps = eps

    def __call__(self, x):  # normalised in fp32, back to the input's dtype, then scaled (LlamaRMSNorm)
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * h.astype(x.dtype)


def _rope(positions, head_dim: int, theta: float):
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions[:, None].astype(jnp.float32) * inv[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x, cos, sin):  # x [B, S, heads, d]; transformers' rotate_half convention
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos[None, :, None, :] + rotated * sin[None, :, None, :]).astype(x.dtype)


class LlamaAttention(nnx.Module):
    def __init__(self, t: dict, c: _Ctx):
        h = t["hidden_size"]
        self.heads, self.kv_heads = t["num_heads"], t["num_kv_heads"]
        d = h // self.heads
        self.q_proj = c.linear(h, self.heads * d, bias=False)
        self.k_proj = c.linear(h, self.kv_heads * d, bias=False)
        self.v_proj = c.linear(h, self.kv_heads * d, bias=False)
        self.o_proj = c.linear(self.heads * d, h, bias=False)
        self.dtype = c.dtype

    def __call__(self, x, cos, sin, mask):
        b, s, h = x.shape
        d = h // self.heads
        q = _rotate(self.q_proj(x).reshape(b, s, self.heads, d), cos, sin)
        k = _rotate(self.k_proj(x).reshape(b, s, self.kv_heads, d), cos, sin)
        v = self.v_proj(x).reshape(b, s, self.kv_heads, d)
        groups = self.heads // self.kv_heads
        if groups > 1:
            k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        out = _attention(q, k, v, mask, self.dtype or x.dtype)
        return self.o_proj(out.reshape(b, s, self.heads * d))


class LlamaMLP(nnx.Module):
    def __init__(self, t: dict, c: _Ctx):
        h, f = t["hidden_size"], t["intermediate_size"]
        self.gate_proj, self.up_proj = c.linear(h, f, bias=False), c.linear(h, f, bias=False)
        self.down_proj = c.linear(f, h, bias=False)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, t: dict, c: _Ctx):
        self.self_attn = LlamaAttention(t, c)
        self.mlp = LlamaMLP(t, c)
        self.input_layernorm = LlamaRMSNorm(t["hidden_size"], t["rms_norm_eps"], c)
        self.post_attention_layernorm = LlamaRMSNorm(t["hidden_size"], t["rms_norm_eps"], c)

    def __call__(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
    def __init__(self, t: dict, c: _Ctx):
        self.embed_tokens = nnx.Embed(t["vocab_size"], t["hidden_size"], dtype=c.dtype, param_dtype=c.param_dtype,
                                      embedding_init=INIT, rngs=c.rngs)
        self.layers = nnx.List([LlamaDecoderLayer(t, c) for _ in range(t["num_layers"])])
        self.norm = LlamaRMSNorm(t["hidden_size"], t["rms_norm_eps"], c)
        self.head_dim, self.theta = t["hidden_size"] // t["num_heads"], t["rope_theta"]


class LlavaModel(nnx.Module):
    def __init__(self, arch: dict, c: _Ctx):
        self.vision_tower = CLIPVisionModel(arch["vision"], c)
        self.multi_modal_projector = LlavaMultiModalProjector(arch, c)
        self.language_model = LlamaModel(arch["text"], c)


class LlavaForConditionalGeneration(nnx.Module):
    def __init__(self, arch: dict, *, dtype=None, param_dtype=jnp.float32, seed: int = 0):
        c = _Ctx(dtype, param_dtype, nnx.Rngs(params=seed))
        self.model = LlavaModel(arch, c)
        t = arch["text"]
        self.lm_head = c.linear(t["hidden_size"], t["vocab_size"], bias=False)
        v = arch["vision"]
        self.image_token_id, self.feature_layer, self.drop_cls = arch["image_token_id"], v["feature_layer"], v["drop_cls"]
        self.remat, self.remat_policy = False, None  # enable_recompute: each decoder layer under nnx.remat

    def image_features(self, pixels):
        feats = self.model.vision_tower.vision_model.feature(pixels, self.feature_layer)
        if self.drop_cls:
            feats = feats[:, 1:]
        return self.model.multi_modal_projector(feats)

    def __call__(self, input_ids, pixel_values, attention_mask):
        """The logits [B, S, vocab] in fp32."""
        lm = self.model.language_model
        embeds = lm.embed_tokens(input_ids)
        if pixel_values is not None and pixel_values.shape[0]:
            feats = self.image_features(pixel_values).astype(embeds.dtype)
            feats = feats.reshape(-1, feats.shape[-1])
            # masked_scatter: the image features, in order, at the image-token positions
            is_image = (input_ids == self.image_token_id).reshape(-1)
            index = jnp.clip(jnp.cumsum(is_image) - 1, 0, feats.shape[0] - 1)
            flat = jnp.where(is_image[:, None], feats[index], embeds.reshape(-1, embeds.shape[-1]))
            embeds = flat.reshape(embeds.shape)
        seq = input_ids.shape[1]
        cos, sin = _rope(jnp.arange(seq), lm.head_dim, lm.theta)
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        mask = causal[None, None] & (attention_mask[:, None, None, :] > 0)
        x = embeds
        for layer in lm.layers:
            if self.remat:
                x = nnx.remat(lambda blk, *a: blk(*a), policy=self.remat_policy)(layer, x, cos, sin, mask)
            else:
                x = layer(x, cos, sin, mask)
        x = lm.norm(x)
        return self.lm_head(x).astype(jnp.float32)


def build(arch: dict, *, dtype=None, param_dtype=jnp.float32, seed: int = 0) -> LlavaForConditionalGeneration:
    if arch.get("anyres"):
        from xfw_jax.families import NOT_PORTED_VARIANTS

        raise Unsupported(NOT_PORTED_VARIANTS["llava (anyres: LLaVA-NeXT)"])
    if arch["text"]["tie_word_embeddings"]:
        raise Unsupported("tied word embeddings are not ported to the JAX adapter yet")
    return LlavaForConditionalGeneration(arch, dtype=dtype, param_dtype=param_dtype, seed=seed)


def loss_fn(model: LlavaForConditionalGeneration, batch: dict):
    """Causal-LM loss over the tokens whose (shifted) label is not -100, averaged over them (transformers'
    ``ForCausalLMLoss`` with no ``num_items_in_batch``)."""
    logits = model(batch["input_ids"], batch.get("pixel_values"), batch["attention_mask"])
    labels = batch["labels"]
    shifted = jnp.concatenate([labels[:, 1:], jnp.full((labels.shape[0], 1), IGNORE_INDEX, labels.dtype)], axis=1)
    valid = shifted != IGNORE_INDEX
    safe = jnp.where(valid, shifted, 0)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def enable_recompute(model: LlavaForConditionalGeneration, policy) -> None:
    """Each decoder layer under ``nnx.remat`` (``jax.checkpoint``) with ``policy``: what its backward
    recomputes (transformers' per-layer gradient checkpointing is the policy that saves nothing)."""
    model.remat, model.remat_policy = True, policy
