"""Convergence: do two backends reach the same eval loss from one start, and how long does each take?

``xfw converge`` trains every seed on both sides from one exported start on identical batches and
evaluates a held-out split every K steps; :func:`analyse` turns those curves and each side's ordinary
speed measurement into a :class:`ConvergeReport` (``converge.json``)::

    report = analyse(curves, speed, backends=("torch", "paddle"), recipe="recipes/x.yaml",
                     comparison="like-for-like", steps=300, eval_every=25, samples_per_step=64)
    report.headline   # ['paddle vs torch: ips +26%, time to target +31% (target 2.134, ...)', 'final eval loss: ...']
    write_outputs(report, "runs/converge")   # converge.json .md .csv .html .png, curves.csv

``backends[0]`` is the reference (it exported the start). Per eval point, each side's eval losses over
its ok seeds are compared by Welch's two-sample t-test (two-sided, at ``level``); a crashed seed is left
out and named. Samples to target are interpolated linearly between the two eval points around the
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
from xfw.report.parity import Tolerances
from xfw.report.table import Page, to_html, to_markdown

CONVERGE_SCHEMA = 1
CONVERGE_FILE = "converge.json"
TEST_NAME = "Welch's t-test, two-sided"
NO_SPREAD = "no spread: fewer than 2 seeds"

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


@dataclass
class Speed:
    status: str
    reason: str = ""
    run_dir: str = ""
    ips: float | None = None
    """Samples/s over the measured window (global)."""
    window_s: float | None = None


@dataclass(kw_only=True)
class PointStats:
    """One eval point: each side's eval losses over its ok seeds, and Welch's test between them."""
    step: int
    samples: int
    mean: dict[str, float | None]
    std: dict[str, float | None]
    """Sample standard deviation over seeds (ddof 1); None with fewer than 2."""
    n: dict[str, int]
    diff: float | None = None
    """mean(other) − mean(reference)."""
    rel_diff: float | None = None
    """diff / |mean(reference)|."""
    t: float | None = None
    """Welch's t of other against reference (> 0: other's loss higher); None when not tested."""
    df: float | None = None
    p: float | None = None
    verdict: str = ""
    worse: str | None = None
    separated: bool = False
    """p < level."""


@dataclass(kw_only=True)
class SeedTarget:
    seed: int
    samples: float | None
    """Samples seen when the eval loss first reached the target (interpolated); None: not reached."""
    time_s: float | None = None
    """samples / the side's ips."""
    final_eval_loss: float | None = None

    @property
    def reached(self) -> bool:
        return self.samples is not None


@dataclass(kw_only=True)
class SideTarget:
    backend: str
    ips: float | None
    seeds: list[SeedTarget] = field(default_factory=list)
    """The side's ok seeds."""
    mean_samples: float | None = None
    """Mean over the seeds that reached the target (``reached`` of ``len(seeds)``)."""
    time_s: float | None = None
    """mean_samples / ips; None when ips is missing or not every seed reached the target (``time_reason``)."""
    time_reason: str = ""
    curve_samples: float | None = None
    """Where the mean eval curve (the side's per-point means) first reaches the target."""
    curve_time_s: float | None = None

    @property
    def reached(self) -> int:
        return sum(s.reached for s in self.seeds)


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
    test: str = TEST_NAME
    curves: dict[str, dict[int, SeedRun]] = field(default_factory=dict)
    speed: dict[str, Speed] = field(default_factory=dict)
    points: list[PointStats] = field(default_factory=list)
    target: float | None = None
    target_source: str = ""
    """``user``, or ``reference mean final eval loss``; why there is none otherwise."""
    targets: dict[str, SideTarget] = field(default_factory=dict)
    ips_contrast: float | None = None
    """(ips other − ips reference) / ips reference: + is faster."""
    time_contrast: float | None = None
    """(time other − time reference) / time reference: + is slower."""
    curve_time_contrast: float | None = None
    headline: list[str] = field(default_factory=list)
    settings_differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def first_separation(self) -> PointStats | None:
        return next((p for p in self.points if p.separated), None)

    @property
    def final(self) -> PointStats | None:
        return self.points[-1] if self.points else None

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
                    first_separation={"step": first.step, "samples": first.samples, "p": first.p} if first else None)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ConvergeReport":
        data = {k: v for k, v in data.items() if k not in ("schema", "first_separation", "final_verdict")}
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
        data = read_json_object(Path(out_dir) / CONVERGE_FILE)
        if not data:
            raise FileNotFoundError(f"{Path(out_dir) / CONVERGE_FILE}: no convergence report")
        return cls.from_dict(data)

    def page(self, chart: Path | None = None) -> Page:
        """What a person reads (:func:`xfw.report.converge_plot.page`)."""
        from xfw.report.converge_plot import page

        return page(self, chart)


# --- analysis ------------------------------------------------------------------------------------

def _finite(value) -> float | None:
    return float(value) if value is not None and math.isfinite(float(value)) else None


def _normalise(backend: str, seed: int, run: SeedRun, notes: list[str]) -> SeedRun:
    """A copy with tuples, sorted by step, and a non-finite loss as None (named once per seed and kind)."""
    out = {}
    for kind in ("train", "eval"):
        raw = sorted(((int(s), int(n), v) for s, n, v in getattr(run, kind)), key=lambda p: p[0])
        out[kind] = [(s, n, _finite(v)) for s, n, v in raw]
        bad = [s for s, _, v in raw if v is not None and _finite(v) is None]
        if bad:
            notes.append(f"{backend} seed {seed}: {kind} loss not finite from step {bad[0]} "
                         f"({len(bad)} point{'s' if len(bad) > 1 else ''}), left out of those points")
    return SeedRun(status=run.status, reason=run.reason, run_dir=run.run_dir, **out)


def welch(reference: list[float], other: list[float], level: float, names: tuple[str, str]) -> dict:
    """Welch's two-sample t-test (two-sided) of ``other`` against ``reference``: t, df, p, verdict,
    worse, separated. No verdict with fewer than 2 values a side; with no spread on either side,
    equal means are indistinguishable and different ones leave the test undefined (never a NaN)."""
    from scipy import stats

    a, b = np.asarray(reference, float), np.asarray(other, float)
    out = {"t": None, "df": None, "p": None, "worse": None, "separated": False}
    if min(a.size, b.size) == 0:
        return {**out, "verdict": f"no eval loss on {names[0] if a.size == 0 else names[1]}"}
    if min(a.size, b.size) < 2:
        return {**out, "verdict": NO_SPREAD}
    diff = float(b.mean() - a.mean())
    if np.ptp(a) == 0 and np.ptp(b) == 0:
        if a[0] == b[0]:
            return {**out, "verdict": "indistinguishable (identical values on both sides)"}
        return {**out, "verdict": f"test undefined: no spread on either side, means differ by {abs(diff):.4g}"}
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = stats.ttest_ind(b, a, equal_var=False)
    t, p = _finite(result.statistic), _finite(result.pvalue)
    df = _finite((va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1)))
    if p is None:
        return {**out, "verdict": "test undefined (no finite p-value)"}
    out.update(t=t, df=df, p=p)
    if p >= level:
        return {**out, "verdict": "indistinguishable"}
    worse, better = (names[1], names[0]) if diff > 0 else (names[0], names[1])
    base = abs(float(a.mean() if worse == names[1] else b.mean()))
    rel = f" ({abs(diff) / base:.1%} above {better})" if base > 0 else ""
    return {**out, "worse": worse, "separated": True, "verdict": f"{worse} worse by {abs(diff):.4g}{rel}"}


REACH_REL = Tolerances().step_rel
"""A loss within this fraction of the target counts as reaching it: parity's tolerance for two losses
being the same loss (so a side equal to the reference up to rounding is not "never reached")."""


def samples_to_target(points: list[Point], target: float, rel: float = REACH_REL) -> float | None:
    """Samples seen when the loss first reaches ``target``: interpolated linearly between the eval points
    either side of the crossing, or the first eval point within ``rel`` × |target| above it (the same
    loss up to rounding); None when it never does."""
    prev = None
    for _, samples, loss in points:
        if loss is None:
            continue
        if loss <= target:
            if prev is None:
                return float(samples)
            s0, l0 = prev
            return s0 + (l0 - target) / (l0 - loss) * (samples - s0)
        if loss <= target + rel * abs(target):
            return float(samples)
        prev = (float(samples), loss)
    return None


def _stats(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else None


def _points(ok: dict[str, dict[int, SeedRun]], backends: tuple[str, str], level: float,
            samples_per_step: int) -> list[PointStats]:
    ref, other = backends
    by_step = {b: {} for b in backends}  # backend -> step -> [eval loss per seed]
    samples = {}
    for b in backends:
        for run in ok[b].values():
            for step, n, loss in run.eval:
                samples.setdefault(step, n)
                if loss is not None:
                    by_step[b].setdefault(step, []).append(loss)
    out = []
    for step in sorted(set(by_step[ref]) | set(by_step[other])):
        values = {b: by_step[b].get(step, []) for b in backends}
        mean, std = {}, {}
        for b in backends:
            mean[b], std[b] = _stats(values[b])
        diff = mean[other] - mean[ref] if mean[other] is not None and mean[ref] is not None else None
        rel = diff / abs(mean[ref]) if diff is not None and mean[ref] else None
        out.append(PointStats(step=step, samples=samples.get(step, step * samples_per_step), mean=mean, std=std,
                              n={b: len(values[b]) for b in backends}, diff=diff, rel_diff=rel,
                              **welch(values[ref], values[other], level, backends)))
    return out


def _side_target(backend: str, runs: dict[int, SeedRun], points: list[PointStats], target: float | None,
                 speed: Speed | None, steps: int) -> SideTarget:
    ips = _finite(speed.ips) if speed is not None and speed.status == "ok" and speed.ips is not None else None
    ips = ips if ips is not None and ips > 0 else None
    side = SideTarget(backend=backend, ips=ips)
    for seed, run in sorted(runs.items()):
        finals = [v for _, _, v in run.eval if v is not None]
        s = samples_to_target(run.eval, target) if target is not None else None
        side.seeds.append(SeedTarget(seed=seed, samples=s, time_s=s / ips if s is not None and ips else None,
                                     final_eval_loss=finals[-1] if finals else None))
    reached = [s.samples for s in side.seeds if s.reached]
    side.mean_samples = float(np.mean(reached)) if reached else None
    why = []
    if target is None:
        why.append("no target")
    elif not side.seeds:
        why.append("no seed ran to completion")
    elif len(reached) < len(side.seeds):
        why.append(f"only {len(reached)} of {len(side.seeds)} seeds reached the target in {steps} steps")
    if ips is None:
        why.append(no_speed(backend, speed))
    side.time_reason = "; ".join(why)
    if not why:
        side.time_s = side.mean_samples / ips
    if target is not None:
        side.curve_samples = samples_to_target([(p.step, p.samples, p.mean.get(backend)) for p in points], target)
        side.curve_time_s = side.curve_samples / ips if side.curve_samples is not None and ips else None
    return side


def no_speed(backend: str, speed: Speed | None) -> str:
    if speed is None:
        return f"no speed measurement for {backend}"
    return f"{backend} speed {speed.status}{': ' + speed.reason if speed.reason else ''}"


def _contrast(other: float | None, reference: float | None) -> float | None:
    return (other - reference) / reference if other is not None and reference else None


def pct(value: float) -> str:
    return f"{value:+.0%}" if abs(value) >= 0.1 else f"{value:+.1%}"


def fmt_p(p: float) -> str:
    return f"{p:.3g}" if p >= 0.001 else f"{p:.1e}"


def analyse(curves: dict[str, dict[int, SeedRun]], speed: dict[str, Speed], *, backends: tuple[str, str],
            recipe: str, comparison: str, steps: int, eval_every: int, samples_per_step: int,
            target: float | None = None, level: float = 0.05, settings_differences: list[str] = (),
            notes: list[str] = ()) -> ConvergeReport:
    """The convergence report from each side's seed runs and speed measurement (module docstring)."""
    backends = tuple(backends)
    notes = list(notes)
    runs = {b: {int(s): _normalise(b, int(s), r, notes) for s, r in sorted(curves.get(b, {}).items())}
            for b in backends}
    all_seeds = sorted({s for b in backends for s in runs[b]})
    ok = {}
    for b in backends:
        ok[b] = {s: r for s, r in runs[b].items() if r.status == "ok" and any(v is not None for *_, v in r.eval)}
        for s in all_seeds:
            if s not in runs[b]:
                runs[b][s] = SeedRun(status="missing", reason="no run of this seed")
        runs[b] = dict(sorted(runs[b].items()))
        for s, r in runs[b].items():
            if s not in ok[b]:
                why = r.reason or ("no finite eval loss" if r.status == "ok" else "")
                notes.append(f"{b} seed {s} {r.status}{': ' + why if why else ''}; "
                             f"statistics over {len(ok[b])} seed{'s' if len(ok[b]) != 1 else ''}")
    report = ConvergeReport(recipe=recipe, comparison=comparison, backends=backends, steps=steps,
                            eval_every=eval_every, samples_per_step=samples_per_step, level=level, curves=runs,
                            speed={b: speed.get(b) or Speed(status="missing", reason="no speed measurement")
                                   for b in backends},
                            points=_points(ok, backends, level, samples_per_step),
                            settings_differences=list(settings_differences), notes=notes)
    final = report.final
    if final is not None and final.step != steps:
        notes.append(f"the last eval point is step {final.step}, not the requested {steps}")
    if target is not None:
        report.target, report.target_source = float(target), "user"
    elif final is not None and final.mean[backends[0]] is not None:
        report.target, report.target_source = final.mean[backends[0]], "reference mean final eval loss"
    else:
        report.target_source = f"none: {backends[0]} has no final eval loss"
    report.targets = {b: _side_target(b, ok[b], report.points, report.target, report.speed[b], steps)
                      for b in backends}
    tr, to = (report.targets[b] for b in backends)
    report.ips_contrast = _contrast(to.ips, tr.ips)
    report.time_contrast = _contrast(to.time_s, tr.time_s)
    report.curve_time_contrast = _contrast(to.curve_time_s, tr.curve_time_s)
    from xfw.report.converge_plot import headline  # the words a person reads, with the page

    report.headline = headline(report)
    return report


# --- outputs -------------------------------------------------------------------------------------

def write_outputs(report: ConvergeReport, out_dir: str | Path) -> dict[str, Path]:
    """converge.json, converge.png, converge.md (the chart by relative path), converge.csv (eval
    points with their statistics), curves.csv (every point), converge.html (self-contained); each
    written atomically. A chart that cannot be drawn is left out and named in the page's notes."""
    from xfw.report.converge_plot import curves_csv, eval_csv, write_chart

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    chart, paths = out_dir / "converge.png", {}
    try:
        paths["png"] = write_chart(report, chart)
    except Exception as err:  # a report without its picture beats no report
        chart = None
        report.notes.append(f"chart not drawn: {type(err).__name__}: {err}")
    paths["json"] = report.save(out_dir)
    page = report.page(chart)
    for kind, name, text in (("markdown", "converge.md", to_markdown(page)), ("csv", "converge.csv", eval_csv(report)),
                             ("curves", "curves.csv", curves_csv(report)), ("html", "converge.html", to_html(page))):
        write_text_atomic(out_dir / name, text)
        paths[kind] = out_dir / name
    return paths
