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
from xfw.run import bisect as bs
from xfw.run import instances
from xfw.run.jobs import ab_order
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
    assert "new slower than old by" in found.text() and "paired t-test on log ratios, two-sided, alpha 0.05" in found.text()
    assert found.detectable < 0.2  # this noise and this many pairs could see a 20% change


def test_ab_of_one_build_against_itself_is_no_change_at_about_its_stated_rate():
    """The false-positive rate the test is designed for (alpha = 5%), on simulated same-build pairs; the
    rate on real runs of one build is measured by benchmarks/ab_false_positives.py."""
    changed = sum(ab_test("a", "b", _pairs(1.0, 5, 0.05, seed)).changed for seed in range(400))
    assert changed / 400 < 0.09  # 5% expected; 9% is more than 3 standard errors above it


def test_ab_with_too_few_pairs_gives_no_verdict_and_says_how_to_get_one():
    found = ab_test("a", "b", _pairs(0.5, MIN_PAIRS - 1, 0.01, 0))
    assert found.verdict == "no verdict" and "--repeat" in found.text()


def test_ab_alternates_the_two_builds_abba():
    order = [name for k in range(4) for name in ab_order(["a", "b", "c"], k)]
    assert order == ["a", "b", "c", "b", "a", "c", "a", "b", "c", "b", "a", "c"]


# --- bisect -------------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [2, 3, 6, 9, 16])
def test_bisect_finds_one_planted_change_in_at_most_log2_n_plus_one_decisions(count):
    names = [f"fw@1.{i}" for i in range(count)]
    for change in range(1, count):
        asked = []

        def decide(name, position):
            asked.append(name)
            return bs.Decision(build=name, position=position, verdict="slower" if position >= change else "no change")

        result = bs.search(names, names[0], names[-1], decide)
        assert (result.first_bad, result.last_good, result.outcome) == (names[change], names[change - 1], "found")
        assert len(asked) <= math.ceil(math.log2(count)) + 1


def test_bisect_skips_a_build_that_does_not_run_and_tries_its_neighbour():
    names = [f"fw@1.{i}" for i in range(8)]

    def decide(name, position):
        if position == 4:
            return bs.Decision(build=name, position=position, verdict="skipped", reason="crashed: on purpose")
        return bs.Decision(build=name, position=position, verdict="slower" if position >= 5 else "no change")

    result = bs.search(names, names[0], names[-1], decide)
    assert result.first_bad == "fw@1.5" and any(d.verdict == "skipped" for d in result.decisions)


def test_bisect_with_no_change_between_good_and_bad_says_so():
    result = bs.search(["a@1", "a@2", "a@3"], "a@1", "a@3",
                       lambda name, pos: bs.Decision(build=name, position=pos, verdict="no change"))
    assert result.outcome == "no change" and len(result.decisions) == 1


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
    assert len(state["decisions"]) <= math.ceil(math.log2(7)) + 1
    assert "First build with the change (slower" in out.text and "Decision rule" in out.text
    again = workflow.bisect(recipe, str(tmp_path / "builds.txt"), good="fake@1", bad="fake@7", overrides=[],
                            repeat=4, out_dir=tmp_path / "bisect", log=(lines := []).append)
    assert all("decided before" in line for line in lines if line.startswith("bisect: fake@"))
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


def test_a_build_that_crashes_is_recorded_and_skipped_and_the_bisect_says_what_it_cannot_decide(tmp_path, fake_backend):
    python = fake_backend["fake"]
    (tmp_path / "builds.txt").write_text("".join(f"fake@{i}={python}\n" for i in range(1, 5)))
    recipe = _recipe(tmp_path, {"fake": {"ips": 100, "ips_jitter": 0.03}, "fake@2": {"behave": "crash"},
                                "fake@3": {"ips": 70}, "fake@4": {"ips": 70}})
    out = workflow.bisect(recipe, str(tmp_path / "builds.txt"), good="fake@1", bad="fake@4", overrides=[],
                          repeat=3, out_dir=tmp_path / "bisect")
    state = json.loads((tmp_path / "bisect" / "bisect.json").read_text())
    skipped = [d for d in state["decisions"] if d["verdict"] == "skipped"]
    assert [d["build"] for d in skipped] == ["fake@2"] and "crashed" in skipped[0]["reason"]
    assert state["result"]["outcome"] == "undecided" and state["result"]["first_bad"] == "fake@3"
    assert out.exit_code == 1 and "Undecided" in out.text
