"""Renderers: comparison rows to the seed-003 table (markdown), a numeric table (CSV/pandas),
and the settings section. Pure functions over :mod:`xfw.report.compare` rows::

    | Model      | Stage | paddle ips | Contrast | torch ips | paddle memory (alloc/reserved) | ...
    |------------|-------|-----------:|---------:|----------:|--------------------------------| ...
    | Tiny LLaVA | SFT   |      412.3 |    +6.1% |     388.6 | 0.05/0.06 GiB (host allocator) | ...

Memory cells carry their unit and source: a CPU peak RSS is never presented as if it were an
allocator's peak.
"""

from __future__ import annotations

from xfw.report.compare import ComparisonRow, Side, strip_common, variant_label

_SOURCE_LABELS = {"cuda_allocator": "GPU allocator", "host_allocator": "host allocator", "peak_rss": "peak RSS"}
GIB, MIB = 1024**3, 1024**2


def fmt_rate(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}" if value < 10 else f"{value:.1f}"


def fmt_contrast(row: ComparisonRow) -> str:
    if row.contrast is None:
        return "n/a"
    text = f"{row.contrast:+.0%}" if abs(row.contrast) >= 0.1 else f"{row.contrast:+.1%}"
    return text + (" (noise)" if row.within_noise else "")


def fmt_memory(side: Side) -> str:
    alloc, reserved = side.mem_alloc_peak_bytes, side.mem_reserved_peak_bytes
    if not side.ok or alloc is None:
        return "–"
    unit, scale = ("GiB", GIB) if max(alloc, reserved or 0) >= GIB else ("MiB", MIB)
    res = f"{reserved / scale:.2f}" if reserved is not None else "–"
    source = _SOURCE_LABELS.get(side.mem_source or "", side.mem_source or "?")
    return f"{alloc / scale:.2f}/{res} {unit} ({source})"


def fmt_side_rate(side: Side) -> str:
    if side.ok:
        spread = f" (spread {side.ips_spread:.1%})" if side.ips_spread is not None else ""
        return fmt_rate(side.ips) + spread
    return f"**{side.status}**"


def fmt_params(row: ComparisonRow, backends: list[str]) -> str:
    counts = [row.sides[b].applied.get("num_params_total") for b in backends]
    text = " / ".join(f"{c:,}" if c is not None else "–" for c in counts)
    if row.params_match is True:
        text += " ✓"
    elif row.params_match is False:
        text += " ✗ differ"
    return text


def contrast_table(rows: list[ComparisonRow], backends: list[str]) -> tuple[list[str], list[list[str]]]:
    """Seed 003's table: header and cells, one row per recipe."""
    a, b = backends[0], backends[1] if len(backends) > 1 else None
    shown = strip_common([row.variant for row in rows])  # keys every row shares say nothing
    with_variant = any(shown)
    header = ["Model", "Stage"] + (["Variant"] if with_variant else []) + [f"{a} ips"]
    if b:
        header += ["Contrast", f"{b} ips"]
    header += [f"{name} memory (alloc/reserved)" for name in backends]
    with_mfu = any(side.mfu is not None for row in rows for side in row.sides.values())
    if with_mfu:
        header += [f"{name} MFU" for name in backends]
    header += [f"Params ({' / '.join(backends)})"]
    cells = []
    previous_model = None
    for row, variant in zip(rows, shown):
        line = [row.model if row.model != previous_model else "", row.stage]
        line += [variant_label(variant)] if with_variant else []
        line += [fmt_side_rate(row.sides[a])]
        previous_model = row.model
        if b:
            line += [fmt_contrast(row), fmt_side_rate(row.sides[b])]
        line += [fmt_memory(row.sides[name]) for name in backends]
        if with_mfu:
            line += [f"{row.sides[name].mfu:.1%}" if row.sides[name].mfu is not None else "–" for name in backends]
        line += [fmt_params(row, backends)]
        cells.append(line)
    return header, cells


def markdown_table(header: list[str], cells: list[list[str]]) -> str:
    numeric = {i for i, h in enumerate(header) if h.endswith("ips") or h == "Contrast"}
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if i in numeric else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    return "\n".join(lines)


def _row_name(row: ComparisonRow) -> str:
    return f"{row.recipe} [{variant_label(row.variant)}]" if row.variant else row.recipe


def failures(rows: list[ComparisonRow]) -> list[str]:
    return [f"{_row_name(row)} / {side.backend}: {side.status} — {side.reason}"
            for row in rows for side in row.sides.values() if not side.ok]


def parity_line(status: dict) -> str:
    """One line on a recipe's parity run: passed/failed, steps, worst relative differences, where."""
    if status["status"] == "none":
        return "Parity: no parity run" + (f" ({status['note']})" if status.get("note") else "") + "."
    worst = status.get("worst") or {}
    text = f"Parity: {'passed' if status['status'] == 'passed' else '**failed**'}, {status['num_steps']} steps"
    if status["status"] == "failed" and status.get("first_failing_step") is not None:
        text += f", first step outside tolerance {status['first_failing_step']}"
    if worst.get("loss_rel_diff") is not None:
        text += f"; worst relative loss difference {worst['loss_rel_diff']:.1e} (step {worst['loss_step']})"
    if worst.get("grad_norm_rel_diff") is not None:
        text += f", gradient norm {worst['grad_norm_rel_diff']:.1e} (step {worst['grad_norm_step']})"
    return f"{text} — `{status['path']}`."


def settings_markdown(rows: list[ComparisonRow], backends: list[str]) -> str:
    parts = []
    for row in rows:
        if not row.settings and row.parity is None:
            continue
        parts.append(f"#### {_row_name(row)}")
        if row.parity is not None:
            parts.append(parity_line(row.parity))
        if not row.settings:
            continue
        lines = ["| Setting | " + " | ".join(backends) + " | |", "|---|" + "---|" * len(backends) + "---|"]
        for key, values in row.settings.items():
            differs = key in row.differing
            lines.append(f"| {key} | " + " | ".join(str(values.get(b, "–")) for b in backends)
                         + f" | {'⚠ differs' if differs else ''} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def report_markdown(rows: list[ComparisonRow], backends: list[str], *, title: str = "Training benchmark") -> str:
    header, cells = contrast_table(rows, backends)
    out = [f"## {title}", "", markdown_table(header, cells), ""]
    if len(backends) > 1:
        out += [f"Contrast = ({backends[0]} − {backends[1]}) / {backends[1]} on samples per second "
                "(ips, global, measured window only). Memory: peak allocated / peak reserved per rank.", ""]
    if any(side.ips_spread is not None for row in rows for side in row.sides.values()):
        out += ["With repeats, ips is the median and spread = (max − min) / median; a contrast no larger "
                "than either side's spread is marked (noise).", ""]
    fails = failures(rows)
    if fails:
        out += ["### Failed runs", ""] + [f"- {f}" for f in fails] + [""]
    warnings = [f"{_row_name(row)}: {w}" for row in rows for w in row.warnings]
    if warnings:
        out += ["### Warnings", ""] + [f"- ⚠ {w}" for w in warnings] + [""]
    settings = settings_markdown(rows, backends)
    if settings:
        out += ["### Settings as applied", "", settings, ""]
    return "\n".join(out)


def numeric_records(rows: list[ComparisonRow], backends: list[str]) -> list[dict]:
    """One flat dict per recipe with raw numbers (bytes, samples/s): for CSV and pandas."""
    out = []
    for row in rows:
        rec = {"recipe": row.recipe, "model": row.model, "stage": row.stage, "variant": variant_label(row.variant),
               "contrast": row.contrast,
               "within_noise": row.within_noise, "params_match": row.params_match}
        for name in backends:
            s = row.sides[name]
            rec.update({
                f"{name}_status": s.status, f"{name}_reason": s.reason, f"{name}_ips": s.ips,
                f"{name}_ips_spread": s.ips_spread, f"{name}_tokens_per_s": s.tokens_per_s,
                f"{name}_step_time_median_s": s.step_time_median_s,
                f"{name}_mem_alloc_peak_bytes": s.mem_alloc_peak_bytes,
                f"{name}_mem_reserved_peak_bytes": s.mem_reserved_peak_bytes, f"{name}_mem_source": s.mem_source,
                f"{name}_mfu": s.mfu,
                f"{name}_num_params_total": s.applied.get("num_params_total"),
                f"{name}_num_params_trainable": s.applied.get("num_params_trainable"),
                f"{name}_compute_dtype": s.applied.get("compute_dtype"), f"{name}_num_repeats": s.num_repeats,
            })
        out.append(rec)
    return out


def to_frame(rows: list[ComparisonRow], backends: list[str]):
    import pandas as pd  # reporting dependency: only where the CLI runs

    return pd.DataFrame(numeric_records(rows, backends))
