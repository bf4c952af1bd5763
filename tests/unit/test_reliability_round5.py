"""Hostile and unlucky input, round five (issue 41): documents read back (converge.json, ab.json, the
nightly verdicts), per-backend overrides of forced keys or unknown backends, instance labels and
wheels, subprocesses of checks and builds, count options, builds files. Each case is refused in one
line naming the file or option and key (exit 2, nothing launched) or survived with nothing lost; the
numbers in the names follow docs/reliability.md (29 onwards).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xfw.contract.atomic import UnreadableFile
from xfw.report import readback
from xfw.report.readback import Maybe, OneOf, Pair, ShapeError, check, read_checked

FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# --- 29: every document read back goes through one typed loader ------------------------------------

def test_29_the_shape_checker_names_the_key_path_of_the_first_problem():
    shape = {"schema": int, "decisions": [{"name": str, "ratio?": Maybe(float), "kind": OneOf("a", "b")}],
             "curve": Pair(int, int, Maybe(float)), "by": {str: bool}}
    good = {"schema": 1, "decisions": [{"name": "x", "kind": "a"}, {"name": "y", "ratio": 1, "kind": "b"}],
            "curve": [1, 2, None], "by": {"t": True}}
    assert check(good, shape) is None
    cases = {
        "decisions[1].ratio: expected a number or null, found text": {"ratio": "1"},
        "decisions[1].kind: expected one of 'a', 'b', found 'c'": {"kind": "c"},
        "decisions[1].extra: not a key this file has": {"extra": 1},
        "decisions[1].name: missing": {"name": None},
    }
    for want, change in cases.items():
        bad = json.loads(json.dumps(good))
        bad["decisions"][1].update(change)
        if change.get("name", 0) is None:
            del bad["decisions"][1]["name"]
        assert check(bad, shape) == want
    assert check({**good, "decisions": "abc"}, shape) == "decisions: expected a list, found text"
    assert check({**good, "schema": True}, shape) == "schema: expected an integer, found a bool"
    assert check({**good, "curve": [1, 2]}, shape) == "curve: expected a list of 3, found a list of 2"
    assert check({**good, "by": {"t": 1}}, shape) == "by.t: expected true or false, found an integer"
    assert check({**good, "curve": [1, 2, float("inf")]}, shape).startswith("curve[2]: expected a number or null")


def test_29_read_checked_is_one_line_naming_the_file_and_key(tmp_path):
    path = tmp_path / "bisect.json"
    assert read_checked(path, {"x": int}) == {}  # no file
    path.write_text('{"x": 1e400}')  # JSON that reads as infinity
    with pytest.raises(ShapeError) as err:
        read_checked(path, {"x": int}, hint="give --force")
    assert str(err.value) == f"{path}: x: expected an integer, found a number out of range; give --force"
    assert isinstance(err.value, UnreadableFile)  # every reader already catches it
    path.write_text("[1]")
    with pytest.raises(UnreadableFile, match="expected a JSON object"):
        read_checked(path, {"x": int})


def test_29_the_declared_shapes_follow_their_dataclasses():
    """A field added to a dataclass that is written back must be in its shape (or the file is refused)."""
    from xfw.report.ab import ABResult
    from xfw.report.converge import ConvergeReport, PointStats, SeedRun, SeedTarget, SideTarget, Speed
    from xfw.report.verdicts import Verdict

    def keys(shape):
        return {k.removesuffix("?") for k in shape if isinstance(k, str)}

    for cls, shape in [(Verdict, readback.VERDICT), (ConvergeReport, readback.CONVERGE), (ABResult, readback.AB_VERDICT),
                       (SeedRun, readback._SEED_RUN), (Speed, readback._SPEED), (PointStats, readback._POINT_STATS),
                       (SeedTarget, readback._SEED_TARGET), (SideTarget, readback._SIDE_TARGET)]:
        assert {f.name for f in fields(cls)} <= keys(shape), cls.__name__


def converge_report():
    from test_nightly_converge import report

    return report()


@pytest.mark.parametrize("edit", [
    {"curves": []}, {"targets": []}, {"speed": None}, {"headline": "a string headline"}, {"points": [{"step": 1}]},
    {"backends": ["torch"]}, {"curves": {"torch": {"0": {"status": "ok", "eval": [[0, 0]]}}}}])
def test_29_a_hand_edited_converge_json_is_one_line_in_the_nightly_report(tmp_path, edit):
    from xfw.report.nightly_report import converge_blocks
    from xfw.report.table import Bullets

    entry = tmp_path / "nights" / "n1" / "llava-converge"
    path = converge_report().save(entry)
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    blocks = converge_blocks(tmp_path, entry.parent, [])
    shown = [getattr(b, "text", "") for b in blocks]
    assert any(str(path) in s and "\n" not in s and next(iter(edit)) in s for s in shown), shown
    assert not any(isinstance(b, Bullets) and len(b.items) > 3 for b in blocks)  # no character per bullet


def test_29_a_damaged_nightly_verdicts_file_is_one_line(tmp_path):
    from xfw.report.verdicts import load_verdicts

    for doc, key in [({"verdicts": "abc"}, "verdicts"), ({"verdicts": [{"entry": "e"}]}, "verdicts[0].backend"),
                     ({"verdicts": [], "policy": []}, "policy"),
                     ({"verdicts": [{"entry": "e", "backend": "b", "metric": "ips", "verdict": "ok", "value": "x"}]},
                      "verdicts[0].value")]:
        (tmp_path / "nightly.json").write_text(json.dumps(doc))
        with pytest.raises(UnreadableFile) as err:
            load_verdicts(tmp_path)
        assert f"nightly.json: {key}:" in str(err.value) and "\n" not in str(err.value)


def test_29_a_damaged_ab_json_is_skipped_by_report_never_a_crash(tmp_path):
    from xfw.workflow.reading import _ab_pair

    good = {"schema": 1, "verdicts": [{"recipe": "r", "first": "a", "second": "b", "verdict": "slower", "pairs": 3}]}
    (tmp_path / "ab.json").write_text(json.dumps(good))
    assert _ab_pair([str(tmp_path)]) == ("a", "b")
    for bad in ({"schema": 1, "verdicts": "x"}, {"schema": 1, "verdicts": [{"first": 1}]}, {"verdicts": [[]]}):
        (tmp_path / "ab.json").write_text(json.dumps(bad))
        assert _ab_pair([str(tmp_path)]) is None


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=5), lambda c: st.lists(c, max_size=3)
                           | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=8)


@FUZZ
@given(data=st.data())
def test_fuzz_29_any_edit_of_converge_json_renders_or_is_one_line(tmp_path_factory, data):
    from xfw.report.converge import ConvergeReport
    from xfw.report.nightly_report import converge_blocks
    from xfw.report.table import to_html, to_markdown, Page

    doc = converge_report().to_dict()
    for _ in range(data.draw(st.integers(1, 3))):  # replace a key at some depth with any JSON value
        node, key = doc, data.draw(st.sampled_from(sorted(doc)))
        while isinstance(node.get(key), dict) and node[key] and data.draw(st.booleans()):
            node, key = node[key], data.draw(st.sampled_from(sorted(node[key])))
        node[key] = data.draw(json_values)
    entry = tmp_path_factory.mktemp("h") / "nights" / "n1" / "c"
    entry.mkdir(parents=True)
    (entry / "converge.json").write_text(json.dumps(doc))
    blocks = converge_blocks(entry.parent.parent.parent, entry.parent, [])
    page = Page(title="t", level=1, blocks=blocks)
    to_html(page), to_markdown(page)
    try:
        ConvergeReport.from_dict(read_checked(entry / "converge.json", readback.CONVERGE))
    except ShapeError as err:
        assert "\n" not in str(err) and "converge.json: " in str(err)
    except (TypeError, KeyError, ValueError):
        pass  # a fitting shape whose values from_dict still refuses: named in the report as above


# --- 30: keys a command forces cannot be overridden per backend --------------------------------------

def invoke(*args):
    from click.testing import CliRunner

    from xfw import cli

    return CliRunner().invoke(cli.main, [str(a) for a in args])


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if not line.startswith("data: ")]  # preparing
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


CONVERGE_RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "llava_json_sft.yaml")


def converge_cli(*args):
    return invoke("converge", CONVERGE_RECIPE, *args, "--python", "torch=/nonexistent/python",
                  "--python", "paddle=/nonexistent/python")


def test_30_every_key_converge_forces_is_refused_as_a_per_backend_override():
    from types import SimpleNamespace

    from xfw.recipe import RecipeError, load_recipe
    from xfw.recipe.overrides import refuse_forced
    from xfw.run.commands.converge import Plan

    forced = [*Plan.seed_overrides(SimpleNamespace(steps=40, eval_every=20, eval_samples=24, timeout_s=600.0), 0),
              "model.weights=EXPORT"]  # as xfw converge declares it
    for key, value in [("data.eval_samples", 100), ("model.weights", "random"), ("measure.eval_every", 5),
                       ("measure.steps", 3), ("measure.seed", 7), ("data.seed", 7), ("measure.warmup_steps", 2)]:
        recipe = load_recipe(CONVERGE_RECIPE, [f"backends.paddle.override.{key}={value}"])
        with pytest.raises(RecipeError) as err:
            refuse_forced(recipe, forced, "xfw converge")
        assert f"backends.paddle.override.{key}: xfw converge sets {key} itself" in str(err.value)
    refuse_forced(load_recipe(CONVERGE_RECIPE, ["backends.paddle.override.optimizer.lr=1.0e-4"]), forced, "x")


def test_30_converge_refuses_a_forced_key_override_in_one_line_before_anything():
    line = one_line_error(converge_cli("--seeds", "2", "--steps", "20", "--eval-every", "10",
                                       "--set", "backends.torch.override.data.eval_samples=100"))
    assert "backends.torch.override.data.eval_samples: xfw converge sets data.eval_samples itself" in line


def test_30_parity_refuses_an_override_of_what_it_forces(tmp_path, write_recipe):
    line = one_line_error(invoke("parity", write_recipe(), "--backends", "torch,paddle", "--out", tmp_path / "p",
                                 "--set", "backends.torch.override.precision.dtype=bf16",
                                 "--set", "backends.torch.override.precision.amp_level=O1"))
    assert "backends.torch.override.precision." in line and "xfw parity sets precision." in line
    assert not (tmp_path / "p").exists()


# --- 31: a backend named in an override must be one the command runs --------------------------------

def test_31_a_misspelt_or_absent_backend_in_an_override_is_refused(tmp_path, fake_backend, write_recipe):
    TINY_RECIPE = write_recipe()
    fakes = ["--python", f"fake={fake_backend['fake']}", "--python", f"fake2={fake_backend['fake2']}"]
    for name in ("torhc", "fake3"):
        line = one_line_error(invoke("compare", TINY_RECIPE, "--backends", "fake,fake2", "--out", tmp_path / name,
                                     "--set", f"backends.{name}.override.optimizer.lr=0.5", *fakes))
        assert f"backends.{name}.override: '{name}' is not a backend of this command (--backends fake,fake2)" in line
        assert not (tmp_path / name).exists()
    line = one_line_error(invoke("validate", TINY_RECIPE, "--set", "backends.torhc.override.optimizer.lr=0.5"))
    assert "backends.torhc.override: 'torhc' is no backend xfw has" in line
    # an adapter's override reaches its instances; an instance's own is fine too
    result = invoke("validate", TINY_RECIPE, "--set", "backends.paddle@3.2.0.override.optimizer.lr=0.5")
    assert result.exit_code == 0, result.output


# --- 32: instance labels and versions over the documented length --------------------------------------

@pytest.mark.parametrize("text", ["paddle@" + "x" * 120, "paddle@1." + "1." * 60 + "0",
                                  "paddle@" + "n" * 95 + "=/usr/bin/python3"])
def test_32_an_instance_name_over_the_length_is_one_line(text):
    from xfw.recipe.names import MAX_NAME_CHARS
    from xfw.run.launch import instances

    with pytest.raises(instances.InstanceError) as err:
        instances.parse(text)
    assert f"at most {MAX_NAME_CHARS}" in str(err.value) and "\n" not in str(err.value) and len(str(err.value)) < 300
    line = one_line_error(invoke("compare", "x.yaml", "--backends", f"torch,{text}"))
    assert f"at most {MAX_NAME_CHARS}" in line


def test_32_a_long_wheel_version_is_one_line(tmp_path):
    from xfw.run.launch import instances

    wheel = tmp_path / f"paddlepaddle-{'1.' * 60}0-cp312-cp312-linux_x86_64.whl"
    wheel.write_bytes(b"")
    with pytest.raises(instances.InstanceError, match="at most 100"):
        instances.parse(f"paddle@{wheel}")


# --- 33: every subprocess of a check or a build ends with it ----------------------------------------

def _gone(pid: int, within_s: float) -> bool:
    import os
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie of an ended process counts as gone
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


SPAWNER = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
           "open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(300)")


def test_33_a_check_that_times_out_is_ended_with_its_children(tmp_path):
    import sys

    from xfw.run.launch.task import TaskTimeout, run_task

    pid_file = tmp_path / "child"
    with pytest.raises(TaskTimeout, match="took over 3 s"):
        run_task([sys.executable, "-c", SPAWNER, str(pid_file)], timeout_s=3)
    assert _gone(int(pid_file.read_text()), 5)


def test_33_a_describe_check_past_its_time_leaves_nothing_running(tmp_path, monkeypatch):
    import sys

    from xfw.run.launch import launcher

    pid_file = tmp_path / "child"
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"{SPAWNER}\" {pid_file}\n")
    script.chmod(0o755)
    monkeypatch.setattr(launcher, "DESCRIBE_TIMEOUT_S", 3)
    with pytest.raises(launcher.BackendError, match="took over 3 s"):
        launcher.describe_backend(launcher.Backend("torch", str(script)))
    assert _gone(int(pid_file.read_text()), 5)


def test_33_xfw_killed_during_a_build_step_leaves_nothing_running(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child"
    xfw = subprocess.Popen([sys.executable, "-c", "import sys; from xfw.run.launch.task import run_task; "
                            f"run_task([sys.executable, '-c', {SPAWNER!r}, {str(pid_file)!r}], timeout_s=300)"],
                           cwd=Path(__file__).resolve().parents[2])
    deadline = time.monotonic() + 20
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(xfw.pid, signal.SIGKILL)
    xfw.wait()
    assert _gone(int(pid_file.read_text()), 5)


def test_33_a_killed_builds_scratch_is_listed_cleaned_and_never_one_that_lives(tmp_path):
    import os
    import subprocess

    from xfw.run.launch import instances

    builds = tmp_path / instances.BUILDS_DIR
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = builds / f".paddle@3.2.0{instances.SCRATCH_MARK}{dead.pid}"
    living = builds / f".paddle@3.3.0{instances.SCRATCH_MARK}{os.getpid()}"
    for d in (left, living):
        (d / "lib").mkdir(parents=True)
        (d / "lib" / "big").write_bytes(b"x" * 4096)
    assert instances.abandoned_builds(tmp_path) == [left]
    assert instances.built_envs(tmp_path) == []  # never taken for a built environment
    lines = instances.clean_builds(tmp_path)
    assert len(lines) == 1 and str(left) in lines[0] and not left.exists() and living.exists()
    assert "nothing to clean" in instances.clean_builds(tmp_path)[0]


# --- 34: a wheel must be the framework it stands for ---------------------------------------------------

def make_wheel(folder: Path, file_dist: str, meta_name: str) -> Path:
    import zipfile

    path = folder / f"{file_dist}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{file_dist}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {meta_name}\nVersion: 1.0\n")
        z.writestr(f"{file_dist}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\n")
    return path


def test_34_a_wheel_of_another_distribution_is_refused_naming_both(tmp_path):
    from xfw.run.launch.buildcheck import wheel_problem

    assert wheel_problem(str(make_wheel(tmp_path, "torch", "torch")), "torch") is None
    assert wheel_problem(str(make_wheel(tmp_path, "paddlepaddle_gpu", "paddlepaddle-gpu")),
                                   "paddlepaddle") is None
    problem = wheel_problem(str(make_wheel(tmp_path, "tinything", "tinything")), "torch")
    assert "the wheel of 'tinything', not of torch" in problem
    problem = wheel_problem(str(make_wheel(tmp_path, "torchvision", "torchvision")), "torch")
    assert "not of torch" in problem  # a name that merely starts like it is not it
    lying = make_wheel(tmp_path, "torch", "tinything")
    assert "not of torch" in wheel_problem(str(lying), "torch")
    junk = tmp_path / "torch-1.0-py3-none-any.whl"
    junk.write_bytes(b"not a zip")
    assert "cannot be read as a wheel" in wheel_problem(str(junk), "torch")


def test_34_an_unrelated_wheel_never_starts_a_build(tmp_path):
    from xfw.run.launch import instances

    (tmp_path / ".venv" / "torch" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "torch" / "bin" / "python").write_text("")
    (tmp_path / "adapters" / "torch").mkdir(parents=True)
    (tmp_path / "adapters" / "torch" / "requirements.txt").write_text("torch==2.13.0  # xfw: framework\n")
    wheel = make_wheel(tmp_path, "tinything", "tinything")
    with pytest.raises(instances.InstanceError, match="not of torch"):
        instances.ensure_env(instances.parse(f"torch@mine={wheel}"), print, tmp_path)
    assert not (tmp_path / instances.BUILDS_DIR).exists()


# --- 35: settings checked before any launch (a converge rerun with other --steps) ----------------------

def test_35_a_converge_rerun_of_other_settings_refuses_before_anything_launches(tmp_path):
    from xfw.run.commands import converge as cv
    from xfw.workflow.studies import converge_jobs

    chosen = cv.plan(CONVERGE_RECIPE, [], backends=("paddle", "torch"), seeds=2, steps=20, eval_every=10)
    out = tmp_path / "out"
    for job in converge_jobs(chosen, out):  # an earlier converge's speed runs, of other settings
        job.run_dir.mkdir(parents=True)
        (job.run_dir / "spec.json").write_text(json.dumps({"name": "x", "measure": {"steps": 3}}))
    # the interpreters do not exist: a check of them (or an export) first would say so instead
    line = one_line_error(converge_cli("--seeds", "2", "--steps", "20", "--eval-every", "10", "--out", out))
    assert "holds a run of other settings" in line
    assert not (out / "seed-0").exists() and not any(out.rglob("model.safetensors"))


# --- 36: every count option has a documented bound, checked before any work ------------------------

@pytest.mark.parametrize("args", [["converge", CONVERGE_RECIPE, "--seeds", "100000"],
                                  ["converge", CONVERGE_RECIPE, "--seeds", "1000000000"],
                                  ["converge", CONVERGE_RECIPE, "--steps", "10000000000"],
                                  ["compare", "x.yaml", "--repeat", "1000000000"],
                                  ["parity", "x.yaml", "--steps", "10000000"],
                                  ["maxbatch", "x.yaml", "--max-micro", "100000000000"]])
def test_36_a_count_past_its_bound_is_one_line_at_once(args):
    import time

    started = time.monotonic()
    result = invoke(*args)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "1000" in result.output.replace(",", "") or "range" in result.output
    assert time.monotonic() - started < 5


def test_36_a_suite_converge_entry_has_the_same_bounds():
    from xfw.run.commands.counts import COUNT_BOUNDS, count_problem
    from xfw.run.commands.converge import MAX_SEEDS

    assert COUNT_BOUNDS["seeds"] == COUNT_BOUNDS["max_seeds"] == MAX_SEEDS  # one bound, two places that name it
    assert count_problem("seeds", 10**9, "entries[0].converge.seeds") == \
        f"entries[0].converge.seeds: must be an integer >= 1 and at most {MAX_SEEDS}, got 1,000,000,000"
    assert count_problem("seeds", 0).startswith("--seeds: must be an integer >= 1")


# --- 37: an uninstallable version names what was asked and what exists --------------------------------

def test_37_pips_useful_line_is_shown_not_its_help_pointer():
    from xfw.run.launch.buildcheck import pip_error as _pip_error

    versions = ", ".join(f"2.{i}.0" for i in range(20))
    lines = ["Collecting torch==9.9.9\n",
             f"ERROR: Could not find a version that satisfies the requirement torch==9.9.9 (from versions: {versions})\n",
             "ERROR: No matching distribution found for torch==9.9.9\n"]
    said = _pip_error(lines)
    assert "torch==9.9.9" in said and "2.19.0" in said and "2.0.0" not in said and len(said) <= 400
    conflict = [  # pip 24's words on this machine, where its configuration constrains torch
        "ERROR: Cannot install torch==9.9.9 because these package versions have conflicting dependencies.\n", "\n",
        "The conflict is caused by:\n", "    The user requested torch==9.9.9\n",
        "    The user requested (constraint) torch<=2.14.1\n", "\n",
        "Additionally, some packages in these conflicts have no matching distributions available for your "
        "environment:\n", "    torch\n", "\n", "To fix this you could try to:\n",
        "ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution\n"]
    assert _pip_error(conflict) == ("ERROR: Cannot install torch==9.9.9 because these package versions have conflicting "
                                    "dependencies: The user requested torch==9.9.9; The user requested (constraint) "
                                    "torch<=2.14.1; no distribution of torch available here")


# --- 38: explain --categories checks what else was given -------------------------------------------------

def test_38_explain_categories_checks_the_recipe_and_backends(write_recipe):
    TINY_RECIPE = write_recipe()
    assert one_line_error(invoke("explain", "missing.yaml", "--categories"))
    assert "no adapter of that name" in one_line_error(invoke("explain", "--categories", "--backends", "torhc,torch"))
    assert one_line_error(invoke("explain", "--categories", "--backends", "torch,,torch"))
    assert invoke("explain", TINY_RECIPE, "--categories").exit_code == 0
    assert invoke("explain", "--categories").exit_code == 0


# --- 39: a builds file's comment starts only at a line start or after whitespace ----------------------

def test_39_a_hash_inside_an_interpreter_path_is_kept(tmp_path):
    from xfw.run.commands.bisect import read_builds, strip_comment

    assert strip_comment("paddle@a=/opt/build#3/bin/python  # nightly 3") == "paddle@a=/opt/build#3/bin/python"
    assert strip_comment("# all of it") == "" and strip_comment("paddle@3.2.0\t#x") == "paddle@3.2.0"
    python = tmp_path / "build#3" / "python"
    python.parent.mkdir()
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    builds = tmp_path / "builds.txt"
    builds.write_text(f"# the builds\npaddle@old=/usr/bin/env # a comment\npaddle@new={python}\n")
    found = read_builds(builds)
    assert [b.python for b in found.builds] == ["/usr/bin/env", str(python)]


@FUZZ
@given(path=st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp")), min_size=1, max_size=30),
       comment=st.text(max_size=20))
def test_fuzz_39_a_path_without_whitespace_survives_any_comment(path, comment):
    from xfw.run.commands.bisect import strip_comment

    comment = comment.replace("\n", " ").replace("\r", " ")
    line = f"paddle@x=/{path}"
    assert strip_comment(f"{line} #{comment}") == line.strip() and strip_comment(line) == line.strip()


def test_33_a_build_step_that_fails_or_hangs_is_one_line_and_leaves_nothing(tmp_path):
    import sys

    from xfw.run.launch import instances

    inst = instances.parse("torch@2.0.0")
    with pytest.raises(instances.InstanceError, match=r"torch@2.0.0: creating its virtual environment failed \(exit 3"):
        instances._step(inst, [sys.executable, "-c", "import sys; sys.exit(3)"], 10, "creating its virtual environment")
    pid_file = tmp_path / "child"
    with pytest.raises(instances.InstanceError, match="pip install: .* took over 2 s") as err:
        instances._step(inst, [sys.executable, "-c", SPAWNER, str(pid_file)], 2, "pip install", on_line=print)
    assert "\n" not in str(err.value) and _gone(int(pid_file.read_text()), 5)
    with pytest.raises(instances.InstanceError, match="cannot start"):
        instances._build(inst, tmp_path / "no-python", "", tmp_path / "scratch", print)


def test_30_maxbatch_refuses_an_override_of_the_batch_it_searches(tmp_path, write_recipe):
    line = one_line_error(invoke("maxbatch", write_recipe(), "--backends", "torch", "--out", tmp_path / "m",
                                 "--set", "backends.torch.override.batch.micro=2"))
    assert "backends.torch.override.batch.micro: xfw maxbatch sets batch.micro itself" in line


def test_31_a_nightly_run_of_some_of_its_backends_keeps_the_others_overrides(tmp_path, write_recipe):
    from xfw.recipe import load_recipe
    from xfw.workflow.base import UsageError, prepare_backends

    recipe = load_recipe(write_recipe(), ["backends.paddle.override.optimizer.lr=1.0e-4"])
    with pytest.raises(UsageError, match="'paddle' is not a backend of this command"):
        prepare_backends(["torch"], {"torch": "/nonexistent"}, [recipe])
    with pytest.raises(UsageError) as err:  # the suite runs paddle: only the interpreter is wrong
        prepare_backends(["torch"], {"torch": "/nonexistent"}, [recipe], runs=["paddle", "torch"])
    assert "override" not in str(err.value)
