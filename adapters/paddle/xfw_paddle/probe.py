"""The probe's Paddle hooks: where an unmodified Paddle command's steps, batches, model and
settings become visible to xfw (``xfw.contract.probe`` does the rest, the same for PyTorch).

Installed when the script imports ``paddle`` (never imported here before that), and, when it
imports ``paddlenlp.trainer.trainer``, into PaddleNLP's ``Trainer``:

* step ends: ``step`` (and ``minimize``) of ``paddle.optimizer.Optimizer`` and of every subclass
  that overrides it (AdamW does), existing or defined later; a step calling another one (a
  wrapper's, a subclass's ``super().step()``) counts once; with a PaddleNLP
  ``Trainer``, a callback's ``on_step_end`` instead, added to every Trainer as it is built;
* the modules: ``paddle.nn.Layer.__call__`` until the first step ends (then restored) sees every
  outermost layer called and reads the AMP state (level and dtype) as each layer runs;
* batches: a forward pre-hook (with keyword arguments) on each outermost layer, then on the model
  alone: what reached it with gradients on; ``paddle.io.DataLoader``'s iterators (``__next__``)
  as the fallback;
* timing and memory as the adapter's session does on GPU (CUDA events, the allocator's peaks);
  on CPU the clock and the process's peak RSS, like the PyTorch hooks (so both sides' CPU memory
  is the same kind of number).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from xfw.contract.env import cpu_model, package_versions
from xfw.contract.probe import observe
from xfw.contract.probe.trainer import attach_callback

VERSIONED = {"paddlepaddle": "paddle", "paddlenlp": "paddlenlp", "ppdiffusers": "ppdiffusers", "paddlemix": "paddlemix"}
"""Distribution -> module: a library's version is recorded when the script imported it."""


def hooks() -> dict:
    """Module name -> what to install once the script has imported it."""
    return {"paddle": install, "paddlenlp.trainer.trainer": install_trainer}


class PaddleFramework:
    name = "paddle"

    def __init__(self, paddle, probe):
        self.paddle, self.probe = paddle, probe
        self.gpu = False
        self._stepping = False
        self._depth = 0
        self._outer: Any = None
        self._restore_call = None
        self._input_hooks: dict[int, Any] = {}

    # -- hooks ------------------------------------------------------------------------------------------
    def install(self) -> None:
        paddle = self.paddle
        from paddle.io.dataloader import dataloader_iter

        self._patch_optimizers(paddle.optimizer.Optimizer)
        for cls in (dataloader_iter._DataLoaderIterSingleProcess, dataloader_iter._DataLoaderIterMultiProcess):
            cls.__next__ = self._counting_next(cls.__next__)

        Layer = paddle.nn.Layer
        original_call = Layer.__call__

        def __call__(layer, *args, **kwargs):
            if self._depth == 0:
                self._outer = layer
                self.probe.saw_model(self, layer)
            self.probe.saw_amp(self._outer, self._amp())  # as this layer runs
            self._depth += 1
            try:
                return original_call(layer, *args, **kwargs)
            finally:
                self._depth -= 1

        Layer.__call__ = __call__
        self._restore_call = lambda: setattr(Layer, "__call__", original_call)

    def _counting_next(self, original_next):
        def __next__(iterator):
            batch = original_next(iterator)
            self.probe.saw_batch(batch, getattr(iterator, "_dataset", iterator))
            return batch

        return __next__

    def _patch_optimizers(self, base) -> None:
        """``step`` and ``minimize`` of the optimizer base class and of every subclass that defines
        its own (AdamW does, without calling the base's ``__init__``), now and when one is defined."""

        def subclasses(cls):
            yield cls
            for sub in cls.__subclasses__():
                yield from subclasses(sub)

        for cls in list(subclasses(base)):
            self._patch_steps(cls)
        own = base.__dict__.get("__init_subclass__")

        def __init_subclass__(cls, **kwargs):
            own.__func__(cls, **kwargs) if own is not None else super(base, cls).__init_subclass__(**kwargs)
            self.probe.call(self._patch_steps, cls)

        base.__init_subclass__ = classmethod(__init_subclass__)

    def _patch_steps(self, cls) -> None:
        """A boundary after the outermost step returns (a wrapper's or a subclass's step calling
        another one counts once)."""
        for name in ("step", "minimize"):
            original = cls.__dict__.get(name)
            if original is None or getattr(original, "_xfw_probe", False):
                continue

            def wrapped(optimizer, *args, _original=original, **kwargs):
                if self._stepping:
                    return _original(optimizer, *args, **kwargs)
                self._stepping = True
                self.probe.optimizer_began(self)
                try:
                    result = _original(optimizer, *args, **kwargs)
                finally:
                    self._stepping = False
                self.probe.boundary(self, "optimizer", optimizer)
                return result

            wrapped._xfw_probe = True
            wrapped.__name__, wrapped.__doc__, wrapped.__wrapped__ = name, original.__doc__, original
            setattr(cls, name, wrapped)

    def stop_watching_forward(self) -> None:
        if self._restore_call is not None:
            self._restore_call()
            self._restore_call = None

    def watch_inputs(self, modules: list) -> None:
        keep = {id(m) for m in modules}
        for key in [k for k in self._input_hooks if k not in keep]:
            self._input_hooks.pop(key).remove()
        paddle = self.paddle

        def hook(layer, args, kwargs=None):
            if paddle.is_grad_enabled():
                self.probe.saw_forward(layer, args, kwargs or {})

        for layer in modules:
            if id(layer) not in self._input_hooks:
                try:
                    handle = layer.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
                except TypeError:  # Paddle before 3.0: positional inputs only
                    handle = layer.register_forward_pre_hook(hook)
                self._input_hooks[id(layer)] = handle

    def _amp(self) -> dict:
        amp = self.paddle.amp
        if not amp.is_autocast_enabled():
            return {"enabled": False, "dtype": None}
        level = str(self.paddle.framework._dygraph_tracer()._amp_level).rsplit(".", 1)[-1]  # AmpLevel.O2 -> O2
        return {"enabled": level != "O0", "dtype": str(amp.get_autocast_dtype()).removeprefix("paddle."),
                "level": level}

    # -- where the run is -----------------------------------------------------------------------------
    def start(self) -> None:
        self.gpu = self.paddle.is_compiled_with_cuda() and self.paddle.get_device().startswith("gpu")

    def rank(self) -> int:
        return int(os.environ.get("PADDLE_TRAINER_ID", os.environ.get("RANK", "0")))

    def world_size(self) -> int:
        return int(os.environ.get("PADDLE_TRAINERS_NUM", os.environ.get("WORLD_SIZE", "1")))

    # -- timing and memory (as xfw_paddle.session.PaddleSession on GPU) ---------------------------------
    def timestamp(self):
        if not self.gpu:
            return time.perf_counter()
        event = self.paddle.device.cuda.Event(enable_timing=True)
        event.record()
        return event

    def is_done(self, stamp) -> bool:
        return stamp.query() if self.gpu else True

    def elapsed_s(self, start, end) -> float:
        return start.elapsed_time(end) / 1000.0 if self.gpu else end - start

    def synchronize(self) -> None:
        if self.gpu:
            self.paddle.device.cuda.synchronize()

    def memory_peaks(self) -> tuple[int | None, int | None]:
        if self.gpu:
            cuda = self.paddle.device.cuda
            return int(cuda.max_memory_allocated()), int(cuda.max_memory_reserved())
        return observe.peak_rss_bytes(), None

    def mem_source(self) -> str:
        return "cuda_allocator" if self.gpu else "peak_rss"

    # -- what the objects show --------------------------------------------------------------------------
    def parameters(self, module: Any) -> list[tuple[int, int, bool]]:
        seen, out = set(), []
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((id(p), int(p.size), not p.stop_gradient))
        return out

    def count_params(self, model: Any, optimizer: Any) -> tuple[int, int]:
        if model is not None:
            params = model.parameters()
        else:
            params = list(getattr(optimizer, "_parameter_list", None) or [])
            params = [p for group in params for p in group["params"]] if params and isinstance(params[0], dict) else params
        seen, total, trainable = set(), 0, 0
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += int(p.size)
            trainable += int(p.size) if not p.stop_gradient else 0
        return total, trainable

    def facts(self, model: Any, wrapper: Any, optimizer: Any) -> dict:
        paddle = self.paddle
        inner = model
        while hasattr(inner, "_layers") and isinstance(inner._layers, paddle.nn.Layer):  # DataParallel
            inner = inner._layers
        dtypes: dict[str, int] = {}
        for p in (model.parameters() if model is not None else []):
            key = str(p.dtype).removeprefix("paddle.")
            dtypes[key] = dtypes.get(key, 0) + int(p.size)
        # The first PaddleNLP config in the model (a composed model keeps it on its language model).
        config = next((c for c in (getattr(m, "config", None) for m in ([inner, *inner.sublayers()] if inner else []))
                       if hasattr(c, "use_flash_attention")), None)
        attention = "unknown" if config is None else (
            "flash_attention" if config.use_flash_attention else "eager")
        return {
            "framework_version": paddle.__version__,
            "device": paddle.get_device() if self.gpu else "cpu",
            "device_name": paddle.device.cuda.get_device_name() if self.gpu else cpu_model(),
            "weight_dtype": observe.majority(dtypes), "attention_impl": attention,
            "recompute": bool(getattr(config, "recompute", False))
            or any(_checkpointing(m) for m in self.probe.modules.values()),
            "sharding_impl": self._sharding(wrapper or model, optimizer),
            "master_weights": bool(getattr(optimizer, "_multi_precision", False)),
            "fused_optimizer": False,
            # On by default in Paddle's CUDA builds (see xfw_paddle.session.PaddleSession.applied).
            "tf32": bool(self.gpu and paddle.base.core.get_cublas_switch()),
            "versions": package_versions(tuple(d for d, m in VERSIONED.items() if m in sys.modules)),
        }

    def _sharding(self, wrapper: Any, optimizer: Any) -> str:
        names = {c.__name__ for c in type(wrapper).__mro__} if wrapper is not None else set()
        optimizer_names = {c.__name__ for c in type(optimizer).__mro__} if optimizer is not None else set()
        if optimizer_names & {"DygraphShardingOptimizer", "DygraphShardingOptimizerV2"}:
            return "fleet_sharding_stage1"
        if names & {"GroupShardedStage2", "GroupShardedStage3"}:
            return "group_sharded_" + ("p_g_os" if "GroupShardedStage3" in names else "os_g")
        if "DataParallel" in names:
            return "data_parallel"
        return "none"


def _checkpointing(layer: Any) -> bool:
    """Recompute on anywhere in ``layer``: ppdiffusers' ``gradient_checkpointing`` flag on its blocks
    (or a model's ``is_gradient_checkpointing``), PaddleNLP's ``enable_recompute`` or ``config.recompute``."""
    if getattr(layer, "is_gradient_checkpointing", False) is True:
        return True
    for m in [layer, *layer.sublayers()]:
        flags = m.__dict__
        if flags.get("gradient_checkpointing") is True or flags.get("enable_recompute") is True \
                or getattr(flags.get("config"), "recompute", False) is True:
            return True
    return False


_FRAMEWORK: PaddleFramework | None = None


def install(paddle, probe) -> None:
    global _FRAMEWORK
    _FRAMEWORK = PaddleFramework(paddle, probe)
    probe.add_framework(_FRAMEWORK)
    _FRAMEWORK.install()


# -- PaddleNLP's Trainer ------------------------------------------------------------------------------

def trainer_settings(args) -> dict:
    """Applied-record fields a PaddleNLP ``TrainingArguments`` states."""
    compute = "bfloat16" if args.bf16 else "float16" if args.fp16 else None
    settings = {"compute_dtype": compute, "recompute": bool(args.recompute),
                "micro_batch": args.per_device_train_batch_size, "grad_accum_steps": args.gradient_accumulation_steps,
                "master_grad": bool(getattr(args, "amp_master_grad", False))}
    stages = [str(getattr(s, "value", s)) for s in (getattr(args, "sharding", None) or [])]
    if stages and getattr(args, "sharding_parallel_degree", 1) not in (1, -1, 0):
        settings["sharding_impl"] = "paddlenlp_sharding_" + "_".join(stages)
    return settings


def install_trainer(module, probe) -> None:
    from paddlenlp.trainer.trainer_callback import TrainerCallback

    attach_callback(module.Trainer, TrainerCallback, _FRAMEWORK, probe, trainer_settings)
