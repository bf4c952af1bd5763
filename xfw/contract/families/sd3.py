"""Stable Diffusion 3 (VAE + MMDiT, rectified flow matching): checks and data.

Text embeddings are synthetic stand-ins for the precomputed CLIP-L/G + T5-XXL outputs (what
a DreamBooth run without text-encoder training precomputes once), and the flow-matching
noise level σ of every sample is in the batch, so both frameworks train on the same
noisy latents::

    >>> arch = xfw.contract.presets.resolve_arch("tiny-sd3", {}, None, None)
    >>> {k: v.shape for k, v in make_batch(arch, 2, np.random.default_rng(0)).items()}
    {'pixel_values': (2, 3, 32, 32), 'prompt_embeds': (2, 16, 32), 'pooled_prompt_embeds': (2, 32),
     'noise': (2, 16, 16, 16), 'sigmas': (2,)}

The step: x0 = (VAE mean − shift) × scale; x_σ = (1 − σ)·x0 + σ·noise; the transformer at
timestep σ·num_train_timesteps predicts noise − x0; plain MSE.

The model's facts (see ``xfw.contract.families``): parts by diffusers' parameter names (the
MMDiT trains in stage dreambooth; stage lora trains only adapters on its attention linears),
:func:`count_params` (diffusers' layout exactly, SD3-medium: MMDiT 2,028,328,000, VAE
83,819,683), :func:`lora_linears`, :func:`flop_ledger` (MMDiT trained or adapted, VAE encoder
forward) and :func:`activation_bytes`.
"""

from __future__ import annotations

import numpy as np

from xfw.contract.families import ArchError, flops
from xfw.contract.families.sd15 import check_vae, count_vae, latent_shape, make_pixels, vae_scale_factor
from xfw.contract.families.sd15.flops import vae_encoder_ledger

TIMESTEP_SAMPLINGS = ("logit_normal", "uniform")

# Parts by prefix of parameter names in the trained system (diffusers' SD3Transformer2DModel and
# AutoencoderKL, held as transformer / vae); the text encoders' outputs are precomputed.
PARTS = {"transformer": ("transformer.",), "vae": ("vae.",)}
STAGE_PARTS = {"dreambooth": ("transformer",), "lora": ()}  # stage lora: only the adapters on LORA_MODULE
LORA_MODULE = "transformer"
# The joint attention's linears: the image stream's (to_*) and the text stream's (add_*, to_add_out).
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def sample_sigmas(scheduler: dict, micro: int, rng: np.random.Generator) -> np.ndarray:
    """Noise levels σ in (0, 1], float32 [micro], drawn like the SD3 training scripts do.

    Both scripts index the training grid of diffusers' FlowMatchEulerDiscreteScheduler,
    s_i = (T - i) / T for i in [0, T), shifted by σ = shift·s / (1 + (shift - 1)·s)
    (shift 3.0 in SD3-medium's scheduler_config.json):

    * ``logit_normal`` (default): i = ⌊sigmoid(N(mean, std))·T⌋, diffusers'
      train_dreambooth_sd3.py default weighting_scheme, the SD3 paper's rf/lognorm(0, 1) (§3.1).
    * ``uniform``: i uniform, PaddleMIX's ppdiffusers script (weighting "sigma_sqrt" with EDM
      output preconditioning, whose loss σ⁻²·(σ(noise − x0 − v))² is the same plain MSE to
      noise − x0 used here).

    The sampling changes the loss's value, never the step's cost.
    """
    steps, shift = scheduler["num_train_timesteps"], scheduler["shift"]
    if scheduler["timestep_sampling"] == "logit_normal":
        u = 1.0 / (1.0 + np.exp(-rng.normal(scheduler["logit_mean"], scheduler["logit_std"], size=micro)))
        index = np.minimum((u * steps).astype(np.int64), steps - 1)
    else:
        index = rng.integers(0, steps, size=micro, dtype=np.int64)
    s = (steps - index) / steps
    return (shift * s / (1.0 + (shift - 1.0) * s)).astype(np.float32)


def check(arch: dict) -> None:
    t, text, vae, scheduler = arch["transformer"], arch["text"], arch["vae"], arch["scheduler"]
    check_vae(arch)
    for key in ("in_channels", "out_channels"):
        if t[key] != vae["latent_channels"]:
            raise ArchError(f"model.arch.transformer.{key}",
                            f"{t[key]} differs from the VAE's latent_channels {vae['latent_channels']}")
    if t["caption_projection_dim"] != t["num_heads"] * t["head_dim"]:
        raise ArchError("model.arch.transformer.caption_projection_dim",
                        f"{t['caption_projection_dim']} must equal num_heads x head_dim = {t['num_heads'] * t['head_dim']}")
    if not text["precomputed"]:
        raise ArchError("model.arch.text.precomputed",
                        "only precomputed (synthetic) text embeddings are implemented for SD3")
    if text["dim"] != t["joint_attention_dim"]:
        raise ArchError("model.arch.text.dim", f"{text['dim']} differs from joint_attention_dim {t['joint_attention_dim']}")
    if text["pooled_dim"] != t["pooled_projection_dim"]:
        raise ArchError("model.arch.text.pooled_dim",
                        f"{text['pooled_dim']} differs from pooled_projection_dim {t['pooled_projection_dim']}")
    side = latent_shape(arch, 1)[-1]
    if side % t["patch_size"]:
        raise ArchError("data.image_size", f"{arch['data']['image_size']} gives {side}-pixel latents, "
                        f"not a multiple of patch_size {t['patch_size']}")
    if side // t["patch_size"] > t["pos_embed_max_size"]:
        raise ArchError("data.image_size", f"{arch['data']['image_size']} gives {side // t['patch_size']} patches "
                        f"per side, more than pos_embed_max_size {t['pos_embed_max_size']}")
    if scheduler["timestep_sampling"] not in TIMESTEP_SAMPLINGS:
        raise ArchError("model.arch.scheduler.timestep_sampling",
                        f"unknown {scheduler['timestep_sampling']!r} (known: {', '.join(TIMESTEP_SAMPLINGS)})")
    if scheduler["shift"] <= 0:
        raise ArchError("model.arch.scheduler.shift", f"must be positive, got {scheduler['shift']}")
    if scheduler["logit_std"] <= 0:
        raise ArchError("model.arch.scheduler.logit_std", f"must be positive, got {scheduler['logit_std']}")


def make_batch(arch: dict, micro: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    text = arch["text"]
    return {
        "pixel_values": make_pixels(micro, arch["data"]["image_size"], rng),
        "prompt_embeds": rng.standard_normal((micro, text["seq_len"], text["dim"]), dtype=np.float32),
        "pooled_prompt_embeds": rng.standard_normal((micro, text["pooled_dim"]), dtype=np.float32),
        "noise": rng.standard_normal(latent_shape(arch, micro), dtype=np.float32),
        "sigmas": sample_sigmas(arch["scheduler"], micro, rng),
    }


def from_prepared(arch: dict, stored: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A prepared sample (``xfw.run.data``: the image resized, cropped and scaled to [-1, 1], and
    ``text_seed``, a digest of its caption) as a batch of one. The text embeddings stand in for
    the precomputed CLIP-L/G + T5 outputs (the text encoders are no part of the trained system):
    drawn from the caption's seed, so one caption always gets one embedding, as precomputing gives."""
    text = arch["text"]
    words = np.random.default_rng(int(stored["text_seed"]))
    return {
        "pixel_values": np.asarray(stored["pixel_values"], np.float32)[None],
        "prompt_embeds": words.standard_normal((1, text["seq_len"], text["dim"]), dtype=np.float32),
        "pooled_prompt_embeds": words.standard_normal((1, text["pooled_dim"]), dtype=np.float32),
        "noise": rng.standard_normal(latent_shape(arch, 1), dtype=np.float32),
        "sigmas": sample_sigmas(arch["scheduler"], 1, rng),
    }


def count_transformer(t: dict) -> int:
    """SD3Transformer2DModel: patch embedding, timestep + pooled-text conditioning, joint blocks.

    The last block is ``context_pre_only``: the text stream is only read, so it has no output
    projection or feed-forward for text, and a 2-way (not 6-way) modulation for it.
    """
    d, p = t["num_heads"] * t["head_dim"], t["patch_size"]
    linear = lambda i, o: i * o + o  # noqa: E731 - every linear here has a bias
    total = linear(p * p * t["in_channels"], d)  # patch conv (the position table is a buffer)
    total += linear(256, d) + linear(d, d) + linear(t["pooled_projection_dim"], d) + linear(d, d)
    total += linear(t["joint_attention_dim"], t["caption_projection_dim"])
    ff = linear(d, 4 * d) + linear(4 * d, d)
    for i in range(t["num_layers"]):
        pre_only = i == t["num_layers"] - 1
        total += linear(d, 6 * d) + linear(d, 2 * d if pre_only else 6 * d)  # adaLN-Zero modulations
        total += (7 if pre_only else 8) * linear(d, d)  # q, k, v, out for image; q, k, v (+ out) for text
        total += ff if pre_only else 2 * ff
    return total + linear(d, 2 * d) + linear(d, p * p * t["out_channels"])


def count_params(arch: dict) -> dict[str, int]:
    """Analytic parameter counts per part; text embeddings are precomputed, so no text encoders."""
    counts = {"transformer": count_transformer(arch["transformer"]), "vae": count_vae(arch["vae"])}
    return {**counts, "total": sum(counts.values())}


def lora_linears(arch: dict) -> dict[str, list[tuple[int, int]]]:
    """(in, out) of every MMDiT linear each LoRA target name matches: each joint block's attention
    has q, k, v and out (d -> d) for the image stream and q, k, v for the text stream, plus the
    text stream's out except in the last block (``context_pre_only``, as :func:`count_transformer`)."""
    t = arch["transformer"]
    d, layers = t["num_heads"] * t["head_dim"], t["num_layers"]
    every = [(d, d)] * layers
    return {**{name: every for name in LORA_TARGETS[:-1]}, "to_add_out": [(d, d)] * (layers - 1)}


def flop_ledger(arch: dict, trained: tuple[str, ...], lora: dict | None, recompute: bool) -> list[flops.Matmul]:
    """Every product of one sample's step (``xfw.contract.families.flops``): the frozen VAE encoder
    forward, then the MMDiT: patch embedding, timestep and pooled-text embeddings, the caption
    projection, per joint block the adaLN modulations, q/k/v of both streams, joint attention over
    image + text tokens, the output projections and feed-forwards (the last block reads the text
    stream only), and the final modulation and projection. With LoRA (adapters only) no gradient
    reaches the embeddings or the modulations (fed by the timestep alone); from the first adapted
    attention on, both streams carry one. Recompute reruns each joint block a gradient reaches."""
    t, z = arch["transformer"], vae_scale_factor(arch["vae"])
    d, p, n_text = t["num_heads"] * t["head_dim"], t["patch_size"], arch["text"]["seq_len"]
    n_image = (arch["data"]["image_size"] // z // p) ** 2
    trains = "transformer" in trained
    out = vae_encoder_ledger(arch["vae"], arch["data"]["image_size"])

    def lin(tokens: int, n_in: int, n_out: int, grad_in: bool, rec: bool = False, name: str = "") -> bool:
        out.extend(flops.adapted("transformer", tokens, n_in, n_out, trains=trains, grad_in=grad_in,
                                 lora_r=flops.lora_rank(lora, name), recomputed=rec))
        return grad_in or trains or bool(flops.lora_rank(lora, name))

    out.append(flops.conv("transformer", n_image, p * p, t["in_channels"], d, trains=trains, grad_in=False))
    for n_in in (256, t["pooled_projection_dim"]):  # timestep and pooled-text embedders: 2 linears each
        lin(1, d, d, lin(1, n_in, d, False))
    modulation = trains  # the conditioning vector carries a gradient only when its linears train
    image = text = trains
    text = lin(n_text, t["joint_attention_dim"], t["caption_projection_dim"], False)
    for i in range(t["num_layers"]):
        pre_only = i == t["num_layers"] - 1
        rec = recompute and (image or text or modulation or trains or any(flops.lora_rank(lora, n) for n in LORA_TARGETS))
        mod = lin(1, d, 6 * d, modulation, rec) | lin(1, d, 2 * d if pre_only else 6 * d, modulation, rec)
        image_in, text_in = image or mod, text or mod
        qkv = [lin(n_image, d, d, image_in, rec, name) for name in ("to_q", "to_k", "to_v")]
        qkv += [lin(n_text, d, d, text_in, rec, name) for name in ("add_q_proj", "add_k_proj", "add_v_proj")]
        out.append(flops.attention("transformer", n_image + n_text, n_image + n_text, d, grad=any(qkv), recomputed=rec))
        image = lin(n_image, d, d, any(qkv), rec, "to_out.0") or image_in
        image = lin(n_image, 4 * d, d, lin(n_image, d, 4 * d, image, rec), rec) or image
        if not pre_only:
            text = lin(n_text, d, d, any(qkv), rec, "to_add_out") or text_in
            text = lin(n_text, 4 * d, d, lin(n_text, d, 4 * d, text, rec), rec) or text
    lin(1, d, 2 * d, modulation)  # norm_out
    lin(n_image, d, p * p * t["out_channels"], image or modulation)
    return out


def activation_bytes(arch: dict, micro: int, *, dtype: str, recompute: bool) -> float:
    """Stored activations at the peak, for one micro-batch: each joint block counted as two GPT
    layers, one per stream, over the image and text tokens (34sbh each: Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", Eq. 1, without the score
    term, which fused SDPA does not keep). Recompute keeps each block's input (2sbh) plus one
    block's full activations while it is recomputed. Counted for 16-bit activations, x2 in fp32."""
    t, b = arch["transformer"], micro
    s = (arch["data"]["image_size"] // vae_scale_factor(arch["vae"]) // t["patch_size"]) ** 2 + arch["text"]["seq_len"]
    d = t["num_heads"] * t["head_dim"]
    per_block = 2 * s * b * d if recompute else 34 * s * b * d
    scale = 2 if dtype == "fp32" else 1
    return scale * (t["num_layers"] * per_block + (34 * s * b * d if recompute else 0))


def transformer_kwargs(t: dict) -> dict:
    """``SD3Transformer2DModel(**transformer_kwargs(arch["transformer"]))`` (diffusers and ppdiffusers alike)."""
    return dict(
        sample_size=t["sample_size"], patch_size=t["patch_size"], in_channels=t["in_channels"],
        num_layers=t["num_layers"], attention_head_dim=t["head_dim"], num_attention_heads=t["num_heads"],
        joint_attention_dim=t["joint_attention_dim"], caption_projection_dim=t["caption_projection_dim"],
        pooled_projection_dim=t["pooled_projection_dim"], out_channels=t["out_channels"],
        pos_embed_max_size=t["pos_embed_max_size"],
    )
