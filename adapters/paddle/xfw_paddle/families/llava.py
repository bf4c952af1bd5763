"""LLaVA in Paddle, composed to be transformers' ``LlavaForConditionalGeneration`` (LLaVA-1.5,
single tile) or ``LlavaNextForConditionalGeneration`` (LLaVA-1.6, AnyRes tiles + image newline).

paddlenlp 3.0.0b4 has no trainable LLaVA, so this module composes one from the neutral
architecture (``xfw.contract.presets``, family ``llava``):

* vision tower: CLIP ViT written here in plain ``paddle.nn`` with transformers' module names.
  paddlenlp's ``CLIPVisionTransformer`` has the same parameter count but is built on
  ``paddle.nn.TransformerEncoder`` (other names, a hard-coded LayerNorm epsilon, hidden states
  only through paddlenlp's global monkey-patches), so it cannot be mapped one-to-one;
* projector: Linear - GELU (exact) - Linear, as ``LlavaMultiModalProjector``;
* language model: paddlenlp's own ``LlamaForCausalLM``;
* AnyRes (LLaVA-1.6): the base tile's features, then the grid tiles' features re-arranged into
  one spatial map, unpadded, whose rows each end with the ``image_newline`` parameter
  (transformers' ``pack_image_features``, "spatial_unpad"). Each image has its own grid (from its
  size), so a micro-batch mixes grids: :func:`host_inputs` turns the batch's ``image_sizes``
  (numpy, before the step) into the indices of the real tiles and of each image token's feature,
  and the step gathers with them, never reading a tensor back to the host.

Checked numerically against transformers (tests/contract/test_paddle_adapter.py): loaded with
the same weights, the two give the same logits and loss (to 1e-5, fp32 on CPU).

Parameter names match transformers' after :func:`hf_name` (Paddle stores Linear weights as
``[in, out]``, transformers as ``[out, in]``)::

    >>> model = build(arch, use_sdpa=True, recompute=False)
    >>> hf_name("language_model.llama.layers.0.self_attn.q_proj.weight")
    'model.language_model.layers.0.self_attn.q_proj.weight'
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from xfw.contract.families import llava as llava_facts
from xfw.contract.harness import Unsupported
from xfw.contract.synthetic import IGNORE_INDEX
from xfw_paddle import nlp


def _normal(std: float) -> paddle.ParamAttr:
    return paddle.ParamAttr(initializer=nn.initializer.Normal(0.0, std))


_ZEROS = paddle.ParamAttr(initializer=nn.initializer.Constant(0.0))


def _linear(d_in: int, d_out: int, std: float) -> nn.Linear:
    return nn.Linear(d_in, d_out, weight_attr=_normal(std), bias_attr=_ZEROS)


def quick_gelu(x: paddle.Tensor) -> paddle.Tensor:
    return x * F.sigmoid(1.702 * x)  # CLIP's activation (transformers' QuickGELUActivation)


_VISION_ACTS = {"quick_gelu": quick_gelu, "gelu": F.gelu}


# -- CLIP vision tower (transformers' modeling_clip, vision half) --------------------------------
# Initialisation follows CLIPPreTrainedModel._init_weights with factor 1 and initializer_range 0.02.

class CLIPVisionEmbeddings(nn.Layer):
    def __init__(self, v: dict):
        super().__init__()
        h, p = v["hidden_size"], v["patch_size"]
        self.class_embedding = self.create_parameter([h], attr=_normal(h ** -0.5))
        self.patch_embedding = nn.Conv2D(3, h, kernel_size=p, stride=p, weight_attr=_normal(0.02), bias_attr=False)
        num_positions = (v["image_size"] // p) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, h, weight_attr=_normal(0.02))

    def forward(self, pixel_values: paddle.Tensor) -> paddle.Tensor:
        patches = self.patch_embedding(pixel_values.astype(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose([0, 2, 1])  # [b, h, g, g] -> [b, g*g, h]
        cls = self.class_embedding.astype(patches.dtype).reshape([1, 1, -1]).expand([patches.shape[0], 1, -1])
        return paddle.concat([cls, patches], axis=1) + self.position_embedding.weight.astype(patches.dtype)


class CLIPAttention(nn.Layer):
    def __init__(self, v: dict, use_sdpa: bool):
        super().__init__()
        h, self.num_heads, self.use_sdpa = v["hidden_size"], v["num_heads"], use_sdpa
        in_std = h ** -0.5 * (2 * v["num_layers"]) ** -0.5
        self.k_proj, self.v_proj, self.q_proj = (_linear(h, h, in_std) for _ in range(3))
        self.out_proj = _linear(h, h, h ** -0.5)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        b, s, h = x.shape
        q, k, v = (proj(x).reshape([b, s, self.num_heads, h // self.num_heads])
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.use_sdpa:  # Paddle's dispatcher: flash / memory-efficient on GPU, math on CPU
            out = F.scaled_dot_product_attention(q, k, v, is_causal=False, training=self.training)
        else:
            q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))
            scores = paddle.matmul(q * (h // self.num_heads) ** -0.5, k, transpose_y=True)
            out = paddle.matmul(F.softmax(scores.astype("float32"), axis=-1).astype(q.dtype), v)
            out = out.transpose([0, 2, 1, 3])
        return self.out_proj(out.reshape([b, s, h]))


class CLIPMLP(nn.Layer):
    def __init__(self, v: dict):
        super().__init__()
        h, f = v["hidden_size"], v["intermediate_size"]
        self.act = _VISION_ACTS[v["hidden_act"]]
        self.fc1 = _linear(h, f, (2 * h) ** -0.5)
        self.fc2 = _linear(f, h, h ** -0.5 * (2 * v["num_layers"]) ** -0.5)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Layer):
    def __init__(self, v: dict, use_sdpa: bool):
        super().__init__()
        h, eps = v["hidden_size"], v["layer_norm_eps"]
        self.self_attn = CLIPAttention(v, use_sdpa)
        self.layer_norm1 = nn.LayerNorm(h, epsilon=eps)
        self.mlp = CLIPMLP(v)
        self.layer_norm2 = nn.LayerNorm(h, epsilon=eps)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Layer):
    def __init__(self, v: dict, use_sdpa: bool):
        super().__init__()
        self.layers = nn.LayerList([CLIPEncoderLayer(v, use_sdpa) for _ in range(v["num_layers"])])


class CLIPVisionTransformer(nn.Layer):
    def __init__(self, v: dict, use_sdpa: bool):
        super().__init__()
        h, eps = v["hidden_size"], v["layer_norm_eps"]
        self.embeddings = CLIPVisionEmbeddings(v)
        self.pre_layrnorm = nn.LayerNorm(h, epsilon=eps)  # sic: transformers' spelling
        self.encoder = CLIPEncoder(v, use_sdpa)
        self.post_layernorm = nn.LayerNorm(h, epsilon=eps)

    def forward(self, pixel_values: paddle.Tensor) -> tuple[paddle.Tensor, list[paddle.Tensor]]:
        """(pooled output, hidden states); hidden_states[0] is the embeddings after
        pre_layrnorm and hidden_states[i] the output of layer i, as in transformers."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        hidden_states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            hidden_states.append(x)
        return self.post_layernorm(x[:, 0]), hidden_states


class CLIPVisionModel(nn.Layer):
    def __init__(self, v: dict, use_sdpa: bool):
        super().__init__()
        self.vision_model = CLIPVisionTransformer(v, use_sdpa)

    def forward(self, pixel_values: paddle.Tensor):
        return self.vision_model(pixel_values)


# -- projector and the whole model --------------------------------------------------------------

class LlavaMultiModalProjector(nn.Layer):
    def __init__(self, vision_hidden: int, text_hidden: int, hidden_act: str):
        super().__init__()
        if hidden_act != "gelu":
            raise Unsupported(f"projector hidden_act {hidden_act!r}: only 'gelu' is built")
        self.linear_1 = _linear(vision_hidden, text_hidden, 0.02)
        self.linear_2 = _linear(text_hidden, text_hidden, 0.02)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x), approximate=False))


def _llama_config(t: dict, seq_len: int, *, use_sdpa: bool, recompute: bool):
    LlamaConfig = nlp.load("paddlenlp.transformers.llama.configuration").LlamaConfig

    return LlamaConfig(
        vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
        num_hidden_layers=t["num_layers"], num_attention_heads=t["num_heads"],
        num_key_value_heads=t["num_kv_heads"], rms_norm_eps=t["rms_norm_eps"], rope_theta=t["rope_theta"],
        max_position_embeddings=t["max_position_embeddings"], seq_length=seq_len,
        tie_word_embeddings=t["tie_word_embeddings"], use_cache=False,
        # paddlenlp's "flash attention" path is F.scaled_dot_product_attention (flash kernel on
        # GPU, math on CPU): the counterpart of transformers' default attn_implementation="sdpa".
        use_flash_attention=use_sdpa,
        # Separate q/k/v and gate/up projections, as transformers' Llama (names map one-to-one).
        fuse_attention_qkv=False, fuse_attention_ffn=False,
        recompute=recompute, recompute_granularity="full", recompute_use_reentrant=False,
    )


class LlavaForConditionalGeneration(nn.Layer):
    def __init__(self, arch: dict, *, use_sdpa: bool, recompute: bool):
        super().__init__()
        LlamaForCausalLM = nlp.load("paddlenlp.transformers.llama.modeling").LlamaForCausalLM

        v, t = arch["vision"], arch["text"]
        # transformers' hidden_states has num_layers + 1 entries; a negative feature_layer counts from the end.
        self.feature_index = v["num_layers"] + 1 + v["feature_layer"]
        self.drop_cls, self.image_token_id = v["drop_cls"], arch["image_token_id"]
        self.image_size = v["image_size"]  # one tile's side: the zero image of a text-only micro-batch
        self.vision_tower = CLIPVisionModel(v, use_sdpa)
        self.multi_modal_projector = LlavaMultiModalProjector(v["hidden_size"], t["hidden_size"],
                                                              arch["projector"]["hidden_act"])
        self.language_model = LlamaForCausalLM(
            _llama_config(t, arch["data"]["seq_len"], use_sdpa=use_sdpa, recompute=recompute))
        # paddlenlp leaves recompute off until its Trainer turns it on; "full" = per decoder layer.
        self.language_model.llama.enable_recompute = recompute
        self.anyres = bool(arch.get("anyres"))
        if self.anyres:
            if not arch["anyres"]["image_newline"]:
                raise Unsupported("LLaVA-NeXT without the image-newline parameter")
            if not v["drop_cls"]:  # transformers' "full" strategy cannot tile either (views fail)
                raise Unsupported("AnyRes with the CLS token kept (vision.drop_cls = false)")
            # transformers: randn(hidden) / sqrt(hidden), the embedding scale of the text model.
            self.image_newline = self.create_parameter([t["hidden_size"]], attr=_normal(t["hidden_size"] ** -0.5))

    @property
    def recompute_enabled(self) -> bool:
        return bool(self.language_model.llama.enable_recompute)

    def image_features(self, pixel_values: paddle.Tensor, anyres_tiles=None, anyres_features=None) -> paddle.Tensor:
        """Projected image features in sequence order, ``[image tokens, text hidden]``. With AnyRes,
        ``pixel_values`` is ``[images, max tiles, 3, S, S]`` (zero-padded), ``anyres_tiles`` the real
        tiles' places in it and ``anyres_features`` each image token's row of the tiles' features
        (the last row being ``image_newline``), both from :func:`host_inputs`."""
        if self.anyres:  # every real tile through the tower in one pass
            pixel_values = paddle.gather(pixel_values.reshape([-1, *pixel_values.shape[2:]]), anyres_tiles)
        # Like transformers, the whole tower runs (last layer and post_layernorm included) and
        # one layer's hidden states are taken: the same work on both sides.
        _, hidden_states = self.vision_tower(pixel_values)
        selected = hidden_states[self.feature_index]
        features = self.multi_modal_projector(selected[:, 1:] if self.drop_cls else selected)
        features = features.reshape([-1, features.shape[-1]])
        if not self.anyres:
            return features
        newline = self.image_newline.astype(features.dtype).reshape([1, -1])
        return paddle.gather(paddle.concat([features, newline], axis=0), anyres_features)

    def forward(self, pixel_values, input_ids, attention_mask, image_sizes=None, anyres_tiles=None,
                anyres_features=None) -> paddle.Tensor:
        """Logits ``[batch, seq, vocab]``; a micro-batch without images (text-only samples) runs a zero
        image through the tower first and adds 0 x its features (:meth:`idle_vision`)."""
        embeds = self.language_model.llama.embed_tokens(input_ids)
        idle = None
        if pixel_values is not None and pixel_values.shape[0] > 0:
            features = self.image_features(pixel_values, anyres_tiles, anyres_features)
            embeds = scatter_image_features(embeds, input_ids == self.image_token_id, features)
        else:
            idle = self.idle_vision()
        out = self.language_model(inputs_embeds=embeds, attention_mask=attention_mask, use_cache=False,
                                  return_dict=False)
        logits = out[0] if isinstance(out, (tuple, list)) else out
        return logits if idle is None else logits + idle.astype(logits.dtype)

    def idle_vision(self) -> paddle.Tensor:
        """0 x the sum of a zero image's features (tower, projector, AnyRes's image_newline), as LLaVA's
        trainer does for text-only samples and as the PyTorch adapter does (``xfw_torch.families.llava.
        idle_vision``): every rank of DataParallel or sharding then reduces the same gradients in the same
        order (without it a rank with a text-only micro-batch skipped the tower, and stage 2 summed
        mismatched gradients: found by xfw converge)."""
        _, hidden_states = self.vision_tower(paddle.zeros([1, 3, self.image_size, self.image_size], dtype="float32"))
        selected = hidden_states[self.feature_index]
        idle = self.multi_modal_projector(selected[:, 1:] if self.drop_cls else selected).astype("float32").sum()
        if self.anyres:
            idle = idle + self.image_newline.astype("float32").sum()
        return idle * 0.0


def scatter_image_features(embeds: paddle.Tensor, is_image: paddle.Tensor, features: paddle.Tensor) -> paddle.Tensor:
    """Token embeddings ``[b, s, h]`` with the image-token positions replaced, in order, by the
    image features: ``masked_scatter`` in transformers. Row-wise cumsum + gather + where keeps
    it free of host syncs (paddle.masked_scatter checks sizes on the host)."""
    b, s, h = embeds.shape
    is_image = is_image.reshape([-1])
    order = paddle.clip(paddle.cumsum(is_image.astype("int64")) - 1, min=0)
    image_rows = paddle.gather(features.reshape([-1, h]).astype(embeds.dtype), order)
    return paddle.where(is_image.unsqueeze(-1), image_rows, embeds.reshape([-1, h])).reshape([b, s, h])


def causal_lm_loss(logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
    """transformers' ForCausalLMLoss: logits[:, :-1] predict labels[:, 1:], in fp32, mean over
    the tokens whose label is not IGNORE_INDEX. The mean is taken here because Paddle's
    ``reduction="mean"`` divides by all tokens, ignored ones included (measured, 3.3.1)."""
    vocab = logits.shape[-1]
    shift_logits = logits[:, :-1].astype("float32").reshape([-1, vocab])
    shift_labels = labels[:, 1:].reshape([-1])
    per_token = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="none")
    return per_token.sum() / (shift_labels != IGNORE_INDEX).astype("float32").sum()


def loss_fn(model: LlavaForConditionalGeneration, batch: dict, autocast) -> paddle.Tensor:
    """The training loss of one micro-batch: forward under ``autocast()``, the loss in fp32 outside it."""
    with autocast():
        logits = model(batch["pixel_values"], batch["input_ids"], batch["attention_mask"],
                       anyres_tiles=batch.get("anyres_tiles"), anyres_features=batch.get("anyres_features"))
    return causal_lm_loss(logits, batch["labels"])


HOST_KEYS = ("anyres_tiles", "anyres_features")


def host_inputs(arch: dict, batch: dict) -> dict:
    """From a batch's numpy arrays, before the step: with AnyRes, which tiles of the zero-padded
    ``pixel_values`` are real (``anyres_tiles``, flat indices) and, for each image token in order,
    the row of the real tiles' stacked features it takes (``anyres_features``; the row after the
    last tile's is ``image_newline``): base tile, then the unpadded grid row by row, each row
    closed by the newline (``xfw.contract.families.llava.anyres_layout``, transformers'
    ``pack_image_features``)."""
    if not arch.get("anyres"):
        return {}
    v = arch["vision"]
    g = v["image_size"] // v["patch_size"]
    per_tile = g * g
    max_tiles = batch["pixel_values"].shape[1] if batch["pixel_values"].ndim == 5 else 1
    tiles, rows, first = [], [], 0
    for j, (height, width) in enumerate(np.asarray(batch.get("image_sizes", np.zeros((0, 2))), np.int64)):
        layout = llava_facts.anyres_layout(arch, (int(height), int(width)))
        tiles.append(np.arange(layout["tiles"]) + j * max_tiles)
        (r0, r1), (c0, c1) = layout["keep_rows"], layout["keep_cols"]
        y, x = np.meshgrid(np.arange(r0, r1), np.arange(c0, c1), indexing="ij")
        grid = first + (1 + (y // g) * layout["cols"] + x // g) * per_tile + (y % g) * g + (x % g)
        newline = np.full((r1 - r0, 1), -1, np.int64)
        rows += [np.arange(per_tile) + first, np.concatenate([grid, newline], axis=1).ravel()]
        first += layout["tiles"] * per_tile
    features = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
    features[features < 0] = first  # image_newline: the row after every tile's features
    return {"anyres_tiles": np.concatenate(tiles).astype(np.int64) if tiles else np.zeros(0, np.int64),
            "anyres_features": features}


def build(arch: dict, *, use_sdpa: bool, recompute: bool) -> LlavaForConditionalGeneration:
    if arch["vision"]["hidden_act"] not in _VISION_ACTS:
        raise Unsupported(f"vision hidden_act {arch['vision']['hidden_act']!r} is not built")
    return LlavaForConditionalGeneration(arch, use_sdpa=use_sdpa, recompute=recompute)


_HF_PREFIXES = (
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
    ("language_model.llama.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("image_newline", "model.image_newline"),
)


def hf_name(name: str) -> str:
    """The transformers parameter name for one of this model's parameter names."""
    for ours, theirs in _HF_PREFIXES:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    raise KeyError(name)


def _is_linear_weight(name: str, shape: list[int]) -> bool:
    return name.endswith((".weight", ".lora_A", ".lora_B")) and len(shape) == 2 and "embed" not in name


def canonical_names(model: nn.Layer, name_map=hf_name) -> dict[str, tuple[str, bool]]:
    """``{our name: (transformers' name, transposed?)}`` for every parameter: the map a neutral
    weight file (xfw.contract.weights) is read and written through."""
    return {n: (name_map(n), _is_linear_weight(n, p.shape)) for n, p in model.named_parameters()}
