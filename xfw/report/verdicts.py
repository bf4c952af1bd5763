"""Regression verdicts: each (entry, backend) of a night against the median of its last nights.

``evaluate(history_rows, night, policy)`` returns one :class:`Verdict` per metric (ips, memory,
or the run's status)::

    tiny-llava-sft / torch: ips 81.8 samples/s vs 344 (median of 2 nights), -76.2%, tolerance ±40.0% (floor 40%)

Throughput is flagged when it fell by more than ``max(ips_drop, noise_k × noise)``, where the noise
is the largest of the run-to-run spreads measured (the history's scatter, 1.4826 × MAD / median once
3 nights exist; the standard deviation / median of two nights; that of this night's repeats) and
the standard error of this run's mean step ((p90 − p10) / 2.563 / median / √steps); memory likewise
with ``mem_growth``, against nights that measured memory the same way (``memory_of``). A change
beyond the tolerance while no run-to-run spread is measured (one night of history, no repeats) is
``not enough history``, neither improvement nor regression: two runs of the same code on a shared
CPU differed threefold. A run that was ok and now is not is always flagged.
Only nights that measured the same workload (:func:`xfw.report.history.workload_fingerprint`)
are compared.

Quality (a converge entry's rows, :func:`xfw.report.history.converge_fields`): its final eval loss
(mean over seeds) is flagged when it rose above the median of the same entry's last nights (same
``quality_workload``: recipe and converge settings) by more than ``max(loss_rise, noise_k × noise)``,
the noise being the largest of the nights' scatter, the spread of two nights and tonight's standard
error of the mean over seeds (seed standard deviation / √n / loss); and a side is flagged when the
night's own Welch test at the final eval point names it worse than the other (``separation``), or
when one of its seeds did not run (``curves``). Every line says what it judges::

    quality: llava-json-converge / paddle: final eval loss 6.213 vs 4.201 (median of 2 nights), +47.9%, ...
    speed: tiny-llava-sft / torch: ips 81.8 samples/s vs 344 (median of 2 nights), -76.2%, ...
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from xfw.report.history import night_order

MIN_NIGHTS_FOR_SCATTER = 3
NOT_ENOUGH = "not enough history"
"""The verdict where a change is beyond the floor but no run-to-run spread is measured (one night of
history, no repeats): neither an improvement nor a regression."""
_Z90 = 2 * 1.2816  # p90 − p10 of a normal distribution, in sigmas
_QUIET_STATUSES = ("ok", "unsupported")  # not a failure of the night by themselves
VERDICTS_FILE = "nightly.json"


@dataclass(frozen=True, kw_only=True)
class RegressionPolicy:
    window: int = 7
    """Compare each run with the median of this many previous nights (fewer while history is short)."""
    min_nights: int = 1
    """Nights of history needed before anything is flagged."""
    ips_drop: float = 0.05
    """Smallest relative throughput drop flagged, whatever the noise."""
    mem_growth: float = 0.05
    """Smallest relative growth of peak memory flagged."""
    noise_k: float = 3.0
    """A change is flagged only beyond noise_k x the measured relative noise (see this module's docstring)."""
    loss_rise: float = 0.05
    """Smallest relative rise of a converge entry's final eval loss flagged (quality)."""


@dataclass(frozen=True, kw_only=True)
class Verdict:
    entry: str
    backend: str
    metric: str
    """``ips`` | ``memory`` | ``status`` (the run) | ``eval_loss`` (a converge entry's final eval loss against
    its nights) | ``separation`` (the night's own test between the sides) | ``curves`` (its seeds' runs)"""
    verdict: str
    """``regression`` | ``improvement`` | ``ok`` | ``new`` (no comparable history) | ``failed``
    (not ok, and not ok before either) | ``incomparable`` (the workload changed) | ``not enough history``
    (:data:`NOT_ENOUGH`) | ``untested`` (separation with fewer than 2 seeds a side)"""
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
    mem_source: str = ""
    """For memory verdicts: where the bytes come from (``cuda_allocator``, ``peak_rss``, ...)."""
    note: str = ""
    decision: dict | None = None
    """Where tonight has repeats and a throughput verdict is made: the decision model's view of them
    against the baseline (xfw.report.decision: interval, n, margin = the policy's floor), as a dict."""

    @property
    def flagged(self) -> bool:
        return self.verdict in ("regression", "failed")

    @property
    def kind(self) -> str:
        """What is judged: ``speed`` (ips), ``memory``, ``status`` (the run) or ``quality`` (a converge entry)."""
        return {"ips": "speed", "memory": "memory", "status": "status"}.get(self.metric, "quality")

    def line(self) -> str:
        """One line a person reads at the top of the report, led by what it judges (:attr:`kind`)."""
        return f"{self.kind}: {self._line()}"

    def _line(self) -> str:
        head = f"{self.entry} / {self.backend}"
        if self.metric in ("status", "separation", "curves"):
            return f"{head}: {self.note}"
        if self.metric == "eval_loss":
            if self.value is None:
                return f"{head}: final eval loss: {self.note}"
            text = f"{head}: final eval loss {self.value:.4g}"
            if self.baseline is not None:
                text += (f" vs {self.baseline:.4g} (median of {self.baseline_nights} night"
                         f"{'s' if self.baseline_nights != 1 else ''}), {self.change:+.1%}, "
                         f"tolerance ±{self.tolerance:.1%} ({self.noise_source})")
            return text + (f"; {self.note}" if self.note else "")
        unit = "samples/s" if self.metric == "ips" else "MiB"
        scale = 1.0 if self.metric == "ips" else 1 / 2**20
        text = f"{head}: {self.metric} {self.value * scale:.4g} {unit}"
        if self.baseline is not None:
            text += (f" vs {self.baseline * scale:.4g} (median of {self.baseline_nights} night"
                     f"{'s' if self.baseline_nights != 1 else ''}), {self.change:+.1%}, "
                     f"tolerance ±{self.tolerance:.1%} ({self.noise_source})")
        if self.decision:
            from xfw.report.decision import Decision

            text += "; tonight's repeats against that median: " + Decision.from_dict(self.decision).phrase(
                "the baseline", "tonight", worse="slower", better="faster")
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
        base["ips_repeats"], base["memory_repeats"] = ips, mems  # their spread is measured noise
        base["memory_source"] = memory_source_of(ok[0]) if ok else None
        out[key] = base
    return out


def memory_of(row: dict) -> float | None:
    """The measure both backends share (``Measurement.memory_bytes``: the CUDA allocator's peak on a
    GPU, the peak resident set on a CPU); a row written before it existed: its framework's peak
    allocated, else reserved (its source: :func:`memory_source_of`)."""
    if row.get("memory_bytes") is not None:
        return row["memory_bytes"]
    value = row.get("mem_alloc_peak_bytes")
    return value if value is not None else row.get("mem_reserved_peak_bytes")


def memory_source_of(row: dict) -> str | None:
    return row.get("memory_source") if row.get("memory_bytes") is not None else row.get("mem_source")


def relative_scatter(values: list[float]) -> float | None:
    """1.4826 × MAD / median: a robust relative sigma of nightly values."""
    if len(values) < MIN_NIGHTS_FOR_SCATTER:
        return None
    med = statistics.median(values)
    if not med:
        return None
    return 1.4826 * statistics.median(abs(v - med) for v in values) / abs(med)


def relative_sd(values: list[float]) -> float | None:
    """Standard deviation / median of a few repeated values (two nights, a night's repeats): the
    run-to-run spread where there are too few for :func:`relative_scatter`; None with fewer than 2."""
    values = [v for v in values if v is not None]
    if len(values) < 2 or not statistics.median(values):
        return None
    return statistics.stdev(values) / abs(statistics.median(values))


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


def build_name(row: dict) -> str:
    """A night's build as a bisect names it: ``paddle@3.2.1`` (its version), the commit beside it."""
    build = row.get("build") or {}
    version = build.get("framework_version") or row.get("framework_version") or "?"
    commit = f" (commit {build['commit'][:12]})" if build.get("commit") else ""
    return f"{row['backend'].partition('@')[0]} {version}{commit}"


def bisect_note(entry: str, last_good: dict, current: dict) -> str:
    """The last good and the first bad night's builds, and the bisect that would search between them
    (docs/builds.md): each night as an instance of the interpreter it ran, the builds between to be added."""
    adapter = current["backend"].partition("@")[0]
    lines = [f"{adapter}@night-{row['night']}" + (f"={row['interpreter']}" if row.get("interpreter") else "")
             for row in (last_good, current)]
    return (f"last good night {last_good['night']}: {build_name(last_good)}; first bad night {current['night']}: "
            f"{build_name(current)}; to find the build: put the builds between them in order in a file, "
            f"first '{lines[0]}', last '{lines[1]}', and run `xfw bisect <{entry}'s recipe> --builds FILE "
            f"--good {lines[0].split('=')[0]} --bad {lines[1].split('=')[0]}`")


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
        same = [r for r in earlier if r.get("workload") == current.get("workload") and same_node_type(r, current)
                ][-policy.window:]
        verdicts.extend(_judge(entry, backend, current, same, earlier, policy))
        if isinstance(current.get("converge"), dict):  # a converge entry: its learning curves too
            verdicts.extend(judge_quality(entry, backend, current, earlier, policy))
    return verdicts


def same_node_type(row: dict, current: dict) -> bool:
    """A night is a baseline only if it measured on the same node type (a row from before node types were
    recorded has none, and is taken as the same)."""
    return row.get("node_type") is None or current.get("node_type") is None or row["node_type"] == current["node_type"]


def _num(value: float, digits: int = 4) -> str:
    return f"{value:.{digits}g}"


def judge_quality(entry: str, backend: str, current: dict, earlier: list[dict],
                  policy: RegressionPolicy) -> list[Verdict]:
    """A converge entry's quality verdicts (module docstring): its seeds' runs (``curves``, only when
    one did not run), its final eval loss against its last nights (``eval_loss``), and the night's own
    test between the sides (``separation``)."""
    base = dict(entry=entry, backend=backend)
    out = []
    if current.get("converge_status") not in (None, "ok"):
        out.append(Verdict(**base, metric="curves", verdict="failed",
                           note=f"not every seed ran: {current.get('converge_reason') or current['converge_status']}"))
    value, n = current.get("final_eval_loss"), current.get("final_eval_loss_n") or 0
    comparable = [r for r in earlier if isinstance(r.get("converge"), dict)]
    same = [r for r in comparable if r.get("quality_workload") == current.get("quality_workload")][-policy.window:]
    history = [r["final_eval_loss"] for r in same if r.get("final_eval_loss") is not None]
    loss = dict(**base, metric="eval_loss", value=value, baseline_nights=len(history))
    if value is None:
        last = next((r for r in reversed(same) if r.get("final_eval_loss") is not None), None)
        out.append(Verdict(**loss, verdict="regression" if last else "failed",
                           note=(f"had one on {last['night']}, none now" if last else "none")
                           + f" ({current.get('converge_verdict') or 'no eval point'}"
                           + (f"; {current['converge_reason']}" if current.get("converge_reason") else "") + ")"))
    elif len(history) < max(1, policy.min_nights):
        changed = comparable and not same
        note = ("the recipe or the converge settings changed since the last night: not compared" if changed else
                "no earlier night to compare with" if not comparable else
                f"{len(history)} comparable night(s) with a final eval loss, {max(1, policy.min_nights)} needed")
        out.append(Verdict(**loss, verdict="incomparable" if changed else "new", note=note))
    else:
        baseline = statistics.median(history)
        std = current.get("final_eval_loss_std")
        # The spread measured: the nights' scatter (3 or more), two nights', tonight's standard error over seeds.
        between = [(relative_scatter(history), f"scatter of {len(history)} nights"),
                   (relative_sd(history) if len(history) == 2 else None, "spread of 2 nights"),
                   (std / n ** 0.5 / abs(value) if std is not None and n >= 2 and value else None,
                    f"standard error over {n} seeds")]
        noise, source = max(((v, s) for v, s in between if v is not None), default=(0.0, "no noise estimate"))
        tolerance = max(policy.loss_rise, policy.noise_k * noise)
        change = (value - baseline) / abs(baseline) if baseline else 0.0
        verdict = "regression" if change > tolerance else "improvement" if -change > tolerance else "ok"
        note = _knob_note(current, same[-1]) if verdict != "ok" else ""
        if verdict != "ok" and all(v is None for v, _ in between):
            verdict = NOT_ENOUGH
            note = (f"{change:+.1%} is beyond the floor but no spread is measured yet (1 comparable night, one "
                    "seed): not called; give the entry 2 or more seeds or wait for a second night"
                    + (f"; {note}" if note else ""))
        source = f"{policy.noise_k:g}× {source}" if policy.noise_k * noise >= policy.loss_rise else \
            f"floor {policy.loss_rise:.0%}"
        out.append(Verdict(**{**loss, "baseline_nights": len(history)}, verdict=verdict, baseline=baseline,
                           change=change, tolerance=tolerance, noise=noise, noise_source=source, note=note))
    out.append(_separation(base, current))
    return out


def _separation(base: dict, current: dict) -> Verdict:
    """The night's own converge verdict at the final eval point (Welch's test over seeds): this side
    named worse than the other is a quality regression, whatever the history says."""
    backend, worse, text = base["backend"], current.get("converge_worse"), current.get("converge_verdict") or ""
    step, p = current.get("final_eval_step"), current.get("converge_p")
    where = f"at the final eval point{f' (step {step})' if step is not None else ''}"
    test = f"p = {_num(p, 3)}, Welch's t-test over seeds" if p is not None else "Welch's t-test over seeds"
    if worse == backend:
        return Verdict(**base, metric="separation", verdict="regression", value=current.get("final_eval_loss"),
                       note=f"worse than the other side {where}: {text} ({test})")
    if worse:
        return Verdict(**base, metric="separation", verdict="ok", value=current.get("final_eval_loss"),
                       note=f"{worse} is the worse side {where} ({test})")
    tested = p is not None or text.startswith("indistinguishable")
    return Verdict(**base, metric="separation", verdict="ok" if tested else "untested",
                   value=current.get("final_eval_loss"),
                   note=f"{text or 'no verdict'} {where}" + (f" ({test})" if p is not None else ""))


def _repeat_decision(repeats: list, baseline: float, margin: float) -> dict | None:
    """Tonight's repeats (two or more) against the nights' median as the one decision model phrases it
    (xfw.report.decision): the log ratio of each repeat to the median, margin = the policy's floor. The
    median is held fixed (its own spread is in the tolerance above), so this is context for the verdict,
    never a second verdict."""
    from xfw.report.decision import decide, log_ratios

    values = [r for r in repeats if isinstance(r, (int, float)) and r > 0]
    if len(values) < 2 or not baseline or not 0 < margin < 1:
        return None
    return decide(log_ratios([baseline] * len(values), values), margin=margin, higher_is_worse=False).to_dict()


def _judge(entry: str, backend: str, current: dict, same: list[dict], earlier: list[dict],
           policy: RegressionPolicy) -> list[Verdict]:
    base = dict(entry=entry, backend=backend)
    mem = {"mem_source": memory_source_of(current) or ""}  # the shared measure's source
    status = current["status"]
    last = same[-1] if same else None
    if status != "ok":
        if last is not None and last["status"] == "ok":
            return [Verdict(**base, metric="status", verdict="regression",
                            note=f"was ok on {last['night']}, now {status}: {current.get('reason', '')}; "
                                 + bisect_note(entry, last, current))]
        verdict = "ok" if status in _QUIET_STATUSES else "failed"
        return [Verdict(**base, metric="status", verdict=verdict, note=f"{status}: {current.get('reason', '')}")]
    if not same:
        other_node = [r for r in earlier if r.get("workload") == current.get("workload") and not same_node_type(r, current)]
        note = (f"earlier nights of this workload measured on another node type ({other_node[-1]['node_type']}; "
                f"this night: {current['node_type']}): not compared" if other_node else
                "the workload changed since the last night (model, batch, precision, parallel layout or steps): "
                "not compared" if earlier else "no earlier night to compare with")
        return [Verdict(**base, metric="ips", verdict="incomparable" if earlier else "new",
                        value=current.get("ips"), note=note)]
    good = [r for r in same if r["status"] == "ok"]
    knob_note = _knob_note(current, last)
    out = []
    for metric, floor, higher_is_better in (("ips", policy.ips_drop, True), ("memory", policy.mem_growth, False)):
        value = current.get(metric)
        # Memory measured another way (a history from before the shared measure) is no baseline.
        history = [r[metric] for r in good if r.get(metric) is not None
                   and (metric != "memory" or r.get("memory_source") == current.get("memory_source"))]
        if value is None or len(history) < policy.min_nights:
            out.append(Verdict(**base, **(mem if metric == "memory" else {}), metric=metric, verdict="new",
                               value=value, baseline_nights=len(history),
                               note=f"{len(history)} comparable night(s), {policy.min_nights} needed"))
            continue
        baseline = statistics.median(history)
        repeats = current.get(f"{metric}_repeats") or []
        # Run-to-run spread, measured: the nights' scatter (3 or more), two nights', tonight's repeats.
        between = [(relative_scatter(history), f"scatter of {len(history)} nights"),
                   (relative_sd(history) if len(history) == 2 else None, "spread of 2 nights"),
                   (relative_sd(repeats), f"spread of {len(repeats)} repeats")]
        own = step_scatter(current) if metric == "ips" else None
        candidates = between + [(own, "step-time standard error of this run")]
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
        note = knob_note if verdict != "ok" else ""
        if verdict == "regression" and good:
            note = "; ".join(n for n in (note, bisect_note(entry, good[-1], current)) if n)
        if verdict != "ok" and all(v is None for v, _ in between):
            # One night against one, no repeats: nothing measured says how far two runs differ by chance.
            verdict = NOT_ENOUGH
            note = (f"{change:+.0%} is beyond the {'floor' if tolerance == floor else 'tolerance'} but no run-to-run "
                    f"spread is measured yet ({len(history)} comparable night, no repeats): not called; "
                    "run with --repeat 3 or wait for a second night" + (f"; {knob_note}" if knob_note else ""))
        source = f"{policy.noise_k:g}× {source}" if policy.noise_k * noise >= floor else f"floor {floor:.0%}"
        out.append(Verdict(**base, **(mem if metric == "memory" else {}), metric=metric, verdict=verdict,
                           value=value, baseline=baseline,
                           baseline_nights=len(history), change=change, tolerance=tolerance, noise=noise,
                           noise_source=source, note=note,
                           decision=_repeat_decision(repeats, baseline, floor) if metric == "ips" else None))
    return out


def read_night_verdicts(night_dir: Path) -> dict:
    """A night's ``nightly.json`` checked against its shape (``xfw.report.readback.VERDICTS``); {} when
    the night has none. A damaged file raises UnreadableFile in one line naming the file and the key."""
    from xfw.report.readback import VERDICTS, read_checked

    return read_checked(night_dir / VERDICTS_FILE, VERDICTS,
                        hint="edited by hand? rerun the night with xfw nightly to write it again")


def load_verdicts(night_dir: Path) -> list[Verdict]:
    """The night's verdicts (:func:`read_night_verdicts`); [] when it has none."""
    fields = Verdict.__dataclass_fields__
    return [Verdict(**{k: v for k, v in d.items() if k in fields})
            for d in read_night_verdicts(night_dir).get("verdicts", [])]
