"""The bisect report: every judgement with its interval, pairs and smallest detectable change, and the
build (or the range of builds) it ends at (docs/builds.md)."""

from __future__ import annotations

from xfw.report.table import Bullets, Heading, Page, Paragraph, Table


def rule(result) -> str:
    return (f"Decision rule (xfw.report.decision): every judgement is a paired t interval of the log ratio of ips over "
            f"alternated pairs, margin ±{100 * result.margin:.1f}% (the same within it), at most {result.max_pairs} "
            "pairs, alpha 0.05 spent across looks. Step 1: the bad build against the good one sets the change searched "
            "for. Each later build is run against BOTH ends: like the bad build (it differs from the good one in the "
            "change's direction, or is the same as the bad one, and is not decidedly on the good side of it) or like "
            "the good one (the mirror rule); undecided after the budget stops the search at a range. The last build "
            "like the good one and the first like the bad one are confirmed by an A/B of their own; a single culprit "
            "is named only when that confirmation decides the change. A build that fails to build, import or run is "
            "skipped with its reason.")


def _d(decision, ref):
    from xfw.report.decision import Decision

    return Decision.from_dict(decision.vs[ref]) if ref in decision.vs else None


def headline(result) -> str:
    """``result``: an xfw.run.commands.bisect.Bisect."""
    ends = result.decisions[0] if result.decisions else None
    end = _d(ends, result.good) if ends else None
    if result.outcome == "same":
        return (f"No change to bisect: {end.phrase(result.good, result.bad, worse='slower', better='faster')}.")
    if result.outcome == "undecided":
        said = f" {end.phrase(result.good, result.bad, worse='slower', better='faster')}." if end else ""
        return (f"Undecided: {result.bad} against {result.good} could not be decided within {result.max_pairs} pairs "
                f"({result.why}): no change is not shown either. Next: {next_step(result)}.{said}")
    if result.outcome == "range":
        return (f"Undecided within {result.last_good} … {result.first_bad}: the change ({result.direction}) lies after "
                f"{result.last_good} and at or before {result.first_bad}, builds this bisect could not split: "
                f"{result.why}. No single build is named. Next: {next_step(result)}.")
    confirm = next(d for d in reversed(result.decisions) if d.role in ("confirm", "ends") and d.has_change)
    line = _d(confirm, confirm.against[0]).phrase(confirm.against[0], confirm.build, worse="slower", better="faster")
    return (f"First build with the change: {result.first_bad}; the last build without it: {result.last_good}. "
            f"Confirmed: {line}. {len(result.decisions)} judgements.")


def next_step(result) -> str:
    """What applies after an undecided bisect: the same builds (or the range it could not split) with more pairs,
    in another directory (this one's bisect.json is keyed by its --max-pairs and refuses other settings)."""
    pairs_help = any(d.verdict == "undecided" or (d.role == "confirm" and d.verdict != "skipped" and not d.has_change)
                     for d in result.decisions)
    if not pairs_help:  # only builds that did not run stand in the way
        return "fix the builds that did not build or run (each one's reason is in the table), then bisect again"
    good, bad = (result.good, result.bad) if result.outcome == "undecided" else (result.last_good, result.first_bad)
    return (f"`xfw bisect RECIPE --builds FILE --good {good} --bad {bad} --repeat auto --max-pairs "
            f"{2 * result.max_pairs} --out ANOTHER_DIR` (more pairs; a new --out, as this one's bisect.json holds "
            "these settings)")


def _cell(d) -> str:
    if d is None:
        return "–"
    if d.low is None:
        return f"{d.estimate:+.1%}" if d.estimate is not None else "–"
    return f"{d.estimate:+.1%} [{d.low:+.1%}, {d.high:+.1%}] {d.outcome}"


def bisect_page(result, recipe: str, planted: list[str] = ()) -> Page:
    cells, records = [], []
    for step, d in enumerate(result.decisions, 1):
        refs = d.against or [result.good]
        vs_good = _d(d, refs[0])
        vs_bad = _d(d, result.bad) if d.role == "step" else None
        detect = d.detectable()
        record = {"step": step, "role": d.role, "build": d.build, "position": d.position,
                  "against": ", ".join(refs),
                  "build / first reference (interval)": _cell(vs_good),
                  "build / bad (interval)": _cell(vs_bad), "pairs": d.pairs,
                  "smallest detectable": f"{100 * detect:.1f}%" if detect is not None else "–",
                  "verdict": d.verdict, "note": d.reason or d.directory}
        cells.append(list(record.values()))
        records.append(record)
    blocks: list = [Paragraph(f"**Bisect of {recipe} over {len(result.builds)} builds of one framework, "
                              f"{result.good} (good) to {result.bad} (bad): {headline(result)}**")]
    if planted:
        blocks.append(Paragraph(f"**Planted: {', '.join(planted)} carry a change put there on purpose (their build "
                                "line says how); this bisect demonstrates the search, it does not find a real "
                                "regression in them.**"))
    header = list(records[0]) if records else ["step"]
    blocks += [Table(header=header, cells=cells, records=records, name="bisect"),
               Paragraph(rule(result), muted=True),
               Heading("Builds, in order (positions count from 1, as in the table and bisect.json)", 3),
               Bullets([f"position {i + 1}: {name}" + (" (good)" if name == result.good else " (bad)"
                                                        if name == result.bad else "")
                        for i, name in enumerate(result.builds)], name="builds")]
    framework = result.builds[0].partition("@")[0] if result.builds else "one framework"
    return Page(title=f"Bisect over {len(result.builds)} builds of {framework}: {recipe}", blocks=blocks)
