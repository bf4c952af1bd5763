"""Stable Diffusion 3 in Paddle: ppdiffusers' SD3Transformer2DModel + AutoencoderKL (16 latent channels).

Text embeddings come precomputed in the batch (see ``xfw.contract.families.sd3``). The step is the
PyTorch side's (diffusers' train_dreambooth_sd3.py), with σ from the batch::

    x0    = (VAE mean(pixels) − shift_factor) × scaling_factor   # frozen, no grad
    noisy = (1 − σ)·x0 + σ·noise
    loss  = MSE(transformer(noisy, σ·1000, text, pooled), noise − x0)

Two places where ppdiffusers 0.29.0 differs from diffusers 0.42, corrected in :func:`build`:

* ``AdaLayerNormContinuous`` (``norm_out`` and the last block's ``norm1_context``) keeps a
  LayerNorm bias although ``elementwise_affine=False`` (diffusers has none: 2 × dim trainable
  parameters more, zero-initialised). It is replaced by a LayerNorm without weight or bias.
* its gradient checkpointing assigns a block's ``(context, hidden)`` pair to ``hidden_states``
  and so fails on the second block; :func:`_checkpointed_blocks` runs each joint block under
  ``paddle.distributed.fleet.utils.recompute`` (non-reentrant), as diffusers does per block.

What each stage trains is ``xfw.contract.families.sd3.STAGE_PARTS``; LoRA is paddlenlp.peft's.
"""

from __future__ import annotations

import types

import paddle
import paddle.nn.functional as F
from paddle import nn

from xfw.contract.families.sd3 import transformer_kwargs
from xfw.contract.harness import InvalidSpec, Unsupported
from xfw_paddle import nlp
from xfw_paddle.families._sd_common import apply_lora, build_vae, canonical_names, encode_latents, use_attention

__all__ = ["apply_lora", "canonical_names", "build", "prediction", "loss_fn"]


class StableDiffusion3(nn.Layer):
    def __init__(self, arch: dict, transformer, vae):
        super().__init__()
        self.transformer, self.vae = transformer, vae
        self.vae_cfg = arch["vae"]
        self.num_train_timesteps = arch["scheduler"]["num_train_timesteps"]

    @property
    def recompute_enabled(self) -> bool:
        return bool(self.transformer.gradient_checkpointing)


def _checkpointed_blocks(self, hidden_states, encoder_hidden_states, temb):
    """SD3Transformer2DModel.sd3_origin_transformer with working per-block recompute."""
    from paddle.distributed.fleet.utils import recompute

    for block in self.transformer_blocks:
        if self.training and self.gradient_checkpointing:
            encoder_hidden_states, hidden_states = recompute(
                block, hidden_states, encoder_hidden_states, temb, use_reentrant=False)
        else:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, temb=temb)
    return encoder_hidden_states, hidden_states


def _drop_adanorm_bias(transformer: nn.Layer) -> None:
    from ppdiffusers.models.normalization import AdaLayerNormContinuous

    for layer in transformer.sublayers():
        if isinstance(layer, AdaLayerNormContinuous) and isinstance(layer.norm, nn.LayerNorm):
            norm = layer.norm
            if norm.weight is None:  # elementwise_affine=False: diffusers has neither weight nor bias
                layer.norm = nn.LayerNorm(norm._normalized_shape, epsilon=norm._epsilon,
                                          weight_attr=False, bias_attr=False)


def build(arch: dict, *, use_sdpa: bool = True, recompute: bool = False) -> StableDiffusion3:
    nlp.load_ppdiffusers()  # before any other ppdiffusers import: PaddleNLP without its eager __init__
    from ppdiffusers import SD3Transformer2DModel

    if not use_sdpa:
        # As on the PyTorch side: diffusers has no non-SDPA processor for SD3's joint attention.
        raise InvalidSpec("backends.paddle.attn_implementation: 'eager' for SD3 (only 'sdpa', as on the PyTorch side)")
    transformer = SD3Transformer2DModel(**transformer_kwargs(arch["transformer"]))
    if getattr(transformer, "inference_optimize", False):
        raise Unsupported("ppdiffusers' INFERENCE_OPTIMIZE=True builds an inference-only SD3; unset it")
    _drop_adanorm_bias(transformer)
    transformer.sd3_origin_transformer = types.MethodType(_checkpointed_blocks, transformer)
    transformer.gradient_checkpointing = recompute
    model = StableDiffusion3(arch, transformer, build_vae(arch["vae"]))
    use_attention(model.vae, use_sdpa)  # the transformer keeps its JointAttnProcessor2_5 (SDPA)
    return model


def prediction(model: StableDiffusion3, batch: dict) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(the transformer's prediction, its target: the velocity noise − x0) for one micro-batch."""
    latents = encode_latents(model.vae, batch["pixel_values"], model.vae_cfg)
    noise, sigmas = batch["noise"], batch["sigmas"]
    sigma = sigmas.reshape([-1, 1, 1, 1])
    noisy = (1.0 - sigma) * latents + sigma * noise
    pred = model.transformer(
        hidden_states=noisy, encoder_hidden_states=batch["prompt_embeds"],
        pooled_projections=batch["pooled_prompt_embeds"], timestep=sigmas * model.num_train_timesteps,
        return_dict=False,
    )[0]
    return pred, noise - latents


def loss_fn(model: StableDiffusion3, batch: dict, autocast) -> paddle.Tensor:
    """The training loss of one micro-batch: forward under ``autocast()``, the MSE in fp32."""
    with autocast():
        pred, target = prediction(model, batch)
    return F.mse_loss(pred.astype("float32"), target.astype("float32"))
