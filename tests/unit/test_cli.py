"""The CLI as a user drives it: bad input stops before launch; a failed backend loses nothing."""

import json

from click.testing import CliRunner

from conftest import ROOT
from xfw import cli
from xfw.report.nodes import load_runs


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)


def python_args(fake_backend):
    return [x for name, path in fake_backend.items() for x in ("--python", f"{name}={path}")]


def test_validate_reports_file_and_key_and_exits_2(write_recipe):
    path = write_recipe(batch={"global": 5, "micro": 2})
    result = invoke("validate", path)
    assert result.exit_code == 2
    assert f"{path}: batch.global: 5 is not divisible" in result.output


def test_validate_prints_the_batch_split(write_recipe):
    result = invoke("validate", write_recipe())
    assert result.exit_code == 0 and "global batch 4 = micro 2 x 1 proc x 2 accum" in result.output


def test_compare_with_an_invalid_recipe_launches_nothing(write_recipe, tmp_path, fake_backend):
    bad = write_recipe(stage="nonsense")
    result = invoke("compare", bad, "--backends", "fake,fake2", "--out", tmp_path / "out", *python_args(fake_backend))
    assert result.exit_code == 2 and "stage: must be one of" in result.output
    assert not (tmp_path / "out").exists()


def test_compare_with_an_unavailable_backend_launches_nothing(write_recipe, tmp_path, fake_backend):
    result = invoke("compare", write_recipe(), "--backends", "fake,nosuch", "--out", tmp_path / "out",
                    "--python", f"fake={fake_backend['fake']}")
    assert result.exit_code == 2 and "backend 'nosuch'" in result.output
    assert not (tmp_path / "out").exists()


def test_compare_writes_table_csv_chart_and_run_directories(write_recipe, tmp_path, fake_backend):
    recipe = write_recipe(backends={"fake": {"ips": 120}, "fake2": {"ips": 100}})
    out = tmp_path / "out"
    result = invoke("compare", recipe, "--backends", "fake,fake2", "--out", out, *python_args(fake_backend))
    assert result.exit_code == 0, result.output
    assert "| Tiny LLaVA | SFT | 120 (one run, no spread) | +20% (one run, no spread) | 100 (one run, no spread) |" in result.output
    for name in ("report.md", "report.csv", "chart.png"):
        assert (out / name).exists()
    assert {r.backend for r in load_runs([out])} == {"fake", "fake2"}


def test_one_backend_crashing_keeps_the_other_result_and_marks_the_failed_side(write_recipe, tmp_path,
                                                                               fake_backend):
    recipe = write_recipe(backends={"fake": {"behave": "crash"}, "fake2": {"ips": 100}})
    out = tmp_path / "out"
    result = invoke("compare", recipe, "--backends", "fake,fake2", "--out", out, *python_args(fake_backend))
    assert result.exit_code == 1
    assert "| Tiny LLaVA | SFT | **crashed** | n/a | 100 (one run, no spread) |" in result.output
    assert "fake: crashed — RuntimeError: fake adapter crashed on purpose" in result.output
    summary = json.loads((out / "tiny-test" / "fake2" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["measurement"]["ips"] == 100.0


def test_one_backend_timing_out_keeps_the_other_result(write_recipe, tmp_path, fake_backend):
    recipe = write_recipe(backends={"fake": {"behave": "hang"}, "fake2": {"ips": 100}},
                          measure={"warmup_steps": 1, "steps": 3, "timeout_s": 3})
    result = invoke("compare", recipe, "--backends", "fake,fake2", "--out", tmp_path / "out",
                    *python_args(fake_backend))
    assert result.exit_code == 1
    assert "| **timeout** | n/a | 100 (one run, no spread) |" in result.output


def test_report_rebuilds_the_same_table_from_run_directories(write_recipe, tmp_path, fake_backend):
    recipe = write_recipe(backends={"fake": {"ips": 120}, "fake2": {"ips": 100}})
    out = tmp_path / "out"
    first = invoke("compare", recipe, "--backends", "fake,fake2", "--out", out, *python_args(fake_backend))
    again = invoke("report", out, "--backends", "fake,fake2", "--out", tmp_path / "again")
    assert again.exit_code == 0
    table = [line for line in first.output.splitlines() if line.startswith("| Tiny")]
    assert table and table[0] in again.output


def test_report_on_a_directory_without_runs_is_a_clear_error(tmp_path):
    result = invoke("report", tmp_path)
    assert result.exit_code == 2 and "no run directories" in result.output


def test_repeat_runs_each_backend_k_times_and_reports_the_median(write_recipe, tmp_path, fake_backend):
    recipe = write_recipe(backends={"fake": {"ips": 120}, "fake2": {"ips": 100}},
                          measure={"warmup_steps": 0, "steps": 2, "repeat": 2})
    out = tmp_path / "out"
    result = invoke("compare", recipe, "--backends", "fake,fake2", "--out", out, *python_args(fake_backend))
    assert result.exit_code == 0
    assert sorted(p.name for p in (out / "tiny-test").iterdir()) == ["fake-r0", "fake-r1", "fake2-r0", "fake2-r1"]


def test_repeat_option_runs_k_times_and_shows_the_spread(write_recipe, tmp_path, fake_backend):
    recipe = write_recipe(backends={"fake": {"ips": 120}, "fake2": {"ips": 100}},
                          measure={"warmup_steps": 0, "steps": 2})
    out = tmp_path / "out"
    result = invoke("compare", recipe, "--backends", "fake,fake2", "--repeat", "2", "--out", out,
                    *python_args(fake_backend))
    assert result.exit_code == 0
    assert sorted(p.name for p in (out / "tiny-test").iterdir()) == ["fake-r0", "fake-r1", "fake2-r0", "fake2-r1"]
    assert "| 120 (spread 0.0%) | +20% (range +20% to +20%) | 100 (spread 0.0%) |" in result.output


def test_help_and_validate_import_neither_pandas_nor_matplotlib_and_help_not_even_numpy():
    """Start-up (issue 15): ``xfw --help`` loads click alone; ``xfw validate`` what a recipe needs."""
    import subprocess
    import sys

    heavy = ("pandas", "matplotlib", "numpy", "rich", "xfw.report", "xfw.run.launch.launcher")
    code = ("import sys, runpy; sys.argv = {argv!r}\n"
            "try:\n    runpy.run_module('xfw.cli', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            f"import json; print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))")
    helped = subprocess.run([sys.executable, "-c", code.format(argv=["xfw", "--help"])], capture_output=True,
                            text=True, check=True, cwd=ROOT)
    assert json.loads(helped.stdout.strip().splitlines()[-1]) == []
    validated = subprocess.run([sys.executable, "-c", code.format(argv=["xfw", "validate", "recipes/tiny/llava_sft.yaml"])],
                               capture_output=True, text=True, check=True, cwd=ROOT)
    assert "recipes/tiny/llava_sft.yaml: ok" in validated.stdout
    loaded = json.loads(validated.stdout.strip().splitlines()[-1])
    assert "pandas" not in loaded and "matplotlib" not in loaded


def test_the_cli_names_every_report_layout():
    from xfw import cli
    from xfw.report.layouts import LAYOUTS

    assert cli.LAYOUT_NAMES == tuple(LAYOUTS)


def test_explain_is_compare_with_explain(monkeypatch, write_recipe):
    """`xfw explain R` makes the very call `xfw compare R --explain` makes (test_documented_commands then runs
    README's `xfw explain` once, as test_explain_both_backends' `compare --explain`)."""
    import inspect

    from xfw import workflow

    calls = []
    real = inspect.signature(workflow.compare)

    def record(*args, **kwargs):
        bound = real.bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append({k: v for k, v in bound.arguments.items() if k not in ("progress", "log")})
        return None

    monkeypatch.setattr(workflow, "compare", record)
    path = write_recipe()
    for argv in (("explain", path, "--set", "measure.steps=3"), ("compare", path, "--explain", "--set", "measure.steps=3")):
        CliRunner().invoke(cli.main, [str(a) for a in argv])
    for call in calls:  # no --parity: compare passes [], explain leaves the default None
        call["parity_dirs"] = list(call["parity_dirs"] or [])
    assert len(calls) == 2 and calls[0] == calls[1] and calls[0]["explain"] is True, calls
