"""The commands that launch runs: ``run``/``compare``, ``sweep``, ``maxbatch``, ``parity`` and
``nightly``. Each checks all its input first (:mod:`xfw.workflow.base`), then runs its jobs one
at a time under the output directory's lock and writes its report.
"""

from __future__ import annotations

import datetime as dt
import os
import shlex
from pathlib import Path

from xfw.contract.atomic import write_json_atomic
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
