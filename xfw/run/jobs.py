"""The one job runner: every command that runs recipes (compare, sweep, maxbatch, nightly) goes
through :func:`run_jobs`, so a run directory is named, kept, launched and summarised one way.

A :class:`Job` is one (recipe, backend, repeat) with the directory it runs in and the variant it
measures (a sweep point, a max-batch probe, a nightly entry)::

    OUT/<recipe>/[<group>/...]<backend>[-r<k>]/{spec.json, env.json, steps.jsonl, summary.json, *.log}

With ``resume=True`` a directory whose ``summary.json`` records a settled outcome (:data:`SETTLED`)
for the very same spec is kept and not launched again; a run without a summary (killed mid-run),
one that ``crashed`` (Ctrl-C included), or one whose spec changed, runs again. The launcher writes
``summary.json`` once, with the job's variant in it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from xfw.report.results import RunResult
from xfw.run import launcher
from xfw.run.recipe import Recipe

SETTLED = ("ok", "oom", "unsupported", "invalid", "timeout")
"""Statuses a resumed command keeps; ``crashed`` (or no summary at all) is run again."""

Backends = dict[str, tuple[launcher.Backend, dict]]
"""Backend name -> (interpreter, its ``--describe`` answer), as :func:`xfw.workflow.prepare_backends` gives."""


def run_dir_for(root: Path, groups: tuple[str, ...], backend: str, repeat_index: int, num_repeats: int) -> Path:
    """``root/<groups...>/<backend>``, or ``<backend>-r<k>`` when the recipe repeats."""
    return root.joinpath(*groups, backend if num_repeats == 1 else f"{backend}-r{repeat_index}")


@dataclass(frozen=True, kw_only=True)
class Job:
    recipe: Recipe
    backend: str
    run_dir: Path
    variant: dict = field(default_factory=dict)
    """What this run measures beyond the recipe (``{"batch.micro": 8}``); written to summary.json."""
    repeat_index: int = 0
    label: str = ""
    """How log lines name the job (default: the run directory's last two parts)."""

    @property
    def name(self) -> str:
        return self.label or f"{self.run_dir.parent.name} / {self.run_dir.name}"


def jobs_for(recipe: Recipe, backends: list[str], root: Path, groups: tuple[str, ...] = (), *,
             variant: dict | None = None, label: str = "") -> list[Job]:
    """Every repeat of ``recipe`` on every backend, repeats outermost (so the sides alternate)."""
    repeats = recipe.measure.repeat
    return [Job(recipe=recipe, backend=name, run_dir=run_dir_for(root, groups, name, k, repeats),
                variant=dict(variant or {}), repeat_index=k,
                label=f"{label} / {name if repeats == 1 else f'{name}-r{k}'}" if label else "")
            for k in range(repeats) for name in backends]


def settled_result(run_dir: Path, spec: dict) -> RunResult | None:
    """The run in ``run_dir`` if it settled for this very spec, else None (run it again)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        old_spec = json.loads((run_dir / "spec.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or not isinstance(old_spec, dict) or summary.get("status") not in SETTLED:
        return None
    if {k: v for k, v in old_spec.items() if k != "run_id"} != {k: v for k, v in spec.items() if k != "run_id"}:
        return None
    return RunResult.load(run_dir)


def run_jobs(jobs: list[Job], backends: Backends, *, resume: bool, progress: launcher.Progress | None = None,
             rendezvous: launcher.Rendezvous = launcher.Rendezvous(), log: Callable[[str], None] = print,
             on_result: Callable[[Job, RunResult], None] | None = None) -> tuple[list[RunResult], int]:
    """Run the jobs one at a time (never side by side: they would share the machine); returns every
    result in job order and how many were kept from an earlier attempt. ``on_result`` is called
    after each job (the nightly history is written there, so a kill loses nothing finished)."""
    results, kept = [], 0
    for i, job in enumerate(jobs, 1):
        where = f"[{i}/{len(jobs)}] {job.name}" if len(jobs) > 1 else job.name
        backend, description = backends[job.backend]
        spec = launcher.spec_for(job.recipe, job.backend, job.run_dir)
        result = settled_result(job.run_dir, spec) if resume else None
        if result is not None:
            kept += 1
            log(f"{where}: {result.status}, kept from an earlier run")
            if result.variant != job.variant:  # killed after the launcher's summary, before ours (older xfw)
                result.variant = dict(job.variant)
                result.save(job.run_dir)
        else:
            log(where)
            result = launcher.launch(job.recipe, backend, job.run_dir, description=description, progress=progress,
                                     repeat_index=job.repeat_index, rendezvous=rendezvous, variant=job.variant)
        results.append(result)
        if on_result is not None:
            on_result(job, result)
    return results, kept
