"""The explain report: two sides' ``explain.json`` (``xfw.contract.explain``) aligned by canonical
module name and by category, against each side's measured step time::

    page = explain_page(rows, ["paddle", "torch"], out_dir)   # tables + explain.png (the waterfall)

Per row of the comparison:

* what the rows rest on: each side's runs (one per ``--repeat``, all combined) and hooked steps;
* what each explain process ran with (interpreter, the backend's variables, threads, knobs, data),
  held against the measured run's: an explanation of another program says so first
  (``xfw.report.explain_trust``);
* a table by module (``xfw.report.explain_rows``): each side's forward / backward self time, their difference
  and its band; a row whose difference is inside its own noise (the two sides' bands overlap) or below the floor
  (1% of the step) is marked so and not ranked; a row one side does not have is listed, with why, and not
  compared; shares of the rows' gap only when the rows' sum agrees with the measured gap (else the page says
  why the explanation is unreliable here); the page shows the largest rows, the CSV every row;
* a table by category (the framework profiler's operator or kernel time), with the operators behind each;
* a waterfall from the second side's measured step to the first's through the ranked rows;
* per side the coverage and the profiler's cost: the profiled and hooked steps against the measured
  step, each with its spread (a cost is named only when it is above the noise).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from xfw.contract.explain import CATEGORIES, read_explain
from xfw.report.compare import ComparisonRow, row_name
from xfw.report.explain_rows import (FLOOR, NOT_MODULES, ROOT, TOP_LEVEL, Aligned, _key, aligned,  # noqa: F401
                                     combine_runs, coverage, folds, module_rows, quartiles, rests_on, runs_of,
                                     spread, total)
from xfw.report.explain_trust import (SIZE_TOLERANCE, Verdict, _cost, _diagnosis, _measured_noise,  # noqa: F401
                                      _ms, program_check, side_lines, verdict)
from xfw.report.table import Bullets, Heading, Image, Page, Paragraph, Table

SHOWN = 12
"""Module rows shown before the rest is folded into one (the CSV holds every row)."""
WATERFALL_PARTS = 8


def _fb(row: dict | None) -> str:
    if row is None:
        return "–"
    text = f"{row['fwd_med_s'] * 1e3:.2f} / {row['bwd_med_s'] * 1e3:.2f}"
    return text + (f" (recompute {row['recompute_s'] * 1e3:.2f})" if row.get("recompute_s") else "")


def _shown_ms(row: dict | None) -> float:
    """A row's fwd + bwd as its cell shows them (ms, each part rounded as printed); a dash counts 0."""
    return 0.0 if row is None else round(row["fwd_med_s"] * 1e3, 2) + round(row["bwd_med_s"] * 1e3, 2)


def _diff_cell(ra: dict | None, rb: dict | None) -> str:
    """The difference column: the first side's shown fwd + bwd minus the second's, from the printed figures
    themselves, so a reader adding the cells gets the same number."""
    return f"{_shown_ms(ra) - _shown_ms(rb):+.2f}"


def _diff_ms(va: float, vb: float) -> str:
    """``va − vb`` of two figures as :func:`_ms` prints them (seconds in, ms out)."""
    return f"{round(va * 1e3, 2) - round(vb * 1e3, 2):+.2f}"


def _iqr(row: dict | None) -> str:
    """A row's noise band (:func:`spread`): p25–p75 of its steps, or min–max of its per-run medians."""
    if row is None:
        return "–"
    low, high = spread(row)
    return f"{low * 1e3:.2f}–{high * 1e3:.2f}"


def _share(diff: float, v: Verdict) -> str:
    return f"{diff / v.rows_gap_s:.0%}" if v.reliable and v.rows_gap_s else "–"


def _spread_header(rows: list[Aligned], a: str, b: str) -> str:
    runs = max([(r.a or r.b or {}).get("runs", 1) for r in rows] or [1])
    return f"p25–p75 (ms) {a}; {b}" if runs == 1 else f"min–max of the {runs} runs' medians (ms) {a}; {b}"


@dataclass
class FoldedTable(Table):
    """A table whose markdown and HTML fold the smaller rows into one; ``full`` (every row) is the CSV's."""

    full: Table | None = None


@dataclass
class ExplainPage(Page):
    """The explain page: its CSV holds every module row (:class:`FoldedTable`), the page shows the largest."""

    def tables(self) -> list[Table]:
        return [t.full if isinstance(t, FoldedTable) and t.full is not None else t for t in super().tables()]


UNRANKED = "beyond its noise, not ranked (unreliable)"
"""A finding's rank cell when the explanation is unreliable: listed by size, never numbered as a finding."""


def module_table(names: tuple[str, str], rows: list[Aligned], v: Verdict, recipe: str = "") -> Table:
    """The rows, largest finding first; the page shows :data:`SHOWN` and folds the rest into one, the CSV
    (``.full``) has every row with its raw numbers, how many runs and hooked steps each rests on, and the
    comparison row (``recipe``) it belongs to. Each side's cell is its row's median step, fwd / bwd, and the
    difference column is the first side's fwd + bwd minus the second's, as shown (:func:`_diff_cell`); rows are
    ranked only when the verdict is reliable (else :data:`UNRANKED`)."""
    a, b = names
    cells, records = [], []
    rank = 0

    def note(r: Aligned) -> str:
        nonlocal rank
        if r.only:
            return f"{r.only} only"
        if r.noise:
            return "within noise"
        if r.small:
            return f"below the floor (<{FLOOR:.0%} of the step)"
        if not v.reliable:
            return UNRANKED
        rank += 1
        return str(rank)

    for r in rows:
        cells.append([r.name, _fb(r.a), _fb(r.b), _diff_cell(r.a, r.b), f"{_iqr(r.a)}; {_iqr(r.b)}", note(r),
                      _share(r.diff, v)])
        side = lambda row, k: row and row[k]  # noqa: E731
        records.append({**({"recipe": recipe} if recipe else {}), "module": r.name,
                        f"{a}_fwd_s": side(r.a, "fwd_med_s"), f"{a}_bwd_s": side(r.a, "bwd_med_s"),
                        f"{b}_fwd_s": side(r.b, "fwd_med_s"), f"{b}_bwd_s": side(r.b, "bwd_med_s"),
                        "diff_s": r.diff, "rank": cells[-1][5], f"{a}_runs": side(r.a, "runs"),
                        f"{a}_steps": side(r.a, "run_steps"), f"{b}_runs": side(r.b, "runs"),
                        f"{b}_steps": side(r.b, "run_steps"), "folded_in": ", ".join(r.folded)})
    header = ["Module (canonical name)", f"{a} fwd / bwd (ms, median)", f"{b} fwd / bwd (ms, median)",
              f"{a} − {b} (ms, fwd + bwd)", _spread_header(rows, a, b), "rank", "share of the rows' gap"]
    full = Table(header=header, cells=cells, records=records, numeric=(1, 2, 3, 6), name="explain-modules")
    shown_cells, shown_records = cells[:SHOWN], records[:SHOWN]
    rest = rows[SHOWN:]
    if rest:
        diff = sum(r.diff for r in rest)
        fold = lambda side: {"fwd_med_s": sum((getattr(r, side) or {}).get("fwd_med_s", 0.0) for r in rest),  # noqa: E731
                             "bwd_med_s": sum((getattr(r, side) or {}).get("bwd_med_s", 0.0) for r in rest)}
        ranked = sum(1 for r in rest if r.finding)
        found = (f"{ranked} ranked" if v.reliable else f"{ranked} beyond noise, not ranked") if ranked else ""
        shown_cells.append([f"({len(rest)} more rows: explain.csv has them)", _fb(fold("a")), _fb(fold("b")),
                            _diff_cell(fold("a"), fold("b")), "", found, _share(diff, v)])
        shown_records.append({"module": f"({len(rest)} more rows)", "diff_s": diff, "rank": ""})
    return FoldedTable(header=header, cells=shown_cells, records=shown_records, numeric=(1, 2, 3, 6),
                       name="explain-modules", full=full)


def _ops(explain: dict, category: str, top: int = 3) -> str:
    ops = (explain.get("category_ops") or {}).get(category) or {}
    return ", ".join(list(ops)[:top])


def category_table(names: tuple[str, str], ea: dict, eb: dict) -> Table:
    a, b = names
    cells = []
    for cat in CATEGORIES:
        va, vb = ea["categories"].get(cat, 0.0), eb["categories"].get(cat, 0.0)
        ops = "; ".join(x for x in (_ops(ea, cat), _ops(eb, cat)) if x)
        cells.append([cat, _ms(va), _ms(vb), _diff_ms(va, vb), ops])
    ta, tb = sum(ea["categories"].values()), sum(eb["categories"].values())
    cells.append(["total (profiled operators)", _ms(ta), _ms(tb), _diff_ms(ta, tb), ""])
    cells.append(["the profiled step", _ms(ea["profiler_step_s"]), _ms(eb["profiler_step_s"]),
                  _diff_ms(ea["profiler_step_s"], eb["profiler_step_s"]), ""])
    return Table(header=["Category", f"{a} (ms per step)", f"{b} (ms per step)", f"{a} − {b} (ms)",
                         "main operators (trace.json's xfwCategories has all)"], cells=cells,
                 numeric=(1, 2, 3), name="explain-categories", csv=False)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:80] or "row"


def chart_name(title: str, index: int) -> str:
    """``explain.png`` for the first row of a page, ``explain-<row>.png`` for the others (never one file for two)."""
    return "explain.png" if index == 0 else f"explain-{_slug(title)}.png"


def load_side(run_dirs: list[str]) -> dict | None:
    """One side's explain.jsons, one per run of it (``--repeat``), combined (:func:`combine_runs`); the runs
    without a readable one are counted in ``unexplained_runs``. None when no run has one."""
    found = []
    for run_dir in run_dirs:
        path = Path(run_dir) / "explain.json"
        try:
            found.append(read_explain(str(path)) | {"path": str(path)})
        except (OSError, ValueError):
            continue
    if not found:
        return None
    return combine_runs(found) | {"unexplained_runs": len(run_dirs) - len(found)}


def one_sided_reasons(rows: list[Aligned], names: tuple[str, str], a: dict | None = None,
                      b: dict | None = None) -> list[str]:
    """Why each row is on one side only, or was folded into its enclosing row (``a``, ``b``: the explain.jsons)."""
    out = []
    if a is not None and b is not None:
        sides = {n: (names[0] if n in set(map(_key, a["modules"])) else names[1]) for n in folds(a, b)}
        for name, target in folds(a, b).items():
            other = names[1] if sides[name] == names[0] else names[0]
            out.append(f"{name} ({sides[name]} only): counted in {target}, whose own code does this work on {other} "
                       "(no module of that name there)")
    for r in rows:
        if r.only:
            other = names[1] if r.only == names[0] else names[0]
            out.append(f"{r.name} ({r.only} only, {_ms(total(r.a or r.b))} ms): {other} has no module under this "
                       f"canonical name (its framework does this work inside another row, or not at all); not compared")
    return out


def basis(names: tuple[str, ...], explains: tuple[dict, ...]) -> str:
    """What each side's rows rest on (runs, hooked steps) and how a row's figure and its band are taken."""
    sides = "; ".join(f"{n} {rests_on(e)}" + (f" ({e['unexplained_runs']} more run(s) without an explain.json)"
                                                if e.get("unexplained_runs") else "") for n, e in zip(names, explains))
    if max(len(runs_of(e)) for e in explains) == 1:
        how = ("each row is its median hooked step (fwd / bwd are that step's, so they add up to the figure the "
               "difference is taken of), its band the steps' p25–p75; a row is within noise when the "
               "two sides' bands overlap (`--repeat 3` profiles every run and takes each row across them)")
    else:
        how = ("each row is the median of its per-run medians (fwd / bwd are that run's median step's), its band the "
               "min–max of those medians (a host stall "
               "in one run moves that run's median only); a row is within noise when the two sides' bands overlap; "
               "categories and the steps below are medians over the runs")
    return f"Rows rest on: {sides}; {how}."


def row_blocks(row: ComparisonRow, names: tuple[str, str], out_dir: Path | None, index: int = 0) -> list:
    a, b = names
    title = row_name(row)
    ea, eb = (load_side(row.sides[n].run_dirs) if n in row.sides else None for n in names)
    if ea is None or eb is None:
        missing = [n for n, e in zip(names, (ea, eb)) if e is None]
        return [Heading(f"Explain: {title}", 3), Paragraph(f"no explain.json for {', '.join(missing)}")]
    side_a, side_b = row.sides[a], row.sides[b]
    sa, sb = side_a.step_time_median_s, side_b.step_time_median_s
    gap = sa - sb if sa is not None and sb is not None else None
    gap_noise = _measured_noise(side_a) + _measured_noise(side_b)
    programs = {n: program_check(e) for n, e in zip(names, (ea, eb))}
    rows = aligned(ea, eb, names)
    diagnosis = [f"{n}'s explain process did not run the measured program: {', '.join(d)}"
                 for n, (_, d) in programs.items() if d] + _diagnosis(names, (side_a, side_b), (ea, eb))
    v = verdict(rows, ea, eb, gap, gap_noise, names, diagnosis)
    if any(d for _, d in programs.values()):
        v = Verdict(False, v.rows_gap_s, v.why or "; ".join(diagnosis),
                    v.short or "an explain process did not run the measured program")
    blocks: list = [Heading(f"Explain: {title}", 3),
                    Paragraph(f"Measured step: {a} {_ms(sa)} ms, {b} {_ms(sb)} ms, gap {a} − {b} "
                              f"{'–' if gap is None else _diff_ms(sa, sb)} ms (±{gap_noise * 1e3:.2f}: half "
                              "the p10–p90 ranges)."),
                    Paragraph(basis((a, b), (ea, eb)))]
    blocks.append(Paragraph(f"**The explanation is unreliable here**, because {v.why}. The rows are listed by the "
                            "size of their difference; none is ranked as a finding, and there are no shares."
                            if not v.reliable else
                            f"The rows' sum ({v.rows_gap_s * 1e3:+.2f} ms) agrees with the measured gap within the "
                            "noise: shares are of the rows' gap and add up to 100%."))
    blocks += [module_table(names, rows, v, recipe=title), category_table(names, ea, eb)]
    one_sided = one_sided_reasons(rows, names, ea, eb)
    if one_sided:
        blocks.append(Bullets(one_sided, title="Rows on one side only (counted in their enclosing row, or not compared)"))
    blocks.append(Bullets([f"{n}: {line}" for n, (line, _) in programs.items()],
                          title="What each explain process ran (the measured run's program)"))
    blocks.append(Bullets([side_lines(a, ea, side_a), side_lines(b, eb, side_b)],
                          title="Coverage and the profiler's cost"))
    if out_dir is not None and gap is not None:
        from xfw.report.plot import plot_waterfall

        # the table's own figures (its difference column, :func:`_diff_cell`), so each bar reads as its row
        shown = lambda r: (_shown_ms(r.a) - _shown_ms(r.b)) / 1e3  # noqa: E731
        ranked = [r for r in rows if r.finding][:WATERFALL_PARTS]
        drawn = {id(r) for r in ranked}
        parts = [(r.name, shown(r)) for r in ranked]
        parts.append(("rows within noise, below the floor or one-sided",
                      sum(shown(r) for r in rows if id(r) not in drawn)))
        parts.append(("not covered", gap - sum(d for _, d in parts)))
        try:
            chart = plot_waterfall((f"{b} step", sb), [(_short(n), d) for n, d in parts], (f"{a} step", sa),
                                   out_dir / chart_name(title, index),
                                   title=f"{title}: from {b}'s step to {a}'s (ms)",
                                   unreliable="" if v.reliable else v.short or v.why)
            blocks.append(Image(chart, f"waterfall from {b}'s step time to {a}'s"))
        except OSError:
            pass
    return blocks


def single_blocks(row: ComparisonRow, name: str) -> list:
    """One backend: its own rows and categories; nothing to compare it with."""
    title = row_name(row)
    e = load_side(row.sides[name].run_dirs) if name in row.sides else None
    if e is None:
        return [Heading(f"Explain: {title}", 3), Paragraph(f"no explain.json for {name}")]
    rows = sorted(module_rows(e).items(), key=lambda kv: -total(kv[1]))
    cells = [[n, _fb(r), _ms(total(r)), _iqr(r)] for n, r in rows]
    header = ["Module (canonical name)", f"{name} fwd / bwd (ms, median)", "total (ms)",
              "p25–p75 (ms)" if len(runs_of(e)) == 1 else "min–max of the runs' medians (ms)"]
    full = Table(header=header, cells=cells, numeric=(1, 2), name="explain-modules")
    shown = cells[:SHOWN] + ([[f"({len(rows) - SHOWN} more rows: explain.csv has them)", "", "", ""]]
                             if len(rows) > SHOWN else [])
    cats = [[c, _ms(e["categories"].get(c, 0.0)), _ops(e, c)] for c in CATEGORIES]
    line, differs = program_check(e)
    return [Heading(f"Explain: {title} ({name} alone)", 3),
            Paragraph(f"One backend ({name}): its own rows, largest first; there is no other side to compare with "
                      "(`--backends A,B` for a comparison)."),
            Paragraph(basis((name,), (e,))),
            FoldedTable(header=header, cells=shown, numeric=(1, 2), name="explain-modules", full=full),
            Table(header=["Category", f"{name} (ms per step)", "main operators"], cells=cats, numeric=(1,),
                  name="explain-categories", csv=False),
            Bullets([f"{name}: {line}" + (f" — differs: {', '.join(differs)}" if differs else ""),
                     side_lines(name, e, row.sides[name])], title="What it ran, coverage and the profiler's cost")]


def _short(name: str) -> str:
    return name if len(name) <= 40 else "…" + name[-39:]


def explain_page(rows: list[ComparisonRow], backends: list[str], out_dir: Path | None,
                 notes: list[str] = ()) -> Page:
    blocks: list = []
    for index, row in enumerate(rows):
        if len(backends) > 1:
            blocks += row_blocks(row, (backends[0], backends[1]), out_dir, index)
        else:
            blocks += single_blocks(row, backends[0])
    if notes:
        blocks += [Heading("Not explained", 3), Bullets(list(notes))]
    blocks.append(Paragraph(
        "Module rows are self times under the canonical module names (a container's row is its own code: "
        "an attention block's row holds the attention itself); `loss` is the loss wrapper's own code and backward "
        "until the model's first module gradient, `(autograd, outside modules)` the rest of backward outside "
        "every module, `optimizer` the optimizer step (the loss is its own row on both sides: transformers' "
        "in-forward loss call is timed as `loss`). `(model, its own code)` is the top level's own code, whichever "
        "class holds it. Recompute is the forward run again inside backward. Each "
        "side's fwd / bwd are the row's median hooked step (the step whose fwd + bwd is the median; over several "
        "runs, the median run's), so they add up to the row's figure, and the difference column is the first side's "
        "fwd + bwd minus the second's, as printed; the band is the steps' interquartile range (over several runs: "
        "the min–max of the runs' medians); a row is ranked only when the explanation is reliable, the "
        f"two sides' ranges do not overlap and its difference is at least {FLOOR:.0%} of the slower side's hooked "
        "step (the floor). The steps are taken after the measured window in a process of its own "
        "that runs the measured run's program (docs/explain.md).", muted=True))
    return ExplainPage(title="Where the step goes", blocks=blocks)
