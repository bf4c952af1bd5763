"""What the CLI commands do, as library functions: validate, run, compare, sweep, maxbatch,
estimate, report.

``compare(["recipes/tiny/llava_sft.yaml"], ["paddle", "torch"], out_dir=...)`` validates every
recipe and checks every backend *before* launching anything, then runs each backend one at a
time (never side by side: they would share the machine), writes the report, and returns the
results. A failed backend is a result with a status; it never stops the others::

    runs/20261122-161500-tiny-llava-sft/
        tiny-llava-sft/paddle/{spec.json,env.json,steps.jsonl,summary.json,stderr.log}
        tiny-llava-sft/torch/...
        report.md  report.csv  chart.png
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from xfw.report import compare as cmp
from xfw.report import estimate as est
from xfw.run import jobs, launcher
from xfw.report import contrast, layouts, table
from xfw.run import maxbatch as mb
from xfw.run import sweep as sw
from xfw.report.plot import plot_comparison
from xfw.report.table import Page
from xfw.run.recipe import Recipe, RecipeError, load_recipe, resolve_spec
from xfw.report.results import RunResult, load_runs
from xfw.contract.atomic import write_json_atomic, write_text_atomic


class UsageError(ValueError):
    """Bad input found before anything launched; the message is complete."""


def load_all(paths: list[str], overrides: list[str]) -> list[Recipe]:
    """Validate every recipe; raise one UsageError listing every problem."""
    recipes, problems = [], []
    for path in paths:
        try:
            recipes.append(load_recipe(path, overrides))
        except RecipeError as err:
            problems.append(str(err))
    if problems:
        raise UsageError("\n".join(problems))
    names = [r.name for r in recipes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise UsageError(f"two recipes are named {duplicates[0]!r}: run directories would collide")
    return recipes


def prepare_backends(names: list[str], interpreters: dict[str, str]) -> dict[str, tuple[launcher.Backend, dict]]:
    """Resolve and describe each backend (fails fast, before any launch)."""
    if not names:
        raise UsageError("no backends given")
    out, problems = {}, []
    for name in names:
        try:
            backend = launcher.resolve_backend(name, interpreters)
            out[name] = (backend, launcher.describe_backend(backend))
        except launcher.BackendError as err:
            problems.append(str(err))
    if problems:
        raise UsageError("\n".join(problems))
    return out


def default_out_dir(recipes: list[Recipe], root: Path = Path("runs")) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    label = recipes[0].name if len(recipes) == 1 else "compare"
    return root / f"{stamp}-{label}"


@dataclass
class Report:
    markdown: str
    paths: dict[str, Path]


def _jobs(recipes: list[Recipe], backends: list[str], out_dir: Path) -> list[jobs.Job]:
    return [job for recipe in recipes for job in jobs.jobs_for(recipe, backends, out_dir, (recipe.name,))]


def run_all(recipes: list[Recipe], backends: jobs.Backends, out_dir: Path,
            progress: launcher.Progress | None = None,
            rendezvous: launcher.Rendezvous = launcher.Rendezvous()) -> list[RunResult]:
    return jobs.run_jobs(_jobs(recipes, list(backends), out_dir), backends, resume=False, progress=progress,
                         rendezvous=rendezvous, log=lambda _line: None)[0]


def launch_commands(recipes: list[Recipe], backends: dict[str, tuple[launcher.Backend, dict]], out_dir: Path,
                    rendezvous: launcher.Rendezvous = launcher.Rendezvous()) -> list[str]:
    """The exact shell lines ``run`` would execute, with their environment; writes each spec.json
    (so a line can be run by hand) and launches nothing."""
    lines = []
    for job in _jobs(recipes, list(backends), out_dir):
        if job.repeat_index:
            continue
        backend, description = backends[job.backend]
        job.run_dir.mkdir(parents=True, exist_ok=True)
        spec_path = job.run_dir / "spec.json"
        write_json_atomic(spec_path, launcher.spec_for(job.recipe, job.backend, job.run_dir))
        cmd = launcher.build_command(backend, description, job.recipe, spec_path, job.run_dir / "steps.jsonl",
                                     rendezvous)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in launcher.run_env(job.recipe).items())
        lines.append(f"# {job.backend}: {job.recipe.name} (timeout {job.recipe.measure.timeout_s:g} s)\n"
                     f"{env} {shlex.join(cmd)}")
    return lines


def parity_statuses(recipes: list[Recipe], out_dir: Path, extra: list[Path] = ()) -> dict[str, dict]:
    """Each recipe's parity status for the report: the newest matching parity.json in ``extra``,
    ``out_dir`` (or one level below) or ``runs/parity-<recipe>`` (xfw parity's default out)."""
    from xfw.run import parity as par  # only here: compare's report is the one place that needs it

    search = [*extra, out_dir, *(Path("runs") / f"parity-{r.name}" for r in recipes)]
    return {r.name: par.find_parity(r, search) for r in recipes}


def write_page(page: Page, out_dir: Path, stem: str = "report") -> Report:
    """``stem``.md, .csv and .html in ``out_dir`` from one page; the terminal gets it without images."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out_dir / f"{stem}.md", "csv": out_dir / f"{stem}.csv", "html": out_dir / f"{stem}.html"}
    write_text_atomic(paths["markdown"], table.to_markdown(page))
    write_text_atomic(paths["csv"], table.to_csv(page))
    write_text_atomic(paths["html"], table.to_html(page))
    return Report(markdown=table.to_markdown(page, images=False), paths=paths)


def write_report(results: list[RunResult], backends: list[str], out_dir: Path, *, chart: bool = True,
                 parity: dict[str, dict] | None = None) -> Report:
    """report.md/csv/html and chart.png; ``parity`` (recipe name -> status) adds the parity lines."""
    rows = cmp.compare_runs(results, backends, parity=parity)
    chart_path = plot_comparison(rows, backends, out_dir / "chart.png") if chart else None
    report = write_page(contrast.contrast_page(rows, backends, chart=chart_path), out_dir)
    if chart_path is not None:
        report.paths["chart"] = chart_path
    return report


def write_layout(results: list[RunResult], layout: str, out_dir: Path, *,
                 price_per_gpu_hour: float | None = None) -> Report:
    """One of the seed layouts (xfw.report.layouts) as report-<layout>.md, .csv and .html."""
    try:
        tables = layouts.build(layout, results, price_per_gpu_hour=price_per_gpu_hour)
    except ValueError as err:
        raise UsageError(str(err)) from None
    return write_page(Page(title=layouts.LAYOUTS[layout][0], blocks=tables), out_dir, f"report-{layout}")


def report_from_dirs(paths: list[str], backends: list[str] | None, out_dir: Path | None, *,
                     layout: str = "contrast", price_per_gpu_hour: float | None = None) -> Report:
    try:
        results = load_runs(paths)
    except FileNotFoundError as err:
        raise UsageError(str(err)) from None
    if not results:
        raise UsageError(f"no run directories under {', '.join(paths)}")
    names = backends or cmp.backends_in(results)
    unknown = sorted(set(names) - {r.backend for r in results})
    if unknown:
        raise UsageError(f"--backends {unknown[0]}: no run of that backend in the given directories")
    target = out_dir or Path(paths[0])
    if layout != "contrast":
        return write_layout([r for r in results if r.backend in names], layout, target,
                            price_per_gpu_hour=price_per_gpu_hour)
    if price_per_gpu_hour is not None:
        raise UsageError("--price-per-gpu-hour applies only to --layout cost")
    return write_report(results, names, target)


def plan_sweep(recipe_path: str, assignments: list[str], fixed: list[str] = ()) -> list[sw.Point]:
    """Every point of a sweep, validated; UsageError (one line per bad point) before any launch."""
    try:
        return sw.plan(recipe_path, assignments, fixed)
    except RecipeError as err:
        raise UsageError(str(err)) from None


def default_sweep_dir(points: list[sw.Point], root: Path = Path("runs")) -> Path:
    """Stable (no timestamp), so running the same sweep again resumes it."""
    return root / f"sweep-{points[0].recipe.name}"


def run_sweep(points: list[sw.Point], backends: dict[str, tuple[launcher.Backend, dict]], out_dir: Path,
              progress: launcher.Progress | None = None, log=print) -> tuple[list[RunResult], Report]:
    results = sw.run_sweep(points, backends, out_dir, progress, log)
    return results, write_report(results, list(backends), out_dir)


def plan_maxbatch(recipe_path: str, overrides: list[str], candidates: str | None) -> list[int] | None:
    """Validate the recipe and every candidate probe before anything launches."""
    try:
        values = mb.parse_candidates(candidates) if candidates else None
        load_recipe(recipe_path, overrides)
        for micro in values or []:
            mb.probe_recipe(recipe_path, micro, overrides)
    except ValueError as err:  # RecipeError included: one line naming the file and key
        raise UsageError(str(err)) from None
    return values


def default_maxbatch_dir(recipe_path: str, overrides: list[str], root: Path = Path("runs")) -> Path:
    """Stable (no timestamp), so running the same search again keeps the settled probes."""
    return root / f"maxbatch-{load_all([recipe_path], overrides)[0].name}"


def run_maxbatch(recipe_path: str, backends: dict[str, tuple[launcher.Backend, dict]], out_dir: Path, *,
                 candidates: list[int] | None, overrides: list[str], max_micro: int = mb.DEFAULT_MAX_MICRO,
                 progress: launcher.Progress | None = None, log=print) -> tuple[list[mb.MaxBatch], Report]:
    """One search per backend, one after the other; writes maxbatch.json and maxbatch.md."""
    found = [mb.search(recipe_path, backend, description, out_dir, candidates=candidates, overrides=overrides,
                       max_micro=max_micro, progress=progress, log=log)
             for backend, description in backends.values()]
    markdown = mb.to_markdown(found)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "maxbatch.json", "markdown": out_dir / "maxbatch.md"}
    write_json_atomic(paths["json"], [f.to_dict() for f in found])
    write_text_atomic(paths["markdown"], markdown)
    return found, Report(markdown=markdown, paths=paths)


def estimate_markdown(recipe_path: str | None, overrides: list[str], run_dir: str | None) -> str:
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
        return est.to_markdown(spec, est.estimate(spec), measured)
    except (KeyError, NotImplementedError) as err:
        raise UsageError(f"{run_dir or recipe_path}: cannot estimate ({err})") from None
