"""Reports a newcomer reads right, round two (issue 24): training memory, noise beside every number,
sweep points that cannot run, readable sweep charts, backend knobs checked without a framework."""

import json
import struct

import pytest
from click.testing import CliRunner

from xfw import cli
from xfw.contract import knobs as knob_declaration
from xfw.contract.harness import GRAD_NORM_KNOB, LOADER_KNOBS
from xfw.report import contrast, layouts
from xfw.report.compare import compare_runs
from xfw.report.measure import Measurement, summarize
from xfw.report.plot import BACKEND_COLORS, plot_comparison
from xfw.report.results import RunResult
from xfw.workflow.base import Outcome, judge_runs

from conftest import ROOT

MIB = 2**20


def cpu_measurement(ips, *, peak_mib, after_mib, window_s=12.0, steps=40, p10=0.09, p90=0.11, own=9_000_000):
    """A CPU run as the harness records it: peak RSS since the build and the RSS right after it."""
    per_rank = [{"rank": 0, "window_time_s": window_s, "ips": ips, "tokens_per_s": None,
                 "mem_alloc_peak_bytes": own, "mem_reserved_peak_bytes": None, "rss_peak_bytes": peak_mib * MIB,
                 "rss_after_build_bytes": after_mib * MIB, "rss_training_bytes": (peak_mib - after_mib) * MIB,
                 "num_measured_steps": steps}]
    return Measurement(num_ranks=1, ips=ips, tokens_per_s=None, step_time_median_s=0.1, step_time_p10_s=p10,
                       step_time_p90_s=p90, window_time_s=window_s, num_measured_steps=steps, num_warmup_steps=3,
                       mem_alloc_peak_bytes=own, mem_reserved_peak_bytes=None, mem_source="host_allocator",
                       loss_first=6.0, loss_last=5.5, per_rank=per_rank, rss_peak_bytes=peak_mib * MIB,
                       rss_after_build_bytes=after_mib * MIB, rss_peak_since_build=True,
                       rss_training_bytes=(peak_mib - after_mib) * MIB)


def cpu_result(backend, ips, *, peak_mib, after_mib, status="ok", variant=None, repeat=0, **kw):
    return RunResult(backend=backend, recipe="tiny-llava-sft", preset="tiny-llava", stage="sft", status=status,
                     reason="" if status == "ok" else "sharding stage1 needs more than one process",
                     measurement=cpu_measurement(ips if status == "ok" else None, peak_mib=peak_mib,
                                                 after_mib=after_mib, **kw),
                     applied={"device": "cpu", "num_params_total": 10, "mem_source": "host_allocator"},
                     variant=variant or {}, repeat_index=repeat,
                     setup={"num_processes": 1, "global_batch": 8, "micro_batch": 4, "sharding": "none"})


def demo_rows(**kw):
    # make demo's shape: Paddle starts at twice PyTorch's resident set, training grows each by ~30 MiB.
    return compare_runs([cpu_result("paddle", 64.0, peak_mib=622, after_mib=595, **kw),
                         cpu_result("torch", 249.0, peak_mib=374, after_mib=340, **kw)], ["paddle", "torch"])


def test_the_headline_memory_on_a_cpu_is_training_memory_with_the_peak_beside_it():
    (row,) = demo_rows()
    table = contrast.contrast_table([row], ["paddle", "torch"])
    cells = [table.cells[0][table.header.index(f"{b} memory")] for b in ("paddle", "torch")]
    assert cells == ["27.00 MiB training (peak RSS 622.00 MiB, 595.00 MiB after build; one run, no spread)",
                     "34.00 MiB training (peak RSS 374.00 MiB, 340.00 MiB after build; one run, no spread)"]
    record = table.records[0]
    assert (record["paddle_memory_bytes"], record["paddle_memory_source"]) == (27 * MIB, "rss_training")
    assert record["paddle_extra_own_mem_source"] == "host_allocator"  # an extra, labelled, never "memory"
    assert not any(k.endswith("_mem_alloc_peak_bytes") for k in record)
    assert not any("different sources" in w for w in row.warnings)


def test_training_memory_is_per_rank_and_needs_the_peak_reset_at_the_build():
    def records(reset):
        out = [{"kind": "start", "rank": r, "rss_after_build_bytes": (100 + 50 * r) * MIB,
                "rss_peak_since_build": reset} for r in (0, 1)]
        for r in (0, 1):
            out.append({"kind": "step", "rank": r, "step": 0, "phase": "measure", "step_time_s": 0.1, "samples": 4,
                        "tokens": 0, "loss": 1.0, "mem_alloc_peak_bytes": None, "mem_reserved_peak_bytes": None,
                        "rss_peak_bytes": (130 + 60 * r) * MIB})
            out.append({"kind": "window", "rank": r, "window_time_s": 0.1, "samples": 4, "tokens": 0})
        return out + [{"kind": "applied", "rank": 0, "mem_source": "peak_rss"}]

    m = summarize(records(True))
    assert (m.memory_bytes, m.memory_source) == (40 * MIB, "rss_training")  # rank 1: 190 - 150; rank 0 grew 30
    m = summarize(records(False))
    assert (m.memory_bytes, m.memory_source) == (190 * MIB, "peak_rss")  # the peak may be start-up's: named so


def test_every_layout_shows_the_same_measure_name_and_unit():
    results = [cpu_result("paddle", 64.0, peak_mib=622, after_mib=595), cpu_result("torch", 249.0, peak_mib=374,
                                                                                   after_mib=340)]
    (strategies,) = layouts.strategies(results)
    assert strategies.header[4:] == ["Training memory / process (MiB)", "MiB / batch"]
    assert [row[4] for row in strategies.cells] == ["27", "34"]
    ranks = layouts.ranks(results)
    assert all(t.header == ["Rank", "Time", "Training memory"] for t in ranks)
    assert [t.cells[0][2] for t in ranks] == ["27.00 MiB", "34.00 MiB"]
    assert ranks[0].records[0]["memory_source"] == "rss_training"


def test_every_compare_states_its_window_and_step_time_spread_and_warns_on_a_short_window():
    (row,) = demo_rows(window_s=0.64, steps=20, p10=0.019, p90=0.047)
    table = contrast.contrast_table([row], ["paddle", "torch"])
    assert any(n.startswith("Measured: paddle 20 steps in 0.64 s, step time p10–p90 19 ms–47 ms") for n in table.notes)
    page = contrast.contrast_page([row], ["paddle", "torch"])
    from xfw.report.table import to_markdown
    text = to_markdown(page)
    assert "the measured window was 0.64 s (20 steps), too short to trust" in text
    assert "set measure.steps=313" in text  # about 10 s at this rate
    assert "+x% means paddle is faster" in text
    (long_row,) = demo_rows()  # 12 s windows: nothing to warn about
    assert "too short to trust" not in to_markdown(contrast.contrast_page([long_row], ["paddle", "torch"]))


def test_a_sweep_point_that_cannot_run_by_construction_is_not_a_failure_but_a_plain_run_is():
    ok = cpu_result("torch", 100.0, peak_mib=10, after_mib=5, variant={"parallel.sharding": "none"})
    na = cpu_result("torch", 0, peak_mib=10, after_mib=5, status="unsupported", variant={"parallel.sharding": "stage1"})
    outcome = judge_runs(Outcome(), [ok, na])
    assert outcome.exit_code == 0 and "1 of 2 sweep points are not applicable here" in outcome.notes[0]
    plain = cpu_result("torch", 0, peak_mib=10, after_mib=5, status="unsupported")
    assert judge_runs(Outcome(), [plain]).exit_code == 1


def png_width(path) -> int:
    return struct.unpack(">I", path.read_bytes()[16:20])[0]


def test_a_sweep_chart_with_many_points_and_failed_sides_is_written_wide_enough(tmp_path):
    results = []
    for n in (1, 2, 4, 8):
        for sharding in ("none", "stage1", "stage2", "stage3"):
            variant = {"parallel.nproc_per_node": n, "parallel.sharding": sharding}
            status = "unsupported" if n == 1 and sharding != "none" else "ok"
            results += [cpu_result(b, 50.0 * n, peak_mib=10, after_mib=5, status=status, variant=variant)
                        for b in ("paddle", "torch")]
    rows = compare_runs(results, ["paddle", "torch"])
    path = plot_comparison(rows, ["paddle", "torch"], tmp_path / "chart.png")
    assert png_width(path) >= 16 * 100  # every one of the 16 labels gets its slot


def test_one_colour_per_backend_in_every_chart():
    from xfw.report import nightly_report, plot
    assert plot.backend_color("torch", 0) == BACKEND_COLORS["torch"] == plot.backend_color("torch", 3)
    assert not hasattr(nightly_report, "_COLORS")


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


@pytest.mark.parametrize("override,expected", [
    ("backends.torch.loader_worker=2", "backends.torch.loader_worker: unknown knob (accepted: "),
    ("backends.torch.bogus_knob=1", "backends.torch.bogus_knob: unknown knob"),
    ("backends.paddle.attn_implementation=flash", "backends.paddle.attn_implementation: 'flash' is not one of"),
    # the loader knobs' values, checked by the harness's own rule before anything starts
    ("backends.paddle.loader_workers=-3", "backends.paddle.loader_workers: must be an integer in [0, 256], got -3"),
    ("backends.torch.loader_prefetch=abc", "backends.torch.loader_prefetch: must be an integer in [1, 256], got 'abc'"),
])
def test_validate_refuses_a_knob_the_adapter_does_not_accept_in_one_line(override, expected):
    result = invoke("validate", ROOT / "recipes/tiny/llava_sft.yaml", "--set", override)
    assert result.exit_code == 2
    (line,) = [x for x in result.output.splitlines() if x.strip()]
    assert expected in line and "llava_sft.yaml" in line
    assert "loader_workers" in line or "paddle" in line or "loader_prefetch" in line  # the accepted names are given


def test_validate_accepts_declared_knobs_and_env():
    result = invoke("validate", ROOT / "recipes/tiny/llava_sft.yaml", "--set", "backends.torch.loader_workers=2",
                    "--set", "backends.paddle.env={OMP_NUM_THREADS: '1'}",
                    "--set", "backends.paddle.sharding_segment_size=1024")  # stage 3's knob (test_paddle_sharding)
    assert result.exit_code == 0, result.output


def test_each_adapter_declares_its_knobs_as_data_with_the_harness_knobs():
    files = sorted(ROOT.glob(f"adapters/*/xfw_*/{knob_declaration.KNOBS_FILE}"))
    assert {f.parent.name for f in files} == {"xfw_torch", "xfw_paddle", "xfw_jax"}
    for f in files:
        declared = knob_declaration.read_declaration(f)
        assert {GRAD_NORM_KNOB, *LOADER_KNOBS} <= set(declared), f
        assert "env" not in declared  # every backend's key, not a knob
        json.loads(f.read_text())  # plain JSON: the core reads it without the adapter


def test_every_applied_setting_is_in_the_settings_table_and_the_csv():
    results = [cpu_result(b, 100.0, peak_mib=10, after_mib=5) for b in ("paddle", "torch")]
    for r, workers in zip(results, (2, 0)):
        r.setup.update({"cpu_threads": 1, "warmup_steps": 3, "measure_steps": 20,
                        "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.999],
                                      "eps": 1e-8, "max_grad_norm": 1.0},
                        "data": {"kind": "llava_json"}, "knobs": {"loader_workers": workers}})
    (row,) = compare_runs(results, ["paddle", "torch"])
    assert row.settings["cpu_threads"] == {"paddle": 1, "torch": 1}
    assert row.settings["max_grad_norm"] == {"paddle": 1.0, "torch": 1.0}
    assert row.settings["loader_workers"] == {"paddle": 2, "torch": 0} and "loader_workers" in row.differing
    assert row.settings["loader_prefetch"] == {"paddle": 2, "torch": 2}  # the harness's default, as applied
    record = contrast.contrast_table([row], ["paddle", "torch"]).records[0]
    assert (record["paddle_setting_loader_workers"], record["torch_setting_cpu_threads"]) == (2, 1)


def test_a_nightly_entrys_own_set_is_in_the_overrides_column():
    from xfw.report.nightly_report import _overrides
    state = {"suite_overrides": ["measure.steps=10"], "entry_overrides": {"llava": ["batch.micro=2"]},
             "overrides": ["measure.cpu_threads=1"]}
    assert _overrides(state) == "suite: measure.steps=10; entry llava: batch.micro=2; --set measure.cpu_threads=1"


def test_a_nightly_change_without_a_measured_spread_is_not_enough_history():
    from xfw.report.verdicts import RegressionPolicy, evaluate

    def night(name, ips, repeat=0):
        return {"night": name, "night_started_utc": f"2026-11-2{name[-1]}T01:00:00Z", "entry": "e",
                "backend": "paddle", "repeat_index": repeat, "status": "ok", "ips": ips, "workload": "w",
                "memory_bytes": 30 * MIB, "memory_source": "rss_training", "step_time_median_s": 8 / ips,
                "step_time_p10_s": 8 / ips, "step_time_p90_s": 8 / ips, "num_measured_steps": 10}

    policy = RegressionPolicy(ips_drop=0.4, mem_growth=0.1)
    # Two nightlies of the same code: 52.6 then 194 ips. One night against one: no call.
    (ips, _) = evaluate([night("n1", 52.6), night("n2", 194.0)], "n2", policy)
    assert ips.verdict == "not enough history" and not ips.flagged and "+269%" in ips.note
    # Tonight's repeats measure the spread: three runs agreeing at ~194 support a call.
    rows = [night("n1", 52.6)] + [night("n2", v, k) for k, v in enumerate((190.0, 194.0, 197.0))]
    (ips, _) = evaluate(rows, "n2", policy)
    assert ips.verdict == "improvement" and ips.flagged is False
    # ... and repeats as noisy as the two nights do not.
    rows = [night("n1", 52.6)] + [night("n2", v, k) for k, v in enumerate((40.0, 194.0, 400.0))]
    (ips, _) = evaluate(rows, "n2", policy)
    assert ips.verdict == "ok" and "spread of 3 repeats" in ips.noise_source


def test_the_progress_line_and_the_finished_line_give_the_same_mean_step_time():
    import io

    from xfw.report.progress import PlainProgress, finished_line

    stream = io.StringIO()
    progress = PlainProgress(stream)
    progress.started("torch", "tiny", 4)
    steps = [{"kind": "step", "rank": r, "phase": phase, "step_time_s": t, "loss": 1.0}
             for phase, t in (("warmup", 0.5), ("measure", 0.1), ("measure", 0.3)) for r in (0, 1)]
    progress.update("torch", steps[:2])
    progress.update("torch", steps[2:])
    lines = stream.getvalue().splitlines()
    assert "last 0.5 s/step" in lines[1] and "mean 0.2 s/step" in lines[2]  # warm-up labelled, then the mean
    result = cpu_result("torch", 40.0, peak_mib=10, after_mib=5, window_s=0.4, steps=2)
    result = RunResult(**{**result.__dict__, "wall_time_s": 3.0})
    assert "(mean 0.2 s/step over 2 measured steps)" in finished_line(result)


def test_a_compare_says_why_first_losses_differ_when_each_side_started_from_its_own_weights():
    from xfw.report.trust import starting_points

    results = [cpu_result(b, 100.0, peak_mib=10, after_mib=5) for b in ("paddle", "torch")]
    results[1] = RunResult(**{**results[1].__dict__, "measurement": Measurement(
        **{**results[1].measurement.__dict__, "loss_first": 0.935})})
    for r in results:
        r.setup["weights"] = "random"
    (line,) = starting_points(compare_runs(results, ["paddle", "torch"]))
    assert "first losses differ (paddle 6, torch 0.935)" in line and "its own random weights" in line
    same = [cpu_result(b, 100.0, peak_mib=10, after_mib=5) for b in ("paddle", "torch")]
    assert starting_points(compare_runs(same, ["paddle", "torch"])) == []


def test_docs_flops_table_is_generated_from_the_code_and_not_stale():
    from xfw.run.commands import flops_table

    current = flops_table.DOC.read_text(encoding="utf-8")
    assert flops_table.render(current) == current, "docs/flops.md is stale: run python -m xfw.run.commands.flops_table"
    row = next(line for line in current.splitlines() if line.startswith("| sd15-pretrain |"))
    assert "| 256 px |" in row  # the recipe's resolution, said beside the figure
    row = next(line for line in current.splitlines() if line.startswith("| llava7b-sft |"))
    assert "tokens (mean: " in row  # a variable-length recipe says which length it assumes
