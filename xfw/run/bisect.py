"""Bisect: from a regression between two builds to the first build that has it (docs/builds.md).

``xfw bisect RECIPE --builds FILE --good G --bad B``. FILE lists builds in order, one instance a line
as ``--backends`` writes them (``paddle@3.2.0``, ``paddle@nightly-1102=/opt/nightly-1102/bin/python``;
a ``#`` at the start of a line or after a space or tab starts a comment: ``#`` inside a path is the path's,
``=/opt/build#3/bin/python``). The decision rule, stated in every report:

1. A/B the bad build against the good one (``xfw.report.ab``: alternated pairs, paired t-test on log
   ratios, two-sided, alpha 0.05). No significant change: nothing to bisect, and the bisect says so.
   A change sets the direction searched for (slower, or faster).
2. While builds lie strictly between the last build known to be without the change and the first
   known to have it: A/B the middle one against the *good* build. The same change, significant and
   in the same direction: the middle build has it; otherwise (no change, or the other direction) it
   has not. A build that fails to build, import or run is recorded with its reason and skipped: the
   next untried build nearest the middle is tried instead.
3. The first build with the change is the one where the two meet.

So n builds take at most ceil(log2 n) + 1 A/B decisions (skipped builds add theirs). Each decision
is an ordinary ``compare --ab`` directory under ``OUT/ab-<build>/``; ``OUT/bisect.json`` holds every
decision as it is made, so a killed bisect resumes where it stopped.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from xfw.run import instances


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
    """One A/B of a build against the good build."""

    build: str
    position: int
    verdict: str
    """``slower`` | ``faster`` | ``no change`` | ``no verdict`` | ``skipped``."""
    ratio: float | None = None
    low: float | None = None
    high: float | None = None
    p_value: float | None = None
    detectable: float | None = None
    pairs: int = 0
    reason: str = ""
    """Why a build was skipped (it did not build, import or run)."""
    directory: str = ""
    has_change: bool | None = None
    """Whether this build has the change searched for (None: skipped)."""


@dataclass
class Bisect:
    builds: list[str]
    good: str
    bad: str
    decisions: list[Decision] = field(default_factory=list)
    direction: str = ""
    """The change searched for: ``slower`` or ``faster`` (the bad build's against the good)."""
    last_good: str = ""
    first_bad: str = ""
    outcome: str = ""
    """``found`` | ``no change`` (bad is not distinguishable from good) | ``undecided`` (skipped builds)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def max_decisions(self) -> int:
        lo, hi = self.builds.index(self.good), self.builds.index(self.bad)
        return math.ceil(math.log2(max(hi - lo, 1))) + 1


Decide = Callable[[str, int], Decision]
"""An A/B of build (name, position) against the good build."""


def search(builds: list[str], good: str, bad: str, decide: Decide,
           log: Callable[[str], None] = lambda _l: None) -> Bisect:
    """The search itself (module docstring, steps 1-3), with ``decide`` running each A/B."""
    out = Bisect(builds=list(builds), good=good, bad=bad)
    lo, hi = builds.index(good), builds.index(bad)
    log(f"bisect: step 1 (of at most {out.max_decisions}): {bad} against {good}")
    first = decide(bad, hi)
    out.decisions.append(first)
    if first.verdict not in ("slower", "faster"):
        out.outcome = "no change" if first.verdict != "skipped" else "undecided"
        out.last_good, out.first_bad = good, bad
        return out
    out.direction = first.verdict
    first.has_change = True
    skipped: set[int] = set()
    while hi - lo > 1:
        untried = [i for i in range(lo + 1, hi) if i not in skipped]
        if not untried:
            out.outcome = "undecided"
            break
        middle = (lo + hi) / 2
        position = min(untried, key=lambda i: (abs(i - middle), i))
        log(f"bisect: step {len(out.decisions) + 1}: {builds[position]} against {good} "
            f"(between {builds[lo]} and {builds[hi]})")
        decision = decide(builds[position], position)
        out.decisions.append(decision)
        if decision.verdict == "skipped":
            skipped.add(position)
            continue
        decision.has_change = decision.verdict == out.direction
        if decision.has_change:
            hi = position
        else:
            lo = position
    out.last_good, out.first_bad = builds[lo], builds[hi]
    out.outcome = out.outcome or "found"
    return out
