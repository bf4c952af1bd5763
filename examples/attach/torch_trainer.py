"""Fine-tune the tiny LLaVA with transformers' Trainer: an ordinary Trainer script, no xfw in it.

    python torch_trainer.py --max-steps 40 --batch 4 --accum 2
"""

import argparse
import tempfile

import torch
from transformers import Trainer, TrainingArguments

from tiny_llava_torch import SyntheticImageText, build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4, help="per-device micro-batch")
    parser.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping (the Trainer's default is 1)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out, max_steps=args.max_steps, per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=args.accum, learning_rate=1e-3, max_grad_norm=args.max_grad_norm, optim="adamw_torch", bf16=args.bf16,
            use_cpu=not torch.cuda.is_available(), save_strategy="no", report_to=[], logging_steps=10,
            dataloader_num_workers=0, disable_tqdm=True)
        dataset = SyntheticImageText(args.max_steps * args.batch * args.accum)
        Trainer(model=build_model(), args=training, train_dataset=dataset).train()


if __name__ == "__main__":
    main()
