"""The explain report: two sides' ``explain.json`` (``xfw.contract.explain``) aligned by canonical
module name and by category, against each side's measured step time::

    page = explain_page(rows, ["paddle", "torch"], out_dir)   # tables + explain.png (the waterfall)

Per row of the comparison: a table by module (each side's forward / backward self time, their
difference, its share of the measured step-time gap; largest first, the rest folded), a table by
category (the framework profiler's operator or kernel time), a waterfall from the second side's
measured step to the first's through the largest differences, and per side the coverage (the
module rows' sum against the measured step time) and the overheads (the step under the module hooks,
and under the profiler, against the measured step).
"""

from __future__ import annotations

from pathlib import Path

from xfw.contract.explain import CATEGORIES, read_explain
from xfw.report.compare import ComparisonRow
from xfw.report.table import Bullets, Heading, Image, Page, Paragraph, Table

SHOWN = 12
"""Module rows shown before the rest is folded into one."""
WATERFALL_PARTS = 8
_PEFT_PARTS = (".base_layer", ".lora_A", ".lora_B", ".lora_dropout")
ROOT = "(model, its own code)"


def _key(name: str) -> str:
    """One row per canonical module: peft's sub-layers folded into the layer they adapt (Paddle's LoRA
    layer is one layer), the root under a readable name."""
    for part in _PEFT_PARTS:
        if part in name:
            name = name[:name.index(part)]
    return name or ROOT


def module_rows(explain: dict) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    for name, row in explain["modules"].items():
        mine = rows.setdefault(_key(name), {"fwd_s": 0.0, "bwd_s": 0.0, "recompute_s": 0.0})
        for k in mine:
            mine[k] += row.get(k, 0.0)
    return rows


def load_side(run_dirs: list[str]) -> dict | None:
    for run_dir in run_dirs[:1]:
        path = Path(run_dir) / "explain.json"
        if path.exists():
            try:
                return read_explain(str(path)) | {"path": str(path)}
            except (OSError, ValueError):
                return None
    return None


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.2f}"


def _fb(row: dict | None) -> str:
    if row is None:
        return "–"
    text = f"{row['fwd_s'] * 1e3:.2f} / {row['bwd_s'] * 1e3:.2f}"
    return text + (f" (recompute {row['recompute_s'] * 1e3:.2f})" if row.get("recompute_s") else "")


def _total(row: dict | None) -> float:
    return 0.0 if row is None else row["fwd_s"] + row["bwd_s"]


def aligned(a: dict, b: dict) -> list[tuple[str, dict | None, dict | None, float]]:
    """(name, a's row, b's row, a − b seconds), largest absolute difference first."""
    ra, rb = module_rows(a), module_rows(b)
    out = [(n, ra.get(n), rb.get(n), _total(ra.get(n)) - _total(rb.get(n))) for n in set(ra) | set(rb)]
    return sorted(out, key=lambda r: (-abs(r[3]), r[0]))


def coverage(explain: dict, step_s: float | None) -> float | None:
    parts = sum(_total(r) for r in explain["modules"].values())
    return parts / step_s if step_s else None


def _share(diff: float, gap: float | None) -> str:
    return f"{diff / gap:.0%}" if gap else "–"


def module_table(names: tuple[str, str], rows: list, gap: float | None) -> Table:
    a, b = names
    cells, records = [], []
    for name, ra, rb, diff in rows[:SHOWN]:
        cells.append([name, _fb(ra), _fb(rb), f"{diff * 1e3:+.2f}", _share(diff, gap)])
        records.append({"module": name, f"{a}_fwd_s": ra and ra["fwd_s"], f"{a}_bwd_s": ra and ra["bwd_s"],
                        f"{b}_fwd_s": rb and rb["fwd_s"], f"{b}_bwd_s": rb and rb["bwd_s"], "diff_s": diff})
    rest = rows[SHOWN:]
    if rest:
        diff = sum(r[3] for r in rest)
        fold = lambda side: {"fwd_s": sum((r[side] or {}).get("fwd_s", 0.0) for r in rest),  # noqa: E731
                             "bwd_s": sum((r[side] or {}).get("bwd_s", 0.0) for r in rest)}
        cells.append([f"({len(rest)} more rows)", _fb(fold(1)), _fb(fold(2)), f"{diff * 1e3:+.2f}", _share(diff, gap)])
        records.append({"module": f"({len(rest)} more rows)", "diff_s": diff})
    return Table(header=["Module (canonical name)", f"{a} fwd / bwd (ms)", f"{b} fwd / bwd (ms)",
                         f"{a} − {b} (ms)", "share of the gap"],
                 cells=cells, records=records, numeric=(1, 2, 3, 4), name="explain-modules")


def category_table(names: tuple[str, str], ea: dict, eb: dict) -> Table:
    a, b = names
    cells = []
    for cat in CATEGORIES:
        va, vb = ea["categories"].get(cat, 0.0), eb["categories"].get(cat, 0.0)
        cells.append([cat, _ms(va), _ms(vb), f"{(va - vb) * 1e3:+.2f}"])
    ta, tb = sum(ea["categories"].values()), sum(eb["categories"].values())
    cells.append(["total (profiled operators)", _ms(ta), _ms(tb), f"{(ta - tb) * 1e3:+.2f}"])
    return Table(header=["Category", f"{a} (ms per step)", f"{b} (ms per step)", f"{a} − {b} (ms)"], cells=cells,
                 numeric=(1, 2, 3), name="explain-categories", csv=False)


def side_lines(name: str, explain: dict, step_s: float | None) -> str:
    cov = coverage(explain, step_s)
    hooks = explain["hooked_step_s"] / step_s if step_s else None
    prof = explain["profiler_step_s"] / step_s if step_s else None
    inner = coverage(explain, explain["hooked_step_s"])
    return (f"{name}: measured step {_ms(step_s)} ms; coverage {cov:.0%} (module rows' sum / measured step; "
            f"{inner:.0%} of the hooked step they were timed in); overhead: hooked step ×{hooks:.2f}, profiled "
            f"step ×{prof:.2f} the measured step; a plain step in the explain process "
            f"{_ms(explain['plain_step_s'])} ms; trace: {Path(explain['path']).with_name(explain['trace'])}"
            if step_s else f"{name}: no measured step time")


def row_blocks(row: ComparisonRow, names: tuple[str, str], out_dir: Path | None) -> list:
    from xfw.report.contrast import row_name

    a, b = names
    title = row_name(row)
    ea, eb = (load_side(row.sides[n].run_dirs) if n in row.sides else None for n in names)
    if ea is None or eb is None:
        missing = [n for n, e in zip(names, (ea, eb)) if e is None]
        return [Heading(f"Explain: {title}", 3), Paragraph(f"no explain.json for {', '.join(missing)}")]
    sa, sb = row.sides[a].step_time_median_s, row.sides[b].step_time_median_s
    gap = sa - sb if sa is not None and sb is not None else None
    rows = aligned(ea, eb)
    blocks: list = [Heading(f"Explain: {title}", 3),
                    Paragraph(f"Measured step: {a} {_ms(sa)} ms, {b} {_ms(sb)} ms, gap {a} − {b} "
                              f"{'–' if gap is None else f'{gap * 1e3:+.2f}'} ms."),
                    module_table(names, rows, gap), category_table(names, ea, eb),
                    Bullets([side_lines(a, ea, sa), side_lines(b, eb, sb)], title="Coverage and overhead")]
    if out_dir is not None and gap is not None:
        from xfw.report.plot import plot_waterfall

        top = rows[:WATERFALL_PARTS]
        parts = [(n, d) for n, _, _, d in top] + [("other rows", sum(r[3] for r in rows[WATERFALL_PARTS:]))]
        parts.append(("not covered", gap - sum(d for _, d in parts)))
        name = "explain.png" if not row.variant else f"explain-{len(list(out_dir.glob('explain*.png')))}.png"
        try:
            chart = plot_waterfall((f"{b} step", sb), [(_short(n), d) for n, d in parts], (f"{a} step", sa),
                                   out_dir / name, title=f"{title}: from {b}'s step to {a}'s (ms)")
            blocks.append(Image(chart, f"waterfall from {b}'s step time to {a}'s"))
        except OSError:
            pass
    return blocks


def _short(name: str) -> str:
    return name if len(name) <= 40 else "…" + name[-39:]


def explain_page(rows: list[ComparisonRow], backends: list[str], out_dir: Path | None,
                 notes: list[str] = ()) -> Page:
    names = (backends[0], backends[1]) if len(backends) > 1 else (backends[0], backends[0])
    blocks: list = []
    for row in rows:
        blocks += row_blocks(row, names, out_dir)
    if notes:
        blocks += [Heading("Not explained", 3), Bullets(list(notes))]
    blocks.append(Paragraph(
        "Module rows are self times under the canonical module names (a container's row is its own code: "
        "an attention block's row holds the attention itself); `loss` is the loss wrapper's own code and backward "
        "until the model's first module gradient, `(autograd, outside modules)` the rest of backward outside "
        "every module, `optimizer` the optimizer step. Recompute is the forward run again inside backward. The "
        "rows are the median one of 5 profiled steps, taken after the measured window in a process of its own "
        "(docs/explain.md).", muted=True))
    return Page(title="Where the step goes", blocks=blocks)
