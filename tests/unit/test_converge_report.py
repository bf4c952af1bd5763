"""xfw.report.converge: the paired decision on the final eval loss (per-seed log ratios, margin,
direction, divergence), the eval points as context, time to target with its interval, the headline
and the files, on synthetic curves (numpy, seeded; no framework)."""

import html
import json
import math

import numpy as np
import pytest

from xfw.contract.atomic import read_json_object
from xfw.report.converge import ConvergeReport, SeedRun, Speed, analyse, diverged_at, samples_to_target, write_outputs
from xfw.report.decision import Decision
from xfw.report.table import to_markdown
from xfw.run.commands.converge import next_look

STEPS, EVERY, SPS = 300, 25, 8
EVAL_STEPS = list(range(0, STEPS + 1, EVERY))
BASE = np.array([1.0 + 3.0 * math.exp(-s / 100) for s in EVAL_STEPS])


def run(eval_losses, *, status="ok", reason="", train=None, seed=0):
    rng = np.random.default_rng(seed)
    train = train or [(i, (i + 1) * SPS, float(BASE[min(i // EVERY, len(BASE) - 1)] + rng.normal(0, 0.05)))
                      for i in range(STEPS)]
    evals = [(s, s * SPS, None if v is None else float(v)) for s, v in zip(EVAL_STEPS, eval_losses)]
    return SeedRun(status=status, reason=reason, run_dir=f"runs/x/seed{seed}", train=train, eval=evals)


def seeds(n=3, spread=0.05, rng_seed=0):
    """n seeds' reference curves: the seed-to-seed spread (a whole curve scaled) is ``spread``."""
    rng = np.random.default_rng(rng_seed)
    return [BASE * (1 + rng.normal(0, spread)) for _ in range(n)]


def paired(ref, factor, jitter=0.002, rng_seed=1):
    """The other side of each seed: the same curve times ``factor`` (per eval point), with a little
    per-pair noise (the sides share the start and the batches, so they differ far less than seeds do)."""
    rng = np.random.default_rng(rng_seed)
    return [v * factor * (1 + rng.normal(0, jitter, v.size)) for v in ref]


def curves_from(ref, other):
    return {"torch": {s: run(v, seed=s) for s, v in enumerate(ref)},
            "paddle": {s: run(v, seed=s) for s, v in enumerate(other)}}


SPEED = {"torch": Speed("ok", ips=100.0, window_s=30.0, ips_low=98.0, ips_high=102.0, spread="3 repeats"),
         "paddle": Speed("ok", ips=125.0, window_s=30.0, ips_low=120.0, ips_high=130.0, spread="3 repeats")}


def report_of(curves, speed=SPEED, **kw):
    args = dict(backends=("torch", "paddle"), recipe="recipes/tiny/llava_sft.yaml", comparison="like-for-like",
                steps=STEPS, eval_every=EVERY, samples_per_step=SPS)
    return analyse(curves, speed, **{**args, **kw})


def test_fp32_rounding_is_the_same_within_the_margin_and_says_what_it_could_see():
    ref = seeds()
    report = report_of(curves_from(ref, [v * (1 + 1e-6) for v in ref]))
    d = report.decision
    assert d.outcome == "same" and d.n == 3 and abs(d.estimate - 1e-6) < 1e-9
    assert -0.02 < d.low and d.high < 0.02 and d.margin == 0.02 and d.level == pytest.approx(0.95)
    line = report.headline[1]
    assert line.startswith("final eval loss (step 300): paddle and torch the same within ±2.0%")
    for word in ("interval", "n=3", "margin ±2.0%", "smallest difference it could detect"):
        assert word in line
    assert "indistinguishable" not in " ".join(report.headline)
    # the same decision, so time to target is the ips ratio, not a second finding
    assert "so time to target is the ips ratio (-20% time), not a second finding" in report.headline[0]


def test_a_one_sided_precision_loss_inside_the_seed_spread_is_named_worse():
    ref = seeds(spread=0.08)  # seeds differ by ~8%; the pairs by 7% ± 0.2%
    report = report_of(curves_from(ref, paired(ref, 1.072)))
    d, final = report.decision, report.final
    assert d.outcome == "worse" and final.worse == "paddle" and final.separated
    assert 0.06 < d.low < 0.072 < d.high < 0.085
    assert final.p > 0.05  # the unpaired view (seed-to-seed spread) could not tell: context only
    assert report.headline[1].startswith("final eval loss (step 300): paddle worse than torch by at least ")
    # the table cell and the verdict come from the one Decision
    cell = report.page().tables()[0].cells[-1][-1]
    from xfw.report.decision import fmt_signed  # the verdict line's own digits (issue 42)
    assert fmt_signed(d.estimate) in str(getattr(cell, "text", cell)) and "paddle worse" in str(getattr(cell, "text", cell))


def test_a_first_separation_must_last_to_the_end():
    ref = seeds()
    lasting = np.array([1.0 if s < 100 else 1.07 for s in EVAL_STEPS])
    report = report_of(curves_from(ref, paired(ref, lasting)))
    first = report.first_separation
    assert first is not None and first.step == 100 and first.samples == 800
    assert "paddle stays worse from step 100 (800 samples) to the end" in report.headline[2]
    transient = np.array([1.07 if s == 100 else 1.0 for s in EVAL_STEPS])  # worse at one point only
    report = report_of(curves_from(ref, paired(ref, transient)))
    assert report.points[4].separated and report.decision.outcome == "same"
    assert report.first_separation is None
    assert report.headline[2] == "the final point decides; no earlier point is a separation that lasts to the end"


@pytest.mark.parametrize("factor, outcome", [(1.07, "worse"), (0.93, "same"), (1.0 + 1e-6, "same")])
def test_direction_asks_only_whether_one_side_is_worse(factor, outcome):
    ref = seeds()
    report = report_of(curves_from(ref, paired(ref, factor)), direction="paddle-worse")
    d = report.decision
    assert d.direction == "one-sided" and d.level == pytest.approx(0.90) and d.outcome == outcome
    if outcome == "same":
        assert "paddle not worse than torch by 2.0% or more" in report.headline[1]
    asked = report_of(curves_from(ref, paired(ref, factor)), direction="torch-worse")  # the other side asked
    assert asked.sides == ("paddle", "torch")
    assert asked.decision.outcome == ("same" if factor > 1 else "worse")


def test_a_diverged_seed_is_a_result_for_that_side_never_dropped():
    ref = seeds()
    other = paired(ref, 1.0 + 1e-6)
    other[1] = np.concatenate([other[1][:6], [np.nan] * 7])
    report = report_of(curves_from(ref, other))
    d = report.decision
    assert d.outcome == "worse" and d.diverged == 1 and d.diverged_side == "B" and d.n == 3
    assert "paddle diverged in 1 of 3" in report.headline[1]
    assert any(n.startswith("paddle diverged in seed 1 (from step 150)") for n in report.notes)
    assert report.final.n == {"torch": 3, "paddle": 3} and report.final.diverged == {"paddle": [1]}
    json.dumps(report.to_dict(), allow_nan=False)
    assert "diverged" in to_markdown(report.page())


def test_a_train_loss_that_blows_up_is_a_divergence():
    train = [(i, (i + 1) * SPS, 2.0 if i < 40 else 2.0e3) for i in range(STEPS)]
    assert diverged_at(run(BASE, train=train)) == 41
    assert diverged_at(run(BASE)) is None
    nan = [(i, (i + 1) * SPS, 2.0 if i < 10 else float("inf")) for i in range(STEPS)]
    assert diverged_at(run(BASE, train=nan)) == 11


def test_a_crashed_seed_is_out_of_the_decision_and_named():
    ref = seeds()
    curves = curves_from(ref, paired(ref, 1.0 + 1e-6))
    curves["paddle"][2] = run([100.0] * 5, status="crashed", reason="exit 139 (SIGSEGV)")
    report = report_of(curves)
    assert any("paddle seed 2 crashed: exit 139 (SIGSEGV): no quality result" in n for n in report.notes)
    assert report.decision.n == 2 and report.final.n == {"torch": 3, "paddle": 2}


def test_too_few_seeds_are_undecided_with_what_they_would_need():
    ref = seeds(n=2)
    other = [ref[0] * 1.01, ref[1] * 0.995]  # the pairs disagree: no interval inside ±2% at n=2
    report = report_of(curves_from(ref, other))
    d = report.decision
    assert d.outcome == "undecided" and d.needed and d.needed > 2
    assert f"needs about {d.needed} in all" in report.headline[1]
    one = report_of(curves_from(seeds(n=1), paired(seeds(n=1), 1.5)))
    assert one.decision.outcome == "undecided" and one.decision.low is None


def test_sequential_looks_spend_alpha_and_progress_says_what_it_waits_for():
    ref = seeds()
    early = report_of(curves_from(ref, paired(ref, 1.0 + 1e-6)), look=1, max_looks=5)
    assert early.decision.level > 0.99  # look 1 of 5 spends 1/25 of α
    go, line = next_look(early.decision, 3, 6, 1, 5, 0.02)
    assert (go, line.split(":")[0]) == (early.decision.outcome != "same", "decided at 3 seeds (look 1 of at most 5)"
                                        if early.decision.decided else "undecided at 3 seeds")
    undecided = Decision(outcome="undecided", estimate=0.008, low=-0.004, high=0.021, level=0.99, margin=0.01, n=3,
                         detectable=0.03, needed=7, diverged=0, diverged_side=None, test="t", higher_is_worse=True,
                         direction="two-sided")
    assert next_look(undecided, 3, 6, 2, 4, 0.01) == (
        True, "undecided at 3 seeds: interval −0.4%…+2.1%, margin 1.0%, needs about 7 seeds in all (look 2 of at most 4)")
    assert next_look(undecided, 6, 6, 4, 4, 0.01)[0] is False
    assert "budget spent" in next_look(undecided, 6, 6, 4, 4, 0.01)[1]


def test_the_default_target_is_never_a_deliberately_different_sides():
    ref = seeds()
    curves = curves_from(ref, paired(ref, 1.072))
    report = report_of(curves, deliberate={"paddle": ["precision.master_weights"]})
    assert report.target == pytest.approx(report.final.mean["torch"])
    report = report_of(curves, deliberate={"torch": ["precision.master_weights"]})
    assert report.target == pytest.approx(report.final.mean["paddle"])
    assert "not torch's, which carries a deliberate difference" in report.target_source
    both = report_of(curves, deliberate={"torch": ["optimizer.lr"], "paddle": ["precision.dtype"]})
    assert both.target is None and "give --target" in both.target_source
    # and the heading names it: never "like-for-like" when a side was changed on purpose
    assert "deliberate difference (torch: precision.master_weights)" in report_of(
        curves, deliberate={"torch": ["precision.master_weights"]}).headline[0]


def test_target_interpolation_is_exact_on_a_linear_curve():
    line = [(s, s * SPS, 3.0 - 0.004 * s) for s in EVAL_STEPS]
    assert samples_to_target(line, 2.65, rel=0.0) == pytest.approx(700.0)
    assert samples_to_target(line, 3.5, rel=0.0) == 0.0
    assert samples_to_target(line, 0.5, rel=0.0) is None


def test_time_to_target_has_an_interval_from_both_spreads():
    rng = np.random.default_rng(3)
    slopes = [0.004 * (1 + rng.normal(0, 0.05)) for _ in range(3)]
    ref = [np.array([3.0 - k * s for s in EVAL_STEPS]) for k in slopes]
    report = report_of(curves_from(ref, [v * 1.001 for v in ref]), target=2.6, margin=0.0001)
    tr = report.targets["torch"]
    assert tr.time_low < tr.time_s < tr.time_high and tr.reached == 3
    assert report.time_contrast_low < report.time_contrast < report.time_contrast_high
    assert "time to target" in report.headline[0] and "approx. 95% interval" in report.headline[0]


def test_not_reached_is_a_result_with_plain_words():
    ref = [np.array([3.0 - 0.004 * s for s in EVAL_STEPS])] * 3
    slow = [np.array([3.0 - 0.001 * s for s in EVAL_STEPS]) * f for f in (1.0, 1.001, 0.999)]
    report = report_of(curves_from(ref, slow), target=2.0)
    to = report.targets["paddle"]
    assert to.reached == 0 and to.time_reason == "no seed reached the target in 300 steps"
    assert "but paddle never reaches the target in 300 steps (none of its 3 seeds)" in report.headline[0]
    assert "0 of" not in report.headline[0]


def test_the_json_round_trips_and_the_loader_names_a_damaged_file(tmp_path):
    ref = seeds()
    report = report_of(curves_from(ref, paired(ref, 1.07)), settings_differences=["x differs"])
    path = report.save(tmp_path)
    data = read_json_object(path)
    assert data["schema"] == 2 and data["final_outcome"] == "worse" and data["first_separation"]["step"] == 0
    assert data["points"][-1]["decision"]["outcome"] == "worse"
    assert ConvergeReport.load(tmp_path) == report
    path.write_text(json.dumps({**data, "points": [{"step": 1}]}))
    with pytest.raises(ValueError, match="converge.json: not a convergence report"):
        ConvergeReport.load(tmp_path)


def test_the_files_carry_the_headline_the_per_seed_heading_and_a_difference_panel(tmp_path):
    ref = seeds()
    report = report_of(curves_from(ref, paired(ref, 1.0 + 1e-6)))
    paths = write_outputs(report, tmp_path)
    assert {p.name for p in paths.values()} == {"converge.json", "converge.md", "converge.csv", "curves.csv",
                                                 "converge.html", "converge.png"}
    md = (tmp_path / "converge.md").read_text()
    assert "### Per seed" in md and "| step | samples |" in md
    csv_text, page = (tmp_path / "converge.csv").read_text(), (tmp_path / "converge.html").read_text()
    for line in report.headline:
        assert line in md and line in csv_text and html.escape(line) in page
    png = (tmp_path / "converge.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert not list(tmp_path.glob(".*"))


def test_the_page_module_does_not_import_the_report_module():
    import xfw.report.converge_plot as shown
    import xfw.report.converge_target as target

    for module in (shown, target):
        source = open(module.__file__).read()
        assert "xfw.report.converge import" not in source and "from xfw.report import converge\n" not in source


def test_the_curve_loop_and_the_report_share_one_divergence_rule():
    from xfw.contract.curves import BLOWUP, diverged

    assert diverged(float("nan"), 6.0) and diverged(float("inf"), 6.0) and diverged(6.0 * BLOWUP + 1, 6.0)
    assert not diverged(6.0 * BLOWUP, 6.0) and not diverged(None, 6.0) and not diverged(0.1, 6.0)
