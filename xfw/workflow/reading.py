"""The commands that read what ran, or launch nothing: ``report``, ``assemble``, ``estimate``,
``env`` and ``selfcheck`` (which runs its own small checks through the same guard).
"""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

from xfw.contract.atomic import UnreadableFile, open_checked, read_bounded, read_json_object

from xfw.report import compare as cmp
from xfw.report import contrast, layouts, table
from xfw.report import estimate as est
from xfw.report.nodes import load_runs
from xfw.report.results import RunResult
from xfw.report.table import Page
from xfw.run.launch import instances, jobs, launcher, lock
from xfw.recipe.spec import resolve_spec
from xfw.workflow.base import (Log, Outcome, UsageError, guarded, judge_runs, load_all, prepare_backends, silent,
                               read_parity_status, write_page, write_report)


def estimate(recipe_path: str | None, overrides: list[str], run_dir: str | None) -> Outcome:
    """The memory estimate of a recipe, or of a run's own spec next to what the run measured."""
    if (recipe_path is None) == (run_dir is None):
        raise UsageError("give a RECIPE or --run DIR (a run directory's spec.json is its recipe), not both")
    measured = None
    if run_dir is not None:
        if overrides:
            raise UsageError("--set applies to a RECIPE, not to --run (the run's spec.json is what ran)")
        spec_path = Path(run_dir) / "spec.json"
        try:
            spec = read_json_object(spec_path)  # bounded, a regular file, a JSON object (never a list)
        except UnreadableFile as err:
            raise UsageError(f"{err} (a run's spec)") from None
        if not spec:
            raise UsageError(f"{spec_path}: no run's spec there (--run names a run directory)")
        m = RunResult.load(run_dir).measurement
        measured = {"mem_alloc_peak_bytes": m.mem_alloc_peak_bytes,
                    "mem_reserved_peak_bytes": m.mem_reserved_peak_bytes, "mem_source": m.mem_source}
    else:
        (recipe,) = load_all([recipe_path], overrides)
        spec = resolve_spec(recipe, backend="estimate", run_id="estimate")
    where = f"{Path(run_dir) / 'spec.json'}" if run_dir is not None else recipe_path
    try:
        estimate_ = est.estimate(spec)
        numbers = [*estimate_.states.values(), estimate_.activations, estimate_.activations_other]
        if not all(v is None or (isinstance(v, (int, float)) and math.isfinite(v)) for v in numbers):
            raise UsageError(f"{where}: cannot estimate: the spec's sizes give a number that is not finite "
                             "(edited by hand?)")
        return Outcome(text=table.to_markdown(est.to_page(spec, estimate_, measured), images=False))
    except KeyError as err:
        raise UsageError(f"{where}: cannot estimate: the spec has no {err.args[0]!r} where xfw writes one "
                         "(an unknown preset or family, or a spec edited by hand)") from None
    except (NotImplementedError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError,
            OverflowError, RecursionError) as err:
        raise UsageError(f"{where}: cannot estimate ({type(err).__name__}: {str(err)[:200]}); a field of the "
                         "wrong type or out of range (edited by hand?)") from None


def _ab_pair(paths: list[str]) -> tuple[str, str] | None:
    """The two builds an ``xfw compare --ab`` directory among ``paths`` judged (its ab.json), or None."""
    for path in paths:
        from xfw.report.readback import AB, read_checked

        try:
            verdicts = read_checked(Path(path) / "ab.json", AB).get("verdicts")  # typed: first, second are text
        except UnreadableFile:
            continue
        if verdicts:
            return verdicts[0]["first"], verdicts[0]["second"]
    return None


def report(paths: list[str], backend_names: list[str] | None, out_dir: Path | None, *, layout: str = "contrast",
           price_per_gpu_hour: float | None = None) -> Outcome:
    """A report (``layout``) over existing run directories, written beside them or into ``out_dir``."""
    try:
        results = load_runs(paths)
    except FileNotFoundError as err:
        raise UsageError(str(err)) from None
    if not results:
        raise UsageError(f"no run directories under {', '.join(paths)}")
    names = backend_names or cmp.backends_in(results)
    unknown = sorted(set(names) - {r.backend for r in results})
    if unknown:
        raise UsageError(f"--backends {unknown[0]}: no run of that backend in the given directories")
    target = out_dir or Path(paths[0])
    holder = lock.held_by(target)
    if holder is not None:  # a live command writes its own report there when it ends
        raise UsageError(f"{target} is in use by {holder}: its runs are still going; report them when it ends, "
                         "or write this report elsewhere with --out")
    try:
        lock.writable_dir(target)
    except lock.OutError as err:
        raise UsageError(str(err)) from None
    if layout == "contrast" and price_per_gpu_hour is None:
        parity = next((p for p in (read_parity_status(Path(d)) for d in [*paths, target]) if p is not None), None)
        ab = _ab_pair(paths)  # an A/B's directory: its verdict again, for the same two builds
        if ab and not backend_names:
            names = [*ab, *(n for n in names if n not in ab)]
        return write_report(results, names, target, parity=parity, ab=bool(ab) and names[:2] == list(ab))
    shown = [r for r in results if r.backend in names]
    try:
        tables = layouts.build(layout, shown, price_per_gpu_hour=price_per_gpu_hour)
    except ValueError as err:
        raise UsageError(str(err)) from None
    named = layouts.comparison_line(shown)
    for t in tables:  # the CSV names the comparison too, on every row
        t.records = [{**r, "comparison": named.removeprefix("Comparison: ").rstrip(".")} for r in t.records]
    return judge_runs(write_page(Page(title=layouts.page_title(layout, shown), blocks=tables, subtitle=named), target,
                                 f"report-{layout}"), results)


def assemble(paths: list[str], out_dir: Path, *, force: bool = False) -> Outcome:
    """Bring the parts each node of multi-node runs wrote (each node's --out) under ``out_dir`` and
    report the whole runs: every rank, the global throughput, a table per run's ranks."""
    from xfw.report.results import find_run_dirs

    for root in map(Path, paths):  # before the lock: nothing is written into an input
        if out_dir.resolve() != root.resolve() and out_dir.resolve().is_relative_to(root.resolve()):
            raise UsageError(f"--out {out_dir} is inside the input {root}: its parts would be copied into "
                             "themselves; choose a directory outside the inputs (or the input itself, when shared)")
    with guarded(out_dir):
        copied = 0
        for root in map(Path, paths):
            try:
                found = find_run_dirs([root])
            except FileNotFoundError as err:
                raise UsageError(str(err)) from None
            for part_dir in found:
                part = RunResult.load(part_dir)
                if "rank" not in part.node:
                    continue
                target = out_dir / part_dir.relative_to(root)
                if target.resolve() == part_dir.resolve():
                    continue  # already here (a shared --out)
                if target.exists() and not force and not _same_part(part_dir, target):
                    raise UsageError(f"{target} holds another run's part; choose another --out or pass --force")
                copy_part(part_dir, target)
                copied += 1
        results = [r for r in load_runs([out_dir]) if r.node]
        if not results:
            raise UsageError(f"no part of a multi-node run under {', '.join(paths)}")
        page = contrast.contrast_page(cmp.compare_runs(results, cmp.backends_in(results)), cmp.backends_in(results),
                                      title="Multi-node runs, assembled")
        page.blocks += [table.Heading("Ranks", 3), *layouts.ranks(results)]
        outcome = judge_runs(write_page(page, out_dir), results)
        outcome.notes.insert(0, f"{copied} node part(s) copied into {out_dir}")
        return outcome


def _same_part(a: Path, b: Path) -> bool:
    try:
        return read_bounded(a / "summary.json") == read_bounded(b / "summary.json")
    except (OSError, UnreadableFile):
        return False


PART_FILE_MAX_BYTES = 4 << 30
"""Largest file copied from a node's part (its steps.jsonl, logs, traces)."""


def copy_part(source: Path, target: Path) -> None:
    """A node's part copied into ``target``: regular files and directories only, each file read through
    :func:`xfw.contract.atomic.open_checked` (a link only inside the part, never a FIFO or a device) and
    at most :data:`PART_FILE_MAX_BYTES`; anything else is one UsageError naming the file, found before
    anything is copied."""
    plan: list[tuple[Path, Path]] = []
    for folder, dirs, files in os.walk(source):  # links to directories are not followed
        here = Path(folder)
        for name in dirs:
            if (here / name).is_symlink():
                raise UsageError(f"{here / name}: a symbolic link to a directory in a node's part; not copied "
                                 "(nothing was)")
        for name in files:
            path = here / name
            try:
                os.close(open_checked(path, within=source))
            except UnreadableFile as err:
                raise UsageError(f"{err} (a node's part; nothing was copied)") from None
            except OSError as err:
                raise UsageError(f"{path}: cannot read ({err.strerror or err}) (a node's part; nothing was copied)") \
                    from None
            plan.append((path, target / path.relative_to(source)))
    for src, dst in plan:
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd = open_checked(src, within=source)
        with os.fdopen(fd, "rb") as f_in:
            if os.fstat(f_in.fileno()).st_size > PART_FILE_MAX_BYTES:
                raise UsageError(f"{src}: larger than {PART_FILE_MAX_BYTES >> 30} GiB; not copied")
            tmp = dst.with_name(f".{dst.name}.part")
            with open(tmp, "wb") as f_out:
                shutil.copyfileobj(f_in, f_out, 1 << 20)
            os.replace(tmp, dst)


def selfcheck(backend_names: list[str], *, families: list[str], paths: list[str], interpreters: dict[str, str],
              out_dir: Path | None = None, progress: launcher.Progress | None = None, log: Log = silent,
              comparison: str | None = None) -> Outcome:
    """Every family through every settings path on every backend; a verdict per (backend, path);
    exit 1 if a path fails (not checked is not a failure: it says why)."""
    from xfw.report import selfcheck as judge
    from xfw.run.commands import selfcheck as sc

    unknown = [f for f in families if f not in sc.FAMILY_RECIPES] + [p for p in paths if p not in judge.BY_NAME]
    if unknown:
        raise UsageError(f"{unknown[0]!r}: not a family ({', '.join(sc.FAMILY_RECIPES)}) nor a path "
                         f"({', '.join(judge.BY_NAME)})")
    paths = ["fp32", *(p for p in paths if p != "fp32")]  # the reference every other path is held to
    backends = prepare_backends(backend_names, interpreters)
    out_dir = out_dir or sc.DEFAULT_OUT
    with guarded(out_dir):
        try:
            verdicts = sc.run_selfcheck(launcher.PROJECT_ROOT, families, paths, backends, out_dir,
                                        progress=progress, log=log,
                                        extra=(f"comparison={comparison}",) if comparison else ())
        except jobs.JobsInterrupted:
            return Outcome(notes=["interrupted: the same command resumes (finished runs are kept)"], exit_code=130)
        except ValueError as err:  # ParityError (the export) and RecipeError: one line
            raise UsageError(str(err)) from None
    page = Page(title="xfw selfcheck", subtitle=f"{', '.join(families)} through {len(paths)} paths on "
                                                f"{', '.join(backends)}, each from one exported start",
                blocks=judge.verdict_blocks(verdicts))
    outcome = write_page(page, out_dir, "selfcheck")
    outcome.paths["verdicts"] = out_dir / sc.VERDICTS_FILE
    outcome.exit_code = 1 if any(v.verdict == "fail" for v in verdicts) else 0
    return outcome


def describe_backends(backend_names: list[str], interpreters: dict[str, str], log: Log = silent) -> Outcome:
    """``xfw env``: each backend's interpreter, device, versions and build (an instance's environment
    built first, once); exit 1 if one is unusable."""
    lines, code = [], 0
    for k, name in enumerate(backend_names, start=1):
        # each probe starts the backend's interpreter and imports its framework and libraries (seconds each):
        # say so as it goes, so a newcomer does not watch a silent terminal
        log(f"xfw env: probing {name} ({k} of {len(backend_names)}): starting its interpreter and importing "
            "its framework and libraries...")
        started = time.monotonic()
        try:
            backend, info = prepare_backends([name], interpreters, log=log)[name]
        except UsageError as err:
            lines.append(f"{name}: NOT AVAILABLE — {err}")
            code = 1
            log(f"xfw env: {name} not available ({time.monotonic() - started:.1f} s)")
            continue
        log(f"xfw env: {name} probed in {time.monotonic() - started:.1f} s")
        versions = ", ".join(f"{k} {v}" for k, v in info.get("versions", {}).items())
        lines.append(f"{name}: {backend.python}\n  device: {info.get('device')} ({info.get('device_name')})\n"
                     f"  versions: {versions}" + (f"\n  commit: {info['framework_commit']}"
                                                  if info.get("framework_commit") else ""))
    built = instances.built_envs()
    if built:
        lines.append(f"built environments ({instances.BUILDS_DIR}; `xfw env --remove NAME` deletes one):")
        for directory, record in built:
            if record is None:
                lines.append(f"  {directory.name}: unreadable or half built (remove it)")
                continue
            sha = record.get("wheel_sha256")
            lines.append(f"  {directory.name}: {record.get('adapter')} {record.get('framework_version')} from "
                         f"{record.get('source')}, {instances.fmt_size(int(record.get('size_bytes') or 0))}, built "
                         f"{record.get('built_at')}" + (f", wheel sha256 {sha[:12]}" if sha else ""))
    for directory in instances.abandoned_builds():
        lines.append(f"abandoned build {directory.name}: {instances.fmt_size(instances.size_on_disk(directory))}, "
                     "left by a build that was killed (`xfw env --clean` removes it; so does the next build)")
    return Outcome(text="\n".join(lines), exit_code=code)


def clean_envs() -> Outcome:
    """``xfw env --clean``: remove what killed builds left (their scratch directories)."""
    return Outcome(text="\n".join(instances.clean_builds()))


def remove_env(name: str) -> Outcome:
    """``xfw env --remove NAME``: delete one built environment."""
    try:
        return Outcome(text=instances.remove_env(name))
    except instances.InstanceError as err:
        raise UsageError(str(err)) from None
