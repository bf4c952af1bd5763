"""Hostile and unlucky input, round four (issue 34): published-settings files and ``--as published``,
backend environments, run directories that are not what they seem (FIFOs, devices, links out, a live
run), processes a run leaves behind, and documents read back (spec.json's comparison block,
selfcheck.json). Each case is refused in one line naming the file and key (exit 2, nothing launched)
or survived with nothing lost; the numbers in the names follow docs/reliability.md (23 to 27).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xfw import cli
from xfw.contract import lifeline
from xfw.contract.atomic import UnreadableFile, read_bounded, read_json_object
from xfw.recipe import published as pub
from xfw.recipe import RecipeError, load_recipe

from conftest import TINY_RECIPE

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SOURCES = {"run": {"repo": "o/r", "commit": COMMIT, "path": "bench.sh"}}


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


@contextlib.contextmanager
def within(seconds: int):
    """Fail (instead of hanging the suite) when the block takes longer than ``seconds``."""
    def expired(signum, frame):
        raise AssertionError(f"took over {seconds} s: a read that blocks or never ends")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def published_file(tmp_path: Path, sides: dict | None = None, throughput=None, **extra) -> Path:
    data = {"row": "test-row", "sources": SOURCES, "sides": sides if sides is not None else {}, **extra}
    if throughput is not None:
        data["throughput"] = throughput
    path = tmp_path / "published.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def recipe_file(tmp_path: Path, published: Path | None = None, **sections) -> Path:
    data = {**TINY_RECIPE, **sections}
    if published is not None:
        data.update(published=str(published), comparison="published")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    return path


def entry(key, value, **more):
    return {"key": key, "value": value, "source": "run", **more}


# --- 23: a published file is cited data ------------------------------------------------------------

@pytest.mark.parametrize("side, item, words", [
    ("torch", entry("command", ["/bin/sh", "-c", "touch /tmp/xfw-pwned"]), "'command' is not a setting"),
    ("fake", entry("command", ["/bin/sh", "-c", "true"]), "'command' is not a setting"),
    ("torch", entry("cwd", "/"), "'cwd' is not a setting"),
    ("torch", entry("override.optimizer.lr", 1.0), "'override.optimizer.lr' is not a setting"),
    ("torch", entry("log_pattern.step", "x"), "'log_pattern.step' is not a setting"),
    ("torch", entry("no_such_knob", 1), "not a knob of backends.torch"),
    ("torch", entry("tf32", [1, 2, 3]), "is not true or false"),
    ("paddle", entry("sharding_segment_size", 0), "is not a positive integer"),
    ("torch", entry("env.XFW_PARENT", "1:2"), "not a variable name a recipe may set"),
    ("torch", entry("env.A.B", "1"), "a variable is env.NAME"),
    ("torch", entry("env.LONG", "x" * 300_000), "a variable is at most"),
    ("torch", entry("env.BAD", "a\ud800b"), "lone surrogate"),
    ("torch", entry("tf32", True, line="7"), "is not a line number"),
    ("torch", {"key": "tf32", "value": True, "source": ["run"]}, "is not one of the file's sources"),
    ("torch", {"key": "tf32", "value": True, "source": {"a": 1}}, "is not one of the file's sources"),
    ("torch", {"not_reproduced": ["a"], "source": "run"}, "not_reproduced: must be text"),
])
def test_23_a_published_entry_that_is_not_a_settable_knob_or_variable_is_one_line_and_nothing_runs(
        tmp_path, side, item, words):
    path = published_file(tmp_path, {side: [item]})
    line = one_line_error(invoke("validate", recipe_file(tmp_path, path)))
    assert str(path) in line and f"sides.{side}.0" in line and words in line, line
    assert not Path("/tmp/xfw-pwned").exists()


@pytest.mark.parametrize("document, words", [
    ({"sides": [1, 2]}, "sides: must be a mapping"),
    ({"sides": "torch"}, "sides: must be a mapping"),
    ({"throughput": [1]}, "throughput: must be a mapping"),
    ({"throughput": {"torch": {"definition": "rank0_times", "n": -5, "source": "run"}}}, "throughput.torch.n"),
    ({"throughput": {"torch": {"definition": "rank0_times", "n": True, "source": "run"}}}, "throughput.torch.n"),
    ({"throughput": {"torch": {"definition": "step_mean", "skip_steps": -1, "source": "run"}}}, "skip_steps"),
    ({"throughput": {"torch": {"definition": "step_mean", "skip_steps": "abc", "source": "run"}}}, "skip_steps"),
    ({"throughput": {"torch": {"definition": "step_mean", "skip_steps": 1.5, "source": "run"}}}, "skip_steps"),
    ({"throughput": {"torch": {"definition": "step_mean", "source": ["run"]}}}, "is not one of the file's sources"),
    ({"command": ["/bin/sh"]}, "command: unknown key"),
])
def test_23_a_published_file_of_the_wrong_shape_is_one_line_naming_the_key(tmp_path, document, words):
    path = tmp_path / "published.yaml"
    path.write_text(yaml.safe_dump({"row": "r", "sources": SOURCES, **document}))
    line = one_line_error(invoke("validate", recipe_file(tmp_path, path)))
    assert str(path) in line and words in line, line


def test_23_a_published_path_in_a_symlink_loop_is_one_line(tmp_path):
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    line = one_line_error(invoke("validate", recipe_file(tmp_path, tmp_path / "a.yaml")))
    assert "a.yaml" in line


def test_23_a_published_path_that_is_a_fifo_or_a_device_is_one_line_at_once(tmp_path):
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    for name in ("fifo.yaml", "zero.yaml"):
        with within(20):
            line = one_line_error(invoke("validate", recipe_file(tmp_path, tmp_path / name)))
        assert name in line or "published" in line, line


def test_23_a_not_reproduced_note_cannot_write_markdown_of_its_own(tmp_path):
    from xfw.report import table

    path = published_file(tmp_path, {"torch": [{"not_reproduced": "a\n# Injected\n- item\u2028## two", "source": "run"}]})
    note = pub.load(path)["sides"]["torch"]["not_reproduced"][0]["what"]
    assert "\n" not in note and "\u2028" not in note
    page = table.Page(title="t", blocks=[table.Heading("h\n# x", 3), table.Bullets(["a\n# Injected", "b\r\n## c"])])
    lines = table.to_markdown(page).splitlines()
    assert not any(line.startswith("# Injected") or line.startswith("## c") or line.startswith("# x") for line in lines)


@pytest.mark.parametrize("value", [0, -1, "abc", 1.5, True, [1]])
def test_23_sharding_segment_size_that_paddle_refuses_is_refused_by_validate(tmp_path, value):
    line = one_line_error(invoke("validate", recipe_file(tmp_path, backends={"paddle": {"sharding_segment_size": value}})))
    assert "backends.paddle.sharding_segment_size" in line and "positive integer" in line


# --- 24: settings that vanish, and what the report says ran --------------------------------------

@pytest.mark.parametrize("assignment, path, expected", [
    ("backends.torch={tf32: false}", ("torch", "tf32"), False),
    ("backends.torch.tf32=false", ("torch", "tf32"), False),
    ("backends={torch: {tf32: false}}", ("torch", "tf32"), False),
    ("backends.paddle.env={FLAGS_x: '2'}", ("paddle", "env", "FLAGS_x"), "2"),
    ("backends.paddle={env: {FLAGS_x: '3'}}", ("paddle", "env", "FLAGS_x"), "3"),
])
def test_24_a_set_in_any_form_is_never_overridden_by_a_published_value(tmp_path, assignment, path, expected):
    from xfw.recipe.spec import resolve_spec

    published = published_file(tmp_path, {"torch": [entry("tf32", True)], "paddle": [entry("env.FLAGS_x", "1")]})
    recipe = load_recipe(recipe_file(tmp_path, published), [assignment])
    node = recipe.backends
    for key in path:
        node = node[key]
    assert node == expected and type(node) is type(expected)
    spec = resolve_spec(recipe, backend=path[0], run_id="t")
    key = ".".join(path[1:])
    described = spec["comparison"]
    assert key not in [e["key"] for e in described["set"]], described  # never listed as applied
    (replaced,) = [e for e in described["replaced"] if e["key"] == key]
    assert replaced["ran"] == expected


def test_24_the_mechanisms_table_lists_what_ran_not_the_replaced_published_value(tmp_path):
    from xfw.report import comparison, table

    class Side:
        ok, applied, ips, script_ips = True, {}, 1.0, None

        def __init__(self, described):
            self.setup = {"comparison": described}

    class Row:
        model, stage = "Tiny", "sft"

        def __init__(self, sides):
            self.sides = sides

    from xfw.recipe.spec import resolve_spec

    published = published_file(tmp_path, {"torch": [entry("tf32", True), entry("env.FLAGS_y", "1")]})
    recipe = load_recipe(recipe_file(tmp_path, published), ["backends.torch.tf32=false"])
    described = resolve_spec(recipe, backend="torch", run_id="t")["comparison"]
    text = table.to_markdown(table.Page(title="t", blocks=comparison.blocks([Row({"torch": Side(described)})], ["torch"])))
    assert "| torch | tf32 |" not in text and "| torch | env.FLAGS_y | 1 |" in text, text
    assert "tf32 ran as False, not the published True" in text, text


def test_24_a_thread_variable_contradicting_cpu_threads_is_refused_and_an_agreeing_one_kept(tmp_path):
    measure = {**TINY_RECIPE["measure"], "cpu_threads": 1}
    line = one_line_error(invoke("validate", recipe_file(tmp_path, measure=measure,
                                                         backends={"torch": {"env": {"OMP_NUM_THREADS": "2"}}})))
    assert "backends.torch.env.OMP_NUM_THREADS" in line and "measure.cpu_threads = 1" in line
    assert invoke("validate", recipe_file(tmp_path, measure=measure,
                                          backends={"torch": {"env": {"OMP_NUM_THREADS": "1"}}})).exit_code == 0


@pytest.mark.parametrize("value, words", [("x" * 300_000, "a variable is at most"), ("a\ud800", "lone surrogate")])
def test_24_an_env_value_that_cannot_launch_is_refused_by_validate(tmp_path, value, words):
    line = one_line_error(invoke("validate", recipe_file(tmp_path, backends={"torch": {"env": {"V": value}}})))
    assert "backends.torch.env.V" in line and words in line


def test_24_variables_that_change_the_program_are_named_in_warnings_and_the_headline(tmp_path, fake_backend):
    recipe = recipe_file(tmp_path, backends={"fake": {"env": {"PYTHONPATH": os.environ["PYTHONPATH"],
                                                              "OMP_NUM_THREADS": "2", "NCCL_ALGO": "Tree"}}},
                         measure={**TINY_RECIPE["measure"], "cpu_threads": None})
    result = invoke("compare", recipe, "--backends", "fake", "--out", tmp_path / "out",
                    "--python", f"fake={fake_backend['fake']}")
    assert result.exit_code == 0, result.output
    report = (tmp_path / "out" / "report.md").read_text()
    headline = report.split("\n\n")[1]
    assert "fake OMP_NUM_THREADS=2 (host thread count)" in headline and "fake PYTHONPATH=" in headline, headline
    warnings = report[report.index("### Warnings"):].split("###")[1]
    assert "OMP_NUM_THREADS=2" in warnings and "PYTHONPATH" in warnings and "NCCL_ALGO" not in warnings


# --- 25: files that are not what they seem --------------------------------------------------------

def test_25_the_bounded_read_refuses_fifos_devices_links_out_and_oversized_files(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "fifo.json")
    (run / "zero.json").symlink_to("/dev/zero")
    (run / "out.json").symlink_to("/etc/hostname")
    (run / "real.json").write_text('{"a": 1}')
    (run / "in.json").symlink_to(run / "real.json")
    (run / "big.json").write_bytes(b" " * 2048)
    (run / "loop.json").symlink_to(run / "loop.json")
    with within(10):
        for name, words in (("fifo.json", "a FIFO"), ("zero.json", "symbolic link out"), ("out.json", "out of"),
                            ("loop.json", "cannot read")):
            with pytest.raises(UnreadableFile, match=words):
                read_bounded(run / name)
        with pytest.raises(UnreadableFile, match="a device"):
            read_bounded(run / "zero.json", within="/")
        with pytest.raises(UnreadableFile, match="larger than 1 KiB"):
            read_bounded(run / "big.json", 1024)
    assert read_json_object(run / "in.json") == {"a": 1}
    with pytest.raises(UnreadableFile, match="nested too deeply"):
        (run / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
        read_json_object(run / "deep.json")


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """One finished run of the fake backend (copied and damaged by the tests)."""
    from conftest import FAKES

    out = tmp_path_factory.mktemp("fake-run")
    (out / "r.yaml").write_text(yaml.safe_dump(TINY_RECIPE))
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(FAKES), old])
    try:
        result = invoke("run", out / "r.yaml", "--backend", "fake", "--out", out / "runs", "--python",
                        f"fake={sys.executable}")
    finally:
        os.environ["PYTHONPATH"] = old
    assert result.exit_code == 0, result.output
    (run_dir,) = [p.parent for p in (out / "runs").rglob("summary.json")]
    return run_dir


def copy_run(fake_run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "runs" / "tiny-test" / "fake"
    shutil.copytree(fake_run, target)
    return target


@pytest.mark.parametrize("name, make", [
    ("summary.json", "fifo"), ("spec.json", "fifo"), ("steps.jsonl", "fifo"),
    ("spec.json", "zero"), ("steps.jsonl", "zero"), ("summary.json", "outside"),
])
def test_25_report_over_a_fifo_a_device_or_a_link_out_never_hangs_and_names_the_file(tmp_path, fake_run, name, make):
    run = copy_run(fake_run, tmp_path)
    (run / name).unlink()
    if make == "fifo":
        os.mkfifo(run / name)
    else:
        (run / name).symlink_to("/dev/zero" if make == "zero" else "/etc/hostname")
    with within(60):
        result = invoke("report", tmp_path / "runs", "--out", tmp_path / "report")
    assert result.exit_code in (1, 2) and "Traceback" not in result.output, result.output
    if result.exit_code == 1:
        assert name in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.parametrize("content, words", [("[1, 2]", "expected a JSON object"),
                                            ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                                            (None, "a FIFO")])
def test_25_estimate_run_on_a_list_a_deep_document_or_a_fifo_is_one_line(tmp_path, fake_run, content, words):
    run = copy_run(fake_run, tmp_path)
    (run / "spec.json").unlink()
    if content is None:
        os.mkfifo(run / "spec.json")
    else:
        (run / "spec.json").write_text(content)
    with within(20):
        line = one_line_error(invoke("estimate", "--run", run))
    assert "spec.json" in line and words in line, line


@pytest.mark.parametrize("edit, words", [
    (lambda s: s["model"]["arch"].pop("family"), "family"),
    (lambda s: s["model"]["arch"].update(family="nosuch"), "cannot estimate"),
    (lambda s: s["batch"].update(micro="2"), "cannot estimate"),
])
def test_25_estimate_run_on_an_edited_spec_is_one_line_never_a_traceback(tmp_path, fake_run, edit, words):
    run = copy_run(fake_run, tmp_path)
    spec = json.loads((run / "spec.json").read_text())
    edit(spec)
    (run / "spec.json").write_text(json.dumps(spec))
    line = one_line_error(invoke("estimate", "--run", run))
    assert words in line and "nan" not in line


def test_25_estimate_run_never_prints_nan(tmp_path, fake_run):
    run = copy_run(fake_run, tmp_path)
    spec = json.loads((run / "spec.json").read_text())
    spec["model"]["arch"]["hidden_size"] = 1e400  # inf once read: inf - inf makes nan
    (run / "spec.json").write_text(json.dumps(spec).replace("Infinity", "1e400"))
    result = invoke("estimate", "--run", run)
    assert "nan" not in result.output.lower() and "Traceback" not in result.output, result.output


def part_dir(tmp_path: Path, fake_run: Path) -> Path:
    """A node's part of a two-node run (rank 0 of 2), made from the fake run."""
    part = copy_run(fake_run, tmp_path / "node0")
    summary = json.loads((part / "summary.json").read_text())
    summary["node"] = {"rank": 0, "count": 2, "ranks": [0, 0]}
    (part / "summary.json").write_text(json.dumps(summary))
    return part


@pytest.mark.parametrize("make", ["zero", "outside", "fifo", "dir-link"])
def test_25_assemble_never_copies_a_device_a_fifo_or_a_file_from_outside_a_part(tmp_path, fake_run, make):
    part = part_dir(tmp_path, fake_run)
    target = {"zero": "/dev/zero", "outside": "/etc/hostname", "dir-link": "/etc"}.get(make)
    if make == "fifo":
        os.mkfifo(part / "extra.log")
    else:
        (part / "extra.log").symlink_to(target)
    with within(30):
        line = one_line_error(invoke("assemble", tmp_path / "node0", "--out", tmp_path / "all"))
    assert "extra.log" in line, line
    assert not list((tmp_path / "all").rglob("extra.log")) and not list((tmp_path / "all").rglob("spec.json"))


def test_25_assemble_keeps_a_link_inside_its_part(tmp_path, fake_run):
    part = part_dir(tmp_path, fake_run)
    (part / "again.log").symlink_to(part / "stderr.log")
    result = invoke("assemble", tmp_path / "node0", "--out", tmp_path / "all")
    assert "Traceback" not in result.output and result.exit_code in (0, 1), result.output
    (copied,) = (tmp_path / "all").rglob("again.log")
    assert not copied.is_symlink() and copied.read_bytes() == (part / "stderr.log").read_bytes()


def test_25_report_refuses_to_write_into_a_directory_a_live_command_holds(tmp_path, fake_run):
    from xfw.run.launch import lock

    run = copy_run(fake_run, tmp_path)
    with lock.hold(tmp_path / "runs", "xfw compare live.yaml"):
        line = one_line_error(invoke("report", tmp_path / "runs"))
        assert "in use by pid" in line and "xfw compare live.yaml" in line
        assert not (tmp_path / "runs" / "report.md").exists()
        (run / "summary.json").unlink()  # the run is going: no summary yet, its adapter alive
        (run / "adapter.json").write_text(json.dumps({"process": lifeline.identity(), "command": ["x"]}))
        result = invoke("report", tmp_path / "runs", "--out", tmp_path / "elsewhere")
    text = (tmp_path / "elsewhere" / "report.md").read_text()
    assert "still running" in text and "crashed" not in text, text
    assert result.exit_code == 1


@pytest.mark.parametrize("value", [[1], "x", {"host": []}, {"host": {"hostname": 5}}, {"backends": {"fake": 1}}])
def test_25_a_malformed_selfcheck_json_never_crashes_a_run(tmp_path, fake_backend, monkeypatch, value):
    from xfw.run.commands import selfcheck

    target = tmp_path / "sc"
    target.mkdir()
    (target / "selfcheck.json").write_text(json.dumps({"env": value, "verdicts": [{"backend": 1}]}))
    setup = {"num_processes": 1, "sharding": "none", "dtype": "fp32", "amp_level": "O0", "recompute": False}
    warnings = selfcheck.unchecked_paths([("fake", setup, {})], {"fake": (None, {"device_name": "cpu"})}, target)
    assert any("selfcheck.json" in w for w in warnings), warnings
    monkeypatch.chdir(tmp_path)
    shutil.copytree(target, tmp_path / "runs" / "selfcheck")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(TINY_RECIPE))
    result = invoke("compare", tmp_path / "r.yaml", "--backends", "fake", "--out", tmp_path / "out",
                    "--python", f"fake={fake_backend['fake']}")
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output


# --- 26: every process a run starts ends with it --------------------------------------------------

def test_26_a_stopped_process_in_its_own_session_ends_with_the_run(tmp_path, fake_backend):
    recipe = recipe_file(tmp_path, backends={"fake": {"behave": "stopped_child", "child_pid_file": str(tmp_path / "pid")}},
                         measure={**TINY_RECIPE["measure"], "timeout_s": 3})
    t0 = time.monotonic()
    result = invoke("run", recipe, "--backend", "fake", "--out", tmp_path / "out",
                    "--python", f"fake={fake_backend['fake']}")
    assert result.exit_code == 1 and "timeout" in result.output, result.output
    ident = (tmp_path / "pid").read_text()
    deadline = time.monotonic() + 5
    while lifeline.is_alive(ident) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not lifeline.is_alive(ident), f"the stopped child {ident} outlived the run"
    assert time.monotonic() - t0 < 30


def test_26_a_killed_ranks_reason_names_the_rank_and_the_signal():
    from xfw.run.launch.launcher import classify

    records = [{"kind": "start", "rank": r} for r in (0, 1)] + \
        [{"kind": "step", "rank": r, "step": i} for r in (0, 1) for i in range(3)] + [{"kind": "end", "rank": 0}]
    status, reason = classify(exit_code=241, timed_out=False, records=records, num_processes=2,
                              stderr_tail="LAUNCH INFO 2026 job exit code 241\n", timeout_s=60)
    assert status == "crashed" and "rank 1 of 2" in reason and "after 3 steps" in reason and "SIGTERM" in reason, reason


# --- 27: documents read back, checked by type -----------------------------------------------------

def test_27_an_edited_comparison_block_makes_the_run_unreadable_in_one_line(tmp_path, fake_run):
    run = copy_run(fake_run, tmp_path)
    spec = json.loads((run / "spec.json").read_text())
    spec["comparison"] = {"kind": "published", "throughput": {"definition": "step_mean", "skip_steps": "abc"}}
    (run / "spec.json").write_text(json.dumps(spec))
    result = invoke("report", tmp_path / "runs")
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "comparison.throughput.skip_steps" in (tmp_path / "runs" / "report.md").read_text()


@pytest.mark.parametrize("step, window", [(1e308, 1e308), (1e308, None), (None, 1e-308), (1e-308, 1e-308)])
def test_27_a_step_time_of_1e308_or_1e_minus_308_still_charts(tmp_path, fake_run, step, window):
    run = copy_run(fake_run, tmp_path)
    lines = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    for record in lines:
        if record["kind"] == "step" and step is not None:
            record["step_time_s"] = step
        if record["kind"] == "window" and window is not None:
            record["window_time_s"] = window
    (run / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = invoke("report", tmp_path / "runs")
    assert result.exit_code in (0, 1) and "Traceback" not in result.output, result.output
    assert (tmp_path / "runs" / "report.md").exists() and (tmp_path / "runs" / "chart.png").exists(), result.output


def test_27_a_breakdown_missing_a_part_is_not_called_an_attached_command():
    from xfw.report import breakdown

    parts = {"data_s": 0.1, "optimizer_s": 0.2, "rest of step": 0.3, "step_time_s": 0.6}
    text = str(breakdown.breakdown_table([("row", "torch", dict(parts))]).cells)
    assert "attached command" not in text and "not recorded" in text
    assert "attached command" in str(breakdown.breakdown_table([("row", "t", {**parts, "attached": True})]).cells)


# --- fuzzed: each reader is total ------------------------------------------------------------------

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
odd_text = st.text(max_size=10) | st.sampled_from(["run", "torch", "tf32", "env.X", "\ud800", "a\nb", "", "command",
                                                    "env.XFW_PARENT", "step_mean", "rank0_times", "window"])
json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | odd_text,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(odd_text, inner, max_size=3),
                           max_leaves=8)
entries = st.fixed_dictionaries({}, optional={
    "key": st.sampled_from(["tf32", "env.NCCL_ALGO", "command", "sharding_impl", "deepspeed.overlap_comm",
                            "attn_implementation", "sharding_segment_size", "env.A.B"]) | json_values,
    "value": json_values, "source": st.sampled_from(["run", "nowhere"]) | json_values,
    "line": st.integers(-3, 10**10) | json_values, "not_reproduced": odd_text | json_values})
definitions = st.fixed_dictionaries({}, optional={
    "definition": st.sampled_from(["window", "step_mean", "whole_run", "rank0_times"]) | json_values,
    "skip_steps": st.integers(-3, 10) | json_values, "n": st.integers(-3, 10) | json_values,
    "source": st.sampled_from(["run"]) | json_values})
published_docs = st.fixed_dictionaries(
    {"row": odd_text | json_values, "sources": st.just(SOURCES) | json_values},
    optional={"sides": st.dictionaries(st.sampled_from(["torch", "paddle", "fake"]), st.lists(entries | json_values,
                                                                                              max_size=3)) | json_values,
              "throughput": st.dictionaries(st.sampled_from(["torch", "paddle"]), definitions | json_values)
              | json_values})


@FUZZ
@given(document=published_docs | json_values)
def test_fuzz_any_published_file_loads_and_applies_or_is_one_line(tmp_path, document):
    path = tmp_path / "published.yaml"
    path.write_text(yaml.safe_dump(document, allow_unicode=True), encoding="utf-8", errors="surrogatepass")
    try:
        table = pub.load(path)
    except pub.PublishedError as err:
        assert "\n" not in str(err) and str(path) in str(err), err
        return
    data = {"backends": {}}
    pub.apply(data, table, set())
    assert all("command" not in knobs and "override" not in knobs for knobs in data["backends"].values())
    for side in ("torch", "paddle", "fake"):
        json.dumps(pub.described("published", table, side, attached=False, knobs=data["backends"].get(side, {})))


comparison_blocks = st.fixed_dictionaries({}, optional={
    "kind": st.sampled_from(["like-for-like", "published"]) | json_values, "row": odd_text | json_values,
    "file": odd_text | json_values, "set": st.lists(entries | json_values, max_size=2) | json_values,
    "not_applied": st.lists(entries | json_values, max_size=2) | json_values,
    "replaced": st.lists(entries | json_values, max_size=2) | json_values,
    "not_reproduced": st.lists(st.fixed_dictionaries({"what": odd_text, "source": odd_text}) | json_values,
                               max_size=2) | json_values,
    "throughput": definitions | json_values})


@settings(FUZZ, max_examples=100)
@given(block=comparison_blocks | json_values)
def test_fuzz_any_comparison_block_in_spec_json_reports_or_is_unreadable_in_one_line(tmp_path, fake_run, block):
    from xfw.report import compare as cmp
    from xfw.report import contrast, table
    from xfw.report.results import RunResult

    run = tmp_path / "run"
    if not run.exists():
        shutil.copytree(fake_run, run)
    spec = json.loads((fake_run / "spec.json").read_text())
    spec["comparison"] = block
    (run / "spec.json").write_text(json.dumps(spec))
    result = RunResult.load(run)
    if result.status == "unreadable":
        assert "spec.json: " in result.reason and "\n" not in result.reason, result.reason
    rows = cmp.compare_runs([result], ["fake"])
    table.to_markdown(contrast.contrast_page(rows, ["fake"]))


def test_a_fifo_or_device_in_place_of_a_history_is_refused_in_one_line_not_read(tmp_path):
    """The nightly history (history.jsonl) is read through the one bounded read like every other file."""
    import os
    import signal

    from xfw.contract.atomic import UnreadableFile
    from xfw.report.history import History

    os.mkfifo(tmp_path / "history.jsonl")
    signal.alarm(10)  # a FIFO opened for reading blocks until a writer comes: the test must not hang
    try:
        with pytest.raises(UnreadableFile, match="a FIFO, not a regular file"):
            History(tmp_path).rows()
    finally:
        signal.alarm(0)
    (tmp_path / "history.jsonl").unlink()
    (tmp_path / "history.jsonl").symlink_to("/dev/zero")
    with pytest.raises(UnreadableFile, match="symbolic link out of"):
        History(tmp_path).rows()
