"""The step breakdown in every compare report: where each side's measured step goes, from the parts
the harness records per step (``xfw.contract.harness.BREAKDOWN``: data wait, forward + backward,
optimizer step), as a small table and a stacked column per side (``breakdown.png``)::

    blocks = breakdown_blocks(rows, backends, out_dir)   # [Heading, Table, Image, Paragraph] or []

Each part is its mean over the measured steps of every rank (means add up: the parts' means sum to
the mean step time, which a median would not). Communication is not a part of its own: on several
processes the gradient reduction overlaps backward, and neither framework says how much of it is
left exposed without a profiler, so it is folded into forward + backward (``xfw explain`` shows the
communication kernels' time by category).
"""

from __future__ import annotations

from pathlib import Path

from xfw.contract import records as rec
from xfw.contract.harness import BREAKDOWN
from xfw.report.compare import ComparisonRow, Side
from xfw.report.table import Heading, Image, Paragraph, Table

PART_LABELS = {"data_wait_s": "data wait", "fwd_bwd_s": "forward + backward", "optimizer_s": "optimizer step"}
REST = "rest of step"
"""What the step time holds beyond the recorded parts (where a session offers no split, and in a command
xfw attached to, whose probe sees only where the optimizer step begins)."""


def side_breakdown(side: Side) -> dict[str, float] | None:
    """Mean seconds per part over the side's measured steps (every run, every rank), ``step_time_s``
    the mean step and ``rest of step`` what the parts leave; None when its records carry no parts."""
    steps = []
    for run_dir in side.run_dirs:
        steps += [r for r in rec.load_records(Path(run_dir) / "steps.jsonl")
                  if r.get("kind") == "step" and r.get("phase") == "measure"]
    steps = [r for r in steps if any(key in r for key in BREAKDOWN)]
    if not steps:
        return None
    mean = {key: sum(r.get(key, 0.0) for r in steps) / len(steps) for key in BREAKDOWN if any(key in r for r in steps)}
    step = sum(r["step_time_s"] for r in steps) / len(steps)
    return {**mean, REST: max(step - sum(mean.values()), 0.0), "step_time_s": step}


def breakdown_entries(rows: list[ComparisonRow], backends: list[str]) -> list[tuple[str, str, dict | None]]:
    """(row label, backend, breakdown or None) for every ok side."""
    from xfw.report.contrast import row_name

    out = []
    for row in rows:
        for name in backends:
            if name in row.sides and row.sides[name].ok:
                side = row.sides[name]
                parts = side_breakdown(side)
                if parts is not None and "command" in ((side.env or {}).get("backend") or {}):
                    parts["attached"] = True  # a command xfw attached to: its probe splits the step its own way
                out.append((row_name(row), name, parts))
    return out


def _cell(seconds: float | None, step: float) -> str:
    if seconds is None:
        return "–"
    return f"{seconds * 1e3:.2f} ms ({seconds / step:.0%})" if step > 0 else f"{seconds * 1e3:.2f} ms"


def _parts_shown(entries: list[tuple[str, str, dict | None]]) -> list[str]:
    """The recorded parts, and the rest only where some side's step is not fully split."""
    unsplit = any(parts is not None and "fwd_bwd_s" not in parts for _, _, parts in entries)
    return [*BREAKDOWN, REST] if unsplit else list(BREAKDOWN)


def breakdown_table(entries: list[tuple[str, str, dict | None]]) -> Table:
    parts = _parts_shown(entries)
    cells, records = [], []
    for label, backend, parts_s in entries:
        if parts_s is None:
            cells.append([label, backend, *(["–"] * len(parts)), "–", "not recorded (a run from before the breakdown, "
                                                                       "or a command whose steps xfw cannot split)"])
            records.append({"row": label, "backend": backend})
            continue
        step = parts_s["step_time_s"]
        note = ("" if "fwd_bwd_s" in parts_s else "an attached command: the probe sees where the optimizer step "
                "begins; the rest is data, forward and backward" if "optimizer_s" in parts_s and parts_s.get("attached")
                else "forward and backward not recorded (this run's records lack the part); the rest is what the "
                "recorded parts leave" if "optimizer_s" in parts_s
                else "forward, backward and optimizer not split")
        cells.append([label, backend, *(_cell(parts_s.get(p), step) if p in parts_s else "–" for p in parts),
                      f"{step * 1e3:.2f} ms", note])
        records.append({"row": label, "backend": backend, "step_time_s": step,
                        **{p if p != REST else "rest_s": parts_s.get(p) for p in parts}})
    header = ["Row", "Backend", *(PART_LABELS.get(p, p) for p in parts), "Step (mean)", "Note"]
    return Table(header=header, cells=cells, records=records, numeric=tuple(range(2, 2 + len(parts) + 1)),
                 name="breakdown", csv=False)


def breakdown_blocks(rows: list[ComparisonRow], backends: list[str], out_dir: Path | None) -> list:
    """The report's step-breakdown section: a table, and the stacked chart when ``out_dir`` is given."""
    entries = breakdown_entries(rows, backends)
    if not any(parts for _, _, parts in entries):
        return []
    blocks: list = [Heading("Step breakdown", 3), breakdown_table(entries)]
    if out_dir is not None:
        from xfw.report.plot import plot_breakdown

        try:
            from xfw.report.comparison import short_name

            chart = plot_breakdown([e for e in entries if e[2]], _parts_shown(entries), PART_LABELS,
                                   Path(out_dir) / "breakdown.png", subtitle=short_name(rows))
            blocks.append(Image(chart, "stacked bars: each side's mean step by part"))
        except OSError:
            pass
    blocks.append(Paragraph("Mean over the measured steps, from device timestamps the harness places between the "
                            "parts (no host sync added). Data wait: fetching the step's micro-batches and moving them "
                            "to the device; forward + backward: every micro-batch's, with the gradient communication "
                            "that overlaps backward (on several processes what stays exposed is folded in here: "
                            "neither framework reports it without a profiler; `xfw explain` shows it by category); "
                            "optimizer step: clipping, the update, zeroing.", muted=True))
    return blocks


def insert_blocks(blocks: list, extra: list) -> list:
    """``extra`` placed before the page's first level-3 heading (after the main table and chart)."""
    at = next((i for i, b in enumerate(blocks) if isinstance(b, Heading)), len(blocks))
    return blocks[:at] + extra + blocks[at:]
