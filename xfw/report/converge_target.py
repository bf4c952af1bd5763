"""Time to target for converge, with its uncertainty: samples to reach a target eval loss per seed,
each side's speed with an interval, and time = samples / ips as an interval combining both spreads.

* Samples to target are interpolated linearly between the eval points around the first crossing
  (:func:`samples_to_target`); their interval is the t interval of the mean over the side's seeds.
* ips comes from the side's own speed run (not the learning curves, which synchronise every step);
  its interval is the t interval over repeats when there are several, else over the window's steps
  (each step's samples / time: a within-run spread, which understates drift between runs — said so).
* Time to target's interval combines both on the log scale (half-widths in quadrature, the delta
  method): approximate, and only given when every seed of the side reached the target.

Nothing here imports the rest of the converge report (:mod:`xfw.report.converge` imports this).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from xfw.report.parity import Tolerances
from xfw.report.trust import MIN_WINDOW_S

Point = tuple[int, int, float | None]
REACH_REL = Tolerances().step_rel
"""A loss within this fraction of the target counts as reaching it: parity's tolerance for two losses
being the same loss (so a side equal to the reference up to rounding is not "never reached")."""
LEVEL = 0.95


@dataclass
class Speed:
    status: str
    reason: str = ""
    run_dir: str = ""
    ips: float | None = None
    """Samples/s over the measured window (global); the mean over repeats when there are several."""
    window_s: float | None = None
    """The measured window's length (the shortest of the repeats)."""
    ips_low: float | None = None
    ips_high: float | None = None
    """The 95% interval of ips (``spread``)."""
    spread: str = ""
    """Where the interval comes from: ``N repeats`` or ``N steps of one window``."""


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
    """The side's seeds with a quality result (a diverged seed never reaches the target)."""
    mean_samples: float | None = None
    """Mean over the seeds that reached the target (``reached`` of ``len(seeds)``)."""
    time_s: float | None = None
    """mean_samples / ips; None when ips is missing or not every seed reached the target (``time_reason``)."""
    time_low: float | None = None
    time_high: float | None = None
    """Time to target's approximate 95% interval (module docstring); None with fewer than 2 seeds."""
    time_reason: str = ""
    curve_samples: float | None = None
    """Where the mean eval curve (the side's per-point means) first reaches the target."""
    curve_time_s: float | None = None

    @property
    def reached(self) -> int:
        return sum(s.reached for s in self.seeds)


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


def t_interval(values: list[float], level: float = LEVEL) -> tuple[float, float] | None:
    """The t interval of the mean of ``values``; None with fewer than 2."""
    if len(values) < 2:
        return None
    from scipy import stats

    mean, se = statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))
    half = float(stats.t.ppf(0.5 + level / 2, len(values) - 1)) * se
    return mean - half, mean + half


def speed_of(windows: list[tuple[float, float, list[tuple[float, float]]]]) -> dict:
    """ips, its interval and where that comes from, from each repeat's (ips, window seconds, measured
    steps as (samples, seconds)): over repeats when there are 2 or more, else over the one window's steps."""
    ips = [w[0] for w in windows]
    if len(ips) >= 2:
        bounds, spread = t_interval(ips), f"{len(ips)} repeats"
    else:
        rates = [s / t for s, t in windows[0][2] if t > 0]
        step = t_interval([t for _, t in windows[0][2] if t > 0])  # the mean step time's interval
        per = statistics.fmean(s for s, _ in windows[0][2]) if windows[0][2] else None
        bounds = (per / step[1], per / step[0]) if step and per and step[0] > 0 else None
        spread = f"{len(rates)} steps of one window (within-run spread)"
    low, high = bounds if bounds else (None, None)
    return {"ips": statistics.fmean(ips), "ips_low": low, "ips_high": high, "spread": spread,
            "window_s": min(w[1] for w in windows)}


def short_window(speed: Speed) -> str:
    """A warning when ``speed``'s window is shorter than compare's minimum (:data:`MIN_WINDOW_S`)."""
    if speed.window_s is None or speed.window_s >= MIN_WINDOW_S:
        return ""
    return (f"its speed window is {speed.window_s:.2g} s, below compare's minimum of {MIN_WINDOW_S:g} s: "
            "give the recipe more measure.steps or measure.repeat")


def _log_half(low: float | None, high: float | None) -> float | None:
    return math.log(high / low) / 2 if low and high and low > 0 and high > 0 else None


def side_target(backend: str, finals: dict[int, list[Point] | None], mean_curve: list[Point], target: float | None,
                speed: Speed | None, steps: int) -> SideTarget:
    """One side's time to target. ``finals``: seed -> its eval points, or None for a diverged seed."""
    ips = speed.ips if speed is not None and speed.status == "ok" and speed.ips and speed.ips > 0 else None
    side = SideTarget(backend=backend, ips=ips)
    for seed, points in sorted(finals.items()):
        values = [v for _, _, v in points or [] if v is not None]
        s = samples_to_target(points, target) if target is not None and points is not None else None
        side.seeds.append(SeedTarget(seed=seed, samples=s, time_s=s / ips if s is not None and ips else None,
                                     final_eval_loss=values[-1] if values and points is not None else None))
    reached = [s.samples for s in side.seeds if s.reached]
    side.mean_samples = statistics.fmean(reached) if reached else None
    why = []
    if target is None:
        why.append("no target")
    elif not side.seeds:
        why.append("no seed ran to completion")
    elif not reached:
        why.append(f"no seed reached the target in {steps} steps")
    elif len(reached) < len(side.seeds):
        why.append(f"{len(side.seeds) - len(reached)} of {len(side.seeds)} seeds did not reach the target "
                   f"in {steps} steps")
    if ips is None:
        why.append(no_speed(backend, speed))
    side.time_reason = "; ".join(why)
    if not why:
        side.time_s = side.mean_samples / ips
        samples = t_interval(reached)
        h_s = _log_half(*samples) if samples and samples[0] > 0 else None
        h_i = _log_half(speed.ips_low, speed.ips_high)
        if h_s is not None and h_i is not None:
            half = math.hypot(h_s, h_i)
            side.time_low, side.time_high = side.time_s * math.exp(-half), side.time_s * math.exp(half)
    if target is not None:
        side.curve_samples = samples_to_target(mean_curve, target)
        side.curve_time_s = side.curve_samples / ips if side.curve_samples is not None and ips else None
    return side


def ratio_interval(other: SideTarget, reference: SideTarget) -> tuple[float, float] | None:
    """Time to target of ``other`` relative to ``reference`` (-1 ... : + is slower), approximate 95% interval."""
    if None in (other.time_s, reference.time_s, other.time_low, reference.time_low):
        return None
    half = math.hypot(_log_half(other.time_low, other.time_high), _log_half(reference.time_low, reference.time_high))
    ratio = other.time_s / reference.time_s
    return ratio * math.exp(-half) - 1, ratio * math.exp(half) - 1


def no_speed(backend: str, speed: Speed | None) -> str:
    if speed is None:
        return f"no speed measurement for {backend}"
    return f"{backend} speed {speed.status}{': ' + speed.reason if speed.reason else ''}"
