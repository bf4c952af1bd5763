"""Nightly converge entries, without a framework: the suite's ``converge:`` mapping validated before a
night starts, the history's converge keys, and the quality verdicts on synthetic history rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import ROOT
from xfw.report.converge import SeedRun, Speed, analyse
from xfw.report.history import History, converge_fields, workload_fingerprint
from xfw.report.verdicts import NOT_ENOUGH, RegressionPolicy, Verdict, evaluate
from xfw.run.commands.suite import SuiteError, load_suite

REAL = str(ROOT / "recipes/tiny/llava_json_sft.yaml")
SYNTHETIC = str(ROOT / "recipes/tiny/llava_sft.yaml")
POLICY = RegressionPolicy(window=7, min_nights=1, ips_drop=0.40, mem_growth=0.10, noise_k=3, loss_rise=0.05)


# -- the suite ----------------------------------------------------------------------------------
def suite_file(tmp_path, converge, *, backends=("paddle", "torch"), recipe=REAL, **top):
    entry = {"recipe": recipe, "label": "llava-converge", "set": ["measure.cpu_threads=1"]}
    if converge is not ...:
        entry["converge"] = converge
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "backends": list(backends), "entries": [entry], **top}))
    return path


def test_a_converge_entry_is_planned_when_the_suite_loads():
    suite = load_suite(ROOT / "suites/cpu_converge.yaml")
    (entry,) = suite.entries
    chosen = entry.converge
    assert chosen.backends == suite.backends == ("paddle", "torch")  # compare's order: torch is the reference
    assert (chosen.seeds, chosen.steps, chosen.eval_every, chosen.target) == ([0, 1], 20, 10, 4.5)
    assert chosen.eval_samples >= 1 and chosen.recipe.measure.cpu_threads == 1
    assert suite.regression.loss_rise == 0.05


def test_converge_defaults_are_xfw_converges_and_an_ordinary_entry_has_none(tmp_path):
    suite = load_suite(suite_file(tmp_path, {}))
    assert (suite.entries[0].converge.seeds, suite.entries[0].converge.steps,
            suite.entries[0].converge.eval_every) == ([0, 1, 2], 300, 25)
    assert load_suite(suite_file(tmp_path, ...)).entries[0].converge is None


@pytest.mark.parametrize("converge, kw, message", [
    ({"seeds": 0}, {}, "entries[0].converge.seeds: must be an integer >= 1, got 0"),
    ({"seeds": 2.5}, {}, "entries[0].converge.seeds: must be an integer >= 1"),
    ({"seeds": True}, {}, "entries[0].converge.seeds: must be an integer >= 1"),
    ({"eval_every": 0}, {}, "entries[0].converge.eval_every: must be an integer >= 1"),
    ({"steps": 10, "eval_every": 20}, {}, "entries[0].converge.steps: 10 is fewer than eval_every 20"),
    ({"eval_samples": 0}, {}, "entries[0].converge.eval_samples: must be an integer >= 1"),
    ({"target": "low"}, {}, "entries[0].converge.target: must be a finite number"),
    ({"target": float("nan")}, {}, "entries[0].converge.target: must be a finite number"),
    ({"seed": 2}, {}, "entries[0].converge.seed: unknown key (known: seeds, steps, eval_every, eval_samples, target)"),
    ([2, 20, 10], {}, "entries[0].converge: a mapping such as"),
    ({"seeds": 2, "steps": 20, "eval_every": 10}, {"backends": ("torch",)},
     "entries[0].converge: a converge entry compares exactly two backends; the suite runs 1 (torch)"),
    ({"seeds": 2, "steps": 20, "eval_every": 10}, {"backends": ("paddle", "torch", "jax")},
     "compares exactly two backends"),
    ({"seeds": 2, "steps": 20, "eval_every": 10}, {"recipe": SYNTHETIC},
     "entries[0].converge: " + SYNTHETIC + ": data.kind: converge needs real data"),
    ({"seeds": 2, "steps": 20, "eval_every": 10, "eval_samples": 100000}, {}, "entries[0].converge: "),
])
def test_a_bad_converge_entry_is_one_line_naming_the_file_and_key(tmp_path, converge, kw, message):
    path = suite_file(tmp_path, converge, **kw)
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    text = str(err.value)
    assert text.startswith(str(path)) and message in text and "\n" not in text


def test_loss_rise_is_a_regression_key_checked_like_the_others(tmp_path):
    with pytest.raises(SuiteError, match=r"regression.loss_rise: must be a number"):
        load_suite(suite_file(tmp_path, {"seeds": 2, "steps": 20, "eval_every": 10}, regression={"loss_rise": "5%"}))
    assert RegressionPolicy().loss_rise == 0.05


# -- the history --------------------------------------------------------------------------------
def report(paddle_final=(4.25, 4.15), torch_final=(4.23, 4.18), paddle_ips=30.0, statuses=("ok", "ok")):
    """A converge report of 2 seeds x 20 steps (eval at 0, 10, 20) from synthetic curves."""
    def seed_run(final, seed, status="ok"):
        evals = [(0, 0, 6.27), (10, 40, 5.06), (20, 80, final)] if status == "ok" else []
        return SeedRun(status=status, reason="" if status == "ok" else "killed", run_dir=f"seed-{seed}",
                       train=[(i, 4 * (i + 1), 5.0) for i in range(20)], eval=evals)

    curves = {"torch": {s: seed_run(v, s) for s, v in enumerate(torch_final)},
              "paddle": {s: seed_run(v, s, status) for (s, v), status in zip(enumerate(paddle_final), statuses)}}
    speed = {"torch": Speed("ok", ips=90.0, window_s=1.0), "paddle": Speed("ok", ips=paddle_ips, window_s=1.0)}
    return analyse(curves, speed, backends=("torch", "paddle"), recipe="tiny-llava-json-sft",
                   comparison="like-for-like", steps=20, eval_every=10, samples_per_step=4, target=4.5)


SETTINGS = {"seeds": [0, 1], "steps": 20, "eval_every": 10, "eval_samples": 24, "target": 4.5}
SPEC = {"name": "r", "batch": {"global": 4}, "optimizer": {"lr": 0.001}, "measure": {"steps": 8}}


def test_converge_fields_keep_the_final_eval_loss_with_its_spread_and_the_time_to_target():
    fields = converge_fields(report(), "paddle", SETTINGS, SPEC, "nights/n1/llava-converge")
    assert fields["final_eval_loss"] == pytest.approx(4.2) and fields["final_eval_loss_n"] == 2
    assert fields["final_eval_loss_std"] == pytest.approx(np.std([4.25, 4.15], ddof=1))
    assert fields["final_eval_step"] == 20 and fields["target_loss"] == 4.5 and fields["target_reached_seeds"] == 2
    # 5.06 at 40 samples, ~4.2 at 80: 4.5 is crossed at about 66 samples; time = samples / ips
    assert fields["samples_to_target"] == pytest.approx(40 + (5.06 - 4.5) / (5.06 - 4.2) * 40, rel=0.02)
    assert fields["time_to_target_s"] == pytest.approx(fields["samples_to_target"] / 30.0)
    assert fields["converge_status"] == "ok" and fields["converge_worse"] is None
    assert fields["converge"] == SETTINGS and fields["converge_reference"] == "torch"
    other = converge_fields(report(), "paddle", {**SETTINGS, "steps": 40}, SPEC, "x")
    assert other["quality_workload"] != fields["quality_workload"]  # other converge settings: a new baseline


def test_old_rows_and_converge_rows_share_one_history(tmp_path):
    history = History(tmp_path)
    old = qrow("n1", None, converge=False)  # written before converge entries existed
    new = qrow("n2", 4.2, std=float("nan"))  # a non-finite value is written as null
    history.upsert([old, new])
    rows = history.rows()
    assert "final_eval_loss" not in rows[0] and rows[1]["final_eval_loss"] == 4.2
    assert rows[1]["final_eval_loss_std"] is None and rows[1]["converge"]["seeds"] == [0, 1]
    frame = pd.read_json(history.path, lines=True)
    assert frame.final_eval_loss.isna().tolist() == [True, False]


def test_a_backends_own_override_is_compared_and_named_not_a_new_workload():
    base = {"optimizer": {"name": "adamw", "lr": 0.001}, "batch": {"global": 4}, "measure": {"steps": 8}}
    changed = {**base, "optimizer": {"name": "adamw", "lr": 1e-5}, "overrides": {"optimizer.lr": 1e-5},
               "overridden": {"optimizer.lr": 0.001}}
    assert workload_fingerprint(changed) == workload_fingerprint(base)
    assert workload_fingerprint({**base, "optimizer": {"name": "adamw", "lr": 1e-5}}) != workload_fingerprint(base)
    unknown = {**changed, "overrides": {"no.such": 1}, "overridden": {"no.such": 2}}  # cannot be put back
    assert workload_fingerprint(unknown) != workload_fingerprint(base)


# -- quality verdicts ---------------------------------------------------------------------------
def qrow(night, loss, backend="paddle", *, std=0.01, n=2, worse=None, verdict="indistinguishable", p=0.6,
         status="ok", converge_status="ok", quality="q", ips=30.0, knobs=None, converge=True):
    row = {"schema": 1, "night": night, "night_started_utc": f"2026-11-{int(night[1:]):02d}T01:00:00Z",
           "entry": "llava-converge", "backend": backend, "repeat_index": 0, "status": status, "reason": "",
           "ips": ips if status == "ok" else None, "workload": "w", "knobs": knobs or {},
           "step_time_median_s": 4 / ips, "step_time_p10_s": 4 / ips, "step_time_p90_s": 4 / ips,
           "num_measured_steps": 8, "memory_bytes": 30 * 2**20, "memory_source": "rss_training"}
    if converge:
        row.update({"converge": dict(SETTINGS), "quality_workload": quality, "final_eval_loss": loss,
                    "final_eval_loss_std": std, "final_eval_loss_n": n if loss is not None else 0,
                    "final_eval_step": 20, "converge_verdict": verdict, "converge_worse": worse, "converge_p": p,
                    "converge_reference": "torch", "converge_status": converge_status,
                    "converge_reason": "" if converge_status == "ok" else "seed 1 crashed: killed",
                    "time_to_target_s": 2.2, "samples_to_target": 66.0})
    return row


def judged(rows, night, policy=POLICY) -> dict[tuple[str, str], Verdict]:
    return {(v.backend, v.metric): v for v in evaluate(rows, night, policy)}


def test_a_final_eval_loss_rising_beyond_the_floor_is_a_quality_regression():
    rows = [qrow("n1", 4.20), qrow("n2", 4.21), qrow("n3", 4.60)]
    v = judged(rows, "n3")
    loss = v[("paddle", "eval_loss")]
    assert loss.verdict == "regression" and loss.flagged and loss.kind == "quality"
    assert loss.baseline == pytest.approx(4.205) and loss.baseline_nights == 2 and loss.tolerance == 0.05
    assert loss.line().startswith("quality: llava-converge / paddle: final eval loss 4.6 vs 4.205 (median of 2 "
                                  "nights), +9.4%, tolerance ±5.0% (floor 5%)")
    speed = v[("paddle", "ips")]
    assert speed.kind == "speed" and speed.line().startswith("speed: llava-converge / paddle: ips")
    assert not speed.flagged  # the same speed: only quality regressed
    within = judged([qrow("n1", 4.20), qrow("n2", 4.21), qrow("n3", 4.35)], "n3")[("paddle", "eval_loss")]
    assert within.verdict == "ok" and not within.flagged
    better = judged([qrow("n1", 4.20), qrow("n2", 4.21), qrow("n3", 3.80)], "n3")[("paddle", "eval_loss")]
    assert better.verdict == "improvement" and not better.flagged


def test_the_seeds_spread_widens_the_tolerance_where_it_is_larger_than_the_floor():
    # Tonight's 2 seeds differ a lot: standard error of their mean 0.3 / sqrt(2) / 4.6 = 4.6%, x3 = 13.8%.
    v = judged([qrow("n1", 4.20), qrow("n2", 4.21), qrow("n3", 4.60, std=0.3)], "n3")[("paddle", "eval_loss")]
    assert v.tolerance == pytest.approx(3 * 0.3 / 2 ** 0.5 / 4.6) and v.verdict == "ok"
    assert "standard error over 2 seeds" in v.noise_source
    # The nights' own scatter counts too (3 nights or more).
    noisy = [qrow(f"n{i}", loss) for i, loss in enumerate((4.0, 4.4, 4.2, 4.6, 3.8), 1)]
    w = judged(noisy + [qrow("n6", 4.5)], "n6")[("paddle", "eval_loss")]
    assert "scatter of 5 nights" in w.noise_source and w.verdict == "ok"


def test_one_seed_and_one_night_is_not_enough_to_call_a_rise():
    v = judged([qrow("n1", 4.2, std=None, n=1), qrow("n2", 4.6, std=None, n=1)], "n2")[("paddle", "eval_loss")]
    assert v.verdict == NOT_ENOUGH and not v.flagged and "2 or more seeds" in v.note
    assert judged([qrow("n1", 4.2, std=None, n=1), qrow("n2", 4.6, std=None, n=1)], "n2")[
        ("paddle", "separation")].verdict in ("ok", "untested")


def test_the_nights_own_verdict_naming_a_side_worse_is_flagged_on_that_side_only():
    text = "paddle worse by 2.05 (48.7% above torch)"
    rows = [qrow("n1", 6.25, worse="paddle", verdict=text, p=0.002),
            qrow("n1", 4.20, backend="torch", worse="paddle", verdict=text, p=0.002)]
    v = judged(rows, "n1")
    assert v[("paddle", "separation")].verdict == "regression" and v[("paddle", "separation")].flagged
    assert v[("paddle", "separation")].line() == ("quality: llava-converge / paddle: worse than the other side at the "
                                                  f"final eval point (step 20): {text} (p = 0.002, Welch's t-test "
                                                  "over seeds)")
    assert v[("torch", "separation")].verdict == "ok" and "paddle is the worse side" in v[("torch", "separation")].note
    assert v[("paddle", "eval_loss")].verdict == "new"  # the first night: nothing to compare with


def test_a_changed_converge_setting_or_recipe_starts_a_new_quality_baseline():
    v = judged([qrow("n1", 4.2), qrow("n2", 6.0, quality="other steps")], "n2")[("paddle", "eval_loss")]
    assert v.verdict == "incomparable" and not v.flagged and "converge settings changed" in v.note


def test_a_backends_changed_override_is_named_in_the_quality_verdict():
    rows = [qrow("n1", 4.20), qrow("n2", 4.21), qrow("n3", 6.25, knobs={"override.optimizer.lr": 1e-5})]
    v = judged(rows, "n3")[("paddle", "eval_loss")]
    assert v.verdict == "regression" and "override.optimizer.lr – → 1e-05" in v.note


def test_a_seed_that_did_not_run_is_a_failure_and_a_lost_eval_loss_a_regression():
    rows = [qrow("n1", 4.2), qrow("n2", 4.2), qrow("n3", 4.2, std=None, n=1, converge_status="failed")]
    v = judged(rows, "n3")
    assert v[("paddle", "curves")].verdict == "failed" and "seed 1 crashed" in v[("paddle", "curves")].note
    gone = judged([qrow("n1", 4.2), qrow("n2", None, converge_status="failed", verdict="no eval loss on paddle")],
                  "n2")[("paddle", "eval_loss")]
    assert gone.verdict == "regression" and "had one on n1, none now" in gone.note
    # A speed run that failed still gets its quality judged (the curves are separate runs).
    crashed = judged([qrow("n1", 4.2), qrow("n2", 4.2), qrow("n3", 4.9, status="crashed")], "n3")
    assert crashed[("paddle", "status")].flagged and crashed[("paddle", "eval_loss")].verdict == "regression"


def test_ordinary_rows_get_no_quality_verdicts():
    v = judged([qrow("n1", None, converge=False), qrow("n2", None, converge=False)], "n2")
    assert {metric for _, metric in v} == {"ips", "memory"}


def test_quality_verdicts_round_trip_through_nightly_json(tmp_path):
    from dataclasses import asdict

    from xfw.report.verdicts import load_verdicts

    verdicts = evaluate([qrow("n1", 4.2), qrow("n2", 4.21), qrow("n3", 4.6)], "n3", POLICY)
    (tmp_path / "nightly.json").write_text(json.dumps({"verdicts": [asdict(v) for v in verdicts]}))
    assert load_verdicts(tmp_path) == verdicts


# -- the report ---------------------------------------------------------------------------------
def test_the_nights_table_leaves_out_a_converge_entrys_curves_and_starts(tmp_path):
    from xfw.report.nightly_report import converge_blocks, night_runs

    night = tmp_path / "nights" / "n1"
    for run in ("plain/torch", "llava-converge/speed/torch", "llava-converge/seed-0/torch",
                "llava-converge/seed-0/weights", "selfcheck/llava/fp32/torch"):
        (night / run).mkdir(parents=True)
        (night / run / "spec.json").write_text(json.dumps({"name": "r"}))
    report().save(night / "llava-converge")
    found = sorted(str(Path(r.run_dir).relative_to(night)) for r in night_runs(night))
    assert found == ["llava-converge/speed/torch", "plain/torch"]
    verdicts = evaluate([qrow("n1", 4.2), qrow("n2", 4.21), qrow("n3", 4.6)], "n3", POLICY)
    blocks = converge_blocks(tmp_path, night, verdicts)
    text = json.dumps([[getattr(b, "text", ""), getattr(b, "title", ""), getattr(b, "items", [])] for b in blocks],
                      ensure_ascii=False)
    assert "Quality: converge entries" in text and "Converge: llava-converge" in text
    assert "paddle vs torch (like-for-like): ips" in text  # the converge headline
    assert "final eval loss 4.6 vs 4.205" in text and "1 flagged" in text


def test_the_trend_of_a_converge_entry_has_its_final_eval_loss(tmp_path):
    from xfw.report import nightly_report

    def width(png):
        return int.from_bytes(png.read_bytes()[16:20], "big")

    plain = [qrow(n, None, converge=False) for n in ("n1", "n2")]
    converged = [qrow(n, loss) for n, loss in (("n1", 4.2), ("n2", 4.6))]
    a = nightly_report.trend_plot(plain, "llava-converge", ["n1", "n2"], set(), tmp_path / "a.png")
    b = nightly_report.trend_plot(converged, "llava-converge", ["n1", "n2"], {("n2", "paddle", "eval_loss")},
                                  tmp_path / "b.png")
    assert width(b) > width(a)  # a third panel: the final eval loss per night


def test_a_night_of_converge_entries_only_needs_both_backends_and_launches_nothing_without(tmp_path):
    from click.testing import CliRunner

    from xfw import cli

    result = CliRunner().invoke(cli.main, ["nightly", str(ROOT / "suites/cpu_converge.yaml"), "--history",
                                           str(tmp_path / "h"), "--backends", "torch"])
    assert result.exit_code == 2 and "every entry of" in result.output and "nothing would run" in result.output
    assert not (tmp_path / "h").exists()


def test_keys_added_for_converge_at_their_defaults_keep_an_old_nights_fingerprint():
    old = {"model": {"preset": "tiny-llava"}, "data": {"kind": "synthetic", "seed": 0},
           "precision": {"dtype": "fp32", "amp_level": "O0"}, "measure": {"steps": 10, "warmup_steps": 2}}
    new = {**old, "data": {**old["data"], "eval_samples": 0}, "precision": {**old["precision"], "master_weights": True},
           "measure": {**old["measure"], "eval_every": 0}}
    assert workload_fingerprint(new) == workload_fingerprint(old)
    pure = {**new, "precision": {**new["precision"], "master_weights": False}}
    assert workload_fingerprint(pure) != workload_fingerprint(old)  # a real change is a new workload
