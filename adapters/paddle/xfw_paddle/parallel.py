"""Data parallelism, ZeRO sharding and master gradients for the Paddle side, as PaddleNLP's Trainer
applies them (``paddlenlp/trainer/trainer.py`` of the paddlenlp 3.0.0b4 wheel the Paddle environment
pins: ``Trainer._wrap_model`` L2070-2250, the ``dp_master_grad`` all-reduce in the training loop
L1128-1170, ``create_optimizer`` L1834-1865), chosen from the neutral settings (docs/design.md §11).

The wrappers, in the order they are applied (the session does 1, this module the rest):

1. O2: ``paddle.amp.decorate(models=model, level="O2", dtype)`` and ``AdamW(multi_precision=True)``
   (fp32 master weights; the Trainer's ``_wrap_amp_model`` and ``create_optimizer``).
2. Master gradients (O2, the Trainer's ``amp_master_grad``): ``MixPrecisionLayer`` hooks on every
   parameter accumulate each gradient into an fp32 ``main_grad`` and free the low-precision one;
   ``MixPrecisionOptimizer`` steps on ``main_grad``
   (``paddle.distributed.fleet.utils.mix_precision_utils``). One process: hooks, then step.
3. ``parallel.sharding``:

   ========  ==========================================================================================
   none      ``paddle.DataParallel(find_unused_parameters=...)``; with master gradients the hooks go on
             after DataParallel, every micro-batch runs under ``no_sync`` and the fp32 ``main_grad``
             are all-reduced once after the last (``fused_allreduce_gradients``), as the Trainer does
   stage1    ``fleet`` sharding (``DygraphShardingOptimizer``: optimizer states); hooks before
             ``fleet.distributed_model``
   stage2    ``group_sharded_parallel(level="os_g")``; stage3 ``level="p_g_os"``: hooks and
             ``MixPrecisionOptimizer`` first, then the Trainer's options: ``group`` = the hybrid
             group's sharding group, ``dp_group`` = its data-parallel group (one rank here),
             ``exclude_layer=["GroupNorm"]``, ``scaler=None``, ``offload=False``; ``segment_size``,
             ``buffer_max_size``, ``sync_comm`` and ``sync_buffers`` at Paddle's defaults (the
             Trainer passes none of them: with ``segment_size`` 2**20 a tiny model's parameters
             are all below it, so stage 3 slices none of them and all-reduces their gradients)
   ========  ==========================================================================================

   fp16 adds a ``GradScaler``: ``MixPrecisionScaler`` patches it to unscale ``main_grad``, and
   stage 2/3 wrap it in ``GroupShardedScaler``.

   Communication overlap (``applied.mechanisms.comm_overlap``): stage 2 reduces each gradient
   bucket from a backward hook with ``sync_op=True``, so the backward waits for every reduce, unless
   ``stage2_overlap`` is on: then, as PaddleNLP's Trainer does for ``sharding_parallel_config``
   ``enable_stage2_overlap`` (paddlenlp 3.0.0b3 ``trainer.py`` L2133-2135; the option's default is
   ``""``, ``training_args.py`` L703-704), ``_set_reduce_overlap(True)`` makes the reduces
   asynchronous (waited for before the step) and ``_set_broadcast_overlap(True, model)`` overlaps
   the post-step broadcasts with the next forward. DataParallel all-reduces buckets during the
   backward; with master gradients the fp32 ``main_grad`` are all-reduced after it; stage 1 reduces
   at the step; stage 3 all-reduces from backward hooks with ``sync_op=True``.

``group_sharded_parallel`` asserts a GPU, XPU or custom device: it runs on a GPU, or on CPU
through xfw's CPU test device (``backends.paddle.device: testcpu``); on a plain CPU it is
``unsupported``. ``paddle.distributed.launch`` starts the processes; its environment says which
one this is.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import paddle
import paddle.distributed as dist
from paddle import nn

from xfw.contract.harness import InvalidSpec, Unsupported

IMPLS = {"none": "data_parallel", "stage1": "fleet_sharding_stage1", "stage2": "group_sharded_os_g",
         "stage3": "group_sharded_p_g_os"}
NEUTRAL = {"none": "data_parallel", "stage1": "zero1", "stage2": "zero2", "stage3": "zero3"}
"""The strategy under a neutral name, for the mechanisms both sides report."""
LEVELS = {"stage2": "os_g", "stage3": "p_g_os"}
EXCLUDE_LAYER = ["GroupNorm"]  # what the Trainer passes to group_sharded_parallel


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


@dataclass
class Parallel:
    """What :func:`apply_parallel` made: the layer and optimizer to train with, and what they are."""

    layer: nn.Layer
    optimizer: object
    scaler: object | None
    impl: str
    """``applied["sharding_impl"]``: none, or a value of :data:`IMPLS`."""
    detail: str
    """The mechanism in Paddle's words (``group_sharded_parallel os_g``, ...)."""
    master_grads: bool
    find_unused: bool | None = None
    """DataParallel's ``find_unused_parameters`` (None: no DataParallel)."""
    group: object | None = None
    """The group a sharded gradient norm is summed over (stage 1/2/3: each rank applies its own share)."""
    overlap: bool = False
    """Stage 2's communication overlap (``stage2_overlap``) is on."""

    @property
    def neutral(self) -> str:
        return "none" if self.impl == "none" else NEUTRAL[next(k for k, v in IMPLS.items() if v == self.impl)]


def add_master_grads(layer: nn.Layer, optimizer, dtype: str):
    """fp32 ``main_grad`` hooks on every parameter of ``layer`` (the wrapper the Trainer discards:
    only its hooks matter) and the optimizer that steps on them."""
    from paddle.distributed.fleet.utils import mix_precision_utils as mp

    mp.MixPrecisionLayer(layer, dtype=dtype)  # asserts a low-precision dtype: it names the AMP dtype
    return mp.MixPrecisionOptimizer(optimizer)


def _master_scaler(scaler, *, fleet_ready: bool = True):
    """``MixPrecisionScaler`` patches the scaler in place to unscale ``main_grad``; its unscale asks
    fleet for the hybrid group, so fleet is initialised first where nothing else did (one process,
    DataParallel: a data-parallel group of every rank)."""
    if scaler is not None:
        from paddle.distributed import fleet
        from paddle.distributed.fleet.utils import mix_precision_utils as mp

        if not fleet_ready:
            fleet.init(is_collective=True)
        mp.MixPrecisionScaler(scaler)
    return scaler


def apply_parallel(layer: LossLayer, optimizer, *, spec: dict, sharding_device: bool, find_unused: bool,
                   master_dtype: str | None, scaler=None, segment_size: int | None = None,
                   stage2_overlap: bool = False) -> Parallel:
    """Wrap for the spec's world size and sharding. ``sharding_device``: group_sharded_parallel can
    run here (GPU or the CPU test device); ``master_dtype``: the AMP dtype when master gradients
    are asked for (O2), else None; ``stage2_overlap``: stage 2's communication overlap (module docstring)."""
    _, size, _ = world()
    if size != spec["derived"]["num_processes"]:
        raise InvalidSpec(f"parallel: the spec asks for {spec['derived']['num_processes']} processes, "
                          f"the launcher started {size}")
    sharding = spec["parallel"]["sharding"]
    master = master_dtype is not None
    if size == 1:
        if sharding != "none":
            raise Unsupported(f"sharding {sharding} needs more than one process")
        if master:
            optimizer, scaler = add_master_grads(layer, optimizer, master_dtype), _master_scaler(scaler, fleet_ready=False)
        return Parallel(layer, optimizer, scaler, "none", "one process", master)
    impl = IMPLS[sharding]
    if sharding in LEVELS and not sharding_device:
        raise Unsupported(f"sharding {sharding} (group_sharded_parallel) needs a GPU or a custom device in Paddle: "
                          "on a CPU set backends.paddle.device=testcpu")
    if sharding == "none":
        dist.init_parallel_env()
        layer = paddle.DataParallel(layer, find_unused_parameters=find_unused)
        if master:
            optimizer, scaler = add_master_grads(layer, optimizer, master_dtype), _master_scaler(scaler, fleet_ready=False)
        detail = f"paddle.DataParallel(find_unused_parameters={find_unused})"
        return Parallel(layer, optimizer, scaler, impl, detail, master, find_unused=find_unused)
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": size}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    if master:
        optimizer, scaler = add_master_grads(layer, optimizer, master_dtype), _master_scaler(scaler)
    if sharding == "stage1":
        if scaler is not None:
            scaler = fleet.distributed_scaler(scaler)
        return Parallel(fleet.distributed_model(layer), fleet.distributed_optimizer(optimizer), scaler, impl,
                        "fleet DygraphShardingOptimizer", master, group=hcg.get_sharding_parallel_group())
    from paddle.distributed.sharding import group_sharded_parallel

    group = hcg.get_sharding_parallel_group()
    extra = {"segment_size": segment_size} if segment_size else {}  # the Trainer passes none: Paddle's default
    layer, optimizer, _ = group_sharded_parallel(layer, optimizer, level=LEVELS[sharding], scaler=None, group=group,
                                                 offload=False, dp_group=hcg.get_data_parallel_group(),
                                                 exclude_layer=list(EXCLUDE_LAYER), **extra)
    if scaler is not None:
        from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_utils import GroupShardedScaler

        scaler = GroupShardedScaler(scaler)
    overlap = stage2_overlap and LEVELS[sharding] == "os_g"
    if overlap:  # the Trainer's enable_stage2_overlap, in its order
        layer._set_reduce_overlap(True)
        optimizer._set_broadcast_overlap(True, layer)
    detail = (f"group_sharded_parallel {LEVELS[sharding]}" + (f" segment_size={segment_size}" if extra else "")
              + (" with reduce and broadcast overlap" if overlap else ""))
    return Parallel(layer, optimizer, scaler, impl, detail, master, group=group, overlap=overlap)


def comm_overlap(wrapped: Parallel, num_ranks: int) -> str:
    """Whether gradient communication overlaps computation, in words both adapters share: ``overlapped: ...``,
    ``none: ...`` or ``n/a (one process)`` (module docstring)."""
    if num_ranks == 1:
        return "n/a (one process)"
    if wrapped.impl == IMPLS["none"]:
        return ("none: the fp32 main_grad are all-reduced after the last backward (fused_allreduce_gradients)"
                if wrapped.master_grads else "overlapped: DataParallel all-reduces gradient buckets during the backward")
    if wrapped.impl == IMPLS["stage1"]:
        return "none: fleet sharding stage 1 reduces the gradients at the step, after the backward"
    if wrapped.impl == IMPLS["stage2"]:
        return ("overlapped: asynchronous gradient reduces during the backward, post-step broadcasts during the next "
                "forward (stage2_overlap)" if wrapped.overlap else
                "none: stage 2 reduces each gradient bucket synchronously (sync_op=True) from the backward hooks "
                "(stage2_overlap off)")
    return "none: stage 3 all-reduces the gradients synchronously (sync_op=True) from the backward hooks"


def gradient_sync(wrapped: Parallel, enabled: bool):
    """DataParallel all-reduces on the last micro-batch only; with master gradients never (the fp32
    ``main_grad`` are all-reduced after it: :func:`after_backward`); sharding reduces on its own."""
    if wrapped.impl != "data_parallel" or (enabled and not wrapped.master_grads):
        return contextlib.nullcontext()
    return wrapped.layer.no_sync()


def after_backward(wrapped: Parallel) -> None:
    """After the last micro-batch: DataParallel with master gradients all-reduces the fp32
    ``main_grad`` (averaged over the ranks), as the Trainer's ``fused_allreduce_gradients``."""
    if wrapped.impl == "data_parallel" and wrapped.master_grads:
        from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

        fused_allreduce_gradients(list(wrapped.layer.parameters()), None)


def clear_grad(wrapped: Parallel) -> None:
    """Gradients released after the step; stage 2/3 zero their own buffers (their ``clear_grad``
    takes no argument, as the Trainer calls it)."""
    if wrapped.impl in (IMPLS["stage2"], IMPLS["stage3"]):
        wrapped.optimizer.clear_grad()
    else:
        wrapped.optimizer.clear_grad(set_to_zero=False)


class NormRecorder:
    """Installed as the innermost optimizer's gradient clip (around the clip it had): sees the
    gradients exactly as the optimizer applies them — reduced, averaged, unscaled, fp32
    ``main_grad`` where master gradients are on — and keeps their global L2 norm (float64 sums;
    under stage 1/2/3 each rank sums the share it applies, summed over the group; parameters stage 3
    leaves unsliced are held whole by every rank and counted once)."""

    def __init__(self, clip, group=None):
        self.clip, self.group, self.norm = clip, group, None

    @paddle.no_grad()
    def __call__(self, params_grads):
        sliced, whole = [], []
        for p, g in params_grads:
            if g is not None:
                square = g.astype("float64").square().sum()
                (whole if self.group is None or hasattr(p, "unslice") else sliced).append(square)
        total = paddle.add_n(whole) if whole else paddle.zeros([], dtype="float64")
        if self.group is not None:
            part = (paddle.add_n(sliced) if sliced else paddle.zeros([], dtype="float64")).astype("float32")
            dist.all_reduce(part, group=self.group)
            total = total + part.astype("float64")
        self.norm = total.sqrt()
        return self.clip(params_grads) if self.clip is not None else params_grads


def record_grad_norm(optimizer, wrapped: Parallel) -> NormRecorder:
    """Put a :class:`NormRecorder` in ``optimizer``'s clip (the AdamW the session built: the
    sharding wrappers set their own clip on it, so this goes on after them)."""
    recorder = NormRecorder(optimizer._grad_clip, wrapped.group)
    optimizer._grad_clip = recorder
    return recorder


def grads_held(params) -> str:
    """What holds this rank's gradients before the optimizer step, as seen: ``float32 main_grad``,
    ``bfloat16 grad``, ... (the master-gradient route checked, not assumed)."""
    seen = set()
    for p in params:
        # stage 3 keeps this rank's slice of the reduced gradient in bw_storage until the step
        kind = "main_grad" if hasattr(p, "main_grad") else "grad"
        for name, g in (("main_grad", getattr(p, "main_grad", None)), ("grad", p.grad),
                        (kind, getattr(p, "bw_storage", None))):
            if g is not None:
                seen.add(f"{str(g.dtype).removeprefix('paddle.')} {name}")
    return ", ".join(sorted(seen)) or "none on this rank"
