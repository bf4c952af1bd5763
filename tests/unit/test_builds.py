"""Two builds of one framework (docs/builds.md): instances, A/B and bisect.

The statistics and the search are checked on numbers; the orchestration (alternation, pairing, per-instance
knobs, resuming, skipped builds) end to end through the workflow with the fake adapter, whose ``ips_jitter``
draws each run's noise from its run id (tests/fakes/xfw_fake). A real A/B of Paddle builds is in
results/cpu/ab/ (a benchmark, not a timed test: these machines are shared).
"""

import json
import math
import os
import random

import pytest
import yaml

from tests.conftest import TINY_RECIPE
from xfw import workflow
from xfw.report.ab import MIN_PAIRS, ab_test
from xfw.run.commands import bisect as bs
from xfw.run.launch import instances
from xfw.run.launch.jobs import ab_order
from xfw.recipe import recipe_from_dict


# --- instances ----------------------------------------------------------------------------------

def test_an_instance_is_a_version_a_wheel_or_an_interpreter(tmp_path):
    assert instances.parse("paddle") == instances.Instance(name="paddle", adapter="paddle")
    version = instances.parse("paddle@3.2.0")
    assert (version.name, version.adapter, version.version, version.built) == ("paddle@3.2.0", "paddle", "3.2.0", True)
    wheel = tmp_path / "paddlepaddle-3.2.0-cp311-cp311-manylinux1_x86_64.whl"
    wheel.write_bytes(b"not really a wheel")
    assert instances.parse(f"paddle@{wheel}").name == "paddle@3.2.0"  # named by the wheel's version
    assert instances.parse(f"paddle@mine={wheel}").wheel == str(wheel)
    given = instances.parse(f"paddle@nightly-1102={os.sys.executable}")
    assert given.python == os.sys.executable and not given.built and given.source.startswith("interpreter ")


@pytest.mark.parametrize("text, says", [
    ("Paddle@3.2.0", "not an adapter name"),
    ("paddle@nightly", "is not a version; give the build as paddle@nightly=PATH"),
    ("paddle@x=/no/such/python", "no such interpreter"),
    ("paddle@x=", "nothing after '='"),
    ("paddle@x y", "the label"),
])
def test_a_badly_written_instance_is_one_line_naming_the_flag(text, says):
    with pytest.raises(instances.InstanceError) as err:
        instances.parse(text)
    assert says in str(err.value) and str(err.value).startswith("--backends") and "\n" not in str(err.value)


def test_two_instances_with_one_name_are_refused():
    with pytest.raises(instances.InstanceError, match="'paddle@3.2.0' is named twice"):
        instances.parse_list(f"paddle@3.2.0,torch,paddle@3.2.0={os.sys.executable}")


def test_an_instance_takes_its_adapters_knobs_with_its_own_on_top():
    recipe = recipe_from_dict({**TINY_RECIPE, "backends": {
        "paddle": {"attn_implementation": "eager", "env": {"A": "1", "B": "2"}},
        "paddle@3.2.0": {"env": {"B": "3"}, "grad_norm": False}}})
    folded = instances.fold(recipe, "paddle@3.2.0").backends["paddle@3.2.0"]
    assert folded == {"attn_implementation": "eager", "env": {"A": "1", "B": "3"}, "grad_norm": False}
    assert instances.fold(recipe, "paddle") is recipe  # the default environment: the recipe as it is


def test_the_framework_pin_is_the_one_line_an_instance_replaces():
    text, package, line = instances.requirements_for(instances.parse("paddle@3.2.0"))
    assert (package, line) == ("paddlepaddle", "paddlepaddle==3.2.0")
    original = (instances.PROJECT_ROOT / "adapters/paddle/requirements.txt").read_text().splitlines()
    changed = [a for a, b in zip(original, text.splitlines()) if a != b]
    assert len(changed) == 1 and instances.FRAMEWORK_MARK in changed[0]


# --- A/B statistics ------------------------------------------------------------------------------

def _pairs(ratio: float, n: int, noise: float, seed: int) -> list[tuple[float, float]]:
    rng = random.Random(seed)
    return [(100 * ratio * math.exp(rng.gauss(0, noise)), 100 * math.exp(rng.gauss(0, noise))) for _ in range(n)]


def test_ab_finds_a_20pc_slowdown_and_states_its_test():
    found = ab_test("new", "old", _pairs(0.8, 6, 0.03, seed=1))
    assert found.verdict == "slower" and found.low < 0.8 < found.high and found.high < 1
    text = found.text()
    assert "new slower than old by at least" in text and "paired t on log ratios, two-sided" in text
    assert "margin ±5.0%" in text and "n=6" in text and "smallest difference it could detect" in text
    assert found.detectable < 0.2  # this noise and this many pairs could see a 20% change


def test_ab_cell_and_verdict_line_come_from_one_decision():
    """Issue 39: the cell said '+17% (noise)' while the line said 'faster by 17.0%'."""
    for seed in range(30):
        found = ab_test("new", "old", _pairs(1.1, 4, 0.08, seed))
        assert f"({found.verdict})" in found.cell()
        word = {"faster": "faster than", "slower": "slower than", "same": "the same within",
                "undecided": "undecided between"}[found.verdict]
        assert word in found.text()


def test_ab_of_one_build_against_itself_is_never_a_change_above_its_stated_rate():
    """The false-positive rate the test is designed for (alpha = 5%), on simulated same-build pairs; the
    rate on real runs of one build is measured by benchmarks/ab_false_positives.py."""
    changed = sum(ab_test("a", "b", _pairs(1.0, 5, 0.05, seed)).changed for seed in range(400))
    assert changed / 400 < 0.09  # 5% expected; 9% is more than 3 standard errors above it


def test_ab_says_same_only_when_the_interval_lies_inside_the_margin():
    tight = ab_test("a", "b", _pairs(1.0, 8, 0.005, 3))
    loose = ab_test("a", "b", _pairs(1.0, 4, 0.2, 3))
    assert tight.verdict == "same" and -0.05 < tight.low - 1 and tight.high - 1 < 0.05
    assert loose.verdict == "undecided" and "needs about" in loose.text()


def test_ab_with_too_few_pairs_gives_no_verdict_and_says_how_to_get_one():
    found = ab_test("a", "b", _pairs(0.5, MIN_PAIRS - 1, 0.01, 0))
    assert found.verdict == "no verdict" and "--repeat" in found.text()


def test_ab_whose_build_crashes_every_run_does_not_advise_more_pairs():
    found = ab_test("a", "b", [], failed={"a": 5})
    assert found.verdict == "no verdict" and "--repeat" not in found.text() and "more pairs cannot help" in found.text()


def test_ab_alternates_the_two_builds_abba():
    order = [name for k in range(4) for name in ab_order(["a", "b", "c"], k)]
    assert order == ["a", "b", "c", "b", "a", "c", "a", "b", "c", "b", "a", "c"]


# --- bisect -------------------------------------------------------------------------------------

def _measure(change_at: int, size: float, noise: float, seed: int = 0, positions=None, skip=(), calls=None):
    """A fabricated measurement: build i's true log ips ratio is ln(1 - size) from ``change_at`` on, else 0;
    each look adds 3 pairs of that plus N(0, noise) (the pairs' noise, alternated runs)."""
    def truth(name):
        return math.log(1 - size) if positions[name] >= change_at else 0.0

    def measure(name, refs, look):
        if calls is not None:
            calls.append((name, refs, look))
        if name in skip:
            raise bs.Skipped("crashed: on purpose")
        rng = random.Random(f"{seed}|{name}|{refs}")
        n = 3 * look
        noise_draws = [rng.gauss(0, noise) for _ in range(n)]
        return {ref: [truth(name) - truth(ref) + e for e in noise_draws] for ref in refs}
    return measure


def _names(count):
    names = [f"fw@1.{i}" for i in range(count)]
    return names, {n: i for i, n in enumerate(names)}


@pytest.mark.parametrize("count", [2, 3, 6, 9])
def test_bisect_names_a_planted_change_only_with_a_confirmed_adjacent_pair(count):
    names, positions = _names(count)
    for change in range(1, count):
        result = bs.search(names, names[0], names[-1], _measure(change, 0.3, 0.03, positions=positions),
                           bs.Plan(start=3, max_pairs=12))
        assert (result.first_bad, result.last_good, result.outcome) == (names[change], names[change - 1], "found")
        last = result.decisions[-1]
        assert last.role in ("confirm", "ends") and last.verdict == "slower"


def test_bisect_never_names_a_wrong_build_under_heavy_noise():
    """Issue 39: a noisy step read as 'has not' named the 8th build. Under noise as large as the change,
    the search may stop at a range, never at a wrong single build."""
    names, positions = _names(8)
    outcomes, wrong_ranges = [], 0
    for seed in range(40):
        result = bs.search(names, names[0], names[-1], _measure(5, 0.18, 0.15, seed=seed, positions=positions),
                           bs.Plan(start=3, max_pairs=9))
        outcomes.append(result.outcome)
        if result.outcome == "found":
            assert result.first_bad == names[5]
        if result.outcome == "range":
            wrong_ranges += not positions[result.last_good] < 5 <= positions[result.first_bad]
    assert "found" in outcomes or "range" in outcomes
    assert wrong_ranges <= 2  # any wrong judgement in a whole bisect: at most alpha = 5% (Bonferroni over steps)


def test_bisect_adds_pairs_while_undecided_and_judges_each_build_against_both_ends():
    names, positions = _names(5)
    calls = []
    bs.search(names, names[0], names[-1], _measure(3, 0.2, 0.08, seed=2, positions=positions, calls=calls),
              bs.Plan(start=3, max_pairs=15))
    assert any(refs == (names[0], names[-1]) for _, refs, _ in calls)
    assert max(look for *_, look in calls) >= 2


def test_a_three_build_bisect_whose_ends_are_undecided_says_so_not_nothing_to_bisect():
    names, positions = _names(3)
    result = bs.search(names, names[0], names[-1], _measure(2, 0.43, 0.6, seed=1, positions=positions),
                       bs.Plan(start=3, max_pairs=3))
    assert result.outcome == "undecided" and "pairs" in result.why
    from xfw.report.bisect import headline
    assert "nothing to bisect" not in headline(result) and "--max-pairs" in headline(result)


def test_bisect_skips_a_build_that_does_not_run_and_tries_its_neighbour():
    names, positions = _names(8)
    result = bs.search(names, names[0], names[-1], _measure(5, 0.3, 0.03, positions=positions, skip={"fw@1.4"}),
                       bs.Plan(start=3, max_pairs=6))
    assert result.first_bad == "fw@1.5" and any(d.verdict == "skipped" for d in result.decisions)


def test_bisect_with_the_same_build_at_both_ends_within_the_margin_says_so():
    names, positions = _names(3)
    result = bs.search(names, names[0], names[-1], _measure(9, 0.0, 0.005, positions=positions),
                       bs.Plan(start=6, max_pairs=6))
    assert result.outcome == "same" and len(result.decisions) == 1


@pytest.mark.parametrize("lines, good, bad, says", [
    (["paddle@3.1.0", "paddle@3.2.0"], "paddle@3.2.0", "paddle@3.1.0", "comes after --bad"),
    (["paddle@3.1.0", "paddle@3.2.0"], "paddle@3.1.0", "paddle@3.1.0", "are the same build"),
    (["paddle@3.1.0", "paddle@3.2.0"], "paddle@3.0.0", "paddle@3.2.0", "--good paddle@3.0.0: not a build of"),
    (["paddle@3.1.0", "paddle@3.1.0"], "paddle@3.1.0", "paddle@3.1.0", "listed twice"),
    (["paddle@3.1.0", "torch@2.13.0"], "paddle@3.1.0", "torch@2.13.0", "a bisect searches the builds of one"),
    (["paddle@3.1.0", "padle@"], "paddle@3.1.0", "padle@", "builds.txt:3:"),
])
def test_a_build_list_that_cannot_be_bisected_is_one_line(tmp_path, lines, good, bad, says):
    path = tmp_path / "builds.txt"
    path.write_text("# builds, oldest first\n" + "\n".join(lines) + "\n")
    with pytest.raises(bs.BisectError) as err:
        bs.check_ends(bs.read_builds(path), good, bad)
    assert says in str(err.value) and "\n" not in str(err.value)


# --- end to end, with the fake adapter -----------------------------------------------------------

def _recipe(tmp_path, backends: dict, repeat: int = 5):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**TINY_RECIPE, "measure": {**TINY_RECIPE["measure"], "repeat": repeat},
                                    "backends": backends}))
    return str(path)


def test_compare_ab_of_two_instances_reports_the_verdict_and_names_each_build(tmp_path, fake_backend):
    python = fake_backend["fake"]
    recipe = _recipe(tmp_path, {"fake": {"ips": 100, "ips_jitter": 0.03}, "fake@slow": {"ips": 80}})
    out = workflow.compare([recipe], ["fake@slow", "fake"], overrides=[], ab=True, out_dir=tmp_path / "ab",
                           interpreters={"fake": python, "fake@slow": python})
    verdict = json.loads((tmp_path / "ab" / "ab.json").read_text())["verdicts"][0]
    assert verdict["verdict"] == "slower" and 0.7 < verdict["ratio"] < 0.9 and verdict["pairs"] == 5
    assert "Two builds of fake: fake@slow against fake" in out.text and "A/B: fake@slow slower than fake" in out.text
    assert len(list((tmp_path / "ab" / "tiny-test").iterdir())) == 10  # 5 pairs, run A B B A (ab_order above)
    build = json.loads((tmp_path / "ab" / "tiny-test" / "fake@slow-r0" / "env.json").read_text())["backend"]["build"]
    assert build["source"].startswith("interpreter ") and build["framework_version"] == "0"
    again = workflow.report([str(tmp_path / "ab")], None, None)  # xfw report keeps the A/B's verdict
    assert "A/B: fake@slow slower than fake" in again.text


def test_ab_needs_pairs_and_contrast_names_two_of_the_backends(tmp_path, fake_backend):
    recipe = _recipe(tmp_path, {"fake": {"ips": 100}}, repeat=1)
    with pytest.raises(workflow.UsageError, match="an A/B needs at least 3"):
        workflow.compare([recipe], ["fake@b", "fake"], overrides=[], ab=True, interpreters={})
    with pytest.raises(workflow.UsageError, match="'torch' is not one of --backends"):
        workflow.compare([recipe], ["fake@b", "fake"], overrides=[], contrast="torch:fake", interpreters={})


def test_bisect_finds_a_planted_change_resumes_and_reports_every_step(tmp_path, fake_backend):
    python = fake_backend["fake"]
    names = [f"fake@{i}" for i in range(1, 8)]
    (tmp_path / "builds.txt").write_text("".join(f"{n}={python}\n" for n in names))
    planted = {n: {"ips": 75} for n in names[4:]}  # builds 5, 6, 7 are 25% slower
    recipe = _recipe(tmp_path, {"fake": {"ips": 100, "ips_jitter": 0.03}, **planted})
    out = workflow.bisect(recipe, str(tmp_path / "builds.txt"), good="fake@1", bad="fake@7", overrides=[],
                          repeat=4, out_dir=tmp_path / "bisect")
    state = json.loads((tmp_path / "bisect" / "bisect.json").read_text())
    assert state["result"]["first_bad"] == "fake@5" and state["result"]["last_good"] == "fake@4"
    decisions = state["result"]["decisions"]
    assert len(decisions) <= math.ceil(math.log2(7)) + 2 and decisions[-1]["role"] == "confirm"
    assert all(d["position"] == names.index(d["build"]) + 1 for d in decisions)  # counted from 1, as on the page
    assert "First build with the change: fake@5" in out.text and "Decision rule" in out.text
    assert "smallest detectable" in (tmp_path / "bisect" / "bisect.md").read_text()
    again = workflow.bisect(recipe, str(tmp_path / "builds.txt"), good="fake@1", bad="fake@7", overrides=[],
                            repeat=4, out_dir=tmp_path / "bisect", log=(lines := []).append)
    assert not any("more alternated pairs" in line for line in lines)  # every look kept from bisect.json
    assert json.loads((tmp_path / "bisect" / "bisect.json").read_text())["result"] == state["result"]


def test_a_nightly_regression_names_the_last_good_and_first_bad_builds_and_the_bisect_to_run():
    from xfw.report.verdicts import RegressionPolicy, evaluate

    def night(n, ips, version, commit):
        return {"night": n, "night_started_utc": f"2026-11-0{n[-1]}T01:00:00Z", "entry": "llava", "backend": "paddle",
                "repeat_index": 0, "status": "ok", "reason": "", "ips": ips, "workload": "w", "knobs": {},
                "mem_alloc_peak_bytes": 1000, "mem_reserved_peak_bytes": None, "step_time_median_s": 1 / ips,
                "step_time_p10_s": 1 / ips, "step_time_p90_s": 1 / ips, "num_measured_steps": 10,
                "build": {"framework_version": version, "commit": commit},
                "interpreter": f"/opt/nightly-{n}/bin/python"}

    rows = [night("n1", 100, "3.2.0", "aaa111"), night("n2", 101, "3.2.0", "bbb222"),
            night("n3", 99, "3.2.1", "ccc333"), night("n4", 70, "3.2.2", "ddd444")]
    (ips,) = [v for v in evaluate(rows, "n4", RegressionPolicy()) if v.metric == "ips"]
    assert ips.verdict == "regression"
    assert "last good night n3: paddle 3.2.1 (commit ccc333)" in ips.note
    assert "first bad night n4: paddle 3.2.2 (commit ddd444)" in ips.note
    assert "--good paddle@night-n3 --bad paddle@night-n4" in ips.note and "paddle@night-n3=/opt/nightly-n3/bin/python" in ips.note


def test_an_unknown_adapter_before_the_at_is_refused_before_anything_is_built(tmp_path):
    recipe = _recipe(tmp_path, {}, repeat=1)
    with pytest.raises(workflow.UsageError, match=r"--backends padle@3.2.0: unknown adapter 'padle' before the @ "
                                                  r"\(known: jax, paddle, torch\)"):
        workflow.compare([recipe], ["padle@3.2.0", "torch"], overrides=[], interpreters={})
    assert not (instances.PROJECT_ROOT / instances.BUILDS_DIR / "padle@3.2.0").exists()


def test_a_second_command_waits_for_the_build_in_progress_and_uses_it_not_builds_it_again(tmp_path):
    # Two commands needing one build at once (CI: two documented commands with paddle@3.2.2): the one that
    # finished building second replaced the environment the first one's next run was importing from.
    import shutil
    import threading

    from xfw.run.launch.lock import wait_for

    (tmp_path / ".venv" / "paddle" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "paddle" / "bin" / "python").symlink_to(os.sys.executable)
    (tmp_path / "adapters" / "paddle").mkdir(parents=True)
    shutil.copy(instances.PROJECT_ROOT / "adapters" / "paddle" / "requirements.txt", tmp_path / "adapters" / "paddle")
    instance = instances.parse("paddle@3.2.2")
    target = instances.env_dir(instance, tmp_path)
    said, found = [], []
    with wait_for(target.with_name(f".{target.name}.lock"), said.append):
        worker = threading.Thread(target=lambda: found.append(instances.ensure_env(instance, said.append, tmp_path)))
        worker.start()
        for _ in range(500):
            if said:
                break
            worker.join(0.01)
        assert said and "paddle@3.2.2: waiting for pid" in said[0] and "which is building it" in said[0], said
        (target / "bin").mkdir(parents=True)  # the build the other command finishes meanwhile
        (target / "bin" / "python").symlink_to(os.sys.executable)
        want = instances._want(instance, instances.requirements_for(instance, tmp_path)[0])
        (target / instances.BUILD_FILE).write_text(json.dumps({"want": want}))
    worker.join(30)
    assert found == [target / "bin" / "python"]
    assert said[1:] == ["paddle@3.2.2: built by that command meanwhile; using it"]  # nothing built


def test_a_build_that_crashes_is_recorded_and_skipped_and_the_bisect_says_what_it_cannot_decide(tmp_path, fake_backend):
    python = fake_backend["fake"]
    (tmp_path / "builds.txt").write_text("".join(f"fake@{i}={python}\n" for i in range(1, 5)))
    recipe = _recipe(tmp_path, {"fake": {"ips": 100, "ips_jitter": 0.03}, "fake@2": {"behave": "crash"},
                                "fake@3": {"ips": 70}, "fake@4": {"ips": 70}})
    out = workflow.bisect(recipe, str(tmp_path / "builds.txt"), good="fake@1", bad="fake@4", overrides=[],
                          repeat="auto", max_pairs=9, out_dir=tmp_path / "bisect")
    state = json.loads((tmp_path / "bisect" / "bisect.json").read_text())
    skipped = [d for d in state["result"]["decisions"] if d["verdict"] == "skipped"]
    assert [d["build"] for d in skipped] == ["fake@2"] and "crash" in skipped[0]["reason"]
    assert state["result"]["outcome"] == "range" and state["result"]["first_bad"] == "fake@3"
    assert state["result"]["last_good"] == "fake@1"  # never fake@3 alone: fake@2 could not be judged
    assert out.exit_code == 1 and "Undecided within fake@1 … fake@3" in out.text


@pytest.mark.parametrize("repeat, max_pairs, margin, says", [
    ("auto", None, "0.05", "--repeat auto: needs a budget, --max-pairs"),
    ("auto", 2, "0.05", "--max-pairs 2: below the 3 pairs"),
    ("6", 4, "0.05", "--max-pairs 4: below --repeat 6"),
    ("2", None, "0.05", "--repeat 2: an A/B needs at least 3"),
    ("5", None, "0", "--margin: 0 must be above 0"),
    ("5", None, "nan", "--margin: nan must be above 0"),
    ("5", None, "-0.1", "--margin: -0.1 must be above 0"),
])
def test_bad_pairs_or_margin_is_one_line_before_anything_launches(repeat, max_pairs, margin, says):
    from xfw.workflow.builds import check_pairs

    with pytest.raises(workflow.UsageError) as err:
        check_pairs(repeat, max_pairs, margin)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("damage", [
    lambda s: {**s, "batches": "a string"},
    lambda s: {**s, "result": {**s["result"], "decisions": "a string"}} if False else {**s, "surprise": 1},
    lambda s: {**s, "batches": {k: [{r: ["x"] for r in b} for b in v] for k, v in s["batches"].items()}},
])
def test_a_corrupt_bisect_json_is_one_line_saying_give_force(tmp_path, fake_backend, damage):
    python = fake_backend["fake"]
    (tmp_path / "builds.txt").write_text(f"fake@1={python}\nfake@2={python}\n")
    recipe = _recipe(tmp_path, {"fake": {"ips": 100, "ips_jitter": 0.01}})
    state = {"schema": 2, "key": {}, "batches": {"fake@2|fake@1": [{"fake@1": [0.01, 0.0, -0.01]}]}, "skipped": {}}
    (tmp_path / "bisect").mkdir()
    (tmp_path / "bisect" / "bisect.json").write_text(json.dumps(damage(state)))
    with pytest.raises(workflow.UsageError) as err:
        workflow.bisect(recipe, str(tmp_path / "builds.txt"), good="fake@1", bad="fake@2", overrides=[],
                        repeat=3, out_dir=tmp_path / "bisect")
    assert "--force" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "bisect" / "ab-fake@2").exists()  # nothing launched


def test_bisect_resume_key_holds_what_a_label_points_at(tmp_path):
    from xfw.workflow.builds import build_key

    one, two = tmp_path / "one.sh", tmp_path / "two.sh"
    one.write_text("#!/bin/sh\nexec python3 \"$@\"\n")
    two.write_text("#!/bin/sh\nexec python3 -X dev \"$@\"\n")
    one.chmod(0o755)
    first = build_key(instances.parse(f"fake@x={one}", flag="--builds"))
    one.write_text(two.read_text())  # the same label and path, other content
    assert build_key(instances.parse(f"fake@x={one}", flag="--builds")) != first
    assert first["python_sha256"] and first["python"] == str(one)


def test_a_nightly_throughput_verdict_with_repeats_states_the_decision_models_interval_n_and_margin():
    from xfw.report.verdicts import RegressionPolicy, evaluate

    def night(n, ips, repeats=None):
        return {"night": n, "night_started_utc": f"2026-11-0{n[-1]}T01:00:00Z", "entry": "llava", "backend": "torch",
                "repeat_index": 0, "status": "ok", "reason": "", "ips": ips, "workload": "w", "knobs": {},
                "mem_alloc_peak_bytes": 1000, "mem_reserved_peak_bytes": None, "step_time_median_s": 1 / ips,
                "step_time_p10_s": 1 / ips, "step_time_p90_s": 1 / ips, "num_measured_steps": 10}

    rows = [night("n1", 100), night("n2", 101), night("n3", 99)]
    rows += [{**night("n4", ips), "repeat_index": k} for k, ips in enumerate([60, 62, 61])]
    (ips,) = [v for v in evaluate(rows, "n4", RegressionPolicy()) if v.metric == "ips"]
    assert ips.verdict == "regression" and ips.decision["outcome"] == "worse" and ips.decision["n"] == 3
    assert "tonight slower than the baseline by at least" in ips.line() and "n=3" in ips.line()


def test_compare_ab_with_max_pairs_adds_pairs_until_decided_and_counts_them(tmp_path, fake_backend):
    python = fake_backend["fake"]
    recipe = _recipe(tmp_path, {"fake": {"ips": 100, "ips_jitter": 0.02}, "fake@slow": {"ips": 70}})
    out = workflow.ab_sequential_cli([recipe], ["fake@slow", "fake"], overrides=[], ab=True, repeat=None, max_pairs=9,
                                     margin="0.05", interpreters={"fake": python, "fake@slow": python},
                                     out_dir=tmp_path / "ab", log=(lines := []).append)
    verdict = json.loads((tmp_path / "ab" / "ab.json").read_text())["verdicts"][0]
    assert verdict["verdict"] == "slower" and verdict["decision"]["margin"] == 0.05
    assert any("pairs 1-3 of at most 9" in line for line in lines) and out.exit_code == 0
    with pytest.raises(workflow.UsageError, match="--max-pairs: only with --ab"):
        workflow.ab_sequential_cli([recipe], ["fake@slow", "fake"], overrides=[], ab=False, repeat=None,
                                   max_pairs=9, margin="0.05", interpreters={})
