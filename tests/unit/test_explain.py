"""The step breakdown and explain's logic, without a framework: the harness's split points and the
records they make, the timeline's attribution, scope names, trace categories and the aligned report."""

from __future__ import annotations

import json
import statistics
import time

import pytest

from xfw.contract import harness, records
from xfw.contract.explain import (EXPLAIN_STEPS, LOSS, MIN_EXPLAIN_STEPS, OPTIMIZER, OUTSIDE, Timeline,
                                  category_of, explain_steps, scope_names, trace_categories)
from xfw.report import explain as report


class Clock:
    """A clock the test advances by hand: the timeline's attribution is checked against known spans."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def tick(self, seconds: float) -> None:
        self.t += seconds


def test_forward_backward_and_optimizer_spans_go_to_the_innermost_module():
    clock = Clock()
    tl = Timeline(clock=clock)
    tl.mark("step")
    root = tl.enter("", root=True)
    clock.tick(1)                   # root's own code
    attn = tl.enter("layers.0.self_attn")
    clock.tick(2)                   # attention core
    q = tl.enter("layers.0.self_attn.q_proj")
    clock.tick(3)
    tl.exit(q)
    clock.tick(4)                   # attention core again
    tl.exit(attn)
    tl.exit(root, root=True)
    clock.tick(5)                   # loss forward + backward, no module gradient yet
    tl.grad_in(root)
    tl.grad_in(attn)
    clock.tick(6)                   # attention's own backward
    tl.grad_in(q)
    clock.tick(7)                   # q_proj's backward
    tl.grad_out(q)
    clock.tick(8)
    tl.grad_out(attn)
    clock.tick(9)                   # after the last gradient of any module: outside modules
    tl.mark("optimizer")
    clock.tick(10)
    tl.mark("end")
    rows, step = tl.attribute()
    assert step == pytest.approx(55)
    assert rows["layers.0.self_attn.q_proj"]["fwd_s"] == pytest.approx(3)
    assert rows["layers.0.self_attn"]["fwd_s"] == pytest.approx(6)
    assert rows[""]["fwd_s"] == pytest.approx(1)
    assert rows[LOSS]["bwd_s"] == pytest.approx(5)
    assert rows["layers.0.self_attn.q_proj"]["bwd_s"] == pytest.approx(7)
    assert rows["layers.0.self_attn"]["bwd_s"] == pytest.approx(6 + 8)
    assert rows[OUTSIDE]["bwd_s"] == pytest.approx(9)
    assert rows[OPTIMIZER]["bwd_s"] == pytest.approx(10)
    # every second of the step is in exactly one row
    assert sum(r["fwd_s"] + r["bwd_s"] for r in rows.values()) == pytest.approx(step)


def test_a_forward_inside_backward_is_recompute():
    clock = Clock()
    tl = Timeline(clock=clock)
    tl.mark("step")
    root = tl.enter("", root=True)
    layer = tl.enter("layers.0")
    clock.tick(2)
    tl.exit(layer)
    tl.exit(root, root=True)
    tl.grad_in(root)
    clock.tick(1)
    again = tl.enter("layers.0")    # checkpointing runs the layer's forward again
    clock.tick(2)
    tl.exit(again)
    tl.grad_in(layer)
    clock.tick(3)
    tl.grad_out(layer)
    tl.mark("end")
    rows, _ = tl.attribute()
    assert rows["layers.0"]["fwd_s"] == pytest.approx(2)
    assert rows["layers.0"]["recompute_s"] == pytest.approx(2)
    assert rows["layers.0"]["bwd_s"] == pytest.approx(2 + 3)


def test_a_module_whose_output_is_its_containers_keeps_its_own_backward():
    """o_proj's output is the attention block's output (the loss's, the model's): both gradient hooks fire on one
    tensor, the container's last; the container's own backward is what runs after its child's interval."""
    clock = Clock()
    tl = Timeline(clock=clock)
    tl.mark("step")
    root = tl.enter("", root=True)
    attn = tl.enter("self_attn")
    clock.tick(1)                   # attention core
    o = tl.enter("self_attn.o_proj")
    clock.tick(2)
    tl.exit(o)
    tl.exit(attn)
    tl.exit(root, root=True)
    tl.grad_in(o)                   # the hooks on the shared output tensor, in the order they were registered
    clock.tick(0.001)
    tl.grad_in(attn)
    clock.tick(5)                   # o_proj's backward
    tl.grad_out(o)
    clock.tick(3)                   # the attention core's backward
    tl.grad_out(attn)
    tl.mark("optimizer")
    tl.mark("end")
    rows, _ = tl.attribute()
    assert rows["self_attn.o_proj"]["bwd_s"] == pytest.approx(5.001)
    assert rows["self_attn"]["bwd_s"] == pytest.approx(3)


def test_the_rows_are_the_median_steps():
    clock = Clock()
    tl = Timeline(clock=clock)
    for seconds in (1.0, 100.0, 2.0):  # one step slowed by a loaded host
        tl.mark("step")
        call = tl.enter("", root=True)
        clock.tick(seconds)
        tl.exit(call, root=True)
        tl.mark("end")
    rows, step = tl.attribute()
    assert rows[""]["fwd_s"] == pytest.approx(2.0)
    assert step == pytest.approx(2.0)


def test_containers_take_the_prefix_their_parameter_owning_modules_share():
    names = scope_names({"": None, "llama": None, "llama.layers.0": None, "llama.layers.0.attn": None,
                         "llama.layers.0.attn.q": "model.layers.0.self_attn.q_proj",
                         "llama.layers.0.attn.k": "model.layers.0.self_attn.k_proj",
                         "llama.layers.0.norm": "model.layers.0.input_layernorm",
                         "head": "lm_head", "empty": None})
    assert names["llama.layers.0.attn"] == "model.layers.0.self_attn"
    assert names["llama.layers.0"] == "model.layers.0"
    assert names[""] == ""
    assert "empty" not in names


def test_trace_categories_use_self_time_and_the_optimizer_annotation(tmp_path):
    us = 1e6
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 0, "dur": 10 * us, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 1 * us, "dur": 8 * us, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::layer_norm", "ts": 20 * us, "dur": 2 * us, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "ts": 30 * us, "dur": 5 * us},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mul_", "ts": 31 * us, "dur": 3 * us, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::softmax", "ts": 40 * us, "dur": 1 * us, "tid": 2},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    cats = trace_categories(str(path), op_cats=("cpu_op",), optimizer_marks=("Optimizer.step",))
    assert cats["matmul"] == pytest.approx(10)     # linear's 2 s of its own + addmm's 8
    assert cats["normalisation"] == pytest.approx(2)
    assert cats["optimizer"] == pytest.approx(3)   # a mul_ inside the optimizer step
    assert cats["attention"] == pytest.approx(1)
    assert category_of("matmul_grad kernel launch") == "matmul"
    assert category_of("ncclDevKernel_AllReduce_Sum_f32") == "communication"


@pytest.mark.parametrize("name, category", [
    # one map for both sides, by what the operation does
    ("autograd::engine::evaluate_function: MmBackward0", "matmul"), ("Global_MatmulGradNode", "matmul"),
    ("aten::convolution_backward", "convolution"), ("conv2d_grad kernel launch", "convolution"),
    ("Local_Conv2dGradNodeFinal", "convolution"), ("aten::log_softmax", "loss"), ("NllLossBackward0", "loss"),
    ("cross_entropy_with_softmax dygraph", "loss"), ("swiglu dygraph", "elementwise/activation"),
    ("SiluBackward0", "elementwise/activation"), ("aten::broadcast_tensors", "copies"), ("aten::t", "copies"),
    ("NativeLayerNormBackward0", "normalisation"), ("__ne__ pybind_patch_func", "elementwise/activation"),
    ("ScaledDotProductFlashAttentionForCpuBackward0", "attention"), ("c10d::allreduce_", "communication")])
def test_the_category_map_reads_both_frameworks_names_the_same_way(name, category):
    assert category_of(name) == category


def _trace(tmp_path, events, name="trace.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "tid": 1, **e} for e in events]}))
    return str(path)


def test_an_operator_counts_in_its_outermost_operation_and_the_trace_names_them(tmp_path):
    us = 1e6
    path = _trace(tmp_path, [
        {"cat": "cpu_op", "name": "aten::scaled_dot_product_attention", "ts": 0, "dur": 10 * us},
        {"cat": "cpu_op", "name": "aten::bmm", "ts": 1 * us, "dur": 6 * us},        # QK inside SDPA: attention
        {"cat": "cpu_op", "name": "autograd::engine::evaluate_function: MmBackward0", "ts": 20 * us, "dur": 5 * us},
        {"cat": "cpu_op", "name": "aten::t", "ts": 20 * us, "dur": 1 * us},         # the backward's transpose: matmul
        {"cat": "cpu_op", "name": "aten::mm", "ts": 21 * us, "dur": 3 * us},
        {"cat": "cpu_op", "name": "aten::matmul", "ts": 30 * us, "dur": 2 * us,    # two activations: attention
         "args": {"Input Dims": [[2, 4, 8, 8], [2, 4, 8, 8]]}},
        {"cat": "cpu_op", "name": "aten::matmul", "ts": 40 * us, "dur": 4 * us,    # with a weight: matmul
         "args": {"Input Dims": [[2, 8, 64], [64, 64]]}}])
    cats = trace_categories(path, op_cats=("cpu_op",), optimizer_marks=("Optimizer.step",))
    assert cats["attention"] == pytest.approx(12) and cats["matmul"] == pytest.approx(9)
    assert cats["copies"] == 0 and cats["other"] == 0
    written = json.loads(open(path).read())
    assert written["xfwCategories"]["attention"] == {"scaled_dot_product_attention": pytest.approx(4),
                                                     "bmm": pytest.approx(6), "matmul": pytest.approx(2)}
    assert all(e["args"]["xfw category"] for e in written["traceEvents"])


def test_paddles_math_attention_products_count_as_attention_forward_and_backward(tmp_path):
    """Paddle's trace has no shapes: a matmul whose innermost layer is an attention layer is QK or PV, and its
    gradient node is the one in the same place from the end of the next backward."""
    us, events = 1e6, []
    t = 0
    for layer, attn in (("Linear", False), ("Attention", True), ("Attention", True), ("Linear", False)):
        events.append({"cat": "Forward", "name": layer, "ts": t, "dur": 3 * us, "tid": 2})
        events.append({"cat": "UserDefined", "name": "matmul pybind_imperative_func", "ts": t + us, "dur": us})
        t += 4 * us
    events.append({"cat": "UserDefined", "name": "backward", "ts": t, "dur": 20 * us})
    for k in range(4):
        events.append({"cat": "Operator", "name": "Global_MatmulGradNode", "ts": t + (1 + 4 * k) * us, "dur": 2 * us})
    events.append({"cat": "Operator", "name": "softmax dygraph", "ts": t + 30 * us, "dur": us})
    path = _trace(tmp_path, [{"tid": 1, **e} for e in events])
    cats = trace_categories(path, op_cats=("UserDefined", "Operator"), optimizer_marks=("Optimization Step",),
                            layer_cats=("Forward",))
    assert cats["attention"] == pytest.approx(2 * 1 + 2 * 2 + 1)   # two products, their two gradients, softmax
    assert cats["matmul"] == pytest.approx(2 * 1 + 2 * 2)


class SplitSession:
    """A session with the breakdown's split points; each part sleeps a known time on the host clock."""

    rank, num_ranks = 0, 1

    def to_device(self, batch):
        return batch

    def forward_backward(self, micro_batches):
        time.sleep(0.004)
        return 1.0

    def optimizer_step(self):
        time.sleep(0.002)

    def train_step(self, micro_batches):
        time.sleep(0.006)
        return 1.0

    loss_token = staticmethod(lambda loss: loss)
    loss_value = staticmethod(float)
    timestamp = staticmethod(time.perf_counter)
    is_done = staticmethod(lambda stamp: True)
    elapsed_s = staticmethod(lambda a, b: b - a)
    synchronize = staticmethod(lambda: None)
    memory_peaks = staticmethod(lambda: (None, None))
    is_oom = staticmethod(lambda err: False)
    applied = staticmethod(lambda: {})


def _spec():
    return {"measure": {"warmup_steps": 1, "steps": 4}, "batch": {"micro": 1},
            "derived": {"grad_accum_steps": 1, "num_processes": 1}, "backend_knobs": {},
            "data": {"kind": "synthetic"}}


def test_every_step_record_carries_parts_that_sum_to_its_time(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "Steps", lambda spec, session: type("S", (), {
        "next": lambda self, step: ([{}], [(4, 4, 4, "h")])})())
    writer = records.RecordWriter(tmp_path / "steps.jsonl", 0)
    session = SplitSession()
    applied = {k: t[0]() for k, t in records.FIELDS["applied"].items()}
    session.applied = lambda: {**applied, "mem_source": "peak_rss"}
    harness.run_training(_spec(), writer, session)
    writer.close()
    steps = [r for r in records.load_records(tmp_path / "steps.jsonl") if r["kind"] == "step"]
    assert len(steps) == 5
    for r in steps:
        assert not records.validate_record(r)
        parts = sum(r[k] for k in harness.BREAKDOWN)
        if r["phase"] == "measure":
            assert parts == pytest.approx(r["step_time_s"], rel=1e-9)
        assert r["fwd_bwd_s"] >= 0.004 and r["optimizer_s"] >= 0.002


def test_breakdown_fields_are_optional_and_typed():
    step = {"schema": 1, "kind": "step", "rank": 0, "step": 0, "phase": "measure", "step_time_s": 0.1,
            "samples": 1, "tokens": 1, "loss": 1.0, "mem_alloc_peak_bytes": None, "mem_reserved_peak_bytes": None}
    assert records.validate_record(step) == []  # a run from before the breakdown still loads
    assert records.validate_record({**step, "data_wait_s": 0.0, "fwd_bwd_s": 0.08, "optimizer_s": 0.02}) == []
    assert records.validate_record({**step, "fwd_bwd_s": "fast"})
    assert records.validate_record({**step, "optimizer_s": -1.0})


def test_aligned_rows_fold_peft_layers_and_sort_by_difference():
    a = {"modules": {"m.q_proj": {"fwd_s": 1.0, "bwd_s": 1.0}, "m.q_proj.lora_A": {"fwd_s": 0.5, "bwd_s": 0.5},
                     "": {"fwd_s": 0.1, "bwd_s": 0.0}, OUTSIDE: {"fwd_s": 0.0, "bwd_s": 0.2}}}
    b = {"modules": {"m.q_proj": {"fwd_s": 1.0, "bwd_s": 1.0}, "": {"fwd_s": 0.2, "bwd_s": 0.0}}}
    rows = report.aligned(a, b, ("paddle", "torch"))
    assert rows[0].name == "m.q_proj" and rows[0].diff == pytest.approx(1.0) and rows[0].finding
    assert [r.name for r in rows[1:]] == [report.ROOT, OUTSIDE] and rows[2].only == "paddle"
    assert report.coverage(a, 2.0) == pytest.approx(1.65)


def _explain(rows: dict[str, list[float]], hooked: list[float], plain: list[float] | None = None) -> dict:
    """An explain.json of per-step rows (seconds, all in backward)."""
    n = len(hooked)
    return {"modules": {k: {"fwd_s": 0.0, "bwd_s": statistics.median(v)} for k, v in rows.items()},
            "module_steps": {k: [[0.0, x] for x in v] for k, v in rows.items()}, "hooked_steps_s": hooked,
            "hooked_step_s": statistics.median(hooked), "plain_steps_s": plain or hooked,
            "plain_step_s": statistics.median(plain or hooked), "profiler_steps_s": hooked,
            "profiler_step_s": statistics.median(hooked), "categories": {}, "trace": "trace.json", "steps": n}


def _side(step, p10, p90):
    from xfw.report.compare import Side

    return Side(backend="x", status="ok", step_time_median_s=step, step_time_p10_s=p10, step_time_p90_s=p90)


def test_the_top_level_is_one_row_and_tiny_differences_are_below_the_floor():
    a = _explain({"": [0.001] * 5, "model": [0.002] * 5, "big": [0.030] * 5, "tiny": [0.0004] * 5},
                 [0.0334] * 5)
    b = _explain({"": [0.002] * 5, "big": [0.010] * 5, "big.pos": [0.004] * 5, "tiny": [0.0001] * 5,
                  OUTSIDE: [0.001] * 5}, [0.0171] * 5)
    rows = {r.name: r for r in report.aligned(a, b, ("paddle", "torch"))}
    # transformers' top class and its inner `model`, Paddle's one top layer: one row, the same work
    assert set(rows) == {report.ROOT, "big", "tiny", OUTSIDE} and rows[report.ROOT].diff == pytest.approx(0.001)
    # a module on one side only counts in the closest row both have (the other side's own code does it there)
    assert rows["big"].folded == ("big.pos",) and rows["big"].diff == pytest.approx(0.016) and rows["big"].finding
    assert rows[OUTSIDE].only == "torch"  # not a module: nothing encloses it, it stays one-sided
    reasons = report.one_sided_reasons(list(rows.values()), ("paddle", "torch"), a, b)
    assert any(r.startswith("big.pos (torch only): counted in big") for r in reasons)
    assert any(r.startswith(f"{OUTSIDE} (torch only") and "not compared" in r for r in reasons)
    tiny = rows["tiny"]  # its ranges do not overlap, but 0.3 ms is under 1% of a 33 ms step
    assert not tiny.noise and tiny.small and not tiny.finding
    cells = report.module_table(("paddle", "torch"), list(rows.values()), report.Verdict(False, 0.0)).cells
    assert [c[5] for c in cells if c[0] == "tiny"] == ["below the floor (<1% of the step)"]


def test_rows_inside_their_noise_are_not_ranked_and_shares_add_up_only_when_the_sum_agrees():
    a = _explain({"slow": [0.030, 0.031, 0.029, 0.030, 0.032], "noisy": [0.010, 0.002, 0.011, 0.001, 0.012]},
                 [0.040, 0.041, 0.042, 0.040, 0.041])
    b = _explain({"slow": [0.010, 0.011, 0.010, 0.009, 0.010], "noisy": [0.003, 0.009, 0.004, 0.010, 0.002]},
                 [0.019, 0.020, 0.020, 0.021, 0.020])
    rows = report.aligned(a, b, ("paddle", "torch"))
    assert [(r.name, r.finding) for r in rows] == [("slow", True), ("noisy", False)]
    agree = report.verdict(rows, a, b, gap=0.021, gap_noise=0.002, names=("paddle", "torch"), diagnosis=[])
    assert agree.reliable
    table = report.module_table(("paddle", "torch"), rows, agree)
    assert [c[5] for c in table.cells] == ["1", "within noise"]
    assert sum(float(c[6].rstrip("%")) for c in table.cells) == pytest.approx(100, abs=1)
    # the same rows against a measured gap of the other sign: no shares, and why
    wrong = report.verdict(rows, a, b, gap=-0.015, gap_noise=0.002, names=("paddle", "torch"),
                           diagnosis=["paddle's explain process ran a plain step in 41 ms against 20 ms measured"])
    assert not wrong.reliable and "sign differs" in wrong.why and "plain step" in wrong.why
    assert {c[6] for c in report.module_table(("paddle", "torch"), rows, wrong).cells} == {"–"}
    too_small = report.verdict(rows, a, b, gap=0.080, gap_noise=0.002, names=("paddle", "torch"), diagnosis=[])
    assert not too_small.reliable and too_small.why.startswith("the rows' sum accounts for 32% of the measured gap: "
                                                               "it misses the gap by 54.00 ms")
    inside = report.verdict(rows, a, b, gap=0.001, gap_noise=0.004, names=("paddle", "torch"), diagnosis=[])
    assert not inside.reliable and "inside its own noise" in inside.why


def test_the_profilers_cost_is_a_factor_only_above_the_noise_and_never_below_one():
    measured = _side(0.020, 0.018, 0.022)
    assert "×1.50 the measured step" in report._cost("profiled", [0.029, 0.030, 0.031], 0.030, measured)
    quiet = report._cost("profiled", [0.019, 0.021, 0.020], 0.020, measured)
    assert "no cost above" in quiet and "×" not in quiet
    faster = report._cost("profiled", [0.010, 0.011, 0.012], 0.011, measured)
    assert "faster than the measured step" in faster and "×" not in faster


def test_one_backend_is_explained_alone_and_two_recipes_get_two_charts(tmp_path):
    from xfw.report.compare import ComparisonRow, Side

    def run(name, backend, rows):
        d = tmp_path / name / backend
        d.mkdir(parents=True)
        (d / "explain.json").write_text(json.dumps({"schema": 1, **_explain(rows, [0.02, 0.021, 0.02])}))
        return Side(backend=backend, status="ok", run_dirs=[str(d)], step_time_median_s=0.02,
                    step_time_p10_s=0.019, step_time_p90_s=0.022)

    rows = [ComparisonRow(recipe=r, model="m", stage="sft", sides={
        "paddle": run(r, "paddle", {"x": [0.015, 0.016, 0.015]}), "torch": run(r, "torch", {"x": [0.005, 0.006, 0.005]})})
        for r in ("first", "second")]
    report.explain_page(rows, ["paddle", "torch"], tmp_path)
    assert (tmp_path / "explain.png").exists() and (tmp_path / "explain-second.png").exists()
    alone = report.explain_page(rows[:1], ["torch"], None)
    text = " ".join(str(getattr(b, "text", "")) for b in alone.blocks)
    assert "torch alone" in " ".join(getattr(b, "text", "") for b in alone.blocks if hasattr(b, "level"))
    assert "no other side to compare with" in text
    assert not any("torch − torch" in h for b in alone.blocks for h in getattr(b, "header", []))


def test_the_explain_process_gets_the_measured_runs_environment_and_one_process_only(tmp_path, monkeypatch):
    from xfw.contract import lifeline
    from xfw.run.commands import explain
    from xfw.run.launch import launcher

    spec = {"measure": {"cpu_threads": 1}, "backend_env": {"FLAGS_use_stride_kernel": "0", "OMP_NUM_THREADS": "1"},
            "derived": {"num_processes": 1}, "backend_knobs": {}}
    env = explain.explain_env(spec)
    assert env["FLAGS_use_stride_kernel"] == "0" and env["OMP_NUM_THREADS"] == "1" and env["MKL_NUM_THREADS"] == "1"
    assert set(launcher.RUN_ENV.items()) <= set(env.items()) and lifeline.ENV in env
    seen = {}
    monkeypatch.setattr(launcher, "adapter_task", lambda backend, args, **kw: seen.update(backend=backend, **kw))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(json.dumps(spec))
    (run_dir / "env.json").write_text(json.dumps({"interpreter": "/bin/sh"}))  # the interpreter the run recorded
    result = type("Result", (), {"run_dir": str(run_dir), "backend": "torch"})()  # what explain_run reads
    path, why = explain.explain_run(result, launcher.Backend("torch", "/elsewhere/python"))
    assert why == "" and seen["backend"].python == "/bin/sh" and seen["env"]["FLAGS_use_stride_kernel"] == "0"
    (run_dir / "spec.json").write_text(json.dumps({**spec, "derived": {"num_processes": 2}}))
    seen.clear()
    path, why = explain.explain_run(result, launcher.Backend("torch", "/bin/sh"))
    assert path is None and not seen and "explain profiles one process" in why and explain.not_applicable(why)


def _run_dir(tmp_path, name, parts):
    run = tmp_path / name
    run.mkdir()
    lines = []
    for step, (data, fb, opt) in enumerate(parts):
        record = {"kind": "step", "rank": 0, "step": step, "phase": "measure", "step_time_s": data + fb + opt}
        if fb is not None:
            record.update(data_wait_s=data, fwd_bwd_s=fb, optimizer_s=opt)
        lines.append(json.dumps(record))
    (run / "steps.jsonl").write_text("\n".join(lines) + "\n")
    return str(run)


def test_the_report_shows_each_sides_mean_parts_and_says_when_a_run_has_none(tmp_path):
    from xfw.report import breakdown
    from xfw.report.compare import Side

    split = Side(backend="paddle", status="ok", run_dirs=[_run_dir(tmp_path, "p", [(0.001, 0.05, 0.01),
                                                                                    (0.003, 0.07, 0.01)])])
    old = tmp_path / "old"  # a run from before the breakdown: no parts in its records
    old.mkdir()
    (old / "steps.jsonl").write_text(json.dumps({"kind": "step", "rank": 0, "step": 0, "phase": "measure",
                                                 "step_time_s": 0.02}) + "\n")
    parts = breakdown.side_breakdown(split)
    assert parts["fwd_bwd_s"] == pytest.approx(0.06) and parts["step_time_s"] == pytest.approx(0.072)
    assert breakdown.side_breakdown(Side(backend="torch", status="ok", run_dirs=[str(old)])) is None
    table = breakdown.breakdown_table([("tiny", "paddle", parts), ("tiny", "torch", None)])
    assert table.cells[0][3] == "60.00 ms (83%)" and table.cells[0][5] == "72.00 ms"
    assert table.cells[1][-1].startswith("not recorded")
    from xfw.report.plot import plot_breakdown

    png = plot_breakdown([("tiny", "paddle", parts)], list(harness.BREAKDOWN), breakdown.PART_LABELS,
                         tmp_path / "breakdown.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_explain_steps_follow_a_short_run_but_stay_between_the_floor_and_the_default():
    assert (MIN_EXPLAIN_STEPS, EXPLAIN_STEPS) == (3, 7)
    assert explain_steps({}) == 7                           # no measure section: the default
    assert explain_steps({"measure": {"steps": True}}) == 7  # a bool is not a step count
    assert explain_steps({"measure": {"steps": 80}}) == 7   # longer runs: the default, not more
    assert explain_steps({"measure": {"steps": 7}}) == 7
    assert explain_steps({"measure": {"steps": 5}}) == 5    # a short run is explained as quickly
    assert explain_steps({"measure": {"steps": 2}}) == 3    # never under the floor
    assert explain_steps({"measure": {"steps": 0}}) == 3
