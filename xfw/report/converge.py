"""Convergence: do two backends reach the same eval loss from one start, and how long does each take?

``xfw converge`` trains every seed on both sides from one exported start on identical batches and
evaluates a held-out split every K steps; :func:`analyse` turns those curves and each side's ordinary
speed measurement into a :class:`ConvergeReport` (``converge.json``)::

    report = analyse(curves, speed, backends=("torch", "paddle"), recipe="recipes/x.yaml",
                     comparison="like-for-like", steps=300, eval_every=25, samples_per_step=64)
    report.headline   # ['paddle vs torch: ips +26%, time to target +31% (target 2.134, ...)', 'final eval loss: ...']
    write_outputs(report, "runs/converge")   # converge.json .md .csv .html .png, curves.csv

``backends[0]`` is the reference (it exported the start). The two sides of a seed share its start and
its batches, so the verdict is paired: per seed, the log ratio of the two sides' held-out eval losses,
decided by :func:`xfw.report.decision.decide` (same within ``margin`` / worse / better / undecided).
The final eval point decides; the other points get the same decision for context only, and a "first
separation" is named only when every point from it to the end separates the same way as the final
decision (a claim about when, made only once the final point has decided that). Welch's unpaired test
over seeds stays as the seed-to-seed context (``p``), never the verdict. A seed that diverged (a
non-finite loss, or a loss above ``xfw.contract.curves.BLOWUP`` times its first) is a result for
that side (+inf on its side of the ratio); a crashed seed has no quality result and is named. Samples to target are interpolated linearly between the two eval points around the
first crossing; time to target = mean samples / the side's ips. ``converge.csv`` has one row per eval
point of every side and seed with that point's statistics beside it; ``curves.csv`` every train and
eval point of every seed. The page, the CSV files and the chart are :mod:`xfw.report.converge_plot`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from xfw.contract.atomic import read_json_object, write_json_atomic, write_text_atomic
from xfw.contract.curves import diverged
from xfw.report import converge_plot as shown
from xfw.report.converge_plot import fmt_p
from xfw.report.converge_target import (SeedTarget, SideTarget, Speed, ratio_interval, samples_to_target,
                                        short_window, side_target)
from xfw.report.decision import Decision, decide, log_ratios
from xfw.report.table import to_html, to_markdown

__all__ = ["ConvergeReport", "PointStats", "SeedRun", "SeedTarget", "SideTarget", "Speed", "analyse",
           "samples_to_target", "welch", "write_outputs"]

CONVERGE_SCHEMA = 2
CONVERGE_FILE = "converge.json"
TEST_NAME = "paired t on per-seed log ratios of the final eval loss"
CONTEXT_TEST = "Welch's t-test, two-sided (unpaired, seed-to-seed context)"
NO_SPREAD = "no spread: fewer than 2 seeds"
DEFAULT_MARGIN = 0.02
"""δ for eval loss, relative (docs/converge.md): below the seed-to-seed spread of a tiny recipe's final
eval loss (5-14%) and of one more epoch's gain, far above fp32 rounding (~1e-6)."""

Point = tuple[int, int, float | None]
"""(step, samples seen, loss): train points are (step index, samples after it, loss); eval points
(optimizer steps done before the eval, samples seen, eval loss)."""


@dataclass
class SeedRun:
    status: str
    """ok | oom | timeout | crashed | unsupported | invalid | missing"""
    reason: str = ""
    run_dir: str = ""
    train: list[Point] = field(default_factory=list)
    eval: list[Point] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict) -> "SeedRun":
        return cls(**{**data, "train": [tuple(p) for p in data.get("train", [])],
                      "eval": [tuple(p) for p in data.get("eval", [])]})


@dataclass(kw_only=True)
class PointStats:
    """One eval point: each side's eval losses over its seeds, the paired decision (the final point's
    is the verdict; the others are context) and Welch's unpaired test as the seed-to-seed context."""
    step: int
    samples: int
    mean: dict[str, float | None]
    std: dict[str, float | None]
    """Sample standard deviation over seeds (ddof 1); None with fewer than 2."""
    n: dict[str, int]
    diff: float | None = None
    """mean(other) − mean(reference)."""
    rel_diff: float | None = None
    """diff / |mean(reference)|: every percentage on a row has this base, the reference."""
    t: float | None = None
    """Welch's t of other against reference (unpaired context; > 0: other's loss higher)."""
    df: float | None = None
    p: float | None = None
    """Welch's p (unpaired context, never the verdict)."""
    context: str = ""
    """Welch's result in words (seed-to-seed context)."""
    decision: dict | None = None
    """The paired decision at this point (:class:`xfw.report.decision.Decision` as a dict)."""
    diverged: dict[str, list[int]] = field(default_factory=dict)
    """Backend -> the seeds that had diverged by this point (their loss counts as +inf)."""
    verdict: str = ""
    """The decision in words (:meth:`Decision.phrase`): the same words as the headline at the final point."""
    worse: str | None = None
    separated: bool = False
    """The decision is worse/better (at the final point: the verdict; elsewhere: context)."""


@dataclass(kw_only=True)
class ConvergeReport:
    recipe: str
    comparison: str
    backends: tuple[str, str]
    """(reference, other): the reference exported the start both sides load."""
    steps: int
    eval_every: int
    samples_per_step: int
    level: float = 0.05
    """α: the chance of a wrong decision (spread over the looks of a sequential run)."""
    margin: float = DEFAULT_MARGIN
    direction: str = "two-sided"
    """``two-sided``, or ``<backend>-worse`` (one-sided: only "is that side worse?" is asked)."""
    look: int = 1
    max_looks: int = 1
    """Sequential runs (``--seeds auto``): this decision is look ``look`` of at most ``max_looks``."""
    test: str = TEST_NAME
    curves: dict[str, dict[int, SeedRun]] = field(default_factory=dict)
    speed: dict[str, Speed] = field(default_factory=dict)
    points: list[PointStats] = field(default_factory=list)
    target: float | None = None
    target_source: str = ""
    """``user``, or which side's mean final eval loss; why there is none otherwise."""
    targets: dict[str, SideTarget] = field(default_factory=dict)
    ips_contrast: float | None = None
    """(ips other − ips reference) / ips reference: + is faster."""
    time_contrast: float | None = None
    """(time other − time reference) / time reference: + is slower."""
    time_contrast_low: float | None = None
    time_contrast_high: float | None = None
    curve_time_contrast: float | None = None
    deliberate: dict[str, list[str]] = field(default_factory=dict)
    """Backend -> the settings its per-backend override changed (a deliberate difference)."""
    headline: list[str] = field(default_factory=list)
    settings_differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def final(self) -> PointStats | None:
        return self.points[-1] if self.points else None

    @property
    def decision(self) -> Decision | None:
        """The verdict: the paired decision at the final eval point."""
        final = self.final
        return Decision.from_dict(final.decision) if final is not None and final.decision else None

    @property
    def sides(self) -> tuple[str, str]:
        """(A, B) of the decision: B is the side asked about (``--direction``), else the other side."""
        ref, other = self.backends
        return (other, ref) if self.direction == f"{ref}-worse" else (ref, other)

    @property
    def first_separation(self) -> PointStats | None:
        """The first point from which every point to the end separates as the final decision does;
        None unless the final decision is worse/better (module docstring)."""
        final = self.final
        if final is None or not final.separated:
            return None
        first = None
        for p in reversed(self.points):
            if not (p.separated and p.decision and p.decision["outcome"] == final.decision["outcome"]):
                break
            first = p
        return first

    def to_dict(self) -> dict:
        data = asdict(self)
        data["backends"] = list(self.backends)
        data["curves"] = {b: {str(s): r for s, r in runs.items()} for b, runs in data["curves"].items()}
        for b, side in self.targets.items():
            data["targets"][b]["reached"] = side.reached
            for seed, entry in zip(side.seeds, data["targets"][b]["seeds"]):
                entry["reached"] = seed.reached
        first = self.first_separation
        data.update(schema=CONVERGE_SCHEMA, final_verdict=self.final.verdict if self.final else None,
                    final_outcome=self.final.decision["outcome"] if self.final and self.final.decision else None,
                    first_separation={"step": first.step, "samples": first.samples} if first else None)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ConvergeReport":
        data = {k: v for k, v in data.items() if k not in ("schema", "first_separation", "final_verdict",
                                                           "final_outcome")}
        targets = {b: SideTarget(**{**{k: v for k, v in t.items() if k != "reached"},
                                    "seeds": [SeedTarget(**{k: v for k, v in s.items() if k != "reached"})
                                              for s in t["seeds"]]})
                   for b, t in data.get("targets", {}).items()}
        return cls(**{**data, "backends": tuple(data["backends"]), "targets": targets,
                      "curves": {b: {int(s): SeedRun.from_dict(r) for s, r in runs.items()}
                                 for b, runs in data.get("curves", {}).items()},
                      "speed": {b: Speed(**s) for b, s in data.get("speed", {}).items()},
                      "points": [PointStats(**p) for p in data.get("points", [])]})

    def save(self, out_dir: str | Path) -> Path:
        path = Path(out_dir) / CONVERGE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, self.to_dict())
        return path

    @classmethod
    def load(cls, out_dir: str | Path) -> "ConvergeReport":
        """converge.json read back; any shape error is a ValueError in one line naming the file."""
        path = Path(out_dir) / CONVERGE_FILE
        data = read_json_object(path)
        if not data:
            raise FileNotFoundError(f"{path}: no convergence report")
        if data.get("schema") != CONVERGE_SCHEMA:
            raise ValueError(f"{path}: schema {data.get('schema')!r}, this xfw reads {CONVERGE_SCHEMA} "
                             "(run the converge again)")
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{path}: not a convergence report ({type(err).__name__}: {err})") from None

    def page(self, chart: Path | None = None):
        """What a person reads (:func:`xfw.report.converge_plot.page`)."""
        return shown.page(self, chart)


# --- analysis ------------------------------------------------------------------------------------

def _finite(value) -> float | None:
    return float(value) if value is not None and math.isfinite(float(value)) else None


def diverged_at(run: SeedRun) -> int | None:
    """The step at which a seed's training diverged: its first non-finite loss (train or eval), or the
    first train loss above ``xfw.contract.curves.BLOWUP`` times its first; None when it never did."""
    first = None
    for step, _, v in sorted(run.train):
        first = v if first is None else first
        if diverged(v, first):  # the curve loop's own rule (xfw.contract.curves)
            return int(step) + 1  # after this step's update
    bad = [int(s) for s, _, v in run.eval if v is not None and _finite(v) is None]
    return min(bad) if bad else None


def welch(reference: list[float], other: list[float], level: float, names: tuple[str, str]) -> dict:
    """Welch's two-sample t-test (two-sided) of ``other`` against ``reference``: t, df, p and the
    result in words (``context``). Unpaired, so it measures the seed-to-seed spread: context only."""
    from scipy import stats

    a, b = np.asarray(reference, float), np.asarray(other, float)
    out = {"t": None, "df": None, "p": None}
    if min(a.size, b.size) < 2:
        return {**out, "context": NO_SPREAD}
    if np.ptp(a) == 0 and np.ptp(b) == 0:
        return {**out, "context": "no spread on either side"}
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = stats.ttest_ind(b, a, equal_var=False)
    t, p = _finite(result.statistic), _finite(result.pvalue)
    df = _finite((va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1)))
    if p is None:
        return {**out, "context": "test undefined (no finite p-value)"}
    return {"t": t, "df": df, "p": p, "context": f"unpaired p = {fmt_p(p)}"}


def _stats(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else None


def _values(run: SeedRun, stop: int | None) -> dict[int, float]:
    """step -> eval loss; from a divergence on, +inf (the side's result for this seed)."""
    out = {int(s): v for s, _, v in run.eval if v is not None and _finite(v) is not None
           and (stop is None or s < stop)}
    return out


def _points(results: dict[str, dict[int, SeedRun]], stops: dict[str, dict[int, int | None]], r: ConvergeReport,
            names: tuple[str, str]) -> list[PointStats]:
    ref, other = r.backends
    a, b = r.sides
    samples, steps = {}, set()
    for side in r.backends:
        for run in results[side].values():
            for step, n, _ in run.eval:
                samples.setdefault(int(step), int(n))
                steps.add(int(step))
    values = {side: {s: _values(run, stops[side][s]) for s, run in results[side].items()} for side in r.backends}
    direction = "two-sided" if r.direction == "two-sided" else "one-sided"
    out = []
    for step in sorted(steps):
        finite = {side: [v[step] for v in values[side].values() if step in v] for side in r.backends}
        gone = {side: sorted(s for s, stop in stops[side].items() if stop is not None and stop <= step)
                for side in r.backends}
        mean, std = {}, {}
        for side in r.backends:
            mean[side], std[side] = _stats(finite[side])
        diff = mean[other] - mean[ref] if mean[other] is not None and mean[ref] is not None else None
        rel = diff / abs(mean[ref]) if diff is not None and mean[ref] else None

        def at(side, seed):
            if seed in gone[side]:
                return math.inf
            return values[side][seed].get(step)
        paired = [s for s in sorted(set(results[a]) & set(results[b])) if at(a, s) is not None and at(b, s) is not None]
        decision = None
        if paired:
            decision = decide(log_ratios([at(a, s) for s in paired], [at(b, s) for s in paired]), margin=r.margin,
                              higher_is_worse=True, alpha=r.level, direction=direction, look=r.look,
                              max_looks=r.max_looks)
        separated = decision is not None and decision.outcome in ("worse", "better")
        worse = None if not separated else (b if decision.outcome == "worse" else a)
        verdict = decision.phrase(a, b, quantity="eval loss") if decision else f"no seed with both sides at step {step}"
        out.append(PointStats(step=step, samples=samples.get(step, step * r.samples_per_step), mean=mean, std=std,
                              n={side: len(finite[side]) + len(gone[side]) for side in r.backends}, diff=diff,
                              rel_diff=rel, **welch(finite[ref], finite[other], r.level, names),
                              decision=decision.to_dict() if decision else None,
                              diverged={side: gone[side] for side in r.backends if gone[side]},
                              verdict=verdict, worse=worse, separated=separated))
    return out


def _contrast(other: float | None, reference: float | None) -> float | None:
    return (other - reference) / reference if other is not None and reference else None


def default_target(r: ConvergeReport) -> tuple[float | None, str]:
    """The reference's mean final eval loss, unless the reference carries a deliberate difference: then
    the other side's; when both do, none (give --target)."""
    final = r.final
    plain = [b for b in r.backends if not r.deliberate.get(b)]
    if not plain:
        return None, ("none: both sides carry a deliberate difference (" + "; ".join(
            f"{b}: {', '.join(keys)}" for b, keys in r.deliberate.items()) + "), so neither's loss is the goal: "
                      "give --target")
    side = plain[0]
    if final is None or final.mean.get(side) is None:
        return None, f"none: {side} has no final eval loss"
    why = "" if side == r.backends[0] else f"; not {r.backends[0]}'s, which carries a deliberate difference"
    return final.mean[side], f"{side} mean final eval loss{why}"


def analyse(curves: dict[str, dict[int, SeedRun]], speed: dict[str, Speed], *, backends: tuple[str, str],
            recipe: str, comparison: str, steps: int, eval_every: int, samples_per_step: int,
            target: float | None = None, level: float = 0.05, margin: float = DEFAULT_MARGIN,
            direction: str = "two-sided", look: int = 1, max_looks: int = 1,
            deliberate: dict[str, list[str]] | None = None, settings_differences: list[str] = (),
            notes: list[str] = ()) -> ConvergeReport:
    """The convergence report from each side's seed runs and speed measurement (module docstring)."""
    backends = tuple(backends)
    if direction not in ("two-sided", *(f"{b}-worse" for b in backends)):
        raise ValueError(f"--direction: {direction!r} (two-sided, or one of "
                         + ", ".join(f"{b}-worse" for b in backends) + ")")
    notes = list(notes)
    raw = {b: {int(s): SeedRun(status=r.status, reason=r.reason, run_dir=r.run_dir,
                               train=sorted(tuple(p) for p in r.train), eval=sorted(tuple(p) for p in r.eval))
               for s, r in sorted(curves.get(b, {}).items())} for b in backends}
    stopped = {b: {s: diverged_at(r) if r.status == "ok" else None for s, r in raw[b].items()} for b in backends}
    runs = {b: {s: SeedRun(status=r.status, reason=r.reason, run_dir=r.run_dir,  # JSON has no NaN: None
                           train=[(int(i), int(n), _finite(v) if v is not None else None) for i, n, v in r.train],
                           eval=[(int(i), int(n), _finite(v) if v is not None else None) for i, n, v in r.eval])
                for s, r in raw[b].items()} for b in backends}
    all_seeds = sorted({s for b in backends for s in runs[b]})
    results, stops = {}, {}
    for b in backends:
        for s in all_seeds:
            runs[b].setdefault(s, SeedRun(status="missing", reason="no run of this seed"))
        runs[b] = dict(sorted(runs[b].items()))
        results[b], stops[b] = {}, {}
        for s, r in runs[b].items():
            stop = stopped[b].get(s)
            if stop is not None:
                notes.append(f"{b} diverged in seed {s} (from step {stop}): a result for {b}, counted in the "
                             "decision as an infinitely higher loss, never dropped")
            if r.status == "ok" and (stop is not None or any(_finite(v) is not None for *_, v in r.eval)):
                results[b][s], stops[b][s] = r, stop
            else:
                why = r.reason or ("no finite eval loss" if r.status == "ok" else "")
                notes.append(f"{b} seed {s} {r.status}{': ' + why if why else ''}: no quality result, so that "
                             "seed is out of the decision (a crash is not a divergence)")
    report = ConvergeReport(recipe=recipe, comparison=comparison, backends=backends, steps=steps,
                            eval_every=eval_every, samples_per_step=samples_per_step, level=level, margin=margin,
                            direction=direction, look=look, max_looks=max_looks, curves=runs,
                            speed={b: speed.get(b) or Speed(status="missing", reason="no speed measurement")
                                   for b in backends}, deliberate=dict(deliberate or {}),
                            settings_differences=list(settings_differences), notes=notes)
    report.points = _points(results, stops, report, backends)
    final = report.final
    if final is not None and final.step != steps:
        notes.append(f"the last eval point is step {final.step}, not the requested {steps}")
    for b in backends:
        warning = short_window(report.speed[b])
        if warning:
            notes.append(f"{b}: {warning}")
    if target is not None:
        report.target, report.target_source = float(target), "user"
    else:
        report.target, report.target_source = default_target(report)
    mean_curve = {b: [(p.step, p.samples, p.mean.get(b)) for p in report.points] for b in backends}
    report.targets = {b: side_target(b, {s: (None if stops[b][s] is not None else run.eval)
                                         for s, run in results[b].items()},
                                     mean_curve[b], report.target, report.speed[b], steps) for b in backends}
    tr, to = (report.targets[b] for b in backends)
    report.ips_contrast = _contrast(to.ips, tr.ips)
    report.time_contrast = _contrast(to.time_s, tr.time_s)
    bounds = ratio_interval(to, tr)
    if bounds:
        report.time_contrast_low, report.time_contrast_high = bounds
    report.curve_time_contrast = _contrast(to.curve_time_s, tr.curve_time_s)
    report.headline = shown.headline(report)
    return report


# --- outputs -------------------------------------------------------------------------------------

def write_outputs(report: ConvergeReport, out_dir: str | Path) -> dict[str, Path]:
    """converge.json, converge.png, converge.md (the chart by relative path), converge.csv (eval
    points with their statistics), curves.csv (every point), converge.html (self-contained); each
    written atomically. A chart that cannot be drawn is left out and named in the page's notes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    chart, paths = out_dir / "converge.png", {}
    try:
        paths["png"] = shown.write_chart(report, chart)
    except Exception as err:  # a report without its picture beats no report
        chart = None
        report.notes.append(f"chart not drawn: {type(err).__name__}: {err}")
    paths["json"] = report.save(out_dir)
    page = report.page(chart)
    for kind, name, text in (("markdown", "converge.md", to_markdown(page)),
                             ("csv", "converge.csv", shown.eval_csv(report)),
                             ("curves", "curves.csv", shown.curves_csv(report)), ("html", "converge.html", to_html(page))):
        write_text_atomic(out_dir / name, text)
        paths[kind] = out_dir / name
    return paths
