"""The probe's PyTorch hooks: where an unmodified PyTorch command's steps, batches, model and
settings become visible to xfw (``xfw.contract.probe`` does the rest, the same for Paddle).

Installed when the script imports ``torch`` (never imported here before that), and, when it
imports ``transformers.trainer``, into its ``Trainer``:

* step ends: PyTorch's global optimizer step hooks (every ``torch.optim.Optimizer``, DeepSpeed's
  and accelerate's included; a nested optimizer's step counts once); with a transformers
  ``Trainer``, a callback's ``on_step_end`` instead, added to every Trainer as it is built;
* the modules: global forward hooks until the first step ends (then removed: no cost after) see
  every outermost module called and read the autocast state as each layer runs (accelerate enters
  autocast inside the model's forward, not before it);
* batches: a forward pre-hook (with keyword arguments) on each outermost module, then on the
  model alone: what reached it with gradients on; ``torch.utils.data``'s DataLoader iterator
  (``__next__``) as the fallback;
* timing and memory as the adapter's session does: CUDA events and the caching allocator's peaks
  on GPU, the clock and the process's peak RSS on CPU.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from xfw.contract.env import cpu_model, package_versions
from xfw.contract.probe import observe
from xfw.contract.probe.trainer import attach_callback

LIBRARIES = ("transformers", "accelerate", "deepspeed", "peft", "diffusers", "trl")


def hooks() -> dict:
    """Module name -> what to install once the script has imported it."""
    return {"torch": install, "transformers.trainer": install_trainer}


class TorchFramework:
    name = "torch"

    def __init__(self, torch, probe):
        self.torch, self.probe = torch, probe
        self.cuda = False
        self._stepping = None  # the optimizer whose step is running (a nested one's step is not a boundary)
        self._depth = 0
        self._outer: Any = None
        self._forward_hooks: list = []
        self._input_hooks: dict[int, Any] = {}

    # -- hooks ------------------------------------------------------------------------------------------
    def install(self) -> None:
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim
        from torch.utils.data import dataloader

        def before_step(opt, args, kwargs):
            if self._stepping is None:
                self._stepping = opt
                self.probe.optimizer_began(self)

        def after_step(opt, args, kwargs):
            if self._stepping is opt:
                self._stepping = None
                self.probe.boundary(self, "optimizer", opt)

        optim.register_optimizer_step_pre_hook(before_step)
        optim.register_optimizer_step_post_hook(after_step)

        original_next = dataloader._BaseDataLoaderIter.__next__

        def __next__(iterator):
            batch = original_next(iterator)
            self.probe.saw_batch(batch, getattr(iterator, "_dataset", iterator))
            return batch

        dataloader._BaseDataLoaderIter.__next__ = __next__

        def before_forward(module, args):
            if self._depth == 0:
                self._outer = module
                first = id(module) not in self.probe.modules
                self.probe.saw_model(self, module)
                if first and args and self.torch.is_grad_enabled():  # its input hook starts with the next call
                    self.probe.saw_forward(module, args, {})
            self.probe.saw_amp(self._outer, self._autocast())  # as this layer runs
            self._depth += 1

        def after_forward(module, args, output):
            self._depth -= 1

        self._forward_hooks = [nn_module.register_module_forward_pre_hook(before_forward),
                               nn_module.register_module_forward_hook(after_forward, always_call=True)]

    def stop_watching_forward(self) -> None:
        for handle in self._forward_hooks:
            handle.remove()
        self._forward_hooks = []

    def watch_inputs(self, modules: list) -> None:
        keep = {id(m) for m in modules}
        for key in [k for k in self._input_hooks if k not in keep]:
            self._input_hooks.pop(key).remove()
        torch = self.torch

        def hook(module, args, kwargs):
            if torch.is_grad_enabled():
                self.probe.saw_forward(module, args, kwargs)

        for module in modules:
            if id(module) not in self._input_hooks:
                self._input_hooks[id(module)] = module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)

    def _autocast(self) -> dict:
        device = "cuda" if self.torch.cuda.is_available() and self.torch.cuda.is_initialized() else "cpu"
        enabled = self.torch.is_autocast_enabled(device)
        dtype = str(self.torch.get_autocast_dtype(device)).removeprefix("torch.") if enabled else None
        return {"enabled": enabled, "dtype": dtype}

    # -- where the run is -----------------------------------------------------------------------------
    def start(self) -> None:
        self.cuda = self.torch.cuda.is_available() and self.torch.cuda.is_initialized()

    def rank(self) -> int:
        dist = self.torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return int(os.environ.get("RANK", "0"))

    def world_size(self) -> int:
        dist = self.torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return int(os.environ.get("WORLD_SIZE", "1"))

    # -- timing and memory (as xfw_torch.session.TorchSession) -------------------------------------------
    def timestamp(self):
        if not self.cuda:
            return time.perf_counter()
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def is_done(self, stamp) -> bool:
        return stamp.query() if self.cuda else True

    def elapsed_s(self, start, end) -> float:
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start

    def synchronize(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def memory_peaks(self) -> tuple[int | None, int | None]:
        if self.cuda:
            return self.torch.cuda.max_memory_allocated(), self.torch.cuda.max_memory_reserved()
        return observe.peak_rss_bytes(), None

    def mem_source(self) -> str:
        return "cuda_allocator" if self.cuda else "peak_rss"

    # -- what the objects show --------------------------------------------------------------------------
    def parameters(self, module: Any) -> list[tuple[int, int, bool]]:
        seen, out = set(), []
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((id(p), getattr(p, "ds_numel", None) or p.numel(), bool(p.requires_grad)))
        return out

    def count_params(self, model: Any, optimizer: Any) -> tuple[int, int]:
        params = list(model.parameters()) if model is not None else \
            [p for group in getattr(optimizer, "param_groups", []) for p in group["params"]]
        seen, total, trainable = set(), 0, 0
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = getattr(p, "ds_numel", None) or p.numel()  # ZeRO-3 keeps a partition; ds_numel is the whole
            total += n
            trainable += n if p.requires_grad else 0
        return total, trainable

    def facts(self, model: Any, wrapper: Any, optimizer: Any) -> dict:
        torch = self.torch
        inner = model
        while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):  # DDP, DeepSpeed
            inner = inner.module
        dtypes: dict[str, int] = {}
        for p in (model.parameters() if model is not None else []):
            key = str(p.dtype).removeprefix("torch.")
            dtypes[key] = dtypes.get(key, 0) + p.numel()
        # The first transformers config in the model (a composed model keeps it on its parts).
        config = next((c for c in (getattr(m, "config", None) for m in (inner.modules() if inner is not None else []))
                       if hasattr(c, "_attn_implementation")), None)
        sharding, masters = self._sharding(wrapper or model, optimizer)
        return {
            "framework_version": torch.__version__,
            "device": f"cuda:{torch.cuda.current_device()}" if self.cuda else "cpu",
            "device_name": torch.cuda.get_device_name() if self.cuda else cpu_model(),
            "weight_dtype": observe.majority(dtypes),
            "attention_impl": str(getattr(config, "_attn_implementation", None) or "unknown"),
            "recompute": any(_checkpointing(m) for m in self.probe.modules.values()),
            "sharding_impl": sharding, "master_weights": masters,
            "fused_optimizer": bool(getattr(optimizer, "defaults", {}).get("fused")),
            "tf32": bool(self.cuda and torch.backends.cuda.matmul.allow_tf32),
            "versions": {"torch": torch.__version__,
                         **package_versions(tuple(n for n in LIBRARIES if n in sys.modules))},
        }

    def _sharding(self, wrapper: Any, optimizer: Any) -> tuple[str, bool]:
        """(how the model is sharded or replicated, whether fp32 master weights live elsewhere),
        from the wrapper's and the optimizer's classes (no import of DeepSpeed or FSDP here)."""
        names = {c.__name__ for c in type(wrapper).__mro__} if wrapper is not None else set()
        if "DeepSpeedEngine" in names:
            stage = wrapper.zero_optimization_stage()
            return f"deepspeed_zero{stage}", bool(wrapper.bfloat16_enabled() or wrapper.fp16_enabled())
        if "FullyShardedDataParallel" in names:
            return "fsdp1", False
        if "FSDPModule" in names:
            return "fsdp2", False
        if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
            return "zero1", False
        if "DistributedDataParallel" in names:
            return "ddp", False
        return "none", False


def _checkpointing(module: Any) -> bool:
    """Gradient checkpointing on anywhere in ``module``: the flag transformers and diffusers models
    set on their blocks (``gradient_checkpointing``), or a model's ``is_gradient_checkpointing``."""
    if getattr(module, "is_gradient_checkpointing", False) is True:
        return True
    return any(m.__dict__.get("gradient_checkpointing") is True for m in module.modules())


_FRAMEWORK: TorchFramework | None = None


def install(torch, probe) -> None:
    global _FRAMEWORK
    _FRAMEWORK = TorchFramework(torch, probe)
    probe.add_framework(_FRAMEWORK)
    _FRAMEWORK.install()


# -- transformers' Trainer ----------------------------------------------------------------------------

def trainer_settings(args) -> dict:
    """Applied-record fields a transformers ``TrainingArguments`` states."""
    settings = {"compute_dtype": "bfloat16" if args.bf16 else "float16" if args.fp16 else None,
                "recompute": bool(args.gradient_checkpointing), "micro_batch": args.per_device_train_batch_size,
                "grad_accum_steps": args.gradient_accumulation_steps,
                "fused_optimizer": "fused" in str(getattr(args, "optim", ""))}
    if getattr(args, "deepspeed", None):
        config = getattr(getattr(args, "hf_deepspeed_config", None), "config", {}) or {}
        stage = config.get("zero_optimization", {}).get("stage", "?")
        settings["sharding_impl"] = f"deepspeed_zero{stage}"
    elif getattr(args, "fsdp", None):
        settings["sharding_impl"] = "fsdp (" + ", ".join(str(getattr(o, "value", o)) for o in args.fsdp) + ")"
    return settings


def install_trainer(module, probe) -> None:
    from transformers import TrainerCallback

    attach_callback(module.Trainer, TrainerCallback, _FRAMEWORK, probe, trainer_settings)
