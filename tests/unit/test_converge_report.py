"""xfw.report.converge: Welch's verdicts per eval point, samples and time to target, the headline, and
the files (JSON, markdown, CSV, HTML, PNG), on synthetic curves (numpy, seeded; no framework)."""

import html
import json
import math

import numpy as np
import pytest

from xfw.contract.atomic import read_json_object
from xfw.report.converge import (NO_SPREAD, ConvergeReport, SeedRun, Speed, analyse, samples_to_target, welch,
                                 write_outputs)
from xfw.report.table import to_markdown

STEPS, EVERY, SPS = 300, 25, 8
EVAL_STEPS = list(range(0, STEPS + 1, EVERY))


def base(step):
    return 1.0 + 3.0 * math.exp(-step / 100)


def run(eval_losses, *, status="ok", reason="", train_noise=0.05, seed=0):
    """A seed run: train losses around the same curve, eval losses as given (one per EVAL_STEPS)."""
    rng = np.random.default_rng(seed)
    train = [(i, (i + 1) * SPS, base(i + 1) + float(rng.normal(0, train_noise))) for i in range(STEPS)]
    evals = [(s, s * SPS, None if v is None else float(v)) for s, v in zip(EVAL_STEPS, eval_losses)]
    return SeedRun(status=status, reason=reason, run_dir=f"runs/x/seed{seed}", train=train, eval=evals)


def noise(seeds=3, scale=0.01, rng_seed=0):
    return np.random.default_rng(rng_seed).normal(0, scale, (seeds, len(EVAL_STEPS)))


def curves_from(ref_values, other_values):
    return {"torch": {s: run(v, seed=s) for s, v in enumerate(ref_values)},
            "paddle": {s: run(v, seed=10 + s) for s, v in enumerate(other_values)}}


SPEED = {"torch": Speed("ok", ips=100.0, window_s=30.0), "paddle": Speed("ok", ips=125.0, window_s=30.0)}


def report_of(curves, speed=SPEED, **kw):
    args = dict(backends=("torch", "paddle"), recipe="recipes/tiny/llava_sft.yaml", comparison="like-for-like",
                steps=STEPS, eval_every=EVERY, samples_per_step=SPS)
    return analyse(curves, speed, **{**args, **kw})


def shifted(shift_from: int | None, shift: float, scale=0.01):
    """Reference: base + noise; other: the same noise values in another seed order (an identical
    sample at every point), plus ``shift`` from step ``shift_from`` on."""
    n = noise(scale=scale)
    b = np.array([base(s) for s in EVAL_STEPS])
    add = np.array([shift if shift_from is not None and s >= shift_from else 0.0 for s in EVAL_STEPS])
    return curves_from(b + n, b + n[[1, 2, 0]] + add)


def test_identical_distributions_are_indistinguishable_at_every_point():
    report = report_of(shifted(None, 0.0))
    assert [p.verdict for p in report.points] == ["indistinguishable"] * len(EVAL_STEPS)
    assert [p.step for p in report.points] == EVAL_STEPS
    assert all(p.p == pytest.approx(1.0) and p.n == {"torch": 3, "paddle": 3} for p in report.points)
    assert report.first_separation is None
    assert report.headline[1].startswith("final eval loss (step 300): indistinguishable (p = 1; Welch's t-test, "
                                         "two-sided, α = 0.05, 3 seeds each)")
    assert report.headline[2] == "the sides never separate (p ≥ 0.05 at every one of the 13 eval points tested)"


def test_the_test_is_welchs_and_calibrated():
    from scipy import stats

    rng = np.random.default_rng(7)
    a, b = rng.normal(2.0, 0.01, 4), rng.normal(2.0, 0.05, 3)
    got = welch(list(a), list(b), 0.05, ("torch", "paddle"))
    want = stats.ttest_ind(b, a, equal_var=False)
    assert got["t"] == pytest.approx(want.statistic) and got["p"] == pytest.approx(want.pvalue)
    assert got["df"] == pytest.approx(float(getattr(want, "df", got["df"])))
    # same distribution: about 5% of draws separate at α = 0.05
    hits = sum(welch(list(rng.normal(0, 1, 3)), list(rng.normal(0, 1, 3)), 0.05, ("a", "b"))["separated"]
               for _ in range(400))
    assert 5 <= hits <= 40


@pytest.mark.parametrize("shift, worse, better", [(0.5, "paddle", "torch"), (-0.5, "torch", "paddle")])
def test_a_shift_of_many_spreads_names_the_worse_side_and_the_first_separation(shift, worse, better):
    report = report_of(shifted(100, shift))
    first = report.first_separation
    assert first is not None and first.step == 100 and first.samples == 800
    assert [p.verdict for p in report.points if p.step < 100] == ["indistinguishable"] * 4
    for p in report.points[4:]:
        assert p.separated and p.worse == worse and p.p < 1e-4
        assert p.diff == pytest.approx(shift) and p.rel_diff == pytest.approx(shift / p.mean["torch"])
        rel = abs(shift) / p.mean[better]
        assert p.verdict == f"{worse} worse by {abs(shift):.4g} ({rel:.1%} above {better})"
    assert report.headline[1].startswith(f"final eval loss (step 300): {worse} worse by 0.5 (")
    assert "the sides first separate at step 100 (800 samples, p = " in report.headline[2]


def test_one_seed_gives_no_verdict():
    n = noise(seeds=1)
    b = np.array([base(s) for s in EVAL_STEPS])
    report = report_of(curves_from(b + n, b + n + 1.0))
    assert all(p.verdict == NO_SPREAD and p.p is None and p.t is None and not p.separated for p in report.points)
    assert all(p.std == {"torch": None, "paddle": None} for p in report.points)
    assert report.first_separation is None
    assert "final eval loss (step 300): no spread: fewer than 2 seeds" in report.headline[1]


def test_zero_spread_never_reaches_the_page_as_nan():
    b = [base(s) for s in EVAL_STEPS]
    same = report_of(curves_from([b] * 3, [b] * 3))
    assert all(p.verdict.startswith("indistinguishable") and p.p is None for p in same.points)
    apart = report_of(curves_from([b] * 3, [[v + 0.1 for v in b]] * 3))
    assert all(p.verdict.startswith("test undefined: no spread on either side") for p in apart.points)
    assert not any(p.separated for p in apart.points)
    for report in (same, apart):
        json.dumps(report.to_dict(), allow_nan=False)  # no NaN or Infinity anywhere
        assert "nan" not in repr(report.page().tables()[0].cells).lower()


def test_target_interpolation_is_exact_on_a_linear_curve():
    line = [(s, s * SPS, 3.0 - 0.004 * s) for s in EVAL_STEPS]
    # 3 − 0.004 s = 2.65 at s = 87.5: 700 samples, between the eval points at 75 and 100
    assert samples_to_target(line, 2.65, rel=0.0) == pytest.approx(700.0)
    # a loss within parity's loss tolerance of the target reaches it: the same loss, up to rounding
    assert samples_to_target([(0, 0, 3.0), (25, 200, 2.65 * (1 + 5e-4))], 2.65) == pytest.approx(200.0)
    assert samples_to_target([(0, 0, 3.0), (25, 200, 2.65 * (1 + 5e-3))], 2.65) is None
    assert samples_to_target(line, 3.0) == 0.0  # already there before training
    assert samples_to_target(line, 3.0 - 0.004 * 300) == pytest.approx(2400.0)
    assert samples_to_target(line, 1.0) is None
    assert samples_to_target([(0, 0, 3.0), (25, 200, None), (50, 400, 2.0)], 2.5) == pytest.approx(200.0)
    values = [[3.0 - 0.004 * s for s in EVAL_STEPS]] * 2
    report = report_of(curves_from(values, values), target=2.65)
    assert report.target == 2.65 and report.target_source == "user"
    for b in ("torch", "paddle"):
        t = report.targets[b]
        assert t.reached == 2 and t.mean_samples == pytest.approx(700.0)
        assert [s.samples for s in t.seeds] == pytest.approx([700.0, 700.0])


def test_time_to_target_is_samples_over_ips():
    ref = [[3.0 - 0.004 * s for s in EVAL_STEPS]] * 3
    other = [[3.0 - 0.002 * s for s in EVAL_STEPS]] * 3  # twice the samples to the same loss
    report = report_of(curves_from(ref, other), target=2.6)
    tr, to = report.targets["torch"], report.targets["paddle"]
    assert tr.time_s == pytest.approx(800.0 / 100.0) and to.time_s == pytest.approx(1600.0 / 125.0)
    assert [s.time_s for s in to.seeds] == pytest.approx([1600.0 / 125.0] * 3)
    assert report.ips_contrast == pytest.approx(0.25)
    assert report.time_contrast == pytest.approx((1600 / 125 - 8) / 8)
    assert report.headline[0] == "paddle vs torch: ips +25%, time to target +60% (target 2.6, user)"


def test_default_target_is_the_reference_mean_final_and_the_mean_curve_compares():
    report = report_of(shifted(0, -0.002))  # paddle 0.002 lower at every point, well within the spread
    assert report.target == pytest.approx(report.final.mean["torch"])
    assert report.target_source == "reference mean final eval loss"
    tr = report.targets["torch"]
    assert 0 < tr.reached < 3 and tr.time_s is None and "seeds reached the target in 300 steps" in tr.time_reason
    assert tr.curve_samples == pytest.approx(2400.0)  # the mean curve reaches its own final mean at the end
    assert "time to target -20% (mean eval curves; seeds reaching it: 1 of 3 paddle, 1 of 3 torch)" \
        in report.headline[0]
    to = report.targets["paddle"]
    assert report.curve_time_contrast == pytest.approx((to.curve_samples / 125) / (2400 / 100) - 1)
    assert f"time to target {report.curve_time_contrast:+.0%} (mean eval curves" in report.headline[0]
    assert report.final.verdict == "indistinguishable"


def test_not_reached_is_a_result():
    values = [[3.0 - 0.004 * s for s in EVAL_STEPS]] * 3
    slow = [[3.0 - 0.001 * s for s in EVAL_STEPS]] * 3
    report = report_of(curves_from(values, slow), target=2.0)
    to = report.targets["paddle"]
    assert to.reached == 0 and to.mean_samples is None and to.time_s is None
    assert all(s.samples is None and not s.reached for s in to.seeds)
    assert report.headline[0] == ("paddle vs torch: ips +25%, but paddle never reaches the target in 300 steps "
                                  "(0 of 3 seeds) (target 2, user)")
    assert "not reached in 300 steps" in to_markdown(report.page())


def test_a_missing_speed_leaves_time_to_target_out_and_says_why():
    values = [[3.0 - 0.004 * s for s in EVAL_STEPS]] * 2
    speed = {"torch": SPEED["torch"], "paddle": Speed("oom", reason="CUDA out of memory")}
    report = report_of(curves_from(values, values), speed, target=2.6)
    assert report.targets["paddle"].time_s is None
    assert report.targets["paddle"].time_reason == "paddle speed oom: CUDA out of memory"
    assert report.headline[0].startswith("paddle vs torch: ips n/a (paddle speed oom: CUDA out of memory)")


def test_a_crashed_seed_is_left_out_and_named():
    n = noise()
    b = np.array([base(s) for s in EVAL_STEPS])
    curves = curves_from(b + n, b + n[[1, 2, 0]])
    curves["paddle"][2] = run([100.0] * 5, status="crashed", reason="exit 139 (SIGSEGV)", seed=12)
    report = report_of(curves)
    assert "paddle seed 2 crashed: exit 139 (SIGSEGV); statistics over 2 seeds" in report.notes
    assert all(p.n == {"torch": 3, "paddle": 2} for p in report.points)
    assert all(p.mean["paddle"] < 10 for p in report.points)
    assert [s.seed for s in report.targets["paddle"].seeds] == [0, 1]
    assert report.curves["paddle"][2].status == "crashed" and len(report.curves["paddle"][2].eval) == 5
    assert "3 torch and 2 paddle seeds" in report.headline[1]


def test_a_non_finite_loss_is_none_and_named():
    b = [base(s) for s in EVAL_STEPS]
    diverged = b[:6] + [float("nan")] * 7
    report = report_of(curves_from([b, b], [b, diverged]))
    assert "paddle seed 1: eval loss not finite from step 150 (7 points), left out of those points" in report.notes
    assert report.points[-1].n["paddle"] == 1
    json.dumps(report.to_dict(), allow_nan=False)


def test_the_json_round_trips(tmp_path):
    report = report_of(shifted(100, 0.5), settings_differences=["attention: sdpa (torch) vs flash (paddle)"])
    path = report.save(tmp_path)
    assert path.name == "converge.json"
    data = read_json_object(path)  # strict: no NaN
    assert data["schema"] == 1 and data["first_separation"]["step"] == 100 and data["test"] == "Welch's t-test, two-sided"
    assert data["points"][0].keys() >= {"step", "samples", "mean", "std", "n", "diff", "rel_diff", "t", "df", "p",
                                        "verdict"}
    assert data["targets"]["torch"]["seeds"][0].keys() >= {"seed", "samples", "time_s", "reached"}
    assert data["targets"]["torch"]["reached"] == report.targets["torch"].reached
    assert data["final_verdict"] == report.final.verdict
    assert data["curves"]["paddle"]["0"]["eval"][0] == [0, 0, pytest.approx(report.curves["paddle"][0].eval[0][2])]
    assert ConvergeReport.load(tmp_path) == report
    assert ConvergeReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


@pytest.mark.parametrize("comparison, first_line", [
    ("like-for-like", "Like-for-like comparison: one algorithm on both sides"),
    ("published", "Published comparison: each side as its own benchmark script ran it")])
def test_the_files_carry_the_comparison_headline_and_verdicts(tmp_path, comparison, first_line):
    report = report_of(shifted(100, 0.5), comparison=comparison)
    paths = write_outputs(report, tmp_path)
    assert {p.name for p in paths.values()} == {"converge.json", "converge.md", "converge.csv", "curves.csv",
                                                 "converge.html", "converge.png"}
    md = (tmp_path / "converge.md").read_text()
    assert md.startswith(f"## Convergence: recipes/tiny/llava_sft.yaml ({comparison})\n\n{first_line}")
    assert "![train and eval loss against samples seen, per backend](converge.png)" in md
    csv_text, page = (tmp_path / "converge.csv").read_text(), (tmp_path / "converge.html").read_text()
    for line in report.headline:
        assert line in md and line in csv_text and html.escape(line) in page
    for verdict in ("indistinguishable", report.final.verdict):
        assert verdict in md and verdict in csv_text and html.escape(verdict) in page
    assert comparison in csv_text.splitlines()[1] and html.escape(first_line) in page
    assert md.index("| step | samples |") < md.index("| backend | ips (samples/s) |")
    assert "data:image/png;base64," in page and "<script" not in page
    rows = csv_text.splitlines()
    assert rows[0].startswith("comparison,recipe,backend,seed,status,step,samples,eval_loss,"
                              "mean_torch,std_torch,n_torch")
    assert len(rows) == 1 + 2 * 3 * len(EVAL_STEPS)
    curves = (tmp_path / "curves.csv").read_text().splitlines()
    assert len(curves) == 1 + 2 * 3 * (STEPS + len(EVAL_STEPS))
    png = (tmp_path / "converge.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


def test_a_target_missed_within_the_seed_spread_says_so():
    report = report_of(shifted(0, +0.002))  # paddle 0.002 higher at every point, well within the spread
    assert "but paddle's mean eval curve never reaches the target" in report.headline[0]
    assert report.final.verdict == "indistinguishable"
    assert "the miss is within the seed-to-seed spread" in report.headline[0]
    far = report_of(shifted(100, +1.0))  # a real gap: the miss is not called noise
    assert far.final.worse == "paddle" and "within the seed-to-seed spread" not in far.headline[0]
