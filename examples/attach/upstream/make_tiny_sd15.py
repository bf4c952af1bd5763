"""A tiny SD1.5 saved in diffusers' or ppdiffusers' format, and a captioned image folder, for running
the two libraries' own LoRA example scripts unmodified on a CPU (docs/attach.md, "The upstream scripts").

    python make_tiny_sd15.py torch  PIPELINE_DIR DATA_DIR   # in an environment with diffusers + transformers
    python make_tiny_sd15.py paddle PIPELINE_DIR DATA_DIR   # in one with ppdiffusers + paddlenlp

Sizes are the ``tiny-sd15`` preset's (xfw/contract/presets.py), weights random (no download); the
tokenizer is the tiny CLIP tokenizer in recipes/tiny/data/tokenizers/clip. DATA_DIR gets 32 random
48-px pictures with a metadata.jsonl of captions (an ``imagefolder``); where ``datasets`` is
installed, the same as a saved ``DatasetDict`` in DATA_DIR-dict (what PaddleMIX's ``_benchmark.py``
variant loads with ``--dataset_name``).
"""

import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

TOKENIZER = Path(__file__).resolve().parents[3] / "recipes" / "tiny" / "data" / "tokenizers" / "clip"
MAX_LENGTH = 16  # the text encoder's positions
UNET = dict(sample_size=16, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
            attention_head_dim=2, norm_num_groups=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
VAE = dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, latent_channels=4,
           down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=1000,
            max_position_embeddings=MAX_LENGTH, hidden_act="quick_gelu")
SCHEDULER = dict(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
SPECIAL = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
           "unk_token": "<|endoftext|>"}


def diffusers_pipeline(out: Path) -> None:
    import torch
    import transformers
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    torch.manual_seed(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER), model_max_length=MAX_LENGTH)
    StableDiffusionPipeline(
        unet=UNet2DConditionModel(**UNET), vae=AutoencoderKL(**VAE), scheduler=DDPMScheduler(**SCHEDULER),
        text_encoder=transformers.CLIPTextModel(transformers.CLIPTextConfig(**TEXT)), tokenizer=tokenizer,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False).save_pretrained(str(out))


def ppdiffusers_pipeline(out: Path) -> None:
    import paddle
    from paddlenlp.transformers import CLIPTextConfig, CLIPTextModel
    from ppdiffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

    paddle.seed(0)
    UNet2DConditionModel(**UNET).save_pretrained(str(out / "unet"))
    AutoencoderKL(**VAE).save_pretrained(str(out / "vae"))
    CLIPTextModel(CLIPTextConfig(**TEXT)).save_pretrained(str(out / "text_encoder"))
    DDPMScheduler(**SCHEDULER).save_pretrained(str(out / "scheduler"))
    # PaddleNLP's CLIPTokenizer reads vocab.json and merges.txt: both are inside tokenizer.json's BPE model.
    bpe = json.loads((TOKENIZER / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    tok = out / "tokenizer"
    tok.mkdir(parents=True, exist_ok=True)
    (tok / "vocab.json").write_text(json.dumps(bpe["vocab"]), encoding="utf-8")
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]
    (tok / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    (tok / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "CLIPTokenizer", "model_max_length": MAX_LENGTH, **SPECIAL}), encoding="utf-8")
    (out / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "scheduler": ["ppdiffusers", "DDPMScheduler"],
        "text_encoder": ["paddlenlp.transformers", "CLIPTextModel"],
        "tokenizer": ["paddlenlp.transformers", "CLIPTokenizer"], "unet": ["ppdiffusers", "UNet2DConditionModel"],
        "vae": ["ppdiffusers", "AutoencoderKL"], "safety_checker": [None, None],
        "feature_extractor": [None, None]}), encoding="utf-8")


def image_folder(data: Path) -> None:
    if not (data / "metadata.jsonl").exists():
        data.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        with open(data / "metadata.jsonl", "w", encoding="utf-8") as f:
            for i in range(32):
                Image.fromarray(rng.integers(0, 255, (48, 48, 3), dtype=np.uint8)).save(data / f"{i}.png")
                f.write(json.dumps({"file_name": f"{i}.png", "text": f"a picture number {i}"}) + "\n")
    try:
        from datasets import load_dataset
    except ImportError:
        return
    if not Path(f"{data}-dict").exists():
        load_dataset("imagefolder", data_dir=str(data)).save_to_disk(f"{data}-dict")


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] not in ("torch", "paddle"):
        sys.exit(__doc__.split("\n\n")[1])
    out, data = Path(sys.argv[2]), Path(sys.argv[3])
    (diffusers_pipeline if sys.argv[1] == "torch" else ppdiffusers_pipeline)(out)
    image_folder(data)
    print(f"{sys.argv[1]} pipeline in {out}, captioned images in {data}")


if __name__ == "__main__":
    main()
