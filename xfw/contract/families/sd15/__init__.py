"""Stable Diffusion 1.5 (VAE + CLIP text encoder + UNet, epsilon prediction): checks, data, facts.

Every random draw of a training step is in the batch, so both frameworks add the same noise at
the same timesteps to the same images::

    >>> arch = xfw.contract.presets.resolve_arch("tiny-sd15", {}, None, None)
    >>> {k: v.shape for k, v in make_batch(arch, 2, np.random.default_rng(0)).items()}
    {'pixel_values': (2, 3, 32, 32), 'input_ids': (2, 16), 'noise': (2, 4, 16, 16), 'timesteps': (2,)}

The DDPM noise schedule is computed here once (:func:`alphas_cumprod`) and handed to both
adapters, so the two sides cannot disagree on it. The VAE helpers are shared with SD3.

The model's facts (see ``xfw.contract.families``): parts by diffusers' parameter names (the
UNet trains in stage pretrain; stage lora trains only adapters on the UNet's attention
linears), parameter counts and LoRA linears (:mod:`.params`: diffusers' layout exactly,
SD1.5: UNet 859,520,964, VAE 83,653,863, CLIP text 123,060,480; ppdiffusers' classes on the
Paddle side must match it), activation bytes (:mod:`.activations`) and the FLOPs ledger
(:mod:`.flops`: UNet trained or adapted, VAE encoder and text encoder forward).
"""

from __future__ import annotations

import numpy as np

from xfw.contract.families.sd15.activations import activation_bytes, activation_note  # noqa: F401 - facts
from xfw.contract.families.sd15.flops import flop_ledger  # noqa: F401 - facts
from xfw.contract.families.sd15.latents import latent_shape, vae_scale_factor  # noqa: F401 - shared with SD3
from xfw.contract.families.sd15.params import count_params, count_vae, lora_linears  # noqa: F401 - facts
from xfw.contract.families import ArchError

DOWN_BLOCKS = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCKS = ("CrossAttnUpBlock2D", "UpBlock2D")
BETA_SCHEDULES = ("scaled_linear", "linear")

# Parts by prefix of parameter names in the trained system (diffusers' UNet2DConditionModel and
# AutoencoderKL, transformers' CLIPTextModel, held as unet / vae / text_encoder).
PARTS = {"unet": ("unet.",), "vae": ("vae.",), "text_encoder": ("text_encoder.",)}
STAGE_PARTS = {"pretrain": ("unet",), "lora": ()}  # stage lora: only the adapters on LORA_MODULE
LORA_MODULE = "unet"
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # the attention linears (params.lora_linears)


# -- shared with SD3: the VAE that turns pixels into latents ----------------------------------
def check_vae(arch: dict) -> None:
    vae, image_size = arch["vae"], arch["data"]["image_size"]
    channels = vae["block_out_channels"]
    if not channels:
        raise ArchError("model.arch.vae.block_out_channels", "must name at least one block")
    for c in channels:
        if c % vae["norm_num_groups"]:
            raise ArchError("model.arch.vae.norm_num_groups",
                            f"{vae['norm_num_groups']} does not divide block width {c}")
    if image_size % vae_scale_factor(vae):
        raise ArchError("data.image_size", f"{image_size} is not a multiple of the VAE's downsampling "
                        f"factor {vae_scale_factor(vae)}")


def make_pixels(micro: int, image_size: int, rng: np.random.Generator) -> np.ndarray:
    """Images as the training scripts hand them to the VAE: float32 in [-1, 1)."""
    return rng.random((micro, 3, image_size, image_size), dtype=np.float32) * 2 - 1


# -- SD1.5 ------------------------------------------------------------------------------------
def alphas_cumprod(scheduler: dict) -> np.ndarray:
    """ᾱ_t of the DDPM training schedule, float64 [num_train_timesteps].

    "scaled_linear" is SD's schedule (diffusers' DDPMScheduler): betas linear in sqrt space.
    """
    start, end, steps = scheduler["beta_start"], scheduler["beta_end"], scheduler["num_train_timesteps"]
    if scheduler["beta_schedule"] == "scaled_linear":
        betas = np.linspace(start ** 0.5, end ** 0.5, steps, dtype=np.float64) ** 2
    else:
        betas = np.linspace(start, end, steps, dtype=np.float64)
    return np.cumprod(1.0 - betas)


def _check_unet(arch: dict) -> None:
    unet, text = arch["unet"], arch["text"]
    channels = unet["block_out_channels"]
    for key, types, known in (("down_block_types", unet["down_block_types"], DOWN_BLOCKS),
                              ("up_block_types", unet["up_block_types"], UP_BLOCKS)):
        if len(types) != len(channels):
            raise ArchError(f"model.arch.unet.{key}", f"{len(types)} blocks for {len(channels)} block_out_channels")
        for t in types:
            if t not in known:
                raise ArchError(f"model.arch.unet.{key}", f"unknown block {t!r} (known: {', '.join(known)})")
    for c in channels:
        if c % unet["norm_num_groups"]:
            raise ArchError("model.arch.unet.norm_num_groups", f"{unet['norm_num_groups']} does not divide block width {c}")
        # diffusers reads SD's attention_head_dim as the number of heads (its documented naming quirk).
        if c % unet["attention_head_dim"]:
            raise ArchError("model.arch.unet.attention_head_dim",
                            f"{unet['attention_head_dim']} heads do not divide block width {c}")
    if unet["cross_attention_dim"] != text["hidden_size"]:
        raise ArchError("model.arch.unet.cross_attention_dim",
                        f"{unet['cross_attention_dim']} differs from the text encoder's hidden_size {text['hidden_size']}")
    latent_side = latent_shape(arch, 1)[-1]
    if latent_side % 2 ** (len(channels) - 1):
        raise ArchError("data.image_size", f"{arch['data']['image_size']} gives {latent_side}-pixel latents, "
                        f"not a multiple of the UNet's downsampling factor {2 ** (len(channels) - 1)}")


def check(arch: dict) -> None:
    text, scheduler = arch["text"], arch["scheduler"]
    check_vae(arch)
    _check_unet(arch)
    if text["hidden_size"] % text["num_heads"]:
        raise ArchError("model.arch.text.num_heads", f"{text['num_heads']} does not divide hidden_size {text['hidden_size']}")
    if text["vocab_size"] < 3:
        raise ArchError("model.arch.text.vocab_size", "needs room for BOS, EOS and at least one text token")
    if text["max_length"] < 2:
        raise ArchError("model.arch.text.max_length", f"must hold at least BOS and EOS, got {text['max_length']}")
    if scheduler["beta_schedule"] not in BETA_SCHEDULES:
        raise ArchError("model.arch.scheduler.beta_schedule",
                        f"unknown schedule {scheduler['beta_schedule']!r} (known: {', '.join(BETA_SCHEDULES)})")
    if not 0 < scheduler["beta_start"] < scheduler["beta_end"] < 1:
        raise ArchError("model.arch.scheduler.beta_end", "betas must satisfy 0 < beta_start < beta_end < 1")
    if scheduler["num_train_timesteps"] < 1:
        raise ArchError("model.arch.scheduler.num_train_timesteps", "must be at least 1")


def make_batch(arch: dict, micro: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Images, CLIP token ids, the noise to add and the timesteps to add it at.

    Token ids follow CLIP's layout: BOS (vocab - 2), text, EOS (vocab - 1), always full length
    (the tokenizer pads every prompt to max_length, so the encoder's cost does not depend on it).
    """
    vocab, length = arch["text"]["vocab_size"], arch["text"]["max_length"]
    pixel_values = make_pixels(micro, arch["data"]["image_size"], rng)
    input_ids = np.empty((micro, length), np.int64)
    input_ids[:, 0] = vocab - 2
    input_ids[:, 1:-1] = rng.integers(0, vocab - 2, size=(micro, length - 2), dtype=np.int64)
    input_ids[:, -1] = vocab - 1
    return {"pixel_values": pixel_values, "input_ids": input_ids, **step_draws(arch, micro, rng)}


def step_draws(arch: dict, micro: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The random draws of a training step: the noise to add and the timesteps to add it at."""
    noise = rng.standard_normal(latent_shape(arch, micro), dtype=np.float32)
    # Uniform over the training timesteps, as diffusers' and PaddleMIX's SD training scripts draw them.
    timesteps = rng.integers(0, arch["scheduler"]["num_train_timesteps"], size=micro, dtype=np.int64)
    return {"noise": noise, "timesteps": timesteps}


def from_prepared(arch: dict, stored: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A prepared sample (``xfw.run.data``: the image resized, cropped and scaled to [-1, 1], its
    caption's CLIP ids padded to max_length) as a batch of one, with its step's draws from ``rng``."""
    return {"pixel_values": np.asarray(stored["pixel_values"], np.float32)[None],
            "input_ids": stored["input_ids"].astype(np.int64)[None], **step_draws(arch, 1, rng)}


# -- constructor arguments ------------------------------------------------------------------------
# diffusers and ppdiffusers (and transformers' / ppdiffusers' CLIPTextConfig) take the same
# keyword arguments, so the neutral -> library mapping is written once, here, as plain data.

def vae_kwargs(vae: dict) -> dict:
    """``AutoencoderKL(**vae_kwargs(arch["vae"]))``: encoder and decoder; only the encoder runs."""
    levels = len(vae["block_out_channels"])
    return dict(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels, block_out_channels=tuple(vae["block_out_channels"]),
        layers_per_block=vae["layers_per_block"], norm_num_groups=vae["norm_num_groups"],
        latent_channels=vae["latent_channels"], scaling_factor=vae["scaling_factor"],
        shift_factor=vae["shift_factor"], use_quant_conv=vae["use_quant_conv"],
        use_post_quant_conv=vae["use_quant_conv"],
    )


def unet_kwargs(arch: dict) -> dict:
    """``UNet2DConditionModel(**unet_kwargs(arch))``."""
    u, z = arch["unet"], arch["vae"]["latent_channels"]
    return dict(
        sample_size=u["sample_size"], in_channels=z, out_channels=z, down_block_types=tuple(u["down_block_types"]),
        up_block_types=tuple(u["up_block_types"]), block_out_channels=tuple(u["block_out_channels"]),
        layers_per_block=u["layers_per_block"], cross_attention_dim=u["cross_attention_dim"],
        attention_head_dim=u["attention_head_dim"], norm_num_groups=u["norm_num_groups"],
    )


def text_kwargs(text: dict) -> dict:
    """``CLIPTextConfig(**text_kwargs(arch["text"]))``: BOS/EOS are the last two ids, as make_batch draws them."""
    t = text
    return dict(
        vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
        num_hidden_layers=t["num_layers"], num_attention_heads=t["num_heads"],
        max_position_embeddings=t["max_length"], hidden_act=t["hidden_act"], layer_norm_eps=t["layer_norm_eps"],
        bos_token_id=t["vocab_size"] - 2, eos_token_id=t["vocab_size"] - 1, pad_token_id=t["vocab_size"] - 1,
    )
