"""The convergence report shown: its page, its CSV files and its chart (:mod:`xfw.report.converge`).

The chart (:func:`write_chart`) puts train loss (left) and eval loss (right) against samples seen,
one line per backend (the mean over its ok seeds) in the colours of every xfw chart, a band from the
lowest to the highest seed, and the target as a dashed line on the eval panel. Train losses are noisy
per step: each seed's is a trailing moving average (:data:`SMOOTH_STEPS`) before the mean is taken.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np

from xfw.report.comparison import KINDS
from xfw.report.converge import ConvergeReport, fmt_p, no_speed, pct
from xfw.report.plot import backend_color
from xfw.report.table import Bullets, Heading, Image, Page, Paragraph, Strong, Table, to_csv

SMOOTH_STEPS = 10
"""Train loss: each seed's trailing moving average over this many steps (fewer at the start)."""
CHART_CAPTION = (f"Lines: the mean over each side's ok seeds; bands: the lowest to the highest seed. Train loss "
                 f"(left) is each seed's moving average over {SMOOTH_STEPS} steps; eval loss (right) is as measured, "
                 "with the target dashed.")


def page(r: ConvergeReport, chart: Path | None = None) -> Page:
    """The page: comparison and recipe, headline, verdict table, time-to-target tables, the chart (when
    given), settings that differ, notes, and how to read it."""
    ref, other = r.backends
    n = {b: len(r.targets[b].seeds) if b in r.targets else 0 for b in r.backends}
    blocks: list = [
        Paragraph(f"{KINDS.get(r.comparison, r.comparison + ' comparison')}. Recipe {r.recipe}: "
                  f"{ref} (the reference: it exported the start) and {other}, "
                  f"{f'{n[ref]} ok seeds each' if n[ref] == n[other] else f'{n[ref]} and {n[other]} ok seeds'}, "
                  f"{r.steps} steps of {r.samples_per_step:,} samples, eval every {r.eval_every} steps."),
        Bullets(r.headline, title="Result", name="headline"),
        Heading("Eval loss at each eval point", 3), _verdict_table(r),
        Heading("Time to target", 3), *_target_tables(r)]
    if chart is not None:
        blocks.append(Image(Path(chart), "train and eval loss against samples seen, per backend"))
        blocks.append(Paragraph(CHART_CAPTION, muted=True))
    blocks += [Heading("Settings that differ between the sides", 3),
               Bullets(r.settings_differences) if r.settings_differences else Paragraph("None reported.")]
    if r.notes:
        blocks += [Heading("Notes", 3), Bullets(r.notes, name="notes")]
    blocks.append(Paragraph(
        f"Test: {r.test} (Welch: unequal variances), α = {r.level:g}, at each eval point over the eval "
        "losses of each side's ok seeds; a seed varies the start (the exported initial weights) and the batch "
        "order, both shared by the two sides of one seed. Mean ± sample standard deviation (n seeds). With "
        f"{n[ref]} and {n[other]} seeds per side the test can only see differences larger than the "
        "seed-to-seed spread: indistinguishable means no larger difference was found, not that the sides are "
        "equal. Samples to target are interpolated linearly between the eval points around the first crossing; "
        "time to target = mean samples to target / the side's ips (its own speed measurement), given only when "
        "every seed reached the target."
        + (" With the default target (the reference's mean final eval loss) about half of the reference seeds end "
           "above it and never reach it, by construction: the mean eval curve (the reference's reaches the target "
           "by its final step) then gives the comparison." if r.target_source != "user" else ""), muted=True))
    return Page(title=f"Convergence: {r.recipe} ({r.comparison})", blocks=blocks)


def _verdict_table(r: ConvergeReport) -> Table:
    ref, other = r.backends
    cells, classes = [], []
    for p in r.points:
        side = [f"{_loss(p.mean[b])} ± {_loss(p.std[b])} ({p.n[b]})" if p.mean[b] is not None else "—"
                for b in r.backends]
        diff = f"{p.diff:+.4g} ({p.rel_diff:+.2%})" if p.diff is not None and p.rel_diff is not None else \
            _loss(p.diff)
        cells.append([str(p.step), f"{p.samples:,}", *side, diff, fmt_p(p.p) if p.p is not None else "—",
                      Strong(p.verdict) if p.separated else p.verdict])
        classes.append("regression" if p.separated else "")
    return Table(header=["step", "samples", f"{ref} eval loss", f"{other} eval loss", f"{other} − {ref}", "p",
                         "verdict"], cells=cells, numeric=(0, 1, 2, 3, 4, 5), row_classes=classes,
                 records=[asdict(p) for p in r.points], name="converge-verdicts")


def _target_tables(r: ConvergeReport) -> list:
    ref = r.backends[0]
    rows, seeds = [], []
    for b in r.backends:
        t = r.targets[b]
        versus = ["reference"] * 3 if b == ref else [_pct(r.ips_contrast), _pct(r.time_contrast),
                                                     _pct(r.curve_time_contrast)]
        mean = (f"{t.mean_samples:,.0f} (over {t.reached} of {len(t.seeds)})" if t.mean_samples is not None
                else f"not reached in {r.steps} steps")
        time = _secs(t.time_s) if t.time_s is not None else Strong("n/a: " + t.time_reason)
        curve = f"{_count(t.curve_samples)} / {_secs(t.curve_time_s)}" if t.curve_samples is not None else "not reached"
        rows.append([b, _rate(t.ips), f"{t.reached} of {len(t.seeds)}", mean, time, curve, *versus])
        seeds += [[b, str(s.seed), _loss(s.final_eval_loss), _count(s.samples) if s.reached else
                   f"not reached in {r.steps} steps", _secs(s.time_s)] for s in t.seeds]
    target = (f"Target: eval loss ≤ {r.target:.4g} ({r.target_source})." if r.target is not None
              else f"No target ({r.target_source}).")
    return [Table(header=["backend", "ips (samples/s)", "seeds reaching the target", "mean samples to target",
                          "time to target", "mean eval curve: samples / time", f"ips vs {ref}",
                          f"time to target vs {ref}", f"mean-curve time vs {ref}"], cells=rows,
                  numeric=(1, 3, 4, 6, 7, 8), name="converge-target",
                  records=[asdict(r.targets[b]) for b in r.backends],
                  notes=[target + " ips: + is faster; time to target: + is slower."]),
            Table(title="Per seed", header=["backend", "seed", "final eval loss", "samples to target",
                                            "time to target"], cells=seeds, numeric=(2, 3, 4),
                  name="converge-seeds")]


def _loss(v: float | None) -> str:
    return "—" if v is None else f"{v:.4f}" if abs(v) >= 0.01 else f"{v:.3g}"


def _rate(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _secs(v: float | None) -> str:
    return "—" if v is None else f"{v:,.1f} s"


def _count(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else pct(v)


# --- CSV ---

def _cell(value) -> str:
    return "" if value is None else str(value)


def eval_csv(report: ConvergeReport) -> str:
    """One row per eval point of every side and seed (crashed seeds' truncated curves included, with
    their status), that point's statistics beside it."""
    ref, other = report.backends
    stats = {p.step: p for p in report.points}
    header = ["comparison", "recipe", "backend", "seed", "status", "step", "samples", "eval_loss"] + \
        [f"{k}_{b}" for b in report.backends for k in ("mean", "std", "n")] + \
        [f"diff_{other}_minus_{ref}", "rel_diff", "t", "df", "p", "verdict", "headline"]
    rows = []
    for b, seeds in report.curves.items():
        for seed, run in seeds.items():
            for step, samples, loss in run.eval:
                p = stats.get(step)
                point = ([x for b2 in report.backends for x in (p.mean[b2], p.std[b2], p.n[b2])]
                         + [p.diff, p.rel_diff, p.t, p.df, p.p, p.verdict]) if p else [None] * 12
                rows.append([_cell(v) for v in [report.comparison, report.recipe, b, seed, run.status, step, samples,
                                                loss, *point, " / ".join(report.headline)]])
    return to_csv([Table(header=header, cells=rows)])


def curves_csv(report: ConvergeReport) -> str:
    """Every train and eval point of every side and seed."""
    rows = [[_cell(v) for v in (report.comparison, b, seed, run.status, kind, *point)]
            for b, seeds in report.curves.items() for seed, run in seeds.items()
            for kind in ("train", "eval") for point in getattr(run, kind)]
    return to_csv([Table(header=["comparison", "backend", "seed", "status", "kind", "step", "samples", "loss"],
                         cells=rows)])


# --- chart ---

def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average; the first points average what there is so far."""
    sums = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(1, values.size + 1)
    lo = np.maximum(idx - window, 0)
    return (sums[idx] - sums[lo]) / (idx - lo)


def _band(series: list[tuple[np.ndarray, np.ndarray]]):
    """Mean, lowest and highest over seeds at every x any seed has (each over the seeds that have it)."""
    xs = np.unique(np.concatenate([x for x, _ in series]))
    grid = np.full((len(series), xs.size), np.nan)
    for i, (x, y) in enumerate(series):
        grid[i, np.searchsorted(xs, x)] = y
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an x only some seeds have is averaged over those
        return xs, np.nanmean(grid, 0), np.nanmin(grid, 0), np.nanmax(grid, 0)


def _series(run, kind: str, window: int):
    points = [(n, v) for _, n, v in getattr(run, kind) if v is not None]
    if not points:
        return None
    x, y = (np.asarray(a, float) for a in zip(*points))
    return x, _smooth(y, window) if window > 1 else y


def write_chart(report: ConvergeReport, path: str | Path) -> Path:
    """One PNG, written atomically: train loss (moving average) and eval loss against samples seen."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    ok = {b: [r for r in report.curves.get(b, {}).values() if r.status == "ok"] for b in report.backends}
    for ax, kind, window in ((axes[0], "train", SMOOTH_STEPS), (axes[1], "eval", 1)):
        for i, b in enumerate(report.backends):
            series = [s for s in (_series(r, kind, window) for r in ok[b]) if s is not None]
            if not series:
                continue
            xs, mean, low, high = _band(series)
            colour = backend_color(b, i)
            ax.plot(xs, mean, color=colour, lw=1.6, marker="o" if kind == "eval" else None, ms=3,
                    label=f"{b}: mean of {len(series)} seed{'s' if len(series) != 1 else ''}")
            ax.fill_between(xs, low, high, color=colour, alpha=0.2, lw=0, label=f"{b}: lowest to highest seed")
        ax.set_xlabel("samples seen")
        ax.grid(alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    if report.target is not None:
        axes[1].axhline(report.target, color="#333333", ls="--", lw=1,
                        label=f"target {report.target:.4g} ({report.target_source})")
    axes[0].set_title(f"Train loss (moving average over {SMOOTH_STEPS} steps)", fontsize=11)
    axes[1].set_title(f"Eval loss (held-out split, every {report.eval_every} steps)", fontsize=11)
    axes[0].set_ylabel("loss")
    for ax in axes:
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(f"{report.recipe} ({report.comparison}): lines are the mean over seeds, bands the lowest to "
                 "highest seed", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


def headline(r: ConvergeReport) -> list[str]:
    """The report's first lines: the ips and time-to-target contrast, the final verdict, the first separation."""
    ref, other = r.backends
    tr, to = r.targets[ref], r.targets[other]
    why_ips = "; ".join(no_speed(t.backend, r.speed.get(t.backend)) for t in (tr, to) if t.ips is None)
    parts = [f"{other} vs {ref}: ips " + (pct(r.ips_contrast) if r.ips_contrast is not None else f"n/a ({why_ips})")]
    never = [t for t in (to, tr) if t.seeds and t.reached == 0]
    empty = [t.backend for t in (to, tr) if not t.seeds]
    if r.target is None:
        parts.append(f"no target ({r.target_source})")
    elif empty:
        parts.append(f"no {' or '.join(empty)} seed ran to completion")
    elif len(never) == 2:
        parts.append(f"but neither side reaches the target in {r.steps} steps")
    elif never:
        parts.append(f"but {never[0].backend} never reaches the target in {r.steps} steps "
                     f"(0 of {len(never[0].seeds)} seeds)")
    elif r.time_contrast is not None:  # every seed of both sides reached it
        parts.append(f"time to target {pct(r.time_contrast)}")
    elif r.curve_time_contrast is not None:  # each side's mean eval curve: the reference's reaches a default target
        parts.append(f"time to target {pct(r.curve_time_contrast)} (mean eval curves; seeds reaching it: "
                     f"{to.reached} of {len(to.seeds)} {other}, {tr.reached} of {len(tr.seeds)} {ref})")
    elif to.curve_samples is None and tr.curve_samples is not None:
        parts.append(f"but {other}'s mean eval curve never reaches the target in {r.steps} steps "
                     f"({to.reached} of {len(to.seeds)} seeds do)")
    else:
        parts.append("time to target n/a (" + "; ".join(f"{t.backend}: {t.time_reason}" for t in (tr, to)
                                                        if t.time_reason) + ")")
    lines = [", ".join(parts) + (f" (target {r.target:.4g}, {r.target_source})" if r.target is not None else "")]
    final = r.final
    if "never reaches" in lines[0] and final is not None and final.verdict.startswith("indistinguishable"):
        lines[0] += ("; the final eval losses are indistinguishable, so the miss is within the seed-to-seed spread "
                     "(a target the reference reaches only on average; give --target for a firmer one)")
    if final is None:
        return lines + ["final eval loss: no eval point"]
    n = final.n
    seeds = f"{n[ref]} seeds each" if n[ref] == n[other] else f"{n[ref]} {ref} and {n[other]} {other} seeds"
    p = f"p = {fmt_p(final.p)}; " if final.p is not None else ""
    lines.append(f"final eval loss (step {final.step}): {final.verdict} ({p}{r.test}, α = {r.level:g}, {seeds})")
    first, tested = r.first_separation, [p for p in r.points if p.p is not None]
    if first is not None:
        lines.append(f"the sides first separate at step {first.step} ({first.samples:,} samples, p = {fmt_p(first.p)})")
    else:
        untested = len(r.points) - len(tested)
        lines.append(f"the sides never separate (p ≥ {r.level:g} at every one of the {len(tested)} eval points "
                     f"tested{f', {untested} without a test' if untested else ''})")
    return lines
