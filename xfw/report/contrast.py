"""The contrast report (seed 003): backends side by side per (recipe, variant), with the settings
each side applied. Pure functions from :mod:`xfw.report.compare` rows to a :class:`~xfw.report.table.Page`::

    | Model      | Stage | paddle ips | Contrast | torch ips | paddle memory                              | ...
    |------------|-------|-----------:|---------:|----------:|--------------------------------------------| ...
    | Tiny LLaVA | SFT   |        125 |     -70% |       412 | 512.31 MiB peak RSS (498.02 after build)   | ...

followed by failed runs, warnings (every applied setting that differs), and the settings table.
Memory is the measure both sides share (``Measurement.memory_bytes``): the CUDA allocator's peak
allocated/reserved on a GPU, each process's peak resident set on a CPU with the resident set right
after the model was built beside it (start-up is not training memory); each framework's own figure
stays in the CSV and the settings. Every cell carries its unit and source.
"""

from __future__ import annotations

from pathlib import Path

from xfw.report import comparison
from xfw.report.compare import ComparisonRow, Side, is_parsed, row_name, strip_common, variant_label
from xfw.report.trust import noise_notes, short_windows, starting_points
from xfw.report.measure import PARSED_NOTE
from xfw.report.provenance import fmt_build, provenance_table, settings_blocks
from xfw.report.table import Bullets, Heading, Image, Page, Paragraph, Strong, Table

SOURCE_LABELS = {"cuda_allocator": "GPU allocator", "host_allocator": "host allocator", "peak_rss": "peak RSS",
                 "rss_training": "training memory"}
PARSED_MARK = " ‡"
PARSED_LINE = f"‡ {PARSED_NOTE} (the backend's log_pattern in the recipe)."


GIB, MIB = 1024**3, 1024**2


def fmt_rate(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}" if value < 10 else f"{value:.1f}"


def fmt_contrast(row: ComparisonRow) -> str:
    if row.ab_cell:
        return row.ab_cell
    if row.contrast is None:
        return "n/a"
    text = _pct(row.contrast)
    return text + (" (noise)" if row.within_noise else "")


def _pct(value: float) -> str:
    return f"{value:+.0%}" if abs(value) >= 0.1 else f"{value:+.1%}"


ONE_RUN = "one run, no spread"
"""What a headline figure says where it has no spread to show (no repeats)."""


def contrast_range(row: ComparisonRow, backends: list[str]) -> tuple[float, float] | None:
    """The lowest and highest contrast the repeats allow (first side's lowest against the second's
    highest, and the other way round); None unless both sides have repeats."""
    a, b = (row.sides[name] for name in backends[:2])
    if row.contrast is None or a.num_repeats < 2 or b.num_repeats < 2 or not (b.ips_low and b.ips_high):
        return None
    return (a.ips_low - b.ips_high) / b.ips_high, (a.ips_high - b.ips_low) / b.ips_low


def fmt_headline_contrast(row: ComparisonRow, backends: list[str]) -> str:
    """The contrast as the table and the chart show it: with the range its repeats allow, or saying it
    is one run with no spread."""
    if row.contrast is None or len(backends) < 2 or row.ab_cell:
        return fmt_contrast(row)
    span = contrast_range(row, backends)
    spread_text = f"range {_pct(span[0])} to {_pct(span[1])}" if span else ONE_RUN if all(
        row.sides[n].num_repeats < 2 for n in backends[:2]) else "one side one run, no spread"
    return f"{_pct(row.contrast)} ({spread_text})" + (" (noise)" if row.within_noise else "")


def fmt_memory_pair(alloc: float | None, reserved: float | None, source: str | None, *, what: str = "") -> str:
    """``2.00/3.00 GiB (GPU allocator)``; ``371.48/– MiB (peak RSS)`` where a source has no reserved figure;
    ``what`` names the pair (``alloc/reserved``) before the source."""
    if alloc is None and reserved is None:
        return "–"
    unit, scale = ("GiB", GIB) if max(alloc or 0, reserved or 0) >= GIB else ("MiB", MIB)
    shown = [f"{v / scale:.2f}" if v is not None else "–" for v in (alloc, reserved)]
    return f"{shown[0]}/{shown[1]} {unit}{f' {what}' if what else ''} ({SOURCE_LABELS.get(source or '', source or '?')})"


MEASURE_NAMES = {"rss_training": "training memory (peak RSS since the build − RSS after the build)",
                 "peak_rss": "peak RSS (start-up included)", "cuda_allocator": "GPU allocator peak allocated",
                 "host_allocator": "Paddle host allocator peak", "torch_peak_rss": "PyTorch process peak RSS"}
"""The shared memory measure's name by ``memory_source``, the same in every layout, CSV and nightly."""


def memory_unit(values) -> tuple[str, int]:
    """One unit for a set of byte counts (a table's, so both sides read in the same unit)."""
    values = [v for v in values if v is not None]
    return ("GiB", GIB) if values and max(values) >= GIB else ("MiB", MIB)


def measure_name(source: str | None) -> str:
    return MEASURE_NAMES.get(source or "", source or "?")


def fmt_memory(side: Side, unit: tuple[str, int] | None = None) -> str:
    """The shared measure: on a CPU the training memory, with the peak RSS and the RSS after the
    build beside it; the peak RSS alone where the peak could not be reset at the build; allocated /
    reserved on a GPU. ``unit``: the table's (:func:`memory_unit`)."""
    if not side.ok or side.memory_bytes is None:
        return "–"
    noise = f"; spread {side.memory_spread:.1%}" if side.memory_spread is not None else f"; {ONE_RUN}"
    if side.memory_source in ("rss_training", "peak_rss"):
        name, scale = unit or memory_unit([side.memory_bytes])
        if side.memory_source == "peak_rss":
            after = side.rss_after_build_bytes
            return (f"{side.memory_bytes / scale:.2f} {name} whole-process peak RSS (start-up included, not training "
                    "memory" + (f"; {after / scale:.2f} {name} after build" if after else "") + f"{noise})")
        return (f"{side.memory_bytes / scale:.2f} {name} training (peak RSS {side.rss_peak_bytes / scale:.2f} {name}, "
                f"{side.rss_after_build_bytes / scale:.2f} {name} after build{noise})")
    pair = fmt_memory_pair(side.mem_alloc_peak_bytes, side.mem_reserved_peak_bytes, side.memory_source,
                           what="alloc/reserved")
    return pair[:-1] + f"{noise})" if pair.endswith(")") else pair


def fmt_mfu(side: Side) -> str:
    """The side's MFU; n/a on a GPU without a datasheet peak (the table's notes say why)."""
    return f"{side.mfu:.1%}" if side.mfu is not None else "n/a" if side.on_gpu else "–"


def fmt_side_rate(side: Side) -> str:
    if side.ok:
        spread = f" (spread {side.ips_spread:.1%})" if side.ips_spread is not None else f" ({ONE_RUN})"
        return fmt_rate(side.ips) + spread + (PARSED_MARK if is_parsed(side) else "")
    return Strong(side.status)


def fmt_params(row: ComparisonRow, backends: list[str]) -> str:
    """Total parameters per side, and trainable ones where they differ from the total; ✓ only when
    both counts agree on every side."""
    def count(side: Side, key: str) -> str:
        value = side.applied.get(key)
        return f"{value:,}" if value is not None else "–"

    sides = [row.sides[b] for b in backends]
    text = " / ".join(count(s, "num_params_total") for s in sides)
    if any(s.applied.get("num_params_trainable") not in (None, s.applied.get("num_params_total")) for s in sides):
        text += " (trainable " + " / ".join(count(s, "num_params_trainable") for s in sides) + ")"
    if row.params_match is True:
        text += " ✓"
    elif row.params_match is False:
        text += " ✗ differ"
    return text


def contrast_table(rows: list[ComparisonRow], backends: list[str]) -> Table:
    """Seed 003's table: one row per (recipe, variant); raw numbers per side in ``records``."""
    a, b = backends[0], backends[1] if len(backends) > 1 else None
    shown = strip_common([row.variant for row in rows])  # keys every row shares say nothing
    with_variant = any(shown)
    kinds = [comparison.kind_of(row) for row in rows]
    with_kind = len(set(kinds)) > 1  # a sweep over comparison=like-for-like,published: each row says which
    header = ["Model", "Stage"] + (["Variant"] if with_variant else []) + (["Comparison"] if with_kind else []) \
        + [f"{a} ips"]
    if b:
        header += ["Contrast", f"{b} ips"]
    header += [f"{name} ips" for name in backends[2:]]  # a third backend and on: its ips, no contrast
    numeric = tuple(i for i, h in enumerate(header) if h.endswith(" ips") or h == "Contrast")
    header += [memory_header(rows, name) for name in backends]
    with_mfu = any(side.mfu is not None or side.on_gpu for row in rows for side in row.sides.values())
    if with_mfu:
        numeric += tuple(range(len(header), len(header) + len(backends)))
        header += [f"{name} MFU" for name in backends]
    header += [f"Params ({' / '.join(backends)})"]
    cells = []
    previous_model = None
    unit = memory_unit(s.memory_bytes for row in rows for s in row.sides.values() if s.ok)
    for row, variant, kind in zip(rows, shown, kinds):
        line = [row.model if row.model != previous_model else "", row.stage]
        line += [variant_label(variant)] if with_variant else []
        line += [kind] if with_kind else []
        line += [fmt_side_rate(row.sides[a])]
        previous_model = row.model
        if b:
            line += [fmt_headline_contrast(row, backends), fmt_side_rate(row.sides[b])]
        line += [fmt_side_rate(row.sides[name]) for name in backends[2:]]
        line += [fmt_memory(row.sides[name], unit) for name in backends]
        if with_mfu:
            line += [fmt_mfu(row.sides[name]) for name in backends]
        line += [fmt_params(row, backends)]
        cells.append(line)
    parsed = any(is_parsed(side) for row in rows for side in row.sides.values())
    return Table(header=header, cells=cells, records=numeric_records(rows, backends), numeric=numeric,
                 name="contrast", notes=([PARSED_LINE] if parsed else []) + (mfu_notes(rows) if with_mfu else [])
                 + noise_notes(rows, backends))


def memory_header(rows: list[ComparisonRow], name: str) -> str:
    """``paddle memory``; ``paddle memory (whole-process peak RSS)`` where every figure of the column is a
    whole process's peak (a command xfw attached to): never under the header training memory stands under."""
    sources = {row.sides[name].memory_source for row in rows if row.sides[name].ok and row.sides[name].memory_bytes}
    return f"{name} memory (whole-process peak RSS)" if sources == {"peak_rss"} else f"{name} memory"


def mfu_notes(rows: list[ComparisonRow]) -> list[str]:
    """How MFU was computed, every peak it divides by (with its datasheet), and each GPU side without
    one and why."""
    peaks = sorted({s.mfu_peak for row in rows for s in row.sides.values() if s.mfu is not None})
    missing = sorted({f"{s.backend} on {s.device}: {s.mfu_peak}" for row in rows for s in row.sides.values()
                      if s.on_gpu and s.mfu is None and s.mfu_peak})
    notes = ["MFU = model FLOPs per sample (the family's ledger, recomputation excluded; the same for every "
             "backend) × ips / (peak × GPUs)." + (f" Peak: {'; '.join(peaks)}." if peaks else "")]
    return notes + [f"No MFU for {m}." for m in missing]


def not_applicable(row: ComparisonRow, side: Side) -> bool:
    """A sweep point its backend refused by construction (``unsupported``: stage 1 on one process):
    not a failure (``xfw.workflow.base.not_applicable``)."""
    return side.status == "unsupported" and bool(row.variant)


def failures(rows: list[ComparisonRow]) -> list[str]:
    return [f"{row_name(row)} / {side.backend}: {side.status} — {side.reason}"
            for row in rows for side in row.sides.values() if not side.ok and not not_applicable(row, side)]


def inapplicable(rows: list[ComparisonRow]) -> list[str]:
    """Sweep points that cannot run here by construction, each with its reason (listed apart from failures)."""
    return [f"{row_name(row)} / {side.backend}: {side.reason}"
            for row in rows for side in row.sides.values() if not_applicable(row, side)]


def builds_heading(backends: list[str]) -> str:
    """When the contrast is between two builds of one framework (``paddle@3.2.0`` against ``paddle``), the
    heading says so first: a reader must not take it for the framework comparison."""
    framework = comparison.one_framework(backends)
    if not framework:
        return ""
    return (f"Two builds of {framework}: {backends[0]} against {backends[1]} (the contrast is between the builds, "
            "not between frameworks). ")


def test_device_flag(rows: list[ComparisonRow]) -> str:
    """Where a side ran on a CPU test device (Paddle's ``testcpu``): its timings are a CPU's, not a GPU's."""
    on_test = sorted({name for row in rows for name, side in row.sides.items() if side.ok and (
        "test device" in str(side.applied.get("device", "")).lower() or "testcpu" in str(side.device).lower()
        or "test device" in str(side.device).lower())})
    if not on_test:
        return ""
    return (f"{' and '.join(on_test)} ran on xfw's CPU test device (testcpu): its GPU code paths ran on a CPU, so "
            "its timings and memory are a CPU's, not a GPU's (docs/testdevice.md).")


def _any_attached(rows: list[ComparisonRow]) -> bool:
    return any("command" in ((side.env or {}).get("backend") or {}) for row in rows for side in row.sides.values())


def contrast_page(rows: list[ComparisonRow], backends: list[str], *, title: str = "Training benchmark",
                  chart: Path | None = None, warnings: list[str] = (), extra: list = ()) -> Page:
    """The whole compare report: which comparison it is, table, chart, how to read it, failed runs,
    warnings, settings, what each side ran differently and its source (xfw.report.comparison)."""
    deliberate = deliberate_lines(rows)
    variables = list(dict.fromkeys(v for row in rows for v in comparison.result_variables(row)))
    blocks: list = [Paragraph(f"**{builds_heading(backends)}{comparison.title(rows)}.**" + (
        f" **{test_device_flag(rows)}**" if test_device_flag(rows) else "") + (
        f" **With {len(deliberate)} deliberate difference{'s' if len(deliberate) > 1 else ''} between the sides "
        "(per-backend overrides, listed under the table).**" if deliberate else "") + (
        f" **Set for a side: {'; '.join(variables)}; variables that can change the program or what is measured "
        "(see the warnings).**" if variables else "")), contrast_table(rows, backends), *extra]
    if deliberate:
        blocks.append(Bullets(deliberate, name="deliberate", title="Deliberate differences (per-backend overrides): "
                              "each side ran these recipe keys as listed, on purpose"))
    if chart is not None:
        blocks.append(Image(chart, "bar chart of throughput per backend"))
    if len(backends) > 1:
        blocks.append(Paragraph(f"Contrast = ({backends[0]} − {backends[1]}) / {backends[1]} on samples per second "
                                "(ips, global, measured window only): +x% means "
                                f"{backends[0]} is faster, −x% that {backends[1]} is (swapping the order changes the "
                                "figure, not the finding). Memory, per rank, the same measure on both sides: peak "
                                "allocated / reserved by the CUDA allocator on a GPU; on a CPU the training memory, each "
                                "process's peak resident set since its model was built minus its resident set right "
                                "after the build (framework start-up, libraries and weights excluded), with both beside "
                                "it. Each framework's own figure is in the settings (mem_source) and the CSV (extra_own_*)."
                                + (" A command xfw attached to has no after-build figure (its probe starts after the "
                                   "script built its model): its memory is the process's whole peak resident set on a "
                                   "CPU, the allocator's peaks on a GPU." if _any_attached(rows) else ""),
                                muted=True))
    starts = starting_points(rows)
    if starts:
        blocks.append(Paragraph(" ".join(starts), muted=True))
    if any(side.ips_spread is not None for row in rows for side in row.sides.values()):
        blocks.append(Paragraph("With repeats, ips is the median and spread = (max − min) / median; a contrast no "
                                "larger than either side's spread is marked (noise).", muted=True))
    fails = failures(rows)
    if fails:
        blocks += [Heading("Failed runs", 3), Bullets(fails, name="failed")]
    skipped = inapplicable(rows)
    if skipped:
        blocks += [Heading("Not applicable here (not failures)", 3), Bullets(skipped, name="not_applicable")]
    warnings = [f"⚠ {w}" for w in warnings] + [f"⚠ {row_name(row)}: {w}" for row in rows for w in row.warnings] \
        + [f"⚠ {w}" for w in short_windows(rows)]
    if warnings:
        blocks += [Heading("Warnings", 3), Bullets(warnings, name="warnings")]
    settings = settings_blocks(rows, backends)
    if settings:
        blocks += [Heading("Settings as applied", 3), *settings]
    differences = comparison.blocks(rows, backends)
    if differences:
        blocks += [Heading("Each side's mechanisms and their sources", 3), *differences]
    provenance = provenance_table(rows, backends)
    if provenance.cells:
        blocks += [Heading("Provenance", 3), provenance]
    return Page(title=title, blocks=blocks)


def deliberate_lines(rows: list[ComparisonRow]) -> list[str]:
    """Every row's deliberate differences (per-backend overrides), named by row when there are several."""
    return [f"{row_name(row)}: {line}" if len(rows) > 1 else line for row in rows for line in row.deliberate]


def numeric_records(rows: list[ComparisonRow], backends: list[str]) -> list[dict]:
    """One flat dict per row with raw numbers (bytes, samples/s): for CSV and pandas."""
    out = []
    for row in rows:
        rec = {"recipe": row.recipe, "model": row.model, "stage": row.stage, "variant": variant_label(row.variant),
               "comparison": comparison.kind_of(row),
               "contrast": row.contrast, "within_noise": row.within_noise, "params_match": row.params_match,
               **({"deliberate_differences": "; ".join(row.deliberate)} if row.deliberate else {})}
        for name in backends:
            s = row.sides[name]
            rec.update({
                f"{name}_status": s.status, f"{name}_reason": s.reason, f"{name}_ips": s.ips,
                f"{name}_ips_spread": s.ips_spread, f"{name}_tokens_per_s": s.tokens_per_s,
                f"{name}_step_time_median_s": s.step_time_median_s,
                f"{name}_step_time_p10_s": s.step_time_p10_s, f"{name}_step_time_p90_s": s.step_time_p90_s,
                f"{name}_window_time_s": s.window_time_s, f"{name}_num_measured_steps": s.num_measured_steps,
                f"{name}_memory_bytes": s.memory_bytes, f"{name}_memory_source": s.memory_source,
                f"{name}_memory_measure": measure_name(s.memory_source) if s.memory_source else None,
                f"{name}_rss_peak_bytes": s.rss_peak_bytes, f"{name}_rss_after_build_bytes": s.rss_after_build_bytes,
                # Each framework's own figure: an extra, its source beside it, never the compared measure.
                f"{name}_extra_own_mem_peak_bytes": s.mem_alloc_peak_bytes,
                f"{name}_extra_own_mem_reserved_bytes": s.mem_reserved_peak_bytes,
                f"{name}_extra_own_mem_source": s.mem_source,
                f"{name}_mfu": s.mfu, f"{name}_mfu_peak": s.mfu_peak, f"{name}_flops_per_sample": s.flops_per_sample,
                f"{name}_num_params_total": s.applied.get("num_params_total"),
                f"{name}_num_params_trainable": s.applied.get("num_params_trainable"),
                f"{name}_compute_dtype": s.applied.get("compute_dtype"), f"{name}_num_repeats": s.num_repeats,
                f"{name}_framework_version": ((s.env or {}).get("backend") or {}).get("framework_version"),
                f"{name}_build": fmt_build(((s.env or {}).get("backend") or {}).get("build")),
                **{f"{name}_{k}": s.data.get(k) for k in ("padding_fraction", "seq_len_mean", "seq_len_max",
                                                        "batch_digest")},
                f"{name}_measured_by": PARSED_NOTE if is_parsed(s) else "xfw",
                f"{name}_script_ips": s.script_ips,
                # Every setting of the report's settings table, as shown.
                **{f"{name}_setting_{key}": values.get(name) for key, values in row.settings.items()},
            })
        out.append(rec)
    return out
