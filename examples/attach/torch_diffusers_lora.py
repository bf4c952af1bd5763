"""A diffusers text-to-image LoRA loop shaped like diffusers' own example script, on a tiny SD1.5
built here at random (no download, no xfw): transformers and peft imported before torch (with a
spec look-up first, as datasets does), accelerate with gradient accumulation and bf16 autocast,
its prefetching DataLoader, gradient checkpointing on the UNet, and a tqdm progress bar on
stderr after a weight-loading bar, as upstream scripts print.

    python torch_diffusers_lora.py --max-steps 40 --batch 4 --accum 2 --mixed-precision bf16
"""

import argparse
import importlib.util
import logging

assert importlib.util.find_spec("torch") is not None  # datasets/transformers/peft look torch up first
import transformers  # noqa: E402  (before torch, as most real scripts)
import peft  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

UNET = dict(sample_size=16, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
            attention_head_dim=2, norm_num_groups=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
VAE = dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, latent_channels=4,
           down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=1000,
            max_position_embeddings=16, hidden_act="quick_gelu")


class Captions(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.pixels, self.ids = torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 1000, (n, 16), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"pixel_values": self.pixels[i], "input_ids": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--mixed-precision", default="bf16", choices=["no", "bf16"])
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    args = parser.parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.accum, mixed_precision=args.mixed_precision)
    torch.manual_seed(0)
    for _ in tqdm(range(5), desc="Loading pipeline components"):  # a bar before training (not a step)
        pass
    unet, vae = UNet2DConditionModel(**UNET), AutoencoderKL(**VAE)
    text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(**TEXT))
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                              beta_end=0.012)
    weight_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    for module in (unet, vae, text_encoder):
        module.requires_grad_(False)
        module.to(accelerator.device, dtype=weight_dtype)
    unet.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                     target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    for p in unet.parameters():  # the trained adapters in fp32, as diffusers' cast_training_params does
        if p.requires_grad:
            p.data = p.data.float()
    if not args.no_gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-4)
    loader = torch.utils.data.DataLoader(Captions(args.max_steps * args.batch * args.accum), shuffle=True,
                                         batch_size=args.batch)
    unet, optimizer, loader = accelerator.prepare(unet, optimizer, loader)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s - %(message)s")  # to stderr, as upstream logs
    logging.getLogger(__name__).info("***** Running training *****")
    progress = tqdm(range(args.max_steps), desc="Steps")
    step = 0
    for batch in loader:
        with accelerator.accumulate(unet):
            latents = vae.encode(batch["pixel_values"].to(weight_dtype)).latent_dist.sample() * 0.18215
            noise = torch.randn_like(latents)
            t = torch.randint(0, 1000, (latents.shape[0],), device=latents.device).long()
            noisy = scheduler.add_noise(latents, noise, t)
            hidden = text_encoder(batch["input_ids"], return_dict=False)[0]
            pred = unet(noisy, t, hidden, return_dict=False)[0]
            loss = F.mse_loss(pred.float(), noise.float())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            progress.update(1)
            step += 1
            progress.set_postfix(loss=loss.item())
            if step >= args.max_steps:
                break


if __name__ == "__main__":
    main()
