"""``xfw bisect``: from a change between two builds to the first build that has it (:mod:`xfw.run.bisect`,
docs/builds.md). Each decision is an ``xfw compare --ab`` of one build against the good one
(:func:`xfw.workflow.running.compare`); the decisions are kept in ``bisect.json`` as they are made.
"""

from __future__ import annotations

from pathlib import Path

from xfw.contract.atomic import UnreadableFile, read_json_object, write_json_atomic
from xfw.report.readback import AB, read_checked
from xfw.run import launcher
from xfw.workflow.base import (Log, Outcome, UsageError, guarded, load_all, prepare_backends, refuse_commands, silent,
                               write_page)
from xfw.workflow.running import compare


def bisect(recipe_path: str, builds_path: str, *, good: str, bad: str, overrides: list[str],
           repeat: int = 5, out_dir: Path | None = None, force: bool = False,
           progress: launcher.Progress | None = None, log: Log = silent) -> Outcome:
    """``xfw bisect`` (:mod:`xfw.run.bisect`): A/B each chosen build against the good one until the first
    build with the bad build's change is found; bisect.json/.md/.csv/.html; resumable. Exit 0 when the
    search ended (found, or nothing to find), 1 when skipped builds left it undecided."""
    from xfw.report.ab import MIN_PAIRS
    from xfw.report.bisect import bisect_page
    from xfw.run import bisect as bs
    from xfw.recipe import load_recipe

    try:
        builds = bs.read_builds(builds_path)
        lo, hi = bs.check_ends(builds, good, bad)
    except bs.BisectError as err:
        raise UsageError(str(err)) from None
    if repeat < MIN_PAIRS:
        raise UsageError(f"--repeat {repeat}: an A/B needs at least {MIN_PAIRS} pairs")
    extra = [*overrides, f"measure.repeat={repeat}"]
    (recipe,) = load_all([recipe_path], extra)  # every problem of the recipe before anything is built
    refuse_commands(recipe, [good], "a bisect runs builds of xfw's own adapters")
    by_name = {b.name: b for b in builds.builds}
    interpreters = {b.name: b.python or b.wheel for b in builds.builds if b.python or b.wheel}
    prepare_backends([good], {k: v for k, v in interpreters.items() if k == good}, [recipe], log)  # or nothing to judge against
    out_dir = out_dir or Path("runs") / f"bisect-{recipe.name}"
    state_path = out_dir / "bisect.json"
    key = {"recipe": str(Path(recipe_path).resolve()), "builds": builds.names, "good": good, "bad": bad,
           "overrides": extra, "recipe_name": recipe.name}
    with guarded(out_dir):
        try:
            state = {} if force else read_json_object(state_path)
        except UnreadableFile as err:
            raise UsageError(f"{err} (give --force to start this bisect again)") from None
        if state and state.get("key") != key:
            raise UsageError(f"{state_path}: holds a bisect of other builds or settings; give another --out, or "
                             "--force to replace it")
        done = {d["build"]: bs.Decision(**d) for d in state.get("decisions", [])}
        decisions: list[dict] = list(state.get("decisions", []))

        def decide(name: str, position: int) -> bs.Decision:
            if name in done:
                log(f"bisect: {name}: decided before ({done[name].verdict}), kept")
                return done[name]
            step_dir = out_dir / f"ab-{name}"
            decision = bs.Decision(build=name, position=position, verdict="skipped", directory=str(step_dir))
            try:
                outcome = compare([recipe_path], [name, good], overrides=extra, interpreters={
                    k: v for k, v in interpreters.items() if k in (name, good)}, out_dir=step_dir, force=True,
                    progress=progress, log=log, ab=True)
            except UsageError as err:  # it did not build or import: recorded, skipped (the good one did, above)
                decision.reason = str(err).splitlines()[0][:300]
                log(f"bisect: {name}: skipped ({decision.reason})")
            else:
                decision = _decision(step_dir, name, position, good, outcome, decision)
            decisions.append({k: v for k, v in vars(decision).items() if k != "has_change"})
            write_json_atomic(state_path, {"schema": 1, "key": key, "decisions": decisions})
            return decision

        result = bs.search(builds.names, good, bad, decide, log)
        planted = [n for n in builds.names[lo:hi + 1] if "planted" in n]
        page = bisect_page(result, recipe.name, planted)
        outcome = write_page(page, out_dir, stem="bisect")
        write_json_atomic(state_path, {"schema": 1, "key": key, "decisions": decisions, "result": result.to_dict()})
        outcome.paths["json"] = state_path
    outcome.exit_code = outcome.exit_code or (1 if result.outcome == "undecided" else 0)
    return outcome


def _decision(step_dir: Path, name: str, position: int, good: str, outcome: Outcome, decision) -> object:
    """One A/B's verdict from its directory (ab.json), or the reason its build was skipped."""
    from xfw.report.results import RunResult

    try:
        verdict = read_checked(step_dir / "ab.json", AB).get("verdicts", [{}])[0]  # typed: xfw.report.readback
    except (UnreadableFile, IndexError):
        verdict = {}
    if verdict.get("verdict") in ("slower", "faster", "no change"):
        for key in ("verdict", "ratio", "low", "high", "p_value", "detectable", "pairs"):
            setattr(decision, key, verdict[key])
        return decision
    failed = []
    for summary in sorted(step_dir.glob("*/*/summary.json")):
        try:
            run = RunResult.load(summary.parent)
        except (UnreadableFile, ValueError, KeyError, TypeError):
            continue
        if not run.ok:
            failed.append(f"{run.backend} {run.status}: {run.reason}")
    if any(f.startswith(f"{good} ") for f in failed):
        raise UsageError(f"bisect: the good build {good} itself did not run ({failed[0][:200]}); nothing can be "
                         "judged against it")
    decision.reason = (failed[0] if failed else f"no verdict from {verdict.get('pairs', 0)} pairs")[:300]
    return decision
