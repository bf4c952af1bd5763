"""The commands that launch runs: ``run``/``compare``, ``sweep``, ``maxbatch``, ``parity`` and
``nightly``. Each checks all its input first (:mod:`xfw.workflow.base`), then runs its jobs one
at a time under the output directory's lock and writes its report.
"""

from __future__ import annotations

import datetime as dt
import os
import shlex
from pathlib import Path

from xfw.contract.atomic import UnreadableFile, write_json_atomic
from xfw.report.results import RunResult
from xfw.run.launch import instances, jobs, launcher
from xfw.run.commands import maxbatch as mb
from xfw.run.commands import sweep as sw
from xfw.recipe.overrides import backend_recipe, refuse_forced
from xfw.recipe import Recipe
from xfw.workflow.base import (Log, Outcome, UsageError, check_node, guarded, interrupted, knob_problems, load_all,
                               one_node, prepare_backends, recipe_error, refuse_commands, refuse_foreign, silent,
                               write_page, write_report)


NODE_WAIT_S = 120.0
"""How long one node of a multi-node run waits for the other nodes' parts to finish beside its own
(a shared --out) before reporting its part alone."""


def default_out_dir(recipes: list[Recipe], root: Path = Path("runs")) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    label = recipes[0].name if len(recipes) == 1 else "compare"
    return root / f"{stamp}-{label}"


def _jobs(recipes: list[Recipe], backends: list[str], out_dir: Path, node_rank: int = 0,
          ab: bool = False) -> list[jobs.Job]:
    return [job for recipe in recipes
            for job in jobs.jobs_for(recipe, backends, out_dir, (recipe.name,), node_rank=node_rank, alternate=ab)]


def contrast_order(backend_names: list[str], contrast: str | None) -> list[str]:
    """The backends with ``--contrast FIRST:SECOND`` first (the report's contrast and an A/B are the
    first against the second), the others after them in their order."""
    if contrast is None:
        return backend_names
    first, sep, second = contrast.partition(":")
    if not sep or not first or not second or first == second:
        raise UsageError(f"--contrast {contrast!r}: expected FIRST:SECOND, two different backends of --backends "
                         f"(e.g. --contrast {':'.join(backend_names[:2][::-1])})")
    for name in (first, second):
        if name not in backend_names:
            raise UsageError(f"--contrast {contrast!r}: {name!r} is not one of --backends ({', '.join(backend_names)})")
    return [first, second, *(n for n in backend_names if n not in (first, second))]


def check_ab(recipes: list[Recipe], backend_names: list[str]) -> None:
    """``--ab`` needs two backends to alternate and enough pairs for a verdict (xfw.report.ab.MIN_PAIRS)."""
    from xfw.report.ab import MIN_PAIRS

    if len(backend_names) < 2:
        raise UsageError("--ab: needs two backends to alternate (e.g. --backends paddle@3.2.0,paddle)")
    for recipe in recipes:
        pairs = min(backend_recipe(instances.fold(recipe, n), n).measure.repeat for n in backend_names[:2])
        if pairs < MIN_PAIRS:
            raise UsageError(f"--ab: {recipe.name}: measure.repeat = {pairs} gives {pairs} pair(s); an A/B needs "
                             f"at least {MIN_PAIRS} (add --repeat 5 or more)")


def launch_commands(recipes: list[Recipe], backends: jobs.Backends, out_dir: Path,
                    rendezvous: launcher.Rendezvous = launcher.Rendezvous(), write: bool = True) -> list[str]:
    """The exact shell lines ``run`` would execute, with their environment; writes each spec.json
    (so a line can be run by hand; ``write=False``: not, and says so) and launches nothing."""
    lines = [] if write else ["# no spec.json written (give --out DIR to have them there, to run a line by hand)"]
    for job in _jobs(recipes, list(backends), out_dir, rendezvous.node_rank):
        if job.repeat_index:
            continue
        backend, description = backends[job.backend]
        spec_path = job.run_dir / "spec.json"
        if write:
            job.run_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(spec_path, launcher.spec_for(job.recipe, job.backend, job.run_dir))
        recipe = backend_recipe(job.recipe, job.backend)  # its override applied (xfw.recipe.overrides)
        run = launcher.invocation(backend, description, recipe, spec_path, job.run_dir / "steps.jsonl", rendezvous)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in {**launcher.run_env(recipe), **run.env}.items())
        inherited = {k: v for k, v in sorted(os.environ.items()) if k.startswith(INHERITED_PREFIXES)}
        lines.append(f"# {job.backend}: {recipe.name} (timeout {recipe.measure.timeout_s:g} s); the adapter "
                     "gets this shell's environment plus the variables in front of the command"
                     + ("; of that environment these matter to the frameworks: "
                        + " ".join(f"{k}={shlex.quote(v)}" for k, v in inherited.items()) if inherited else "")
                     + f"\ncd {shlex.quote(run.cwd or str(Path.cwd()))} && {env} {shlex.join(run.argv)}")
    return lines


INHERITED_PREFIXES = ("CUDA_", "NCCL_", "NVIDIA_", "FLAGS_", "PADDLE_", "TORCH_", "PYTORCH_", "OMP_", "MKL_",
                      "PYTHONPATH", "LD_LIBRARY_PATH", "HF_", "TRANSFORMERS_", "XFW_")
"""The caller's variables ``--print-command`` shows: the ones the frameworks and their launchers read."""


def parity_statuses(recipes: list[Recipe], out_dir: Path, extra: list[Path] = ()) -> dict[str, dict]:
    """Each recipe's parity status for the report: the newest matching parity.json in ``extra``,
    ``out_dir`` (or one level below) or ``runs/parity-<recipe>`` (xfw parity's default out)."""
    from xfw.run.commands import parity as par  # only here: compare's report is the one place that needs it

    search = [*extra, out_dir, *(Path("runs") / f"parity-{r.name}" for r in recipes)]
    return {r.name: par.find_parity(r, search) for r in recipes}


def compare(recipe_paths: list[str], backend_names: list[str], *, overrides: list[str],
            interpreters: dict[str, str], out_dir: Path | None = None,
            rendezvous: launcher.Rendezvous = launcher.Rendezvous(), parity_dirs: list[Path] | None = None,
            print_command: bool = False, force: bool = False, progress: launcher.Progress | None = None,
            log: Log = silent, explain: bool = False, ab: bool = False, contrast: str | None = None) -> Outcome:
    """``xfw run`` (one backend) and ``xfw compare``: run every recipe on every backend and report.
    ``parity_dirs`` (a list, possibly empty): look up and show each recipe's parity status.
    ``explain``: then each ok run's adapter profiles a few steps (``xfw explain``, :func:`explained`).
    ``contrast``: FIRST:SECOND, the pair the contrast is of (default the first two backends);
    ``ab``: those two run alternately (A B B A ...) and judged as an A/B (xfw.report.ab)."""
    backend_names = contrast_order(backend_names, contrast)
    recipes = load_all(recipe_paths, overrides)
    if ab:
        check_ab(recipes, backend_names)
    backends = prepare_backends(backend_names, interpreters, recipes, log)
    chosen, out_dir = out_dir is not None, out_dir or default_out_dir(recipes)
    if print_command:  # into the default runs/<stamp>/ nothing: a look at the commands leaves no run behind
        return Outcome(text="\n".join(launch_commands(recipes, backends, out_dir, rendezvous, write=chosen)))
    multi_node = any(r.parallel.nnodes > 1 for r in recipes)
    check_node(recipes, rendezvous)
    with guarded(out_dir, rendezvous.node_rank if multi_node else None):
        refuse_foreign(out_dir, recipes, force)
        todo = _jobs(recipes, list(backends), out_dir, rendezvous.node_rank, ab=ab)
        jobs.check_jobs(todo, force=force)
        unchecked = _unchecked(todo, backends)
        for warning in unchecked:
            log(f"warning: {warning}")
        log(f"runs in {out_dir}" + (f" (node {rendezvous.node_rank}'s part)" if multi_node else ""))
        try:
            results, _ = jobs.run_jobs(todo, backends, resume=False, force=force, progress=progress,
                                       rendezvous=rendezvous, log=silent)
        except jobs.JobsInterrupted as stop:
            return interrupted(write_report(stop.results, backend_names, out_dir, ab=ab))
        results, notes = _with_sibling_parts(results, log)
        parity = None if parity_dirs is None else parity_statuses(recipes, out_dir, parity_dirs)
        outcome = write_report(results, backend_names, out_dir, parity=parity, warnings=unchecked, ab=ab)
        outcome.notes += notes
        outcome = explained(outcome, results, backend_names, backends, out_dir, log) if explain else outcome
        outcome.notes.append(next_step(recipe_paths, results, out_dir, outcome, ab=bool(ab)))
        return outcome


def next_step(recipe_paths: list[str], results: list[RunResult], out_dir: Path, outcome: Outcome,
              ab: bool = False) -> str:
    """The last line a compare prints: where to read the report, and the one command that makes its
    numbers more trustworthy (the spread, where there was one run; else the losses, where parity was not run)."""
    page = outcome.paths.get("html")
    recipe = shlex.quote(recipe_paths[0]) if len(recipe_paths) == 1 else "RECIPE"
    repeated = any(r.repeat_index for r in results)
    more = ("the same command with `--repeat 3` gives every figure its spread (this was one run each)"
            if not repeated else f"`xfw parity {recipe}` checks both sides train the same model")
    if ab:  # two builds of one framework: parity across frameworks does not apply (issue 42)
        more = (f"an undecided A/B needs the pairs its verdict names (--repeat N); a change between two builds is "
                f"narrowed down by `xfw bisect {recipe} --builds FILE --good OLD --bad NEW` (docs/builds.md)")
    return f"next: open {page or out_dir} in a browser; {more}; `xfw report {shlex.quote(str(out_dir))}` renders these runs again."


def explained(outcome: Outcome, results: list[RunResult], backend_names: list[str], backends: jobs.Backends,
              out_dir: Path, log: Log) -> Outcome:
    """After the measured runs: each side profiled (``xfw.run.commands.explain``), aligned (``xfw.report.explain``),
    written to explain.md/.csv/.html and explain.png beside the report, and printed."""
    from xfw.report import compare as cmp
    from xfw.report.explain import explain_page
    from xfw.report.table import Image
    from xfw.run.commands.explain import explain_runs, not_applicable

    found = explain_runs(results, backends, log=log)
    notes = [f"{Path(run_dir).parent.name}/{Path(run_dir).name}: {why}" for run_dir, (_, why) in found.items() if why]
    page = explain_page(cmp.compare_runs(results, backend_names), backend_names, out_dir, notes)
    more = write_page(page, out_dir, stem="explain")
    outcome.text += "\n\n" + more.text
    outcome.paths.update({f"explain {k}": v for k, v in more.paths.items()})
    charts = [b.path for b in page.blocks if isinstance(b, Image)]  # one waterfall per recipe
    outcome.paths.update({"explain chart" + (f" {i + 1}" if i else ""): c for i, c in enumerate(charts)})
    outcome.notes += more.notes
    failed = any(why and not not_applicable(why) for _, why in found.values())
    outcome.exit_code = outcome.exit_code or more.exit_code or (1 if failed else 0)
    return outcome


def _unchecked(todo: list[jobs.Job], backends: jobs.Backends) -> list[str]:
    """Settings paths these jobs take that ``xfw selfcheck`` has not passed on this machine."""
    from xfw.report.results import setup_from_spec
    from xfw.run.commands.selfcheck import unchecked_paths

    setups = []
    for job in todo:
        spec = launcher.spec_for(job.recipe, job.backend, job.run_dir)
        setups.append((job.backend, setup_from_spec(spec), spec["backend_knobs"]))
    return unchecked_paths(setups, backends)


def _with_sibling_parts(results: list[RunResult], log: Log) -> tuple[list[RunResult], list[str]]:
    pairs = [jobs.with_sibling_parts(r, wait_s=NODE_WAIT_S, log=log) for r in results]
    return [r for r, _ in pairs], [note for _, note in pairs if note]


def sweep(recipe_path: str, axes: list[str], backend_names: list[str], *, fixed: list[str],
          interpreters: dict[str, str], out_dir: Path | None = None, force: bool = False,
          progress: launcher.Progress | None = None, log: Log = silent) -> Outcome:
    """Every combination of the axes' values, one run at a time; the same ``out_dir`` resumes.
    ``fixed`` overrides (``--repeat``) apply to every point without being part of its variant."""
    points = recipe_error(sw.plan, recipe_path, axes, fixed)
    problems = sorted({f"{recipe_path}: {x}" for p in points for x in knob_problems(p.recipe)})
    if problems:
        raise UsageError("\n".join(problems))
    one_node([p.recipe for p in points], "sweep")
    backends = prepare_backends(backend_names, interpreters, [p.recipe for p in points], log)
    out_dir = out_dir or Path("runs") / f"sweep-{points[0].recipe.name}"  # no timestamp: a rerun resumes
    with guarded(out_dir):
        refuse_foreign(out_dir, [points[0].recipe], force)
        jobs.check_jobs(sw.sweep_jobs(points, list(backends), out_dir), force=force)
        log(f"sweep of {len(points)} points x {len(backends)} backends in {out_dir}")
        try:
            results = sw.run_sweep(points, backends, out_dir, progress, log, force=force)
        except jobs.JobsInterrupted as stop:
            return interrupted(write_report(stop.results, list(backends), out_dir))
        return write_report(results, list(backends), out_dir)


def maxbatch(recipe_path: str, backend_names: list[str], *, overrides: list[str], candidates: str | None,
             max_micro: int, interpreters: dict[str, str], out_dir: Path | None = None, force: bool = False,
             progress: launcher.Progress | None = None, log: Log = silent) -> Outcome:
    """The largest micro-batch that fits, per backend; writes maxbatch.json and maxbatch.md/.csv/.html.
    Exit code 1 unless every search found its edge through ok and OOM probes only."""
    values = recipe_error(mb.parse_candidates, candidates) if candidates else None
    (recipe,) = load_all([recipe_path], overrides)
    one_node([recipe], "maxbatch")
    refuse_commands(recipe, backend_names, "maxbatch changes batch.micro, which the command itself decides")
    recipe_error(refuse_forced, recipe, ["batch.micro=M", "batch.global=G"], "xfw maxbatch")  # what it forces
    for micro in values or []:
        recipe_error(mb.probe_recipe, recipe_path, micro, overrides)
    backends = prepare_backends(backend_names, interpreters, [recipe])
    out_dir = out_dir or Path("runs") / f"maxbatch-{recipe.name}"  # no timestamp: a rerun keeps settled probes
    with guarded(out_dir):
        refuse_foreign(out_dir, [recipe], force)
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


def parity(recipe_path: str, backend_names: list[str], *, steps: int, overrides: list[str],
           interpreters: dict[str, str], out_dir: Path | None = None, force: bool = False,
           weights: dict[str, str] | None = None) -> Outcome:
    """Both backends from one start on the same batches; parity.json/.md/.html; exit 1 if a step fails.
    ``weights``: a backend started from its own ``model.weights`` directory instead of the shared
    export (to test the checker: a weight changed on one side must be found)."""
    from xfw.contract.presets import PRESETS
    from xfw.contract.weights import Checkpoint, WeightsError
    from xfw.run.commands import parity as par

    if len(backend_names) != 2:
        raise UsageError(f"--backends {','.join(backend_names)!r}: parity compares exactly two backends")
    (recipe,) = load_all([recipe_path], overrides)
    refuse_commands(recipe, backend_names, "parity starts both sides from one exported model, which only "
                     "xfw's own adapters do")
    recipe_error(refuse_forced, recipe, par.forced_overrides(steps, "EXPORT"), "xfw parity")
    for name, directory in (weights or {}).items():
        if name not in backend_names:
            raise UsageError(f"--weights {name}={directory}: {name!r} is not one of the compared backends "
                             f"({', '.join(backend_names)})")
        try:
            Checkpoint(directory, family=PRESETS[recipe.model.preset]["family"])  # reads every header
        except WeightsError as err:
            raise UsageError(f"--weights {name}={directory}: {err}") from None
    out_dir = out_dir or Path("runs") / f"parity-{recipe.name}"
    with guarded(out_dir):
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


def converge_jobs(chosen, out_dir: Path) -> list[jobs.Job]:
    """The runs a converge into ``out_dir`` would make that an earlier one there already holds: its speed
    runs, and each seed's curves whose exported start exists (a curve's spec names its start), so that
    ``jobs.check_jobs`` refuses other settings (another --steps) before anything launches."""
    from xfw.recipe import load_recipe
    from xfw.run.commands import converge as cv

    todo = cv.speed_jobs_for(chosen, out_dir)
    for seed in chosen.seeds:
        weights = (out_dir / f"seed-{seed}" / "weights").resolve()
        held = [name for name in chosen.backends if (out_dir / f"seed-{seed}" / name / "spec.json").exists()]
        if not held or not (weights / "model.safetensors").is_file():
            continue
        recipe = load_recipe(chosen.recipe_path, [*chosen.overrides, *chosen.seed_overrides(seed),
                                                  f"model.weights={weights}"])
        todo += [jobs.Job(recipe=recipe, backend=name, run_dir=out_dir / f"seed-{seed}" / name) for name in held]
    return todo


def converge(recipe_path: str, backend_names: list[str], *, seeds: int | str, steps: int, eval_every: int,
             overrides: list[str], interpreters: dict[str, str], eval_samples: int | None = None,
             target: float | None = None, max_seeds: int | None = None, margin: float | str = 0.02,
             direction: str = "two-sided", out_dir: Path | None = None, force: bool = False,
             progress: launcher.Progress | None = None, log: Log = silent) -> Outcome:
    """Speed at equal quality (:mod:`xfw.run.commands.converge`): each side's speed run, then per seed one
    exported start and both sides' learning curves; converge.json/.md/.csv/.html/.png. Exit 0 when every
    run finished (a verdict of "worse" or a target never reached is a result), 1 when a run failed."""
    from xfw.report.converge import write_outputs
    from xfw.report.table import to_markdown
    from xfw.run.commands import converge as cv

    try:
        chosen = cv.plan(recipe_path, overrides, backends=tuple(backend_names), seeds=seeds, steps=steps,
                         eval_every=eval_every, eval_samples=eval_samples, target=target, margin=margin,
                         direction=direction, max_seeds=max_seeds)
        forced = [*chosen.seed_overrides(chosen.seeds[0]), "model.weights=EXPORT"]  # what converge forces
        refuse_forced(chosen.recipe, forced, "xfw converge")
    except (cv.ConvergeError, ValueError) as err:  # RecipeError included: one line naming the file and key
        raise UsageError(str(err)) from None
    problems = [f"{recipe_path}: {p}" for p in knob_problems(chosen.recipe)]
    if problems:
        raise UsageError("\n".join(problems))
    refuse_commands(chosen.recipe, backend_names, "converge starts both sides from one exported model, which only "
                    "xfw's own adapters do")
    out_dir = out_dir or Path("runs") / f"converge-{chosen.recipe.name}"
    try:  # every run directory of other settings refused before any launch (an export, a describe included)
        jobs.check_jobs(converge_jobs(chosen, out_dir), force=force)
    except jobs.JobError as err:
        raise UsageError(str(err)) from None
    backends = prepare_backends(backend_names, interpreters, [chosen.recipe], log)
    with guarded(out_dir):
        log(f"converge in {out_dir}: {len(chosen.seeds)} seeds"
            + (f" (then more, up to {chosen.max_seeds}, until decided)" if chosen.max_seeds else "")
            + f" x {steps} steps, eval every {eval_every} steps on "
            f"{chosen.eval_samples} held-out samples")
        try:
            result = cv.run_converge(chosen, out_dir, backends, comparison=chosen.recipe.comparison, force=force,
                                     progress=progress, log=log)
        except jobs.JobError as err:
            raise UsageError(str(err)) from None
        except jobs.JobsInterrupted:
            return Outcome(notes=["interrupted: finished runs are kept; the same command resumes"], exit_code=130)
        paths = write_outputs(result, out_dir)
    failed = [f"{name} seed {seed} {run.status}" for name, runs in result.curves.items()
              for seed, run in runs.items() if run.status != "ok"]
    failed += [f"{name} speed run {sp.status}" for name, sp in result.speed.items() if sp.status != "ok"]
    return Outcome(text=to_markdown(result.page(), images=False), paths=paths,
                   notes=[f"{len(failed)} run(s) did not finish: " + "; ".join(failed)] if failed else [],
                   exit_code=1 if failed else 0)


def nightly(suite_path: str, history_dir: Path, *, night: str | None, overrides: list[str],
            only_backends: list[str] | None, interpreters: dict[str, str], report_only: bool = False,
            rendezvous: launcher.Rendezvous = launcher.Rendezvous(), progress: launcher.Progress | None = None,
            log: Log = silent) -> Outcome:
    """Run (or resume) a night of a suite, judge it against the history, write its report.
    Exit 0: no regression; 1: a regression or a failed run; 130: interrupted (the same command resumes)."""
    from xfw.report.history import NIGHTS_DIR, History
    from xfw.report.nightly_report import write_night_report
    from xfw.report.selfcheck import NIGHT_DIR as CHECKED
    from xfw.report.selfcheck import load_verdicts as checked_paths
    from xfw.report.verdicts import VERDICTS_FILE, load_verdicts
    from xfw.run.commands import nightly as nt
    from xfw.run.commands.suite import SuiteError, load_suite

    if night is not None and not nt.is_night_name(night):
        raise UsageError(f"--night {night!r}: {nt.NIGHT_RULE} (a night is a directory under --history/nights)")
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
        try:
            verdicts = load_verdicts(history_dir / NIGHTS_DIR / night)
        except UnreadableFile as err:
            raise UsageError(f"--report-only: {err}") from None
        failing = [v for v in checked_paths(history_dir / NIGHTS_DIR / night / CHECKED) if v.verdict == "fail"]
        path = write_night_report(history_dir, night, suite_name=suite.name)
        return Outcome(paths={"report": path}, exit_code=1 if failing or any(v.flagged for v in verdicts) else 0)
    names = list(suite.backends)
    if only_backends is not None:
        stray = [n for n in only_backends if n not in suite.backends]
        if stray:
            raise UsageError(f"--backends {stray[0]}: not a backend of {suite_path} "
                             f"(it runs {', '.join(suite.backends)})")
        names = only_backends
        # A converge entry compares both of the suite's backends: without one of them it is skipped.
        skipped = [e for e in suite.entries if e.converge is not None and not set(e.converge.backends) <= set(names)]
        if len(skipped) == len(suite.entries):
            raise UsageError(f"--backends {','.join(names)}: every entry of {suite_path} is a converge entry, which "
                             f"needs both {' and '.join(suite.backends)}: nothing would run")
    multi = [e.recipe for e in suite.entries if e.recipe.parallel.nnodes > 1]
    check_node(multi, rendezvous)
    if rendezvous.node_rank > 0 and night is None:
        raise UsageError(f"--node-rank {rendezvous.node_rank}: give every node the same --night (node 0 names it)")
    backends = prepare_backends(names, interpreters, [e.recipe for e in suite.entries], log, runs=list(suite.backends))
    # A scheduler's polite stop (cron's `timeout`, Slurm's time limit) arrives as SIGTERM: the
    # running adapter is stopped the way Ctrl-C stops it, recorded as cut off and rerun on resume.
    with guarded(history_dir, rendezvous.node_rank if multi else None):
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
    for label, converged in result.converged.items():  # each converge entry's own answer, as xfw converge gives it
        text += "".join(f"\n{label}: {line}" for line in converged.headline)
    text += "".join(f"\nskipped {line}" for line in result.skipped)
    if result.selfcheck:
        failing = result.failed_paths
        text += (f"\nselfcheck: {len(failing)} path(s) fail here: " + "; ".join(f"{v.backend} {v.path} ({v.detail})"
                                                                       for v in failing) if failing else
                 f"\nselfcheck: {len(result.selfcheck)} verdicts, none failing")
    return Outcome(text=text, paths={"report": report_path, "history": history_dir / "history.jsonl"},
                   exit_code=result.exit_code)
