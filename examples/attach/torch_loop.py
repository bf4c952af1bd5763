"""Fine-tune the tiny LLaVA with a hand-written PyTorch loop (DataLoader, AdamW, accumulation):
no Trainer and no xfw in it.

    python torch_loop.py --max-steps 40 --batch 4 --accum 2
"""

import argparse
import time

import torch

from tiny_llava_torch import SyntheticImageText, build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4, help="micro-batch")
    parser.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--print-step-times", action="store_true",
                        help="print each optimizer step's host time, as many scripts log their own speed")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model().to(device).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    data = torch.utils.data.DataLoader(SyntheticImageText(args.max_steps * args.batch * args.accum),
                                       batch_size=args.batch, shuffle=True)
    last = time.perf_counter()
    for i, batch in enumerate(data):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        loss = model(**batch).loss / args.accum
        loss.backward()
        if (i + 1) % args.accum == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if args.print_step_times:  # host time: on a GPU this would need a synchronize to mean anything
                now = time.perf_counter()
                print(f"step {(i + 1) // args.accum} time_s {now - last:.6f}", flush=True)
                last = now
            if (i + 1) // args.accum % 10 == 0:
                print(f"step {(i + 1) // args.accum}: loss {loss.item() * args.accum:.4f}", flush=True)


if __name__ == "__main__":
    main()
