"""Data parallelism and ZeRO sharding for the Paddle side, chosen from the neutral settings
(docs/design.md §11), applied after ``paddle.amp.decorate`` as Paddle's docs order it:

====================  =====================================================================
parallel.sharding     Paddle mechanism
====================  =====================================================================
none                  ``paddle.DataParallel``
stage1                ``fleet`` sharding (``DygraphShardingOptimizer``: optimizer states)
stage2                ``group_sharded_parallel(level="os_g")``   (GPU only)
stage3                ``group_sharded_parallel(level="p_g_os")`` (GPU only)
====================  =====================================================================

``paddle.distributed.launch`` starts the processes; its environment says which one this is.
Stage 2/3 are written to Paddle's documentation and have never run here (no Paddle GPU build
reaches the lent GPU); on CPU they are reported ``unsupported``.
"""

from __future__ import annotations

import contextlib
import os

import paddle
import paddle.distributed as dist
from paddle import nn

from xfw.contract.harness import InvalidSpec, Unsupported

IMPLS = {"none": "data_parallel", "stage1": "fleet_sharding_stage1", "stage2": "group_sharded_os_g",
         "stage3": "group_sharded_p_g_os"}


def world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from paddle.distributed.launch's environment."""
    return (int(os.environ.get("PADDLE_TRAINER_ID", "0")), int(os.environ.get("PADDLE_TRAINERS_NUM", "1")),
            int(os.environ.get("PADDLE_LOCAL_RANK", "0")))


class LossLayer(nn.Layer):
    """The model and its loss as one layer, so DataParallel and sharding see every forward."""

    def __init__(self, model: nn.Layer, loss_fn, autocast):
        super().__init__()
        self.model = model
        self._loss_fn, self._autocast = loss_fn, autocast

    def forward(self, **batch) -> paddle.Tensor:
        return self._loss_fn(self.model, batch, self._autocast)


def apply_parallel(layer: LossLayer, optimizer, *, spec: dict, gpu: bool, find_unused: bool):
    """Wrap for the spec's world size and sharding: (layer, optimizer, name of what was applied)."""
    _, size, _ = world()
    if size != spec["derived"]["num_processes"]:
        raise InvalidSpec(f"parallel: the spec asks for {spec['derived']['num_processes']} processes, "
                          f"the launcher started {size}")
    sharding = spec["parallel"]["sharding"]
    if size == 1:
        if sharding != "none":
            raise Unsupported(f"sharding {sharding} needs more than one process")
        return layer, optimizer, "none"
    impl = IMPLS[sharding]
    if sharding in ("stage2", "stage3") and not gpu:
        raise Unsupported(f"sharding {sharding} (group_sharded_parallel) is GPU-only in Paddle")
    if sharding == "stage1":
        from paddle.distributed import fleet

        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": size}
        fleet.init(is_collective=True, strategy=strategy)
        return fleet.distributed_model(layer), fleet.distributed_optimizer(optimizer), impl
    dist.init_parallel_env()
    if sharding == "none":
        return paddle.DataParallel(layer, find_unused_parameters=find_unused), optimizer, impl
    from paddle.distributed.sharding import group_sharded_parallel  # untested: GPU only

    layer, optimizer, _ = group_sharded_parallel(layer, optimizer, level="os_g" if sharding == "stage2" else "p_g_os")
    return layer, optimizer, impl


def gradient_sync(layer: nn.Layer, impl: str, enabled: bool):
    """Skip DataParallel's all-reduce on all but the last micro-batch; sharding reduces at step."""
    if enabled or impl != "data_parallel":
        return contextlib.nullcontext()
    return layer.no_sync()
