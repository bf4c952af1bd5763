"""What each CLI command does, as one library call returning an :class:`Outcome`.

The CLI (:mod:`xfw.cli`) parses options, calls one function here, prints the outcome and exits
with its code; every policy (what is checked before launching, where results go, which exit code
a result earns) lives here. Every function validates all its input *before* launching anything
and raises :class:`UsageError` (exit 2) for bad input::

    outcome = compare(["recipes/tiny/llava_sft.yaml"], ["paddle", "torch"], overrides=[], interpreters={})
    outcome.exit_code      # 0 all runs ok, 1 some run failed (every other result still written)
    outcome.text           # the report as markdown
    # runs/20261122-161500-tiny-llava-sft/{tiny-llava-sft/{paddle,torch}/..., report.md/.csv/.html, chart.png}

Runs go one at a time (never side by side: they would share the machine). A failed backend is a
result with a status; it never stops the others.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shlex
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from xfw.contract.atomic import UnreadableFile, write_json_atomic, write_text_atomic
from xfw.report import compare as cmp
from xfw.report import contrast, layouts, table
from xfw.report import estimate as est
from xfw.report.plot import plot_comparison
from xfw.report.results import RunResult, load_runs
from xfw.report.table import Page
from xfw.run import command, jobs, launcher, lock
from xfw.run import maxbatch as mb
from xfw.run import sweep as sw
from xfw.run.recipe import Recipe, RecipeError, load_recipe, resolve_spec

Log = Callable[[str], None]
NODE_WAIT_S = 120.0
"""How long one node of a multi-node run waits for the other nodes' parts to finish beside its own
(a shared --out) before reporting its part alone."""


class UsageError(ValueError):
    """Bad input found before anything launched; the message is complete."""


@dataclass
class Outcome:
    """What a command produced: text for stdout, files and notes for stderr, an exit code."""

    text: str = ""
    paths: dict[str, Path] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    exit_code: int = 0


def _silent(_line: str) -> None:
    pass


# --- input, checked before anything launches ---------------------------------------------------

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


def data_summary(recipe: Recipe) -> str:
    """One line on a recipe's prepared real data (``xfw validate``): samples, lengths, where it is."""
    data = resolve_spec(recipe, backend="validate", run_id="validate")["data"]
    stats = data["stats"]
    text = f"data: {stats['num_samples']} samples, {stats['num_images']} images"
    if stats.get("max_seq_len"):
        text += (f", sequence length mean {stats['mean_seq_len']:.1f} / max {stats['max_seq_len']} "
                 f"({stats['truncated']} cut at data.seq_len), template {stats['template']}")
    return f"{text}; prepared in {data['prepared']}"


def prepare_backends(names: list[str], interpreters: dict[str, str], recipes: list[Recipe] = ()) -> jobs.Backends:
    """Resolve and describe each backend (fails fast, before any launch). A backend that runs a
    command in every one of ``recipes`` needs no interpreter and no description (xfw.run.command)."""
    if not names:
        raise UsageError("no backends given")
    stray = sorted(set(interpreters) - set(names))
    if stray:
        raise UsageError(f"--python {stray[0]}=...: {stray[0]!r} is not a backend of this command "
                         f"(it runs {', '.join(names)})")
    out, problems = {}, []
    for name in names:
        if command.is_command(list(recipes), name):
            if name in interpreters:
                problems.append(f"--python {name}=...: backend {name!r} runs the recipe's command "
                                f"(backends.{name}.command), not an interpreter; set the command's first item instead")
            out[name] = (launcher.Backend(name, ""), {"command": True})
            continue
        try:
            backend = launcher.resolve_backend(name, interpreters)
            out[name] = (backend, launcher.describe_backend(backend))
        except launcher.BackendError as err:
            problems.append(str(err))
    if problems:
        raise UsageError("\n".join(problems))
    return out


def _refuse_commands(recipe: Recipe, backend_names: list[str], why: str) -> None:
    attached = [name for name in backend_names if command.command_of(recipe, name) is not None]
    if attached:
        raise UsageError(f"{recipe.name}: backends.{attached[0]}.command: {why}; use compare, sweep or nightly")


def _recipe_error(fn, *args):
    try:
        return fn(*args)
    except ValueError as err:  # RecipeError included: one line naming the file and key
        raise UsageError(str(err)) from None


# --- writing reports ------------------------------------------------------------------------------

def write_page(page: Page, out_dir: Path, stem: str = "report") -> Outcome:
    """``stem``.md, .csv and .html in ``out_dir`` from one page; the terminal gets it without images.
    A file that cannot be written (a full disk) is named in the notes, with exit code 1."""
    outcome = Outcome(text=table.to_markdown(page, images=False))
    renderers = {"markdown": (f"{stem}.md", table.to_markdown), "csv": (f"{stem}.csv", table.to_csv),
                 "html": (f"{stem}.html", table.to_html)}
    for kind, (name, render) in renderers.items():
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(out_dir / name, render(page))
            outcome.paths[kind] = out_dir / name
        except OSError as err:
            outcome.notes.append(f"could not write {out_dir / name}: {err.strerror or err} (the report is printed above)")
            outcome.exit_code = 1
    return outcome


def write_report(results: list[RunResult], backends: list[str], out_dir: Path, *, chart: bool = True,
                 parity: dict[str, dict] | None = None, warnings: list[str] = ()) -> Outcome:
    """report.md/csv/html and chart.png; ``parity`` (recipe name -> status) adds the parity lines.
    Exit code 1 when any run is not ok."""
    rows = cmp.compare_runs(results, backends, parity=parity)
    try:
        chart_path = plot_comparison(rows, backends, out_dir / "chart.png") if chart else None
    except OSError as err:
        chart_path, problem = None, f"could not write {out_dir / 'chart.png'}: {err.strerror or err}"
    else:
        problem = ""
    outcome = write_page(contrast.contrast_page(rows, backends, chart=chart_path, warnings=list(warnings)), out_dir)
    if chart_path is not None:
        outcome.paths["chart"] = chart_path
    if problem:
        outcome.notes.append(problem)
        outcome.exit_code = 1
    return _judge_runs(outcome, results)


def _judge_runs(outcome: Outcome, results: list[RunResult]) -> Outcome:
    """Exit code 1 (and a note) when any run is not ok: failed, unreadable or incomplete."""
    failed = [r for r in results if not r.ok]
    if failed:
        outcome.notes.append(f"{len(failed)} of {len(results)} runs did not succeed (their status is in the report)")
        outcome.exit_code = 1
    return outcome


@contextlib.contextmanager
def _guarded(out_dir: Path, node_rank: int | None = None) -> Iterator[None]:
    """While a command runs jobs: its output directory locked (per node for one node of a multi-node
    run), SIGTERM handled as Ctrl-C (the running adapter is stopped and recorded as cut off), and a
    refused job reported as bad input."""
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        with lock.hold(out_dir, node_rank=node_rank):
            yield
    except (lock.LockedError, jobs.JobError) as err:
        raise UsageError(str(err)) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _refuse_foreign(out_dir: Path, recipes: list[Recipe], force: bool) -> None:
    others = [] if force else jobs.foreign_recipes(out_dir, [r.name for r in recipes])
    if others:
        raise UsageError(f"{out_dir} already holds runs of {others[0]}"
                         + (f" and {len(others) - 1} other recipe(s)" if len(others) > 1 else "")
                         + "; choose another --out, or pass --force (its report will then show only this command's runs)")


def _interrupted(outcome: Outcome) -> Outcome:
    outcome.notes.append("interrupted: finished runs are kept; the report above shows them")
    outcome.exit_code = 130
    return outcome


# --- run and compare ------------------------------------------------------------------------------

def default_out_dir(recipes: list[Recipe], root: Path = Path("runs")) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    label = recipes[0].name if len(recipes) == 1 else "compare"
    return root / f"{stamp}-{label}"


def _jobs(recipes: list[Recipe], backends: list[str], out_dir: Path, node_rank: int = 0) -> list[jobs.Job]:
    return [job for recipe in recipes
            for job in jobs.jobs_for(recipe, backends, out_dir, (recipe.name,), node_rank=node_rank)]


def launch_commands(recipes: list[Recipe], backends: jobs.Backends, out_dir: Path,
                    rendezvous: launcher.Rendezvous = launcher.Rendezvous()) -> list[str]:
    """The exact shell lines ``run`` would execute, with their environment; writes each spec.json
    (so a line can be run by hand) and launches nothing."""
    lines = []
    for job in _jobs(recipes, list(backends), out_dir, rendezvous.node_rank):
        if job.repeat_index:
            continue
        backend, description = backends[job.backend]
        job.run_dir.mkdir(parents=True, exist_ok=True)
        spec_path = job.run_dir / "spec.json"
        write_json_atomic(spec_path, launcher.spec_for(job.recipe, job.backend, job.run_dir))
        run = launcher.invocation(backend, description, job.recipe, spec_path, job.run_dir / "steps.jsonl",
                                  rendezvous)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in {**launcher.run_env(job.recipe), **run.env}.items())
        inherited = {k: v for k, v in sorted(os.environ.items()) if k.startswith(INHERITED_PREFIXES)}
        lines.append(f"# {job.backend}: {job.recipe.name} (timeout {job.recipe.measure.timeout_s:g} s); the adapter "
                     "gets this shell's environment plus the variables in front of the command"
                     + (f"; of that environment these matter to the frameworks: "
                        + " ".join(f"{k}={shlex.quote(v)}" for k, v in inherited.items()) if inherited else "")
                     + f"\ncd {shlex.quote(run.cwd or str(Path.cwd()))} && {env} {shlex.join(run.argv)}")
    return lines


INHERITED_PREFIXES = ("CUDA_", "NCCL_", "NVIDIA_", "FLAGS_", "PADDLE_", "TORCH_", "PYTORCH_", "OMP_", "MKL_",
                      "PYTHONPATH", "LD_LIBRARY_PATH", "HF_", "TRANSFORMERS_", "XFW_")
"""The caller's variables ``--print-command`` shows: the ones the frameworks and their launchers read."""


def parity_statuses(recipes: list[Recipe], out_dir: Path, extra: list[Path] = ()) -> dict[str, dict]:
    """Each recipe's parity status for the report: the newest matching parity.json in ``extra``,
    ``out_dir`` (or one level below) or ``runs/parity-<recipe>`` (xfw parity's default out)."""
    from xfw.run import parity as par  # only here: compare's report is the one place that needs it

    search = [*extra, out_dir, *(Path("runs") / f"parity-{r.name}" for r in recipes)]
    return {r.name: par.find_parity(r, search) for r in recipes}


def compare(recipe_paths: list[str], backend_names: list[str], *, overrides: list[str],
            interpreters: dict[str, str], out_dir: Path | None = None,
            rendezvous: launcher.Rendezvous = launcher.Rendezvous(), parity_dirs: list[Path] | None = None,
            print_command: bool = False, force: bool = False, progress: launcher.Progress | None = None,
            log: Log = _silent) -> Outcome:
    """``xfw run`` (one backend) and ``xfw compare``: run every recipe on every backend and report.
    ``parity_dirs`` (a list, possibly empty): look up and show each recipe's parity status."""
    recipes = load_all(recipe_paths, overrides)
    backends = prepare_backends(backend_names, interpreters, recipes)
    out_dir = out_dir or default_out_dir(recipes)
    if print_command:
        return Outcome(text="\n".join(launch_commands(recipes, backends, out_dir, rendezvous)))
    multi_node = any(r.parallel.nnodes > 1 for r in recipes)
    _check_node(recipes, rendezvous)
    with _guarded(out_dir, rendezvous.node_rank if multi_node else None):
        _refuse_foreign(out_dir, recipes, force)
        todo = _jobs(recipes, list(backends), out_dir, rendezvous.node_rank)
        jobs.check_jobs(todo, force=force)
        unchecked = _unchecked(todo, backends)
        for warning in unchecked:
            log(f"warning: {warning}")
        log(f"runs in {out_dir}" + (f" (node {rendezvous.node_rank}'s part)" if multi_node else ""))
        try:
            results, _ = jobs.run_jobs(todo, backends, resume=False, force=force, progress=progress,
                                       rendezvous=rendezvous, log=_silent)
        except jobs.JobsInterrupted as stop:
            return _interrupted(write_report(stop.results, backend_names, out_dir))
        results, notes = _with_sibling_parts(results, log)
        parity = None if parity_dirs is None else parity_statuses(recipes, out_dir, parity_dirs)
        outcome = write_report(results, backend_names, out_dir, parity=parity, warnings=unchecked)
        outcome.notes += notes
        return outcome


def _unchecked(todo: list[jobs.Job], backends: jobs.Backends) -> list[str]:
    """Settings paths these jobs take that ``xfw selfcheck`` has not passed on this machine."""
    from xfw.report.results import setup_from_spec
    from xfw.run.selfcheck import unchecked_paths

    setups = []
    for job in todo:
        spec = launcher.spec_for(job.recipe, job.backend, job.run_dir)
        setups.append((job.backend, setup_from_spec(spec), spec["backend_knobs"]))
    return unchecked_paths(setups, backends)


def _check_node(recipes: list[Recipe], rendezvous: launcher.Rendezvous) -> None:
    """The rendezvous flags fit the recipes: a node rank inside parallel.nnodes, one port for all nodes."""
    for recipe in recipes:
        nnodes = recipe.parallel.nnodes
        if not 0 <= rendezvous.node_rank < nnodes:
            raise UsageError(f"--node-rank {rendezvous.node_rank}: {recipe.name} runs on parallel.nnodes = {nnodes} "
                             f"node(s), so the rank is 0" + (f"..{nnodes - 1}" if nnodes > 1 else ""))
        if nnodes > 1 and rendezvous.master_port is None:
            raise UsageError(f"{recipe.name}: parallel.nnodes = {nnodes} needs --master-port (the same on every node)")


def _one_node(recipes: list[Recipe], command: str) -> None:
    multi = next((r for r in recipes if r.parallel.nnodes > 1), None)
    if multi is not None:
        raise UsageError(f"{multi.name}: parallel.nnodes = {multi.parallel.nnodes}: xfw {command} runs on one node; "
                         "run each node with xfw run or compare --node-rank R (docs/multinode.md)")


def _with_sibling_parts(results: list[RunResult], log: Log) -> tuple[list[RunResult], list[str]]:
    pairs = [jobs.with_sibling_parts(r, wait_s=NODE_WAIT_S, log=log) for r in results]
    return [r for r, _ in pairs], [note for _, note in pairs if note]


# --- studies --------------------------------------------------------------------------------------

def sweep(recipe_path: str, axes: list[str], backend_names: list[str], *, fixed: list[str],
          interpreters: dict[str, str], out_dir: Path | None = None, force: bool = False,
          progress: launcher.Progress | None = None, log: Log = _silent) -> Outcome:
    """Every combination of the axes' values, one run at a time; the same ``out_dir`` resumes.
    ``fixed`` overrides (``--repeat``) apply to every point without being part of its variant."""
    points = _recipe_error(sw.plan, recipe_path, axes, fixed)
    _one_node([p.recipe for p in points], "sweep")
    backends = prepare_backends(backend_names, interpreters, [p.recipe for p in points])
    out_dir = out_dir or Path("runs") / f"sweep-{points[0].recipe.name}"  # no timestamp: a rerun resumes
    with _guarded(out_dir):
        _refuse_foreign(out_dir, [points[0].recipe], force)
        jobs.check_jobs(sw.sweep_jobs(points, list(backends), out_dir), force=force)
        log(f"sweep of {len(points)} points x {len(backends)} backends in {out_dir}")
        try:
            results = sw.run_sweep(points, backends, out_dir, progress, log, force=force)
        except jobs.JobsInterrupted as stop:
            return _interrupted(write_report(stop.results, list(backends), out_dir))
        return write_report(results, list(backends), out_dir)


def maxbatch(recipe_path: str, backend_names: list[str], *, overrides: list[str], candidates: str | None,
             max_micro: int, interpreters: dict[str, str], out_dir: Path | None = None, force: bool = False,
             progress: launcher.Progress | None = None, log: Log = _silent) -> Outcome:
    """The largest micro-batch that fits, per backend; writes maxbatch.json and maxbatch.md/.csv/.html.
    Exit code 1 unless every search found its edge through ok and OOM probes only."""
    values = _recipe_error(mb.parse_candidates, candidates) if candidates else None
    (recipe,) = load_all([recipe_path], overrides)
    _one_node([recipe], "maxbatch")
    _refuse_commands(recipe, backend_names, "maxbatch changes batch.micro, which the command itself decides")
    for micro in values or []:
        _recipe_error(mb.probe_recipe, recipe_path, micro, overrides)
    backends = prepare_backends(backend_names, interpreters)
    out_dir = out_dir or Path("runs") / f"maxbatch-{recipe.name}"  # no timestamp: a rerun keeps settled probes
    with _guarded(out_dir):
        _refuse_foreign(out_dir, [recipe], force)
        log(f"probes in {out_dir}")
        try:
            found = [mb.search(recipe_path, backend, description, out_dir, candidates=values, overrides=overrides,
                               max_micro=max_micro, progress=progress, log=log, force=force)
                     for backend, description in backends.values()]
        except jobs.JobsInterrupted:
            return Outcome(notes=["interrupted: settled probes are kept; the same command resumes the search"],
                           exit_code=130)
    outcome = write_page(mb.to_page(found), out_dir, "maxbatch")
    outcome.paths["json"] = out_dir / "maxbatch.json"
    write_json_atomic(outcome.paths["json"], [f.to_dict() for f in found])
    settled = all(f.edge and all(p.status in ("ok", "oom") for p in f.probes) for f in found)
    outcome.exit_code = 0 if settled else 1
    return outcome


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


# --- reading what ran ------------------------------------------------------------------------------

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
    if layout == "contrast" and price_per_gpu_hour is None:
        return write_report(results, names, target)
    try:
        tables = layouts.build(layout, [r for r in results if r.backend in names],
                               price_per_gpu_hour=price_per_gpu_hour)
    except ValueError as err:
        raise UsageError(str(err)) from None
    return _judge_runs(write_page(Page(title=layouts.LAYOUTS[layout][0], blocks=tables), target, f"report-{layout}"),
                       results)


def assemble(paths: list[str], out_dir: Path, *, force: bool = False) -> Outcome:
    """Bring the parts each node of multi-node runs wrote (each node's --out) under ``out_dir`` and
    report the whole runs: every rank, the global throughput, a table per run's ranks."""
    from xfw.report.results import find_run_dirs

    with _guarded(out_dir):
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
        outcome = _judge_runs(write_page(page, out_dir), results)
        outcome.notes.insert(0, f"{copied} node part(s) copied into {out_dir}")
        return outcome


def _same_part(a: Path, b: Path) -> bool:
    try:
        return (a / "summary.json").read_bytes() == (b / "summary.json").read_bytes()
    except OSError:
        return False


def selfcheck(backend_names: list[str], *, families: list[str], paths: list[str], interpreters: dict[str, str],
              out_dir: Path | None = None, progress: launcher.Progress | None = None, log: Log = _silent) -> Outcome:
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
    with _guarded(out_dir):
        try:
            verdicts = sc.run_selfcheck(launcher.PROJECT_ROOT, families, paths, backends, out_dir,
                                        progress=progress, log=log)
        except jobs.JobsInterrupted:
            return Outcome(notes=["interrupted: the same command resumes (finished runs are kept)"], exit_code=130)
        except ValueError as err:  # ParityError (the export) and RecipeError: one line
            raise UsageError(str(err)) from None
    cells = [[v.backend, judge.BY_NAME[v.path].title, table.Strong(v.verdict) if v.verdict != "pass" else "pass",
              v.detail] for v in verdicts]
    skipped = [f"{v.backend}, {judge.BY_NAME[v.path].title}: {v.detail}" for v in verdicts if v.verdict == "not checked"]
    page = Page(title="xfw selfcheck", subtitle=f"{', '.join(families)} through {len(paths)} paths on "
                                                f"{', '.join(backends)}, each from one exported start",
                blocks=[table.Table(header=["Backend", "Path", "Verdict", "Detail"], cells=cells, name="selfcheck",
                                    records=[v.to_dict() for v in verdicts])])
    if skipped:
        page.blocks += [table.Heading("Could not be checked on this machine", 3), table.Bullets(skipped)]
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


# --- parity and the nightly job ----------------------------------------------------------------------

def parity(recipe_path: str, backend_names: list[str], *, steps: int, overrides: list[str],
           interpreters: dict[str, str], out_dir: Path | None = None, force: bool = False,
           weights: dict[str, str] | None = None) -> Outcome:
    """Both backends from one start on the same batches; parity.json/.md/.html; exit 1 if a step fails.
    ``weights``: a backend started from its own ``model.weights`` directory instead of the shared
    export (to test the checker: a weight changed on one side must be found)."""
    from xfw.contract.presets import PRESETS
    from xfw.contract.weights import Checkpoint, WeightsError
    from xfw.run import parity as par

    if len(backend_names) != 2:
        raise UsageError(f"--backends {','.join(backend_names)!r}: parity compares exactly two backends")
    (recipe,) = load_all([recipe_path], overrides)
    _refuse_commands(recipe, backend_names, "parity starts both sides from one exported model, which only "
                     "xfw's own adapters do")
    for name, directory in (weights or {}).items():
        if name not in backend_names:
            raise UsageError(f"--weights {name}={directory}: {name!r} is not one of the compared backends "
                             f"({', '.join(backend_names)})")
        try:
            Checkpoint(directory, family=PRESETS[recipe.model.preset]["family"])  # reads every header
        except WeightsError as err:
            raise UsageError(f"--weights {name}={directory}: {err}") from None
    out_dir = out_dir or Path("runs") / f"parity-{recipe.name}"
    with _guarded(out_dir):
        try:
            result = par.run_parity(recipe_path, overrides, steps, out_dir, interpreters,
                                    backends=(backend_names[0], backend_names[1]), force=force, weights=weights)
        except par.ParityError as err:
            raise UsageError(str(err)) from None
        except jobs.JobsInterrupted:
            return Outcome(notes=["interrupted: parity did not finish"], exit_code=130)
    outcome = write_page(result.page(), out_dir, "parity")
    outcome.paths["json"] = out_dir / "parity.json"
    outcome.exit_code = 0 if result.passed else 1
    return outcome


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def nightly(suite_path: str, history_dir: Path, *, night: str | None, overrides: list[str],
            only_backends: list[str] | None, interpreters: dict[str, str], report_only: bool = False,
            rendezvous: launcher.Rendezvous = launcher.Rendezvous(), progress: launcher.Progress | None = None,
            log: Log = _silent) -> Outcome:
    """Run (or resume) a night of a suite, judge it against the history, write its report.
    Exit 0: no regression; 1: a regression or a failed run; 130: interrupted (the same command resumes)."""
    from xfw.report.history import NIGHTS_DIR, History
    from xfw.report.nightly_report import write_night_report
    from xfw.report.verdicts import VERDICTS_FILE, load_verdicts
    from xfw.run import nightly as nt
    from xfw.run.suite import SuiteError, load_suite

    try:
        suite = load_suite(suite_path, overrides)
        History(history_dir).rows()  # a corrupt history is found now, not after the first run has trained
    except (SuiteError, UnreadableFile) as err:
        raise UsageError(f"{err}" if isinstance(err, SuiteError) else
                         f"{err}; the history cannot be read (move the file aside to start a new one)") from None
    if report_only:
        night = night or (History(history_dir).nights() or [None])[-1]
        if night is None or not (history_dir / NIGHTS_DIR / night / VERDICTS_FILE).exists():
            raise UsageError(f"--report-only: no recorded night {night or ''} in {history_dir}".replace("  ", " "))
        verdicts = load_verdicts(history_dir / NIGHTS_DIR / night)
        path = write_night_report(history_dir, night, suite_name=suite.name)
        return Outcome(paths={"report": path}, exit_code=1 if any(v.flagged for v in verdicts) else 0)
    names = list(suite.backends)
    if only_backends is not None:
        stray = [n for n in only_backends if n not in suite.backends]
        if stray:
            raise UsageError(f"--backends {stray[0]}: not a backend of {suite_path} "
                             f"(it runs {', '.join(suite.backends)})")
        names = only_backends
    multi = [e.recipe for e in suite.entries if e.recipe.parallel.nnodes > 1]
    _check_node(multi, rendezvous)
    if rendezvous.node_rank > 0 and night is None:
        raise UsageError(f"--node-rank {rendezvous.node_rank}: give every node the same --night (node 0 names it)")
    backends = prepare_backends(names, interpreters, [e.recipe for e in suite.entries])
    # A scheduler's polite stop (cron's `timeout`, Slurm's time limit) arrives as SIGTERM: the
    # running adapter is stopped the way Ctrl-C stops it, recorded as cut off and rerun on resume.
    with _guarded(history_dir, rendezvous.node_rank if multi else None):
        try:
            result = nt.run_night(suite, backends, history_dir, night=night, overrides=overrides,
                                  progress=progress, log=log, rendezvous=rendezvous)
        except KeyboardInterrupt:
            return Outcome(notes=["interrupted: finished runs are kept; the same command resumes this night"],
                           exit_code=130)
    if rendezvous.node_rank > 0:
        failed = [r for r in result.results if not r.ok]
        return Outcome(text=f"night {result.night}, node {rendezvous.node_rank}: {len(result.results)} part(s) run, "
                            f"{len(failed)} failed; node 0 records the assembled runs",
                       exit_code=1 if failed else 0)
    report_path = write_night_report(history_dir, result.night, suite_name=suite.name)
    nt.finish_night(result)
    flagged = result.regressions
    if flagged:
        text = "\n".join([f"{len(flagged)} regression(s) or failure(s) in night {result.night}:"]
                         + [f"  {v.line()}" for v in flagged])
    else:
        text = (f"night {result.night}: no regressions ({len(result.results)} runs, "
                f"{result.kept} kept from an earlier attempt)")
    return Outcome(text=text, paths={"report": report_path, "history": history_dir / "history.jsonl"},
                   exit_code=result.exit_code)
