"""Recipes: what to train, never how a framework does it.

A recipe is a YAML file loaded with ``yaml.safe_load`` into frozen dataclasses. Every check
runs here, before anything launches, and every error is one line naming the file and the
dotted key::

    recipes/tiny/llava_sft.yaml: batch.global: 6 is not divisible by micro (4) x processes (1)

``load_recipe(path, overrides=["batch.micro=2"])`` returns a validated :class:`Recipe`;
``xfw.run.spec.resolve_spec(recipe)`` turns it into the JSON-ready ``spec.json`` an adapter reads. The sections are built
and checked by :mod:`xfw.run.schema`; the data section lives with the data (:mod:`xfw.run.data.section`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xfw.contract import presets
from xfw.contract.families import family_module
from xfw.run import command
from xfw.contract import envvars
from xfw.run import published as published_settings
from xfw.run.data.section import DATA_FAMILIES, DATA_PATHS, DataSpec
from xfw.run.schema import FieldError, bounded, build
from xfw.run.assign import SetError, apply_override
from xfw.run.yamlfile import YamlError, load_file


STAGES = ("pretrain", "sft", "lora", "dreambooth")
DTYPES = ("fp32", "bf16", "fp16")
AMP_LEVELS = ("O0", "O1", "O2")
SHARDINGS = ("none", "stage1", "stage2", "stage3")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_+-]*(\.[A-Za-z0-9_+-]+)*")
"""A recipe name is one plain path component (it names run directories): letters, digits, ``_ + - .``."""
MAX_NAME_CHARS = 100
RESERVED_SUFFIXES = (".md", ".csv", ".html", ".png", ".json", ".jsonl", ".log", ".lock", ".yaml", ".safetensors")
"""A name may not end like a file xfw writes beside its run directories (report.md, chart.png, ...)."""
PLAIN_NAME_RULE = (f"must be one plain file name of at most {MAX_NAME_CHARS} characters (letters, digits, '_', '+', "
                   "'-', inner '.'), not ending like a report file (.md, .csv, .html, .png, .json, ...)")


def is_plain_name(text: object) -> bool:
    """Whether ``text`` may name a directory xfw writes (a recipe, a suite, a suite entry)."""
    return (isinstance(text, str) and NAME.fullmatch(text) is not None and len(text) <= MAX_NAME_CHARS
            and not text.lower().endswith(RESERVED_SUFFIXES))


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
    DIR}}``, xfw.run.command); ``override``: recipe keys that backend alone sets otherwise (xfw.run.overrides)."""
    comparison: str = "like-for-like"
    """``like-for-like`` (one algorithm on both sides) or ``published`` (each side as its own benchmark
    script ran it, from the ``published`` file): :mod:`xfw.run.published`."""
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


def recipe_from_dict(data: Any, source: str = "<recipe>") -> Recipe:
    """Validate plain data into a Recipe; errors read ``source: key.path: message``. Each backend's
    override (``backends.<name>.override``, :mod:`xfw.run.overrides`) is put in its canonical form and
    the recipe with it applied validated too, errors naming the override's key."""
    from xfw.run import overrides

    data = overrides.canonical(data, source)
    try:
        recipe = build(Recipe, data, "")
    except FieldError as err:
        raise RecipeError(f"{source}: {err.key}: {err}") from None
    for backend in overrides.backend_overrides(recipe):
        overrides.effective(recipe, backend, source)
    return recipe


def _absolute_paths(data: dict, overrides: list[str], recipe_dir: Path) -> None:
    """``data.<path key>`` made absolute in place (:data:`DATA_PATHS`): from the current directory
    when a ``--set`` gave it, else from the recipe's own directory."""
    section = data.get("data")
    if not isinstance(section, dict):
        return
    given = {a.split("=", 1)[0].strip() for a in overrides}
    for key in DATA_PATHS:
        value = section.get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            from_cli = f"data.{key}" in given or "data" in given
            section[key] = str(((Path.cwd() if from_cli else recipe_dir) / value).resolve())
        elif isinstance(value, str) and value:
            section[key] = str(Path(value).expanduser())


def _apply_published(data: dict, overrides, recipe_dir: Path, source: str) -> None:
    """``published:`` made an absolute file path (checked), and with ``comparison: published`` its
    entries applied as backend knobs and variables where no ``--set`` named the same key."""
    name = data.get("published")
    if name is None:
        return
    if not isinstance(name, str):
        raise RecipeError(f"{source}: published: must be a name in recipes/published/ or a .yaml path, got {name!r}")
    try:
        path = published_settings.locate(name, recipe_dir)
        table = published_settings.load(path)
    except published_settings.PublishedError as err:
        raise RecipeError(f"{source}: {err}") from None
    data["published"] = str(path)
    if data.get("comparison") == "published":
        given = {a.split("=", 1)[0].strip() for a in overrides}
        published_settings.apply(data, table, given)


def check_data(recipe: Recipe, arch: dict, source: str) -> None:
    """What the data section asks of the architecture, and real data prepared (``xfw.run.data``):
    every problem a one-line RecipeError naming the file and the key or sample."""
    from xfw.contract import families

    try:
        if recipe.model.trainable is not None:
            families.check_parts(arch, recipe.model.trainable, recipe.stage)
        tokens = recipe.data.text_tokens
        if tokens is not None:
            longest = families.fixed_tokens(arch) + tokens.max
            if longest > arch["data"]["seq_len"]:
                raise families.ArchError("data.text_tokens.max", f"{tokens.max} text tokens after "
                                         f"{families.fixed_tokens(arch)} others exceed data.seq_len {arch['data']['seq_len']}")
    except families.ArchError as err:
        raise RecipeError(f"{source}: {err.key}: {err}") from None
    if recipe.data.kind != "synthetic":
        from xfw.run import data as real

        try:
            real.check_split(recipe, real.prepare(recipe, arch))
        except real.DataError as err:
            raise RecipeError(f"{source}: {err}") from None


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """Read, override and validate one recipe file; real data is prepared (or found prepared) here,
    so bad data is refused before anything launches. Raises RecipeError with a one-line message."""
    source = str(path)
    try:
        data = load_file(path, "recipe")
    except YamlError as err:
        raise RecipeError(str(err)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: (top level): must be a mapping, got {type(data).__name__}")
    from xfw.run import overrides as per_backend

    _absolute_paths(data, [], Path(path).resolve().parent)
    per_backend.nest(data, source)  # so a --set of an override's key replaces the file's, whatever its form
    try:
        for assignment in overrides:
            apply_override(data, assignment, source)
    except SetError as err:
        raise RecipeError(str(err)) from None
    _absolute_paths(data, list(overrides), Path(path).resolve().parent)
    per_backend.nest(data, source)
    per_backend.absolute_paths(data, {a.split("=", 1)[0].strip() for a in overrides}, Path(path).resolve().parent)
    _apply_published(data, overrides, Path(path).resolve().parent, source)
    recipe = recipe_from_dict(data, source)
    _check_weights_dir(recipe.model.weights, source)
    try:
        arch = presets.resolve_arch(recipe.model.preset, recipe.model.arch, recipe.data.image_size, recipe.data.seq_len)
        recipe = command.resolve(recipe, Path(path).parent)  # backends that run a command (xfw.run.command)
    except (presets.ArchError, command.CommandError) as err:
        raise RecipeError(f"{source}: {err.key}: {err}") from None
    check_data(recipe, arch, source)
    for backend, own in per_backend.backend_overrides(recipe).items():
        if any(key.split(".")[0] in ("model", "data") for key in own):  # its model or its data differ: checked too
            try:
                _check_effective(per_backend.effective(recipe, backend, source), source)
            except RecipeError as err:  # "source: key: message" named by the override's key
                key, _, message = str(err).removeprefix(f"{source}: ").partition(": ")
                if not re.fullmatch(r"[a-z_]+(\.[A-Za-z0-9_]+)*", key):
                    key, message = "", str(err).removeprefix(f"{source}: ")
                raise per_backend.named(key, message, backend, list(own), source) from None
    return recipe


def _check_effective(recipe: Recipe, source: str) -> None:
    """A backend's effective recipe through the checks beyond the schema: checkpoint directory,
    architecture, real data (that backend's own, prepared here)."""
    _check_weights_dir(recipe.model.weights, source)
    try:
        arch = presets.resolve_arch(recipe.model.preset, recipe.model.arch, recipe.data.image_size, recipe.data.seq_len)
    except presets.ArchError as err:
        raise RecipeError(f"{source}: {err.key}: {err}") from None
    check_data(recipe, arch, source)


def _check_weights_dir(weights: str, source: str) -> None:
    """``model.weights`` names a directory holding a checkpoint (a single file or Hugging Face shards)."""
    if weights == "random":
        return
    path = Path(weights)
    if not path.is_dir():
        raise RecipeError(f"{source}: model.weights: {weights} is not a directory (give a checkpoint directory, "
                          "or 'random')")
    if not any((path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        raise RecipeError(f"{source}: model.weights: {weights} holds no model.safetensors "
                          "(nor model.safetensors.index.json)")
