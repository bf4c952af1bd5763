"""Issue 42 (reports a newcomer reads right, round four): explain's figures computed by the function of the
figures they are compared with (a row's fwd / bwd add up to what its difference is taken of, the waterfall
drawn from the table's own differences, explain.png marked unreliable like its page, rows under an unreliable
banner not ranked), and every published row recording the same mechanisms on both sides. No framework."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from PIL import Image as PILImage

from xfw.report import explain as report
from xfw.report import plot
from xfw.report.compare import ComparisonRow, Side
from xfw.report.table import Table
from xfw.recipe import published

NAMES = ("paddle", "torch")


def _explain(rows: dict[str, list[tuple[float, float]]], hooked: list[float]) -> dict:
    """An explain.json whose rows carry each hooked step's (fwd, bwd), seconds."""
    return {"schema": 1, "modules": {k: {"fwd_s": statistics.median(f for f, _ in v),
                                         "bwd_s": statistics.median(b for _, b in v)} for k, v in rows.items()},
            "module_steps": {k: [list(p) for p in v] for k, v in rows.items()}, "hooked_steps_s": hooked,
            "hooked_step_s": statistics.median(hooked), "plain_steps_s": hooked,
            "plain_step_s": statistics.median(hooked), "profiler_steps_s": hooked,
            "profiler_step_s": statistics.median(hooked), "categories": {"matmul": statistics.median(hooked)},
            "trace": "trace.json", "steps": len(hooked), "ran_with": {"interpreter": "python", "env": {}, "knobs": {}}}


# o_proj as issue 42 saw it: host stalls land in forward in some steps and in backward in others, so the median
# of fwd and the median of bwd are both small while the median step (fwd + bwd) is large.
STALLED = [(0.001, 0.012), (0.0012, 0.011), (0.013, 0.0009), (0.001, 0.0008), (0.012, 0.001), (0.0011, 0.0105),
           (0.0125, 0.0009)]
QUIET = [(0.0005, 0.0005)] * 7


def _page(tmp_path, a_rows, b_rows, a_step, b_step):
    sides = {}
    for name, rows, step in zip(NAMES, (a_rows, b_rows), (a_step, b_step)):
        d = tmp_path / "tiny" / name
        d.mkdir(parents=True)
        (d / "explain.json").write_text(json.dumps(_explain(rows, [step] * 7)))
        sides[name] = Side(backend=name, status="ok", run_dirs=[str(d)], step_time_median_s=step,
                           step_time_p10_s=step * 0.98, step_time_p90_s=step * 1.02)
    row = ComparisonRow(recipe="tiny", model="m", stage="sft", sides=sides)
    return report.explain_page([row], list(NAMES), tmp_path)


def _module_table(page) -> Table:
    return next(b for b in page.blocks if isinstance(b, Table) and b.name == "explain-modules")


def _shown(cell: str) -> float:
    return 0.0 if cell == "–" else sum(float(x) for x in cell.split(" (")[0].split(" / "))


def test_a_rows_fwd_and_bwd_add_up_to_what_its_difference_is_taken_of(tmp_path, monkeypatch):
    drawn = {}
    real = plot.plot_waterfall
    monkeypatch.setattr(plot, "plot_waterfall", lambda start, steps, end, path, **kw: (
        drawn.update(steps=steps, **kw), real(start, steps, end, path, **kw))[1])
    page = _page(tmp_path, {"o_proj": STALLED, "mlp": [(0.004, 0.006)] * 7},
                 {"o_proj": QUIET, "mlp": [(0.001, 0.002)] * 7}, 0.0200, 0.0040)
    table = _module_table(page)
    for name, fa, fb, diff, *_ in table.cells:
        # the difference column is the difference of the shown columns, to the printed digit
        assert abs(_shown(fa) - _shown(fb) - float(diff)) < 1e-9, (name, fa, fb, diff)
    o_proj = next(c for c in table.cells if c[0] == "o_proj")
    # before: fwd 1.20 / bwd 1.00 (separate medians) beside a difference of +12.4; now the median step's parts
    assert _shown(o_proj[1]) > 10 and float(o_proj[3]) > 10
    # the waterfall's bars are the table's differences
    bars = dict(drawn["steps"])
    assert bars["o_proj"] * 1e3 == pytest.approx(float(o_proj[3]), abs=1e-9) and not drawn["unreliable"]
    assert "UNRELIABLE" not in PILImage.open(tmp_path / "explain.png").text.get("Description", "")


def test_rows_under_an_unreliable_banner_are_not_ranked_and_the_chart_says_so_too(tmp_path):
    # the rows' sum (+9 ms) against a measured gap of +40 ms: unreliable
    page = _page(tmp_path, {"mlp": [(0.004, 0.006)] * 7}, {"mlp": [(0.0005, 0.0005)] * 7}, 0.0440, 0.0040)
    text = " ".join(getattr(b, "text", "") for b in page.blocks)
    assert "**The explanation is unreliable here**" in text and "none is ranked as a finding" in text
    assert "the rows' sum accounts for 23% of the measured gap: it misses the gap by 31.00 ms" in text
    assert "% of the gap:" not in text and "size differs" not in text
    ranks = [c[5] for c in _module_table(page).cells]
    assert ranks == [report.UNRANKED] and not any(r.isdigit() for r in ranks)
    mark = PILImage.open(tmp_path / "explain.png").text.get("Description", "")
    assert mark.startswith(plot.UNRELIABLE_MARK) and "accounts for 23%" in mark


PUBLISHED = sorted((Path(__file__).resolve().parents[2] / "recipes" / "published").glob("*.yaml"))


@pytest.mark.parametrize("path", PUBLISHED, ids=[p.stem for p in PUBLISHED])
def test_every_published_row_records_the_same_mechanisms_on_both_sides(path):
    data = published.load(path)
    assert set(data["sides"]) == {"paddle", "torch"}
    assert published.one_sided_mechanisms(data) == []
    # the ones issue 42 found on PyTorch's side only: the optimizer's implementation and, where a side checkpoints,
    # its style, each on Paddle's side too, read from a source or marked as the framework's default
    keys = {side: {e["key"]: e for kind in ("set", "recorded") for e in entries[kind]}
            for side, entries in data["sides"].items()}
    assert "optimizer_impl" in keys["paddle"] and ("checkpointing" in keys["paddle"]) == ("checkpointing" in keys["torch"])
    for entry in data["sides"]["paddle"]["recorded"]:
        assert entry["source"].count("@") == 1 and "#L" in entry["source"]
        if entry["how"] == "default":
            assert entry["text"] == (f"not set by the script — the framework's default, {entry['value']}, "
                                     f"from {entry['source']}")


def test_a_mechanism_on_one_side_only_is_named_and_a_recorded_entry_is_checked(tmp_path):
    source = "{repo: o/r, commit: " + "a" * 40 + ", path: run.sh}"
    f = tmp_path / "row.yaml"
    f.write_text("row: r\nsources: {s: " + source + "}\nsides:\n"
                 "  torch:\n    - {key: optimizer_impl, value: foreach, source: s, line: 3}\n"
                 "  paddle:\n    - {key: checkpointing, value: non_reentrant, recorded: default, source: s, line: 4}\n")
    data = published.load(f)
    assert published.one_sided_mechanisms(data) == ["checkpointing: paddle only (not on torch)",
                                                    "optimizer_impl: torch only (not on paddle)"]
    described = published.described("like-for-like", data, "paddle", attached=False)
    assert described["recorded"][0]["text"].startswith("not set by the script — the framework's default, non_reentrant")
    f.write_text(f.read_text().replace("recorded: default", "recorded: maybe"))
    with pytest.raises(published.PublishedError, match=r"sides\.paddle\.0\.recorded: must be one of default, script"):
        published.load(f)


def test_xfw_env_says_what_it_probes_as_it_goes(monkeypatch):
    from xfw.run.launch import launcher
    from xfw.workflow import reading

    seen = []

    def probe(names, interpreters, log):  # what prepare_backends does, without starting an interpreter
        seen.append(("probed", names[0]))
        if names[0] == "jax":
            raise reading.UsageError("no interpreter")
        return {names[0]: (launcher.Backend(names[0], f"/envs/{names[0]}/python"), {"device": "cpu"})}

    monkeypatch.setattr(reading, "prepare_backends", probe)
    monkeypatch.setattr(reading.instances, "built_envs", lambda: [])
    outcome = reading.describe_backends(["paddle", "jax"], {}, log=lambda line: seen.append(("log", line)))
    # a line before each probe starts, then how long it took: never a silent wait
    assert [kind for kind, _ in seen] == ["log", "probed", "log", "log", "probed", "log"]
    assert seen[0][1].startswith("xfw env: probing paddle (1 of 2)") and "probed in" in seen[2][1]
    assert seen[3][1].startswith("xfw env: probing jax (2 of 2)") and "jax not available" in seen[5][1]
    assert outcome.exit_code == 1 and "jax: NOT AVAILABLE" in outcome.text


# --- A/B and bisect pages (issue 42): each names what it compares and suggests a step that applies ------------------

BUILDS = ["paddle@3.0.0", "paddle"]
BACKPORT = ("Paddle 3.0.0 on a CPU: causal attention's GPU-only fused softmax replaced by the plain masked softmax "
            "Paddle 3.3 runs there (xfw_paddle.devices.backport_cpu_causal_softmax)")


def _build_rows(names=BUILDS, notes=("fp32 throughout; " + BACKPORT, "fp32 throughout"), losses=(6.3, 6.4),
                published_block=None):
    import dataclasses

    from tests.unit.test_reports_round2 import cpu_result
    from xfw.report.compare import compare_runs

    runs = []
    for name, note, loss in zip(names, notes, losses):
        r = cpu_result(name, 100.0, peak_mib=10, after_mib=5)
        r.measurement = dataclasses.replace(r.measurement, loss_first=loss)
        r.applied["notes"] = note
        if published_block is not None:
            r.setup["comparison"] = published_block
        runs.append(r)
    return compare_runs(runs, list(names))


def test_an_ab_page_and_its_chart_name_two_builds_show_the_backport_and_suggest_no_cross_framework_step(
        tmp_path, monkeypatch):
    from xfw.report import comparison, contrast
    from xfw.report.table import to_markdown

    rows = _build_rows()
    assert comparison.compared(BUILDS) == "two builds of paddle" and comparison.compared(NAMES) == "two frameworks"
    assert plot.chart_title(rows, BUILDS) == "Training speed of two builds of paddle"
    assert plot.chart_title(_build_rows(NAMES, notes=("a", "b")), list(NAMES)) == "Training speed by framework"
    titles = []
    monkeypatch.setattr("matplotlib.axes.Axes.set_title", lambda self, text, **kw: titles.append(text))
    plot.plot_comparison(rows, BUILDS, tmp_path / "chart.png")
    assert titles[0].startswith("Training speed of two builds of paddle\n")
    page = to_markdown(contrast.contrast_page(rows, BUILDS))
    heading = page.splitlines()[2]
    assert heading.startswith("**Two builds of paddle: paddle@3.0.0 against paddle") and "framework comparison" not in heading
    # the backport that changes 3.0.0's attention path: in the heading, the warnings and the settings, not only summary.json
    assert f"paddle@3.0.0 only: {BACKPORT}" in heading
    assert any(line.startswith("- ⚠ tiny-llava-sft: the builds did not run the same code here") and BACKPORT in line
               for line in page.splitlines())
    assert next(x for x in page.splitlines() if x.startswith("| adapter_notes |")).endswith("⚠ differs |")
    # first losses of two builds: no `xfw parity` (a check across frameworks) and no "the frameworks draw them"
    assert "xfw parity" not in page and "the two builds of paddle drew" in page
    for row in rows:  # nor a "no parity run" line: parity compares frameworks
        row.parity = {"status": "none", "path": None, "note": ""}
    assert "Parity:" not in to_markdown(contrast.contrast_page(rows, BUILDS))
    # two frameworks: their adapters' notes differ by nature, shown and never flagged
    (row,) = _build_rows(NAMES, notes=("fp32 throughout", "fp32 throughout; autograd anomaly detection on"))
    assert "adapter_notes" in row.settings and "adapter_notes" not in row.differing


def test_published_settings_are_listed_once_when_both_builds_share_them_and_by_build_where_they_differ():
    from xfw.report import comparison
    from xfw.report.table import Bullets

    block = {"kind": "like-for-like", "row": "llava7b-sft", "file": "recipes/published/llava7b_sft.yaml",
             "not_applied": [{"key": "env.FLAGS_x", "value": "1", "source": "o/r@abc:run.sh#L1"}],
             "not_reproduced": [{"what": "its own loop", "source": "o/r@abc:run.sh#L2"}]}
    rows = _build_rows(published_block=block)
    bullets = {b.name: b.items for b in comparison.blocks(rows, BUILDS) if isinstance(b, Bullets)}
    assert bullets["not_applied"] == ["both builds: env.FLAGS_x = 1 (o/r@abc:run.sh#L1)"]
    assert bullets["not_reproduced"] == ["both builds: its own loop (o/r@abc:run.sh#L2)"]
    assert comparison.once({"a": ["x", "y"], "b": ["x", "z"]}, "both sides") == [
        ("both sides", "x"), ("a", "y"), ("b", "z")]


def test_a_bisect_page_names_its_framework_counts_from_1_and_an_undecided_range_suggests_more_pairs():
    from tests.unit.test_builds import _measure, _names
    from xfw.report.bisect import bisect_page, headline
    from xfw.report.table import Bullets
    from xfw.run.commands import bisect as bs

    names, positions = _names(8)
    undecided, result = (bs.search(names, names[0], names[-1], _measure(5, 0.18, 0.4, seed=seed, positions=positions),
                                   bs.Plan(start=3, max_pairs=6)) for seed in (0, 2))
    assert (undecided.outcome, result.outcome) == ("undecided", "range")
    page = bisect_page(result, "tiny")
    assert page.title == "Bisect over 8 builds of fw: tiny"
    table = next(b for b in page.blocks if getattr(b, "name", "") == "bisect")
    for record in table.records:  # the page's positions are bisect.json's: 1-based, as the builds list
        assert names[record["position"] - 1] == record["build"]
    listed = next(b for b in page.blocks if isinstance(b, Bullets) and b.name == "builds").items
    assert listed[0].startswith(f"position 1: {names[0]}")
    # more pairs apply (a new --out: bisect.json is keyed by --max-pairs), over the range it could not split
    assert f"Next: `xfw bisect RECIPE --builds FILE --good {result.last_good} --bad {result.first_bad} --repeat auto " \
           "--max-pairs 12 --out ANOTHER_DIR`" in headline(result)
    assert f"--good {names[0]} --bad {names[-1]} --repeat auto --max-pairs 12" in headline(undecided)
    skipped = bs.search(names[:3], names[0], names[2], _measure(1, 0.3, 0.01, positions=positions, skip={names[1]}),
                        bs.Plan(start=3, max_pairs=6))
    assert skipped.outcome == "range" and "Next: fix the builds that did not build or run" in headline(skipped)


def test_max_pairs_help_shows_the_range_its_check_keeps():
    from click.testing import CliRunner

    from xfw.cli import main

    for command in (["bisect"], ["compare"]):
        assert "[3<=x<=1000]" in CliRunner().invoke(main, [*command, "--help"]).output
    refused = CliRunner().invoke(main, ["bisect", "r.yaml", "--builds", "b", "--good", "a", "--bad", "c",
                                        "--max-pairs", "2"])
    assert refused.exit_code == 2 and "2 is not in the range 3<=x<=1000" in refused.output


def test_a_converge_page_and_chart_name_a_deliberate_difference_and_a_differing_mechanism_never_one_algorithm(
        tmp_path, monkeypatch):
    from tests.unit.test_converge_report import curves_from, paired, report_of, seeds
    from xfw.report import converge_plot

    ref = seeds()
    curves = curves_from(ref, paired(ref, 1.0))
    plain = report_of(curves)
    assert converge_plot.page(plain).blocks[0].text.startswith(
        "Like-for-like comparison: one algorithm on both sides (the framework comparison). Recipe")
    # the final row's cell is the headline's verdict, to the printed digit (it read +0.00% beside +3.4e-05%)
    ref_fp32 = seeds()
    fp32 = report_of(curves_from(ref_fp32, [v * (1 + 3e-7) for v in ref_fp32]))
    cell = str(converge_plot._verdict_table(fp32).cells[-1][-1])
    estimate, interval = cell.split(": ", 1)[1].split(" (")
    assert f"{estimate} (95.0% interval {interval.rstrip(')')})" in fp32.headline[1], (cell, fp32.headline[1])
    assert "e-05%" in estimate and "0.00%" not in cell
    changed = report_of(curves, deliberate={"torch": ["optimizer.lr"]},
                        settings_differences=["mechanism attention_kernel differs: paddle=sdpa_math, torch=sdpa: flash"])
    first = converge_plot.page(changed).blocks[0].text
    assert first.startswith("Like-for-like comparison with a deliberate difference (torch: optimizer.lr), and differing "
                            "mechanism attention_kernel (not one algorithm on both sides). Recipe")
    assert "compared:" not in first  # named once, not twice in one paragraph
    titles = []
    monkeypatch.setattr("matplotlib.figure.Figure.suptitle", lambda self, text, **kw: titles.append(text))
    converge_plot.write_chart(changed, tmp_path / "converge.png")
    assert titles and "deliberate difference (torch: optimizer.lr)" in titles[0]
