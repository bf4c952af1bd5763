"""The one decision model (xfw/report/decision.py): its answers, its error rates, its sequential looks."""

import math
import random

import pytest

from xfw.report.decision import check_margin, decide, log_ratios, spend


def _losses(base, rel, n, noise, seed=0):
    rng = random.Random(seed)
    a = [base * (1 + rng.gauss(0, 0.05)) for _ in range(n)]           # seed-to-seed spread 5%
    b = [x * (1 + rel) * (1 + rng.gauss(0, noise)) for x in a]       # paired: the same seed's other side
    return a, b


def test_a_side_seven_percent_worse_on_both_of_two_seeds_is_worse_not_same():
    # the case: +0.148 and +0.140 on losses near 2.0, 2 seeds
    d = decide(log_ratios([2.05, 1.95], [2.198, 2.090]), margin=0.02, higher_is_worse=True, direction="one-sided")
    assert d.outcome == "worse"
    assert d.estimate == pytest.approx(0.0721, abs=1e-3)
    assert "worse than" in d.phrase("paddle", "torch") and "n=2" in d.phrase("paddle", "torch")


def test_fp32_rounding_consistent_tiny_difference_is_same_within_the_margin():
    a, _ = _losses(2.0, 0, 3, 0)
    b = [x * (1 + 1e-6) for x in a]
    d = decide(log_ratios(a, b), margin=0.01, higher_is_worse=True)
    assert d.outcome == "same"
    assert d.low > 0  # the paired interval excludes 0: a plain paired test would have called it a change


def test_too_few_noisy_pairs_are_undecided_with_what_they_would_need_never_same():
    a, b = _losses(2.0, 0.0, 3, 0.03, seed=3)
    d = decide(log_ratios(a, b), margin=0.01, higher_is_worse=True)
    assert d.outcome == "undecided"
    assert d.needed is not None and d.needed > 3
    assert "needs about" in d.phrase("a", "b")


def test_one_pair_gives_no_interval_and_no_decision():
    d = decide([0.5], margin=0.02, higher_is_worse=True)
    assert d.outcome == "undecided" and d.low is None and "at least 2" in d.phrase("a", "b")


def test_slower_ips_is_worse_and_faster_is_better_two_sided():
    slow = decide([math.log(0.80), math.log(0.82), math.log(0.79)], margin=0.03, higher_is_worse=False)
    fast = decide([math.log(1.20), math.log(1.22), math.log(1.19)], margin=0.03, higher_is_worse=False)
    assert slow.outcome == "worse" and fast.outcome == "better"
    assert "slower than" in slow.phrase("old", "new", worse="slower", better="faster")
    assert slow.near_bound() > 0.1


def test_one_sided_never_says_better_and_calls_a_better_side_not_worse():
    d = decide([math.log(0.8), math.log(0.81), math.log(0.79)], margin=0.02, higher_is_worse=True,
               direction="one-sided")
    assert d.outcome == "same" and "not worse" in d.phrase("a", "b")


def test_a_diverged_seed_is_counted_against_its_side_never_dropped():
    r = log_ratios([2.0, 2.1, 2.0], [2.0, float("nan"), 2.0])
    assert r[1] == math.inf
    d = decide(r, margin=0.02, higher_is_worse=True)
    assert d.outcome == "worse" and d.diverged == 1 and d.diverged_side == "B" and d.n == 3
    assert "diverged in 1 of 3" in d.phrase("paddle", "torch")
    both = decide(log_ratios([None, 2.0], [float("inf"), 2.0]), margin=0.02, higher_is_worse=True)
    assert both.outcome == "undecided" and both.diverged_side == "both"


def test_spending_shares_add_up_to_alpha_and_start_small():
    shares = [spend(0.05, k, 8) for k in range(1, 9)]
    assert sum(shares) == pytest.approx(0.05)
    assert shares[0] < shares[-1]
    with pytest.raises(ValueError):
        spend(0.05, 9, 8)


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, "x", float("nan"), None])
def test_a_margin_that_is_not_a_positive_fraction_is_refused_naming_the_option(bad):
    with pytest.raises(ValueError, match="--margin"):
        check_margin(bad)


def test_no_difference_is_called_worse_or_better_more_often_than_alpha_even_with_many_looks():
    # planted: no difference at all; sequential looks from 3 to 12 pairs; wrong claims must stay <= alpha
    rng = random.Random(7)
    wrong = 0
    trials = 400
    for _ in range(trials):
        diffs = []
        for n in range(1, 13):
            diffs.append(rng.gauss(0, 0.03))
            if n < 3:
                continue
            d = decide(diffs, margin=0.005, higher_is_worse=False, look=n - 2, max_looks=10)
            if d.outcome in ("worse", "better"):
                wrong += 1
                break
            if d.decided:
                break
    assert wrong / trials <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / trials)


def test_a_difference_beyond_the_margin_is_never_called_same_more_often_than_alpha():
    rng = random.Random(11)
    trials, wrong = 400, 0
    for _ in range(trials):
        diffs = [math.log(1.03) + rng.gauss(0, 0.02) for _ in range(4)]  # true +3%, margin 2%
        if decide(diffs, margin=0.02, higher_is_worse=True).outcome == "same":
            wrong += 1
    assert wrong / trials <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / trials)


def test_a_decision_round_trips_through_its_dict():
    d = decide([0.01, 0.02, 0.015], margin=0.05, higher_is_worse=True)
    assert type(d).from_dict(d.to_dict()) == d
