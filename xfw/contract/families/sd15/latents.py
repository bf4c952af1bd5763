"""The VAE's latent geometry, shared by SD 1.5 and SD3: given an architecture (its ``vae`` and image size), the
pixels per latent side and a batch's latent shape. Imports nothing, so the family's facts (its FLOP ledger among
them) and the family itself can all read it."""

from __future__ import annotations


def vae_scale_factor(vae: dict) -> int:
    """Pixels per latent side: one 2x downsample between consecutive encoder blocks."""
    return 2 ** (len(vae["block_out_channels"]) - 1)


def latent_shape(arch: dict, micro: int) -> tuple[int, int, int, int]:
    side = arch["data"]["image_size"] // vae_scale_factor(arch["vae"])
    return micro, arch["vae"]["latent_channels"], side, side
