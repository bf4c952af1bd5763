"""Nightly, without a framework: suite files, the history store, choosing a night, verdicts."""

from __future__ import annotations

import datetime as dt
import json

import pandas as pd
import pytest
import yaml

from conftest import ROOT
from xfw.report.history import History, workload_fingerprint
from xfw.report.verdicts import RegressionPolicy, evaluate, relative_scatter, step_scatter
from xfw.run.commands.nightly import choose_night
from xfw.run.commands.suite import SuiteError, load_suite

POLICY = RegressionPolicy(window=7, min_nights=1, ips_drop=0.05, mem_growth=0.05, noise_k=3)


# -- suites -------------------------------------------------------------------------------------
def write_suite(tmp_path, data, name="suite.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


@pytest.mark.parametrize("shipped", ["suites/cpu_smoke.yaml", "suites/h800_nightly.yaml"])
def test_shipped_suites_load_with_every_recipe_validated(shipped):
    suite = load_suite(ROOT / shipped)
    assert suite.backends == ("paddle", "torch")
    assert len({e.label for e in suite.entries}) == len(suite.entries)
    if "h800" in shipped:  # the seed's 12 rows
        assert len(suite.entries) == 12
        assert {e.recipe.num_processes for e in suite.entries} <= {1, 8}


def test_suite_recipes_are_relative_to_the_suite_file_and_overrides_stack(tmp_path):
    (tmp_path / "sub").mkdir()
    path = write_suite(tmp_path / "sub", {
        "name": "s", "backends": ["torch"], "set": ["measure.steps=7", "batch.micro=2"],
        "entries": [{"recipe": str(ROOT / "recipes/tiny/llava_sft.yaml"), "set": ["batch.micro=1"]}]})
    suite = load_suite(path, ["measure.warmup_steps=0"])
    recipe = suite.entries[0].recipe
    assert (recipe.measure.steps, recipe.batch.micro, recipe.measure.warmup_steps) == (7, 1, 0)
    assert suite.entries[0].label == "tiny-llava-sft"


@pytest.mark.parametrize("data, message", [
    ({"name": "s", "backends": ["torch"], "entries": [{"recipe": "nope.yaml"}]},
     "entries[0].recipe: no such file nope.yaml"),
    ({"name": "s", "backends": ["torch"], "entries": []}, "entries: must be a non-empty list"),
    ({"name": "s", "backends": "torch", "entries": ["x"]}, "backends: must be a non-empty list"),
    ({"name": "s", "backends": ["torch"], "entries": ["x"], "regresion": {}}, "regresion: unknown key"),
    ({"name": "s", "backends": ["torch"], "regression": {"window": 0}, "entries": ["x"]},
     "regression.window: must be >= 1"),
    ({"name": "s", "backends": ["torch"], "regression": {"ips_drop": "5%"}, "entries": ["x"]},
     "regression.ips_drop: must be a number"),
    ({"name": "s", "backends": ["torch"], "entries": [{"recipe": "R", "sett": []}]}, "entries[0].sett: unknown key"),
    ({"name": "s", "backends": ["torch"], "entries": [{"recipe": "R", "set": ["batch.micro=0"]}]},
     "entries[0]: "),
    ({"name": "s", "backends": ["torch"], "entries": ["R", "R"]}, "two entries are labelled 'tiny-llava-sft'"),
    ({"name": "a b", "backends": ["torch"], "entries": ["R"]}, "name: 'a b' must be one plain file name"),
    ({"name": "s", "backends": ["torch"], "entries": ["R"], "selfcheck": {"paths": ["bf16"]}},
     "selfcheck.paths: a non-empty list of fp32, bf16-o1"),
    ({"name": "s", "backends": ["torch"], "entries": ["R"], "selfcheck": "yes"}, "selfcheck: true, or a mapping"),
])
def test_bad_suites_fail_with_one_line_naming_the_file_and_key(tmp_path, data, message):
    text = json.dumps(data).replace('"R"', json.dumps(str(ROOT / "recipes/tiny/llava_sft.yaml")))
    path = write_suite(tmp_path, json.loads(text))
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    assert str(err.value).startswith(str(path)) and message in str(err.value)


def test_a_suite_selfcheck_runs_fp32_first_and_defaults_to_everything(tmp_path):
    from xfw.report.selfcheck import BY_NAME
    from xfw.run.commands.selfcheck import FAMILY_RECIPES

    base = {"name": "s", "backends": ["torch"], "entries": [str(ROOT / "recipes/tiny/llava_sft.yaml")]}
    assert load_suite(write_suite(tmp_path, base)).selfcheck is None
    assert load_suite(write_suite(tmp_path, {**base, "selfcheck": {"families": ["sd3"], "paths": ["recompute"]}})
                      ).selfcheck == (("sd3",), ("fp32", "recompute"))
    families, paths = load_suite(write_suite(tmp_path, {**base, "selfcheck": True})).selfcheck
    assert families == tuple(FAMILY_RECIPES) and paths == tuple(BY_NAME) and paths[0] == "fp32"


def test_a_bad_override_from_the_command_line_names_the_entry(tmp_path):
    path = write_suite(tmp_path, {"name": "s", "backends": ["torch"],
                                  "entries": [str(ROOT / "recipes/tiny/llava_sft.yaml")]})
    with pytest.raises(SuiteError, match=r"entries\[0\]: .*measure.steps"):
        load_suite(path, ["measure.steps=0"])


def test_suite_that_is_not_yaml_says_where(tmp_path):
    path = write_suite(tmp_path, "name: s\nentries: [unclosed\n")
    with pytest.raises(SuiteError, match=r"line \d+: invalid YAML"):
        load_suite(path)


# -- history ------------------------------------------------------------------------------------
def row(night, entry="e", backend="torch", *, ips=100.0, mem=1000, status="ok", workload="w", knobs=None,
        started=None, p10=None, p90=None, steps=10, repeat=0):
    med = 1.0 / ips if ips else None
    return {"schema": 1, "night": night, "night_started_utc": started or f"2026-11-{int(night[1:]):02d}T01:00:00Z",
            "entry": entry, "backend": backend, "repeat_index": repeat, "status": status, "reason": "",
            "ips": ips if status == "ok" else None, "mem_alloc_peak_bytes": mem if status == "ok" else None,
            "mem_reserved_peak_bytes": None, "workload": workload, "knobs": knobs or {},
            "step_time_median_s": med, "step_time_p10_s": p10 if p10 is not None else med,
            "step_time_p90_s": p90 if p90 is not None else med, "num_measured_steps": steps}


def test_history_upsert_replaces_by_key_and_pandas_reads_it(tmp_path):
    history = History(tmp_path)
    history.upsert([row("n1", ips=1.0), row("n1", backend="paddle", ips=2.0)])
    history.upsert([row("n1", ips=3.0), row("n2", ips=4.0)])  # n1/torch rerun after a resume: replaced
    rows = history.rows()
    assert [(r["night"], r["backend"], r["ips"]) for r in rows] == [("n1", "paddle", 2.0), ("n1", "torch", 3.0),
                                                                   ("n2", "torch", 4.0)]
    frame = pd.read_json(history.path, lines=True)
    assert list(frame["ips"]) == [2.0, 3.0, 4.0] and history.nights() == ["n1", "n2"]
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed, not left behind


def test_history_names_a_line_that_is_not_json(tmp_path):
    history = History(tmp_path)
    history.upsert([row("n1")])
    with open(history.path, "a") as f:
        f.write('{"night": "n2", "trunc\n')
    with pytest.raises(ValueError, match=r"history.jsonl:2: not a JSON object"):
        history.rows()


def test_workload_fingerprint_ignores_run_id_knobs_and_timeouts_but_not_the_batch():
    spec = {"run_id": "a", "backend": "torch", "backend_knobs": {}, "backends": {}, "batch": {"global": 8},
            "measure": {"steps": 10, "timeout_s": 60, "repeat": 1}}
    same = {**spec, "run_id": "b", "backend": "paddle", "backend_knobs": {"compile": True},
            "backends": {"torch": {"compile": True}}, "measure": {"steps": 10, "timeout_s": 99, "repeat": 3}}
    assert workload_fingerprint(spec) == workload_fingerprint(same)
    assert workload_fingerprint(spec) != workload_fingerprint({**spec, "batch": {"global": 16}})
    assert workload_fingerprint(spec) != workload_fingerprint({**spec, "measure": {"steps": 20}})


# -- choosing the night -------------------------------------------------------------------------
def write_night(tmp_path, name, started, finished=None, suite="s"):
    d = tmp_path / "nights" / name
    d.mkdir(parents=True)
    (d / "night.json").write_text(json.dumps({"suite": suite, "started_utc": started, "finished_utc": finished}))


NOW = dt.datetime(2026, 11, 22, 23, 0, tzinfo=dt.timezone.utc)


def test_a_new_night_is_the_utc_date_and_never_reuses_a_finished_one(tmp_path):
    assert choose_night(tmp_path, "s", now=NOW) == ("2026-11-22", False)
    write_night(tmp_path, "2026-11-22", "2026-11-22T01:00:00Z", finished="2026-11-22T02:00:00Z")
    assert choose_night(tmp_path, "s", now=NOW) == ("2026-11-22.2", False)


def test_an_unfinished_recent_night_of_the_same_suite_is_resumed(tmp_path):
    write_night(tmp_path, "2026-11-22", "2026-11-22T20:00:00Z")
    assert choose_night(tmp_path, "s", now=NOW) == ("2026-11-22", True)
    assert choose_night(tmp_path, "other-suite", now=NOW) == ("2026-11-22.2", False)
    later = NOW + dt.timedelta(hours=21)  # yesterday's abandoned night is left alone
    assert choose_night(tmp_path, "s", now=later) == ("2026-11-23", False)
    assert choose_night(tmp_path, "s", "mine", now=NOW) == ("mine", False)


# -- verdicts -----------------------------------------------------------------------------------
def verdicts_for(rows, night, policy=POLICY):
    return {(v.entry, v.backend, v.metric): v for v in evaluate(rows, night, policy)}


def test_a_drop_beyond_the_floor_is_a_regression_and_within_it_is_not():
    rows = [row("n1", ips=100), row("n2", ips=102), row("n3", ips=98), row("n4", ips=80)]
    v = verdicts_for(rows, "n4")[("e", "torch", "ips")]
    assert v.verdict == "regression" and v.baseline == 100 and v.baseline_nights == 3
    assert v.change == pytest.approx(-0.2) and v.flagged
    ok = verdicts_for(rows[:3] + [row("n4", ips=97)], "n4")[("e", "torch", "ips")]
    assert ok.verdict == "ok" and not ok.flagged


def test_measured_nightly_scatter_widens_the_tolerance():
    noisy = [row("n1", ips=100), row("n2", ips=120), row("n3", ips=80), row("n4", ips=110), row("n5", ips=90)]
    scatter = relative_scatter([100, 120, 80, 110, 90])
    v = verdicts_for(noisy + [row("n6", ips=80)], "n6")[("e", "torch", "ips")]
    assert v.tolerance == pytest.approx(3 * scatter) and v.tolerance > 0.2
    assert v.verdict == "ok" and "scatter of 5 nights" in v.noise_source
    assert verdicts_for(noisy + [row("n6", ips=40)], "n6")[("e", "torch", "ips")].verdict == "regression"


def test_a_jittery_run_is_judged_by_its_standard_error_while_history_is_short():
    jitter = row("n2", ips=85, p10=1 / 85 * 0.5, p90=1 / 85 * 1.5, steps=4)  # sigma/median ~0.39, SE ~0.2
    v = verdicts_for([row("n1", ips=100), jitter], "n2")[("e", "torch", "ips")]
    assert step_scatter(jitter) == pytest.approx(1 / 2.5631 / 2, rel=1e-3)
    assert v.verdict == "ok" and v.tolerance == pytest.approx(3 * step_scatter(jitter))


def test_memory_growth_improvements_and_knob_changes_are_reported():
    # Two nights of history: their spread is measured (one night alone would be "not enough history").
    rows = [row("n1", mem=1000), row("n2", mem=1010), row("n3", mem=1100, ips=150, knobs={"compile": True})]
    v = verdicts_for(rows, "n3")
    assert v[("e", "torch", "memory")].verdict == "regression"
    assert v[("e", "torch", "ips")].verdict == "improvement"
    assert "compile – → True" in v[("e", "torch", "ips")].note


def test_a_run_that_was_ok_and_now_fails_is_flagged_and_a_repeated_failure_is_reported():
    v = verdicts_for([row("n1"), row("n2", status="oom")], "n2")[("e", "torch", "status")]
    assert v.verdict == "regression" and "was ok on n1, now oom" in v.note
    again = verdicts_for([row("n1", status="crashed"), row("n2", status="crashed")], "n2")[("e", "torch", "status")]
    assert again.verdict == "failed" and again.flagged
    quiet = verdicts_for([row("n1", status="unsupported")], "n1")[("e", "torch", "status")]
    assert quiet.verdict == "ok" and not quiet.flagged


def test_nothing_is_compared_across_a_changed_workload_or_another_backend():
    v = verdicts_for([row("n1", ips=100), row("n2", ips=10, workload="bigger batch")], "n2")
    assert v[("e", "torch", "ips")].verdict == "incomparable" and not v[("e", "torch", "ips")].flagged
    first = verdicts_for([row("n1", backend="paddle", ips=100), row("n2", ips=10)], "n2")
    assert first[("e", "torch", "ips")].verdict == "new"


def test_only_the_last_window_nights_form_the_baseline_and_repeats_fold_to_their_median():
    old = [row(f"n{i}", ips=10) for i in range(1, 4)]
    recent = [row(f"n{i}", ips=100) for i in range(4, 7)]
    policy = RegressionPolicy(window=3, min_nights=1, ips_drop=0.05, mem_growth=0.05, noise_k=3)
    tonight = [row("n7", ips=v, repeat=k) for k, v in enumerate((99, 60, 101))]
    v = verdicts_for(old + recent + tonight, "n7", policy)[("e", "torch", "ips")]
    assert v.baseline == 100 and v.baseline_nights == 3 and v.value == 99 and v.verdict == "ok"


def test_min_nights_holds_back_a_verdict():
    policy = RegressionPolicy(min_nights=3)
    v = verdicts_for([row("n1"), row("n2", ips=10)], "n2", policy)[("e", "torch", "ips")]
    assert v.verdict == "new" and "1 comparable night(s), 3 needed" in v.note


# -- the command's input checks (nothing launches) ------------------------------------------------
def test_nightly_rejects_a_backend_the_suite_does_not_run_and_creates_nothing(tmp_path):
    from click.testing import CliRunner

    from xfw import cli

    result = CliRunner().invoke(cli.main, ["nightly", str(ROOT / "suites/cpu_smoke.yaml"), "--history",
                                           str(tmp_path / "h"), "--backends", "torch,jax"])
    assert result.exit_code == 2 and "--backends jax: not a backend of" in result.output
    assert not (tmp_path / "h").exists()
    empty = CliRunner().invoke(cli.main, ["nightly", str(ROOT / "suites/cpu_smoke.yaml"), "--history",
                                          str(tmp_path / "h"), "--report-only"])
    assert empty.exit_code == 2 and "--report-only: no recorded night" in empty.output


def test_memory_is_compared_only_with_nights_that_measured_it_the_same_way():
    old = [row("n1", mem=9_000_000), row("n2", mem=9_000_000)]  # Paddle's host allocator, before the shared measure
    for r in old:
        r["mem_source"] = "host_allocator"
    new = {**row("n3", mem=1), "memory_bytes": 400 * 2**20, "memory_source": "peak_rss"}
    v = verdicts_for(old + [new], "n3")[("e", "torch", "memory")]
    assert v.verdict == "new" and not v.flagged and v.baseline is None
    again = {**row("n4", mem=1), "memory_bytes": 401 * 2**20, "memory_source": "peak_rss"}
    later = {**row("n5", mem=1), "memory_bytes": 500 * 2**20, "memory_source": "peak_rss"}
    assert verdicts_for(old + [new, again, later], "n5")[("e", "torch", "memory")].verdict == "regression"
