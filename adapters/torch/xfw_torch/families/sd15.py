"""Stable Diffusion 1.5 from the neutral architecture, with diffusers' and transformers' classes.

``build(arch)`` maps ``xfw.contract.presets`` (family ``sd15``) onto ``UNet2DConditionModel``,
``AutoencoderKL`` and ``CLIPTextModel``, randomly initialised, inside one module the session
moves, casts and counts. The step is diffusers' train_text_to_image.py with its randomness
taken from the batch::

    latents = VAE mean(pixels) x scaling_factor          # frozen, no grad
    text    = CLIP text(input_ids).last_hidden_state      # frozen, no grad
    noisy   = sqrt(ᾱ_t)·latents + sqrt(1 − ᾱ_t)·noise     # ᾱ from xfw.contract.families.sd15
    loss    = MSE(UNet(noisy, t, text), noise)            # epsilon prediction

The VAE posterior's mean (``latent_dist.mode()``) replaces ``.sample()``: sampling would
draw from the framework's RNG, and the two frameworks' draws could never match. The cost is
the same. What each stage trains is ``xfw.contract.families.sd15.STAGE_PARTS``.
"""

from __future__ import annotations

import functools

import torch

from xfw.contract.families import sd15 as core
from xfw.contract.harness import InvalidSpec

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def build_vae(vae: dict):
    """The AutoencoderKL both SD families use (encoder and decoder; only the encoder runs)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(**core.vae_kwargs(vae))


def encode_latents(vae, pixel_values: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Frozen VAE encoder: the posterior's mean, shifted and scaled, in fp32."""
    with torch.no_grad():
        latents = vae.encode(pixel_values).latent_dist.mode().float()
    return (latents - (cfg["shift_factor"] or 0.0)) * cfg["scaling_factor"]


class StableDiffusion15(torch.nn.Module):
    def __init__(self, arch: dict, unet, vae, text_encoder):
        super().__init__()
        self.unet, self.vae, self.text_encoder = unet, vae, text_encoder
        self.vae_cfg = arch["vae"]
        # A plain attribute, not a buffer: Module.to(dtype) would round a buffer to bf16 under O2.
        # Made on the device the model is built under; moved once, on a warm-up step, if not.
        self.alphas_cumprod = torch.tensor(core.alphas_cumprod(arch["scheduler"]), dtype=torch.float32)

    def noise_coefficients(self, timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.alphas_cumprod.device != timesteps.device:
            self.alphas_cumprod = self.alphas_cumprod.to(timesteps.device)
        alpha = self.alphas_cumprod[timesteps].view(-1, 1, 1, 1)
        return alpha.sqrt(), (1.0 - alpha).sqrt()


def build(arch: dict, *, attn_implementation: str = "sdpa") -> torch.nn.Module:
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor
    from transformers import CLIPTextConfig, CLIPTextModel

    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise InvalidSpec(f"backends.torch.attn_implementation: {attn_implementation!r} for SD1.5 "
                          f"(known: {', '.join(ATTN_IMPLEMENTATIONS)})")
    unet = UNet2DConditionModel(**core.unet_kwargs(arch))
    text_config = CLIPTextConfig(**core.text_kwargs(arch["text"]))
    text_config._attn_implementation = attn_implementation
    model = StableDiffusion15(arch, unet, build_vae(arch["vae"]), CLIPTextModel(text_config))
    if attn_implementation == "eager":  # diffusers' default is AttnProcessor2_0 (SDPA)
        model.unet.set_attn_processor(AttnProcessor())
        model.vae.set_attn_processor(AttnProcessor())
    return model


def loss_fn(model: StableDiffusion15, batch: dict) -> torch.Tensor:
    latents = encode_latents(model.vae, batch["pixel_values"], model.vae_cfg)
    with torch.no_grad():
        text = model.text_encoder(batch["input_ids"], return_dict=False)[0]
    noise, timesteps = batch["noise"], batch["timesteps"]
    sqrt_alpha, sqrt_one_minus_alpha = model.noise_coefficients(timesteps)
    noisy = sqrt_alpha * latents + sqrt_one_minus_alpha * noise
    pred = model.unet(noisy, timesteps, text, return_dict=False)[0]
    return torch.nn.functional.mse_loss(pred.float(), noise.float())


def enable_recompute(model: StableDiffusion15, reentrant: bool = False) -> None:
    """diffusers' per-block checkpointing: non-reentrant (diffusers' default) unless asked otherwise."""
    model.unet.enable_gradient_checkpointing(
        functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True) if reentrant else None)


def shard_units(model: StableDiffusion15) -> list:
    """Blocks FSDP shards one by one: the UNet's down, mid and up blocks."""
    unet = model.unet
    return [*unet.down_blocks, unet.mid_block, *unet.up_blocks]
