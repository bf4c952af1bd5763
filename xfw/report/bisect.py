"""The bisect report: every A/B decision with its measured ratio, and the build it ends at (docs/builds.md)."""

from __future__ import annotations

from xfw.report.ab import ALPHA
from xfw.report.table import Bullets, Heading, Page, Paragraph, Table


RULE = (f"Decision rule: each step is an A/B of one build against the good build (alternated pairs A B B A, paired "
        f"t-test on the log ratio of their ips, two-sided, alpha {ALPHA:g}). Step 1 judges the bad build and sets the "
        "direction searched for; a later build has the change when its A/B is significant in that direction, and the "
        "search halves the builds between the last without it and the first with it. A build that fails to build, "
        "import or run is skipped with its reason and the nearest untried build is tried instead.")


def headline(result) -> str:
    """``result``: an xfw.run.bisect.Bisect."""
    if result.outcome == "no change":
        first = result.decisions[0]
        why = first.reason or f"ratio {first.ratio:.3f}" if first.ratio is not None else first.reason
        return (f"No significant change between {result.good} and {result.bad} ({why}): nothing to bisect. A "
                "regression seen elsewhere was noise here, or needs more pairs (--repeat).")
    if result.outcome == "undecided":
        return (f"Undecided: the change is between {result.last_good} and {result.first_bad}, but the builds between "
                "them could not be judged (skipped; see each reason).")
    change = next(d for d in result.decisions if d.build == result.first_bad)
    size = f" by {100 * abs(1 - change.ratio):.1f}% (ratio {change.ratio:.3f})" if change.ratio else ""
    return (f"First build with the change ({result.direction}{size} against {result.good}): {result.first_bad}; "
            f"the last build without it: {result.last_good}. {len(result.decisions)} A/B decisions "
            f"(at most {result.max_decisions} without skipped builds).")


def bisect_page(result, recipe: str, planted: list[str] = ()) -> Page:
    cells, records = [], []
    for step, d in enumerate(result.decisions, 1):
        ratio = f"{d.ratio:.3f} [{d.low:.3f}, {d.high:.3f}]" if d.ratio is not None and d.low is not None else "–"
        has = {True: "has the change", False: "has not", None: "skipped" if d.verdict == "skipped" else "–"}[d.has_change]
        record = {"step": step, "build": d.build, "position": d.position + 1, "ratio_ci95": ratio,
                  "p_value": f"{d.p_value:.3g}" if d.p_value is not None else "–", "pairs": d.pairs,
                  "verdict": d.verdict,
                  "decision": has if step > 1 else f"sets the direction: {d.verdict}" if d.verdict in ("slower", "faster")
                  else "nothing to bisect" if d.verdict == "no change" else f"cannot start ({d.verdict})",
                  "note": d.reason or d.directory}
        cells.append(list(record.values()))
        records.append(record)
    blocks: list = [Paragraph(f"**Bisect of {recipe} over {len(result.builds)} builds of one framework, "
                              f"{result.good} (good) to {result.bad} (bad): {headline(result)}**")]
    if planted:
        blocks.append(Paragraph(f"**Planted: {', '.join(planted)} carry a change put there on purpose (their build "
                                "line says how); this bisect demonstrates the search, it does not find a real "
                                "regression in them.**"))
    blocks += [Table(header=["Step", "Build", "Position", "Ratio (95% CI), build / good", "p", "Pairs", "Verdict",
                             "Decision", "Note / directory"], cells=cells, records=records, name="bisect"),
               Paragraph(RULE, muted=True),
               Heading("Builds, in order", 3),
               Bullets([f"position {i + 1}: {name}" + (" (good)" if name == result.good else " (bad)"
                                                        if name == result.bad else "")
                        for i, name in enumerate(result.builds)], name="builds")]
    return Page(title="Bisect", blocks=blocks)
