"""The one job runner: every command that runs recipes (compare, sweep, maxbatch, nightly) goes
through :func:`run_jobs`, so a run directory is named, kept, launched and summarised one way.

A :class:`Job` is one (recipe, backend, repeat) with the directory it runs in and the variant it
measures (a sweep point, a max-batch probe, a nightly entry)::

    OUT/<recipe>/[<group>/...]<backend>[-r<k>]/{spec.json, env.json, steps.jsonl, summary.json, *.log}

With ``resume=True`` a directory whose ``summary.json`` records a settled outcome (:data:`SETTLED`)
for the very same spec is kept and not launched again; a run without a summary (killed mid-run) or
one that ``crashed`` (Ctrl-C included) runs again. The launcher writes ``summary.json`` once, with
the job's variant in it.

Nothing is overwritten by surprise: before anything launches, :func:`check_jobs` refuses a job
whose directory holds a run of another spec (unless ``force``), and a directory where an adapter of
an earlier command is still alive (an orphan of a killed xfw, ended by its lifeline within seconds).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol

from xfw.contract.atomic import UnreadableFile, read_json_object

from xfw.report.nodes import assemble_parts
from xfw.report.results import RunResult
from xfw.run.launch import instances, launcher
from xfw.recipe.overrides import backend_recipe
from xfw.recipe import Recipe

SETTLED = ("ok", "oom", "unsupported", "invalid", "timeout")
"""Statuses a resumed command keeps; ``crashed`` (or no summary at all) is run again."""

Backends = dict[str, tuple[launcher.Backend, dict]]
"""Backend name -> (interpreter, its ``--describe`` answer), as :func:`xfw.workflow.prepare_backends` gives."""


NODE_DIR = "node-{}"
"""A multi-node run's part from one node: ``<run dir>/node-<node rank>/``, itself a run directory."""


def run_dir_for(root: Path, groups: tuple[str, ...], backend: str, repeat_index: int, num_repeats: int,
                node_rank: int | None = None) -> Path:
    """``root/<groups...>/<backend>``, or ``<backend>-r<k>`` when the recipe repeats; with ``node_rank``
    (a multi-node recipe) the node's part below it: ``.../<backend>/node-<rank>``."""
    run_dir = root.joinpath(*groups, backend if num_repeats == 1 else f"{backend}-r{repeat_index}")
    return run_dir if node_rank is None else run_dir / NODE_DIR.format(node_rank)


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
    together: str = ""
    """Jobs with the same non-empty value run one after another, in their order, in one place (an A/B's
    alternated pairs: alternation only cancels drift on one machine); an executor keeps them on one node."""

    def __post_init__(self):  # an instance (paddle@3.2.0) runs with its adapter's knobs under its own
        object.__setattr__(self, "recipe", instances.fold(self.recipe, self.backend))

    @property
    def name(self) -> str:
        return self.label or f"{self.run_dir.parent.name} / {self.run_dir.name}"


def jobs_for(recipe: Recipe, backends: list[str], root: Path, groups: tuple[str, ...] = (), *,
             variant: dict | None = None, label: str = "", node_rank: int = 0, alternate: bool = False) -> list[Job]:
    """Every repeat of ``recipe`` on every backend, repeats outermost (so the sides alternate). A
    multi-node recipe's jobs are this node's parts (``node_rank``). ``alternate`` (an A/B): the jobs are
    ``together`` (one node, in this order, under any executor). Each job holds ``recipe`` as
    loaded; its backend's override (``backends.<name>.override``, which may change its repeats) is
    applied where it runs (``launcher.spec_for`` and ``launcher.launch``: :mod:`xfw.recipe.overrides`)."""
    node = node_rank if recipe.parallel.nnodes > 1 else None
    repeats = {name: backend_recipe(instances.fold(recipe, name), name).measure.repeat for name in backends}
    return [Job(recipe=recipe, backend=name, run_dir=run_dir_for(root, groups, name, k, repeats[name], node),
                variant=dict(variant or {}), repeat_index=k,
                label=f"{label} / {name if repeats[name] == 1 else f'{name}-r{k}'}" if label else "",
                together=str(root.joinpath(*groups)) if alternate else "")
            for k in range(max(repeats.values(), default=0)) for name in ab_order(backends, k, alternate)
            if k < repeats[name]]


def ab_order(backends: list[str], repeat_index: int, alternate: bool = True) -> list[str]:
    """The run order of one repeat. ``alternate`` (an A/B, xfw.report.ab): the first two backends A B, then
    B A, then A B, ... (A B B A A B: a drift during the command moves both sides of a pair alike), the
    others after them; else the given order every time."""
    head = backends[:2][::-1] if alternate and repeat_index % 2 else backends[:2]
    return head + backends[2:]


class JobError(ValueError):
    """A job cannot start without losing something; one line naming the directory."""


class JobsInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM: ``results`` holds every run that finished, the cut-off one last."""

    def __init__(self, results: list[RunResult]):
        super().__init__()
        self.results = results


ORPHAN_WAIT_S = 15.0
"""How long a check waits for an earlier command's adapter to end (its lifeline ends it within ~6 s)."""


def same_spec(old: dict, new: dict) -> bool:
    """Two specs equal but for their run ids (a run directory of this spec can be kept)."""
    return {k: v for k, v in old.items() if k != "run_id"} == {k: v for k, v in new.items() if k != "run_id"}


def _old_spec(run_dir: Path) -> dict:
    try:
        return read_json_object(run_dir / "spec.json")
    except UnreadableFile:
        return {"unreadable": True}


def check_jobs(jobs: list[Job], *, force: bool, adapters: bool | None = None) -> None:
    """Refuse (JobError) before anything launches: a job whose directory holds a run of another spec
    (unless ``force``), or one where an earlier command's adapter still runs after ORPHAN_WAIT_S.
    ``adapters`` (default: when the jobs run here, not through an executor): whether to look for such
    adapters at all. Under an executor the adapter seen is its job's, which the executor attaches to
    (a loopback cluster's job runs on this host: waiting for it would outlive the job and resubmit it)."""
    adapters = _EXECUTOR.get() is None if adapters is None else adapters
    different = [job.run_dir for job in jobs
                 if not force and (old := _old_spec(job.run_dir)) and
                 not same_spec(old, launcher.spec_for(job.recipe, job.backend, job.run_dir))]
    if different:
        more = f" (and {len(different) - 1} more)" if len(different) > 1 else ""
        raise JobError(f"{different[0]}{more} holds a run of other settings; choose another --out, or pass "
                       "--force to replace it")
    deadline = time.monotonic() + ORPHAN_WAIT_S
    for job in jobs if adapters else ():
        while (adapter := launcher.running_adapter(job.run_dir)) is not None:
            if time.monotonic() > deadline:
                raise JobError(f"{job.run_dir}: an adapter of an earlier command is still running there "
                               f"({adapter['process'].split(':')[0]}: {' '.join(adapter['command'][:4])} ...); "
                               "stop it first")
            time.sleep(0.5)


def foreign_recipes(out_dir: Path, names: list[str]) -> list[str]:
    """Recipes other than ``names`` with run directories under ``out_dir`` (an earlier command's)."""
    found = set()
    for spec_path in out_dir.rglob("spec.json") if out_dir.is_dir() else ():
        try:
            name = read_json_object(spec_path).get("name")
        except UnreadableFile:
            name = str(spec_path.parent)
        if name not in names:
            found.add(str(name))
    return sorted(found)


def settled_result(run_dir: Path, spec: dict) -> RunResult | None:
    """The run in ``run_dir`` if it settled for this very spec, else None (run it again)."""
    try:
        summary = read_json_object(run_dir / "summary.json")
        old_spec = read_json_object(run_dir / "spec.json")
    except UnreadableFile:
        return None
    if summary.get("status") not in SETTLED or not old_spec or not same_spec(old_spec, spec):
        return None
    result = RunResult.load(run_dir)
    return result if result.status in SETTLED else None


class Executor(Protocol):
    """Where jobs run when not here, one at a time (the default): :class:`xfw.run.launch.slurm.SlurmExecutor`.
    ``run`` runs every job it is given (none is settled yet) and returns their results in job order,
    calling ``on_result`` as each ends; Ctrl-C or SIGTERM cancels its own jobs and re-raises."""

    name: str

    def run(self, jobs: list[Job], backends: Backends, *, rendezvous: launcher.Rendezvous,
            log: Callable[[str], None], on_result: Callable[[Job, RunResult], None] | None
            ) -> list[RunResult]: ...


_EXECUTOR: contextvars.ContextVar[Executor | None] = contextvars.ContextVar("xfw_executor", default=None)


@contextlib.contextmanager
def executing(executor: Executor | None) -> Iterator[None]:
    """Every :func:`run_jobs` inside runs its jobs through ``executor`` (None: here, one at a time).
    The CLI sets it from ``--executor``, so no workflow knows where its jobs run."""
    token = _EXECUTOR.set(executor)
    try:
        yield
    finally:
        _EXECUTOR.reset(token)


def _run_elsewhere(executor: Executor, jobs: list[Job], backends: Backends, *, resume: bool,
                   rendezvous: launcher.Rendezvous, log: Callable[[str], None],
                   on_result: Callable[[Job, RunResult], None] | None) -> tuple[list[RunResult], int]:
    """:func:`run_jobs` through an executor: settled runs kept (``resume``), the rest handed over."""
    kept: dict[int, RunResult] = {}
    for i, job in enumerate(jobs):
        result = settled_result(job.run_dir, launcher.spec_for(job.recipe, job.backend, job.run_dir)) if resume else None
        if result is not None:
            kept[i] = result
            log(f"{job.name}: {result.status}, kept from an earlier run")
            if on_result is not None:
                on_result(job, result)
    todo = [i for i in range(len(jobs)) if i not in kept]
    finished: dict[int, RunResult] = {}

    def ended(job: Job, result: RunResult) -> None:
        finished[jobs.index(job)] = result
        if on_result is not None:
            on_result(job, result)

    try:
        executor.run([jobs[i] for i in todo], backends, rendezvous=rendezvous, log=log, on_result=ended)
    except KeyboardInterrupt:
        raise JobsInterrupted([r for i, r in sorted({**kept, **finished}.items())]) from None
    every = {**kept, **finished}
    return [every[i] for i in range(len(jobs))], len(kept)


def run_jobs(jobs: list[Job], backends: Backends, *, resume: bool, force: bool = False,
             progress: launcher.Progress | None = None, rendezvous: launcher.Rendezvous = launcher.Rendezvous(),
             log: Callable[[str], None] = print,
             on_result: Callable[[Job, RunResult], None] | None = None) -> tuple[list[RunResult], int]:
    """Check the jobs (:func:`check_jobs`), then run them one at a time (never side by side: they
    would share the machine); returns every result in job order and how many were kept from an
    earlier attempt. ``on_result`` is called after each job (the nightly history is written there,
    so a kill loses nothing finished). Ctrl-C or SIGTERM raises :class:`JobsInterrupted`. Inside
    :func:`executing` the jobs run through that executor instead (a Slurm cluster)."""
    executor = _EXECUTOR.get()
    check_jobs(jobs, force=force)
    if executor is not None:
        return _run_elsewhere(executor, jobs, backends, resume=resume, rendezvous=rendezvous, log=log,
                              on_result=on_result)
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
            try:
                result = launcher.launch(job.recipe, backend, job.run_dir, description=description,
                                         progress=progress, repeat_index=job.repeat_index, rendezvous=rendezvous,
                                         variant=job.variant)
            except launcher.Interrupted as stop:
                if on_result is not None:
                    on_result(job, stop.result)
                raise JobsInterrupted([*results, stop.result]) from None
        results.append(result)
        if on_result is not None:
            on_result(job, result)
    return results, kept


def with_sibling_parts(result: RunResult, *, wait_s: float, log: Callable[[str], None] = print
                       ) -> tuple[RunResult, str]:
    """One node's part of a multi-node run, assembled with the other nodes' parts when they are beside
    it (a shared directory: waits up to ``wait_s`` for them to finish); else the part itself, marked as
    one node's (a ``node`` variant key) with a note saying how to assemble. Other runs pass through."""
    if "rank" not in result.node:
        return result, ""
    run_dir = Path(result.run_dir).parent
    siblings = [run_dir / NODE_DIR.format(k) for k in range(result.node["count"])]
    if any(s.exists() for s in siblings if s != Path(result.run_dir)):  # a shared directory: the others write here
        log(f"waiting up to {wait_s:g} s for the other nodes' parts in {run_dir}")
        deadline = time.monotonic() + wait_s
        while not all((s / "summary.json").exists() for s in siblings) and time.monotonic() < deadline:
            time.sleep(1.0)
    parts = [RunResult.load(s) for s in siblings if (s / "summary.json").exists()]
    if len(parts) == result.node["count"]:
        return assemble_parts(parts), ""
    first, last = result.node["ranks"]
    result.variant = {**result.variant,
                      "node": f"{result.node['rank']} of {result.node['count']} (ranks {first}-{last})"}
    return result, (f"{result.recipe} / {result.backend}: node {result.node['rank']}'s part only (ranks {first}-{last}; "
                    "its ips counts them alone). When every node has finished: xfw assemble <each node's --out> "
                    "--out DIR")
