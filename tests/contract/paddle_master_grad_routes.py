"""Two routes to bf16 O2 master gradients under Paddle's ``group_sharded_parallel`` stage 2, on the CPU
test device, against one process training the whole batch (run by test_paddle_sharding.py under
``paddle.distributed.launch`` with the test device's environment; rank 0 writes the losses as JSON)::

    python -m paddle.distributed.launch --nproc_per_node 2 paddle_master_grad_routes.py OUT.json

* ``decorate``: ``paddle.amp.decorate(level="O2", master_weight=True, master_grad=True)`` then
  ``group_sharded_parallel(level="os_g")`` — what xfw's adapter did before PaddleNLP's route;
* ``main_grad``: ``MixPrecisionLayer`` / ``MixPrecisionOptimizer`` (fp32 ``main_grad``) then the same —
  PaddleNLP's Trainer's route, and xfw's now;
* ``reference``: the same model and data in one process (each rank computes it alone, no collectives),
  the ``main_grad`` route without sharding over the whole batch.
"""

import json
import sys

from xfw_paddle import testdevice

paddle = testdevice.activate()

import paddle.distributed as dist  # noqa: E402
from paddle.distributed import fleet  # noqa: E402
from paddle.distributed.fleet.utils import mix_precision_utils as mp  # noqa: E402
from paddle.distributed.sharding import group_sharded_parallel  # noqa: E402

STEPS, WIDTH, BATCH = 8, 64, 8


def model_and_data():
    paddle.seed(0)
    model = paddle.nn.Sequential(paddle.nn.Linear(WIDTH, WIDTH), paddle.nn.GELU(), paddle.nn.Linear(WIDTH, WIDTH),
                                 paddle.nn.GELU(), paddle.nn.Linear(WIDTH, 1))
    x = paddle.randn([BATCH, WIDTH])
    y = (x[:, :1] * 0.5 + 0.1).astype("float32")
    return model, x, y


def optimizer_for(model):
    return paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters(), multi_precision=True)


def train(route: str, rank: int, size: int) -> list[float]:
    model, x, y = model_and_data()
    if route != "reference":  # each rank its share of the batch
        share = BATCH // size
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    optimizer = optimizer_for(model)
    if route == "decorate":
        model, optimizer = paddle.amp.decorate(models=model, optimizers=optimizer, level="O2", dtype="bfloat16",
                                               master_weight=True, master_grad=True)
    else:
        model = paddle.amp.decorate(models=model, level="O2", dtype="bfloat16")
        mp.MixPrecisionLayer(model, dtype="bfloat16")
        optimizer = mp.MixPrecisionOptimizer(optimizer)
    if route != "reference":
        hcg = fleet.get_hybrid_communicate_group()
        model, optimizer, _ = group_sharded_parallel(model, optimizer, level="os_g",
                                                     group=hcg.get_sharding_parallel_group(),
                                                     dp_group=hcg.get_data_parallel_group())
    losses = []
    for _ in range(STEPS):
        with paddle.amp.auto_cast(level="O2", dtype="bfloat16"):
            loss = paddle.nn.functional.mse_loss(model(x).astype("float32"), y)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()  # as the Trainer calls it (the sharded optimizers take no argument)
        whole = loss.detach().clone()
        if route != "reference":  # the mean over the ranks' shares: the loss of the whole batch
            dist.all_reduce(whole)
            whole = whole / size
        losses.append(float(whole.numpy()))
    return losses


def main(out: str) -> None:
    strategy = fleet.DistributedStrategy()
    size = dist.get_world_size()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": size}
    fleet.init(is_collective=True, strategy=strategy)
    rank = dist.get_rank()
    result = {route: train(route, rank, size) for route in ("reference", "main_grad", "decorate")}
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
