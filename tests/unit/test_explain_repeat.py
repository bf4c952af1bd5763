"""Explain across ``--repeat`` runs (each row the median of its per-run medians, its band their range: one run's
stall cannot top the table), the CSV holding every row, and a loss marked in the trace (Paddle's ``mse_loss``)
counting as the loss forward and backward. No framework: explain.jsons and traces written here."""

from __future__ import annotations

import csv
import io
import json
import statistics

import pytest

from xfw.contract.explain import trace_categories
from xfw.contract.explain_categories import LOSS_BACKWARD_BEGINS, LOSS_BACKWARD_ENDS, LOSS_MARK
from xfw.report import explain as report
from xfw.report.compare import ComparisonRow, Side
from xfw.report.table import to_csv, to_markdown


def _explain(rows: dict[str, list[float]], hooked: list[float]) -> dict:
    """An explain.json of per-step rows (seconds, all in backward)."""
    return {"schema": 1, "modules": {k: {"fwd_s": 0.0, "bwd_s": statistics.median(v)} for k, v in rows.items()},
            "module_steps": {k: [[0.0, x] for x in v] for k, v in rows.items()}, "hooked_steps_s": hooked,
            "hooked_step_s": statistics.median(hooked), "plain_steps_s": hooked,
            "plain_step_s": statistics.median(hooked), "profiler_steps_s": hooked,
            "profiler_step_s": statistics.median(hooked), "categories": {"matmul": sum(hooked) / len(hooked)},
            "trace": "trace.json", "steps": len(hooked)}


QUIET = [0.010, 0.011, 0.010, 0.012, 0.010]
STALL = [0.040, 0.041, 0.039, 0.042, 0.040]  # a whole run of one row held up by the host (a stall in every step)


def _side(tmp_path, backend: str, runs: list[dict]) -> Side:
    dirs = []
    for k, e in enumerate(runs):
        d = tmp_path / "tiny" / (f"{backend}-r{k}" if len(runs) > 1 else backend)
        d.mkdir(parents=True)
        (d / "explain.json").write_text(json.dumps(e))
        dirs.append(str(d))
    return Side(backend=backend, status="ok", run_dirs=dirs, step_time_median_s=0.031, step_time_p10_s=0.029,
                step_time_p90_s=0.033)


def _paddle_runs():
    # "slow" is slower on paddle in every run (a real difference); "stalled" is the same work on both sides
    # but one paddle run's host stall lands in it (every step of that run).
    return [_explain({"slow": [0.020, 0.021, 0.020, 0.022, 0.020], "stalled": STALL if k == 1 else QUIET},
                     [0.061 if k == 1 else 0.031] * 5) for k in range(3)]


def _torch_runs():
    return [_explain({"slow": [0.005, 0.006, 0.005, 0.005, 0.006], "stalled": QUIET}, [0.016] * 5) for _ in range(3)]


def test_across_runs_a_rows_figure_is_the_median_of_its_run_medians_and_one_stalled_run_cannot_top_it(tmp_path):
    paddle = report.load_side(_side(tmp_path, "paddle", _paddle_runs()).run_dirs)
    torch = report.load_side(_side(tmp_path, "torch", _torch_runs()).run_dirs)
    assert paddle["runs"] == 3 and paddle["steps"] == 15 and len(paddle["hooked_steps_s"]) == 15
    assert paddle["hooked_step_s"] == pytest.approx(0.031)  # the median of the runs' medians, not the stalled run's
    rows = {r.name: r for r in report.aligned(paddle, torch, ("paddle", "torch"))}
    assert rows["stalled"].diff == pytest.approx(0.0) and rows["stalled"].noise and not rows["stalled"].finding
    assert rows["slow"].finding and rows["slow"].diff == pytest.approx(0.015)
    assert rows["slow"].a["runs"] == 3 and rows["slow"].a["run_steps"] == 15
    # the first run alone (what the report read before: its first run directory): the stall is not there, but
    # the stalled run alone would have put "stalled" first
    alone = report.aligned(report.combine_runs([_paddle_runs()[1]]), _torch_runs()[0], ("paddle", "torch"))
    assert alone[0].name == "stalled" and alone[0].finding


def test_the_page_says_what_each_row_rests_on_and_the_csv_holds_every_row(tmp_path):
    many = {f"m.layers.{k}": [0.001 * (k + 1)] * 5 for k in range(20)}
    a = [_explain({**many, "x": [0.030] * 5}, [0.3] * 5) for _ in range(2)]
    b = [_explain({**many, "x": [0.010] * 5}, [0.28] * 5) for _ in range(2)]
    row = ComparisonRow(recipe="tiny", model="m", stage="sft", sides={
        "paddle": _side(tmp_path / "a", "paddle", a), "torch": _side(tmp_path / "b", "torch", b)})
    page = report.explain_page([row], ["paddle", "torch"], None)
    text = to_markdown(page)
    assert "Rows rest on: paddle 2 runs × 5 hooked steps (10); torch 2 runs × 5 hooked steps (10)" in text
    assert "min–max of the 2 runs' medians (ms)" in text
    assert f"({21 - report.SHOWN} more rows: explain.csv has them)" in text  # the page folds the small rows
    records = list(csv.DictReader(io.StringIO(to_csv(page))))
    assert len(records) == 21 and {r["module"] for r in records} == {*many, "x"}  # the CSV does not
    assert not any("more rows" in r["module"] for r in records)
    # both sides' measured steps are 31 ms: no gap to explain, so "x" is listed first but not ranked as a finding
    assert records[0]["module"] == "x" and records[0]["rank"] == report.UNRANKED and records[0]["paddle_runs"] == "2"
    assert records[0]["paddle_steps"] == "10"


def test_one_run_rests_on_its_hooked_steps_and_says_repeat_would_take_rows_across_runs(tmp_path):
    row = ComparisonRow(recipe="tiny", model="m", stage="sft", sides={
        "paddle": _side(tmp_path / "a", "paddle", _paddle_runs()[:1]),
        "torch": _side(tmp_path / "b", "torch", _torch_runs()[:1])})
    text = to_markdown(report.explain_page([row], ["paddle", "torch"], None))
    assert "Rows rest on: paddle 1 run, 5 hooked steps; torch 1 run, 5 hooked steps" in text
    assert "`--repeat 3` profiles every run" in text and "p25–p75 (ms) paddle; torch" in text


def test_a_run_without_its_explain_json_is_counted_and_its_program_checked_per_run(tmp_path):
    side = _side(tmp_path, "paddle", _paddle_runs())
    (tmp_path / "tiny" / "paddle-r2" / "explain.json").unlink()
    combined = report.load_side(side.run_dirs)
    assert combined["runs"] == 2 and combined["unexplained_runs"] == 1
    assert "1 more run(s) without an explain.json" in report.basis(("paddle",), (combined,))
    line, differs = report.program_check(combined)
    assert "not recorded" in line and differs  # these explain.jsons predate ran_with: said, for each run
    assert any(d.startswith("run 2: ") for d in differs)


def test_a_marked_loss_counts_as_the_loss_forward_and_backward(tmp_path):
    """Paddle's mse_loss is subtract, square and mean: inside the adapter's loss event (forward) and between its
    backward markers (the gradient nodes that end there; the node holding the end marker is the next layer's)
    they are the loss, as PyTorch's one mse_loss and its MseLossBackward0; outside, elementwise."""
    us = 1e6
    ops = [("subtract dygraph", 1, 1), ("square dygraph", 3, 1), ("mean dygraph", 5, 1),     # inside the loss event
           ("add dygraph", 8, 1),                                                            # after it: elementwise
           ("Global_ScaleGradNode", 10, 1),                                                  # before the loss's
           ("Global_MeanGradNode", 12, 2), ("Global_SquareGradNode", 15, 1),
           ("Global_SubtractGradNode", 17, 1),
           ("Global_AddGradNode", 19, 2)]                                                    # holds the end marker
    events = [{"cat": "Operator", "name": n, "ts": t * us, "dur": d * us, "tid": "7(C++)"} for n, t, d in ops]
    events += [{"cat": "PythonUserDefined", "name": LOSS_MARK, "ts": 0.5 * us, "dur": 6 * us, "tid": "7(Python)"},
               {"cat": "PythonUserDefined", "name": LOSS_BACKWARD_BEGINS + "[1.2 us]", "ts": 12.5 * us, "dur": 0.1,
                "tid": "7(Python)"},
               {"cat": "PythonUserDefined", "name": LOSS_BACKWARD_ENDS, "ts": 19.5 * us, "dur": 0.1,
                "tid": "7(Python)"}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", **e} for e in events]}))
    cats = trace_categories(str(path), op_cats=("Operator",), optimizer_marks=("Optimization Step",))
    assert cats["loss"] == pytest.approx(1 + 1 + 1 + 2 + 1 + 1)
    assert cats["elementwise/activation"] == pytest.approx(1 + 1 + 2)  # add, scale, the next layer's add
    written = json.loads(path.read_text())
    assert written["xfwCategories"]["loss"] == {"mean": pytest.approx(3), "subtract": pytest.approx(2),
                                                "square": pytest.approx(2)}


def test_paddles_attention_gradients_pair_only_with_products_that_made_a_gradient_node(tmp_path):
    """A product run without gradients (a frozen vision tower's, a no-grad plant's) has no gradient node in
    backward: paired by position it shifted every pair. Only the forward products with a ``node_creation`` event
    pair, so the attention products' gradients are still attention."""
    us, events, t = 1e6, [], 0
    for layer, grad in (("Linear", False), ("Linear", True), ("Attention", True), ("Attention", True),
                        ("Linear", True)):
        events.append({"cat": "Forward", "name": layer, "ts": t, "dur": 3 * us, "tid": 2})
        events.append({"cat": "UserDefined", "name": "matmul pybind_imperative_func", "ts": t + us, "dur": us})
        if grad:
            events.append({"cat": "OperatorInner", "name": "matmul node_creation", "ts": t + 1.5 * us, "dur": 0.1 * us})
        t += 4 * us
    events.append({"cat": "UserDefined", "name": "backward", "ts": t, "dur": 20 * us})
    for k in range(4):
        events.append({"cat": "Operator", "name": "Global_MatmulGradNode", "ts": t + (1 + 4 * k) * us, "dur": 2 * us})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "tid": 1, **e} for e in events]}))
    cats = trace_categories(str(path), op_cats=("UserDefined", "Operator", "OperatorInner"),
                            optimizer_marks=("Optimization Step",), layer_cats=("Forward",))
    assert cats["attention"] == pytest.approx(2 * 1 + 2 * 2)  # two products and their two gradient nodes
    assert cats["matmul"] == pytest.approx(3 * 1 + 2 * 2)  # the other three and the two gradients of the grad ones


def test_the_diagnosis_names_the_side_whose_hooks_cost_more():
    from xfw.report.explain_trust import _diagnosis

    side = Side(backend="x", status="ok", step_time_median_s=0.020, step_time_p10_s=0.015, step_time_p90_s=0.025)
    quiet = _explain({"x": [0.01] * 5}, [0.020] * 5)
    hooked = _explain({"x": [0.01] * 5}, [0.025] * 5) | {"plain_steps_s": [0.020] * 5, "plain_step_s": 0.020}
    found = _diagnosis(("paddle", "torch"), (side, side), (quiet, hooked))
    assert found == ["the hooks' cost differs between the sides (hooked step ×1.00 the plain step on paddle, ×1.25 "
                     "on torch): small modules' rows are inflated more on torch"]


def test_the_categories_listing_names_every_category_and_the_loss_marks():
    from xfw.contract.explain import CATEGORIES, category_rules

    text = category_rules()
    assert all(f"\n{c}: " in text for c in CATEGORIES)
    assert LOSS_MARK in text and "mse_loss" in text and "node_creation" not in text
