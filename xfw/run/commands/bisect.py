"""Bisect: from a change between two builds to the first build that has it, never naming a wrong one
(docs/builds.md).

``xfw bisect RECIPE --builds FILE --good G --bad B``. FILE lists builds in order, one instance a line
as ``--backends`` writes them (``paddle@3.2.0``, ``paddle@nightly-1102=/opt/nightly-1102/bin/python``;
a ``#`` at the start of a line or after a space or tab starts a comment: ``#`` inside a path is the path's,
``=/opt/build#3/bin/python``). Every judgement is a decision of the one model (xfw.report.decision:
paired log ratios of ips, an interval, the margin δ ``--margin``), with alternated pairs added look by
look while it is undecided (``--repeat auto --max-pairs N``; alpha spent across looks):

1. The ends: the bad build against the good one. *Same within δ*: nothing to bisect. *Slower* or
   *faster*: that is the change searched for. *Undecided* when the budget is spent: the bisect says so,
   with the pairs it would need — never "nothing to bisect".
2. While builds lie strictly between the last build known to be like the good one and the first known
   to be like the bad one: the middle build is judged against *both* ends (alternated runs of it, the
   good and the bad build). It is *like bad* when it differs from the good build in the change's
   direction, or is the same as the bad one within δ, and is not decidedly on the good side of the bad
   build; *like good* the other way round. Neither, when the budget is spent: the search stops and reports
   the range of builds it could not split. A build that fails to build, import or run is skipped with
   its reason and the nearest untried build is tried instead.
3. Confirmation: the last build like the good one against the first like the bad one, an A/B of their
   own. Only when it decides the change (in its direction) is that build named; otherwise the result is
   the range between them, with what the confirmation would need.

Positions count from 1, as in the builds file and on the page. ``OUT/bisect.json`` holds every pair's
log ratios as they are measured, so a killed bisect resumes where it stopped.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from xfw.run.launch import instances


class BisectError(ValueError):
    """A build list or a --good/--bad that cannot be bisected; one line naming the file or flag."""


@dataclass(frozen=True)
class BuildList:
    path: str
    builds: tuple[instances.Instance, ...]

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.builds]


_COMMENT = re.compile(r"(?:^|[ \t])#")


def strip_comment(line: str) -> str:
    """A builds-file line without its comment: from a ``#`` at the line's start or after a space or tab
    (never one inside a path or label), stripped."""
    found = _COMMENT.search(line)
    return (line[:found.start()] if found else line).strip()


def read_builds(path: str | Path) -> BuildList:
    """The build list FILE, checked: every line an instance, no name twice, one adapter."""
    from xfw.contract.atomic import UnreadableFile, read_bounded

    try:
        text = read_bounded(Path(path), 1 << 20, within="/").decode("utf-8")
    except FileNotFoundError:
        raise BisectError(f"--builds {path}: no such file") from None
    except (UnreadableFile, UnicodeDecodeError) as err:
        raise BisectError(f"--builds {err}" if isinstance(err, UnreadableFile) else
                          f"--builds {path}: not UTF-8 text") from None
    builds, seen = [], {}
    for number, line in enumerate(text.splitlines(), 1):
        line = strip_comment(line)
        if not line:
            continue
        try:
            build = instances.parse(line, flag=f"--builds {path}:{number}:")
        except instances.InstanceError as err:
            raise BisectError(str(err)) from None
        if build.name in seen:
            raise BisectError(f"--builds {path}:{number}: {build.name!r} is listed twice (first on line {seen[build.name]})")
        seen[build.name] = number
        builds.append(build)
    if len(builds) < 2:
        raise BisectError(f"--builds {path}: lists {len(builds)} build(s); a bisect needs at least two")
    adapters = sorted({b.adapter for b in builds})
    if len(adapters) > 1:
        raise BisectError(f"--builds {path}: builds of {', '.join(adapters)}; a bisect searches the builds of one "
                          "framework")
    return BuildList(str(path), tuple(builds))


def check_ends(builds: BuildList, good: str, bad: str) -> tuple[int, int]:
    """The positions of --good and --bad in the list; good must come first."""
    if good == bad:
        raise BisectError(f"--good {good} and --bad {bad} are the same build")
    for flag, name in (("--good", good), ("--bad", bad)):
        if name not in builds.names:
            raise BisectError(f"{flag} {name}: not a build of {builds.path} ({', '.join(builds.names)})")
    lo, hi = builds.names.index(good), builds.names.index(bad)
    if lo > hi:
        raise BisectError(f"--good {good} comes after --bad {bad} in {builds.path} (line order is build order: "
                          "the good build must be the older one)")
    return lo, hi


@dataclass
class Decision:
    """One judgement: a build against the good and bad builds, the ends, or the confirmation."""

    build: str
    position: int
    """1-based, as in the builds file and on the page."""
    verdict: str
    """ends/confirm: ``slower`` | ``faster`` | ``same`` | ``undecided``; a step: ``like good`` |
    ``like bad`` | ``undecided``; any: ``skipped``."""
    role: str = "step"
    """``ends`` (bad against good), ``step`` (a build against both ends), ``confirm`` (last good against first bad)."""
    against: list[str] = field(default_factory=list)
    pairs: int = 0
    looks: int = 0
    vs: dict = field(default_factory=dict)
    """Reference build -> its Decision (xfw.report.decision.Decision.to_dict) of this build against it."""
    reason: str = ""
    """Why a build was skipped (it did not build, import or run)."""
    directory: str = ""
    has_change: bool | None = None

    def detectable(self) -> float | None:
        found = [v.get("detectable") for v in self.vs.values() if v.get("detectable") is not None]
        return max(found) if found else None


@dataclass
class Bisect:
    builds: list[str]
    good: str
    bad: str
    margin: float
    max_pairs: int
    decisions: list[Decision] = field(default_factory=list)
    direction: str = ""
    """The change searched for: ``slower`` or ``faster`` (the bad build's against the good)."""
    last_good: str = ""
    first_bad: str = ""
    outcome: str = ""
    """``found`` (a decided adjacent pair) | ``same`` (bad is the good one within δ: nothing to bisect) |
    ``undecided`` (the ends could not be decided within the budget) | ``range`` (builds it could not split,
    between ``last_good`` and ``first_bad``)."""
    alpha: float = 0.05
    """Each judgement's alpha: 0.05 over the most judgements this bisect can take."""
    why: str = ""
    """For ``undecided`` and ``range``: what could not be decided and what it would need."""

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def max_decisions(self) -> int:
        lo, hi = self.builds.index(self.good), self.builds.index(self.bad)
        return math.ceil(math.log2(max(hi - lo, 1))) + 2


class Skipped(Exception):
    """A build that did not build, import or run: the reason, one line."""


Measure = Callable[[str, tuple, int], dict]
"""``measure(build, references, look)``: after alternated runs of look ``look`` (1, 2, ...), every pair's
log ratio ln(ips_build / ips_reference) so far, per reference: {reference: [log ratios]}. Raises Skipped."""


@dataclass(frozen=True)
class Plan:
    """The pairs: ``start`` at the first look, ``step`` more at each later one, at most ``max_pairs``."""

    start: int
    max_pairs: int
    step: int = 2
    margin: float = 0.05
    alpha: float = 0.05
    """The chance of any wrong judgement in the whole bisect: each judgement gets alpha / the most
    judgements it can take (Bonferroni across steps), each look its share of that (alpha spending)."""

    @property
    def max_looks(self) -> int:
        return 1 + math.ceil(max(self.max_pairs - self.start, 0) / self.step)


def _judge(build: str, references: tuple, measure: Measure, plan: Plan, classify, log, position: int,
           role: str) -> Decision:
    from xfw.report.decision import decide

    out = Decision(build=build, position=position, verdict="undecided", role=role, against=list(references))
    for look in range(1, plan.max_looks + 1):
        try:
            ratios = measure(build, references, look)
        except Skipped as err:
            out.verdict, out.reason = "skipped", str(err)
            return out
        out.looks, out.pairs = look, min(len(r) for r in ratios.values())
        out.vs = {ref: decide(ratios[ref], margin=plan.margin, higher_is_worse=False, look=look,
                              max_looks=plan.max_looks, alpha=plan.alpha).to_dict() for ref in references}
        out.verdict = classify(out.vs)
        log(f"bisect: {build}: pair {out.pairs} of at most {plan.max_pairs}: {out.verdict}"
            + ("" if out.verdict != "undecided" else " — waiting for " + "; ".join(
                f"against {ref}: interval {_pct(v['low'])}…{_pct(v['high'])}, margin ±{100 * plan.margin:.1f}%"
                for ref, v in out.vs.items() if v.get("low") is not None)))
        if out.verdict != "undecided":
            break
    return out


def _pct(x) -> str:
    return "?" if x is None else f"{100 * x:+.1f}%"


def _ab_verdict(vs: dict) -> str:
    (d,) = vs.values()
    return {"worse": "slower", "better": "faster"}.get(d["outcome"], d["outcome"])


def needs(decision: Decision) -> str:
    """What an undecided judgement would need, in words."""
    parts = []
    for ref, v in decision.vs.items():
        if v["outcome"] == "undecided":
            need = f"about {v['needed']} pairs" if v.get("needed") else "more pairs than it can estimate"
            seen = f", smallest change it could see {100 * v['detectable']:.0f}%" if v.get("detectable") else ""
            parts.append(f"against {ref}: {need} (had {v['n']}{seen})")
    return "; ".join(parts) or "more pairs"


def search(builds: list[str], good: str, bad: str, measure: Measure, plan: Plan,
           log: Callable[[str], None] = lambda _l: None) -> Bisect:
    """The search (module docstring, steps 1-3), with ``measure`` running the alternated pairs."""
    out = Bisect(builds=list(builds), good=good, bad=bad, margin=plan.margin, max_pairs=plan.max_pairs)
    lo, hi = builds.index(good), builds.index(bad)
    plan = replace(plan, alpha=plan.alpha / out.max_decisions)
    out.alpha = plan.alpha
    log(f"bisect: step 1: {bad} against {good} (up to {plan.max_pairs} pairs)")
    ends = _judge(bad, (good,), measure, plan, _ab_verdict, log, hi + 1, "ends")
    out.decisions.append(ends)
    out.last_good, out.first_bad = good, bad
    if ends.verdict == "skipped":
        out.outcome, out.why = "undecided", f"{bad} did not run: {ends.reason}"
        return out
    if ends.verdict == "same":
        out.outcome = "same"
        return out
    if ends.verdict == "undecided":
        out.outcome, out.why = "undecided", needs(ends)
        return out
    out.direction = ends.verdict
    ends.has_change = True
    toward, away = ("worse", "better") if out.direction == "slower" else ("better", "worse")

    def classify(vs: dict) -> str:
        g, b = vs[good]["outcome"], vs[bad]["outcome"]
        if (g == toward or b == "same") and b != away and g != "same":
            return "like bad"
        if (g == "same" or b == away) and g != toward and b != "same":
            return "like good"
        return "undecided"

    skipped: set[int] = set()
    while hi - lo > 1:
        untried = [i for i in range(lo + 1, hi) if i not in skipped]
        if not untried:
            break
        middle = (lo + hi) / 2
        position = min(untried, key=lambda i: (abs(i - middle), i))
        log(f"bisect: step {len(out.decisions) + 1}: {builds[position]} against both ends "
            f"(between {builds[lo]} and {builds[hi]})")
        decision = _judge(builds[position], (good, bad), measure, plan, classify, log, position + 1, "step")
        out.decisions.append(decision)
        if decision.verdict == "skipped":
            skipped.add(position)
            continue
        if decision.verdict == "undecided":
            out.last_good, out.first_bad = builds[lo], builds[hi]
            out.outcome = "range"
            out.why = f"{builds[position]} could not be judged within {plan.max_pairs} pairs ({needs(decision)})"
            return out
        decision.has_change = decision.verdict == "like bad"
        if decision.has_change:
            hi = position
        else:
            lo = position
    out.last_good, out.first_bad = builds[lo], builds[hi]
    if hi - lo > 1:
        out.outcome, out.why = "range", "every build between them was skipped (see each reason)"
        return out
    if (lo, hi) == (builds.index(good), builds.index(bad)):
        confirm = ends  # the ends are the adjacent pair: already decided
    else:
        log(f"bisect: confirmation: {builds[hi]} against {builds[lo]}")
        confirm = _judge(builds[hi], (builds[lo],), measure, plan, _ab_verdict, log, hi + 1, "confirm")
        out.decisions.append(confirm)
    if confirm.verdict == out.direction:
        confirm.has_change = True
        out.outcome = "found"
    else:
        out.outcome = "range"
        out.why = (f"the confirmation {builds[hi]} against {builds[lo]} did not decide the change ("
                   + (confirm.reason if confirm.verdict == "skipped" else
                      f"it says {confirm.verdict}; {needs(confirm)}") + ")")
    return out
