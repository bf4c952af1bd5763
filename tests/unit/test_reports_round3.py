"""Reports a newcomer reads right, round three (issue 33): every headline with its noise, every page
naming its comparison, pages without raw markdown, a quick selfcheck."""

import csv
import dataclasses
import io
import re

import pytest
from click.testing import CliRunner

from xfw import cli
from xfw.report import comparison, contrast, layouts, plot
from xfw.report.compare import compare_runs
from xfw.report.nightly_report import memory_words, regressions_box
from xfw.report.table import to_csv, to_html, to_markdown
from xfw.report.verdicts import Verdict

from test_reports_round2 import MIB, cpu_measurement, cpu_result, demo_rows

BACKENDS = ["paddle", "torch"]


def repeated_rows():
    runs = [cpu_result("paddle", ips, peak_mib=622 + i, after_mib=595, repeat=i) for i, ips in enumerate((60.0, 70.0))]
    runs += [cpu_result("torch", ips, peak_mib=374, after_mib=340, repeat=i) for i, ips in enumerate((240.0, 260.0))]
    return compare_runs(runs, BACKENDS)


def headline(rows):
    table = contrast.contrast_table(rows, BACKENDS)
    return dict(zip(table.header, table.cells[0]))


def test_every_headline_figure_shows_its_spread_or_says_it_is_one_run():
    one = headline(demo_rows())
    assert one["paddle ips"] == "64.0 (one run, no spread)" and one["torch ips"] == "249 (one run, no spread)"
    assert one["Contrast"] == "-74% (one run, no spread)"
    assert one["paddle memory"] == ("27.00 MiB training (peak RSS 622.00 MiB, 595.00 MiB after build; "
                                    "one run, no spread)")
    many = headline(repeated_rows())
    assert many["paddle ips"] == "65.0 (spread 15.4%)"
    # the contrast's range over the repeats: paddle's lowest against torch's highest, and the other way round
    assert many["Contrast"] == f"-74% (range {(60 - 260) / 260:+.0%} to {(70 - 240) / 240:+.0%})"
    assert "spread 3.6%" in many["paddle memory"] and "one run" not in many["paddle memory"]


def test_the_chart_writes_the_contrast_as_the_table_does(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(plot, "_save", lambda fig, path: drawn.append(fig) or path)
    for rows, said in ((demo_rows(), "one run, no spread"), (repeated_rows(), "range")):
        plot.plot_comparison(rows, BACKENDS, tmp_path / "chart.png")
        ax = drawn[-1].axes[0]
        texts = [t.get_text() for t in ax.texts]
        assert contrast.fmt_headline_contrast(rows[0], BACKENDS).replace(" (", "\n(", 1) in texts
        assert said in ax.get_title() or said in " ".join(texts)
        assert "like-for-like comparison" in ax.get_title()  # the chart names its comparison


def two_process_rows(repeats=1):
    runs = []
    for backend in BACKENDS:
        for i in range(repeats):
            r = cpu_result(backend, 100.0, peak_mib=10, after_mib=5, repeat=i, window_s=0.3, steps=6)
            r.setup["num_processes"] = 2
            r.measurement = dataclasses.replace(r.measurement, num_ranks=2, per_rank=[
                {**r.measurement.per_rank[0], "rank": k, "num_measured_steps": 3} for k in (0, 1)])
            runs.append(r)
    return compare_runs(runs, BACKENDS)


def test_the_short_window_warning_counts_one_processs_steps_and_knows_its_repeats():
    (warning, _) = contrast.short_windows(two_process_rows())
    assert "(3 steps per process, 2 processes)" in warning and "6 steps" not in warning
    assert "set measure.steps=101 " in warning  # 3 steps in 0.3 s: about 10 s is 100 steps
    assert "--repeat 3" in warning
    (warning, _) = contrast.short_windows(two_process_rows(repeats=3))
    assert "--repeat 3" not in warning and "its 3 repeats give the spread shown" in warning
    notes = " ".join(contrast.contrast_table(two_process_rows(), BACKENDS).notes)
    assert "paddle 3 steps per process (2 processes) in 0.3 s" in notes


def verdict(verdict_name, baseline=None):
    return Verdict(entry="e", backend="torch", metric="ips", verdict=verdict_name, value=1.0, baseline=baseline,
                   change=None if baseline is None else 1.0 / baseline - 1, tolerance=0.05)


def test_a_first_night_says_nothing_was_compared_and_the_footer_names_the_memory_shown():
    first = regressions_box([verdict("new"), verdict("new")])
    assert first.box != "good" and first.title.startswith("Nothing compared") and "No regressions" not in first.title
    later = regressions_box([verdict("ok", 1.0), verdict("new")])
    assert later.box == "good" and "1 of 2 verdicts compared" in later.title
    assert regressions_box([verdict("regression", 2.0)]).box == "bad"
    assert memory_words(demo_rows()) == contrast.measure_name("rss_training")
    assert "peak RSS since the build" in memory_words(demo_rows())


def with_mechanisms(rows, **per_backend):
    for name, kernel in per_backend.items():
        rows[0].sides[name].applied["mechanisms"] = {"attention_kernel": kernel}
    return rows


def test_the_heading_says_what_is_not_the_same_instead_of_one_algorithm():
    runs = [cpu_result(b, 100.0, peak_mib=10, after_mib=5) for b in BACKENDS]
    runs[0].applied["mechanisms"] = {"attention_kernel": "sdpa_math"}
    runs[1].applied["mechanisms"] = {"attention_kernel": "sdpa: flash"}
    rows = compare_runs(runs, BACKENDS)
    title = comparison.title(rows)
    assert "one algorithm" not in title
    assert "except mechanism.attention_kernel (paddle sdpa_math, torch sdpa: flash)" in title
    assert comparison.short_name(rows) == "like-for-like comparison, except mechanism.attention_kernel"
    assert comparison.title(demo_rows()).startswith("Like-for-like comparison: one algorithm on both sides")
    single = compare_runs([cpu_result("torch", 100.0, peak_mib=10, after_mib=5)], ["torch"])
    assert "both sides" not in comparison.title(single) and "one backend (torch)" in comparison.title(single)
    page = to_markdown(contrast.contrast_page(single, ["torch"]))
    assert "on both sides" not in page.splitlines()[2]


def published_rows():
    runs = [cpu_result(b, 100.0, peak_mib=10, after_mib=5) for b in BACKENDS]
    entries = {"paddle": [{"key": "env.FLAGS_x", "value": "1", "source": "mix_run"}],
               "torch": [{"key": "tf32", "value": True, "source": "bench_run"},
                         {"key": "attn_implementation", "value": "flash_attention_2", "source": "bench_mem"}]}
    for r in runs:
        r.setup["comparison"] = {"kind": "published", "row": "llava7b_sft", "file": "recipes/published/x.yaml",
                                 "set": entries[r.backend], "not_reproduced": []}
        r.setup["optimizer"] = {"name": "adamw", "lr": 1e-3}
        r.setup["knobs"] = {e["key"]: e["value"] for e in entries[r.backend] if "." not in e["key"]}
    runs[1].applied["not_honoured"] = {"tf32": "asked true: a CPU has no TF32 (fp32 matmuls ran)",
                                       "attn_implementation": "asked flash_attention_2, ran sdpa: needs a CUDA device"}
    return compare_runs(runs, BACKENDS)


def test_a_published_headline_counts_the_settings_applied_here_and_flags_knobs_that_did_not_run():
    rows = published_rows()
    assert comparison.title(rows).endswith("published settings: 1 of 3 applied here")
    text = to_markdown(contrast.contrast_page(rows, BACKENDS))
    line = next(x for x in text.splitlines() if x.startswith("| knob.tf32 |"))
    assert "⚠ not what ran (torch: asked true: a CPU has no TF32" in line


def test_html_pages_show_no_raw_markdown_and_wide_tables_scroll():
    results = [cpu_result(b, 100.0, peak_mib=10, after_mib=5) for b in BACKENDS]
    results[1].measurement = dataclasses.replace(results[1].measurement, loss_first=7.0)  # parity advised, `quoted`
    for rows in (published_rows(), compare_runs(results, BACKENDS)):
        page = contrast.contrast_page(rows, BACKENDS)
        markdown, html = to_markdown(page), to_html(page)
        assert "**" in markdown
        text = re.sub(r"<[^>]+>", "", html.split("<body>", 1)[1])
        assert "**" not in text and "`" not in text
        assert html.count("<div class=wide><table") == html.count("<table") > 0
    assert "<strong>Like-for-like comparison" in html and "<code>xfw parity</code>" in html


def test_no_csv_has_two_columns_that_differ_only_in_case():
    text = to_csv(contrast.contrast_page(demo_rows(), BACKENDS))
    header = next(csv.reader(io.StringIO(text)))
    assert len({h.lower() for h in header}) == len(header)
    assert "Contrast (as shown)" in header and "contrast" in header


def test_cpu_layouts_speak_of_processes_and_name_the_comparison():
    runs = [cpu_result(b, 100.0, peak_mib=10, after_mib=5) for b in BACKENDS]
    (cost,) = layouts.cost(runs, 2.5)
    assert "GPU-hour" not in " ".join(cost.notes) and "per process-hour" in cost.notes[0]
    assert layouts.page_title("strategies", runs) == "Training strategies by process count"
    assert layouts.page_title("scaling", runs) == "Multi-process scaling"
    assert layouts.comparison_line(runs) == "Comparison: like-for-like comparison."


def test_points_that_cannot_run_are_not_listed_as_failed_runs():
    ok = [cpu_result(b, 100.0, peak_mib=10, after_mib=5, variant={"parallel.sharding": "none"}) for b in BACKENDS]
    na = [cpu_result(b, 0, peak_mib=10, after_mib=5, status="unsupported", variant={"parallel.sharding": "stage1"})
          for b in BACKENDS]
    text = to_markdown(contrast.contrast_page(compare_runs(ok + na, BACKENDS), BACKENDS))
    assert "Failed runs" not in text
    assert "### Not applicable here (not failures)" in text and "sharding stage1 needs more than one process" in text


def test_a_test_device_headline_says_its_timings_are_not_a_gpus():
    runs = [cpu_result(b, 100.0, peak_mib=10, after_mib=5) for b in BACKENDS]
    runs[0].applied["device"] = "testcpu (CPU test device: timings are not GPU-like)"
    first = to_markdown(contrast.contrast_page(compare_runs(runs, BACKENDS), BACKENDS)).splitlines()[2]
    assert "paddle ran on xfw's CPU test device (testcpu)" in first and "not a GPU's" in first
    assert "test device" not in to_markdown(contrast.contrast_page(demo_rows(), BACKENDS)).splitlines()[2]


def test_a_passed_parity_run_is_not_advised_again_and_report_keeps_the_parity_line(tmp_path):
    from xfw.workflow.base import read_parity_status, write_report

    results = [cpu_result(b, 100.0, peak_mib=10, after_mib=5) for b in BACKENDS]
    results[1].measurement = dataclasses.replace(results[1].measurement, loss_first=7.0)
    passed = {"tiny-llava-sft": {"status": "passed", "path": "runs/parity-x/parity.json", "num_steps": 10,
                                 "first_failing_step": None, "worst": {}, "note": ""}}
    advise = to_markdown(contrast.contrast_page(compare_runs(results, BACKENDS), BACKENDS))
    assert "`xfw parity` on the recipe" in advise
    quiet = to_markdown(contrast.contrast_page(compare_runs(results, BACKENDS, parity=passed), BACKENDS))
    assert "`xfw parity` on the recipe" not in quiet and "started both from one exported file and passed" in quiet
    write_report(results, BACKENDS, tmp_path, chart=False, parity=passed)
    assert read_parity_status(tmp_path) == passed
    assert read_parity_status(tmp_path / "elsewhere") is None


def test_parity_defaults_to_paddle_torch_like_every_other_command():
    defaults = {name: next(p.default for p in command.params if p.name == "backends")
                for name, command in cli.main.commands.items()
                if any(p.name == "backends" for p in command.params)}
    assert defaults["parity"] == "paddle,torch" == defaults["compare"]


def test_selfcheck_defaults_to_one_family_and_full_runs_them_all(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli.workflow, "selfcheck", lambda names, **kw: seen.update(kw) or cli.workflow.Outcome())
    for args, families in (([], ["llava"]), (["--full"], ["llava", "qwen2vl", "sd15", "sd3"]),
                           (["--families", "sd15"], ["sd15"])):
        result = CliRunner().invoke(cli.main, ["selfcheck", *args])
        assert result.exit_code == 0, result.output
        assert seen["families"] == families
    assert CliRunner().invoke(cli.main, ["selfcheck", "--full", "--families", "sd15"]).exit_code == 2


def test_selfcheck_counts_every_run_up_front_and_writes_verdicts_as_each_family_finishes(tmp_path, monkeypatch):
    from xfw.report.results import RunResult
    from xfw.run.commands import selfcheck as sc

    monkeypatch.setattr(sc, "export_initial_weights", lambda *a, **k: None)
    monkeypatch.setattr(sc, "load_recipe", lambda path, overrides: path)
    written = []

    def fake_run_jobs(todo, backends, *, on_result, **kw):
        for job in todo:
            on_result(job, RunResult(backend=job.backend, recipe="r", preset="tiny-llava", stage="sft",
                                     status="crashed", reason="no", measurement=cpu_measurement(None, peak_mib=1,
                                                                                                after_mib=1)))
            written.append((sc.VERDICTS_FILE in {p.name for p in tmp_path.iterdir()}))
        return [], 0

    monkeypatch.setattr(sc, "run_jobs", fake_run_jobs)
    monkeypatch.setattr(sc, "Job", lambda **kw: type("J", (), kw))
    lines = []
    backends = {"paddle": (None, {}), "torch": (None, {})}
    verdicts = sc.run_selfcheck(tmp_path, ["llava", "sd15"], ["fp32", "stage2"], backends, tmp_path, log=lines.append)
    assert lines[0].startswith("selfcheck: 8 runs (2 families x 2 paths x 2 backends), about ")
    assert "3/8 runs done" in " ".join(lines)
    assert written == [False, False, False, True, True, True, True, True]  # the first family's verdicts at once
    assert any(line.startswith("selfcheck llava: paddle fp32: fail") for line in lines)
    assert len(verdicts) == 4 and all(v.verdict == "fail" for v in verdicts)
