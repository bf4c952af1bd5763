"""Where PyTorch's harness-overhead residual lies: the PyTorch adapter's ``train_step`` against the
bare loop's body (the family's loss under the session's autocast, backward, step, zero grad) on
the same session and batches, one step each, alternated (ABBA), no harness at all::

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 .venv/torch/bin/python benchmarks/train_step_vs_bare.py recipes/tiny/llava_sft.yaml

Prints the median of (bare step's CPU time / train_step's CPU time) over 600 pairs and its 95%
interval (distribution-free, :func:`harness_overhead.median_ci`). Results: results/cpu/harness-overhead/README.md.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness_overhead as ho  # noqa: E402 - puts this checkout's xfw and adapters on the path

from xfw.contract.synthetic import make_pool  # noqa: E402
from xfw.recipe import load_recipe  # noqa: E402
from xfw.recipe.spec import resolve_spec

PAIRS = 600


def main(recipe: str) -> None:
    from xfw_torch.families import family_module

    spec = resolve_spec(load_recipe(ho.ROOT / recipe, []), backend="torch", run_id="train-step")
    session, _, _ = ho._torch_loop(spec)
    pool = [session.to_device(b) for b in make_pool(spec, 0)]
    loss_fn = family_module(spec["model"]["family"]).loss_fn
    model, optimizer = session.model, session.optimizer

    def body(batch) -> None:
        with session._autocast():
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    steps = (body, lambda batch: session.train_step([batch]))
    for _ in range(5):
        for step in steps:
            step(pool[0])
    ratios = []
    gc.disable()
    for i in range(PAIRS):
        if i % ho.COLLECT_EVERY == 0:
            gc.collect()
        spent = {}
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            t0 = time.process_time()
            steps[k](pool[i % len(pool)])
            spent[k] = time.process_time() - t0
        ratios.append(spent[0] / spent[1])
    lo, hi = ho.median_ci(ratios)
    print(f"{recipe}: bare / train_step CPU time, median {statistics.median(ratios):.4f} over {PAIRS} pairs, "
          f"95% interval [{lo:.4f}, {hi:.4f}]")


if __name__ == "__main__":
    main(sys.argv[1])
