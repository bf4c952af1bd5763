"""The commands that run many runs to answer one question: ``parity`` (the same model?), ``converge`` (the same
quality, at what speed?) and ``nightly`` (a suite against its history). Each checks all input, then launches through
:mod:`xfw.run.launch.jobs`, and returns one :class:`~xfw.workflow.base.Outcome`. (``bisect`` is
:mod:`xfw.workflow.builds`, ``selfcheck`` :mod:`xfw.workflow.reading`.)
"""

from __future__ import annotations

from pathlib import Path

from xfw.contract.atomic import UnreadableFile
from xfw.run.launch import jobs, launcher
from xfw.recipe.overrides import refuse_forced
from xfw.workflow.base import (Log, Outcome, UsageError, check_node, guarded, interrupted, knob_problems, load_all,
                               prepare_backends, recipe_error, refuse_commands, silent, write_page)


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
