"""The mechanisms under the PyTorch side's settings: chosen from knobs, carried out, and observed.

Knobs (``backends.torch.<knob>``; ``xfw compare --as published`` sets them from the seed row's
published-settings file, docs/recipes.md "Two comparisons"):

=====================  ==========================================================================
knob                   meaning (default: like-for-like)
=====================  ==========================================================================
attn_implementation    ``sdpa`` (default) | ``eager`` | ``flash_attention_2`` (needs CUDA and flash-attn)
tf32                   TF32 matmuls on a GPU (``torch.backends.cuda.matmul.allow_tf32``; default
                       false, as Paddle's runs with ``NVIDIA_TF32_OVERRIDE=0``)
tf32_conv              TF32 convolutions on a GPU (``torch.backends.cudnn.allow_tf32``; default: the
                       value of ``tf32``). The scripts set the two apart: ``--tf32`` of the HF Trainer
                       sets both, diffusers' ``--allow_tf32`` only the matmul one, and a script that
                       sets neither leaves PyTorch's defaults (matmul off, cuDNN on)
optimizer_impl         AdamW's ``fused`` | ``foreach`` | ``for_loop`` (default: fused on CUDA, else
                       torch's own choice for the device); ``fused_optimizer: true`` is ``fused``
checkpointing          ``non_reentrant`` (default) | ``reentrant`` (with input gradients enabled, as
                       transformers' Trainer does for it)
recompute              this side's activation checkpointing, where its script's differed from the
                       recipe's ``recompute`` (default: the recipe's)
deepspeed              a mapping merged into DeepSpeed's config (``overlap_comm``, ``contiguous_gradients``,
                       ``communication_data_type``, bucket sizes, ...): only with ``sharding_impl: deepspeed``
=====================  ==========================================================================

A knob the published file set that this machine or layout cannot carry out (flash attention on a
CPU, DeepSpeed on one process) is not an error: the default runs, and ``applied.not_honoured``
says what was asked, what ran and why. The same knob given by hand is checked strictly.

``applied.mechanisms`` records what was carried out under neutral keys both adapters share:
``attention_kernel`` (observed: the attention operators the first warm-up step dispatched),
``optimizer_impl``, ``grad_reduce_dtype``, ``master_weights``, ``master_grads``, ``sharding_impl``
(``data_parallel``, ``zero1``, ``zero2``, ``zero3``, with the implementation in ``sharding_detail``),
``tf32`` (matmuls), ``tf32_conv`` (convolutions), ``comm_overlap`` (whether gradient communication
overlaps the backward), ``checkpointing``, ``device``. On a CPU TF32 has no effect: both are ``n/a (CPU)``,
and a TF32 knob asked true is listed in ``not_honoured``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch

from xfw.contract.harness import InvalidSpec

ATTENTION = ("sdpa", "eager", "flash_attention_2")
OPTIMIZER_IMPLS = ("fused", "foreach", "for_loop")
CHECKPOINTING = ("non_reentrant", "reentrant")
DEEPSPEED_ZERO_KEYS = ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
                       "reduce_scatter", "allgather_partitions", "round_robin_gradients",
                       "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                       "stage3_max_live_parameters", "stage3_max_reuse_distance",
                       "stage3_gather_16bit_weights_on_model_save", "sub_group_size")
DEEPSPEED_TOP_KEYS = ("communication_data_type",)
NEUTRAL_SHARDING = {"none": "none", "ddp": "data_parallel", "zero_redundancy": "zero1"}


class Plan:
    """The knobs read once: what runs, and what was asked for but cannot run here (``not_honoured``)."""

    def __init__(self, spec: dict, cuda: bool):
        knobs = spec["backend_knobs"]
        self.published = {e["key"].split(".")[0] for e in spec.get("comparison", {}).get("set", [])}
        self.not_honoured: dict[str, str] = {}
        self.cuda = cuda
        self.attn = self._choice(knobs, "attn_implementation", ATTENTION, "sdpa")
        if self.attn == "flash_attention_2" and not (cuda and importlib.util.find_spec("flash_attn")):
            why = "needs a CUDA device" if not cuda else "the flash-attn package is not installed"
            self._refuse_or_note("attn_implementation", f"asked flash_attention_2, ran sdpa: {why}")
            self.attn = "sdpa"
        self.tf32 = knobs.get("tf32", False)
        if not isinstance(self.tf32, bool):
            raise InvalidSpec(f"backends.torch.tf32: must be true or false, got {self.tf32!r}")
        if self.tf32 and not cuda:
            self.not_honoured["tf32"] = "asked true: a CPU has no TF32 (fp32 matmuls ran)"
        self.tf32_conv = knobs.get("tf32_conv", self.tf32)
        if not isinstance(self.tf32_conv, bool):
            raise InvalidSpec(f"backends.torch.tf32_conv: must be true or false, got {self.tf32_conv!r}")
        if self.tf32_conv and not cuda:
            self.not_honoured["tf32_conv"] = "asked true: a CPU has no TF32 (fp32 convolutions ran)"
        self.optimizer_impl = self._choice(knobs, "optimizer_impl", OPTIMIZER_IMPLS, None)
        if "fused_optimizer" in knobs:
            legacy = "fused" if knobs["fused_optimizer"] else None
            if self.optimizer_impl not in (None, legacy):
                raise InvalidSpec("backends.torch.fused_optimizer: conflicts with optimizer_impl "
                                  f"{self.optimizer_impl!r} (give one)")
            self.optimizer_impl = legacy or self.optimizer_impl
        if "sharding_impl" in knobs and spec["derived"]["num_processes"] == 1:
            self.not_honoured["sharding_impl"] = (f"asked {knobs['sharding_impl']}, ran none: this recipe runs one "
                                                  "process, with nothing to shard or reduce")
        self.recompute = knobs.get("recompute", spec["recompute"])
        if not isinstance(self.recompute, bool):
            raise InvalidSpec(f"backends.torch.recompute: must be true or false, got {self.recompute!r}")
        self.checkpointing = self._choice(knobs, "checkpointing", CHECKPOINTING, "non_reentrant")
        if "checkpointing" in knobs and not self.recompute:
            self.not_honoured["checkpointing"] = f"asked {self.checkpointing}: this recipe trains without recompute"
        self.deepspeed = knobs.get("deepspeed", {})
        if not isinstance(self.deepspeed, dict):
            raise InvalidSpec(f"backends.torch.deepspeed: must be a mapping of DeepSpeed config keys, got {self.deepspeed!r}")
        unknown = sorted(set(self.deepspeed) - set(DEEPSPEED_ZERO_KEYS) - set(DEEPSPEED_TOP_KEYS))
        if unknown:
            raise InvalidSpec(f"backends.torch.deepspeed.{unknown[0]}: not a DeepSpeed key xfw passes on "
                              f"(known: {', '.join(DEEPSPEED_ZERO_KEYS + DEEPSPEED_TOP_KEYS)})")

    def _choice(self, knobs: dict, key: str, allowed: tuple, default):
        value = knobs.get(key, default)
        if value is not default and value not in allowed:
            raise InvalidSpec(f"backends.torch.{key}: {value!r} is not one of {', '.join(allowed)}")
        return value

    def _refuse_or_note(self, key: str, message: str) -> None:
        """Published choices that cannot run here are noted; the same choice by hand is refused."""
        if key not in self.published:
            raise InvalidSpec(f"backends.torch.{key}: {message}")
        self.not_honoured[key] = message

    # -- carried out ---------------------------------------------------------------------------
    def sharding_impl(self, spec: dict, allowed: dict) -> str:
        """``sharding_impl`` for this layout; a published one this layout has no place for is noted."""
        sharding = spec["parallel"]["sharding"]
        impl = spec["backend_knobs"].get("sharding_impl", allowed[sharding][0])
        if impl in allowed[sharding]:
            return impl
        message = f"{impl!r} does not implement sharding {sharding} (choose {', '.join(allowed[sharding])})"
        if "sharding_impl" in self.published:
            self.not_honoured["sharding_impl"] = (f"asked {impl}, ran {allowed[sharding][0]}: this recipe runs "
                                                  f"sharding {sharding} on {spec['derived']['num_processes']} process(es)")
            return allowed[sharding][0]
        raise InvalidSpec(f"backends.torch.sharding_impl: {message}")

    def note_unused_deepspeed(self, impl: str) -> None:
        if self.deepspeed and impl != "deepspeed":
            self._refuse_or_note("deepspeed", f"a DeepSpeed config, but the sharding that ran is {impl}: not used")

    def deepspeed_config(self, config: dict, spec: dict) -> dict:
        """DeepSpeed's config with ``backends.torch.deepspeed`` merged in; ``auto`` bucket sizes become
        hidden_size², as the HF Trainer's DeepSpeed integration fills them."""
        hidden = (spec["model"]["arch"].get("text") or {}).get("hidden_size")
        for key, value in self.deepspeed.items():
            if value == "auto" and key.endswith("bucket_size"):
                if hidden is None:
                    continue  # DeepSpeed's own default
                value = hidden * hidden
            if key in DEEPSPEED_TOP_KEYS:
                config[key] = value
            else:
                config["zero_optimization"][key] = value
        return config

    def apply_tf32(self) -> None:
        torch.backends.cuda.matmul.allow_tf32 = bool(self.tf32 and self.cuda)
        torch.backends.cudnn.allow_tf32 = bool(self.tf32_conv and self.cuda)

    def optimizer_kwargs(self) -> dict:
        """AdamW's implementation switches; None leaves torch's own choice for the device."""
        impl = self.optimizer_impl or ("fused" if self.cuda else None)
        return {"fused": {"fused": True}, "foreach": {"foreach": True, "fused": False},
                "for_loop": {"foreach": False, "fused": False}, None: {"fused": False}}[impl]

    def checkpoint_fn(self):
        """The checkpoint function a family's recompute uses (diffusers takes one; transformers takes kwargs)."""
        return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=self.checkpointing == "reentrant")


def optimizer_impl(optimizer) -> str:
    """What AdamW actually runs: fused, foreach (multi-tensor) or for_loop (per parameter)."""
    if optimizer is None:
        return "DeepSpeed's optimizer (torch AdamW inside ZeRO)"
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the local one
    group = inner.param_groups[0]
    if group.get("fused"):
        return "fused"
    if group.get("foreach") is None:
        params = [p for g in inner.param_groups for p in g["params"]]
        return "foreach" if params and all(p.is_cuda for p in params) else "for_loop"
    return "foreach" if group["foreach"] else "for_loop"


class AttentionWatch(torch.utils._python_dispatch.TorchDispatchMode):
    """Records which attention operators run (one warm-up step, never a measured one)."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "attention" in name or "softmax" in name or "flash" in name:
            self.seen.add(name)
        return func(*args, **(kwargs or {}))

    def kernel(self) -> str:
        names = " ".join(sorted(self.seen))
        for needle, label in (("flash_attn", "flash_attn (FlashAttention-2)"),
                              ("_scaled_dot_product_flash_attention", "sdpa: flash"),
                              ("_scaled_dot_product_efficient_attention", "sdpa: memory-efficient"),
                              ("_scaled_dot_product_cudnn_attention", "sdpa: cuDNN"),
                              ("_scaled_dot_product_attention_math", "sdpa: math"),
                              ("_softmax", "matmul + softmax (eager)")):
            if needle in names:
                return label
        return "none seen"


def watch_first_step(session, warmup_steps: int, compiled: bool):
    """A context for one train_step: the attention watch on the first warm-up step, else nothing."""
    if session.attention_kernel is not None:
        return contextlib.nullcontext()
    if warmup_steps < 1 or compiled:
        session.attention_kernel = "not observed (" + ("torch.compile" if compiled else "no warm-up step") + ")"
        return contextlib.nullcontext()
    watch = AttentionWatch()

    @contextlib.contextmanager
    def observed():
        with watch:
            yield
        session.attention_kernel = watch.kernel()
    return observed()


def comm_overlap(impl: str, num_ranks: int, deepspeed: dict, sharding: str) -> str:
    """Whether gradient communication overlaps the backward, in words both adapters share (``overlapped: ...``,
    ``none: ...``, ``n/a (one process)``). DeepSpeed's ``overlap_comm`` defaults to on for ZeRO-3 only."""
    if num_ranks == 1:
        return "n/a (one process)"
    if impl == "deepspeed":
        on = deepspeed.get("overlap_comm", sharding == "stage3")
        return ("overlapped: DeepSpeed overlap_comm true (gradients reduced on their own stream)" if on else
                "none: DeepSpeed overlap_comm false (gradients reduced on the compute stream)")
    if impl in ("fsdp1", "fsdp2"):
        return "overlapped: FSDP reduce-scatters gradients during the backward"
    return "overlapped: DDP all-reduces gradient buckets during the backward"


def mechanisms(session, spec: dict) -> dict:
    """``applied.mechanisms`` for the PyTorch side (module docstring)."""
    level, impl, dtype = spec["precision"]["amp_level"], session.impl, str(session.dtype).removeprefix("torch.")
    sharding = spec["parallel"]["sharding"]
    neutral = NEUTRAL_SHARDING.get(impl, "zero" + sharding.removeprefix("stage"))
    if impl in ("fsdp1", "fsdp2"):
        reduce_dtype = "float32"  # MixedPrecisionPolicy(reduce_dtype=float32)
    elif impl == "deepspeed":
        reduce_dtype = session.plan.deepspeed.get("communication_data_type") or (dtype if level == "O2" else "float32")
    else:
        reduce_dtype = dtype if level == "O2" else "float32"
    if session.num_ranks == 1:
        reduce_dtype = "n/a (one process)"
    masters = "fp32 (FSDP's shards)" if impl in ("fsdp1", "fsdp2") and level == "O2" else \
        "fp32 (ZeRO's optimizer)" if impl == "deepspeed" and level == "O2" else \
        "fp32 copies in the optimizer" if session.master is not None else \
        f"none: the optimizer updates the {dtype} weights (precision.master_weights: false)" if level == "O2" else \
        "none (fp32 weights)"
    weights = dtype if level == "O2" else "float32"
    grads = ("fp32 (cast to the masters before the step)" if session.master is not None else
             "fp32 (FSDP's sharded gradients)" if impl in ("fsdp1", "fsdp2") and level == "O2" else
             "ZeRO's fp32 partitions" if impl == "deepspeed" and level == "O2" else f"the weights' dtype ({weights})")
    return {
        "attention_kernel": session.attention_kernel or "not observed",
        "attention_impl": session.plan.attn,
        "optimizer_impl": optimizer_impl(session.optimizer),
        "grad_reduce_dtype": reduce_dtype,
        "master_weights": masters,
        "master_grads": grads,
        "sharding_impl": neutral,
        "sharding_detail": {"none": "one process", "ddp": "DistributedDataParallel",
                            "zero_redundancy": "DDP + ZeroRedundancyOptimizer",
                            "fsdp2": "FSDP2 fully_shard", "fsdp1": "FSDP1",
                            "deepspeed": f"DeepSpeed {session.deepspeed_version} ZeRO-{sharding.removeprefix('stage')}"
                            }.get(impl, impl),
        "tf32": (bool(torch.backends.cuda.matmul.allow_tf32) if session.cuda else "n/a (CPU)"),
        "tf32_conv": (bool(torch.backends.cudnn.allow_tf32) if session.cuda else "n/a (CPU)"),
        "comm_overlap": comm_overlap(impl, session.num_ranks, session.plan.deepspeed, sharding),
        "checkpointing": (f"per block, {session.plan.checkpointing.replace('_', '-')}" if session.plan.recompute
                          else "none"),
        "device": "gpu" if session.cuda else "cpu",
    }
