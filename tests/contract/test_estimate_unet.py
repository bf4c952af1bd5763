"""`xfw estimate`'s SD1.5 activation count against what a real diffusers UNet saves for backward.

The estimate walks the UNet block by block with no framework (xfw.contract.families.sd15.activations);
here a real diffusers UNet2DConditionModel of reduced width trains one forward on CPU in fp32, and every
tensor autograd saves for the backward (parameters excluded) is counted by storage. The two must
agree: this is what the H100 comparison in results/h100/README.md rests on, checked here where
it can be checked exactly."""

from __future__ import annotations

import pytest

from xfw.contract.families.sd15 import activations

pytestmark = pytest.mark.contract
torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")


def unet_arch(channels: tuple[int, ...], latent_side: int, layers: int) -> dict:
    down = ["CrossAttnDownBlock2D"] * (len(channels) - 1) + ["DownBlock2D"]
    up = ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * (len(channels) - 1)
    return {"unet": {"block_out_channels": list(channels), "layers_per_block": layers, "cross_attention_dim": 64,
                     "attention_head_dim": 8, "norm_num_groups": 32, "down_block_types": down,
                     "up_block_types": up},
            "vae": {"block_out_channels": [1] * 4}, "data": {"image_size": latent_side * 8}}


def saved_for_backward_bytes(arch: dict, batch: int) -> int:
    u = arch["unet"]
    side = arch["data"]["image_size"] // 8
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=side, in_channels=4, out_channels=4, down_block_types=tuple(u["down_block_types"]),
        up_block_types=tuple(u["up_block_types"]), block_out_channels=tuple(u["block_out_channels"]),
        layers_per_block=u["layers_per_block"], cross_attention_dim=u["cross_attention_dim"],
        attention_head_dim=u["attention_head_dim"], norm_num_groups=u["norm_num_groups"])
    unet.train()
    params = {p.untyped_storage().data_ptr() for p in unet.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(batch, 4, side, side)
    text = torch.randn(batch, 77, u["cross_attention_dim"])
    timesteps = torch.randint(0, 1000, (batch,))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = unet(x, timesteps, text, return_dict=False)[0]
        torch.nn.functional.mse_loss(out, x)
    return sum(saved.values())


@pytest.mark.parametrize("channels, latent_side, layers", [((32, 64, 128, 128), 32, 2), ((32, 64), 16, 1)])
def test_unet_activation_estimate_matches_what_autograd_saves(channels, latent_side, layers):
    arch = unet_arch(channels, latent_side, layers)
    measured = saved_for_backward_bytes(arch, batch=2)
    estimated = activations.unet_activation_bytes(arch, 2, act=4, autocast=False, recompute=False)
    assert abs(estimated - measured) / measured < 0.05, (estimated, measured)
