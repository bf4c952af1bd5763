"""A ppdiffusers text-to-image loop shaped like PaddleMIX's example script, on a tiny SD1.5 built
here at random (no download, no xfw): Paddle imported through ``importlib`` after a spec look-up
(not from a thread: Paddle's dygraph mode is per thread), PaddleNLP's CLIP text encoder, ppdiffusers' UNet with gradient
checkpointing and LoRA-style trainable adapters only, gradient accumulation, ``paddle.amp.auto_cast``.

    python paddle_ppdiffusers_lora.py --max-steps 40 --batch 4 --accum 2 --amp bfloat16
"""

import argparse
import importlib
import importlib.util

assert importlib.util.find_spec("paddle") is not None
paddle = importlib.import_module("paddle")
import paddle.nn.functional as F  # noqa: E402
from paddlenlp.transformers import CLIPTextConfig, CLIPTextModel  # noqa: E402
from ppdiffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel  # noqa: E402

UNET = dict(sample_size=16, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
            attention_head_dim=2, norm_num_groups=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
VAE = dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, latent_channels=4,
           down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=1000,
            max_position_embeddings=16, hidden_act="quick_gelu")


class Captions(paddle.io.Dataset):
    def __init__(self, n: int):
        paddle.seed(0)
        self.pixels, self.ids = paddle.randn([n, 3, 32, 32]), paddle.randint(0, 1000, [n, 16])

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        return {"pixel_values": self.pixels[i], "input_ids": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--amp", default="bfloat16", choices=["no", "bfloat16", "float16"])
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    args = parser.parse_args()
    paddle.seed(0)
    unet, vae = UNet2DConditionModel(**UNET), AutoencoderKL(**VAE)
    text_encoder = CLIPTextModel(CLIPTextConfig(**TEXT))
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                              beta_end=0.012)
    for module in (unet, vae, text_encoder):
        for p in module.parameters():
            p.stop_gradient = True
    trained = [p for n, p in unet.named_parameters() if "attn" in n and n.endswith("to_q.weight")]
    for p in trained:  # a few trained matrices stand in for the LoRA adapters
        p.stop_gradient = False
    if not args.no_gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=trained)
    loader = paddle.io.DataLoader(Captions(args.max_steps * args.batch * args.accum), batch_size=args.batch,
                                  shuffle=True)
    print("***** Running training *****", flush=True)
    step = 0
    for i, batch in enumerate(loader):
        with paddle.amp.auto_cast(enable=args.amp != "no", dtype=args.amp if args.amp != "no" else "float32"):
            latents = vae.encode(batch["pixel_values"]).latent_dist.sample() * 0.18215
            noise = paddle.randn(latents.shape)
            t = paddle.randint(0, 1000, [latents.shape[0]])
            noisy = scheduler.add_noise(latents, noise, t)
            hidden = text_encoder(batch["input_ids"])[0]
            pred = unet(noisy, t, hidden).sample
            loss = F.mse_loss(pred.astype("float32"), noise.astype("float32")) / args.accum
        loss.backward()
        if (i + 1) % args.accum == 0:
            optimizer.step()
            optimizer.clear_grad()
            step += 1
            print(f"Steps: {step}/{args.max_steps} loss {float(loss):.4f}", flush=True)
            if step >= args.max_steps:
                break


if __name__ == "__main__":
    main()
