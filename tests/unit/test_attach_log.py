"""Attached commands under hostile or unlucky output (issues 25 and 26): progress bars, a pattern
that backtracks without end, a log without newlines, bad log patterns. Helpers: test_attach."""

from __future__ import annotations

from pathlib import Path

import pytest

from xfw.contract.records import read_records

from test_attach import PY, run_command, script

TQDM_SCRIPT = r"""
    import sys, time
    sys.stderr.write("Loading weights: 100%|##########| 5/5 [00:00<00:00, 5036.20it/s]\n")
    sys.stderr.write("***** Running training *****\n")  # logging goes to stderr, as the bar does
    for i in range(1, int(sys.argv[1]) + 1):
        time.sleep(0.02)
        sys.stderr.write(f"\rSteps: {i:>3}/100 [00:01<00:05, {10 + i}.00it/s]")
        sys.stderr.write(f"\rSteps: {i:>3}/100 [00:01<00:05, {10 + i}.00it/s, loss=0.1]")  # set_postfix: same step
        sys.stderr.flush()
    time.sleep(float(sys.argv[2]))
"""


def test_a_progress_bar_counts_each_step_once_after_training_starts_and_stops_the_command(tmp_path):
    path = script(tmp_path, TQDM_SCRIPT)
    pattern = {"steps_per_s": r"Steps: +(?P<step>\d+)/\d+ .*?([0-9.]+)it/s", "after": "Running training",
               "stream": "stderr"}
    result = run_command(tmp_path, {"command": [PY, str(path), "100", "0"], "log_pattern": pattern})
    assert result.status == "ok" and result.wall_time_s < 20, result.reason
    steps = [r for r in read_records(Path(result.run_dir) / "steps.jsonl")[0] if r["kind"] == "step"]
    assert [round(r["step_time_s"], 6) for r in steps] == [round(1 / (10 + i), 6) for i in range(1, 5)]
    assert "100/100" not in (Path(result.run_dir) / "stderr.log").read_text()  # stopped after 4 steps
    # the "after" line never comes: nothing counts, and the command that ends says how many matched
    pattern["after"] = "never printed"
    result = run_command(tmp_path, {"command": [PY, str(path), "3", "0"], "log_pattern": pattern},
                         run_dir=tmp_path / "out2")
    assert result.status == "invalid" and "had 0 line(s) matching log_pattern.steps_per_s after" in result.reason


def test_a_pattern_that_backtracks_without_end_is_ended_not_xfw(tmp_path):
    code = "print('a' * 34 + 'b', flush=True); import time; time.sleep(600)"
    result = run_command(tmp_path, {"command": [PY, "-c", code], "log_pattern": {"ips": r"^(?:a+)+c|([0-9]+)"}},
                         measure={"warmup_steps": 1, "steps": 3, "timeout_s": 300})
    assert result.status == "invalid" and result.wall_time_s < 60
    assert result.reason.startswith("log_pattern: matching 1 line(s) of the command's stdout took longer than")


def test_a_log_without_newlines_is_read_in_bounded_memory(tmp_path):
    from xfw.run.launch import logparse

    log = tmp_path / "stdout.log"
    with open(log, "w") as f:
        f.write("x" * (12 * logparse.CHUNK))  # 12 MiB and no newline
        f.write("\nstep time_s 0.5\r" + "y" * 100 + "\rstep time_s 0.25\n")
    pattern = logparse.LogPattern.parse({"step_time_s": r"time_s ([0-9.]+)"})
    counter = logparse.LogCounter(pattern, log)
    lines = logparse.Lines()
    assert lines.feed("z" * 10_000_000) == [] and len(lines.partial) == logparse.MAX_LINE
    assert counter.poll() == 2 and counter.values == [0.5, 0.25]
    counter.close()


@pytest.mark.parametrize("pattern, key, words", [
    ({"ips": r"(\d+) (\d+)"}, "ips", "exactly one group"),
    ({"ips": r"(?P<step>\d+) (\d+)", "after": "("}, "after", "not a regular expression"),
    ({"ips": "x" * 2000}, "ips", "at most 1000"),
    ({"ips": r"(\d)", "before": "x"}, "before", "unknown key"),
    ({"ips": r"([0-9.]+)(?P<unit>it/s|s/it)"}, "ips", "is for steps_per_s and step_time_s"),
])
def test_a_bad_log_pattern_names_its_key(pattern, key, words):
    from xfw.run.launch import logparse

    with pytest.raises(logparse.PatternError) as err:
        logparse.LogPattern.parse(pattern)
    assert err.value.key == key and words in str(err.value)


def test_a_third_backend_keeps_its_ips_column_and_the_terminal_shows_comparisons_plainly():
    from xfw.report import contrast
    from xfw.report.compare import compare_runs
    from xfw.report.table import Bullets, Page, to_markdown

    from test_compare_render import result

    backends = ["paddle", "torch", "other"]
    rows = compare_runs([result("paddle", 82.0), result("torch", 65.0), result("other", 12.5)], backends)
    table = contrast.contrast_table(rows, backends)
    assert table.header[2:6] == ["paddle ips", "Contrast", "torch ips", "other ips"]
    assert table.cells[0][5] == contrast.fmt_side_rate(rows[0].sides["other"]) and "12.5" in table.cells[0][5]
    page = Page(title="t", blocks=[Bullets(items=["needs measure.steps >= 3 <x>"])])
    assert "needs measure.steps >= 3 <x>" in to_markdown(page, images=False)  # the terminal
    assert "&gt;= 3 &lt;x&gt;" in to_markdown(page)  # the markdown file


def test_print_command_without_out_leaves_no_run_directory_behind(tmp_path, monkeypatch):
    from test_attach import command_recipe
    from test_reliability import invoke

    monkeypatch.chdir(tmp_path)
    path = command_recipe(tmp_path, {"command": [PY, "train.py"], "cwd": "."})
    result = invoke("run", path, "--backend", "mine", "--print-command")
    assert result.exit_code == 0, result.output
    assert "xfw.run.launch.guard" in result.output and "no spec.json written" in result.output
    assert not (tmp_path / "runs").exists() and not list(tmp_path.rglob("spec.json"))


def test_an_attached_sides_provenance_and_params_come_from_what_its_probe_saw():
    from xfw.report import contrast
    from xfw.report.compare import compare_runs
    from xfw.report.table import to_markdown

    from test_compare_render import result

    seen = dict(framework="torch", framework_version="2.13.0", version_torch="2.13.0", version_diffusers="0.42.1",
                step_boundary="optimizer step", notes="attached; samples counted from the inputs that reached "
                "UNet2DConditionModel's forward; parameters over UNet2DConditionModel 802948 (trainable 9984)")
    attached = result("torch", 40.0, preset="tiny-sd15", params=1_108_916, **seen)
    attached.env = {"backend": {"command": ["python", "train.py"], "cwd": "/x", "env": {}}}
    own = result("paddle", 20.0, preset="tiny-sd15", params=1_501_003)
    (row,) = compare_runs([own, attached], ["paddle", "torch"])
    assert any(w.startswith("torch ran 1,108,916 parameters") and "tiny-sd15 has 1,501,003" in w for w in row.warnings)
    assert not any(w.startswith("paddle ran") for w in row.warnings)  # xfw's own adapter builds the preset
    text = to_markdown(contrast.contrast_page([row], ["paddle", "torch"]))
    line = next(line for line in text.splitlines() if line.startswith("| ") and "| torch | the command" in line)
    assert "the command's own" in line and "reached UNet2DConditionModel's forward" in line
    assert "torch 2.13.0 (diffusers 0.42.1)" in line and "A command xfw attached to has no after-build" in text


def test_the_live_record_tail_holds_no_more_than_a_record_of_a_file_without_newlines(tmp_path):
    from xfw.contract.records import RecordTail

    path = tmp_path / "steps.jsonl"
    path.write_text("x" * (3 << 20))
    tail = RecordTail(path)
    assert tail.poll() == [] and len(tail._partial) == 1 << 20
    with open(path, "a") as f:
        f.write('\n{"kind": "end", "rank": 0}\n')
    assert tail.poll() == [{"kind": "end", "rank": 0}]


def test_a_lora_recipe_of_commands_only_needs_no_lora_section(tmp_path):
    from xfw.recipe import RecipeError, load_recipe

    from test_attach import command_recipe

    path = command_recipe(tmp_path, {"command": [PY, "train.py"]}, stage="lora")
    assert load_recipe(path).lora is None  # the command decides its adapters
    data = __import__("yaml").safe_load(path.read_text())
    data["backends"]["torch"] = {}  # xfw's own adapter beside it needs to know which LoRA to build
    path.write_text(__import__("yaml").safe_dump(data))
    with pytest.raises(RecipeError, match="stage 'lora' needs a lora section"):
        load_recipe(path)


def test_the_matcher_process_ends_with_xfw_even_inside_a_match_that_never_returns(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT

    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from xfw.run.launch import logparse\n"
            "m = logparse.Matcher(logparse.LogPattern.parse({'ips': r'^(?:a+)+c|([0-9]+)'}), deadline_s=600)\n"
            "print(m.proc.pid, flush=True); m.match(['a' * 40 + 'b'])\n")
    xfw_like = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    worker = int(xfw_like.stdout.readline())
    time.sleep(0.5)  # inside the match
    os.kill(xfw_like.pid, signal.SIGKILL)
    xfw_like.wait()
    for _ in range(50):
        try:
            state = Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    pytest.fail(f"the matcher {worker} outlived the process that started it (state {state})")


def test_a_bar_that_switches_to_seconds_per_step_is_read_through_a_unit_group():
    """tqdm prints it/s, and s/it once a step takes longer than a second (a loaded machine, a large model):
    a group named unit reads both, as the kind's unit; without it the slow lines would not count."""
    from xfw.run.launch import logparse

    log = "Steps: 1/100 [00:01, 4.00it/s]\rSteps: 2/100 [00:02, 1.25s/it]\rSteps: 3/100 [00:04, 2.00it/s]\n"
    rate = logparse.LogPattern.parse({"steps_per_s": r"Steps: +(?P<step>\d+)/\d+ .*?([0-9.]+)(?P<unit>it/s|s/it)"})
    assert rate.values(log) == [4.0, 0.8, 2.0]
    assert [rate.step_time_s(v, 8) for v in rate.values(log)] == [0.25, 1.25, 0.5]
    seconds = logparse.LogPattern.parse({"step_time_s": r"([0-9.]+)(?P<unit>s/it|it/s)"})
    assert seconds.values(log) == [0.25, 1.25, 0.5]
    plain = logparse.LogPattern.parse({"steps_per_s": r"([0-9.]+)it/s"})
    assert plain.values(log) == [4.0, 2.0]  # the s/it line is not a match: what the unit group is for

