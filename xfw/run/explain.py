"""``xfw explain`` / ``xfw compare --explain``: after the runs, each side's adapter profiles a few
steps of the same spec in a process of its own (``--explain``, ``xfw.contract.explain``), never
inside a measured window; then the sides are aligned (``xfw.report.explain``)::

    found = explain_runs(results, backends, log=print)   # run_dir -> explain.json path, or why not
    # runs/.../tiny-llava-sft/{paddle,torch}/{explain.json, trace.json}

A run of a command xfw attached to (``backends.<name>.command``) gets no module table: the hooks
and the profiler need xfw's own adapter; its step breakdown is whatever its probe recorded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from xfw.report.results import RunResult
from xfw.run import jobs, launcher

EXPLAIN_FILE = "explain.json"
ATTACHED_NOTE = ("an attached command (backends.{backend}.command): module and category tables need xfw's own "
                 "adapter (its hooks and profiler run xfw's step); the step breakdown above is what the probe saw")


def _env(spec: dict) -> dict[str, str]:
    """The run's own thread settings (``measure.cpu_threads``), as the launcher gave the run."""
    threads = spec.get("measure", {}).get("cpu_threads")
    extra = {} if threads is None else {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return {**os.environ, **launcher.RUN_ENV, **extra}


def explain_run(result: RunResult, backend: launcher.Backend) -> tuple[Path | None, str]:
    """(explain.json, "") after the adapter profiled this run's spec, or (None, why not)."""
    run_dir = Path(result.run_dir)
    try:
        spec = json.loads((run_dir / "spec.json").read_text())
    except (OSError, ValueError) as err:
        return None, f"{run_dir / 'spec.json'}: cannot read ({err})"
    if "command" in spec.get("backend_knobs", {}):
        return None, ATTACHED_NOTE.format(backend=result.backend)
    path = run_dir / EXPLAIN_FILE
    timeout = float(spec.get("measure", {}).get("timeout_s", 600))
    try:
        launcher.adapter_task(backend, ["--explain", str(path), "--spec", str(run_dir / "spec.json")],
                              timeout_s=timeout, failed="explain failed", env=_env(spec))
    except launcher.BackendError as err:
        return None, str(err)
    return path, ""


def explain_runs(results: list[RunResult], backends: jobs.Backends, log=lambda _line: None) -> dict[str, tuple]:
    """Every ok run profiled by its own adapter, one at a time: ``{run_dir: (explain.json or None, note)}``."""
    found = {}
    for result in results:
        if not result.ok or result.backend not in backends:
            continue
        log(f"[{result.backend}] {result.recipe}: profiling a few steps (explain)")
        found[result.run_dir] = explain_run(result, backends[result.backend][0])
    return found
