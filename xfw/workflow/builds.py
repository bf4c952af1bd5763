"""``xfw bisect``: from a change between two builds to the first build that has it (:mod:`xfw.run.commands.bisect`,
docs/builds.md). Each look is an ``xfw compare --ab`` of one build against the good and the bad build
(:func:`xfw.workflow.running.compare`) in ``OUT/ab-<build>/look-<k>``; every pair's log ratio is kept in
``bisect.json`` as it is measured, so a killed bisect resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

from xfw.contract.atomic import UnreadableFile, write_json_atomic
from xfw.report.readback import Maybe, read_checked
from xfw.run.launch import launcher
from xfw.workflow.base import (Log, Outcome, UsageError, guarded, load_all, prepare_backends, refuse_commands, silent,
                               write_page)
from xfw.workflow.running import compare

_BUILD_KEY = {"name": str, "version": str, "wheel": str, "wheel_sha256": str, "python": str, "python_sha256": str}
BISECT = {"schema": int, "key": {"recipe": str, "builds": [_BUILD_KEY], "good": str, "bad": str,
                                 "overrides": [str], "recipe_name": str, "margin": float, "start": int,
                                 "max_pairs": int},
          "batches": {str: [{str: [float]}]}, "skipped": {str: str}, "result?": Maybe({str: object})}
"""``bisect.json`` as :func:`bisect` writes it: the key resume matches, every look's log ratios per
judgement (``build|reference,reference``), the skipped builds' reasons, and the result."""


def _sha256(path: str) -> str:
    if not path:
        return ""
    try:
        with open(Path(path).resolve(), "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return "unreadable"


def build_key(build) -> dict:
    """What a label points at, for resume: its version, its wheel and interpreter with their content hashes
    (issue 41 item 10: pointing a label at another interpreter is another build)."""
    return {"name": build.name, "version": build.version, "wheel": build.wheel, "wheel_sha256": _sha256(build.wheel),
            "python": build.python, "python_sha256": _sha256(build.python)}


def check_pairs(repeat: str | int, max_pairs: int | None, margin: float) -> tuple[int, int, float]:
    """``--repeat N|auto``, ``--max-pairs``, ``--margin`` checked before anything launches: (start, budget, margin)."""
    from xfw.report.ab import MIN_PAIRS
    from xfw.report.decision import check_margin

    try:
        margin = check_margin(margin)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if str(repeat) == "auto":
        if max_pairs is None:
            raise UsageError("--repeat auto: needs a budget, --max-pairs N (e.g. --max-pairs 12)")
        if max_pairs < MIN_PAIRS:
            raise UsageError(f"--max-pairs {max_pairs}: below the {MIN_PAIRS} pairs --repeat auto starts with")
        return MIN_PAIRS, max_pairs, margin
    try:
        start = int(repeat)
    except ValueError:
        raise UsageError(f"--repeat {repeat!r}: a number of pairs (at least {MIN_PAIRS}) or auto") from None
    if start < MIN_PAIRS:
        raise UsageError(f"--repeat {start}: an A/B needs at least {MIN_PAIRS} pairs")
    if max_pairs is not None and max_pairs < start:
        raise UsageError(f"--max-pairs {max_pairs}: below --repeat {start} (the pairs it starts with)")
    return start, max_pairs if max_pairs is not None else start, margin


def ab_margin(margin) -> float:
    """``compare --ab --margin``: the margin checked (one line, exit 2, before anything launches)."""
    from xfw.report.decision import check_margin

    try:
        return check_margin(margin)
    except ValueError as err:
        raise UsageError(str(err)) from None


def bisect(recipe_path: str, builds_path: str, *, good: str, bad: str, overrides: list[str],
           repeat: int | str = 5, max_pairs: int | None = None, margin: float | None = None,
           out_dir: Path | None = None, force: bool = False,
           progress: launcher.Progress | None = None, log: Log = silent) -> Outcome:
    """``xfw bisect`` (:mod:`xfw.run.commands.bisect`): judge builds against both ends until an adjacent pair is
    decided and confirmed, or say which range it could not split; bisect.json/.md/.csv/.html; resumable.
    Exit 0 when the search ended decided (found, or the same within the margin), 1 when undecided."""
    from xfw.recipe import load_recipe  # noqa: F401  (the recipe is loaded through load_all)
    from xfw.report.ab import MARGIN, pairs_from_results
    from xfw.report.bisect import bisect_page
    from xfw.report.results import RunResult
    from xfw.run.commands import bisect as bs

    start, budget, margin = check_pairs(repeat, max_pairs, MARGIN if margin is None else margin)
    try:
        builds = bs.read_builds(builds_path)
        lo, hi = bs.check_ends(builds, good, bad)
    except bs.BisectError as err:
        raise UsageError(str(err)) from None
    plan = bs.Plan(start=start, max_pairs=budget, step=3, margin=margin)
    (recipe,) = load_all([recipe_path], [*overrides, f"measure.repeat={start}"])  # every problem before any build
    refuse_commands(recipe, [good], "a bisect runs builds of xfw's own adapters")
    interpreters = {b.name: b.python or b.wheel for b in builds.builds if b.python or b.wheel}
    prepare_backends([good], {k: v for k, v in interpreters.items() if k == good}, [recipe], log)  # or nothing to judge against
    out_dir = out_dir or Path("runs") / f"bisect-{recipe.name}"
    state_path = out_dir / "bisect.json"
    key = {"recipe": str(Path(recipe_path).resolve()), "builds": [build_key(b) for b in builds.builds], "good": good,
           "bad": bad, "overrides": list(overrides), "recipe_name": recipe.name, "margin": margin, "start": start,
           "max_pairs": budget}
    with guarded(out_dir):
        try:
            state = {} if force else read_checked(state_path, BISECT, hint="damaged or edited by hand? give --force "
                                                                         "to start this bisect again")
        except UnreadableFile as err:
            raise UsageError(f"{str(err).splitlines()[0]}" + ("" if "--force" in str(err) else
                                                              " (give --force to start this bisect again)")) from None
        if state and state.get("key") != key:
            raise UsageError(f"{state_path}: holds a bisect of other builds or settings (a label pointing elsewhere "
                             "counts); give another --out, or --force to replace it")
        batches: dict = dict(state.get("batches", {}))
        skipped: dict = dict(state.get("skipped", {}))

        def save(result=None) -> None:
            write_json_atomic(state_path, {"schema": 2, "key": key, "batches": batches, "skipped": skipped,
                                           **({"result": result} if result else {})})

        def measure(name: str, references: tuple, look: int) -> dict:
            tag = f"{name}|{','.join(references)}"
            if name in skipped:
                raise bs.Skipped(skipped[name])
            looks = batches.setdefault(tag, [])
            while len(looks) < look:
                k = len(looks) + 1
                pairs = start if k == 1 else plan.step
                refs = list(references[k % len(references):]) + list(references[:k % len(references)])
                step_dir = out_dir / f"ab-{name}" / (f"vs-{references[0]}" if len(references) == 1 else "") / f"look-{k}"
                log(f"bisect: {name}: look {k}: {pairs} more alternated pairs against {', '.join(references)} "
                    f"(pair {sum(len(next(iter(b.values()))) for b in looks) + pairs} of at most {budget})")
                try:
                    compare([recipe_path], [name, *refs], overrides=[*overrides, f"measure.repeat={pairs}"],
                            interpreters={n: v for n, v in interpreters.items() if n in (name, *references)},
                            out_dir=step_dir, force=True, progress=progress, log=log, ab=margin)
                except UsageError as err:  # it did not build or import: recorded, skipped (the good one did, above)
                    skipped[name] = str(err).splitlines()[0][:300]
                    save()
                    raise bs.Skipped(skipped[name]) from None
                results = []
                for summary in sorted(step_dir.glob("*/*/summary.json")):
                    try:
                        results.append(RunResult.load(summary.parent))
                    except (UnreadableFile, ValueError, KeyError, TypeError):
                        continue
                batch = {}
                for ref in references:
                    found, failed = pairs_from_results(results, name, ref)
                    if failed.get(ref) and not found and ref == good:
                        raise UsageError(f"bisect: the good build {good} itself did not run in {step_dir}; nothing "
                                         "can be judged against it")
                    batch[ref] = [math.log(a / b) for a, b in found]
                if not all(batch.values()):
                    skipped[name] = f"no successful pair in {step_dir} (every run of {name} failed: see its status)"
                    save()
                    raise bs.Skipped(skipped[name])
                looks.append(batch)
                save()
            return {ref: [x for b in looks[:look] for x in b[ref]] for ref in references}

        result = bs.search(builds.names, good, bad, measure, plan, log)
        planted = [n for n in builds.names[lo:hi + 1] if "planted" in n]
        page = bisect_page(result, recipe.name, planted)
        outcome = write_page(page, out_dir, stem="bisect")
        save(result.to_dict())
        outcome.paths["json"] = state_path
    outcome.exit_code = outcome.exit_code or (0 if result.outcome in ("found", "same") else 1)
    return outcome


def ab_sequential_cli(recipe_paths: list[str], backend_names: list[str], *, ab: bool, repeat: int | None,
                      max_pairs: int, margin, **kwargs) -> Outcome:
    """``compare --max-pairs``: its options checked (one line, exit 2, nothing launched), then :func:`ab_sequential`."""
    if not ab:
        raise UsageError("--max-pairs: only with --ab (sequential alternated pairs)")
    if len(backend_names) != 2:
        raise UsageError("--max-pairs: a sequential A/B runs exactly two backends")
    start, budget, margin = check_pairs(repeat or 3, max_pairs, margin)
    return ab_sequential(recipe_paths, backend_names, start=start, max_pairs=budget, margin=margin, **kwargs)


def ab_sequential(recipe_paths: list[str], backend_names: list[str], *, overrides: list[str],
                  interpreters: dict[str, str], start: int, max_pairs: int, margin: float,
                  out_dir: Path | None = None, force: bool = False, progress: launcher.Progress | None = None,
                  log: Log = silent) -> Outcome:
    """``compare --ab --max-pairs N``: alternated pairs look by look (``start``, then 3 more each) until the
    decision (xfw.report.ab) is reached or N pairs are spent; each look is an ordinary ``compare --ab``
    in ``OUT/look-<k>`` and spends its share of alpha (xfw.report.decision.spend). One recipe."""
    from xfw.report.ab import ab_test, pairs_from_results
    from xfw.report.results import RunResult
    from xfw.report.table import Page, Paragraph
    from xfw.workflow.running import default_out_dir

    if len(recipe_paths) != 1:
        raise UsageError("--max-pairs: a sequential A/B takes one recipe")
    step = 3
    looks = 1 + math.ceil(max(max_pairs - start, 0) / step)
    recipes = load_all(recipe_paths, overrides)
    out_dir = out_dir or default_out_dir(recipes)
    first, second = backend_names[:2]
    pairs, failed, found = [], {}, None
    for look in range(1, looks + 1):
        count = start if look == 1 else min(step, max_pairs - len(pairs))
        log(f"A/B: look {look} of at most {looks}: pairs {len(pairs) + 1}-{len(pairs) + count} of at most {max_pairs}")
        compare(recipe_paths, backend_names[:2], overrides=[*overrides, f"measure.repeat={count}"],
                interpreters=interpreters, out_dir=out_dir / f"look-{look}", force=force, progress=progress,
                log=log, ab=margin)
        results = []
        for summary in sorted((out_dir / f"look-{look}").glob("*/*/summary.json")):
            try:
                results.append(RunResult.load(summary.parent))
            except (UnreadableFile, ValueError, KeyError, TypeError):
                continue
        got, bad = pairs_from_results(results, first, second)
        pairs += got
        for k, v in bad.items():
            failed[k] = failed.get(k, 0) + v
        found = ab_test(first, second, pairs, margin=margin, look=look, max_looks=looks, failed=failed)
        if found.decision and found.verdict != "undecided":
            break
        d = found.the_decision()
        log(f"A/B: pair {len(pairs)} of at most {max_pairs}: {found.verdict}"
            + (f", waiting for the interval {d.low:+.1%}…{d.high:+.1%} to leave 0 or fit inside ±{margin:.1%}"
               if d and d.low is not None else ""))
        if not got and failed:
            break  # a build that fails every run: more pairs cannot help
    write_json_atomic(out_dir / "ab.json", {"schema": 1, "verdicts": [
        {"recipe": recipes[0].name, **found.to_dict(), "text": found.text()}]})
    page = Page(title=f"A/B of two builds: {first} against {second}", blocks=[
        Paragraph(f"**{recipes[0].name}: {found.text()}**"),
        Paragraph(f"Sequential: {len(pairs)} alternated pairs over {look} look(s) of at most {looks} "
                  f"(--max-pairs {max_pairs}); each look's runs and report are in {out_dir}/look-<k>.", muted=True)])
    outcome = write_page(page, out_dir, stem="ab")
    outcome.exit_code = outcome.exit_code or (0 if found.verdict in ("same", "slower", "faster") else 1)
    return outcome
