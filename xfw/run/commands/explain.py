"""``xfw explain`` / ``xfw compare --explain``: after the runs, each side's adapter profiles a few
steps of the same spec in a process of its own (``--explain``, ``xfw.contract.explain``), never
inside a measured window; then the sides are aligned (``xfw.report.explain``)::

    found = explain_runs(results, backends, log=print)   # run_dir -> explain.json path, or why not
    # runs/.../tiny-llava-sft/{paddle,torch}/{explain.json, trace.json}

The profiled process runs the measured run's program: the interpreter the run recorded (env.json),
the same environment the launcher gave the run (the caller's, xfw's, ``measure.cpu_threads``'s thread
variables and the backend's own ``backends.<name>.env``), the same spec (knobs, batches). A run of a
command xfw attached to (``backends.<name>.command``) gets no module table: the hooks and the profiler
need xfw's own adapter; its step breakdown is whatever its probe recorded. A run of several processes is
not profiled (explain profiles one), and says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from xfw.contract import lifeline
from xfw.report.results import RunResult
from xfw.run.launch import jobs, launcher

EXPLAIN_FILE = "explain.json"
ATTACHED_NOTE = ("an attached command (backends.{backend}.command): module and category tables need xfw's own "
                 "adapter (its hooks and profiler run xfw's step); the step breakdown above is what the probe saw")


MANY_NOTE = ("{n} processes: explain profiles one process (its module hooks and profiler time one rank's step); "
             "this run's step breakdown is in its steps.jsonl")


def not_applicable(why: str) -> bool:
    """A run explain does not profile by construction (an attached command, several processes): not a failure."""
    return why.startswith(ATTACHED_NOTE.split("{")[0]) or "explain profiles one process" in why


def explain_env(spec: dict) -> dict[str, str]:
    """The environment the launcher gave the measured run (``launcher._run``: the caller's, ``run_env``'s
    and ``backends.<name>.env``, in that order), rebuilt from its spec.json."""
    threads = spec.get("measure", {}).get("cpu_threads")
    extra = {} if threads is None else {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    own = {str(k): str(v) for k, v in (spec.get("backend_env") or {}).items()}
    return {**os.environ, **launcher.RUN_ENV, **extra, **own, lifeline.ENV: lifeline.identity()}


def run_interpreter(run_dir: Path, backend: launcher.Backend) -> launcher.Backend:
    """The interpreter the measured run ran (its env.json), when it is still there; else ``backend``'s."""
    try:
        recorded = json.loads((run_dir / "env.json").read_text(encoding="utf-8")).get("interpreter")
    except (OSError, ValueError, AttributeError):
        return backend
    if isinstance(recorded, str) and os.path.isfile(recorded) and os.access(recorded, os.X_OK):
        return launcher.Backend(backend.name, recorded)
    return backend


def explain_run(result: RunResult, backend: launcher.Backend) -> tuple[Path | None, str]:
    """(explain.json, "") after the adapter profiled this run's spec, or (None, why not)."""
    run_dir = Path(result.run_dir)
    try:
        spec = json.loads((run_dir / "spec.json").read_text())
    except (OSError, ValueError) as err:
        return None, f"{run_dir / 'spec.json'}: cannot read ({err})"
    if not isinstance(spec, dict):
        return None, f"{run_dir / 'spec.json'}: not a spec"
    if "command" in spec.get("backend_knobs", {}):
        return None, ATTACHED_NOTE.format(backend=result.backend)
    processes = spec.get("derived", {}).get("num_processes", 1)
    if processes != 1:
        return None, MANY_NOTE.format(n=processes)
    path = run_dir / EXPLAIN_FILE
    timeout = float(spec.get("measure", {}).get("timeout_s", 600))
    try:
        launcher.adapter_task(run_interpreter(run_dir, backend),
                              ["--explain", str(path), "--spec", str(run_dir / "spec.json")],
                              timeout_s=timeout, failed="explain failed", env=explain_env(spec))
    except launcher.BackendError as err:
        return None, str(err)
    return path, ""


def explain_runs(results: list[RunResult], backends: jobs.Backends, log=lambda _line: None) -> dict[str, tuple]:
    """Every ok run profiled by its own adapter, one at a time, after all of them (with ``--repeat``, every
    repeat: the report takes each row across them): ``{run_dir: (explain.json or None, note)}``."""
    found = {}
    for result in results:
        if not result.ok or result.backend not in backends:
            continue
        run = f", run {result.repeat_index + 1}" if getattr(result, "repeat_index", 0) or \
            any(r.repeat_index for r in results if r.backend == result.backend) else ""
        log(f"[{result.backend}] {result.recipe}: profiling a few steps (explain{run})")
        found[result.run_dir] = explain_run(result, backends[result.backend][0])
    return found
