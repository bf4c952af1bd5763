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
