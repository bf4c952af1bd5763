"""Nightly runs: a suite, a history, regressions against the last nights, one HTML report.

``xfw nightly suites/h800_nightly.yaml --history /data/xfw-nightly`` runs every entry of the
suite on every backend, one run at a time, into a night directory, and appends each finished run
to the history (``xfw.report.history``) as soon as it finishes::

    /data/xfw-nightly/
        history.jsonl                       one row per (night, entry, backend, repeat); pandas reads it
        report.html                         the latest night's report (a copy)
        nights/2026-11-22/
            night.json                      suite, start/finish time, host, backends' versions
            tiny-llava-sft/torch/...        ordinary run directories
            llava-converge/                 a converge entry: xfw converge's directory (speed/<backend>/,
                                            seed-<s>/..., converge.json .md .html .png)
            nightly.json                    every verdict (xfw.report.verdicts.Verdict), for programs
            report.md  report.html  chart.png

Killed at any moment, a rerun of the same command resumes the unfinished night (if it started
less than ``RESUME_WITHIN_H`` hours ago): settled runs are kept, the run that was cut off runs
again, nothing is counted twice, and every file is replaced atomically.

Regressions: each (entry, backend) of the night is compared with the median of the same pair over
the previous ``window`` nights that measured the same workload (xfw.report.history.workload_fingerprint).
Throughput is flagged when it fell by more than ``max(ips_drop, noise_k × noise)``, where the noise
is the larger of the history's own scatter (1.4826 × MAD / median, once 3 nights exist) and the
standard error of this run's mean step ((p90 − p10) / 2.563 / median / √steps); memory
likewise with ``mem_growth`` and the history's scatter; a run that was ok and now is not is always
flagged. A converge entry (``converge:`` in the suite) runs :func:`xfw.run.commands.converge.run_converge` after
the ordinary entries; its speed runs are its history rows, with its final eval loss and time to target
beside them (``xfw.report.history.converge_fields``), and a quality regression is flagged like a speed
one (``xfw.report.verdicts.judge_quality``). The exit code is 1 when anything is flagged or failed, so
a scheduler can alert.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from xfw.contract import env as host
from xfw.run.launch import launcher
from xfw.report.converge import ConvergeReport
from xfw.report.converge import write_outputs as write_converge
from xfw.report.history import NIGHTS_DIR, History, converge_fields, row_from_result
from xfw.report.selfcheck import NIGHT_DIR as SELFCHECK_DIR
from xfw.report.verdicts import VERDICTS_FILE, Verdict, evaluate
from xfw.run.launch.jobs import Backends, Job, JobError, jobs_for, run_jobs, with_sibling_parts
from xfw.report.results import RunResult
from xfw.contract.atomic import read_json_object, write_json_atomic
from xfw.run.commands.converge import run_converge, speed_jobs_for
from xfw.recipe import PLAIN_NAME_RULE, is_plain_name
from xfw.run.commands.selfcheck import run_selfcheck
from xfw.run.commands.suite import Entry, Suite

NODE_WAIT_S = 300.0
"""How long node 0 waits for the other nodes' parts of a multi-node entry before recording its own."""
RESUME_WITHIN_H = 20.0
"""An unfinished night older than this is left as it is and a new night starts (the job of the
next evening should not continue yesterday's)."""


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _iso(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _read_json(path: Path) -> dict:
    try:
        value = read_json_object(path)
    except (OSError, ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return {}
    return value if isinstance(value, dict) else {}


def _started(state: dict) -> dt.datetime | None:
    try:
        return dt.datetime.strptime(state["started_utc"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    except (KeyError, TypeError, ValueError):
        return None


# -- which night --------------------------------------------------------------------------------
NIGHT_RULE = PLAIN_NAME_RULE


def is_night_name(night: str) -> bool:
    """Whether ``night`` may name a night: one plain directory name under ``--history/nights``, never
    ``..``, an absolute path or a path with a separator (``--night`` must not write outside ``--history``)."""
    return is_plain_name(night)


def choose_night(history_dir: Path, suite_name: str, requested: str | None = None,
                 now: dt.datetime | None = None) -> tuple[str, bool]:
    """(night id, resuming?). ``requested`` is used as given; otherwise the suite's latest night is
    resumed when it is unfinished and recent, else a new id is the UTC date (``.2``, ``.3`` when taken)."""
    now = now or _utc_now()
    nights_dir = history_dir / NIGHTS_DIR
    if requested is not None:
        if not is_night_name(requested):
            raise ValueError(f"night {requested!r}: {NIGHT_RULE}")
        return requested, (nights_dir / requested / "night.json").exists()
    states = [(_read_json(p), p.parent.name) for p in nights_dir.glob("*/night.json")]
    states = [(s, n) for s, n in states if s.get("suite") == suite_name and _started(s) is not None]
    if states:
        state, name = max(states, key=lambda item: _started(item[0]))
        started = _started(state)
        if not state.get("finished_utc") and 0 <= (now - started).total_seconds() < RESUME_WITHIN_H * 3600:
            return name, True
    base = now.strftime("%Y-%m-%d")
    name, k = base, 1
    while (nights_dir / name).exists():
        k += 1
        name = f"{base}.{k}"
    return name, False


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
    selfcheck: list = field(default_factory=list)
    """The suite's selfcheck verdicts (``xfw.report.selfcheck.Verdict``), when it has one."""
    converged: dict = field(default_factory=dict)
    """Converge entries run this night: label -> ``xfw.report.converge.ConvergeReport``."""
    skipped: list[str] = field(default_factory=list)
    """Why an entry did not run this night (a converge entry without both of its backends)."""

    @property
    def regressions(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.flagged]

    @property
    def failed_paths(self) -> list:
        return [v for v in self.selfcheck if v.verdict == "fail"]

    @property
    def exit_code(self) -> int:
        return 1 if self.regressions or self.failed_paths else 0


def start_night(history_dir: Path, suite: Suite, night: str, overrides: list[str],
                descriptions: dict[str, dict], now: dt.datetime | None = None) -> dict:
    """Create (or reread, when resuming) ``nights/<night>/night.json``."""
    night_dir = history_dir / NIGHTS_DIR / night
    state = _read_json(night_dir / "night.json")
    if not state:
        night_dir.mkdir(parents=True, exist_ok=True)
        state = {"night": night, "suite": suite.name, "suite_path": str(suite.path),
                 "started_utc": _iso(now or _utc_now()), "finished_utc": None, "overrides": list(overrides),
                 "suite_overrides": list(suite.overrides),
                 # Each entry's own ``set:`` (its overrides are the suite's, its own, then the command line's).
                 "entry_overrides": {e.label: list(e.overrides[len(suite.overrides):len(e.overrides) - len(overrides)])
                                     for e in suite.entries
                                     if len(e.overrides) > len(suite.overrides) + len(overrides)},
                 "env": host.host_env(), "backends": descriptions}
        write_json_atomic(night_dir / "night.json", state)
    return state


def run_night(suite: Suite, backends: Backends, history_dir: Path, *,
              night: str | None = None, overrides: list[str] = (), progress: launcher.Progress | None = None,
              log=print, now: dt.datetime | None = None,
              rendezvous: launcher.Rendezvous = launcher.Rendezvous()) -> NightOutcome:
    """Run (or resume) one night of ``suite``; returns the verdicts (report written by the caller).

    Multi-node entries (``parallel.nnodes > 1``) run first, on every node: each node starts this with
    its ``--node-rank`` and the same ``--night`` and ``--master-port`` on a shared history directory.
    Node 0 runs the single-node entries too, assembles each multi-node run from the nodes' parts and
    keeps the history; the other nodes only run their parts."""
    history, node_rank = History(history_dir), rendezvous.node_rank
    night, resuming = choose_night(history_dir, suite.name, night, now)
    night_dir = history_dir / NIGHTS_DIR / night
    state = start_night(history_dir, suite, night, list(overrides),
                        {name: description for name, (_, description) in backends.items()}, now) if node_rank == 0 \
        else {}
    entries = sorted(suite.entries, key=lambda e: e.recipe.parallel.nnodes == 1)  # multi-node first, same order everywhere
    converging = [e for e in entries if e.converge is not None and node_rank == 0]
    skipped = [f"{e.label}: a converge entry needs both {' and '.join(e.converge.backends)}; "
               f"this night runs {', '.join(backends)}" for e in converging
               if any(name not in backends for name in e.converge.backends)]
    converging = [e for e in converging if all(name in backends for name in e.converge.backends)]
    jobs, entry_of = [], {}
    for entry in entries:
        if (node_rank > 0 and entry.recipe.parallel.nnodes == 1) or entry.converge is not None:
            continue
        for job in jobs_for(entry.recipe, list(backends), night_dir, (entry.label,), label=entry.label,
                            # two entries of one recipe: keep their rows apart
                            variant={"entry": entry.label} if entry.label != entry.recipe.name else {},
                            node_rank=node_rank):
            jobs.append(job)
            entry_of[job.run_dir] = entry.label
    log(f"night {night} of suite {suite.name}: {len(jobs)} runs" + (f" on node {node_rank}" if node_rank else "")
        + (f" and {len(converging)} converge entr{'y' if len(converging) == 1 else 'ies'}" if converging else "")
        + (" (resuming: finished runs are kept)" if resuming else "") + f" -> {night_dir}")
    for line in skipped:
        log(f"skipped {line}")

    def record(job: Job, result: RunResult) -> None:  # after every run: a kill loses nothing finished
        if node_rank > 0:
            return  # node 0 keeps the history, with the assembled run
        result, note = with_sibling_parts(result, wait_s=NODE_WAIT_S, log=log)
        if note:
            log(note)
        history.upsert([row_from_result(result, launcher.spec_for(job.recipe, job.backend, job.run_dir),
                                        night=night, night_started_utc=state["started_utc"], suite=suite.name,
                                        entry=entry_of[job.run_dir],
                                        run_dir=str(Path(result.run_dir).relative_to(history_dir)))])

    checked = []
    if suite.selfcheck and node_rank == 0:  # first: the machine's settings paths, before any number of the night
        families, paths = suite.selfcheck
        log(f"selfcheck: {', '.join(families)} through {len(paths)} paths -> {night_dir / SELFCHECK_DIR}")
        checked = run_selfcheck(launcher.PROJECT_ROOT, list(families), list(paths), backends, night_dir / SELFCHECK_DIR,
                                progress=progress, log=log)
    # force: a resumed night reruns a run whose spec changed (new --set): the night is one suite's, not a user's
    results, kept = run_jobs(jobs, backends, resume=True, force=True, progress=progress, rendezvous=rendezvous,
                             log=log, on_result=record)
    if node_rank > 0:
        return NightOutcome(night=night, night_dir=night_dir, results=results, verdicts=[], kept=kept)
    converged = {}
    for entry in converging:  # after the ordinary entries: each is several runs per backend
        converged[entry.label], speed_results, entry_kept = run_converge_entry(
            entry, backends, night_dir, progress=progress, log=log)
        kept += entry_kept
        results += speed_results
        history.upsert(converge_rows(entry, converged[entry.label], speed_results, history_dir,
                                     night=night, night_started_utc=state["started_utc"], suite=suite.name))
    verdicts = evaluate(history.rows(), night, suite.regression)
    write_json_atomic(night_dir / VERDICTS_FILE, {
        "night": night, "suite": suite.name, "policy": asdict(suite.regression),
        "verdicts": [asdict(v) | {"flagged": v.flagged} for v in verdicts]})
    return NightOutcome(night=night, night_dir=night_dir, results=results, verdicts=verdicts, kept=kept,
                        selfcheck=checked, converged=converged, skipped=skipped)


def entry_variant(entry: Entry) -> dict:
    """What keeps two entries of one recipe apart in the night's table (their run directories already are)."""
    return {"entry": entry.label} if entry.label != entry.recipe.name else {}


def run_converge_entry(entry: Entry, backends: Backends, night_dir: Path, *, progress: launcher.Progress | None,
                       log) -> tuple[ConvergeReport, list[RunResult], int]:
    """Run one converge entry into ``night_dir/<label>/`` (xfw converge's layout) and write its converge.*
    files there; returns (its ConvergeReport, its speed runs' results, how many runs were kept).

    Resumed (the same night again), every settled run of the same settings is kept and each seed's start
    is exported only when it is missing or was exported for other settings. When a run of other
    settings is in the way (the night resumed with another ``--set``), it is replaced, as an ordinary
    entry's is: the night is the suite's, not a user's directory."""
    chosen, out_dir = entry.converge, night_dir / entry.label
    before = _settled_runs(out_dir)
    log(f"{entry.label}: converge, {len(chosen.seeds)} seeds x {chosen.steps} steps on {' vs '.join(chosen.backends)}"
        f" (eval every {chosen.eval_every} steps on {chosen.eval_samples} held-out samples) -> {out_dir}")
    try:
        report = run_converge(chosen, out_dir, backends, comparison=chosen.recipe.comparison, force=False,
                              progress=progress, log=log, variant=entry_variant(entry),
                              ordinary_speed=True)
    except JobError:  # runs of other settings there (or an adapter still running: refused again below)
        log(f"{entry.label}: runs of other settings in {out_dir} are replaced")
        report = run_converge(chosen, out_dir, backends, comparison=chosen.recipe.comparison, force=True,
                              progress=progress, log=log, variant=entry_variant(entry),
                              ordinary_speed=True)
    write_converge(report, out_dir)
    speed = [RunResult.load(job.run_dir) for job in speed_jobs_for(chosen, out_dir, entry_variant(entry))]
    kept = len(before & _settled_runs(out_dir))
    return report, speed, kept


def _settled_runs(out_dir: Path) -> set[tuple[str, float]]:
    """(summary path, modification time) of every run summary under ``out_dir``: which ones a command kept."""
    return {(str(p), p.stat().st_mtime) for p in out_dir.glob("**/summary.json")} if out_dir.is_dir() else set()


def converge_rows(entry: Entry, report: ConvergeReport, speed: list[RunResult], history_dir: Path, *, night: str,
                  night_started_utc: str, suite: str) -> list[dict]:
    """The history rows of one converge entry: its speed runs, each with the entry's curves' outcome."""
    chosen = entry.converge
    settings = {"seeds": list(chosen.seeds), "steps": chosen.steps, "eval_every": chosen.eval_every,
                "eval_samples": chosen.eval_samples, "target": chosen.target}
    converge_dir = str(Path(NIGHTS_DIR, night, entry.label))
    rows = []
    for result in speed:
        spec = launcher.spec_for(chosen.recipe, result.backend, Path(result.run_dir))
        row = row_from_result(result, spec, night=night, night_started_utc=night_started_utc, suite=suite,
                              entry=entry.label, run_dir=str(Path(result.run_dir).relative_to(history_dir)))
        rows.append(row | converge_fields(report, result.backend, settings, spec, converge_dir))
    return rows


def finish_night(outcome: NightOutcome, now: dt.datetime | None = None) -> None:
    """Mark the night finished (after its report is written): a rerun starts a new night."""
    path = outcome.night_dir / "night.json"
    state = _read_json(path)
    state["finished_utc"] = _iso(now or _utc_now())
    write_json_atomic(path, state)
