"""The commands that read what ran, or launch nothing: ``report``, ``assemble``, ``estimate``,
``env`` and ``selfcheck`` (which runs its own small checks through the same guard).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from xfw.report import compare as cmp
from xfw.report import contrast, layouts, table
from xfw.report import estimate as est
from xfw.report.results import RunResult, load_runs
from xfw.report.table import Page
from xfw.run import jobs, launcher, lock
from xfw.run.spec import resolve_spec
from xfw.workflow.base import (Log, Outcome, UsageError, guarded, judge_runs, load_all, prepare_backends, silent,
                               write_page, write_report)


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
            spec = json.loads(spec_path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise UsageError(f"{spec_path}: cannot read a run's spec ({err})") from None
        m = RunResult.load(run_dir).measurement
        measured = {"mem_alloc_peak_bytes": m.mem_alloc_peak_bytes,
                    "mem_reserved_peak_bytes": m.mem_reserved_peak_bytes, "mem_source": m.mem_source}
    else:
        (recipe,) = load_all([recipe_path], overrides)
        spec = resolve_spec(recipe, backend="estimate", run_id="estimate")
    try:
        return Outcome(text=table.to_markdown(est.to_page(spec, est.estimate(spec), measured), images=False))
    except (KeyError, NotImplementedError) as err:
        raise UsageError(f"{run_dir or recipe_path}: cannot estimate ({err})") from None


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
    try:
        lock.writable_dir(target)
    except lock.OutError as err:
        raise UsageError(str(err)) from None
    if layout == "contrast" and price_per_gpu_hour is None:
        return write_report(results, names, target)
    try:
        tables = layouts.build(layout, [r for r in results if r.backend in names],
                               price_per_gpu_hour=price_per_gpu_hour)
    except ValueError as err:
        raise UsageError(str(err)) from None
    return judge_runs(write_page(Page(title=layouts.LAYOUTS[layout][0], blocks=tables), target, f"report-{layout}"),
                       results)


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
                shutil.copytree(part_dir, target, dirs_exist_ok=True)
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
        return (a / "summary.json").read_bytes() == (b / "summary.json").read_bytes()
    except OSError:
        return False


def selfcheck(backend_names: list[str], *, families: list[str], paths: list[str], interpreters: dict[str, str],
              out_dir: Path | None = None, progress: launcher.Progress | None = None, log: Log = silent,
              comparison: str | None = None) -> Outcome:
    """Every family through every settings path on every backend; a verdict per (backend, path);
    exit 1 if a path fails (not checked is not a failure: it says why)."""
    from xfw.report import selfcheck as judge
    from xfw.run import selfcheck as sc

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


def describe_backends(backend_names: list[str], interpreters: dict[str, str]) -> Outcome:
    """``xfw env``: each backend's interpreter, device and versions; exit 1 if one is unusable."""
    lines, code = [], 0
    for name in backend_names:
        try:
            backend = launcher.resolve_backend(name, interpreters)
            info = launcher.describe_backend(backend)
        except launcher.BackendError as err:
            lines.append(f"{name}: NOT AVAILABLE — {err}")
            code = 1
            continue
        versions = ", ".join(f"{k} {v}" for k, v in info.get("versions", {}).items())
        lines.append(f"{name}: {backend.python}\n  device: {info.get('device')} ({info.get('device_name')})\n"
                     f"  versions: {versions}")
    return Outcome(text="\n".join(lines), exit_code=code)
