"""Comparator and renderers: contrast as in seed 003, failed sides kept, units on memory."""

import pandas as pd
import pytest

import io

from xfw.report import contrast, provenance
from xfw.report.table import markdown_table, to_csv, to_markdown
from xfw.report.compare import compare_runs, variant_label
from xfw.report.measure import Measurement
from xfw.report.plot import chart_labels, plot_comparison
from xfw.report.results import RunResult


def measurement(ips, alloc=2 * 1024**3, reserved=3 * 1024**3, source="cuda_allocator"):
    return Measurement(num_ranks=1, ips=ips, tokens_per_s=ips * 100 if ips else None, step_time_median_s=1.0,
                       step_time_p10_s=0.9, step_time_p90_s=1.1, window_time_s=10.0, num_measured_steps=10,
                       num_warmup_steps=2, mem_alloc_peak_bytes=alloc, mem_reserved_peak_bytes=reserved,
                       mem_source=source, loss_first=5.0, loss_last=4.0)


def result(backend, ips, status="ok", recipe="llava7b-sft", preset="llava-1.6-vicuna-7b", params=7_063_000_000,
           repeat=0, **applied):
    return RunResult(backend=backend, recipe=recipe, preset=preset, stage="sft", status=status,
                     reason="" if status == "ok" else "it broke", measurement=measurement(ips if status == "ok" else None),
                     applied={"num_params_total": params, "compute_dtype": "bfloat16", "mem_source": "cuda_allocator",
                              **applied}, repeat_index=repeat)


def report_markdown(rows) -> str:
    return to_markdown(contrast.contrast_page(rows, ["paddle", "torch"]))


def test_contrast_is_first_minus_second_over_second():
    (row,) = compare_runs([result("paddle", 82.0), result("torch", 65.0)], ["paddle", "torch"])
    assert row.contrast == pytest.approx((82 - 65) / 65)
    assert row.model == "LLaVA1.6 7B" and row.stage == "SFT"
    assert contrast.fmt_contrast(row) == "+26%"


def test_small_contrasts_keep_a_decimal():
    (row,) = compare_runs([result("paddle", 66.0), result("torch", 67.0)], ["paddle", "torch"])
    assert contrast.fmt_contrast(row) == "-1.5%"


def test_a_failed_side_keeps_the_row_and_shows_its_status():
    rows = compare_runs([result("paddle", 0, status="timeout"), result("torch", 65.0)], ["paddle", "torch"])
    table = contrast.contrast_table(rows, ["paddle", "torch"])
    header, (line,) = table.header, table.cells
    assert line[header.index("paddle ips")] == "timeout" and "| **timeout** |" in markdown_table(table)
    assert line[header.index("torch ips")] == "65.0 (one run, no spread)"
    assert line[header.index("Contrast")] == "n/a"
    assert "paddle: timeout — it broke" in report_markdown(rows)


def test_a_backend_with_no_run_is_reported_missing():
    (row,) = compare_runs([result("torch", 65.0)], ["paddle", "torch"])
    assert row.sides["paddle"].status == "missing" and row.contrast is None


def test_memory_cells_carry_unit_and_source():
    (row,) = compare_runs([result("paddle", 1.0), result("torch", 1.0)], ["paddle", "torch"])
    assert contrast.fmt_memory(row.sides["torch"]) == "2.00/3.00 GiB alloc/reserved (GPU allocator; one run, no spread)"


def test_unequal_parameter_counts_are_warned_about_and_marked():
    rows = compare_runs([result("paddle", 1.0, params=10), result("torch", 1.0, params=11)], ["paddle", "torch"])
    assert rows[0].params_match is False
    assert any("parameter counts differ" in w for w in rows[0].warnings)
    assert contrast.fmt_params(rows[0], ["paddle", "torch"]) == "10 / 11 ✗ differ"


def test_differing_settings_are_warned_about_but_framework_versions_are_not():
    runs = [result("paddle", 1.0, compute_dtype="float32", framework_version="3.3.1"),
            result("torch", 1.0, framework_version="2.13.0")]
    (row,) = compare_runs(runs, ["paddle", "torch"])
    assert row.differing == ["compute_dtype"]
    assert "⚠ differs" in to_markdown(contrast.contrast_page([row], ["paddle", "torch"]))


def test_repeats_collapse_to_the_median_and_small_contrasts_are_flagged_as_noise():
    runs = [result("paddle", v, repeat=i) for i, v in enumerate((100.0, 110.0, 90.0))]
    runs += [result("torch", v, repeat=i) for i, v in enumerate((98.0, 99.0, 97.0))]
    (row,) = compare_runs(runs, ["paddle", "torch"])
    assert row.sides["paddle"].ips == 100.0 and row.sides["paddle"].num_repeats == 3
    assert row.within_noise is True
    assert contrast.fmt_contrast(row).endswith("(noise)")


def test_markdown_table_has_the_seed_columns_in_order():
    rows = compare_runs([result("paddle", 82.0), result("torch", 65.0)], ["paddle", "torch"])
    header = contrast.contrast_table(rows, ["paddle", "torch"]).header
    assert header[:5] == ["Model", "Stage", "paddle ips", "Contrast", "torch ips"]
    table = markdown_table(contrast.contrast_table(rows, ["paddle", "torch"]))
    assert table.splitlines()[1].startswith("|---|---|---:|---:|---:|")


def test_repeated_model_names_are_blank_like_the_seed():
    runs = [result(b, 1.0, recipe=r) for r in ("a", "b") for b in ("paddle", "torch")]
    cells = contrast.contrast_table(compare_runs(runs, ["paddle", "torch"]), ["paddle", "torch"]).cells
    assert cells[0][0] == "LLaVA1.6 7B" and cells[1][0] == ""


def test_numeric_frame_keeps_raw_numbers_for_programs():
    rows = compare_runs([result("paddle", 82.0), result("torch", 65.0)], ["paddle", "torch"])
    frame = pd.read_csv(io.StringIO(to_csv([contrast.contrast_table(rows, ["paddle", "torch"])])))
    assert isinstance(frame, pd.DataFrame)
    assert frame.loc[0, "paddle_ips"] == 82.0 and frame.loc[0, "torch_extra_own_mem_peak_bytes"] == 2 * 1024**3
    assert frame.loc[0, "contrast"] == pytest.approx(17 / 65)


def test_chart_is_written_as_a_png_even_with_a_failed_side(tmp_path):
    rows = compare_runs([result("paddle", 0, status="oom"), result("torch", 65.0)], ["paddle", "torch"])
    path = plot_comparison(rows, ["paddle", "torch"], tmp_path / "chart.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*"))  # no temp file left behind


def test_chart_labels_tell_sweep_points_apart():
    runs = [result(b, 1.0) for b in ("paddle", "torch")] + [result(b, 2.0) for b in ("paddle", "torch")]
    for r, micro in zip(runs, (1, 1, 2, 2)):
        r.variant = {"batch.micro": micro, "measure.steps": 5}
    labels = chart_labels(compare_runs(runs, ["paddle", "torch"]))
    # One model and stage: the chart's title names them, each label only its point (one key a line).
    assert labels == ["micro=1", "micro=2"]


def parity_status(status="passed"):
    return {"status": status, "path": "runs/parity-llava7b-sft/parity.json", "num_steps": 10,
            "first_failing_step": 3 if status == "failed" else None, "note": "",
            "worst": {"loss_rel_diff": 7.6e-08, "loss_step": 1, "grad_norm_rel_diff": 5.4e-07, "grad_norm_step": 2}}


def test_the_settings_section_shows_the_parity_run_of_each_recipe_or_says_there_is_none():
    runs = [result("paddle", 82.0), result("torch", 65.0), result("paddle", 8.0, recipe="other"),
            result("torch", 6.0, recipe="other")]
    rows = compare_runs(runs, ["paddle", "torch"], parity={"llava7b-sft": parity_status()})
    text = report_markdown(rows)
    settings = text[text.index("### Settings as applied"):]
    assert ("Parity: passed, 10 steps; worst relative loss difference 7.6e-08 (step 1), gradient norm 5.4e-07 "
            "(step 2) — `runs/parity-llava7b-sft/parity.json`.") in settings
    other = settings[settings.index("#### other"):]
    assert other.splitlines()[2] == "Parity: no parity run."
    failed = provenance.parity_line(parity_status("failed"))
    assert failed.startswith("Parity: **failed**, 10 steps, first step outside tolerance 3;")
    note = {"status": "none", "path": None, "note": "runs/x/parity.json is for another configuration of other"}
    assert provenance.parity_line(note) == f"Parity: no parity run ({note['note']})."


def test_without_a_parity_lookup_the_report_says_nothing_about_parity():
    rows = compare_runs([result("paddle", 82.0), result("torch", 65.0)], ["paddle", "torch"])
    assert rows[0].parity is None and "Parity" not in report_markdown(rows)


def with_setup(r, sharding="none", processes=2, **knobs):
    r.setup = {"num_processes": processes, "sharding": sharding, "global_batch": 8, "micro_batch": 2,
               "dtype": "bf16", "amp_level": "O2", "recompute": True, "measure_steps": 10, "knobs": knobs}
    return r


def test_runs_from_separate_commands_are_configurations_not_repeats():
    from xfw.report.results import distinguish_configurations

    runs = distinguish_configurations([
        with_setup(result("paddle", 80.0), "stage2"), with_setup(result("torch", 60.0), "stage2"),
        with_setup(result("torch", 50.0), "stage3", sharding_impl="fsdp2"),
        with_setup(result("torch", 40.0), "stage3", sharding_impl="deepspeed"),
        with_setup(result("torch", 61.0, repeat=1), "stage2"),  # a true repeat of the stage2 run
    ])
    rows = compare_runs(runs, ["paddle", "torch"])
    by_variant = {variant_label(r.variant): r for r in rows}
    assert set(by_variant) == {"parallel.sharding=stage2",
                               "parallel.sharding=stage3, backends.torch.sharding_impl=fsdp2",
                               "parallel.sharding=stage3, backends.torch.sharding_impl=deepspeed"}
    stage2 = by_variant["parallel.sharding=stage2"]
    assert stage2.sides["torch"].ips == pytest.approx(60.5) and stage2.contrast is not None  # paired, repeats folded
    assert by_variant["parallel.sharding=stage3, backends.torch.sharding_impl=deepspeed"].sides["torch"].ips == 40.0


def test_the_params_column_shows_trainable_counts_and_a_cross_when_only_they_differ():
    rows = compare_runs([result("paddle", 1.0, num_params_trainable=6_272),
                         result("torch", 1.0, num_params_trainable=6_336)], ["paddle", "torch"])
    cell = contrast.fmt_params(rows[0], ["paddle", "torch"])
    assert cell == "7,063,000,000 / 7,063,000,000 (trainable 6,272 / 6,336) ✗ differ"
    assert any("6,272 trainable" in w for w in rows[0].warnings)


def test_the_report_says_whether_both_sides_trained_on_identical_batches():
    import dataclasses

    def with_data(r, digest):
        r.measurement = dataclasses.replace(r.measurement, batch_digest=digest, num_batches=40, padding_fraction=0.125,
                                            seq_len_mean=68.0, seq_len_max=80)
        return r

    same = compare_runs([with_data(result("paddle", 82.0), "ab" * 16), with_data(result("torch", 65.0), "ab" * 16)],
                        ["paddle", "torch"])
    text = report_markdown(same)
    assert "Batches: identical on both sides (40 micro-batch hashes equal, digest abababababab…)." in text
    assert "| padding | 12.5% | 12.5% |" in text and "| seq_len_mean_max | 68.0 / 80 | 68.0 / 80 |" in text
    assert "different batches" not in text
    differ = compare_runs([with_data(result("paddle", 82.0), "ab" * 16), with_data(result("torch", 65.0), "cd" * 16)],
                          ["paddle", "torch"])
    text = report_markdown(differ)
    assert "⚠ llava7b-sft: the sides trained on different batches (micro-batch hashes: paddle abababababab… over 40, " \
           "torch cdcdcdcdcdcd… over 40)" in text
    assert "Batches: **differ** between the sides" in text
