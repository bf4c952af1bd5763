"""The Slurm executor: each job of :func:`xfw.run.launch.jobs.run_jobs` becomes one ``sbatch`` job that runs
``python -m xfw.run.launch.slurm_job PAYLOAD`` from the same (shared) checkout and writes the ordinary run
directory; xfw watches the queue with ``squeue``/``scontrol``, never pickles anything, and keeps no
cluster configuration (the Slurm client commands find theirs, ``SLURM_CONF`` included). docs/slurm.md.

In the run directory: ``slurm-job.json`` (the payload: the recipe as plain data, the backend, its
interpreter), ``slurm-job.sh`` (the batch script), ``slurm.json`` (job id, submit time, Slurm's final
state and reason) and ``slurm-<id>.out``. The same command run again attaches to a job still queued or
running (its id in ``slurm.json``) and resubmits only a job that failed or was lost. A job Slurm ends
(cancelled, past its time limit, its node failed) is recorded with Slurm's own state and reason, never
as a finished run. Ctrl-C / SIGTERM cancels xfw's own jobs (``scancel``) and keeps what finished.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from xfw.contract.atomic import UnreadableFile, read_json_object, write_json_atomic
from xfw.recipe.schema import to_dict
from xfw.report.measure import summarize
from xfw.report.results import RunResult
from xfw.run.launch import launcher

POLL_S = 1.0
START_MARGIN_S = 120
"""Added to a recipe's ``measure.timeout_s`` for the default time limit: the job's own start-up."""
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")
ENDED_AS = {"CANCELLED": ("crashed", "cut off"), "TIMEOUT": ("timeout", "timeout"),
            "NODE_FAIL": ("crashed", "node failed"), "PREEMPTED": ("crashed", "cut off (preempted)"),
            "BOOT_FAIL": ("crashed", "node failed"), "OUT_OF_MEMORY": ("oom", "out of memory"),
            "DEADLINE": ("timeout", "timeout"), "FAILED": ("crashed", "job failed")}
"""Slurm's final job state -> (run status, what xfw calls it) for a job that did not complete."""


class SlurmError(ValueError):
    """Bad Slurm input found before anything was submitted; one line naming the option."""


class Detached(Exception):
    """``--detach``: the jobs (``job_ids``) and the report job after them are submitted; nothing to wait for."""

    def __init__(self, job_ids: list[str], report_id: str, command: list[str], where: Path):
        super().__init__(f"submitted Slurm job(s) {' '.join(job_ids)}")
        self.job_ids, self.report_id, self.command, self.where = job_ids, report_id, command, where


@dataclass(frozen=True)
class SlurmOptions:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int | None = None
    """``--time`` in minutes; None: the recipe's measure.timeout_s plus START_MARGIN_S."""
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    exclusive: bool = True
    sbatch_args: tuple[str, ...] = ()
    max_queued: int = 64
    constraint: str | None = None
    """``--constraint``: the node type/feature every job asks for (``h800``, ``h800&ib``)."""
    detach: bool = False
    """Submit every job and a report job after them (``afterany``), then return (:class:`Detached`)."""


def _cmd(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def check_cluster(options: SlurmOptions) -> dict:
    """The partition's facts (nodes); SlurmError when there is no Slurm here or no such partition."""
    if shutil.which("sbatch") is None or shutil.which("squeue") is None:
        raise SlurmError("--executor slurm: no sbatch/squeue on this machine (install Slurm's client commands "
                         "or run with --executor local)")
    name = options.partition
    argv = ["scontrol", "show", "partition", "-o"] + ([name] if name else [])
    done = _cmd(argv)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PartitionName=")]
    if name is None:  # the cluster's default partition
        lines = [line for line in lines if "Default=YES" in line] or lines[:1]
    if done.returncode != 0 or not lines:
        known = " ".join(sorted(set(_cmd(["sinfo", "-h", "-o", "%R"]).stdout.split())))
        raise SlurmError(f"--partition: no partition {name!r} on this cluster (it has: {known or 'none'})"
                         if name else f"--executor slurm: the cluster answered no partition ({done.stderr.strip()})")
    fields = dict(item.split("=", 1) for item in lines[0].split() if "=" in item)
    return {"name": fields.get("PartitionName"), "nodes": int(fields.get("TotalNodes", "1"))}


def check_jobs(options: SlurmOptions, partition: dict, recipes: list) -> None:
    """Refuse before any submission: a time limit below a recipe's own timeout, more nodes than the
    partition has."""
    for recipe in recipes:
        if options.time_min is not None and options.time_min * 60 < recipe.measure.timeout_s:
            raise SlurmError(f"--time: {options.time_min} min is below recipe {recipe.name}'s measure.timeout_s "
                             f"({recipe.measure.timeout_s:g} s); give at least {math.ceil(recipe.measure.timeout_s / 60)}")
        if recipe.parallel.nnodes > partition["nodes"]:
            raise SlurmError(f"--partition: {partition['name']} has {partition['nodes']} node(s); recipe "
                             f"{recipe.name} asks parallel.nnodes={recipe.parallel.nnodes}")


def sbatch_argv(options: SlurmOptions, recipe, label: str, run_dir: Path, runs: int = 1) -> list[str]:
    """The sbatch command line of one job of ``runs`` runs (pure: unit-tested); its script and output in
    ``run_dir``. ``--no-requeue``: a job whose node failed is recorded as such, never silently run again
    over its own run directory (the same command resubmits it)."""
    minutes = options.time_min or math.ceil((recipe.measure.timeout_s * runs + START_MARGIN_S) / 60)
    argv = ["sbatch", "--parsable", f"--job-name=xfw:{label}"[:120], f"--time={minutes}",
            f"--nodes={recipe.parallel.nnodes}", "--ntasks-per-node=1", "--no-requeue", f"--output={run_dir}/slurm-%j.out",
            f"--chdir={launcher.PROJECT_ROOT}"]
    argv += [f"--{key}={value}" for key, value in (("partition", options.partition), ("account", options.account),
                                                   ("qos", options.qos), ("gpus-per-node", options.gpus_per_node),
                                                   ("cpus-per-task", options.cpus_per_task),
                                                   ("constraint", options.constraint)) if value]
    argv += ["--exclusive"] if options.exclusive else []
    return argv + list(options.sbatch_args) + [str(run_dir / "slurm-job.sh")]


def _queue(job_ids: list[str]) -> dict[str, tuple[str, str, str]]:
    """Job id -> (state, reason, node list) of the given jobs still known to squeue."""
    if not job_ids:
        return {}
    done = _cmd(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i|%T|%r|%N"])
    found = {}
    for line in done.stdout.splitlines():
        job_id, state, reason, nodes = (line.split("|") + ["", "", ""])[:4]
        found[job_id.strip()] = (state.strip(), reason.strip(), nodes.strip())
    return found


def final_state(job_id: str) -> tuple[str, str]:
    """(JobState, Reason) of an ended job from ``scontrol show job`` ('' when Slurm forgot it)."""
    done = _cmd(["scontrol", "show", "job", "-o", job_id])
    fields = dict(item.split("=", 1) for item in done.stdout.split() if "=" in item)
    return fields.get("JobState", ""), fields.get("Reason", "")


def recorded_job(run_dir: Path) -> dict:
    try:
        return read_json_object(run_dir / "slurm.json")
    except UnreadableFile:
        return {}


class SlurmExecutor:
    """Runs :class:`xfw.run.launch.jobs.Job` s as Slurm jobs; the :class:`xfw.run.launch.jobs.Executor` interface."""

    name = "slurm"

    def __init__(self, options: SlurmOptions, log: Callable[[str], None] | None = None,
                 command: list[str] | None = None):
        self.options = options
        self.partition = check_cluster(options)
        self.log = log
        """Where the jobs' states go; None: the log each run_jobs call passes (compare passes a silent one)."""
        self.command = command or []
        """``--detach``: the xfw arguments the report job runs (this command without ``--detach``)."""

    def _existing(self, jobs: list, unit: list[int], backends: dict, live: dict) -> tuple[str | None, str]:
        """The job recorded for ``unit`` that this command takes over: (id, 'attached') while queued or running,
        (id, 'collect') when it ended while no xfw watched; (None, '') when it must be submitted."""
        record = recorded_job(jobs[unit[0]].run_dir)
        old = record.get("job_id") if all(recorded_job(jobs[i].run_dir).get("job_id") == record.get("job_id") and
                                          self._same_payload(jobs[i], backends) for i in unit) else None
        if old and old in live and live[old][0] in ACTIVE:
            return old, "attached"
        return (old, "collect") if old and "state" not in record else (None, "")

    def _detach(self, jobs: list, backends: dict, rendezvous, live: dict, log: Callable[[str], None]) -> None:
        """Submit every job not queued yet and the report job after all of them; raise :class:`Detached`."""
        ids = []
        for unit in units_of(jobs):
            old, _ = self._existing(jobs, unit, backends, live)
            ids.append(old or self._submit([jobs[i] for i in unit], backends, rendezvous))
            log(f"{unit_name(jobs, unit)}: Slurm job {ids[-1]}" + (" (already submitted)" if old else ""))
        where = Path(os.path.commonpath([str(job.run_dir.resolve()) for job in jobs]))
        script = where / "slurm-report.sh"
        script.write_text("#!/bin/sh\n# written by xfw (xfw/run/launch/slurm.py): after the runs' jobs, the same "
                          "command attaches to them and writes the report\n"
                          f"exec {shlex.quote(sys.executable)} -m xfw.cli {shlex.join(self.command)}\n")
        minutes = self.options.time_min or max(
            math.ceil((job.recipe.measure.timeout_s + START_MARGIN_S) / 60) for job in jobs)
        argv = ["sbatch", "--parsable", "--job-name=xfw:report", f"--time={3 * minutes}", "--nodes=1",
                "--ntasks=1", "--no-requeue", f"--dependency=afterany:{':'.join(dict.fromkeys(ids))}",
                f"--output={where}/slurm-report-%j.out", f"--chdir={Path.cwd()}"]
        argv += [f"--{key}={value}" for key, value in (("partition", self.options.partition),
                                                       ("account", self.options.account),
                                                       ("qos", self.options.qos)) if value]
        done = _cmd([*argv, str(script)], timeout=60)
        if done.returncode != 0:
            raise SlurmError(f"sbatch refused the report job: {done.stderr.strip().splitlines()[-1:] or ['no reason']}")
        raise Detached(list(dict.fromkeys(ids)), done.stdout.strip().split(";")[0], self.command, where)

    def run(self, jobs: list, backends: dict, *, rendezvous, log: Callable[[str], None],
            on_result: Callable | None) -> list[RunResult]:
        check_jobs(self.options, self.partition, [job.recipe for job in jobs])
        log = self.log or log
        live = _queue([recorded_job(job.run_dir).get("job_id", "") for job in jobs
                       if recorded_job(job.run_dir).get("job_id")])
        if self.options.detach and jobs:
            self._detach(jobs, backends, rendezvous, live, log)
        waiting, queued, results = units_of(jobs), {}, {}
        seen: dict[str, str] = {}
        try:
            while waiting or queued:
                while waiting and len(queued) < self.options.max_queued:
                    unit = waiting.pop(0)
                    name = unit_name(jobs, unit)
                    old, how = self._existing(jobs, unit, backends, live)
                    if how == "attached":
                        log(f"{name}: attached to Slurm job {old} ({live[old][0].lower()})")
                        queued[old] = unit
                    elif how == "collect":  # ended while no xfw watched (xfw killed, --detach): collect it
                        log(f"{name}: Slurm job {old} ended while no xfw watched it; collecting its run")
                        queued[old] = unit
                    else:
                        queued[self._submit([jobs[i] for i in unit], backends, rendezvous)] = unit
                states = _queue(list(queued))
                for job_id, unit in list(queued.items()):
                    state, reason, nodes = states.get(job_id, ("", "", ""))
                    said = f"{state.lower()} ({reason})" if state == "PENDING" else \
                        f"running on {nodes}" if state == "RUNNING" else state.lower()
                    if state in ACTIVE:
                        if seen.get(job_id) != said:
                            log(f"{unit_name(jobs, unit)}: Slurm job {job_id} {said}")
                            seen[job_id] = said
                        continue
                    del queued[job_id]
                    for i in unit:
                        results[i] = self._ended(jobs[i], job_id, log, together=len(unit) > 1)
                        if on_result is not None:
                            on_result(jobs[i], results[i])
                if queued:
                    time.sleep(poll_s())
        except KeyboardInterrupt:
            cancel = list(queued)
            if cancel:
                _cmd(["scancel", *cancel])
                log(f"interrupted: cancelled Slurm job(s) {' '.join(cancel)}; finished runs are kept")
            raise
        return [results[i] for i in range(len(jobs))]

    @staticmethod
    def _payload(job, backends: dict, rendezvous) -> dict:
        backend, description = backends[job.backend]
        run_dir = job.run_dir.resolve()
        return {"recipe": to_dict(job.recipe), "backend": backend.name, "python": backend.python,
                "description": description, "run_dir": str(run_dir), "repeat_index": job.repeat_index,
                "variant": job.variant, "checkout": str(launcher.PROJECT_ROOT),
                "rendezvous": {"master_port": rendezvous.master_port}}

    def _same_payload(self, job, backends: dict) -> bool:
        """The job recorded in the run directory runs this very job (same recipe, backend, interpreter,
        variant): only then is it attached to or collected instead of submitted again."""
        try:
            old = read_json_object(job.run_dir.resolve() / "slurm-job.json")
        except UnreadableFile:
            return False
        new = self._payload(job, backends, launcher.Rendezvous())
        new = json.loads(json.dumps(new))  # as read back (tuples become lists)
        return all(old.get(key) == new[key] for key in ("recipe", "backend", "python", "repeat_index", "variant"))

    def _submit(self, unit: list, backends: dict, rendezvous) -> str:
        """One Slurm job running ``unit`` (one job, or an A/B's jobs in their order) on one node."""
        for job in unit:
            run_dir = job.run_dir.resolve()
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "summary.json").unlink(missing_ok=True)  # a resubmitted job's old outcome is not its own
            write_json_atomic(run_dir / "slurm-job.json", self._payload(job, backends, rendezvous))
        where = job_dir(unit)
        script = where / "slurm-job.sh"
        # a multi-node recipe: one job of parallel.nnodes nodes, srun starts xfw's node part on each
        many = "srun --ntasks-per-node=1 --kill-on-bad-exit=1 " if unit[0].recipe.parallel.nnodes > 1 else ""
        payloads = " ".join(shlex.quote(str(job.run_dir.resolve() / "slurm-job.json")) for job in unit)
        script.write_text("#!/bin/sh\n# written by xfw (xfw/run/launch/slurm.py): "
                          f"{'one run' if len(unit) == 1 else f'{len(unit)} runs in this order'}, each an ordinary "
                          f"run directory\nexec {many}{shlex.quote(sys.executable)} -m xfw.run.launch.slurm_job {payloads}\n")
        name = unit[0].name if len(unit) == 1 else f"{where.name} (A/B)"
        argv = sbatch_argv(self.options, unit[0].recipe, name, where, runs=len(unit))
        done = _cmd(argv, timeout=60)
        if done.returncode != 0:
            raise SlurmError(f"sbatch refused {name}: {done.stderr.strip().splitlines()[-1:] or ['no reason']}")
        job_id = done.stdout.strip().split(";")[0]
        for job in unit:
            write_json_atomic(job.run_dir.resolve() / "slurm.json", {
                "job_id": job_id, "submitted_unix": time.time(), "sbatch": argv,
                **({"together": [str(j.run_dir.resolve()) for j in unit]} if len(unit) > 1 else {})})
        return job_id

    def _ended(self, job, job_id: str, log: Callable[[str], None], together: bool = False) -> RunResult:
        """The run of an ended job: its own summary when Slurm says it completed (or, in a job of several
        runs, when the run itself ended before the job did), else recorded with Slurm's state and reason
        (the summary's measurements kept)."""
        from xfw.run.launch.jobs import SETTLED  # here: xfw --help imports this module, not the report's

        run_dir = job.run_dir.resolve()
        state, reason = final_state(job_id)
        record = {**recorded_job(run_dir), "state": state, "reason": reason}
        write_json_atomic(run_dir / "slurm.json", record)
        try:
            result = RunResult.load(run_dir)
        except (UnreadableFile, OSError, KeyError, ValueError):
            result = None
        if result is not None and (state in ("COMPLETED", "") or (together and result.status in SETTLED)):
            log(f"{job.name}: Slurm job {job_id} done: {result.status}")
            return result
        status, called = ENDED_AS.get(state, ("crashed", "lost"))
        out = (run_dir.parent if together else run_dir) / f"slurm-{job_id}.out"
        last = out.read_text(errors="replace").strip().splitlines()[-1:] if out.exists() else []
        why = f"{called}: Slurm job {job_id} {state or 'left the queue without a result'}" + \
              (f" ({reason})" if reason and reason != "None" else "") + (f"; {last[0]}" if last else "")
        base = dict(backend=job.backend, recipe=job.recipe.name, preset=job.recipe.model.preset,
                    stage=job.recipe.stage, repeat_index=job.repeat_index, run_dir=str(run_dir),
                    variant=dict(job.variant))
        if result is None:
            result = RunResult(**base, status=status, reason=why, measurement=summarize([]))
        else:
            result.status, result.reason = status, why
        result.save(run_dir)
        log(f"{job.name}: {why}")
        return result


def units_of(jobs: list) -> list[list[int]]:
    """The Slurm jobs to submit, as lists of indices into ``jobs``: one each, but jobs ``together`` (an
    A/B's alternated pairs) in one, in their order (pure: unit-tested)."""
    units: list[list[int]] = []
    by_key: dict[str, list[int]] = {}
    for i, job in enumerate(jobs):
        if job.together and job.together in by_key:
            by_key[job.together].append(i)
            continue
        units.append([i])
        if job.together:
            by_key[job.together] = units[-1]
    return units


def unit_name(jobs: list, unit: list[int]) -> str:
    return jobs[unit[0]].name if len(unit) == 1 else \
        f"{Path(jobs[unit[0]].together).name} (A/B: {len(unit)} runs in one job)"


def job_dir(unit: list) -> Path:
    """Where a Slurm job's script and output go: the run directory, or for runs together their common parent."""
    return unit[0].run_dir.resolve() if len(unit) == 1 else Path(unit[0].together).resolve()


def poll_s() -> float:
    """Seconds between two looks at the queue: POLL_S, or ``XFW_SLURM_POLL_S`` (tests, a busy scheduler)."""
    try:
        return max(0.05, float(os.environ.get("XFW_SLURM_POLL_S", POLL_S)))
    except ValueError:
        return POLL_S
