"""Stable Diffusion 3 from the neutral architecture: diffusers' SD3Transformer2DModel + AutoencoderKL.

Text embeddings come precomputed in the batch (see ``xfw.contract.families.sd3``), so the system is
the MMDiT and the frozen VAE, in one module the session moves, casts and counts. The step
is rectified flow matching as in diffusers' train_dreambooth_sd3.py, with σ from the batch::

    x0    = (VAE mean(pixels) − shift_factor) × scaling_factor   # frozen, no grad
    noisy = (1 − σ)·x0 + σ·noise
    loss  = MSE(transformer(noisy, σ·1000, text, pooled), noise − x0)

As for SD1.5, the VAE posterior's mean replaces ``.sample()`` to keep framework RNGs out of
the step. What each stage trains is ``xfw.contract.families.sd3.STAGE_PARTS``.
"""

from __future__ import annotations

import functools

import torch

from xfw.contract.families.sd3 import transformer_kwargs
from xfw.contract.harness import InvalidSpec
from xfw_torch.families.sd15 import build_vae, encode_latents


class StableDiffusion3(torch.nn.Module):
    def __init__(self, arch: dict, transformer, vae):
        super().__init__()
        self.transformer, self.vae = transformer, vae
        self.vae_cfg = arch["vae"]
        self.num_train_timesteps = arch["scheduler"]["num_train_timesteps"]


def build(arch: dict, *, attn_implementation: str = "sdpa") -> torch.nn.Module:
    from diffusers import SD3Transformer2DModel

    if attn_implementation != "sdpa":
        # diffusers has no non-SDPA processor for SD3's joint attention (JointAttnProcessor2_0 only).
        raise InvalidSpec(f"backends.torch.attn_implementation: {attn_implementation!r} for SD3 (only 'sdpa')")
    transformer = SD3Transformer2DModel(**transformer_kwargs(arch["transformer"]))
    return StableDiffusion3(arch, transformer, build_vae(arch["vae"]))


def loss_fn(model: StableDiffusion3, batch: dict) -> torch.Tensor:
    latents = encode_latents(model.vae, batch["pixel_values"], model.vae_cfg)
    noise, sigmas = batch["noise"], batch["sigmas"]
    sigma = sigmas.view(-1, 1, 1, 1)
    noisy = (1.0 - sigma) * latents + sigma * noise
    pred = model.transformer(
        hidden_states=noisy, encoder_hidden_states=batch["prompt_embeds"],
        pooled_projections=batch["pooled_prompt_embeds"], timestep=sigmas * model.num_train_timesteps,
        return_dict=False,
    )[0]
    return torch.nn.functional.mse_loss(pred.float(), (noise - latents).float())


def enable_recompute(model: StableDiffusion3, reentrant: bool = False) -> None:
    """diffusers' per-block checkpointing: non-reentrant (diffusers' default) unless asked otherwise."""
    model.transformer.enable_gradient_checkpointing(
        functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True) if reentrant else None)


def shard_units(model: StableDiffusion3) -> list:
    """Blocks FSDP shards one by one: the joint transformer blocks."""
    return list(model.transformer.transformer_blocks)


# The last joint block's text-stream projections produce an output that is discarded, so their
# parameters never get a gradient: DDP must be told to look for unused parameters.
DDP_FIND_UNUSED = True
