"""The pieces LLaVA and Qwen2-VL share: a Llama/Qwen2 decoder behind a ViT, as plain arithmetic.

Both families' language models are the same decoder layer (RMSNorm, GQA attention, SwiGLU MLP),
so its linear shapes, forward FLOPs and stored activations are written once, here::

    >>> decoder_linear_shapes({"hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2})
    {'q_proj': (64, 64), 'k_proj': (64, 32), 'v_proj': (64, 32), 'o_proj': (64, 64), 'gate_proj': (64, 128), 'up_proj': (64, 128), 'down_proj': (128, 64)}

FLOPs are ledgers of matrix products (:mod:`xfw.contract.families.flops`: its conventions, and
why a product costs 1x, 2x or 3x its forward in a training step): :func:`decoder_ledger` and
:func:`vit_ledger`.

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

from xfw.contract.families.flops import Matmul, adapted, attention, linear, lora_rank

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


def decoder_ledger(text: dict, seq_len: int, *, term: str, trains: bool, grad_in: bool, lora: dict | None,
                   recompute: bool, rope_axes: int = 1) -> list[Matmul]:
    """Every product of the decoder and its LM head for one sample (``flops``' conventions): the
    rotary table (inverse frequencies x positions, one per M-RoPE axis), then per layer q/k/v, the
    attention, o, gate/up and down, each with its LoRA adapters when targeted, then the head over
    every position. ``grad_in``: the embeddings carry a gradient (a trained part feeds them);
    ``trains``: the decoder's own weights train. Recompute reruns each layer a gradient reaches
    (transformers' per-layer checkpointing) up to its down_proj, never the head."""
    s, h, f = seq_len, text["hidden_size"], text["intermediate_size"]
    shapes = decoder_linear_shapes(text)
    head_dim = h // text["num_heads"]
    out = [Matmul(term, 2.0 * rope_axes * (head_dim // 2) * s)]  # no weight, no gradient
    carries = grad_in

    def block(names: tuple[str, ...], flows: bool, rec: bool) -> bool:
        """Linears that share one input; whether their outputs carry a gradient."""
        for name in names:
            out.extend(adapted(term, s, *shapes[name], trains=trains, grad_in=flows, lora_r=lora_rank(lora, name),
                               recomputed=rec, ends_unit=name == "down_proj"))
        return flows or trains or any(lora_rank(lora, n) for n in names)

    for _ in range(text["num_layers"]):
        rec = recompute and block_needs_backward(carries, trains, lora, DECODER_LINEARS)
        qkv = block(("q_proj", "k_proj", "v_proj"), carries, rec)
        out.append(attention(term, s, s, h, grad=qkv, recomputed=rec))
        carries = block(("o_proj",), qkv, rec) or carries
        gate_up = block(("gate_proj", "up_proj"), carries, rec)
        carries = block(("down_proj",), gate_up, rec) or carries
    out.append(linear(term, s, h, text["vocab_size"], trains=trains, grad_in=carries))
    return out


def block_needs_backward(grad_in: bool, trains: bool, lora: dict | None, names: tuple[str, ...]) -> bool:
    """Whether backward enters a checkpointed unit (and so recomputes it): a gradient reaches its
    input, or it holds weights that train."""
    return grad_in or trains or any(lora_rank(lora, n) for n in names)


def vit_ledger(term: str, tokens: int, width: int, mlp: int, layers: int, *, qkv_fused: bool = False,
               trains: bool = False) -> list[Matmul]:
    """A ViT's blocks: q, k, v, o, attention, the MLP. Frozen (the default) they run forward only
    (nothing upstream trains); trained (a recipe's ``model.trainable`` naming the tower), every weight
    gets its gradient and every input one, the patch embedding below them training too."""
    qkv = [linear(term, tokens, width, 3 * width, trains=trains, grad_in=trains)] if qkv_fused else \
        [linear(term, tokens, width, width, trains=trains, grad_in=trains)] * 3
    one = [*qkv, attention(term, tokens, tokens, width, grad=trains),
           linear(term, tokens, width, width, trains=trains, grad_in=trains),
           linear(term, tokens, width, mlp, trains=trains, grad_in=trains),
           linear(term, tokens, mlp, width, trains=trains, grad_in=trains)]
    return one * layers


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
