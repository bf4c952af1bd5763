"""What the CLI commands do, as library functions: validate, run, compare, report.

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
from dataclasses import dataclass
from pathlib import Path

from xfw import compare as cmp
from xfw import launcher, render
from xfw.plot import plot_comparison
from xfw.recipe import Recipe, RecipeError, load_recipe
from xfw.results import RunResult, load_runs, write_text_atomic


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


def run_all(recipes: list[Recipe], backends: dict[str, tuple[launcher.Backend, dict]], out_dir: Path,
            progress: launcher.Progress | None = None) -> list[RunResult]:
    results = []
    for recipe in recipes:
        repeats = recipe.measure.repeat
        for k in range(repeats):
            for name, (backend, description) in backends.items():
                run_dir = out_dir / recipe.name / (name if repeats == 1 else f"{name}-r{k}")
                results.append(launcher.launch(recipe, backend, run_dir, description=description,
                                               progress=progress, repeat_index=k))
    return results


def write_report(results: list[RunResult], backends: list[str], out_dir: Path, *, chart: bool = True) -> Report:
    rows = cmp.compare_runs(results, backends)
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = render.report_markdown(rows, backends)
    paths = {"markdown": out_dir / "report.md", "csv": out_dir / "report.csv"}
    write_text_atomic(paths["markdown"], markdown)
    write_text_atomic(paths["csv"], render.to_frame(rows, backends).to_csv(index=False))
    if chart:
        paths["chart"] = plot_comparison(rows, backends, out_dir / "chart.png")
    return Report(markdown=markdown, paths=paths)


def report_from_dirs(paths: list[str], backends: list[str] | None, out_dir: Path | None) -> Report:
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
    return write_report(results, names, target)
