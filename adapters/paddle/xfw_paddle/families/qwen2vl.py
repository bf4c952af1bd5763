"""Qwen2-VL in Paddle, written to be transformers' ``Qwen2VLForConditionalGeneration``.

paddlenlp 3.0.0b4 has Qwen2 but no Qwen2-VL, and its Qwen2 decoder has 1-D RoPE only (no
M-RoPE), so both halves are written here in plain ``paddle.nn`` from the neutral architecture
(``xfw.contract.presets``, family ``qwen2vl``), following transformers 5.2's ``modeling_qwen2_vl``:

* vision: ``PatchEmbed`` (a Conv3D whose kernel is the whole [C, T, P, P] patch, no bias),
  2-D rotary embedding over (row, col) in the merge-window order of the image processor,
  blocks of LayerNorm (eps 1e-6) + attention (fused qkv with bias) + MLP (quick_gelu), each
  image attending only within itself (transformers' ``cu_seqlens``), and ``PatchMerger``
  (LayerNorm, then Linear(4d -> 4d) - GELU - Linear(4d -> out) over 2x2 windows);
* language: the Qwen2 decoder (q/k/v with bias, GQA, RMSNorm, SwiGLU) with M-RoPE driven by
  the batch's ``position_ids`` [3, b, L] and ``mrope_section``; tied embeddings when the
  preset says so (then there is no ``lm_head`` parameter, as in transformers' count).

Each image has its own patch grid: :func:`host_inputs` turns the batch's ``image_grid_thw``
(numpy, before the step) into every patch's rotary (row, col) and each image's patch count, so
the step never reads a tensor back to the host; images of one size attend as one batch, images
of different sizes one by one (attention stays inside each image, as transformers' ``cu_seqlens``).
Padding sits after each sample's last token and attention is causal, so it changes no trained
position. Checked against transformers with the same weights (tests/contract/test_paddle_vlm.py).
Parameter names map one-to-one onto transformers' through :func:`hf_name`::

    >>> hf_name("language_model.layers.0.self_attn.q_proj.bias")
    'model.language_model.layers.0.self_attn.q_proj.bias'
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from xfw.contract.families.qwen2vl import grid
from xfw.contract.harness import Unsupported
from xfw_paddle.families.llava import causal_lm_loss, quick_gelu, scatter_image_features
from xfw_paddle.families.llava import canonical_names as _canonical_names

# transformers' Qwen2VLPreTrainedModel._init_weights: normal(0, initializer_range = 0.02), zero biases.
_W = paddle.ParamAttr(initializer=nn.initializer.Normal(0.0, 0.02))
_ZEROS = paddle.ParamAttr(initializer=nn.initializer.Constant(0.0))
_ONES = paddle.ParamAttr(initializer=nn.initializer.Constant(1.0))
VISION_LN_EPS = 1e-6  # hard-coded in transformers' Qwen2VLVisionBlock and PatchMerger
VISION_ROPE_THETA = 10000.0  # transformers' VisionRotaryEmbedding default


def _fp32():
    """Where transformers computes in fp32 whatever the autocast: Paddle's O2 would otherwise
    run these ops in low precision too (paddlenlp's Qwen2 does the same)."""
    return paddle.amp.auto_cast(False)


def _linear(d_in: int, d_out: int, bias: bool = True) -> nn.Linear:
    return nn.Linear(d_in, d_out, weight_attr=_W, bias_attr=_ZEROS if bias else False)


def _attention(q, k, v, *, causal: bool, use_sdpa: bool, training: bool) -> paddle.Tensor:
    """Softmax attention over ``[b, s, heads, d]`` with scale d^-0.5 (no dropout: both models use 0)."""
    if use_sdpa:  # Paddle's dispatcher: flash / memory-efficient on GPU, math on CPU
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, training=training)
    q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))
    scores = paddle.matmul(q * q.shape[-1] ** -0.5, k, transpose_y=True)
    with _fp32():
        scores = scores.astype("float32")
        if causal:
            s = scores.shape[-1]
            scores = scores + paddle.triu(paddle.full([s, s], float("-inf"), "float32"), diagonal=1)
        weights = F.softmax(scores, axis=-1).astype(q.dtype)
    out = paddle.matmul(weights, v)
    return out.transpose([0, 2, 1, 3])


def rotate_half(x: paddle.Tensor) -> paddle.Tensor:
    x1, x2 = x.chunk(2, axis=-1)
    return paddle.concat([-x2, x1], axis=-1)


# -- vision tower (transformers' Qwen2VisionTransformerPretrainedModel) ---------------------------

def vision_rotary_positions(grids: np.ndarray, merge: int) -> np.ndarray:
    """(row, col) ``[patches, 2]`` of every image's patches in the processor's order (2x2 merge
    windows, row by row, each frame alike): the positions of transformers' ``rot_pos_emb``."""
    out = []
    for t, h, w in np.asarray(grids, np.int64).reshape(-1, 3):
        rows = np.broadcast_to(np.arange(h)[:, None], (h, w)).reshape(h // merge, merge, w // merge, merge)
        cols = np.broadcast_to(np.arange(w)[None, :], (h, w)).reshape(h // merge, merge, w // merge, merge)
        pairs = np.stack([rows.transpose(0, 2, 1, 3).ravel(), cols.transpose(0, 2, 1, 3).ravel()], axis=-1)
        out.append(np.tile(pairs, (t, 1)))
    return np.concatenate(out).astype(np.int64) if out else np.zeros((0, 2), np.int64)


HOST_KEYS = ("vision_positions", "vision_lengths")


def host_inputs(arch: dict, batch: dict) -> dict:
    """From a batch's numpy ``image_grid_thw``, before the step: each patch's rotary (row, col) and
    each image frame's number of patches (a list: the step splits by it without a host read)."""
    grids = np.asarray(batch["image_grid_thw"], np.int64).reshape(-1, 3)
    lengths = [int(h * w) for t, h, w in grids for _ in range(t)]
    return {"vision_positions": vision_rotary_positions(grids, arch["vision"]["spatial_merge_size"]),
            "vision_lengths": lengths}


def inv_freq(theta: float, dim: int) -> paddle.Tensor:
    """RoPE inverse frequencies in fp32, made on the device at each call: a float buffer would
    be cast to bf16 by ``paddle.amp.decorate(level='O2')`` and lose the angles' precision (``full`` and
    ``arange`` are device kernels: no host copy in the step)."""
    with _fp32():
        return 1.0 / paddle.pow(paddle.full([], theta, "float32"), paddle.arange(0, dim, 2, dtype="float32") / dim)


class PatchEmbed(nn.Layer):
    def __init__(self, v: dict):
        super().__init__()
        self.kernel = [v["temporal_patch_size"], v["patch_size"], v["patch_size"]]
        self.embed_dim = v["embed_dim"]
        self.proj = nn.Conv3D(3, v["embed_dim"], self.kernel, stride=self.kernel, weight_attr=_W, bias_attr=False)

    def forward(self, patches: paddle.Tensor) -> paddle.Tensor:
        x = patches.astype(self.proj.weight.dtype).reshape([-1, 3, *self.kernel])
        return self.proj(x).reshape([-1, self.embed_dim])


class VisionAttention(nn.Layer):
    def __init__(self, v: dict, use_sdpa: bool):
        super().__init__()
        d, self.num_heads, self.use_sdpa = v["embed_dim"], v["num_heads"], use_sdpa
        self.qkv = _linear(d, 3 * d)
        self.proj = _linear(d, d)

    def forward(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
        """``x`` [images, patches, d]: attention stays inside each image (``cu_seqlens``)."""
        n, s, d = x.shape
        q, k, v = self.qkv(x).reshape([n, s, 3, self.num_heads, d // self.num_heads]).unbind(axis=2)
        with _fp32():  # transformers' apply_rotary_pos_emb_vision: in fp32, back to the input dtype
            q, k = ((t.astype("float32") * cos + rotate_half(t.astype("float32")) * sin).astype(t.dtype)
                    for t in (q, k))
        out = _attention(q, k, v, causal=False, use_sdpa=self.use_sdpa, training=self.training)
        return self.proj(out.reshape([n, s, d]))


class VisionMlp(nn.Layer):
    def __init__(self, v: dict):
        super().__init__()
        d, hidden = v["embed_dim"], v["embed_dim"] * v["mlp_ratio"]
        self.fc1, self.fc2 = _linear(d, hidden), _linear(hidden, d)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.fc2(quick_gelu(self.fc1(x)))  # Qwen2VLVisionConfig.hidden_act = "quick_gelu"


class Qwen2VLVisionBlock(nn.Layer):
    def __init__(self, v: dict, use_sdpa: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(v["embed_dim"], epsilon=VISION_LN_EPS)
        self.norm2 = nn.LayerNorm(v["embed_dim"], epsilon=VISION_LN_EPS)
        self.attn = VisionAttention(v, use_sdpa)
        self.mlp = VisionMlp(v)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Layer):
    def __init__(self, v: dict):
        super().__init__()
        self.hidden = v["embed_dim"] * v["spatial_merge_size"] ** 2
        self.ln_q = nn.LayerNorm(v["embed_dim"], epsilon=VISION_LN_EPS)
        self.mlp = nn.Sequential(_linear(self.hidden, self.hidden), nn.GELU(), _linear(self.hidden, v["merger_out"]))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.mlp(self.ln_q(x).reshape([-1, self.hidden]))


class Qwen2VisionTransformer(nn.Layer):
    def __init__(self, arch: dict, use_sdpa: bool):
        super().__init__()
        v = arch["vision"]
        self.head_dim = v["embed_dim"] // v["num_heads"]
        self.patch_embed = PatchEmbed(v)
        self.blocks = nn.LayerList([Qwen2VLVisionBlock(v, use_sdpa) for _ in range(v["depth"])])
        self.merger = PatchMerger(v)

    def rotary_cos_sin(self, positions: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos, sin ``[patches, 1, head_dim]``: angles of rows in the first half of each rotary
        half, of columns in the second (VisionRotaryEmbedding(head_dim / 2), theta 1e4)."""
        with _fp32():
            angles = inv_freq(VISION_ROPE_THETA, self.head_dim // 2)
            freqs = positions.astype("float32").unsqueeze(-1) * angles  # [patches, 2, head_dim / 4]
            freqs = freqs.reshape([positions.shape[0], 1, -1])  # [rows' angles, cols' angles]
            emb = paddle.concat([freqs, freqs], axis=-1)
            return paddle.cos(emb), paddle.sin(emb)

    def _blocks(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
        for block in self.blocks:
            x = block(x, cos, sin)
        return x

    def forward(self, patches: paddle.Tensor, positions: paddle.Tensor, lengths: list[int]) -> paddle.Tensor:
        """Flattened patches ``[patches, 3*T*P*P]`` of images with ``lengths`` patches each ->
        merged tokens ``[patches / 4, out]``; attention stays inside each image."""
        x = self.patch_embed(patches)
        cos, sin = self.rotary_cos_sin(positions)
        d = x.shape[-1]
        if len(set(lengths)) == 1:  # images of one size: one batched pass
            n, length = len(lengths), lengths[0]
            x = self._blocks(x.reshape([n, length, d]), cos.reshape([n, length, 1, -1]), sin.reshape([n, length, 1, -1]))
            return self.merger(x.reshape([-1, d]))
        outs, start = [], 0
        for length in lengths:
            piece = slice(start, start + length)
            outs.append(self._blocks(x[piece].unsqueeze(0), cos[piece].unsqueeze(0), sin[piece].unsqueeze(0))[0])
            start += length
        return self.merger(paddle.concat(outs, axis=0))


# -- language model (transformers' Qwen2VLTextModel) ---------------------------------------------

class Qwen2VLRMSNorm(nn.Layer):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = self.create_parameter([hidden], attr=_ONES)
        self.eps = eps

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        with _fp32():
            x32 = x.astype("float32")
            normed = (x32 * paddle.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).astype(x.dtype)
        return self.weight * normed


def mrope_cos_sin(position_ids: paddle.Tensor, inv_freqs: paddle.Tensor, mrope_section: list[int]):
    """cos, sin ``[b, L, 1, head_dim]`` for M-RoPE: angles for the (t, h, w) ids, then each
    channel section takes its own axis (transformers' ``apply_multimodal_rotary_pos_emb``)."""
    with _fp32():
        freqs = position_ids.astype("float32").unsqueeze(-1) * inv_freqs  # [3, b, L, head_dim/2]
        emb = paddle.concat([freqs, freqs], axis=-1)
        chunks = paddle.split(emb, list(mrope_section) * 2, axis=-1)
        emb = paddle.concat([chunk[i % 3] for i, chunk in enumerate(chunks)], axis=-1)  # [b, L, head_dim]
        return paddle.cos(emb).unsqueeze(2), paddle.sin(emb).unsqueeze(2)


class Qwen2VLAttention(nn.Layer):
    def __init__(self, t: dict, use_sdpa: bool):
        super().__init__()
        h = t["hidden_size"]
        self.num_heads, self.num_kv_heads, self.use_sdpa = t["num_heads"], t["num_kv_heads"], use_sdpa
        self.head_dim = h // self.num_heads
        kv = self.head_dim * self.num_kv_heads
        self.q_proj, self.k_proj, self.v_proj = _linear(h, h), _linear(h, kv), _linear(h, kv)
        self.o_proj = _linear(h, h, bias=False)

    def forward(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
        b, s, h = x.shape
        q = self.q_proj(x).reshape([b, s, self.num_heads, self.head_dim])
        k = self.k_proj(x).reshape([b, s, self.num_kv_heads, self.head_dim])
        v = self.v_proj(x).reshape([b, s, self.num_kv_heads, self.head_dim])
        cos, sin = cos.astype(q.dtype), sin.astype(q.dtype)  # transformers casts them to the input dtype
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if self.num_kv_heads != self.num_heads:  # GQA: each kv head serves num_heads / num_kv_heads queries
            k, v = (paddle.repeat_interleave(t, self.num_heads // self.num_kv_heads, axis=2) for t in (k, v))
        out = _attention(q, k, v, causal=True, use_sdpa=self.use_sdpa, training=self.training)
        return self.o_proj(out.reshape([b, s, h]))


class Qwen2MLP(nn.Layer):
    def __init__(self, t: dict):
        super().__init__()
        h, f = t["hidden_size"], t["intermediate_size"]
        self.gate_proj, self.up_proj, self.down_proj = _linear(h, f, False), _linear(h, f, False), _linear(f, h, False)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2VLDecoderLayer(nn.Layer):
    def __init__(self, t: dict, use_sdpa: bool):
        super().__init__()
        self.self_attn = Qwen2VLAttention(t, use_sdpa)
        self.mlp = Qwen2MLP(t)
        self.input_layernorm = Qwen2VLRMSNorm(t["hidden_size"], t["rms_norm_eps"])
        self.post_attention_layernorm = Qwen2VLRMSNorm(t["hidden_size"], t["rms_norm_eps"])

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TiedEmbedding(nn.Embedding):
    """The token embedding that, with tied word embeddings, also gives the logits: ``embed(hidden,
    logits=True)`` is ``hidden @ weight.T`` called through the layer, as PaddleNLP's LM head holds the
    embedding's weight, so stage 3 (``group_sharded_parallel p_g_os``, whose hooks gather a layer's
    parameters around its own calls) gathers the sliced weight for this use too. Read outside a call,
    the weight is a released slice ("Tensor holds no memory")."""

    def forward(self, x, logits: bool = False):
        return paddle.matmul(x, self.weight, transpose_y=True) if logits else super().forward(x)


class Qwen2VLTextModel(nn.Layer):
    def __init__(self, t: dict, *, use_sdpa: bool, recompute: bool):
        super().__init__()
        self.embed_tokens = TiedEmbedding(t["vocab_size"], t["hidden_size"], weight_attr=_W)
        self.layers = nn.LayerList([Qwen2VLDecoderLayer(t, use_sdpa) for _ in range(t["num_layers"])])
        self.norm = Qwen2VLRMSNorm(t["hidden_size"], t["rms_norm_eps"])
        self.mrope_section, self.recompute = list(t["mrope_section"]), recompute
        self.rope_theta, self.head_dim = t["rope_theta"], t["hidden_size"] // t["num_heads"]

    def forward(self, inputs_embeds: paddle.Tensor, position_ids: paddle.Tensor) -> paddle.Tensor:
        cos, sin = mrope_cos_sin(position_ids, inv_freq(self.rope_theta, self.head_dim), self.mrope_section)
        x = inputs_embeds
        for layer in self.layers:
            if self.recompute and self.training:
                from paddle.distributed.fleet.utils import recompute

                x = recompute(layer, x, cos, sin, use_reentrant=False)  # per decoder block
            else:
                x = layer(x, cos, sin)
        return self.norm(x)


# -- the whole model ---------------------------------------------------------------------------

class Qwen2VLForConditionalGeneration(nn.Layer):
    def __init__(self, arch: dict, *, use_sdpa: bool, recompute: bool):
        super().__init__()
        t = arch["text"]
        self.image_token_id, self.tied = arch["image_token_id"], t["tie_word_embeddings"]
        v = arch["vision"]
        # A text-only micro-batch's zero image: one merge x merge grid of patches (one merged token).
        self.merge, self.patch_values = v["spatial_merge_size"], 3 * v["temporal_patch_size"] * v["patch_size"] ** 2
        self.visual = Qwen2VisionTransformer(arch, use_sdpa)
        self.language_model = Qwen2VLTextModel(t, use_sdpa=use_sdpa, recompute=recompute)
        if not self.tied:
            self.lm_head = _linear(t["hidden_size"], t["vocab_size"], bias=False)

    @property
    def recompute_enabled(self) -> bool:
        return self.language_model.recompute

    def forward(self, pixel_values, input_ids, position_ids, vision_positions=None, vision_lengths=()) -> paddle.Tensor:
        """Logits ``[batch, seq, vocab]``; a micro-batch without images runs a zero image through the
        vision tower first and adds 0 x its features (as the LLaVA family does: ``idle_vision`` there)."""
        embed = self.language_model.embed_tokens
        inputs_embeds = embed(input_ids)
        idle = None
        if vision_lengths:
            inputs_embeds = scatter_image_features(inputs_embeds, input_ids == self.image_token_id,
                                                   self.visual(pixel_values, vision_positions, list(vision_lengths)))
        else:
            m = self.merge
            positions = paddle.to_tensor(vision_rotary_positions(np.array([[1, m, m]]), m))
            zeros = paddle.zeros([m * m, self.patch_values], dtype="float32")
            idle = self.visual(zeros, positions, [m * m]).astype("float32").sum() * 0.0
        hidden = self.language_model(inputs_embeds, position_ids)
        logits = embed(hidden, logits=True) if self.tied else self.lm_head(hidden)
        return logits if idle is None else logits + idle.astype(logits.dtype)


def loss_fn(model: Qwen2VLForConditionalGeneration, batch: dict, autocast) -> paddle.Tensor:
    with autocast():
        logits = model(batch["pixel_values"], batch["input_ids"], batch["position_ids"],
                       batch.get("vision_positions"), batch.get("vision_lengths", ()))
    return causal_lm_loss(logits, batch["labels"])


def build(arch: dict, *, use_sdpa: bool, recompute: bool) -> Qwen2VLForConditionalGeneration:
    t = grid(arch)[0]
    if t != 1:
        raise Unsupported(f"Qwen2-VL with {t} temporal patches per image (video) is not built")
    return Qwen2VLForConditionalGeneration(arch, use_sdpa=use_sdpa, recompute=recompute)


def hf_name(name: str) -> str:
    """The transformers parameter name for one of this model's parameter names."""
    if name.startswith(("visual.", "language_model.")):
        return "model." + name
    if name.startswith("lm_head."):
        return name
    raise KeyError(name)


def canonical_names(model: nn.Layer) -> dict[str, tuple[str, bool]]:
    """``{our name: (transformers' name, transposed?)}``, as llava.canonical_names."""
    return _canonical_names(model, hf_name)
