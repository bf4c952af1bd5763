"""Launching one backend's run as a subprocess with that backend's own interpreter.

Each backend ``NAME`` is the package ``xfw_NAME`` installed in its own environment. Its
interpreter is ``--python NAME=PATH`` when given, else ``<project>/.venv/NAME/bin/python``
(what ``make setup`` creates). The adapter describes itself (``--describe``: versions, device,
multi-process launcher), so the core builds every command without knowing any framework::

    .venv/torch/bin/python -m xfw_torch --spec RUN/spec.json --records RUN/steps.jsonl

The launcher tails ``steps.jsonl`` for live progress, enforces ``measure.timeout_s`` on the
whole process group, and classifies the outcome from records, exit code and stderr:
``ok | oom | timeout | crashed | unsupported | invalid``. It never raises for a failed run:
a failure is a result like any other, so the other backend's result is never lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from xfw.contract import env as host
from xfw.contract import lifeline
from xfw.contract import records as rec
from xfw.report.measure import summarize
from xfw.recipe import command
from xfw.run.launch import attached, described, instances, logparse
from xfw.recipe import Recipe
from xfw.recipe.overrides import backend_recipe
from xfw.recipe.spec import resolve_spec
from xfw.report.results import RunResult, mfu_fields, setup_from_spec
from xfw.contract.atomic import UnreadableFile, read_bounded, write_json_atomic

PROJECT_ROOT = Path(__file__).resolve().parents[3]
POLL_INTERVAL_S = 0.2
DESCRIBE_TIMEOUT_S = 180
KILL_GRACE_S = 10
RUN_ENV = {"PYTHONUNBUFFERED": "1"}  # added to the caller's environment for every backend process


def run_env(recipe: Recipe) -> dict[str, str]:
    """What a backend process gets on top of the caller's environment: RUN_ENV, plus the host
    thread count when the recipe sets ``measure.cpu_threads`` (honoured by both frameworks)."""
    threads = recipe.measure.cpu_threads
    extra = {} if threads is None else {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return {**RUN_ENV, **extra}
_OOM_PATTERNS = re.compile(r"out of memory|OutOfMemoryError|ResourceExhaustedError|CUDA error: out of memory", re.I)


class BackendError(RuntimeError):
    """A backend cannot be used at all (no interpreter, adapter not importable); one line."""


@dataclass(frozen=True)
class Backend:
    name: str
    """What reports call it: ``paddle``, or an instance ``paddle@3.2.0`` (xfw.run.launch.instances)."""
    python: str

    @property
    def adapter(self) -> str:
        return instances.adapter_of(self.name)

    @property
    def module(self) -> str:
        return f"xfw_{self.adapter}"


class Progress(Protocol):
    def started(self, backend: str, recipe: str, total_steps: int) -> None: ...
    def update(self, backend: str, new_records: list[dict]) -> None: ...
    def finished(self, result: RunResult) -> None: ...


def resolve_backend(name: str, interpreters: dict[str, str], root: Path = PROJECT_ROOT) -> Backend:
    """The interpreter of backend ``name``: ``--python NAME=PATH``, else ``.venv/NAME`` (a bare
    adapter) or the instance's own environment (built by ``instances.ensure_env`` beforehand, or
    the interpreter its ``=PATH`` gave)."""
    if "@" in name and name not in interpreters:
        try:
            instance = instances.parse(name)
        except instances.InstanceError as err:
            raise BackendError(str(err)) from None
        if instance.python or instance.built:
            python = instance.python or str(instances.env_dir(instance, root) / "bin" / "python")
            if not Path(python).exists():
                raise BackendError(f"backend {name!r}: its environment is not built ({python})")
            return Backend(instance.name, python)
    elif "@" not in name and not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise BackendError(f"backend name {name!r} must be lowercase letters, digits or _")
    if name in interpreters:
        python = Path(interpreters[name])
        if not python.exists():
            raise BackendError(f"--python {name}={python}: no such interpreter")
        if not python.is_file() or not os.access(python, os.X_OK):
            raise BackendError(f"--python {name}={python}: not an executable file")
        return Backend(name, str(python))
    python = root / ".venv" / name / "bin" / "python"
    known = instances.known_adapters(root)
    if not python.exists() and name not in known:
        raise BackendError(f"unknown backend {name!r} (known: {', '.join(known)}; an instance of one is "
                           f"ADAPTER@VERSION, or NAME with --python {name}=/path/to/python)")
    if not python.exists():
        raise BackendError(f"backend {name!r}: no interpreter at {python.relative_to(root)}; "
                           f"run `make setup` or pass --python {name}=/path/to/python")
    return Backend(name, str(python))


def adapter_task(backend: Backend, args: list[str], *, timeout_s: float, failed: str,
                 env: dict[str, str] | None = None) -> str:
    """Run ``python -m xfw_NAME ARGS`` for a side task (describe, export weights, probe modules) and
    return its stdout (``env``: its whole environment, else this process's). If it fails:
    BackendError "backend 'NAME': <failed> (<its last stderr line>)"."""
    from xfw.run.launch.task import TaskTimeout, run_task

    cmd = [backend.python, "-m", backend.module, *args]
    try:  # in a process group of its own, ended with everything it started (xfw.run.launch.task)
        code, stdout, stderr = run_task(cmd, timeout_s=timeout_s, env=env)
    except TaskTimeout:
        raise BackendError(f"backend {backend.name!r}: `{shlex.join(cmd)}` took over {timeout_s:g} s (ended, with "
                           "everything it started)") from None
    except OSError as err:
        raise BackendError(f"backend {backend.name!r}: cannot start {backend.python} "
                           f"({getattr(err, 'strerror', None) or err})") from None
    if code != 0:
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        raise BackendError(f"backend {backend.name!r}: {failed} ({last})")
    return stdout


def describe_backend(backend: Backend) -> dict:
    """Ask the adapter to describe itself; proves the interpreter can import it. The same question asked again
    in one test session is answered from :mod:`xfw.run.launch.described` (only when ``XFW_DESCRIBE_CACHE`` is set)."""
    kept = described.cache_file(backend.python, backend.module, PROJECT_ROOT / "adapters" / backend.adapter)
    if (answer := described.recall(kept)) is None:
        described.keep(kept, answer := _describe(backend))
    return answer


def _describe(backend: Backend) -> dict:
    stdout = adapter_task(backend, ["--describe"], timeout_s=DESCRIBE_TIMEOUT_S,
                          failed=f"{backend.python} cannot run {backend.module}")
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise BackendError(f"backend {backend.name!r}: --describe printed no JSON") from None


@dataclass(frozen=True)
class Rendezvous:
    """Where the processes of a multi-node run meet; passed through to the adapter's launcher."""

    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    """None: a free port on this host (single-node runs never collide with each other)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_command(backend: Backend, description: dict, recipe: Recipe, spec_path: Path, records_path: Path,
                  rendezvous: Rendezvous = Rendezvous()) -> list[str]:
    if recipe.num_processes == 1:
        head = [backend.python, "-m", backend.module]
    else:
        # Placeholders an adapter's launcher template may use. log_dir: paddle.distributed.launch
        # writes ./log unless told otherwise.
        values = {"python": backend.python, "nproc": recipe.parallel.nproc_per_node,
                  "nnodes": recipe.parallel.nnodes, "node_rank": rendezvous.node_rank,
                  "master_addr": rendezvous.master_addr, "master_port": rendezvous.master_port or _free_port(),
                  "log_dir": spec_path.parent / "launch_log"}
        head = [part.format(**values) for part in description["launcher"]]
    return head + ["--spec", str(spec_path), "--records", str(records_path)]


def invocation(backend: Backend, description: dict, recipe: Recipe, spec_path: Path, records_path: Path,
               rendezvous: Rendezvous = Rendezvous()) -> attached.Invocation:
    """What a run starts: xfw's adapter, or the command the recipe gives this backend (xfw.recipe.command)."""
    declared = command.command_of(recipe, backend.name)
    if declared is not None:
        return attached.invocation(declared, spec_path, records_path)
    env = dict(recipe.backends.get(backend.name, {}).get("env", {}))  # backends.NAME.env, for every rank
    return attached.Invocation(argv=build_command(backend, description, recipe, spec_path, records_path, rendezvous),
                               facts=description, interpreter=backend.python, env=env)


def _tail(path: Path, num_bytes: int = 8192) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - num_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "".join(c if c.isprintable() else " " for c in lines[-1][:300]) if lines else ""


def local_ranks(recipe: Recipe, rendezvous: Rendezvous) -> range:
    """The global ranks this node's processes run: all of them on one node, a slice on many."""
    if recipe.parallel.nnodes == 1:
        return range(recipe.num_processes)
    first = rendezvous.node_rank * recipe.parallel.nproc_per_node
    return range(first, first + recipe.parallel.nproc_per_node)


def classify(*, exit_code: int | None, timed_out: bool, records: list[dict], num_processes: int,
             stderr_tail: str, timeout_s: float) -> tuple[str, str]:
    """(status, one-line reason) for a finished process; ``num_processes``: the ranks it ran."""
    if timed_out:
        first = min((r["rank"] for r in records if r.get("kind") == "step"), default=0)
        done = sum(1 for r in records if r.get("kind") == "step" and r.get("rank") == first)
        return "timeout", f"exceeded measure.timeout_s = {timeout_s:g} s (rank {first} had finished {done} steps)"
    errors = [r for r in records if r.get("kind") == "error"]
    if errors:
        return errors[0]["status"], errors[0]["message"]
    ends = {r["rank"] for r in records if r.get("kind") == "end"}
    if len(ends) >= num_processes:
        # Seen with FSDP on gloo: every rank wrote all its records, then the process aborted at exit.
        note = "" if exit_code == 0 else f"finished, then exited with code {exit_code} (records complete)"
        return "ok", note
    # unsupported / invalid / oom only with the adapter's error record (above): an exit code alone
    # could come from anything (a wrapper script, an interpreter failing to start).
    if exit_code is not None and exit_code < 0:
        name = signal.Signals(-exit_code).name if -exit_code in signal.valid_signals() else str(-exit_code)
        return "crashed", f"killed by {name}" + (" (the kernel's OOM killer?)" if name == "SIGKILL" else "")
    last = _last_line(stderr_tail)
    hint = " (out of memory?)" if _OOM_PATTERNS.search(stderr_tail) and not _OOM_PATTERNS.search(last) else ""
    code = f"exit code {exit_code}{_signal_in(exit_code)}"
    text = f"{last}{hint} ({code})" if last else f"{code} with no records of an error"
    started = {r["rank"] for r in records if r.get("kind") == "start" and isinstance(r.get("rank"), int)}
    unended = sorted(started - ends)
    if unended and num_processes > 1:  # which rank went: a launcher's last line names neither rank nor signal
        steps = sum(1 for r in records if r.get("kind") == "step" and r.get("rank") == unended[0])
        text = (f"rank {', '.join(map(str, unended[:8]))} of {num_processes} ended without its end record "
                f"(rank {unended[0]} after {steps} steps); {text}")
    return "crashed", text


_ENDING_SIGNALS = {int(s) for s in (signal.SIGINT, signal.SIGABRT, signal.SIGBUS, signal.SIGKILL, signal.SIGSEGV,
                                     signal.SIGTERM)}


def _signal_in(exit_code: int | None) -> str:
    """``" (SIGTERM?)"`` where an exit code reads as a signal: 128 + N (a shell, a launcher's report) or
    256 − N (a process that exited with −N, as a byte); "" otherwise."""
    if exit_code is None or exit_code <= 128:
        return ""
    for number, how in ((exit_code - 128, "128 + "), (256 - exit_code, "256 − ")):
        if number in _ENDING_SIGNALS:
            return f", {how}{number}: {signal.Signals(number).name}?"
    return ""


def _tree(pid: int) -> set[str]:
    """``pid:start`` of every living process below ``pid``, whatever group or session it moved to."""
    return {ident for ident in map(lifeline.identity, lifeline.descendants(pid)) if not ident.endswith(":None")}


def _signal_all(proc: subprocess.Popen, started: set[str], sig: int) -> None:
    """``sig`` to the run's process group and to every process it started that is still the same process
    (a rank in a group or session of its own, an orphan the launcher left: reliability 23)."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, sig)
    for ident in started:
        if lifeline.is_alive(ident):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(ident.partition(":")[0]), sig)


def _stop(proc: subprocess.Popen, started: set[str] | None = None) -> None:
    """Terminate the whole process group (torchrun and its workers too), every process the run started
    outside it (``started``, and what is below it now), stopped ones included (SIGCONT after SIGTERM:
    a stopped process handles its SIGTERM only once continued; SIGKILL ends it in any state)."""
    everything = (started if started is not None else set()) | _tree(proc.pid)
    if started is not None:
        started |= everything
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5)):
        _signal_all(proc, everything, sig)
        if sig == signal.SIGTERM:
            _signal_all(proc, everything, signal.SIGCONT)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


TREE_SCAN_S = 1.0
"""How often the launcher notes the processes below a run (so one that leaves the group still ends with it)."""


def spec_for(recipe: Recipe, backend: str, run_dir: Path) -> dict:
    """The spec.json a run of ``recipe`` on ``backend`` in ``run_dir`` reads."""
    return resolve_spec(recipe, backend=backend, run_id=f"{run_dir.parent.name}/{run_dir.name}")


ADAPTER_FILE = "adapter.json"
"""In a run directory while its adapter runs: pid and start time of the adapter's process group."""


def running_adapter(run_dir: Path) -> dict | None:
    """The adapter an earlier command started in ``run_dir`` if it is still alive, else None."""
    try:
        data = json.loads(read_bounded(run_dir / ADAPTER_FILE, 1 << 20).decode("utf-8"))
        return data if lifeline.is_alive(data["process"]) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UnreadableFile):
        return None


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while an adapter ran; ``result`` is that run, recorded as cut off."""

    def __init__(self, result: "RunResult"):
        super().__init__()
        self.result = result


def launch(recipe: Recipe, backend: Backend, run_dir: Path, *, description: dict,
           progress: Progress | None = None, repeat_index: int = 0,
           rendezvous: Rendezvous = Rendezvous(), variant: dict | None = None) -> RunResult:
    """Run one backend on one recipe in ``run_dir``; always returns a RunResult, saved with
    ``variant`` (what the run measures beyond its recipe) in summary.json. An I/O error in the run
    directory (a full disk) makes the run ``crashed`` with the error as its reason, never an
    exception: the other runs go on. Ctrl-C or SIGTERM stops the adapter, records the run as cut
    off and raises :class:`Interrupted`."""
    spec = spec_for(recipe, backend.name, run_dir)
    recipe = backend_recipe(recipe, backend.name)  # this backend's own (its override applied: xfw.recipe.overrides)
    ranks = local_ranks(recipe, rendezvous)
    node = {} if recipe.parallel.nnodes == 1 else {"rank": rendezvous.node_rank, "count": recipe.parallel.nnodes,
                                                   "ranks": [ranks.start, ranks.stop - 1]}
    base = dict(backend=backend.name, recipe=recipe.name, preset=recipe.model.preset, stage=recipe.stage,
                repeat_index=repeat_index, run_dir=str(run_dir), variant=dict(variant or {}),
                setup=setup_from_spec(spec), node=node)
    t0, interrupted = time.monotonic(), False
    try:
        result, interrupted = _run(recipe, backend, run_dir, spec, description, progress, rendezvous, base)
    except OSError as err:
        where = err.filename or run_dir
        result = RunResult(**base, status="crashed", measurement=summarize([]),
                           reason=f"I/O error at {where}: {err.strerror or err}; this run's files may be incomplete",
                           wall_time_s=round(time.monotonic() - t0, 3))
        try:
            result.save(run_dir)
        except OSError:
            pass  # the summary is lost with the disk; the report still shows this run
    if progress:
        progress.finished(result)
    if interrupted:
        raise Interrupted(result)
    return result


def _run(recipe: Recipe, backend: Backend, run_dir: Path, spec: dict, description: dict,
         progress: Progress | None, rendezvous: Rendezvous, base: dict) -> tuple[RunResult, bool]:
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path, records_path = run_dir / "spec.json", run_dir / "steps.jsonl"
    write_json_atomic(spec_path, spec)
    run = invocation(backend, description, recipe, spec_path, records_path, rendezvous)
    env = {**host.host_env(), "interpreter": run.interpreter, "backend": run.facts}
    write_json_atomic(run_dir / "env.json", env)
    records_path.unlink(missing_ok=True)  # a rerun into the same directory starts clean
    cmd = run.argv
    timeout_s = recipe.measure.timeout_s
    needed = recipe.measure.warmup_steps + recipe.measure.steps
    # a log has one line per step, not per rank; a node of a multi-node run runs its own ranks only
    num_processes = 1 if run.log else len(local_ranks(recipe, rendezvous))
    log_lines = logparse.LogCounter(run.log, run_dir / f"{run.log.stream}.log") if run.log else None
    ended = attached.ending(run, records_path, num_processes)  # stopped once every rank ended (and a grace)
    if progress:  # steps per rank: every rank takes the same steps
        progress.started(backend.name, recipe.name, needed)

    tail, timed_out, interrupted, stopped = rec.RecordTail(records_path), False, False, False
    started: set[str] = set()  # pid:start of each process seen below the run (_stop, the end below)
    t0 = time.monotonic()
    with open(run_dir / "stdout.log", "wb") as out, open(run_dir / "stderr.log", "wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
                                cwd=run.cwd, env={**os.environ, **run_env(recipe), **run.env,
                                                  lifeline.ENV: lifeline.identity()})
        try:
            write_json_atomic(run_dir / ADAPTER_FILE, {"process": lifeline.identity(proc.pid), "command": cmd})
            scanned = 0.0
            while proc.poll() is None:
                if time.monotonic() - scanned >= TREE_SCAN_S:  # every process the run starts ends with it
                    started |= _tree(proc.pid)
                    scanned = time.monotonic()
                if time.monotonic() - t0 > timeout_s:
                    timed_out = True
                    _stop(proc, started)
                    break
                if (log_lines is not None and log_lines.poll() >= needed) or (ended is not None and ended.due()):
                    stopped = True
                    _stop(proc, started)
                    break
                if progress:
                    progress.update(backend.name, tail.poll())
                time.sleep(POLL_INTERVAL_S)
        except KeyboardInterrupt:
            interrupted = True
            _stop(proc, started)
        except BaseException:
            _stop(proc, started)  # an I/O error in this loop must not leave the adapter running
            raise
        finally:
            (run_dir / ADAPTER_FILE).unlink(missing_ok=True)
            # what the run left, in its group or outside it, stopped or not, ends with it (reliability 16, 23)
            _signal_all(proc, started | (_tree(proc.pid) if proc.poll() is None else set()), signal.SIGKILL)
    if progress:
        progress.update(backend.name, tail.poll())
    wall = time.monotonic() - t0
    attached.verified(run, records_path)  # records the probe did not write are not measurements
    if run.log is not None:
        logparse.write_records(run.log, log_lines.path, records_path, spec, exit_code=proc.returncode,
                               stopped=stopped, counter=log_lines)
    records = rec.load_records(records_path)
    stderr_tail = _tail(run_dir / "stderr.log")
    status, reason = classify(exit_code=proc.returncode, timed_out=timed_out, records=records,
                              num_processes=num_processes, stderr_tail=stderr_tail, timeout_s=timeout_s)
    if stopped and not run.attached and status == "ok":
        reason = (f"finished; its launcher had not exited {attached.ADAPTER_EXIT_GRACE_S:g} s after every rank's "
                  "end record, so xfw stopped it (records complete)")
    if run.attached:  # a command: its outcome said for a command
        status, reason = attached.refine(status, reason, exit_code=proc.returncode, records=records,
                                        stderr_line=_last_line(stderr_tail), stopped=stopped)
    if interrupted:
        status, reason = "crashed", "interrupted (Ctrl-C or SIGTERM); the same command runs it again"
    applied = rec.applied_settings(records)
    measurement = summarize(records)
    result = RunResult(**base, status=status, reason=reason, measurement=measurement, applied=applied,
                       **mfu_fields(spec, measurement, applied), env=env, exit_code=proc.returncode,
                       wall_time_s=round(wall, 3))
    result.save(run_dir)
    return result, interrupted
