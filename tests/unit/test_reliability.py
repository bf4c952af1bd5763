"""Hostile and unlucky input: each case gives a one-line error or a correct result, nothing lost.

The numbers in the test names follow docs/reliability.md. The adapters here are the fake ones
(tests/fakes): they write canned records through the real record writer and run the real lifeline.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from xfw import cli
from xfw.contract import lifeline, weights
from xfw.contract.records import read_records
from xfw.report.results import RunResult
from xfw.run.launch import jobs, launcher

from conftest import ROOT, TINY_RECIPE


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


def fake_python(fake_backend, *names):
    return [x for name in names or ("fake",) for x in ("--python", f"{name}={fake_backend[name]}")]


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


# --- 1. one command per output directory ----------------------------------------------------------

def xfw_process(*args, env_extra=None) -> subprocess.Popen:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "xfw.cli", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


def test_1_a_second_command_into_a_busy_out_refuses_and_names_the_holder(write_recipe, tmp_path, fake_backend):
    out = tmp_path / "out"
    hanging = write_recipe("hang.yaml", backends={"fake": {"behave": "hang"}}, measure={"timeout_s": 60})
    first = xfw_process("compare", hanging, "--backends", "fake", "--out", out, *fake_python(fake_backend))
    try:
        wait_for(lambda: (out / "tiny-test" / "fake" / launcher.ADAPTER_FILE).exists())
        second = invoke("compare", write_recipe(), "--backends", "fake", "--out", out, *fake_python(fake_backend))
        line = one_line_error(second)
        assert f"is in use by pid {first.pid}" in line and "xfw compare" in line
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(30)
    assert first.returncode == 130  # SIGTERM stops the adapter and reports what finished


# --- 2. a recipe's name is one plain path component --------------------------------------------------

@pytest.mark.parametrize("name", ["../../x", "/abs/path", "a\0b", "x" * 300, "report.md", "a/b", ".hidden", ""])
def test_2_a_name_that_is_not_a_plain_file_name_is_refused(tmp_path, name):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**TINY_RECIPE, "name": name}))
    line = one_line_error(invoke("validate", path))
    assert ": name: " in line


# --- 3. YAML that expands, repeats or nests without end ----------------------------------------------

BOMB = """name: bomb
model: {preset: tiny-llava}
stage: sft
batch: {global: 4, micro: 2}
backends:
  a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
  b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
  c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
  d: [*c, *c, *c, *c, *c, *c, *c, *c, *c]
"""


def test_3_an_alias_bomb_is_refused_at_once(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    t0 = time.monotonic()
    for args in (["validate", path], ["validate", "--print-spec", path]):
        assert "anchors and aliases" in one_line_error(invoke(*args))
    assert time.monotonic() - t0 < 5


def test_3_a_suite_with_aliases_or_duplicate_keys_is_refused(tmp_path):
    suite = tmp_path / "s.yaml"
    suite.write_text("name: s\nname: t\nbackends: [torch]\nentries: [x.yaml]\n")
    assert "duplicate key 'name'" in one_line_error(invoke("nightly", suite, "--history", tmp_path / "h"))


def test_3_nesting_without_end_is_refused(write_recipe, tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("name: x\nmodel: " + "[" * 200 + "]" * 200 + "\n")
    assert "nested deeper" in one_line_error(invoke("validate", path))


# --- 4. adapters die with xfw; a resume never runs beside an orphan ----------------------------------

def test_4_killing_xfw_with_sigkill_ends_its_adapter(write_recipe, tmp_path, fake_backend):
    out = tmp_path / "out"
    hanging = write_recipe(backends={"fake": {"behave": "hang"}}, measure={"timeout_s": 600})
    first = xfw_process("run", hanging, "--backend", "fake", "--out", out, *fake_python(fake_backend))
    marker = out / "tiny-test" / "fake" / launcher.ADAPTER_FILE
    wait_for(marker.exists)
    adapter = json.loads(marker.read_text())["process"]
    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    wait_for(lambda: not lifeline.is_alive(adapter), timeout_s=lifeline.POLL_S + lifeline.GRACE_S + 10)


def test_4_a_resume_refuses_while_an_earlier_adapter_still_runs_there(write_recipe, tmp_path, fake_backend,
                                                                     monkeypatch):
    monkeypatch.setattr(jobs, "ORPHAN_WAIT_S", 0.5)
    out = tmp_path / "sweep"
    run_dir = out / "tiny-test" / "batch.micro-1" / "fake"
    run_dir.mkdir(parents=True)
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run_dir / launcher.ADAPTER_FILE).write_text(json.dumps(
            {"process": lifeline.identity(orphan.pid), "command": ["python", "-m", "xfw_fake"]}))
        result = invoke("sweep", write_recipe(), "--set", "batch.micro=1", "--backends", "fake", "--out", out,
                        *fake_python(fake_backend))
        assert f"still running there ({orphan.pid}" in one_line_error(result)
        assert not (run_dir / "summary.json").exists()
    finally:
        orphan.kill()
        orphan.wait()


def test_4_the_lifeline_knows_a_reused_pid_from_its_process():
    me = lifeline.identity()
    assert lifeline.is_alive(me)
    pid, _, start = me.partition(":")
    assert not lifeline.is_alive(f"{pid}:{int(start) + 1}")  # same pid, another process
    assert not lifeline.is_alive("999999999:1")


# --- 5. nothing overwritten without --force --------------------------------------------------------------

def test_5_other_settings_or_another_recipe_into_an_existing_out_are_refused(write_recipe, tmp_path, fake_backend):
    out = tmp_path / "out"
    args = ["--backends", "fake", "--out", out, *fake_python(fake_backend)]
    assert invoke("compare", write_recipe(), *args).exit_code == 0
    before = (out / "report.md").read_text()
    assert invoke("compare", write_recipe(), *args).exit_code == 0  # the same settings again: re-measured
    line = one_line_error(invoke("compare", write_recipe(batch={"global": 4, "micro": 1}), *args))
    assert "holds a run of other settings" in line and "--force" in line
    other = dict(TINY_RECIPE, name="another")
    path = tmp_path / "another.yaml"
    path.write_text(yaml.safe_dump(other))
    line = one_line_error(invoke("compare", path, *args))
    assert "already holds runs of tiny-test" in line
    assert (out / "report.md").read_text().splitlines()[:4] == before.splitlines()[:4]
    assert invoke("compare", write_recipe(batch={"global": 4, "micro": 1}), *args, "--force").exit_code == 0


# --- 6. numbers finite and bounded, keys unique -----------------------------------------------------------

@pytest.mark.parametrize("override, key", [
    ("optimizer.lr=.nan", "optimizer.lr"), ("optimizer.lr=.inf", "optimizer.lr"),
    ("measure.timeout_s=.nan", "measure.timeout_s"), ("measure.steps=100000000000000000000000000000000000000000",
                                                      "measure.steps"),
    ("measure.timeout_s=1e30", "measure.timeout_s"), ("batch.micro=-3", "batch.micro"),
])
def test_6_a_number_that_is_not_finite_or_out_of_bounds_is_refused(write_recipe, override, key):
    line = one_line_error(invoke("validate", write_recipe(), "--set", override))
    assert f": {key}: " in line


def test_6_a_duplicate_key_is_refused(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(yaml.safe_dump(TINY_RECIPE) + "stage: lora\n")
    assert "duplicate key 'stage'" in one_line_error(invoke("validate", path))


# --- 7. one-line errors, never a traceback ----------------------------------------------------------------

def test_7_a_recipe_that_is_not_utf8_is_refused(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    assert "not UTF-8" in one_line_error(invoke("validate", path))


@pytest.mark.parametrize("kind", ["directory", "not executable"])
def test_7_a_python_that_cannot_run_is_refused(write_recipe, tmp_path, kind):
    target = tmp_path / "py"
    if kind == "directory":
        target.mkdir()
    else:
        target.write_text("#!/bin/sh\n")
        target.chmod(0o644)
    line = one_line_error(invoke("run", write_recipe(), "--backend", "fake", "--python", f"fake={target}"))
    assert "not an executable file" in line


def test_7_a_python_for_a_backend_not_run_is_refused(write_recipe, fake_backend):
    line = one_line_error(invoke("run", write_recipe(), "--backend", "fake", *fake_python(fake_backend, "fake", "fake2")))
    assert "'fake2' is not a backend of this command" in line


def fill(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def ran(tmp_path, write_recipe, fake_backend) -> Path:
    out = tmp_path / "out"
    assert invoke("compare", write_recipe(), "--backends", "fake,fake2", "--out", out,
                  *fake_python(fake_backend, "fake", "fake2")).exit_code == 0
    return out


CORRUPTIONS = {
    "garbage summary": ("fake/summary.json", lambda p: fill(p, "{not json"), "not valid JSON"),
    "a list for a summary": ("fake/summary.json", lambda p: fill(p, "[1, 2]"), "expected a JSON object"),
    "NaN in the spec": ("fake/spec.json", lambda p: fill(p, p.read_text().replace('"seed": 0', '"seed": NaN', 1)),
                        "not a number JSON allows"),
    "a summary field of the wrong type": ("fake/summary.json",
                                          lambda p: fill(p, json.dumps({**json.loads(p.read_text()), "variant": []})),
                                          "'variant' has type list"),
    "a record without its phase": ("fake/steps.jsonl",
                                   lambda p: fill(p, p.read_text().replace('"phase":"measure",', "", 1)),
                                   "missing 'phase'"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_7_a_corrupt_run_is_reported_unreadable_and_the_rest_still_renders(tmp_path, write_recipe, fake_backend,
                                                                          case):
    out = ran(tmp_path, write_recipe, fake_backend)
    relative, corrupt, message = CORRUPTIONS[case]
    corrupt(out / "tiny-test" / relative)
    result = invoke("report", out)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "| **unreadable** |" in result.output and message in result.output
    assert "| 100 (one run, no spread) |" in result.output  # fake2's side still renders


def test_7_a_zero_length_window_is_unreadable(tmp_path):
    records = tmp_path / "steps.jsonl"
    records.write_text(json.dumps({"schema": 1, "kind": "window", "rank": 0, "window_time_s": 0, "num_steps": 1,
                                   "samples": 1, "tokens": 0}) + "\n")
    _, problem = read_records(records)
    assert "window_time_s" in problem and "line 1" in problem


def test_7_a_corrupt_history_is_found_before_the_first_run(tmp_path, fake_backend):
    history = tmp_path / "h"
    history.mkdir()
    (history / "history.jsonl").write_text('{"night": "n1"\n')
    suite = tmp_path / "s.yaml"
    suite.write_text(yaml.safe_dump({"name": "s", "backends": ["fake"],
                                     "entries": [str(ROOT / "recipes/tiny/llava_sft.yaml")]}))
    line = one_line_error(invoke("nightly", suite, "--history", history, *fake_python(fake_backend)))
    assert "history.jsonl:1" in line
    assert not (history / "nights").exists()


def mounted_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def test_7_a_full_disk_in_one_backends_run_keeps_the_other_and_says_what_was_lost(write_recipe, tmp_path,
                                                                                  fake_backend):
    disk = tmp_path / "small"
    if not mounted_tmpfs(disk, "64k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (disk / "filler").write_bytes(b"\0" * (64 * 1024 - 4096 * 3))  # leave a few blocks
        recipe = write_recipe(measure={"warmup_steps": 1, "steps": 2000, "timeout_s": 60})
        result = invoke("compare", recipe, "--backends", "fake,fake2", "--out", disk / "out",
                        *fake_python(fake_backend, "fake", "fake2"))
        assert "Traceback" not in result.output and result.exit_code == 1
        assert "| **crashed** |" in result.output or "| **unreadable** |" in result.output
        assert "No space left on device" in result.output
        assert "could not write" in result.output  # the report files: named, and the table printed anyway
    finally:
        subprocess.run(["umount", str(disk)], check=False)


# --- 8. a truncated record file is never "ok" -------------------------------------------------------------

def test_8_a_truncated_steps_file_is_incomplete_not_ok(tmp_path, write_recipe, fake_backend):
    out = ran(tmp_path, write_recipe, fake_backend)
    records = out / "tiny-test" / "fake" / "steps.jsonl"
    records.write_text("".join(records.read_text().splitlines(keepends=True)[:3]))
    result = invoke("report", out)
    assert result.exit_code == 1
    assert "| **incomplete** |" in result.output and "a measured window for 0 of 1 ranks" in result.output
    assert RunResult.load(records.parent).status == "incomplete"


# --- 9. weights: float types only, offsets integers ---------------------------------------------------------

def test_9_float_bytes_labelled_as_integers_are_refused(tmp_path):
    import numpy as np

    path = tmp_path / weights.WEIGHTS_FILE
    weights.save_file({"w": np.ones((2, 2), np.float32)}, path)
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"F32"', b'"I32"'))
    with pytest.raises(weights.WeightsError, match=r"'w' is stored as I32, the model's parameter is floating"):
        weights.Checkpoint(tmp_path, family="llava").check({"w": (2, 2)}, lora=False)


def test_9_string_data_offsets_are_a_malformed_header(tmp_path):
    import numpy as np

    import struct

    path = tmp_path / weights.WEIGHTS_FILE
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + np.ones(2, np.float32).tobytes())
    with pytest.raises(weights.WeightsError, match="malformed header entry"):
        weights.list_tensors(path)


# --- 10. an exit code alone says nothing -------------------------------------------------------------------

def test_10_an_interpreter_that_prints_boom_and_exits_3_is_a_crash(write_recipe, tmp_path):
    script = tmp_path / "python"
    describe = {"backend": "odd", "framework": "odd", "framework_version": "0", "versions": {}, "device": "cpu",
                "device_name": "none", "launcher": ["{python}"]}
    script.write_text(f"#!{sys.executable}\nimport json, sys\n"
                      f"if '--describe' in sys.argv:\n    print(json.dumps({describe!r}))\n    sys.exit(0)\n"
                      "print('boom', file=sys.stderr)\nsys.exit(3)\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    result = invoke("run", write_recipe(), "--backend", "odd", "--python", f"odd={script}", "--out", tmp_path / "o")
    assert result.exit_code == 1
    assert "odd: crashed — boom (exit code 3)" in result.output


# --- 11. small things ----------------------------------------------------------------------------------------

def test_11_markup_in_a_reason_is_text_in_markdown_and_html(tmp_path, write_recipe, fake_backend):
    out = ran(tmp_path, write_recipe, fake_backend)
    summary = out / "tiny-test" / "fake" / "summary.json"
    data = json.loads(summary.read_text())
    summary.write_text(json.dumps({**data, "status": "crashed", "reason": "<img src=x onerror=alert(1)>"}))
    invoke("report", out)
    assert "<img src=x" not in (out / "report.md").read_text()
    assert "&lt;img src=x onerror=alert(1)&gt;" in (out / "report.html").read_text()


# --- fuzz: whatever a recipe or a --set holds, validate answers ok or one line, exit 0 or 2 ------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SECTIONS = ("name", "model", "stage", "data", "precision", "parallel", "batch", "recompute", "lora", "optimizer",
            "measure", "backends")
SUBKEYS = ("preset", "arch", "weights", "kind", "image_size", "seq_len", "dtype", "amp_level", "nproc_per_node",
           "sharding", "global", "micro", "r", "alpha", "targets", "lr", "betas", "steps", "warmup_steps",
           "timeout_s", "repeat", "cpu_threads", "torch", "text", "vision", "num_layers")
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-10**45, max_value=10**45),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                    st.sampled_from(["tiny-llava", "sft", "lora", "bf16", "O2", "stage2", "fp32", "O0", "synthetic"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(SUBKEYS) | st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
recipes = st.fixed_dictionaries({}, optional={k: values for k in SECTIONS}).map(
    lambda d: {**TINY_RECIPE, **d} if d.get("name") is None else d)
set_keys = st.lists(st.sampled_from(SECTIONS + SUBKEYS) | st.text(max_size=6), min_size=1, max_size=3).map(".".join)


def assert_answers_cleanly(result) -> None:
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    if result.exit_code == 2:
        assert result.output.startswith("error: ") and len(result.output.strip().splitlines()) <= 3, result.output


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=recipes)
def test_fuzz_any_recipe_validates_or_is_one_line_error(tmp_path, data):
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    assert_answers_cleanly(invoke("validate", path))


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=set_keys, value=st.text(max_size=30) | values.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip()))
def test_fuzz_any_set_option_validates_or_is_one_line_error(write_recipe, key, value):
    assert_answers_cleanly(invoke("validate", write_recipe(), "--set", f"{key}={value}"))


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_fuzz_any_text_as_a_recipe_validates_or_is_one_line_error(tmp_path, text):
    path = tmp_path / "text.yaml"
    path.write_text(text)
    assert_answers_cleanly(invoke("validate", path))
