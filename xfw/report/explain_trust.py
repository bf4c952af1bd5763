"""Whether an explanation can be trusted: the rows' sum held against the measured gap, each with its noise (the
verdict); what each explain process ran, held against its measured run's program; why the rows may miss (the
explain process ran at another speed, the hooks cost the sides differently); the profiler's cost per side::

    v = verdict(rows, ea, eb, gap, gap_noise, ("paddle", "torch"), diagnosis)   # v.reliable, v.why
    line, differs = program_check(ea)                                           # differs: [] when the same

The page that shows them is ``xfw.report.explain``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from xfw.report.explain_rows import Aligned, coverage, quartiles, runs_of, step_noise

SIZE_TOLERANCE = 0.25
"""How far the rows' sum may miss the measured gap beyond both noises (a share of the gap) and still explain it."""


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.2f}"


@dataclass
class Verdict:
    """Whether the rows explain the measured gap: the rows' sum against it, each with its noise."""

    reliable: bool
    rows_gap_s: float
    why: str = ""
    short: str = ""
    """``why`` in a few words (the chart's mark)."""


def _measured_noise(side) -> float:
    p10, p90 = getattr(side, "step_time_p10_s", None), getattr(side, "step_time_p90_s", None)
    return (p90 - p10) / 2 if p10 is not None and p90 is not None else 0.0


def verdict(rows: list[Aligned], ea: dict, eb: dict, gap: float | None, gap_noise: float,
            names: tuple[str, str], diagnosis: list[str]) -> Verdict:
    """Reliable when the measured gap is beyond its noise and the rows' sum has its sign and its size
    (within both noises and :data:`SIZE_TOLERANCE` of the gap)."""
    a, b = names
    rows_gap = sum(r.diff for r in rows)
    rows_noise = step_noise(ea) + step_noise(eb)
    said = (f"the rows' sum gives {a} − {b} {rows_gap * 1e3:+.2f} ms (±{rows_noise * 1e3:.2f}) against a measured "
            f"{'–' if gap is None else f'{gap * 1e3:+.2f}'} ms (±{gap_noise * 1e3:.2f})")
    why = short = ""
    allowed = rows_noise + gap_noise + SIZE_TOLERANCE * abs(gap or 0.0)
    if gap is None:
        why = short = "no measured gap"
    elif abs(gap) <= gap_noise:
        short = "the measured gap is inside its own noise"
        why = f"{short}: there is no difference to explain ({said})"
    elif abs(rows_gap) > rows_noise and (rows_gap > 0) != (gap > 0):
        short = "the rows' sum and the measured gap have opposite signs"
        why = f"the sign differs: {said}"
    elif abs(rows_gap - gap) > allowed:
        short = f"the rows' sum accounts for {rows_gap / gap:.0%} of the measured gap"
        why = (f"{short}: it misses the gap by {abs(rows_gap - gap) * 1e3:.2f} ms, more than both noises plus "
               f"{SIZE_TOLERANCE:.0%} of the gap allow ({allowed * 1e3:.2f} ms); {said}")
    if why and diagnosis:
        why += "; " + "; ".join(diagnosis)
    return Verdict(not why, rows_gap, why, short)


def _spread(values: list[float] | None, fallback: float) -> str:
    q1, q2, q3 = quartiles(values or [fallback])
    return f"{q2 * 1e3:.2f} ms (p25–p75 {q1 * 1e3:.2f}–{q3 * 1e3:.2f})"


def _cost(label: str, values: list[float] | None, fallback: float, side) -> str:
    """``label``'s step against the measured one; a factor only when it is above both spreads."""
    step, p10, p90 = side.step_time_median_s, side.step_time_p10_s, side.step_time_p90_s
    q1, q2, q3 = quartiles(values or [fallback])
    low, high = (p10 if p10 is not None else step), (p90 if p90 is not None else step)
    if q1 > high:
        return f"{label} step {_spread(values, fallback)}: ×{q2 / step:.2f} the measured step"
    if q3 < low:
        return (f"{label} step {_spread(values, fallback)}: faster than the measured step, so the explain process ran "
                "at another speed than the run; its cost cannot be read here")
    return f"{label} step {_spread(values, fallback)}: no cost above the measured step's spread"


def side_lines(name: str, explain: dict, side) -> str:
    step_s = side.step_time_median_s if side is not None else None
    if not step_s:
        return f"{name}: no measured step time"
    cov = coverage(explain, step_s)
    p10, p90 = side.step_time_p10_s, side.step_time_p90_s
    measured = f"measured step {_ms(step_s)} ms" + (f" (p10–p90 {_ms(p10)}–{_ms(p90)})" if p10 is not None else "")
    trace = Path(explain["path"]).with_name(explain["trace"])
    return (f"{name}: {measured}; coverage {cov:.0%} (module rows' sum / measured step); "
            f"{_cost('profiled', explain.get('profiler_steps_s'), explain['profiler_step_s'], side)}; "
            f"{_cost('hooked', explain.get('hooked_steps_s'), explain['hooked_step_s'], side)}; "
            f"a plain step in the explain process {_spread(explain.get('plain_steps_s'), explain['plain_step_s'])}; "
            f"trace: {trace}")


def _first_measured_hashes(run_dir: Path) -> list | None:
    """The first step record's micro-batch hashes (reading no further than that record)."""
    try:
        with open(run_dir / "steps.jsonl", encoding="utf-8") as f:
            for n, line in enumerate(f):
                if n > 64 or len(line) > 1_000_000:
                    return None
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("kind") == "step":
                    hashes = record.get("batch_hashes")
                    return hashes if isinstance(hashes, list) else None
    except OSError:
        return None
    return None


def program_check(explain: dict) -> tuple[str, list[str]]:
    """(what the explain process ran with, one line; the ways it differs from the measured run's program), every
    run's explain process held against its own run (``--repeat``: each difference named with its run)."""
    runs = runs_of(explain)
    line, differs = _program_check_one(runs[0])
    if len(runs) == 1:
        return line, differs
    for n, e in enumerate(runs[1:], start=2):
        differs += [f"run {n}: {d}" for d in _program_check_one(e)[1]]
    return f"{line} (run 1 of {len(runs)}; each run's explain process held against its own run)", differs


def _program_check_one(explain: dict) -> tuple[str, list[str]]:
    ran = explain.get("ran_with")
    if not isinstance(ran, dict):
        return "not recorded (an explain.json from before xfw recorded it)", ["what it ran with is not recorded"]
    run_dir = Path(explain["path"]).parent
    differs: list[str] = []
    try:
        spec = json.loads((run_dir / "spec.json").read_text(encoding="utf-8"))
        recorded = json.loads((run_dir / "env.json").read_text(encoding="utf-8")).get("interpreter")
    except (OSError, ValueError, AttributeError):
        spec, recorded = {}, None
    if recorded and recorded != ran.get("interpreter"):
        differs.append(f"interpreter {ran.get('interpreter')} (the run's: {recorded})")
    env = ran.get("env") or {}
    for key, value in (spec.get("backend_env") or {}).items():
        if env.get(key) != value:
            differs.append(f"{key}={env.get(key)!r} (the run's backends.<name>.env: {value!r})")
    threads = spec.get("measure", {}).get("cpu_threads")
    if threads is not None and env.get("OMP_NUM_THREADS") != str(threads):
        differs.append(f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS')!r} (measure.cpu_threads: {threads})")
    if spec and ran.get("knobs") != spec.get("backend_knobs", {}):
        differs.append(f"knobs {ran.get('knobs')} (the run's: {spec.get('backend_knobs')})")
    first = _first_measured_hashes(run_dir)
    same = "unknown" if not first or not ran.get("first_batch_hashes") else \
        "the measured run's" if first == ran["first_batch_hashes"] else "NOT the measured run's"
    if same.startswith("NOT"):
        differs.append("its first micro-batches are not the measured run's")
    shown = " ".join(f"{k}={v}" for k, v in env.items() if v is not None) or "none set"
    data = ran.get("data") or {}
    line = (f"interpreter {ran.get('interpreter')}; variables {shown}; knobs {ran.get('knobs') or '{}'}; "
            f"data {data.get('kind')}{' ' + str(data.get('fingerprint'))[:12] if data.get('fingerprint') else ''}, "
            f"first micro-batches {same}")
    return line, differs


def _diagnosis(names: tuple[str, str], sides: tuple, explains: tuple[dict, dict]) -> list[str]:
    """Why the rows may miss the measured gap: each side's explain process ran at another speed than its
    run, or the hooks cost the sides differently."""
    out = []
    for name, side, e in zip(names, sides, explains):
        plain = quartiles(e.get("plain_steps_s") or [e["plain_step_s"]])
        low = side.step_time_p10_s if side.step_time_p10_s is not None else side.step_time_median_s
        high = side.step_time_p90_s if side.step_time_p90_s is not None else side.step_time_median_s
        if low is not None and high is not None and (plain[0] > high or plain[2] < low):
            out.append(f"{name}'s explain process ran a plain step in {_ms(plain[1])} ms against {_ms(side.step_time_median_s)} "
                       f"ms measured (p10–p90 {_ms(low)}–{_ms(high)}): the host's load changed, run it again on a quiet machine")
    ratios = [quartiles(e.get("hooked_steps_s") or [e["hooked_step_s"]])[1]
              / max(quartiles(e.get("plain_steps_s") or [e["plain_step_s"]])[1], 1e-12) for e in explains]
    if abs(ratios[0] - ratios[1]) > 0.1:
        more = names[0] if ratios[0] > ratios[1] else names[1]
        out.append(f"the hooks' cost differs between the sides (hooked step ×{ratios[0]:.2f} the plain step on "
                   f"{names[0]}, ×{ratios[1]:.2f} on {names[1]}): small modules' rows are inflated more on {more}")
    return out
