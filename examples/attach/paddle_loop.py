"""Fine-tune the tiny LLaVA with a hand-written Paddle loop (DataLoader, AdamW, accumulation):
no Trainer and no xfw in it.

    python paddle_loop.py --max-steps 40 --batch 4 --accum 2
"""

import argparse
import time

import paddle

from tiny_llava_paddle import SyntheticImageText, build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4, help="micro-batch")
    parser.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--print-step-times", action="store_true",
                        help="print each optimizer step's host time, as many scripts log their own speed")
    args = parser.parse_args()
    model = build_model()
    model.train()
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=[p for p in model.parameters()
                                                                       if not p.stop_gradient])
    data = paddle.io.DataLoader(SyntheticImageText(args.max_steps * args.batch * args.accum),
                                batch_size=args.batch, shuffle=True)
    last = time.perf_counter()
    for i, batch in enumerate(data):
        (loss,) = model(**batch)
        (loss / args.accum).backward()
        if (i + 1) % args.accum == 0:
            optimizer.step()
            optimizer.clear_grad()
            if args.print_step_times:  # host time: on a GPU this would need a synchronize to mean anything
                now = time.perf_counter()
                print(f"step {(i + 1) // args.accum} time_s {now - last:.6f}", flush=True)
                last = now
            if (i + 1) // args.accum % 10 == 0:
                print(f"step {(i + 1) // args.accum}: loss {float(loss):.4f}", flush=True)


if __name__ == "__main__":
    main()
