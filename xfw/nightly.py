"""Nightly runs: a suite, a history, regressions against the last nights, one HTML report.

``xfw nightly suites/h800_nightly.yaml --history /data/xfw-nightly`` runs every entry of the
suite on every backend, one run at a time, into a night directory, and appends each finished run
to the history (``xfw.history``) as soon as it finishes::

    /data/xfw-nightly/
        history.jsonl                       one row per (night, entry, backend, repeat); pandas reads it
        report.html                         the latest night's report (a copy)
        nights/2026-11-22/
            night.json                      suite, start/finish time, host, backends' versions
            tiny-llava-sft/torch/...        ordinary run directories
            nightly.json                    every verdict (xfw.nightly.Verdict), for programs
            report.md  report.html  chart.png

Killed at any moment, a rerun of the same command resumes the unfinished night (if it started
less than ``RESUME_WITHIN_H`` hours ago): settled runs are kept, the run that was cut off runs
again, nothing is counted twice, and every file is replaced atomically.

Regressions: each (entry, backend) of the night is compared with the median of the same pair over
the previous ``window`` nights that measured the same workload (xfw.history.workload_fingerprint).
Throughput is flagged when it fell by more than ``max(ips_drop, noise_k × noise)``, where the noise
is the larger of the history's own scatter (1.4826 × MAD / median, once 3 nights exist) and the
standard error of this run's mean step ((p90 − p10) / 2.563 / median / √steps); memory
likewise with ``mem_growth`` and the history's scatter; a run that was ok and now is not is always
flagged. The exit code is 1 when anything is flagged or failed, so a scheduler can alert.
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from xfw import env as host
from xfw import launcher
from xfw.history import History, night_order, row_from_result
from xfw.recipe import resolve_spec
from xfw.results import RunResult, write_json_atomic
from xfw.suite import RegressionPolicy, Suite
from xfw.sweep import finished_result

RESUME_WITHIN_H = 20.0
"""An unfinished night older than this is left as it is and a new night starts (the job of the
next evening should not continue yesterday's)."""
NIGHTS_DIR = "nights"
MIN_NIGHTS_FOR_SCATTER = 3
_Z90 = 2 * 1.2816  # p90 − p10 of a normal distribution, in sigmas
_QUIET_STATUSES = ("ok", "unsupported")  # not a failure of the night by themselves


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _iso(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


# -- which night --------------------------------------------------------------------------------
def choose_night(history_dir: Path, suite_name: str, requested: str | None = None,
                 now: dt.datetime | None = None) -> tuple[str, bool]:
    """(night id, resuming?). ``requested`` is used as given; otherwise the suite's latest night is
    resumed when it is unfinished and recent, else a new id is the UTC date (``.2``, ``.3`` when taken)."""
    now = now or _utc_now()
    nights_dir = history_dir / NIGHTS_DIR
    if requested is not None:
        return requested, (nights_dir / requested / "night.json").exists()
    states = [(_read_json(p), p.parent.name) for p in nights_dir.glob("*/night.json")]
    states = [(s, n) for s, n in states if s.get("suite") == suite_name and s.get("started_utc")]
    if states:
        state, name = max(states, key=lambda item: item[0]["started_utc"])
        started = dt.datetime.strptime(state["started_utc"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
        if not state.get("finished_utc") and (now - started).total_seconds() < RESUME_WITHIN_H * 3600:
            return name, True
    base = now.strftime("%Y-%m-%d")
    name, k = base, 1
    while (nights_dir / name).exists():
        k += 1
        name = f"{base}.{k}"
    return name, False


# -- verdicts -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Verdict:
    entry: str
    backend: str
    metric: str
    """``ips`` | ``memory`` | ``status``"""
    verdict: str
    """``regression`` | ``improvement`` | ``ok`` | ``new`` (no comparable history) | ``failed``
    (not ok, and not ok before either) | ``incomparable`` (the workload changed)"""
    value: float | None = None
    baseline: float | None = None
    """Median of the comparable previous nights."""
    baseline_nights: int = 0
    change: float | None = None
    """(value − baseline) / baseline."""
    tolerance: float | None = None
    """Relative change allowed before flagging."""
    noise: float | None = None
    noise_source: str = ""
    note: str = ""

    @property
    def flagged(self) -> bool:
        return self.verdict in ("regression", "failed")

    def line(self) -> str:
        """One line a person reads at the top of the report."""
        head = f"{self.entry} / {self.backend}"
        if self.metric == "status":
            return f"{head}: {self.note}"
        unit = "samples/s" if self.metric == "ips" else "MiB"
        scale = 1.0 if self.metric == "ips" else 1 / 2**20
        text = f"{head}: {self.metric} {self.value * scale:.4g} {unit}"
        if self.baseline is not None:
            text += (f" vs {self.baseline * scale:.4g} (median of {self.baseline_nights} night"
                     f"{'s' if self.baseline_nights != 1 else ''}), {self.change:+.1%}, "
                     f"tolerance ±{self.tolerance:.1%} ({self.noise_source})")
        return text + (f"; {self.note}" if self.note else "")


def _per_night(rows: list[dict]) -> dict[tuple[str, str, str], dict]:
    """(night, entry, backend) -> one row, the repeats folded into their median ips and memory."""
    grouped: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["night"], row["entry"], row["backend"]), []).append(row)
    out = {}
    for key, group in grouped.items():
        ok = [r for r in group if r["status"] == "ok"]
        base = dict((ok or group)[0])
        ips = [r["ips"] for r in ok if r.get("ips") is not None]
        mems = [memory_of(r) for r in ok if memory_of(r) is not None]
        base["ips"] = statistics.median(ips) if ips else None
        base["memory"] = statistics.median(mems) if mems else None
        out[key] = base
    return out


def memory_of(row: dict) -> float | None:
    """Peak allocated where the framework reports it (CUDA, Paddle's host allocator, peak RSS), else reserved."""
    value = row.get("mem_alloc_peak_bytes")
    return value if value is not None else row.get("mem_reserved_peak_bytes")


def relative_scatter(values: list[float]) -> float | None:
    """1.4826 × MAD / median: a robust relative sigma of nightly values."""
    if len(values) < MIN_NIGHTS_FOR_SCATTER:
        return None
    med = statistics.median(values)
    if not med:
        return None
    return 1.4826 * statistics.median(abs(v - med) for v in values) / abs(med)


def step_scatter(row: dict) -> float | None:
    """Relative standard error of the run's mean step time: the sigma of one step (from its p10/p90
    step times) over the square root of the measured steps. It covers a short or jittery run
    while the history is too short to show its own scatter."""
    p10, p90, med = row.get("step_time_p10_s"), row.get("step_time_p90_s"), row.get("step_time_median_s")
    steps = row.get("num_measured_steps") or 1
    if None in (p10, p90, med) or med <= 0:
        return None
    return (p90 - p10) / _Z90 / med / steps ** 0.5


def _knob_note(current: dict, previous: dict) -> str:
    now, before = current.get("knobs") or {}, previous.get("knobs") or {}
    changed = sorted(set(now) | set(before))
    changed = [k for k in changed if now.get(k) != before.get(k)]
    if not changed:
        return ""
    return "knobs changed since the last comparable night: " + ", ".join(
        f"{k} {before.get(k, '–')} → {now.get(k, '–')}" for k in changed)


def evaluate(rows: list[dict], night: str, policy: RegressionPolicy) -> list[Verdict]:
    """Every (entry, backend) of ``night`` against the previous nights of ``rows`` (a history)."""
    folded = _per_night(rows)
    order = night_order(rows)
    if night not in order:
        return []
    previous_nights = order[:order.index(night)]
    verdicts = []
    for (n, entry, backend), current in sorted(folded.items()):
        if n != night:
            continue
        earlier = [folded[(p, entry, backend)] for p in previous_nights if (p, entry, backend) in folded]
        same = [r for r in earlier if r.get("workload") == current.get("workload")][-policy.window:]
        verdicts.extend(_judge(entry, backend, current, same, earlier, policy))
    return verdicts


def _judge(entry: str, backend: str, current: dict, same: list[dict], earlier: list[dict],
           policy: RegressionPolicy) -> list[Verdict]:
    base = dict(entry=entry, backend=backend)
    status = current["status"]
    last = same[-1] if same else None
    if status != "ok":
        if last is not None and last["status"] == "ok":
            return [Verdict(**base, metric="status", verdict="regression",
                            note=f"was ok on {last['night']}, now {status}: {current.get('reason', '')}")]
        verdict = "ok" if status in _QUIET_STATUSES else "failed"
        return [Verdict(**base, metric="status", verdict=verdict, note=f"{status}: {current.get('reason', '')}")]
    if not same:
        note = ("the workload changed since the last night (model, batch, precision, parallel layout or steps): "
                "not compared" if earlier else "no earlier night to compare with")
        return [Verdict(**base, metric="ips", verdict="incomparable" if earlier else "new",
                        value=current.get("ips"), note=note)]
    good = [r for r in same if r["status"] == "ok"]
    knob_note = _knob_note(current, last)
    out = []
    for metric, floor, higher_is_better in (("ips", policy.ips_drop, True), ("memory", policy.mem_growth, False)):
        value = current.get(metric)
        history = [r[metric] for r in good if r.get(metric) is not None]
        if value is None or len(history) < policy.min_nights:
            out.append(Verdict(**base, metric=metric, verdict="new", value=value, baseline_nights=len(history),
                               note=f"{len(history)} comparable night(s), {policy.min_nights} needed"))
            continue
        baseline = statistics.median(history)
        scatter = relative_scatter(history)
        own = step_scatter(current) if metric == "ips" else None
        candidates = [(scatter, f"scatter of {len(history)} nights"), (own, "step-time standard error of this run")]
        noise, source = max(((v, s) for v, s in candidates if v is not None), default=(0.0, "no noise estimate"))
        tolerance = max(floor, policy.noise_k * noise)
        change = (value - baseline) / baseline if baseline else 0.0
        worse = -change if higher_is_better else change
        if worse > tolerance:
            verdict = "regression"
        elif -worse > tolerance:
            verdict = "improvement"
        else:
            verdict = "ok"
        source = f"{policy.noise_k:g}× {source}" if policy.noise_k * noise >= floor else f"floor {floor:.0%}"
        out.append(Verdict(**base, metric=metric, verdict=verdict, value=value, baseline=baseline,
                           baseline_nights=len(history), change=change, tolerance=tolerance, noise=noise,
                           noise_source=source, note=knob_note if verdict != "ok" else ""))
    return out


# -- running a night ----------------------------------------------------------------------------
@dataclass
class NightOutcome:
    night: str
    night_dir: Path
    results: list[RunResult]
    verdicts: list[Verdict]
    kept: int
    """Runs kept from an earlier attempt at this night (interrupted, or rerun with --night)."""
    report_path: Path | None = None

    @property
    def regressions(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.flagged]

    @property
    def exit_code(self) -> int:
        return 1 if self.regressions else 0


def start_night(history_dir: Path, suite: Suite, night: str, overrides: list[str],
                descriptions: dict[str, dict], now: dt.datetime | None = None) -> dict:
    """Create (or reread, when resuming) ``nights/<night>/night.json``."""
    night_dir = history_dir / NIGHTS_DIR / night
    state = _read_json(night_dir / "night.json")
    if not state:
        night_dir.mkdir(parents=True, exist_ok=True)
        state = {"night": night, "suite": suite.name, "suite_path": str(suite.path),
                 "started_utc": _iso(now or _utc_now()), "finished_utc": None, "overrides": list(overrides),
                 "env": host.host_env(), "backends": descriptions}
        write_json_atomic(night_dir / "night.json", state)
    return state


def run_night(suite: Suite, backends: dict[str, tuple[launcher.Backend, dict]], history_dir: Path, *,
              night: str | None = None, overrides: list[str] = (), progress: launcher.Progress | None = None,
              log=print, now: dt.datetime | None = None) -> NightOutcome:
    """Run (or resume) one night of ``suite``; returns the verdicts (report written by the caller)."""
    history = History(history_dir)
    night, resuming = choose_night(history_dir, suite.name, night, now)
    state = start_night(history_dir, suite, night, list(overrides),
                        {name: description for name, (_, description) in backends.items()}, now)
    night_dir = history_dir / NIGHTS_DIR / night
    jobs = [(entry, k, name) for entry in suite.entries for k in range(entry.recipe.measure.repeat)
            for name in backends]
    log(f"night {night} of suite {suite.name}: {len(jobs)} runs"
        + (" (resuming: finished runs are kept)" if resuming else "") + f" -> {night_dir}")
    results, kept = [], 0
    for i, (entry, k, name) in enumerate(jobs, 1):
        backend, description = backends[name]
        run_dir = night_dir / entry.label / (name if entry.recipe.measure.repeat == 1 else f"{name}-r{k}")
        spec = resolve_spec(entry.recipe, backend=name, run_id=f"{run_dir.parent.name}/{run_dir.name}")
        result = finished_result(run_dir, spec)
        if result is not None:
            kept += 1
            log(f"[{i}/{len(jobs)}] {entry.label} / {run_dir.name}: {result.status}, kept")
        else:
            log(f"[{i}/{len(jobs)}] {entry.label} / {run_dir.name}")
            result = launcher.launch(entry.recipe, backend, run_dir, description=description, progress=progress,
                                     repeat_index=k)
        if entry.label != entry.recipe.name and result.variant != {"entry": entry.label}:
            result.variant = {"entry": entry.label}  # two entries of one recipe: keep their rows apart
            result.save(run_dir)
        results.append(result)
        history.upsert([row_from_result(result, spec, night=night, night_started_utc=state["started_utc"],
                                        suite=suite.name, entry=entry.label,
                                        run_dir=str(run_dir.relative_to(history_dir)))])
    verdicts = evaluate(history.rows(), night, suite.regression)
    write_json_atomic(night_dir / "nightly.json", {
        "night": night, "suite": suite.name, "policy": asdict(suite.regression),
        "verdicts": [asdict(v) | {"flagged": v.flagged} for v in verdicts]})
    return NightOutcome(night=night, night_dir=night_dir, results=results, verdicts=verdicts, kept=kept)


def finish_night(outcome: NightOutcome, now: dt.datetime | None = None) -> None:
    """Mark the night finished (after its report is written): a rerun starts a new night."""
    path = outcome.night_dir / "night.json"
    state = _read_json(path)
    state["finished_utc"] = _iso(now or _utc_now())
    write_json_atomic(path, state)


def load_verdicts(night_dir: Path) -> list[Verdict]:
    data = _read_json(night_dir / "nightly.json")
    fields = Verdict.__dataclass_fields__
    return [Verdict(**{k: v for k, v in d.items() if k in fields}) for d in data.get("verdicts", [])]
