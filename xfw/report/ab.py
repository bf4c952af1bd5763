"""A/B of two builds: paired runs, decided by the one decision model (xfw.report.decision, docs/builds.md).

``xfw compare RECIPE --backends B,A --ab --repeat N`` runs the two instances alternately, A B B A A B
..., so a machine that drifts during the command (thermal, a neighbour's load) moves both sides of a
pair alike; repeat k of one side pairs with repeat k of the other. The statistic is each pair's log
ratio ``d_k = ln(ips_first_k / ips_second_k)``, decided by :func:`xfw.report.decision.decide` with a
relative ips margin δ (``--margin``, default :data:`MARGIN`)::

    same       the interval of exp(mean d) - 1 lies inside ±δ (two one-sided tests)
    slower     the interval excludes 0 on the slower side ("slower by at least <near bound>")
    faster     the interval excludes 0 on the faster side
    undecided  neither: about N pairs in all would decide it (``--repeat auto`` adds them)

The table cell and the verdict line are both this one Decision (:meth:`ABResult.cell`, :meth:`ABResult.text`).
A failed run leaves its pair out; a build that fails every run gets no decision and says why, not "more pairs".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from xfw.report.decision import ALPHA, Decision, decide

MARGIN = 0.05
"""The default ``--margin``: a relative ips difference under 5% counts as the same (docs/builds.md says why)."""
MIN_PAIRS = 3
"""Fewer pairs give no verdict: two pairs leave one degree of freedom (t = 12.7), an interval too wide to use."""
OUTCOME_WORDS = {"worse": "slower", "better": "faster", "same": "same", "undecided": "undecided"}


@dataclass
class ABResult:
    first: str
    """The build judged (the contrast's first side, e.g. the new build)."""
    second: str
    """The build it is judged against (the baseline)."""
    pairs: int
    ratios: list[float]
    """Each pair's ips(first) / ips(second), in run order."""
    ratio: float | None = None
    low: float | None = None
    high: float | None = None
    detectable: float | None = None
    """The smallest relative change (0.05 = 5%) this many pairs detect with 80% power at this noise."""
    verdict: str = "no verdict"
    """``same`` | ``slower`` | ``faster`` | ``undecided`` | ``no verdict`` (fewer than MIN_PAIRS pairs)."""
    alpha: float = ALPHA
    margin: float = MARGIN
    failed: dict[str, int] = field(default_factory=dict)
    """Runs that did not succeed, per build: a build failing every run is no matter of pairs."""
    decision: dict | None = None
    """The Decision (xfw.report.decision) this verdict is, as a dict."""

    @property
    def changed(self) -> bool:
        return self.verdict in ("slower", "faster")

    def the_decision(self) -> Decision | None:
        return Decision.from_dict(self.decision) if self.decision else None

    def cell(self) -> str:
        """The table's contrast cell, from the same Decision as :meth:`text`."""
        d = self.the_decision()
        if d is None or d.estimate is None:
            return "no verdict"
        return f"{d.estimate:+.1%} ({self.verdict})"

    def text(self) -> str:
        """One line: the verdict with its interval, n, level, margin and what it could have detected."""
        if self.decision is None:
            crashed = [b for b in (self.first, self.second) if self.failed.get(b) and self.pairs == 0]
            if crashed:
                return (f"A/B {self.first} against {self.second}: no verdict: {', '.join(crashed)} did not run "
                        f"successfully in any of its runs (see each run's status); more pairs cannot help, fix the "
                        "build first")
            return (f"A/B {self.first} against {self.second}: no verdict from {self.pairs} pair(s) (needs "
                    f"{MIN_PAIRS}; --repeat {max(MIN_PAIRS, 5)} or --repeat auto gives one)")
        line = self.the_decision().phrase(self.second, self.first, worse="slower", better="faster",
                                         quantity="ips ratio")
        return f"A/B: {line}"

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {**asdict(self), "changed": self.changed}


def ab_test(first: str, second: str, pairs: list[tuple[float, float]], alpha: float = ALPHA,
            margin: float = MARGIN, look: int = 1, max_looks: int = 1,
            failed: dict[str, int] | None = None) -> ABResult:
    """The decision on ``pairs`` of (ips of first, ips of second), one per alternation; look ``look`` of
    at most ``max_looks`` (``--repeat auto``) spends its share of alpha (xfw.report.decision.spend)."""
    pairs = [(a, b) for a, b in pairs if _ok(a) and _ok(b)]
    out = ABResult(first=first, second=second, pairs=len(pairs), ratios=[a / b for a, b in pairs], alpha=alpha,
                   margin=margin, failed=dict(failed or {}))
    if len(pairs) < MIN_PAIRS:
        return out
    d = decide([math.log(r) for r in out.ratios], margin=margin, higher_is_worse=False, alpha=alpha,
               look=look, max_looks=max_looks)
    out.decision = d.to_dict()
    out.verdict = OUTCOME_WORDS[d.outcome]
    out.ratio = 1 + d.estimate
    out.low = None if d.low is None else 1 + d.low
    out.high = None if d.high is None else 1 + d.high
    out.detectable = d.detectable
    return out


def _ok(x) -> bool:
    return bool(x) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def pairs_from_results(results, first: str, second: str) -> tuple[list[tuple[float, float]], dict[str, int]]:
    """Pair the two builds' runs by repeat index (a failed run leaves its pair out); failed runs per build."""
    by, failed = {}, {}
    for r in results:
        if r.backend not in (first, second):
            continue
        if r.ok and r.measurement.ips is not None:
            by.setdefault(r.repeat_index, {})[r.backend] = r.measurement.ips
        else:
            failed[r.backend] = failed.get(r.backend, 0) + 1
    return [(v[first], v[second]) for _, v in sorted(by.items()) if first in v and second in v], failed


def ab_from_results(results, first: str, second: str, alpha: float = ALPHA, margin: float = MARGIN) -> ABResult:
    pairs, failed = pairs_from_results(results, first, second)
    return ab_test(first, second, pairs, alpha, margin=margin, failed=failed)
