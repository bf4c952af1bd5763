"""The convergence report shown: its headline, page, CSV files and chart (:mod:`xfw.report.converge`).

The report is passed in (``r``); this module imports nothing of :mod:`xfw.report.converge`, which
imports it (one direction). The chart (:func:`write_chart`) puts train loss (left), eval loss (middle)
and the per-seed eval-loss difference between the sides (right) against samples seen: one line per
backend (the mean over its seeds) in the colours of every xfw chart, with markers and different line
styles so two coinciding lines stay visible, a band from the lowest to the highest seed, and the
target dashed. Train losses are each seed's trailing moving average (:data:`SMOOTH_STEPS`).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np

from xfw.report.comparison import KINDS
from xfw.report.converge_target import no_speed
from xfw.report.decision import Decision, fmt_pct, fmt_signed
from xfw.report.plot import backend_color
from xfw.report.table import Bullets, Heading, Image, Page, Paragraph, Strong, Table, to_csv


def pct(value: float) -> str:
    return f"{value:+.0%}" if abs(value) >= 0.1 else f"{value:+.1%}"


def fmt_p(p: float) -> str:
    return f"{p:.3g}" if p >= 0.001 else f"{p:.1e}"


SMOOTH_STEPS = 10
"""Train loss: each seed's trailing moving average over this many steps (fewer at the start)."""
CHART_CAPTION = (f"Lines: the mean over each side's seeds (circles and solid for the reference, crosses and dashed "
                 f"for the other, so coinciding lines stay visible); bands: the lowest to the highest seed. Train loss "
                 f"(left) is each seed's moving average over {SMOOTH_STEPS} steps; eval loss (middle) as measured, the "
                 "target dotted; right: each seed's eval loss of the other side relative to the reference's, with "
                 "the margin shaded.")


def what_compared(r) -> str:
    """The comparison in words: a deliberate difference or a differing mechanism is named, never hidden
    behind "like-for-like"."""
    overrides = [f"{b}: {', '.join(keys)}" for b, keys in r.deliberate.items() if keys]
    differing = [d.split(" differs")[0] for d in r.settings_differences if " differs" in d]
    if overrides:  # both named: a deliberate difference does not hide a mechanism that also differs
        return "deliberate difference (" + "; ".join(overrides) + ")" + (
            f", and differing {', '.join(differing)}" if differing else "")
    if differing:
        return f"{r.comparison}, with differing " + ", ".join(differing)
    return r.comparison


def _kind(r) -> str:
    """The first words of the page: the comparison, and "one algorithm on both sides" only where nothing differs."""
    if what_compared(r) == r.comparison:
        return KINDS.get(r.comparison, r.comparison + " comparison")
    return f"{r.comparison.capitalize()} comparison with a {what_compared(r).removeprefix(r.comparison + ', with ')}" \
        " (not one algorithm on both sides)"


def page(r, chart: Path | None = None) -> Page:
    """The page: comparison and recipe, headline, verdict table, time-to-target tables, the chart (when
    given), settings that differ, notes, and how to read it."""
    ref, other = r.backends
    d = r.decision
    blocks: list = [
        Paragraph(f"{_kind(r)}. Recipe {r.recipe}: {ref} (the reference: it exported the start) and {other}; "
                  f"{len(r.curves.get(ref, {}))} seeds, {r.steps} steps of {r.samples_per_step:,} samples, "
                  f"eval every {r.eval_every} steps."),
        Bullets(r.headline, title="Result", name="headline"),
        Heading("Eval loss at each eval point", 3), _verdict_table(r),
        Paragraph("The final eval point decides (its row is the verdict above); the other rows' decisions are "
                  "context, at the same level, and a first separation is named only when every later point "
                  "separates the same way (no point is tested on its own). Unpaired p: Welch's test over seeds, "
                  "the seed-to-seed spread, context only.", muted=True),
        Heading("Time to target", 3), *_target_tables(r)]
    if chart is not None:
        blocks.append(Image(Path(chart), "train and eval loss against samples seen, per backend"))
        blocks.append(Paragraph(CHART_CAPTION, muted=True))
    blocks += [Heading("Settings that differ between the sides", 3),
               Bullets(r.settings_differences) if r.settings_differences else Paragraph("None reported.")]
    if r.notes:
        blocks += [Heading("Notes", 3), Bullets(r.notes, name="notes")]
    a, b = r.sides
    blocks.append(Paragraph(
        f"Test: {r.test}. The two sides of a seed share its start and its batches, so each seed gives one paired "
        f"observation ln({b} / {a}) of the held-out eval loss, and the decision is the paired t interval of their "
        f"mean (:mod:`xfw.report.decision`): same when the whole interval lies inside ±{r.margin:.1%} (the margin), "
        f"worse/better when it excludes 0, else undecided with about how many seeds would decide it. "
        + ("Two-sided (is either side worse?), α = " if r.direction == "two-sided" else
           f"One-sided (only: is {b} worse?), α = ") + f"{r.level:g}"
        + (f", spent over at most {r.max_looks} looks (this is look {r.look})" if r.max_looks > 1 else "")
        + (f"; smallest difference this n could detect: {fmt_pct(d.detectable)}" if d and d.detectable else "")
        + ". A seed that diverged counts as an infinitely higher loss for its side. Time to target = mean samples "
        "to target / the side's ips; its interval combines the seeds' spread of samples with the ips interval "
        "(approximate), given only when every seed reached the target.", muted=True))
    return Page(title=f"Convergence: {r.recipe} ({what_compared(r)})", blocks=blocks)


def _decision_cell(d: dict | None, a: str, b: str) -> str:
    if not d:
        return "—"
    x = Decision.from_dict(d)
    word = {"worse": f"{b} worse", "better": f"{b} better", "same": "same"}.get(x.outcome, "undecided")
    if x.diverged:
        return f"{word} (diverged in {x.diverged} of {x.n})"
    if x.low is None:
        return f"{word} (n={x.n}, no interval)"
    return f"{word}: {fmt_signed(x.estimate)} ({fmt_signed(x.low)}…{fmt_signed(x.high)})"


def _verdict_table(r) -> Table:
    ref, other = r.backends
    a, b = r.sides
    cells, classes = [], []
    for p in r.points:
        side = [f"{_loss(p.mean[x])} ± {_loss(p.std[x])} ({p.n[x]})" if p.mean[x] is not None else "—"
                for x in r.backends]
        diff = f"{p.diff:+.4g} ({fmt_signed(p.rel_diff)})" if p.diff is not None and p.rel_diff is not None else \
            _loss(p.diff)
        cell = _decision_cell(p.decision, a, b)
        cells.append([str(p.step), f"{p.samples:,}", *side, diff, fmt_p(p.p) if p.p is not None else "—",
                      Strong(cell) if p.separated else cell])
        classes.append("regression" if p.separated else "")
    return Table(header=["step", "samples", f"{ref} eval loss", f"{other} eval loss",
                         f"{other} − {ref} (% of {ref})", "unpaired p", f"paired decision: {b}/{a} − 1 (interval)"],
                 cells=cells, numeric=(0, 1, 2, 3, 4, 5), row_classes=classes,
                 records=[asdict(p) for p in r.points], name="converge-verdicts")


def _interval(low, high) -> str:
    return "" if low is None or high is None else f" ({_secs(low)}…{_secs(high)})"


def _target_tables(r) -> list:
    ref = r.backends[0]
    rows, seeds = [], []
    for b in r.backends:
        t = r.targets[b]
        time_vs = "n/a" if r.time_contrast is None else pct(r.time_contrast) + (
            f" ({pct(r.time_contrast_low)}…{pct(r.time_contrast_high)})" if r.time_contrast_low is not None else "")
        versus = ["reference"] * 3 if b == ref else [_pct(r.ips_contrast), time_vs, _pct(r.curve_time_contrast)]
        mean = (f"{t.mean_samples:,.0f} (over {t.reached} of {len(t.seeds)})" if t.mean_samples is not None
                else f"not reached in {r.steps} steps")
        time = (_secs(t.time_s) + _interval(t.time_low, t.time_high) if t.time_s is not None
                else Strong("n/a: " + t.time_reason))
        sp = r.speed.get(b)
        ips = _rate(t.ips) + (f" ({_rate(sp.ips_low)}…{_rate(sp.ips_high)}, {sp.spread})"
                              if sp is not None and sp.ips_low is not None else "")
        curve = f"{_count(t.curve_samples)} / {_secs(t.curve_time_s)}" if t.curve_samples is not None else "not reached"
        rows.append([b, ips, f"{t.reached} of {len(t.seeds)}", mean, time, curve, *versus])
        seeds += [[b, str(s.seed), _loss(s.final_eval_loss) if s.final_eval_loss is not None else "diverged",
                   _count(s.samples) if s.reached else f"not reached in {r.steps} steps", _secs(s.time_s)]
                  for s in t.seeds]
    target = (f"Target: eval loss ≤ {r.target:.4g} ({r.target_source})." if r.target is not None
              else f"No target ({r.target_source}).")
    return [Table(header=["backend", "ips (samples/s, 95% interval)", "seeds reaching the target",
                          "mean samples to target", "time to target (95% interval)",
                          "mean eval curve: samples / time", f"ips vs {ref}", f"time to target vs {ref}",
                          f"mean-curve time vs {ref}"], cells=rows,
                  numeric=(3, 6, 7, 8), name="converge-target",
                  records=[asdict(r.targets[b]) for b in r.backends],
                  notes=[target + " ips: + is faster; time to target: + is slower."]),
            Heading("Per seed", 3),
            Table(header=["backend", "seed", "final eval loss", "samples to target", "time to target"], cells=seeds,
                  numeric=(2, 3, 4), name="converge-seeds")]


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


def eval_csv(report) -> str:
    """One row per eval point of every side and seed (crashed seeds' truncated curves included, with
    their status), that point's statistics beside it."""
    ref, other = report.backends
    stats = {p.step: p for p in report.points}
    header = ["comparison", "recipe", "backend", "seed", "status", "step", "samples", "eval_loss"] + \
        [f"{k}_{b}" for b in report.backends for k in ("mean", "std", "n")] + \
        [f"diff_{other}_minus_{ref}", "rel_diff", "welch_t", "welch_df", "welch_p", "outcome", "verdict", "headline"]
    rows = []
    for b, seeds in report.curves.items():
        for seed, run in seeds.items():
            for step, samples, loss in run.eval:
                p = stats.get(step)
                point = ([x for b2 in report.backends for x in (p.mean[b2], p.std[b2], p.n[b2])]
                         + [p.diff, p.rel_diff, p.t, p.df, p.p, p.decision["outcome"] if p.decision else None,
                            p.verdict]) if p else [None] * 13
                rows.append([_cell(v) for v in [report.comparison, report.recipe, b, seed, run.status, step, samples,
                                                loss, *point, " / ".join(report.headline)]])
    return to_csv([Table(header=header, cells=rows)])


def curves_csv(report) -> str:
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


def write_chart(report, path: str | Path) -> Path:
    """One PNG, written atomically: train loss (moving average), eval loss, and each seed's relative
    eval-loss difference (other / reference − 1) against samples seen."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ok = {b: [r for r in report.curves.get(b, {}).values() if r.status == "ok"] for b in report.backends}
    styles = ({"ls": "-", "marker": "o", "ms": 5, "mfc": "none"}, {"ls": "--", "marker": "x", "ms": 5})
    for ax, kind, window in ((axes[0], "train", SMOOTH_STEPS), (axes[1], "eval", 1)):
        for i, b in enumerate(report.backends):
            series = [s for s in (_series(r, kind, window) for r in ok[b]) if s is not None]
            if not series:
                continue
            xs, mean, low, high = _band(series)
            colour, style = backend_color(b, i), dict(styles[i % 2])
            if kind == "train":
                style.update(marker=None)
            ax.plot(xs, mean, color=colour, lw=1.6, label=f"{b}: mean of {len(series)} seed{'s' if len(series) != 1 else ''}",
                    **style)
            ax.fill_between(xs, low, high, color=colour, alpha=0.2, lw=0, label=f"{b}: lowest to highest seed")
    ref, other = report.backends
    by_seed = {b: {s: {n: v for _, n, v in r.eval if v is not None} for s, r in report.curves.get(b, {}).items()
                   if r.status == "ok"} for b in report.backends}
    for k, seed in enumerate(sorted(set(by_seed[ref]) & set(by_seed[other]))):
        a, o = by_seed[ref][seed], by_seed[other][seed]
        xs = sorted(n for n in set(a) & set(o) if a[n] and math.isfinite(a[n]) and math.isfinite(o[n]))
        if xs:
            axes[2].plot(xs, [100 * (o[n] / a[n] - 1) for n in xs], marker="o", ms=3, lw=1, label=f"seed {seed}",
                         color=f"C{k % 10}")
    margin = 100 * getattr(report, "margin", 0.0)
    if margin:
        axes[2].axhspan(-margin, margin, color="#999999", alpha=0.15, lw=0, label=f"margin ±{margin:.3g}%")
    axes[2].axhline(0, color="#333333", lw=0.8)
    axes[2].set_title(f"Eval loss, {other} vs {ref} per seed (%)", fontsize=11)
    axes[2].set_ylabel(f"{other} / {ref} − 1 (%)")
    for ax in axes:
        ax.set_xlabel("samples seen")
        ax.grid(alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    if report.target is not None:
        axes[1].axhline(report.target, color="#333333", ls=":", lw=1,
                        label=f"target {report.target:.4g} ({report.target_source.split(';')[0]})")
    axes[0].set_title(f"Train loss (moving average over {SMOOTH_STEPS} steps)", fontsize=11)
    axes[1].set_title(f"Eval loss (held-out split, every {report.eval_every} steps)", fontsize=11)
    axes[0].set_ylabel("loss")
    for ax in axes:
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(f"{report.recipe} ({what_compared(report)}): lines are the mean over seeds, bands the lowest to "
                 "highest seed; right: each seed's paired difference", fontsize=10)
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


def headline(r) -> list[str]:
    """The report's first lines: what was compared with the ips and time-to-target contrast; the final
    decision (the verdict, :meth:`Decision.phrase`); where the sides first separate for good, if they do."""
    ref, other = r.backends
    tr, to = r.targets[ref], r.targets[other]
    d = r.decision
    why_ips = "; ".join(no_speed(t.backend, r.speed.get(t.backend)) for t in (tr, to) if t.ips is None)
    ips = pct(r.ips_contrast) if r.ips_contrast is not None else f"n/a ({why_ips})"
    parts = [f"{other} vs {ref} ({what_compared(r)}): ips {ips}"]
    never = [t for t in (to, tr) if t.seeds and t.reached == 0]
    empty = [t.backend for t in (to, tr) if not t.seeds]
    if d is not None and d.outcome == "same" and r.direction == "two-sided" and r.ips_contrast is not None:
        parts.append(f"eval loss the same within ±{r.margin:.1%}, so time to target is the ips ratio "
                     f"({pct(1 / (1 + r.ips_contrast) - 1)} time), not a second finding")
    elif r.target is None:
        parts.append(f"no target ({r.target_source})")
    elif empty:
        parts.append(f"no {' or '.join(empty)} seed ran to completion")
    elif len(never) == 2:
        parts.append(f"but neither side reaches the target in {r.steps} steps")
    elif never:
        parts.append(f"but {never[0].backend} never reaches the target in {r.steps} steps "
                     f"(none of its {len(never[0].seeds)} seeds)")
    elif r.time_contrast is not None:  # every seed of both sides reached it
        interval = (f" (approx. 95% interval {pct(r.time_contrast_low)}…{pct(r.time_contrast_high)})"
                    if r.time_contrast_low is not None else " (no interval: fewer than 2 seeds or no ips spread)")
        parts.append(f"time to target {pct(r.time_contrast)}{interval}")
    elif r.curve_time_contrast is not None:  # each side's mean eval curve
        parts.append(f"time to target {pct(r.curve_time_contrast)} on the mean eval curves (no interval: seeds "
                     f"reaching it {to.reached} of {len(to.seeds)} {other}, {tr.reached} of {len(tr.seeds)} {ref})")
    elif to.curve_samples is None and tr.curve_samples is not None:
        parts.append(f"but {other}'s mean eval curve never reaches the target in {r.steps} steps "
                     f"({to.reached} of {len(to.seeds)} seeds do)")
    else:
        parts.append("time to target n/a (" + "; ".join(f"{t.backend}: {t.time_reason}" for t in (tr, to)
                                                        if t.time_reason) + ")")
    lines = [", ".join(parts) + (f" (target {r.target:.4g}, {r.target_source})" if r.target is not None else "")]
    final = r.final
    if final is None or d is None:
        return lines + ["final eval loss: no eval point with both sides"]
    a, b = r.sides
    lines.append(f"final eval loss (step {final.step}): " + d.phrase(a, b))
    first = r.first_separation
    if first is not None:
        lines.append(f"{first.worse} stays worse from step {first.step} ({first.samples:,} samples) to the end "
                     "(every point from there decides the same way; the final point decides)")
    else:
        lines.append("the final point decides; no earlier point is a separation that lasts to the end")
    return lines
