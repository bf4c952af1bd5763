"""The one decision model behind every verdict xfw gives: converge, ``--ab``, bisect, nightly.

Given paired observations of two sides A and B (a converge seed's two eval losses from one start and
the same batches; an A/B's alternated pair of ips), the question is one of three answers::

    same       B and A are the same within the margin δ   (the interval lies inside ±δ)
    worse      B is worse than A by at least x            (the interval excludes 0 on the worse side)
    better     B is better than A by at least x           (two-sided questions only)
    undecided  neither yet; about N observations in all would decide it

>>> d = decide(log_ratios([3.10, 3.05, 3.12], [3.32, 3.27, 3.35]), margin=0.02, higher_is_worse=True)
>>> d.outcome, round(d.estimate, 3)
('worse', 0.072)

The statistic is each pair's log ratio ``ln(B_i / A_i)`` (a relative difference, symmetric on that
scale); the interval is the paired t interval of their mean, at level 1 - α for a two-sided question
and 1 - 2α when only "is B worse?" is asked (then each bound is a one-sided test at α: the upper
bound below δ is MLPerf-style non-inferiority, the lower bound above 0 a one-sided test of "worse").
"same" needs the whole interval inside ±δ — two one-sided tests (TOST) — so a consistent difference
far below the margin (fp32 rounding, ~1e-6) is "same", and too few observations are never "same":
they are "undecided" with what they would need. A non-finite observation means a side diverged
there; it is a result for that side and decides against it, never dropped.

Sequential runs (``--seeds auto``, ``--repeat auto``) look after every added observation. Each look
k of at most K gets its own share of α (``spend``: the Kim–DeMets power family, ρ = 2, so early looks
get little) and is tested at that share alone: by Bonferroni over looks, the chance of any wrong claim
across all looks stays at most α whatever the looks found.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from functools import lru_cache

ALPHA = 0.05
POWER = 0.80
RHO = 2.0
"""The spending function's power: look k of K may spend α((k/K)^ρ - ((k-1)/K)^ρ)."""
MAX_NEEDED = 1000
"""Past this many observations in all, ``needed`` is None: the difference sits on the margin."""
OUTCOMES = ("same", "worse", "better", "undecided")
DIRECTIONS = ("two-sided", "one-sided")


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    outcome: str
    """``same`` | ``worse`` | ``better`` | ``undecided``: of B relative to A, in the caller's sense."""
    estimate: float | None
    """B relative to A: exp(mean log ratio) - 1 (+0.072: B 7.2% higher). None when nothing finite was seen."""
    low: float | None
    """The interval of that relative difference (exp(bound) - 1); None with fewer than two finite pairs."""
    high: float | None
    level: float
    """The interval's confidence level: 1 - α' (two-sided) or 1 - 2α' (one-sided), α' this look's share."""
    margin: float
    """δ, relative: a difference inside ±δ counts as the same."""
    n: int
    """Paired observations, diverged ones included."""
    detectable: float | None
    """The smallest relative difference this n detects with 80% power at this level and spread."""
    needed: int | None
    """Undecided only: about how many observations in all would decide it (None: not estimable)."""
    diverged: int
    """Observations where a side diverged (counted, never dropped)."""
    diverged_side: str | None
    """``A`` | ``B`` | ``both`` when ``diverged``."""
    test: str
    """The test in words: statistic, level, margin, n, look."""
    higher_is_worse: bool
    direction: str
    """``two-sided`` (is B the same, worse or better?) or ``one-sided`` (is B worse?)."""

    @property
    def decided(self) -> bool:
        return self.outcome != "undecided"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Decision":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})

    def phrase(self, a: str, b: str, *, worse: str = "worse", better: str = "better",
               quantity: str = "") -> str:
        """One line a person reads: the answer, then the interval, n, test and what it could have seen.

        ``worse``/``better`` name the direction for the quantity (``slower``/``faster`` for ips);
        ``quantity`` (e.g. "final eval loss") is put before the estimate when given.
        """
        what = f"{quantity} " if quantity else ""
        if self.diverged:
            side = {"A": a, "B": b, "both": f"both {a} and {b}"}[self.diverged_side or "both"]
            head = {"worse": f"{b} {worse} than {a}", "better": f"{b} {better} than {a}",
                    }.get(self.outcome, f"undecided between {a} and {b}")
            return (f"{head}: {side} diverged in {self.diverged} of {self.n} "
                    f"(a diverged run is a result, never dropped); {self.test}")
        margin = f"±{_pct(self.margin)}"
        interval = self._interval()
        if self.outcome == "same":
            head = (f"{b} not {worse} than {a} by {_pct(self.margin)} or more" if self.direction == "one-sided"
                    else f"{b} and {a} the same within {margin}")
        elif self.outcome in ("worse", "better"):
            word = worse if self.outcome == "worse" else better
            head = f"{b} {word} than {a} by at least {_pct(self.near_bound())}"
        else:
            need = (f"needs about {self.needed} in all" if self.needed else
                    "needs at least 2 finite pairs" if self.low is None else "the difference sits on the margin")
            head = f"undecided between {a} and {b} at n={self.n} ({need})"
        seen = ("" if self.detectable is None else
                f"; smallest difference it could detect: {_pct(self.detectable)}")
        return f"{head}: {what}{interval}, margin {margin}, n={self.n}; {self.test}{seen}"

    def near_bound(self) -> float:
        """|the interval's bound nearest zero|: the least the difference is, when one was found."""
        if self.low is None or self.high is None:
            return math.inf
        return min(abs(self.low), abs(self.high))

    def _interval(self) -> str:
        if self.estimate is None:
            return "no finite pair"
        if self.low is None:
            return f"{_signed(self.estimate)} (one pair, no interval)"
        return f"{_signed(self.estimate)} ({_pct(self.level)} interval {_signed(self.low)}…{_signed(self.high)})"


def _pct(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "∞"
    digits = 1 if abs(x) >= 0.001 else 4
    return f"{100 * x:.{digits}f}%" if digits == 1 else f"{100 * x:.2g}%"


def _signed(x: float) -> str:
    text = _pct(abs(x))
    return ("+" if x >= 0 else "−") + text


fmt_pct, fmt_signed = _pct, _signed
"""A share as every verdict line prints it (1e-05%, 4.2%; signed +3.4e-05%, −6.7%): a page or cell repeating a
verdict's figure uses these, so a cell never reads +0.00% beside a verdict of +3.4e-05%."""


def log_ratios(a_values, b_values) -> list[float]:
    """Pair by position: ln(b/a), with +inf where B diverged, -inf where A did, nan where both.

    A value diverged when it is not a finite positive number (NaN, ±inf, None, <= 0 for a loss or ips).
    """
    out = []
    for a, b in zip(a_values, b_values, strict=True):
        a_ok, b_ok = _usable(a), _usable(b)
        if a_ok and b_ok:
            out.append(math.log(b / a))
        else:
            out.append(math.nan if not (a_ok or b_ok) else (math.inf if a_ok else -math.inf))
    return out


def _usable(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def spend(alpha: float, look: int, max_looks: int) -> float:
    """Look ``look`` of at most ``max_looks``: its share of α (Kim–DeMets power family, ρ = 2)."""
    if not 1 <= look <= max_looks:
        raise ValueError(f"look {look} outside 1..{max_looks}")
    return alpha * ((look / max_looks) ** RHO - ((look - 1) / max_looks) ** RHO)


@lru_cache(maxsize=4096)
def _t(q: float, df: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(q, df))


def check_margin(margin, option: str = "--margin") -> float:
    """The margin as a float in (0, 1), or ValueError naming ``option`` (the CLI turns it into exit 2)."""
    try:
        value = float(margin)
    except (TypeError, ValueError):
        raise ValueError(f"{option}: '{margin}' is not a number (a relative margin, e.g. 0.02 for 2%)") from None
    if not math.isfinite(value) or not 0 < value < 1:
        raise ValueError(f"{option}: {margin} must be above 0 and below 1 (a relative margin, e.g. 0.02 for 2%)")
    return value


def decide(ratios, *, margin: float, higher_is_worse: bool, alpha: float = ALPHA,
           direction: str = "two-sided", look: int = 1, max_looks: int = 1) -> Decision:
    """The decision on paired log ratios ln(B_i/A_i) (``log_ratios``), at look ``look`` of ``max_looks``."""
    margin = check_margin(margin)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, not {direction!r}")
    share = spend(alpha, look, max_looks)
    one_sided = direction == "one-sided"
    level = 1 - 2 * share if one_sided else 1 - share
    q = 1 - share if one_sided else 1 - share / 2
    ratios = [float(r) for r in ratios]
    finite = [r for r in ratios if math.isfinite(r)]
    n = len(ratios)
    looks = f" (look {look} of at most {max_looks}, α {share:.3g} of {alpha:g} spent here)" if max_looks > 1 else ""
    test = (f"paired t on log ratios, {'one-sided' if one_sided else 'two-sided'}, "
            f"{100 * level:.4g}% interval, margin ±{_pct(margin)} (TOST for same), n={n}{looks}")
    common = dict(level=level, margin=margin, n=n, test=test, higher_is_worse=higher_is_worse, direction=direction)
    estimate = math.expm1(statistics.fmean(finite)) if finite else None

    diverged = n - len(finite)
    if diverged:
        b_only = sum(1 for r in ratios if r == math.inf)
        a_only = sum(1 for r in ratios if r == -math.inf)
        side = "B" if b_only and not a_only and b_only == diverged else (
            "A" if a_only and not b_only and a_only == diverged else "both")
        outcome = {"B": "worse", "A": "better"}.get(side, "undecided")
        return Decision(outcome=outcome, estimate=estimate, low=None, high=None, detectable=None, needed=None,
                        diverged=diverged, diverged_side=side, **common)
    if n < 2:
        return Decision(outcome="undecided", estimate=estimate, low=None, high=None, detectable=None, needed=None,
                        diverged=0, diverged_side=None, **common)

    mean, sd = statistics.fmean(finite), statistics.stdev(finite)
    se = sd / math.sqrt(n)
    half = _t(q, n - 1) * se
    lo, hi = math.expm1(mean - half), math.expm1(mean + half)
    worse_bound, better_bound = (lo, hi) if higher_is_worse else (hi, lo)
    sign = 1 if higher_is_worse else -1
    if one_sided:
        same = sign * (hi if higher_is_worse else lo) < margin
    else:
        same = -margin < lo and hi < margin
    if same:
        outcome = "same"
    elif sign * worse_bound > 0:
        outcome = "worse"
    elif not one_sided and sign * better_bound < 0:
        outcome = "better"
    else:
        outcome = "undecided"
    detectable = math.expm1((_t(q, n - 1) + _t(POWER, n - 1)) * se)
    needed = None if outcome != "undecided" else _needed(mean, sd, n, q, margin, one_sided, sign)
    return Decision(outcome=outcome, estimate=math.expm1(mean), low=lo, high=hi, detectable=detectable,
                    needed=needed, diverged=0, diverged_side=None, **common)


def _needed(mean: float, sd: float, n: int, q: float, margin: float, one_sided: bool, sign: int) -> int | None:
    """About how many pairs in all would make the interval decide, if the mean and spread stay as seen.

    The interval's half-width must fall below the distance from the mean to the nearest line that
    decides: 0 (a difference) or the margin (the same); whichever is farther is the easier target.
    """
    log_margin = math.log1p(margin)
    to_same = log_margin - (sign * mean if one_sided else abs(mean))
    to_diff = abs(mean)
    target = max(to_same, to_diff)
    if target <= 0 or sd == 0:
        return None
    from scipy import stats

    total = max(n + 1, math.ceil((float(stats.norm.ppf(q)) * sd / target) ** 2))  # the normal's answer, then t's
    while total <= MAX_NEEDED:
        if _t(q, total - 1) * sd / math.sqrt(total) < target:
            return total
        total += 1
    return None
