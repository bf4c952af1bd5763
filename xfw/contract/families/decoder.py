"""The pieces LLaVA and Qwen2-VL share: a Llama/Qwen2 decoder behind a ViT, as plain arithmetic.

Both families' language models are the same decoder layer (RMSNorm, GQA attention, SwiGLU MLP),
so its linear shapes, forward FLOPs and stored activations are written once, here::

    >>> decoder_linear_shapes({"hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2})
    {'q_proj': (64, 64), 'k_proj': (64, 32), 'v_proj': (64, 32), 'o_proj': (64, 64), 'gate_proj': (64, 128), 'up_proj': (64, 128), 'down_proj': (128, 64)}

FLOPs are model FLOPs under the conventions of ``xfw.report.mfu``'s docstring (matmuls only,
PaLM's accounting); :func:`train_multiplier` is its rule for what a training step costs a part.

Activations of one decoder layer, in bytes for 16-bit activations (x2 for fp32), follow the
per-tensor accounting of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Sec. 4.1 (their Eq. 1 gives 34sbh + 5as^2b for a GPT layer), redone for
this layer (RMSNorm, GQA, SwiGLU, no dropout) with fused SDPA attention, which keeps no s x s
score matrix (so no 5as^2b term)::

    per layer = 4sbh (2 norm inputs) + 2sbh (q/k/v input) + 2sbh + 4sb·kv (q, k, v)
              + 2sbh (o_proj input) + 2sbh (MLP input) + 8sbf (gate, up, silu(gate), product)
              = 12sbh + 4sb·kv + 8sbf
    full recompute: 2sbh per layer (its input) + one layer's full activations while it is recomputed
    loss: 4sbV (fp32 log-probabilities kept for backward) + 6sbV transient (the logits and their fp32 copy)

s = sequence length (image tokens included), b = micro-batch, h = hidden size, f = MLP size,
kv = key/value width, V = vocabulary. The frozen vision tower runs without gradients and keeps
no activations; projector and LoRA intermediates are ignored (small).
"""

from __future__ import annotations

# Module names stage lora may target in the decoder (every linear of a layer).
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def decoder_linear_shapes(text: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear in a Llama/Qwen2 decoder layer, by module name."""
    h, f = text["hidden_size"], text["intermediate_size"]
    kv = h // text["num_heads"] * text["num_kv_heads"]
    return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}


def decoder_lora_linears(text: dict) -> dict[str, list[tuple[int, int]]]:
    """Every linear a LoRA target name matches in the decoder: one per layer."""
    return {name: [shape] * text["num_layers"] for name, shape in decoder_linear_shapes(text).items()}


def train_multiplier(trained: bool, upstream_trains: bool) -> int:
    """Forwards' worth of FLOPs a training step costs a part: 3 if it trains (forward, activation
    and weight gradients), 2 if frozen but gradients cross it to a trained part upstream, else 1."""
    return 3 if trained else 2 if upstream_trains else 1


def decoder_forward_flops(text: dict, seq_len: int, with_head: bool = True) -> float:
    h, f, layers = text["hidden_size"], text["intermediate_size"], text["num_layers"]
    kv = h // text["num_heads"] * text["num_kv_heads"]
    linear = 2 * seq_len * (2 * h * h + 2 * h * kv + 3 * h * f)
    attention = 2 * 2 * seq_len * seq_len * h
    head = 2 * seq_len * h * text["vocab_size"] if with_head else 0
    return layers * (linear + attention) + head


def vit_forward_flops(num_tokens: int, hidden: int, mlp: int, layers: int) -> float:
    return layers * (2 * num_tokens * (4 * hidden * hidden + 2 * hidden * mlp) + 2 * 2 * num_tokens ** 2 * hidden)


def decoder_activation_bytes(text: dict, seq_len: int, micro: int, *, dtype: str, recompute: bool) -> float:
    """Stored activations of the decoder and its loss at the peak, for one micro-batch (module docstring)."""
    s, b = seq_len, micro
    h, f = text["hidden_size"], text["intermediate_size"]
    kv = h // text["num_heads"] * text["num_kv_heads"]
    layer, layer_input = 12 * s * b * h + 4 * s * b * kv + 8 * s * b * f, 2 * s * b * h
    layers = text["num_layers"] * (layer_input if recompute else layer) + (layer if recompute else 0)
    loss = 10 * s * b * text["vocab_size"]  # 4sbV kept + 6sbV transient; fp32 whatever the AMP level
    scale = 2 if dtype == "fp32" else 1  # the layer formula counts 16-bit activations
    return scale * layers + loss
