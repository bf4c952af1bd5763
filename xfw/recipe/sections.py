"""The loaded recipe: frozen dataclasses, one per section, each checking itself.

Given plain data that the schema (:mod:`xfw.recipe.schema`) builds them from; returns a :class:`Recipe` whose every
field is typed and in range, with the checks across sections (batch divisible by the processes, the stage a family
supports, LoRA targets, the data kind a family takes) done in ``Recipe.__post_init__``. Nothing here reads a file:
:mod:`xfw.recipe.load` reads and overrides the file, then builds this. :class:`RecipeError` is the one-line error
every recipe problem becomes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from xfw.contract import envvars, presets
from xfw.contract.families import family_module
from xfw.recipe import published as published_settings
from xfw.recipe.data_section import DATA_FAMILIES, DataSpec
from xfw.recipe.names import PLAIN_NAME_RULE, is_plain_name
from xfw.recipe.schema import FieldError, bounded


STAGES = ("pretrain", "sft", "lora", "dreambooth")
DTYPES = ("fp32", "bf16", "fp16")
AMP_LEVELS = ("O0", "O1", "O2")
SHARDINGS = ("none", "stage1", "stage2", "stage3")
class RecipeError(ValueError):
    """A problem a user can fix in a recipe; ``str()`` is the whole one-line message."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    preset: str
    """Name of a neutral architecture in ``xfw.contract.presets`` (e.g. ``tiny-llava``)."""
    arch: dict = field(default_factory=dict)
    """Architecture fields that override the preset's, e.g. ``{text: {num_layers: 4}}``."""
    weights: str = "random"
    """``random`` (seeded init) or a local checkpoint directory."""
    trainable: list[str] | None = None
    """The family's parts that train (e.g. ``[text]``: Qwen2-VL with its merger frozen); None: the
    stage's own (``STAGE_PARTS`` in ``xfw.contract.families.<family>``). LoRA adapters always train."""

    def __post_init__(self):
        if self.preset not in presets.PRESETS:
            known = ", ".join(sorted(presets.PRESETS))
            raise FieldError("preset", f"unknown preset {self.preset!r} (known: {known})")
        if self.trainable is not None and len(set(self.trainable)) != len(self.trainable):
            raise FieldError("trainable", f"names a part twice: {self.trainable}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionSpec:
    dtype: str = "fp32"
    """fp32 | bf16 | fp16: the low-precision type used for compute."""
    amp_level: str = "O0"
    """O0 = no AMP (fp32 only); O1 = autocast over fp32 weights; O2 = low-precision weights + fp32 master weights."""
    master_weights: bool = True
    """O2 only: the optimizer keeps fp32 master weights (and gradients); false: it updates the low-precision
    weights in place (pure bf16/fp16 training: less memory, updates below the dtype's step round away)."""

    def __post_init__(self):
        if not self.master_weights and self.amp_level != "O2":
            raise FieldError("master_weights", f"false applies only to amp_level O2, not {self.amp_level}")
        if self.dtype not in DTYPES:
            raise FieldError("dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.amp_level not in AMP_LEVELS:
            raise FieldError("amp_level", f"must be one of {', '.join(AMP_LEVELS)}, got {self.amp_level!r}")
        if self.dtype == "fp32" and self.amp_level != "O0":
            raise FieldError("amp_level", f"{self.amp_level} needs dtype bf16 or fp16 (fp32 runs O0)")
        if self.dtype != "fp32" and self.amp_level == "O0":
            raise FieldError("amp_level", f"dtype {self.dtype} needs amp_level O1 or O2")


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelSpec:
    nproc_per_node: int = bounded(1, 1024, default=1)
    nnodes: int = bounded(1, 4096, default=1)
    sharding: str = "none"
    """none | stage1 | stage2 | stage3 (ZeRO stages; each backend maps them natively)."""

    def __post_init__(self):
        for name in ("nproc_per_node", "nnodes"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be at least 1, got {getattr(self, name)}")
        if self.sharding not in SHARDINGS:
            raise FieldError("sharding", f"must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSpec:
    global_size: int = bounded(1, 1 << 24, metadata={"key": "global"})
    """Samples per optimizer step, summed over all processes."""
    micro: int = bounded(1, 1 << 20)
    """Samples per forward/backward on one process; accumulation is derived."""

    def __post_init__(self):
        if self.global_size < 1:
            raise FieldError("global", f"must be at least 1, got {self.global_size}")
        if self.micro < 1:
            raise FieldError("micro", f"must be at least 1, got {self.micro}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSpec:
    r: int = bounded(1, 65536)
    alpha: float = bounded(1e-6, 1e6)
    dropout: float = 0.0
    targets: list[str] = field(default_factory=list)
    """Module names that get adapters, e.g. [q_proj, v_proj]."""

    def __post_init__(self):
        if self.r < 1:
            raise FieldError("r", f"must be at least 1, got {self.r}")
        if not self.targets:
            raise FieldError("targets", "must name at least one module")
        if not 0.0 <= self.dropout < 1.0:
            raise FieldError("dropout", f"must be in [0, 1), got {self.dropout}")


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSpec:
    name: str = "adamw"
    lr: float = bounded(1e-12, 10.0, default=1e-5)
    weight_decay: float = bounded(0.0, 10.0, default=0.0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = bounded(1e-30, 1.0, default=1e-8)
    max_grad_norm: float | None = bounded(0.0, 1e6, default=None)
    """Clip the global L2 norm of the trainable gradients to this before each step (PaddleNLP's and
    transformers' ``max_grad_norm``); 0 or null: no clipping."""

    def __post_init__(self):
        if self.name != "adamw":
            raise FieldError("name", f"only 'adamw' is supported, got {self.name!r}")
        if self.lr <= 0:
            raise FieldError("lr", f"must be positive, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise FieldError("betas", f"must be two numbers in [0, 1), got {self.betas}")


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasureSpec:
    warmup_steps: int = bounded(0, 100_000, default=10)
    """Optimizer steps run before the timed window; recorded as phase 'warmup', excluded."""
    steps: int = bounded(1, 1_000_000, default=50)
    """Optimizer steps inside the timed window."""
    repeat: int = bounded(1, 1000, default=1)
    timeout_s: float = bounded(1.0, 7 * 24 * 3600.0, default=1800.0)
    """Wall-clock limit for one backend's run, start-up included."""
    seed: int = bounded(0, 2**32 - 1, default=0)
    """Seeds weight init and synthetic data, identically for every backend."""
    eval_every: int = bounded(0, 1_000_000, default=0)
    """Evaluate the held-out split (``data.eval_samples``) first, every K steps and last (``eval`` records; xfw
    converge sets it); every step is then synchronised: a learning curve, not a speed measurement. 0: never."""
    cpu_threads: int | None = bounded(1, 4096, default=None)
    """Host threads per process (OMP_NUM_THREADS / MKL_NUM_THREADS for both frameworks); None leaves
    each framework's default. On a shared CPU, 1 thread per process removes most of the run-to-run
    noise (measured here: tiny LLaVA torch step times 19-1400 ms with the default, 24-36 ms with 1)."""

    def __post_init__(self):
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise FieldError("cpu_threads", f"must be at least 1 (or null for the framework default), got {self.cpu_threads}")
        if self.warmup_steps < 0:
            raise FieldError("warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        for name in ("steps", "repeat"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be at least 1, got {getattr(self, name)}")
        if self.timeout_s <= 0:
            raise FieldError("timeout_s", f"must be positive, got {self.timeout_s}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    name: str
    model: ModelSpec
    stage: str
    batch: BatchSpec
    data: DataSpec = field(default_factory=DataSpec)
    precision: PrecisionSpec = field(default_factory=PrecisionSpec)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    recompute: bool = False
    """Activation checkpointing per transformer block."""
    lora: LoraSpec | None = None
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    measure: MeasureSpec = field(default_factory=MeasureSpec)
    backends: dict = field(default_factory=dict)
    """Backend-specific knobs only, e.g. {torch: {sharding_impl: fsdp2}}, checked by each adapter; ``env``: variables
    for that backend's processes; or a command xfw runs instead of its adapter (``{torch: {command: [...], cwd:
    DIR}}``, xfw.recipe.command); ``override``: recipe keys that backend alone sets otherwise (xfw.recipe.overrides)."""
    comparison: str = "like-for-like"
    """``like-for-like`` (one algorithm on both sides) or ``published`` (each side as its own benchmark
    script ran it, from the ``published`` file): :mod:`xfw.recipe.published`."""
    published: str | None = None
    """The seed row this recipe stands for: a name in ``recipes/published/`` or a ``.yaml`` path (made
    absolute when the recipe loads)."""

    def __post_init__(self):
        if not is_plain_name(self.name):
            raise FieldError("name", f"{self.name[:120]!r} {PLAIN_NAME_RULE}: it names the run directories")
        if self.comparison not in published_settings.COMPARISONS:
            raise FieldError("comparison", f"must be one of {', '.join(published_settings.COMPARISONS)}, "
                             f"got {self.comparison!r}")
        if self.comparison == "published" and self.published is None:
            raise FieldError("comparison", "published needs the recipe's `published:` key (the seed row it stands "
                             "for: a name in recipes/published/ or a .yaml path)")
        if self.stage not in STAGES:
            raise FieldError("stage", f"must be one of {', '.join(STAGES)}, got {self.stage!r}")
        family = presets.PRESETS[self.model.preset]["family"]
        allowed = presets.FAMILY_STAGES[family]
        if self.stage not in allowed:
            raise FieldError("stage", f"{family} models support {', '.join(allowed)}, not {self.stage!r}")
        commands_only = bool(self.backends) and all(isinstance(k, dict) and "command" in k
                                                    for k in self.backends.values())
        if self.stage == "lora" and self.lora is None and not commands_only:  # a command decides its own LoRA
            raise FieldError("lora", "stage 'lora' needs a lora section (r, alpha, targets)")
        if self.stage != "lora" and self.lora is not None:
            raise FieldError("lora", f"a lora section only applies to stage 'lora', not {self.stage!r}")
        if self.lora is not None:
            allowed = _lora_targets(family)
            wrong = [t for t in self.lora.targets if allowed is not None and t not in allowed]
            if wrong:
                raise FieldError("lora.targets", f"{wrong[0]!r} is not a module LoRA can target in {family} "
                                 f"models (choose from {', '.join(allowed)})")
        num_procs = self.parallel.nproc_per_node * self.parallel.nnodes
        per_step = self.batch.micro * num_procs
        if self.batch.global_size % per_step:
            raise FieldError(
                "batch.global",
                f"{self.batch.global_size} is not divisible by micro ({self.batch.micro}) x processes ({num_procs})",
            )
        for name, knobs in self.backends.items():
            if not isinstance(knobs, dict):
                raise FieldError(f"backends.{name}", f"must be a mapping of knobs, got {type(knobs).__name__}")
            env = knobs.get("env")
            conflict = envvars.thread_conflict(env, self.measure.cpu_threads) if isinstance(env, dict) else None
            if conflict:
                raise FieldError(f"backends.{name}.env.{conflict}",
                                 f"{str(env[conflict])[:40]!r} contradicts measure.cpu_threads = "
                                 f"{self.measure.cpu_threads} (xfw sets the thread variables from it; set "
                                 "measure.cpu_threads instead, or null to leave them to this variable)")
        kinds = DATA_FAMILIES.get(self.data.kind)
        if kinds is not None and family not in kinds:
            raise FieldError("data.kind", f"{self.data.kind} data feeds {' and '.join(kinds)} models, not {family}")
        if self.data.text_tokens is not None and family not in DATA_FAMILIES["llava_json"]:
            raise FieldError("data.text_tokens", f"{family} models have no text sequence to vary")

    @property
    def num_processes(self) -> int:
        return self.parallel.nproc_per_node * self.parallel.nnodes

    @property
    def grad_accum_steps(self) -> int:
        return self.batch.global_size // (self.batch.micro * self.num_processes)


def _lora_targets(family: str) -> tuple[str, ...] | None:
    """The module names a family lets LoRA target, or None when it does not restrict them."""
    try:
        return getattr(family_module(family), "LORA_TARGETS", None)
    except ModuleNotFoundError:
        return None
