"""Data parallelism and ZeRO sharding for the PyTorch side, chosen from the neutral settings.

``apply_parallel(module, spec=..., units=..., device=..., dtype=...)`` wraps the loss module
once, in the one order that works (docs/design.md §11):

====================  =========================================================================
parallel.sharding     PyTorch mechanism (``backends.torch.sharding_impl`` picks among them)
====================  =========================================================================
none                  DDP
stage1                DDP + ZeroRedundancyOptimizer (optimizer states sharded: ZeRO-1)
stage2                FSDP2 ``fully_shard(reshard_after_forward=False)`` (≈ ZeRO-2), or
                      FSDP1 ``SHARD_GRAD_OP``
stage3                FSDP2 ``fully_shard(reshard_after_forward=True)`` (ZeRO-3), or
                      FSDP1 ``FULL_SHARD``
stage1/2/3            or DeepSpeed ZeRO-1/2/3 (``sharding_impl: deepspeed``): the engine owns the
                      optimizer, gradient accumulation and, under O2, bf16/fp16 weights with fp32
                      master weights (:func:`deepspeed_engine`)
====================  =========================================================================

Order matters: FSDP shards each transformer block first and the root last, so every block
gathers its own parameters just in time; the optimizer is built afterwards, over the sharded
parameters. Under FSDP, O2 is FSDP's mixed precision (bf16 compute over fp32 shards, fp32
gradient reduction), so the fp32 shards are the master weights and no extra copy is kept.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from xfw.contract.harness import Unsupported

IMPLS = {
    "none": ("ddp",),
    "stage1": ("zero_redundancy", "deepspeed"),
    "stage2": ("fsdp2", "fsdp1", "deepspeed"),
    "stage3": ("fsdp2", "fsdp1", "deepspeed"),
}


def init_distributed(cuda: bool) -> tuple[int, int, torch.device]:
    """(rank, world size, this process's device) from torchrun's environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if world == 1:
        return 0, 1, device
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), world, device


class LossModule(torch.nn.Module):
    """The model and its loss as one module, so DDP/FSDP see every forward through their hooks."""

    def __init__(self, model: torch.nn.Module, loss_fn):
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn

    def forward(self, **batch) -> torch.Tensor:
        return self._loss_fn(self.model, batch)


def apply_parallel(module: LossModule, *, spec: dict, impl: str, units: list[torch.nn.Module], device: torch.device,
                   dtype: torch.dtype | None, find_unused: bool) -> tuple[torch.nn.Module, str]:
    """Wrap for the spec's world size and sharding with ``impl`` (one of :data:`IMPLS` for it, chosen
    by ``xfw_torch.mechanisms.Plan.sharding_impl``); returns (module, name of what was applied).

    ``dtype`` is the low-precision compute dtype under O2 (None otherwise); ``units`` are the
    blocks FSDP shards one by one.
    """
    if spec["derived"]["num_processes"] == 1:
        if spec["parallel"]["sharding"] != "none":
            raise Unsupported(f"sharding {spec['parallel']['sharding']} needs more than one process")
        return module, "none"
    cuda = device.type == "cuda"
    if impl == "deepspeed":
        return module, impl  # wrapped with its optimizer by deepspeed_engine, once the optimizer is known
    if impl in ("ddp", "zero_redundancy"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(module, device_ids=[device.index] if cuda else None, find_unused_parameters=find_unused)
        return wrapped, impl
    reshard = spec["parallel"]["sharding"] == "stage3"
    if impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
        for unit in units:
            fully_shard(unit, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(module, mp_policy=policy, reshard_after_forward=reshard)
        return module, "fsdp2"
    if not cuda:  # torch raises "FSDP needs a non-CPU accelerator device" at wrap time
        raise Unsupported("FSDP1 needs a GPU; on CPU use backends.torch.sharding_impl: fsdp2")
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    unit_ids = {id(u) for u in units}
    wrapped = FSDP(
        module, sharding_strategy=ShardingStrategy.FULL_SHARD if reshard else ShardingStrategy.SHARD_GRAD_OP,
        auto_wrap_policy=lambda m, recurse, nonwrapped_numel: recurse or id(m) in unit_ids,
        mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else None,
        use_orig_params=True, device_id=device if cuda else None,
    )
    return wrapped, "fsdp1"


def deepspeed_engine(module: LossModule, params: list, spec: dict, plan):
    """DeepSpeed's engine over the loss module: ZeRO stage from parallel.sharding, AdamW from the
    recipe (torch's implementation, so both sides of a comparison run the same update), the batch
    split from the spec, and O2 as DeepSpeed's bf16/fp16 mode (low-precision weights, fp32 master
    weights in the optimizer). O1 stays torch.autocast over the fp32 engine (the session's)."""
    try:
        import deepspeed
    except ImportError:
        raise Unsupported("backends.torch.sharding_impl: deepspeed is not installed in this environment "
                          "(make setup installs it)") from None
    opt, precision = spec["optimizer"], spec["precision"]
    config = {
        "train_micro_batch_size_per_gpu": spec["batch"]["micro"],
        "gradient_accumulation_steps": spec["derived"]["grad_accum_steps"],
        "train_batch_size": spec["batch"]["global"],
        "zero_optimization": {"stage": int(spec["parallel"]["sharding"].removeprefix("stage"))},
        "optimizer": {"type": "AdamW", "params": {"lr": opt["lr"], "betas": list(opt["betas"]), "eps": opt["eps"],
                                                  "weight_decay": opt["weight_decay"], "torch_adam": True,
                                                  "adam_w_mode": True}},
        "gradient_clipping": float(opt.get("max_grad_norm") or 0.0),
        "steps_per_print": 2**31 - 1,  # no progress lines of its own inside the measured window
        "wall_clock_breakdown": False,
    }
    if precision["amp_level"] == "O2":
        config["bf16" if precision["dtype"] == "bf16" else "fp16"] = {"enabled": True}
    config = plan.deepspeed_config(config, spec)  # backends.torch.deepspeed: the script's ZeRO options
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=params, config=config)
    return engine, deepspeed.__version__


def make_optimizer(params: list, impl: str, optimizer: dict, switches: dict) -> torch.optim.Optimizer:
    """AdamW with the recipe's settings; ``switches``: its implementation (fused / foreach), from the plan."""
    kwargs = dict(lr=optimizer["lr"], betas=tuple(optimizer["betas"]), eps=optimizer["eps"],
                  weight_decay=optimizer["weight_decay"], **switches)
    if impl == "zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def gradient_sync(module: torch.nn.Module, impl: str, enabled: bool):
    """Context for one micro-batch's backward: skip the gradient all-reduce until the last one."""
    if enabled or impl == "none":
        return contextlib.nullcontext()
    if impl == "fsdp2":
        module.set_requires_gradient_sync(False)
        return _ResyncOnExit(module)
    return module.no_sync()  # DDP and FSDP1


class _ResyncOnExit(contextlib.AbstractContextManager):
    def __init__(self, module):
        self.module = module

    def __exit__(self, *exc):
        self.module.set_requires_gradient_sync(True)
        return False
