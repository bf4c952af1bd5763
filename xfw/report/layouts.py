"""Report layouts beyond the contrast table: each seed's table, as pure functions over RunResults.

Each layout returns :class:`~xfw.report.table.Table` sections (a title, a header, formatted cells,
the raw numbers for CSV, notes), which :mod:`xfw.report.table` renders like every other report::

    xfw report runs/sweep-llava7b-sft --layout strategies

    For 2x NVIDIA H100 80GB HBM3:

    | Framework | Strategy | Time for 100 iters (s) | Throughput (batches/s) | VRAM / GPU (GB) | GB / batch |
    |---|---|---:|---:|---:|---:|
    | torch | ZeRO-2 (fsdp2) | 84.2 | 1.19 | 61.3 | 7.66 |

Layouts and their seeds: ``contrast`` (seed 003, :mod:`xfw.report.contrast`), ``strategies`` (seed
000), ``ranks`` (seed 001), ``batch`` (seed 002), ``scaling`` and ``cost`` (seed 004). Repeats of one (recipe, variant, backend) collapse to their
median, as in the contrast table; a failed run keeps its row with its status in place of numbers.
"""

from __future__ import annotations

from xfw.report import contrast
from xfw.report.compare import Side, backends_in, collapse, compare_runs, strip_common, variant_key, variant_label
from xfw.report.measure import PARSED_NOTE
from xfw.report.results import RunResult
from xfw.report.table import Strong, Table

GB = 1e9  # seeds 000 and 004 write decimal GB
_STRATEGY_NAMES = {"stage1": "ZeRO-1", "stage2": "ZeRO-2", "stage3": "ZeRO-3"}


def collapse_shown(results: list[RunResult]) -> list[Side]:
    """One side per (recipe, variant, backend) (:func:`xfw.report.compare.collapse`), with only the
    variant keys that tell them apart (a sweep-wide ``--set`` would clutter each row)."""
    sides = collapse(results)
    for side, shown in zip(sides, strip_common([s.variant for s in sides])):
        side.variant = shown
    return sides


def on_gpus(entries: list[Side]) -> bool:
    """Whether these runs ran on GPUs (then the seeds' words: GPUs, VRAM); on CPU the tables say
    processes and memory instead, never GPUs."""
    return any(str(e.applied.get("device", "")).startswith(("cuda", "gpu")) for e in entries)


def devices_word(entries: list[Side], gpu_word: str = "GPUs") -> str:
    return gpu_word if on_gpus(entries) else "Processes"


def hardware(e: Side, gpus: bool) -> str:
    """``8x NVIDIA H800`` on GPUs; ``2 processes on AMD EPYC`` on a CPU."""
    n = e.num_processes
    return f"{n}x {e.device}" if gpus else f"{n} process{'es' if n != 1 else ''} on {e.device}"


def _other_keys(variant: dict, prefixes: tuple[str, ...]) -> dict:
    return {k: v for k, v in variant.items() if not k.startswith(prefixes)}


def _status_cell(e: Side) -> str:
    return "OOM" if e.status == "oom" else Strong(e.status)


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _framework(e: Side) -> str:
    """The backend's name, marked when its numbers were parsed from a command's log, not measured."""
    return e.backend + (contrast.PARSED_MARK if contrast.is_parsed(e) else "")


def _measured_by(e: Side) -> str:
    return PARSED_NOTE if contrast.is_parsed(e) else "xfw"


def _parsed_notes(entries: list[Side]) -> list[str]:
    return [contrast.PARSED_LINE] if any(contrast.is_parsed(e) for e in entries) else []


def _rss_measured(entries: list[Side]) -> bool:
    """Whether these runs' shared memory measure is the process's resident set (a CPU): then every
    layout shows it (the training memory where the peak was reset at the build), as the contrast does."""
    return any(e.ok and e.memory_source in ("rss_training", "peak_rss") for e in entries)


def _rss_source(entries: list[Side]) -> str:
    sources = {e.memory_source for e in entries if e.ok and e.memory_source in ("rss_training", "peak_rss")}
    return "rss_training" if sources == {"rss_training"} else "peak_rss"


def _rss_word(entries: list[Side]) -> str:
    return "Training memory" if _rss_source(entries) == "rss_training" else "Peak RSS"


def _memory_source_notes(entries: list[Side]) -> list[str]:
    """Say where memory is not GPU memory, and which framework measured it how: a column must not
    silently mix an allocator's bytes with a process's peak RSS."""
    by_backend: dict[str, set[str]] = {}
    for e in entries:
        if e.memory_source:
            by_backend.setdefault(e.backend, set()).add(e.memory_source)
    sources = set().union(*by_backend.values()) if by_backend else set()
    notes = []
    if sources - {"cuda_allocator"}:
        notes.append(f"Memory here is {'; '.join(contrast.measure_name(x) for x in sorted(sources - {'cuda_allocator'}))}"
                     ", not GPU memory: these runs had no GPU.")
    if len(sources) > 1:
        notes.append("Memory sources differ (" + "; ".join(f"{b}: {', '.join(sorted(v))}" for b, v in
                                                         by_backend.items())
                     + "): compare memory within a framework, not across.")
    return notes


# --- seed 000: strategies x GPU count -----------------------------------------------------------

def strategy_name(e: Side, applied_impl: str | None = None) -> str:
    sharding = e.setup.get("sharding", "none")
    name = _STRATEGY_NAMES.get(sharding, "DDP" if e.num_processes > 1 else "single device")
    if applied_impl and applied_impl.lower() not in ("none", sharding, name.lower()):
        name += f" ({applied_impl})"
    rest = _other_keys(e.variant, ("parallel.",))
    return f"{name}, {variant_label(rest)}" if rest else name


def strategies(results: list[RunResult]) -> list[Table]:
    """Seed 000: per GPU count, Framework | Strategy | Time for 100 iters | batches/s | VRAM | GB/batch."""
    impls = {(r.recipe, variant_key(r.variant), r.backend): r.applied.get("sharding_impl") for r in results}
    entries = collapse_shown(results)
    gpus = on_gpus(entries)
    rss = _rss_measured(entries)
    unit, scale = contrast.memory_unit(e.memory_bytes for e in entries if e.ok) if rss else ("GB", GB)
    header = ["Framework", "Strategy", "Time for 100 iters (s)", "Throughput (batches/s)",
              "VRAM / GPU (GB)" if gpus else f"{_rss_word(entries)} / process ({unit})" if rss
              else "Memory / process (GB)", f"{unit} / batch"]
    tables = []
    backends = list(dict.fromkeys(e.backend for e in entries))
    shardings = ("none", *_STRATEGY_NAMES)
    for count in sorted({e.num_processes for e in entries}):  # 1 process (GPU) first, as counts read
        # Grouped by framework as in the seed, strategies from least to most sharded.
        mine = sorted((e for e in entries if e.num_processes == count),
                      key=lambda e: (backends.index(e.backend), shardings.index(e.setup.get("sharding", "none"))))
        devices = sorted({e.device for e in mine})
        cells, records = [], []
        for e in mine:
            strategy = strategy_name(e, impls.get((e.recipe, variant_key(e.variant), e.backend)))
            vram = e.memory_bytes if rss else \
                e.mem_reserved_peak_bytes if e.mem_reserved_peak_bytes is not None else e.mem_alloc_peak_bytes
            global_batch, micro = e.setup.get("global_batch"), e.setup.get("micro_batch")
            batches_per_s = e.ips / global_batch if e.ok and global_batch else None
            per_sample = vram / micro if vram is not None and micro else None
            if e.ok:
                cells.append([_framework(e), strategy, _num(e.step_time_median_s * 100 if e.step_time_median_s else None, ".1f"),
                              _num(batches_per_s, ".3g"), _num(vram / scale if vram is not None else None, ".3g"),
                              _num(per_sample / scale if per_sample is not None else None, ".3g")])
            else:
                cells.append([e.backend, strategy, _status_cell(e), "–", "–", "–"])
            records.append({"num_processes": count, "device": ", ".join(devices), "framework": e.backend,
                            "recipe": e.recipe, "strategy": strategy, "status": e.status,
                            "time_100_iters_s": e.step_time_median_s * 100 if e.ok and e.step_time_median_s else None,
                            "batches_per_s": batches_per_s, "vram_per_gpu_bytes": vram,
                            "bytes_per_sample": per_sample, "global_batch": global_batch, "micro_batch": micro,
                            "memory_source": e.memory_source, "memory_measure": contrast.measure_name(e.memory_source),
                            "measured_by": _measured_by(e)})
        where = f"{count}x" if gpus else f"{count} process{'es' if count != 1 else ''} on"
        tables.append(Table(seed_columns=True, title=f"For {where} {' / '.join(devices)}:", header=header, cells=cells,
                            records=records, numeric=(2, 3, 4, 5)))
    if tables:
        tables[-1].notes += _memory_source_notes(entries) + _parsed_notes(entries)
    if tables:
        memory = (f"memory per process = the largest rank's {contrast.measure_name(_rss_source(entries))}" if rss
                  else "memory per GPU (process) = the largest rank's peak reserved by the allocator (allocated "
                  "where reserved is unknown)")
        tables[-1].notes.append("Time for 100 iters = 100 x median optimizer-step time; batches/s = global "
                                f"samples/s / global batch; {memory}; {unit} / batch = that "
                                "memory per sample of the micro-batch.")
    return tables


# --- seed 001: per rank ---------------------------------------------------------------------------

def ranks(results: list[RunResult]) -> list[Table]:
    """Seed 001: per run, Rank | Time | Max Memory Allocated, then the final loss."""
    tables = []
    sources = {r.measurement.memory_source for r in results if r.measurement.memory_source}
    rss_all = bool(sources & {"rss_training", "peak_rss"})
    column = ("Training memory" if sources == {"rss_training"} else "Peak RSS") if rss_all else "Max Memory Allocated"
    for r, variant in zip(results, strip_common([r.variant for r in results])):
        parsed = r.measurement.source == "command_log"
        title = f"{r.backend}{contrast.PARSED_MARK if parsed else ''}: {r.recipe}" + \
            (f" [{variant_label(variant)}]" if variant else "")
        title += f" (repeat {r.repeat_index})" if r.repeat_index else ""
        cells, records = [], []
        source = r.measurement.memory_source
        rss = source in ("rss_training", "peak_rss")
        key = "rss_training_bytes" if source == "rss_training" else "rss_peak_bytes" if rss else "mem_alloc_peak_bytes"
        unit, scale = contrast.memory_unit(p.get(key) for p in r.measurement.per_rank)
        for p in r.measurement.per_rank:
            value = p.get(key)
            shown = "–" if value is None else f"{value / scale:.2f} {unit}" if rss else f"{value} bytes"
            cells.append([str(p["rank"]), _num(p["window_time_s"], ".3f") + " seconds", shown])
            records.append({"backend": r.backend, "recipe": r.recipe, "variant": variant_label(r.variant),
                            "repeat_index": r.repeat_index, "rank": p["rank"], "time_s": p["window_time_s"],
                            "memory_bytes": value, "memory_source": source,
                            "memory_measure": contrast.measure_name(source) if source else None,
                            "extra_own_mem_peak_bytes": p["mem_alloc_peak_bytes"],
                            "extra_own_mem_source": r.measurement.mem_source, "loss_last": r.measurement.loss_last,
                            "status": r.status, "measured_by": PARSED_NOTE if parsed else "xfw"})
        loss = r.measurement.loss_last
        notes = [f"loss: {loss:.4f}" if loss is not None else "loss: –"]
        if not r.ok:
            notes.append(f"status: {r.status} — {r.reason}")
        if source and source != "cuda_allocator":
            notes.append(f"memory: {contrast.measure_name(source)}")
        if parsed:
            notes.append(contrast.PARSED_LINE)
        tables.append(Table(seed_columns=True, title=title, header=["Rank", "Time", column], cells=cells,
                            records=records, notes=notes))
    if tables:
        tables[-1].notes.append("Time = the rank's measured window (warm-up excluded); memory = the rank's share of "
                                "the measure both backends share (on a GPU the peak allocated by the CUDA allocator; "
                                "on a CPU the training memory: peak resident set since the build minus the resident "
                                "set after it). Accuracy is not measured.")
    return tables


# --- seed 002: throughput per global batch, OOM rows kept ---------------------------------------

def batch(results: list[RunResult]) -> list[Table]:
    """Seed 002: Hardware | Framework | Recipe | Global batch size | Micro-batch | Throughput, OOM rows
    kept, largest batch first (as an OOM search probes)."""
    entries = collapse_shown(results)
    gpus = on_gpus(entries)
    shown = ("batch.", "parallel.nproc_per_node", "parallel.nnodes")  # already in the size and hardware columns
    with_variant = any(_other_keys(e.variant, shown) for e in entries)
    header = ["Hardware", "Framework", "Recipe"] + (["Variant"] if with_variant else []) + \
        ["Global batch size", "Micro-batch", "Throughput (samples/s)"]

    def order(e: Side):
        return (e.device, e.num_processes, e.backend, e.recipe, variant_key(_other_keys(e.variant, shown)),
                -(e.setup.get("global_batch") or 0), -(e.setup.get("micro_batch") or 0))

    cells, records, bullets = [], [], []
    for e in sorted(entries, key=order):
        where, size, micro = hardware(e, gpus), e.setup.get("global_batch"), e.setup.get("micro_batch")
        rest = variant_label(_other_keys(e.variant, shown))
        rate = f"{e.ips:,.3g}" if e.ok else _status_cell(e)
        cells.append([where, _framework(e), e.recipe] + ([rest] if with_variant else [])
                     + [str(size), str(micro), rate])
        records.append({"hardware": where, "framework": e.backend, "recipe": e.recipe, "variant": rest,
                        "global_batch": size, "micro_batch": micro, "status": e.status, "samples_per_s": e.ips,
                        "measured_by": _measured_by(e)})
        extra = f", {rest}" if rest else ""
        bullets.append(f"- *{where}* ({_framework(e)}, {e.recipe}): global batch size {size} (micro-batch {micro})"
                       f"{extra}: " + (f"{e.ips:,.3g} samples/s" if e.ok else "OOM" if e.status == "oom" else e.status))
    return [Table(seed_columns=True, title="", header=header, cells=cells, records=records,
                  numeric=(len(header) - 3, len(header) - 2, len(header) - 1), notes=bullets + _parsed_notes(entries))]


# --- seed 004: scaling and cost -----------------------------------------------------------------

_SCALED = ("batch.", "parallel.nproc_per_node", "parallel.nnodes")


def _unsharded_single(e: Side, entries: list[Side]) -> Side | None:
    """The same framework's single-process, unsharded run with otherwise the same settings: the
    baseline of a sharded group whose 1-process run could not run (one process has nothing to shard)."""
    rest = variant_key(_other_keys(e.variant, (*_SCALED, "parallel.sharding")))
    return next((o for o in entries if o.ok and o.num_processes == 1 and o.recipe == e.recipe and o.backend == e.backend
                 and o.setup.get("sharding", "none") == "none"
                 and variant_key(_other_keys(o.variant, (*_SCALED, "parallel.sharding"))) == rest), None)


def scaling_baseline(group: list[Side], entries: list[Side]) -> tuple[Side | None, str]:
    """(baseline, how it was chosen): the group's run at its smallest GPU count; where that did not
    run, the framework's 1-process unsharded run; else the smallest GPU count that ran."""
    smallest = min(e.num_processes for e in group)
    base = next((e for e in group if e.ok and e.num_processes == smallest), None)
    if base:
        return base, ""
    single = _unsharded_single(group[0], entries) if smallest == 1 else None
    if single:
        return single, (f"Linear Scaling against the 1x unsharded run ({single.ips:,.1f} samples/s): the 1x row of "
                        "this strategy did not run, and one process has nothing to shard.")
    base = next((e for e in group if e.ok), None)
    if base:
        unit = "GPU" if on_gpus(entries) else "process"
        return base, f"Linear Scaling against {base.num_processes}x, the smallest {unit} count that ran."
    return None, ""


def _scaling_groups(entries: list[Side]) -> list[tuple[str, list[Side]]]:
    """Runs that form a scaling series: the same recipe, backend, micro-batch and other settings, at
    several process counts, with either the same global batch (strong scaling) or the same batch per
    process (weak scaling). Returns (how the batch is held, runs) for every series of two counts or more."""
    groups: dict[tuple, list[Side]] = {}
    for e in entries:
        groups.setdefault((e.recipe, e.backend, e.setup.get("micro_batch"),
                           variant_key(_other_keys(e.variant, _SCALED))), []).append(e)
    series = []
    for group in groups.values():
        per_process = {(e.setup.get("global_batch") or 0) // max(e.num_processes, 1) for e in group}
        by_global: dict[int, list[Side]] = {}
        for e in group:
            by_global.setdefault(e.setup.get("global_batch") or 0, []).append(e)
        if len(by_global) > 1 and len(per_process) == 1:
            candidates = [(f"weak scaling: {per_process.pop()} samples per process per step", group)]
        else:
            candidates = [(f"strong scaling: global batch {size}", runs) for size, runs in by_global.items()]
        series += [(how, runs) for how, runs in candidates if len({e.num_processes for e in runs}) > 1]
    return series


def scaling(results: list[RunResult]) -> list[Table]:
    """Seed 004: per scaling series (:func:`_scaling_groups`), GPUs | Batch Size | Throughput | Linear
    Scaling, against the smallest GPU count (:func:`scaling_baseline`). Runs that differ only in
    something else (a micro-batch sweep at one process count) are no scaling series: ValueError."""
    everything = collapse_shown(results)
    gpus = on_gpus(everything)
    series = _scaling_groups(everything)
    if not series:
        varying = sorted({k for e in everything for k in e.variant})
        raise ValueError("--layout scaling: these runs form no series at several process counts with a fixed "
                         "global batch or a fixed batch per process"
                         + (f" (they differ in {', '.join(varying)})" if varying else "")
                         + "; sweep parallel.nproc_per_node to measure scaling")
    tables = []
    for how, entries in series:
        entries.sort(key=lambda e: (e.num_processes, e.setup.get("global_batch") or 0))
        base, note = scaling_baseline(entries, everything)
        first = entries[0]
        rest = variant_label(_other_keys(first.variant, _SCALED))
        cells, records = [], []
        for e in entries:
            eff = (e.ips / e.num_processes) / (base.ips / base.num_processes) if e.ok and base else None
            cells.append([f"{e.num_processes}x", str(e.setup.get("global_batch")),
                          f"{e.ips:,.1f} samples/s" if e.ok else _status_cell(e),
                          f"{eff:.2f}x" if eff is not None else "–"])
            records.append({"recipe": first.recipe, "framework": first.backend, "num_processes": e.num_processes,
                            "global_batch": e.setup.get("global_batch"), "micro_batch": e.setup.get("micro_batch"),
                            "samples_per_s": e.ips, "linear_scaling": eff,
                            "baseline_num_processes": base.num_processes if base else None, "status": e.status,
                            "measured_by": _measured_by(e)})
        title = (f"{first.model} {first.stage} on {first.device} ({_framework(first)}), {how}, micro-batch "
                 f"{first.setup.get('micro_batch')}" + (f" [{rest}]" if rest else ""))
        tables.append(Table(seed_columns=True, title=title, header=[devices_word(entries), "Batch Size", "Throughput", "Linear Scaling"],
                            cells=cells, records=records, numeric=(1, 2, 3),
                            notes=([note] if note else []) + _parsed_notes(entries)))
    unit = "GPU" if gpus else "process"
    tables[-1].notes.append(f"Linear Scaling = (samples/s per {unit}) / (samples/s per {unit} at the smallest "
                            f"{unit} count that ran); 1.00x is perfect scaling. Batch Size is the global batch.")
    return tables


def cost(results: list[RunResult], price_per_gpu_hour: float) -> list[Table]:
    """Seed 004: Model | GPU | Recipe | Cost/1M Samples | Notes, from a price per GPU-hour."""
    cells, records = [], []
    entries = collapse_shown(results)
    gpus = on_gpus(entries)
    for e in entries:
        gpu = hardware(e, gpus)
        recipe = e.stage + (f" ({variant_label(e.variant)})" if e.variant else "")
        # GPU-hours for 1M samples = GPUs x 1e6 / (samples/s) / 3600
        usd = price_per_gpu_hour * e.num_processes * 1e6 / e.ips / 3600 if e.ok else None
        note = f"{_framework(e)}, {e.ips:,.1f} samples/s" if e.ok else f"{e.backend}: {e.status}"
        cells.append([e.model, gpu, recipe, f"${usd:,.2f}" if usd is not None else "–", note])
        records.append({"model": e.model, "recipe": e.recipe, "framework": e.backend, "gpu": gpu,
                        "variant": variant_label(e.variant), "samples_per_s": e.ips,
                        "price_per_gpu_hour": price_per_gpu_hour, "cost_per_1m_samples": usd, "status": e.status,
                        "measured_by": _measured_by(e)})
    return [Table(seed_columns=True, title="Cost Per Sample", header=["Model", "GPU" if gpus else "Hardware", "Recipe", "Cost/1M Samples",
                                                   "Notes"],
                  cells=cells, records=records, numeric=(3,),
                  notes=[f"Based on 1 million training samples at ${price_per_gpu_hour:g} per "
                         f"{'GPU-hour' if gpus else 'process-hour (the price given, charged per process: these runs had no GPU)'}: "
                         f"cost = price x {'GPUs' if gpus else 'processes'} x 10^6 / (samples/s) / 3600, measured window "
                         "only (no start-up)."] + _parsed_notes(entries))]


def contrast_layout(results: list[RunResult]) -> list[Table]:
    """Seed 003: backends side by side (:mod:`xfw.report.contrast`), in the order found."""
    return [contrast.contrast_table(compare_runs(results, backends_in(results)), backends_in(results))]


LAYOUTS = {
    "contrast": ("Training benchmark", contrast_layout),
    "strategies": ("Training strategies by GPU count", strategies),
    "ranks": ("Per-rank time and memory", ranks),
    "batch": ("Throughput per global batch size", batch),
    "scaling": ("Multi-GPU scaling", scaling),
    "cost": ("Cost per 1M samples", cost),
}
"""Layout name -> (title, function from runs to tables)."""


def page_title(layout: str, results: list[RunResult]) -> str:
    """The layout's title in the runs' hardware words (processes, not GPUs, for runs without one)."""
    title = LAYOUTS[layout][0]
    if on_gpus(collapse_shown(results)):
        return title
    return title.replace("Multi-GPU", "Multi-process").replace("GPU count", "process count")


def comparison_line(results: list[RunResult]) -> str:
    """Which comparison the runs are (the page's subtitle): ``Comparison: like-for-like comparison``."""
    from xfw.report import comparison

    rows = compare_runs(results, backends_in(results))
    return f"Comparison: {comparison.short_name(rows)}." if rows else ""


def build(layout: str, results: list[RunResult], *, price_per_gpu_hour: float | None = None) -> list[Table]:
    if layout not in LAYOUTS:
        raise ValueError(f"--layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    if layout == "cost":
        if price_per_gpu_hour is None or price_per_gpu_hour <= 0:
            raise ValueError("--layout cost needs a positive --price-per-gpu-hour")
        return cost(results, price_per_gpu_hour)
    if price_per_gpu_hour is not None:
        raise ValueError("--price-per-gpu-hour applies only to --layout cost")
    return LAYOUTS[layout][1](results)
