"""What the Paddle SD1.5 and SD3 families share: the VAE, attention kernels, LoRA, diffusers names.

* ``build_vae``/``encode_latents``: ppdiffusers' ``AutoencoderKL`` from the neutral fields and
  the frozen encoder step (posterior mean, − shift, × scale), as the PyTorch side does.
* ``use_attention``: ppdiffusers picks its attention processor by whether its CUDA kernels
  loaded; here the recipe's knob decides. "sdpa" is ppdiffusers' ``AttnProcessor2_5``, which
  calls ``F.scaled_dot_product_attention_`` — a function ppdiffusers defines only on CUDA
  builds, so on CPU :func:`ensure_sdpa` supplies the plain math it would run there.
* ``apply_lora``: ``paddlenlp.peft.LoRAModel`` over the UNet/transformer, with peft's
  name matching translated to paddlenlp's regexes, so the same Linears get adapters.
* ``diffusers_state``/``load_diffusers_state``: ppdiffusers' parameter names are diffusers'
  (and transformers' for CLIP); Paddle stores Linear weights ``[in, out]``, torch ``[out, in]``::

      >>> load_diffusers_state(model.unet, np.load("unet.npz"))   # names as in diffusers

Importing ppdiffusers patches Paddle globally (e.g. ``nn.Layer.to``); only these families import it,
first through ``xfw_paddle.nlp.load_ppdiffusers`` (each family's ``build`` starts with it).
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from xfw.contract.families.sd15 import vae_kwargs
from xfw_paddle import nlp


def _sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               training=True, attention_op=None):
    """ppdiffusers' ``scaled_dot_product_attention_`` "math" branch: inputs [b, s, heads, head_dim]."""
    if is_causal:
        raise NotImplementedError("causal attention is not used by the SD families")
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    q, k, v = (paddle.transpose(t, [0, 2, 1, 3]) for t in (query, key, value))
    scores = paddle.matmul(q * scale, k, transpose_y=True)
    if attn_mask is not None:
        scores = scores + attn_mask.astype(scores.dtype)
    probs = F.softmax(scores, axis=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p, training=training)
    return paddle.transpose(paddle.matmul(probs, v), [0, 2, 1, 3])


def ensure_sdpa() -> None:
    """Give Paddle the ``F.scaled_dot_product_attention_`` ppdiffusers' attention calls, where
    ppdiffusers did not (it defines it only when its CUDA memory-efficient kernels load)."""
    nlp.load_ppdiffusers()  # its patches run at import and may define the function

    if not hasattr(F, "scaled_dot_product_attention_"):
        F.scaled_dot_product_attention_ = _sdpa_math


def use_attention(layer: nn.Layer, use_sdpa: bool) -> None:
    """SDPA-style (``AttnProcessor2_5``) or eager (``AttnProcessor``: bmm + softmax) attention."""
    from ppdiffusers.models.attention_processor import AttnProcessor, AttnProcessor2_5

    ensure_sdpa()
    layer.set_attn_processor(AttnProcessor2_5() if use_sdpa else AttnProcessor())


# -- the VAE both families use -------------------------------------------------------------------
def build_vae(vae: dict):
    from ppdiffusers import AutoencoderKL

    return AutoencoderKL(**vae_kwargs(vae))


def encode_latents(vae, pixel_values: paddle.Tensor, cfg: dict) -> paddle.Tensor:
    """Frozen VAE encoder: the posterior's mean (no framework RNG), shifted and scaled, in fp32."""
    with paddle.no_grad():
        latents = vae.encode(pixel_values).latent_dist.mode().astype("float32")
    return (latents - (cfg["shift_factor"] or 0.0)) * cfg["scaling_factor"]


# -- LoRA ---------------------------------------------------------------------------------------
def lora_patterns(targets: list[str]) -> list[str]:
    """peft matches a target to a module named exactly so or ending in ``.<target>``;
    paddlenlp.peft full-matches regexes against the names, so say the same thing as a regex."""
    return [r"(.*\.)?" + re.escape(t) for t in targets]


class _LoRAHolder(nn.Layer):
    """paddlenlp's LoRAModel reads ``model.config.tensor_parallel_degree`` (a paddlenlp
    PretrainedConfig field); ppdiffusers models carry a diffusers-style FrozenDict without it."""

    def __init__(self, target: nn.Layer):
        super().__init__()
        self.target = target
        self.config = SimpleNamespace(tensor_parallel_degree=1)


def apply_lora(target: nn.Layer, lora: dict) -> None:
    """paddlenlp.peft LoRA adapters injected in place into ``target`` (the UNet/transformer);
    only the adapters train there. scaling = alpha / r, B = 0 at start, no bias: as peft."""
    peft = nlp.load("paddlenlp.peft")  # PaddleNLP's own import order (xfw_paddle.nlp)
    LoRAConfig, LoRAModel = peft.LoRAConfig, peft.LoRAModel
    from paddlenlp.peft.lora.lora_layers import LoRAConv2D, LoRALinear

    from xfw.contract.harness import InvalidSpec

    config = LoRAConfig(target_modules=lora_patterns(lora["targets"]), r=lora["r"], lora_alpha=lora["alpha"],
                        lora_dropout=lora["dropout"])
    LoRAModel(_LoRAHolder(target), config)  # replaces the matched layers inside target, in place
    if not any(isinstance(m, (LoRALinear, LoRAConv2D)) for m in target.sublayers()):
        raise InvalidSpec(f"lora.targets: none of {list(lora['targets'])} names a layer of {type(target).__name__}")


# -- diffusers' names and layouts (for loading torch weights) ------------------------------------
def _linear_weights(model: nn.Layer) -> set[str]:
    """Parameter names of Linear weights, found by layer kind (never by shape: square matrices)."""
    return {f"{name}.weight" if name else "weight" for name, m in model.named_sublayers(include_self=True)
            if isinstance(m, nn.Linear)}


def canonical_names(model: nn.Layer) -> dict[str, tuple[str, bool]]:
    """``{our name: (diffusers' name, transposed?)}``: ppdiffusers keeps diffusers' names, and
    Paddle's Linear weights are [in, out] where torch's are [out, in]."""
    linear = _linear_weights(model)
    return {n: (n, n in linear) for n, _ in model.named_parameters()}


def load_diffusers_state(model: nn.Layer, state) -> None:
    """Copy weights given under diffusers' names and torch layouts (numpy arrays) into ``model``."""
    linear = _linear_weights(model)
    ours = dict(model.named_parameters())
    missing, unexpected = sorted(set(ours) - set(state)), sorted(set(state) - set(ours))
    if missing or unexpected:
        raise KeyError(f"missing {missing[:3]} ({len(missing)}), unexpected {unexpected[:3]} ({len(unexpected)})")
    for name, param in ours.items():
        value = np.asarray(state[name])
        param.set_value((value.T if name in linear else value).astype(np.float32))
