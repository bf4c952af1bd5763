"""A/B of two builds: paired runs, the ratio with its interval, the smallest change this many pairs
could have seen, and a verdict (docs/builds.md).

``xfw compare RECIPE --backends B,A --ab --repeat N`` runs the two instances alternately, A B B A A B
..., so a machine that drifts during the command (thermal, a neighbour's load) moves both sides of a
pair alike; repeat k of one side pairs with repeat k of the other. The statistic is each pair's log
ratio ``d_k = ln(ips_first_k / ips_second_k)``::

    mean d, its standard error s/sqrt(n); the ratio exp(mean d) with the 95% interval exp(mean d +- t(0.975, n-1) s/sqrt(n))
    the test: the paired t-test on d, two-sided, at alpha = 0.05: a change when the interval excludes 1
    the smallest detectable change: exp((t(1 - alpha/2, n-1) + t(0.80, n-1)) s/sqrt(n)) - 1, the change
    this test finds 80% of the time with this noise and this many pairs

By construction the test calls *no change* a change in 5% of A/Bs (its false-positive rate, checked
over repeated same-build A/Bs by ``benchmarks/ab_false_positives.py``). Log ratios, not differences:
a slowdown is a factor whatever the machine's speed, and the interval is symmetric on that scale.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

ALPHA = 0.05
POWER = 0.80
MIN_PAIRS = 3
"""Fewer pairs give no verdict: two pairs leave one degree of freedom (t = 12.7), an interval too wide to use."""


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
    p_value: float | None = None
    detectable: float | None = None
    """The smallest relative change (0.05 = 5%) this many pairs detect with 80% power at this noise."""
    verdict: str = "no verdict"
    """``no change`` | ``slower`` | ``faster`` | ``no verdict``."""
    alpha: float = ALPHA

    @property
    def changed(self) -> bool:
        return self.verdict in ("slower", "faster")

    def text(self) -> str:
        """One line: the verdict with its ratio, interval, test and what it could have detected."""
        if self.ratio is None:
            return (f"A/B {self.first} against {self.second}: no verdict from {self.pairs} pair(s) (needs "
                    f"{MIN_PAIRS}; --repeat {max(MIN_PAIRS, 5)} gives one)")
        conf = f"{100 * (1 - self.alpha):g}%"
        measured = (f"ratio {self.ratio:.3f} ({conf} CI {self.low:.3f}–{self.high:.3f}, paired t-test on log ratios, "
                    f"two-sided, alpha {self.alpha:g}, p = {self.p_value:.3g}, {self.pairs} pairs run A B B A; "
                    f"smallest change detectable at 80% power: {100 * self.detectable:.1f}%)")
        if self.verdict == "no change":
            return f"A/B: no change within noise between {self.first} and {self.second}: {measured}"
        change = abs(self.ratio - 1) if self.verdict == "faster" else abs(1 - self.ratio)
        return f"A/B: {self.first} {self.verdict} than {self.second} by {100 * change:.1f}%: {measured}"

    def to_dict(self) -> dict:
        return {**asdict(self), "changed": self.changed}


def _t(q: float, df: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(q, df))


def ab_test(first: str, second: str, pairs: list[tuple[float, float]], alpha: float = ALPHA) -> ABResult:
    """The verdict on ``pairs`` of (ips of first, ips of second), one per alternation."""
    pairs = [(a, b) for a, b in pairs if a and b and a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b)]
    out = ABResult(first=first, second=second, pairs=len(pairs), ratios=[a / b for a, b in pairs], alpha=alpha)
    if len(pairs) < MIN_PAIRS:
        return out
    logs = [math.log(r) for r in out.ratios]
    n, mean = len(logs), statistics.fmean(logs)
    se = statistics.stdev(logs) / math.sqrt(n)
    half = _t(1 - alpha / 2, n - 1) * se
    out.ratio, out.low, out.high = math.exp(mean), math.exp(mean - half), math.exp(mean + half)
    if se == 0:
        out.p_value = 1.0 if mean == 0 else 0.0
    else:
        from scipy import stats

        out.p_value = float(2 * stats.t.sf(abs(mean) / se, n - 1))
    out.detectable = math.exp((_t(1 - alpha / 2, n - 1) + _t(POWER, n - 1)) * se) - 1
    out.verdict = "no change" if out.p_value >= alpha else ("slower" if mean < 0 else "faster")
    return out


def ab_from_results(results, first: str, second: str, alpha: float = ALPHA) -> ABResult:
    """Pair the two builds' runs by repeat index (failed runs leave their pair out)."""
    by = {}
    for r in results:
        if r.backend in (first, second) and r.ok and r.measurement.ips is not None:
            by.setdefault(r.repeat_index, {})[r.backend] = r.measurement.ips
    pairs = [(v[first], v[second]) for _, v in sorted(by.items()) if first in v and second in v]
    return ab_test(first, second, pairs, alpha)
