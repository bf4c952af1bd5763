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
flagged. The exit code is 1 when anything is flagged or failed, so a scheduler can alert.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from xfw.contract import env as host
from xfw.run import launcher
from xfw.report.history import NIGHTS_DIR, History, row_from_result
from xfw.report.selfcheck import NIGHT_DIR as SELFCHECK_DIR
from xfw.report.verdicts import VERDICTS_FILE, Verdict, evaluate
from xfw.run.jobs import Backends, Job, jobs_for, run_jobs, with_sibling_parts
from xfw.report.results import RunResult
from xfw.contract.atomic import write_json_atomic
from xfw.run.selfcheck import run_selfcheck
from xfw.run.recipe import PLAIN_NAME_RULE, is_plain_name
from xfw.run.suite import Suite

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
        value = json.loads(path.read_text(encoding="utf-8"))
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
    jobs, entry_of = [], {}
    for entry in entries:
        if node_rank > 0 and entry.recipe.parallel.nnodes == 1:
            continue
        for job in jobs_for(entry.recipe, list(backends), night_dir, (entry.label,), label=entry.label,
                            # two entries of one recipe: keep their rows apart
                            variant={"entry": entry.label} if entry.label != entry.recipe.name else {},
                            node_rank=node_rank):
            jobs.append(job)
            entry_of[job.run_dir] = entry.label
    log(f"night {night} of suite {suite.name}: {len(jobs)} runs" + (f" on node {node_rank}" if node_rank else "")
        + (" (resuming: finished runs are kept)" if resuming else "") + f" -> {night_dir}")

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
    verdicts = evaluate(history.rows(), night, suite.regression)
    write_json_atomic(night_dir / VERDICTS_FILE, {
        "night": night, "suite": suite.name, "policy": asdict(suite.regression),
        "verdicts": [asdict(v) | {"flagged": v.flagged} for v in verdicts]})
    return NightOutcome(night=night, night_dir=night_dir, results=results, verdicts=verdicts, kept=kept,
                        selfcheck=checked)


def finish_night(outcome: NightOutcome, now: dt.datetime | None = None) -> None:
    """Mark the night finished (after its report is written): a rerun starts a new night."""
    path = outcome.night_dir / "night.json"
    state = _read_json(path)
    state["finished_utc"] = _iso(now or _utc_now())
    write_json_atomic(path, state)
