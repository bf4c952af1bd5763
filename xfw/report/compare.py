"""The comparator: pure functions from run results to comparison rows.

``compare_runs(results, ["paddle", "torch"])`` groups runs by (recipe, variant) — a variant
is a sweep point, e.g. ``{"batch.micro": 8}`` — and gives one :class:`ComparisonRow` per
group, with each backend's side and the contrast of the first backend against the second,
as in seed 003::

    contrast = (paddle_ips - torch_ips) / torch_ips        # +26% means paddle is faster

Repeats of the same (recipe, variant, backend) collapse to their median, with the spread kept; a
contrast smaller than the spread is flagged as within noise. A failed side keeps its row,
with the status and reason in place of numbers.

What each side trained on is compared too (``Measurement.batch_digest``): equal digests mean
bit-identical micro-batches on both sides (``row.data_line`` says so); different ones are a
warning. The padding fraction and the mean/longest sequence trained are shown per side.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field

from xfw.contract import presets
from xfw.contract.harness import LOADER_KNOBS, InvalidSpec, loader_settings
from xfw.report import comparison
from xfw.report.measure import script_throughput, spread
from xfw.report.results import RunResult

# Applied settings shown side by side; a difference on any of these is warned about.
SETTINGS = ("device", "weight_dtype", "compute_dtype", "amp_level", "master_weights", "sharding_impl",
            "attention_impl", "tf32", "fused_optimizer", "recompute", "num_params_total",
            "num_params_trainable", "num_processes", "grad_accum_steps", "mem_source", "framework_version")
# Settings only a run xfw attached to can report (xfw.contract.probe): shown where a side has them.
SEEN_SETTINGS = ("micro_batch", "master_grad", "step_boundary")
# Settings that differ by nature between frameworks: shown, never warned about.
_EXPECTED_TO_DIFFER = {"framework_version", "mem_source", "step_boundary"}

STAGE_NAMES = {"pretrain": "Pretrain", "sft": "SFT", "lora": "LoRA", "dreambooth": "SFT (Dreambooth)"}


@dataclass(kw_only=True)
class Side:
    """One (recipe, variant, backend): its repeats collapsed to their medians, the spread kept."""

    backend: str
    status: str
    reason: str = ""
    recipe: str = ""
    model: str = ""
    """As seed 003 names it (``presets.display_name``)."""
    stage: str = ""
    """As seed 003 names it (:data:`STAGE_NAMES`)."""
    variant: dict = field(default_factory=dict)
    setup: dict = field(default_factory=dict)
    """The resolved spec's batch/parallel/precision settings (``RunResult.setup``)."""
    device: str = ""
    ips: float | None = None
    ips_spread: float | None = None
    ips_low: float | None = None
    """The lowest and highest ips over the repeats (error bars); the median's with one run."""
    ips_high: float | None = None
    loss_first: float | None = None
    """The first recorded loss (warm-up included) of the first ok run: what the side started from."""
    tokens_per_s: float | None = None
    step_time_median_s: float | None = None
    mem_alloc_peak_bytes: int | None = None
    mem_reserved_peak_bytes: int | None = None
    mem_source: str | None = None
    """The source of ``mem_*``: the framework's own figure (an allocator's, or PyTorch's peak RSS on a CPU)."""
    memory_bytes: int | None = None
    """The measure both backends share (``Measurement.memory_bytes``): what the contrast shows."""
    memory_source: str | None = None
    rss_after_build_bytes: int | None = None
    rss_peak_bytes: int | None = None
    """The peak resident set (since the build), shown beside the training memory on a CPU."""
    window_time_s: float | None = None
    """The measured window (median over repeats): how long the figures were measured for."""
    step_time_p10_s: float | None = None
    step_time_p90_s: float | None = None
    num_measured_steps: int = 0
    """Measured steps of every rank together (the records'); :attr:`steps_per_process` is one process's."""
    steps_per_process: int = 0
    """Measured optimizer steps of one process: what ``measure.steps`` counts."""
    memory_spread: float | None = None
    """(max − min) / median of ``memory_bytes`` over the repeats; None with one run."""
    mfu: float | None = None
    mfu_peak: str = ""
    """The peak ``mfu`` divides by and its datasheet, or why there is none (``RunResult.mfu_peak``)."""
    flops_per_sample: float | None = None
    source: str = "xfw"
    """Where the numbers come from (``Measurement.source``): ``command_log`` is not measured by xfw."""
    script_ips: float | None = None
    """Throughput as this side's own benchmark script defined it, from the same records (a published
    file's ``throughput``; :func:`xfw.report.measure.script_throughput`); None without one."""
    num_repeats: int = 0
    applied: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    """The first run's env.json: host, Python, xfw commit, the backend's description."""
    run_dirs: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    """What the side trained on (its first ok run's): padding_fraction, seq_len_mean, seq_len_max,
    batch_digest, num_batches (``xfw.report.measure.Measurement``)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.ips is not None

    @property
    def on_gpu(self) -> bool:
        device = str(self.applied.get("device", "cpu"))
        return self.ok and device != "cpu" and "CPU test device" not in device  # Paddle's testcpu is a CPU

    @property
    def num_processes(self) -> int:
        return int(self.setup.get("num_processes") or 1)


@dataclass(kw_only=True)
class ComparisonRow:
    recipe: str
    model: str
    stage: str
    sides: dict[str, Side]
    variant: dict = field(default_factory=dict)
    """The sweep point of this row's runs ({} for plain runs)."""
    contrast: float | None = None
    within_noise: bool | None = None
    ab_cell: str | None = None
    """Under ``--ab``: the contrast cell from the A/B's Decision (xfw.report.ab.ABResult.cell)."""
    params_match: bool | None = None
    expected_params: int | None = None
    settings: dict[str, dict] = field(default_factory=dict)
    """setting -> {backend: value}"""
    differing: list[str] = field(default_factory=list)
    """Settings whose values differ between the sides (and are expected not to)."""
    warnings: list[str] = field(default_factory=list)
    parity: dict | None = None
    """This recipe's parity status (``xfw.run.commands.parity.find_parity``); None when nobody looked."""
    data_line: str = ""
    """Whether both sides trained on identical batches (their micro-batch hashes); "" when unknown."""
    deliberate: list[str] = field(default_factory=list)
    """One line per key a backend overrode (``backends.<name>.override``, xfw.recipe.overrides): a
    deliberate difference, shown in every report (:func:`deliberate_differences`)."""
    deliberate_by: dict[str, list[str]] = field(default_factory=dict)
    """Settings key (``override.<key>``) -> the backends whose override set it."""


def device_of(r: RunResult) -> str:
    return r.applied.get("device_name") or r.env.get("backend", {}).get("device_name") or "unknown device"


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _side(backend: str, runs: list[RunResult]) -> Side:
    """The runs of one (recipe, variant, backend) as one side; ``missing`` when there are none."""
    if not runs:
        return Side(backend=backend, status="missing", reason="no run of this backend")
    ok = [r for r in runs if r.ok and r.measurement.ips is not None]
    first = (ok or runs)[0]
    side = Side(backend=backend, status="ok" if ok else first.status, reason="" if ok else first.reason,
                recipe=first.recipe, model=presets.display_name(first.preset),
                stage=STAGE_NAMES.get(first.stage, first.stage), variant=dict(first.variant),
                setup=first.setup or {"num_processes": first.applied.get("num_processes", 1)},
                device=device_of(first), num_repeats=len(ok) if ok else len(runs), applied=first.applied,
                env=first.env, run_dirs=[r.run_dir for r in runs])
    if ok:
        m = [r.measurement for r in ok]
        side.ips, side.ips_spread = _median(x.ips for x in m), spread([x.ips for x in m])
        side.ips_low, side.ips_high = min(x.ips for x in m), max(x.ips for x in m)
        side.loss_first = m[0].loss_first
        side.tokens_per_s, side.step_time_median_s = _median(x.tokens_per_s for x in m), \
            _median(x.step_time_median_s for x in m)
        side.mem_alloc_peak_bytes = _median(x.mem_alloc_peak_bytes for x in m)
        side.mem_reserved_peak_bytes = _median(x.mem_reserved_peak_bytes for x in m)
        side.mem_source, side.mfu = m[0].mem_source, _median(r.mfu for r in ok)
        side.data = {k: getattr(m[0], k) for k in DATA_KEYS}
        side.memory_bytes, side.memory_source = _median(x.memory_bytes for x in m), m[0].memory_source
        side.memory_spread = spread([x.memory_bytes for x in m])
        side.rss_after_build_bytes = _median(x.rss_after_build_bytes for x in m)
        side.rss_peak_bytes = _median(x.rss_peak_bytes for x in m)
        side.window_time_s, side.num_measured_steps = _median(x.window_time_s for x in m), m[0].num_measured_steps
        per_rank = [p.get("num_measured_steps") for p in (m[0].per_rank or []) if p.get("num_measured_steps")]
        side.steps_per_process = max(per_rank) if per_rank else m[0].num_measured_steps // max(m[0].num_ranks, 1)
        side.step_time_p10_s = _median(x.step_time_p10_s for x in m)
        side.step_time_p90_s = _median(x.step_time_p90_s for x in m)
        side.mfu_peak, side.flops_per_sample = ok[0].mfu_peak, ok[0].flops_per_sample
        side.source = "command_log" if any(x.source == "command_log" for x in m) else "xfw"
        definition = side.setup.get("comparison", {}).get("throughput")
        if definition:  # what this side's own benchmark script would have printed (xfw.recipe.published)
            side.script_ips = _median(script_throughput(x, definition) for x in m)
    return side


def recipe_settings(side: Side) -> dict:
    """What the recipe set and the side ran with, beyond the applied record: host threads, gradient
    clipping, the optimizer, warm-up and measured steps, its DataLoader (prepared data, or where a
    loader knob is set) and each backend knob (``knob.<name>``); {} for a run without a spec."""
    setup = side.setup
    if "optimizer" not in setup:
        return {}
    opt, knobs = setup.get("optimizer") or {}, dict(setup.get("knobs") or {})
    out = {"cpu_threads": setup.get("cpu_threads") if setup.get("cpu_threads") is not None else "framework default",
           "max_grad_norm": opt.get("max_grad_norm") or "none (no clipping)",
           "optimizer": f"{opt.get('name')} lr {opt.get('lr')}, weight decay {opt.get('weight_decay')}, "
                        f"betas {tuple(opt.get('betas') or ())}, eps {opt.get('eps')}",
           "warmup_and_measured_steps": f"{setup.get('warmup_steps')} / {setup.get('measure_steps')}"}
    if (setup.get("data") or {}).get("kind", "synthetic") != "synthetic" or any(k in knobs for k in LOADER_KNOBS):
        try:
            out["loader_workers"], out["loader_prefetch"] = loader_settings({"backend_knobs": knobs})
        except InvalidSpec:
            out.update({k: knobs.get(k) for k in LOADER_KNOBS})
    out.update({f"knob.{k}": v for k, v in sorted(knobs.items()) if k not in LOADER_KNOBS})
    return out


def add_recipe_settings(row: ComparisonRow) -> None:
    """:func:`recipe_settings` of every side into the settings; a difference is warned about, except
    backend knobs (each framework has its own)."""
    per_side = {name: recipe_settings(s) for name, s in row.sides.items() if s.applied}
    for key in dict.fromkeys(k for values in per_side.values() for k in values):
        values = {name: v.get(key, "–") for name, v in per_side.items()}
        row.settings[key] = values
        if not key.startswith("knob.") and len(values) >= 2 and len({repr(v) for v in values.values()}) > 1:
            row.differing.append(key)
            row.warnings.append(f"{key} differs: " + ", ".join(f"{k}={v}" for k, v in values.items()))


DATA_KEYS = ("padding_fraction", "seq_len_mean", "seq_len_max", "batch_digest", "num_batches")


def compare_data(row: ComparisonRow) -> None:
    """The sides' micro-batch hashes compared (a warning when they differ, ``data_line`` either way),
    and each side's padding and sequence lengths in the settings."""
    sides = {name: s for name, s in row.sides.items() if s.ok and s.data.get("batch_digest")}
    if not sides:
        return
    digests = {name: s.data["batch_digest"] for name, s in sides.items()}
    counts = {name: s.data["num_batches"] for name, s in sides.items()}
    row.settings["batch_hashes"] = {name: f"{digests[name][:12]}… ({counts[name]} micro-batches)" for name in sides}
    if any(s.data.get("padding_fraction") is not None for s in sides.values()):
        row.settings["padding"] = {name: f"{s.data['padding_fraction']:.1%}" for name, s in sides.items()
                                   if s.data.get("padding_fraction") is not None}
        row.settings["seq_len_mean_max"] = {name: f"{s.data['seq_len_mean']:.1f} / {s.data['seq_len_max']}"
                                            for name, s in sides.items() if s.data.get("seq_len_mean") is not None}
    if len(sides) < 2:
        return
    if len(set(digests.values())) == 1 and len(set(counts.values())) == 1:
        row.data_line = (f"Batches: identical on both sides ({next(iter(counts.values()))} micro-batch hashes equal, "
                         f"digest {next(iter(digests.values()))[:12]}…).")
    else:
        row.differing.append("batch_hashes")
        row.data_line = "Batches: **differ** between the sides (see the warnings)."
        row.warnings.append("the sides trained on different batches (micro-batch hashes: "
                            + ", ".join(f"{k} {v[:12]}… over {counts[k]}" for k, v in digests.items()) + ")")


def fmt_value(value) -> str:
    """A recipe value as a report shows it: text as itself, anything else as YAML flow writes it (0.0001, true)."""
    return value if isinstance(value, str) else json.dumps(value)


def fmt_deliberate(by: list[str], key: str, values: dict) -> str:
    """``Deliberate difference (backends.paddle.override): optimizer.lr = 0.0001 on paddle, 0.001 on torch``;
    ``values``: where -> value, in the order shown."""
    where = ", ".join(f"backends.{name}.override" for name in by)
    return (f"Deliberate difference ({where}): {key} = "
            + ", ".join(f"{fmt_value(v)} on {name}" for name, v in values.items()))


def deliberate_differences(row: ComparisonRow) -> None:
    """Each key a side's spec records as overridden (``overrides``, with the recipe's own value in
    ``overridden``): a line in ``row.deliberate`` and an ``override.<key>`` row first in the settings
    (each side's value: its override, else the recipe's). Never a warning: it was asked for."""
    sides = {name: s for name, s in row.sides.items() if s.setup}
    keys = sorted({k for s in sides.values() for k in (s.setup.get("overrides") or {})})
    rows = {}
    for key in keys:
        by = [name for name, s in sides.items() if key in (s.setup.get("overrides") or {})]
        recipe_value = sides[by[0]].setup.get("overridden", {}).get(key)
        values = {name: (s.setup.get("overrides") or {}).get(key, recipe_value) for name, s in sides.items()}
        row.deliberate.append(fmt_deliberate(by, key, values))
        rows[f"override.{key}"] = {name: fmt_value(v) for name, v in values.items()}
        row.deliberate_by[f"override.{key}"] = by
    if rows:
        row.settings = {**rows, **row.settings}
    by = sorted({name for names in row.deliberate_by.values() for name in names})
    for i, warning in enumerate(row.warnings):  # a difference the overrides explain: said so beside the warning
        setting = warning.split(" differs: ")[0].removeprefix("mechanism ")
        if " differs: " in warning and any(k.startswith(_FOLLOWS.get(setting, ())) for k in keys):
            row.warnings[i] = f"{warning} (deliberate: " + ", ".join(f"backends.{n}.override" for n in by) + ")"


_FOLLOWS = {"optimizer": ("optimizer.",), "max_grad_norm": ("optimizer.max_grad_norm",),
            "cpu_threads": ("measure.cpu_threads",), "warmup_and_measured_steps": ("measure.warmup_steps", "measure.steps"),
            "compute_dtype": ("precision.",), "weight_dtype": ("precision.",), "amp_level": ("precision.",),
            "master_weights": ("precision.",), "recompute": ("recompute",), "num_processes": ("parallel.",),
            "grad_accum_steps": ("batch.", "parallel."), "sharding_impl": ("parallel.",)}
"""Settings (the warnings' names) an override of these recipe keys changes on its side."""


def collapse(results: list[RunResult]) -> list[Side]:
    """One :class:`Side` per (recipe, variant, backend), in first-seen order; repeats share one."""
    groups: dict[tuple, list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.recipe, variant_key(r.variant), r.backend), []).append(r)
    return [_side(runs[0].backend, runs) for runs in groups.values()]


def _expected_params(preset: str) -> int | None:
    try:
        return presets.count_params(presets.PRESETS[preset])["total"]
    except (KeyError, NotImplementedError):
        return None


def row_name(row: ComparisonRow) -> str:
    """``recipe`` or ``recipe [variant]``: how reports name a row."""
    return f"{row.recipe} [{variant_label(row.variant)}]" if row.variant else row.recipe


def is_parsed(side: Side) -> bool:
    """Numbers parsed from a command's log, not measured by xfw (``Measurement.source``)."""
    return side.source == "command_log"


def variant_label(variant: dict) -> str:
    """``batch.micro=8, parallel.sharding=stage2`` (values as YAML flow would write them); "" for {}."""
    return ", ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in variant.items())


def strip_common(variants: list[dict]) -> list[dict]:
    """The variants without the keys every one of them sets to the same value (for display: a
    ``--set measure.steps=4`` given to a whole sweep tells the rows apart from nothing)."""
    if len(variants) < 2:
        return [dict(v) for v in variants]
    common = {k for k in variants[0] if all(k in v and v[k] == variants[0][k] for v in variants[1:])}
    return [{k: val for k, val in v.items() if k not in common} for v in variants]


def variant_key(variant: dict) -> str:
    """A hashable, order-independent identity of a variant."""
    return json.dumps(variant, sort_keys=True)


def _count(value: int | None) -> str:
    return "–" if value is None else f"{value:,}"


def compare_row(recipe: str, runs: list[RunResult], backends: list[str]) -> ComparisonRow:
    first = runs[0]
    sides = {b: _side(b, [r for r in runs if r.backend == b]) for b in backends}
    row = ComparisonRow(recipe=recipe, model=presets.display_name(first.preset),
                        stage=STAGE_NAMES.get(first.stage, first.stage), sides=sides, variant=dict(first.variant),
                        expected_params=_expected_params(first.preset))
    a, b = (sides[name] for name in backends[:2]) if len(backends) >= 2 else (None, None)
    if a and b and a.ok and b.ok and b.ips:
        row.contrast = (a.ips - b.ips) / b.ips
        spreads = [s for s in (a.ips_spread, b.ips_spread) if s is not None]
        row.within_noise = abs(row.contrast) <= max(spreads) if spreads else None
    counts = {name: (s.applied.get("num_params_total"), s.applied.get("num_params_trainable"))
              for name, s in sides.items() if s.applied}
    if len(counts) == len(sides) and len(sides) >= 2:
        row.params_match = len(set(counts.values())) == 1
        if not row.params_match:
            row.warnings.append("parameter counts differ: the two sides did not build or train the same model ("
                                + ", ".join(f"{k} {_count(total)} total, {_count(trainable)} trainable"
                                            for k, (total, trainable) in counts.items()) + ")")
    for name, s in sides.items():  # a command xfw attached to: the model it ran against the preset naming the row
        total = (s.applied or {}).get("num_params_total") if "step_boundary" in (s.applied or {}) else None
        if total is not None and row.expected_params and total != row.expected_params:
            row.warnings.append(f"{name} ran {_count(total)} parameters (the modules its steps called, in its notes); "
                                f"the preset {first.preset} has {_count(row.expected_params)}: the row's label and "
                                "MFU's FLOPs are the preset's")
    for key in SETTINGS + SEEN_SETTINGS:
        values = {name: s.applied.get(key) for name, s in sides.items() if s.applied}
        if key in SEEN_SETTINGS:
            values = {name: v for name, v in values.items() if v is not None}
        if values:
            row.settings[key] = values
            if len(values) >= 2 and len({comparison.neutral(key, v) for v in values.values()}) > 1 \
                    and key not in _EXPECTED_TO_DIFFER:
                row.differing.append(key)
                if comparison.kind_of(row) != "published":  # a published row differs by design, each value sourced
                    row.warnings.append(f"{key} differs: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    comparison.add_notes(row, backends)
    add_recipe_settings(row)
    comparison.add_mechanisms(row)
    compare_data(row)
    deliberate_differences(row)
    node_types = {r.node_type for r in runs if r.backend in sides and r.node_type}
    if len(node_types) > 1:  # first: it changes what every other figure of the row means (issue 40)
        by_side = {name: sorted({r.node_type for r in runs if r.backend == name and r.node_type}) for name in sides}
        row.warnings.insert(0, "the runs measured on different node types (" + "; ".join(
            f"{name}: {', '.join(kinds)}" for name, kinds in by_side.items() if kinds)
            + "): speed and memory are not like-for-like; pin one node type (--constraint)")
    sources = {s.memory_source for s in sides.values() if s.ok and s.memory_source}  # a parsed log has none
    if len(sources) > 1:
        row.warnings.append("memory is measured from different sources (" + ", ".join(sorted(sources))
                            + "): not directly comparable")
    return row


def compare_runs(results: list[RunResult], backends: list[str], *,
                 parity: dict[str, dict] | None = None) -> list[ComparisonRow]:
    """One row per (recipe, variant), in the order they first appear; repeats share a row.
    ``parity``: recipe name -> its parity status, when looked up (a recipe missing from it has none)."""
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.recipe, variant_key(r.variant)), []).append(r)
    rows = [compare_row(name, runs, backends) for (name, _), runs in groups.items()]
    if parity is not None:
        for row in rows:
            row.parity = parity.get(row.recipe, {"status": "none", "path": None, "note": ""})
    return rows


def backends_in(results: list[RunResult]) -> list[str]:
    """Backends in first-seen order (for reports over run directories)."""
    seen: list[str] = []
    for r in results:
        if r.backend not in seen:
            seen.append(r.backend)
    return seen
