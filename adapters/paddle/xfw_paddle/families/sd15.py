"""Stable Diffusion 1.5 in Paddle: ppdiffusers' UNet2DConditionModel + AutoencoderKL + CLIP text.

``build(arch)`` maps ``xfw.contract.presets`` (family ``sd15``) onto the same architecture as the
PyTorch side (``xfw_torch.families.sd15``), with the same parameter names and counts. The CLIP
text encoder is ``ppdiffusers.transformers.CLIPTextModel`` (what ppdiffusers' SD pipelines
load): a port of transformers' CLIPTextModel with its module names, unlike paddlenlp's. The
step is the PyTorch side's, its randomness from the batch::

    latents = VAE mean(pixels) x scaling_factor          # frozen, no grad
    text    = CLIP text(input_ids).last_hidden_state      # frozen, no grad
    noisy   = sqrt(ᾱ_t)·latents + sqrt(1 − ᾱ_t)·noise     # ᾱ from xfw.contract.families.sd15
    loss    = MSE(UNet(noisy, t, text), noise)            # epsilon prediction

What each stage trains is ``xfw.contract.families.sd15.STAGE_PARTS``; LoRA is paddlenlp.peft's
(:func:`apply_lora`). Recompute is ppdiffusers' gradient checkpointing (each resnet and each
Transformer2D, as diffusers). One difference remains under LoRA: ppdiffusers checkpoints a layer
only when its input needs a gradient, diffusers whenever grad is enabled, so with LoRA the first
Transformer2D (fed by frozen layers) keeps its activations on the Paddle side.
Checked against diffusers with the same weights in tests/contract/test_paddle_diffusion.py.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from xfw.contract.families import sd15 as core
from xfw_paddle import nlp
from xfw_paddle.families._sd_common import apply_lora, build_vae, canonical_names, encode_latents, use_attention

__all__ = ["apply_lora", "canonical_names", "build", "prediction", "loss_fn"]


class StableDiffusion15(nn.Layer):
    def __init__(self, arch: dict, unet, vae, text_encoder):
        super().__init__()
        self.unet, self.vae, self.text_encoder = unet, vae, text_encoder
        self.vae_cfg = arch["vae"]
        # A plain attribute, not a buffer: paddle.amp.decorate(O2) would round a buffer to low precision.
        self.alphas_cumprod = paddle.to_tensor(core.alphas_cumprod(arch["scheduler"]), dtype="float32")

    @property
    def recompute_enabled(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) for m in self.unet.sublayers())

    @property
    def recompute_use_reentrant(self) -> bool:
        """What ppdiffusers' blocks pass: ``use_reentrant=False`` unless its ``recompute_use_reentrant()`` is True
        (on Paddle >= 2.5 only with FLAG_USE_OLD_RECOMPUTE or FLAG_RECOMPUTE_USE_REENTRANT set)."""
        from ppdiffusers.utils import recompute_use_reentrant

        return bool(recompute_use_reentrant())

    def noise_coefficients(self, timesteps: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        alpha = paddle.gather(self.alphas_cumprod, timesteps).reshape([-1, 1, 1, 1])
        return alpha.sqrt(), (1.0 - alpha).sqrt()


def _text_encoder(t: dict):
    from ppdiffusers.transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(**core.text_kwargs(t))
    return CLIPTextModel(config)


def build(arch: dict, *, use_sdpa: bool = True, recompute: bool = False) -> StableDiffusion15:
    nlp.load_ppdiffusers()  # before any other ppdiffusers import: PaddleNLP without its eager __init__
    from ppdiffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(**core.unet_kwargs(arch))
    model = StableDiffusion15(arch, unet, build_vae(arch["vae"]), _text_encoder(arch["text"]))
    use_attention(model.unet, use_sdpa)
    use_attention(model.vae, use_sdpa)
    if recompute:
        model.unet.enable_gradient_checkpointing()
    return model


def prediction(model: StableDiffusion15, batch: dict) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(the UNet's prediction, its target: the noise) for one micro-batch."""
    latents = encode_latents(model.vae, batch["pixel_values"], model.vae_cfg)
    with paddle.no_grad():
        text = model.text_encoder(batch["input_ids"], return_dict=False)[0]
    noise, timesteps = batch["noise"], batch["timesteps"]
    sqrt_alpha, sqrt_one_minus_alpha = model.noise_coefficients(timesteps)
    noisy = sqrt_alpha * latents + sqrt_one_minus_alpha * noise
    return model.unet(noisy, timesteps, text, return_dict=False)[0], noise


def loss_fn(model: StableDiffusion15, batch: dict, autocast) -> paddle.Tensor:
    """The training loss of one micro-batch: forward under ``autocast()``, the MSE in fp32."""
    with autocast():
        pred, target = prediction(model, batch)
    return F.mse_loss(pred.astype("float32"), target.astype("float32"))
