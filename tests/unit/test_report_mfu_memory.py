"""Reports over real run directories: MFU for every family with its peak cited, none on a CPU,
"n/a" with the reason on an unknown GPU; memory on a CPU is one measure on both sides (peak RSS,
with the resident set after the build), and a run written before it existed still loads."""

import json

from xfw.contract.records import RecordWriter
from xfw.report import contrast
from xfw.report.compare import compare_runs
from xfw.report.history import row_from_result
from xfw.report.nodes import load_runs
from xfw.report.results import RunResult
from xfw.report.table import to_csv, to_html, to_markdown
from xfw.recipe import load_recipe
from xfw.recipe.spec import resolve_spec

from conftest import ROOT

GPU = {"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3", "compute_dtype": "bfloat16",
       "mem_source": "cuda_allocator"}
CPU = {"device": "cpu", "device_name": "AMD EPYC", "compute_dtype": "float32", "mem_source": "host_allocator"}


def write_run(run_dir, recipe, backend, device, *, rss=True, window_s=2.0, alloc=8_000_000):
    """A finished run as an adapter and the launcher leave it: spec, records, summary."""
    spec = resolve_spec(load_recipe(ROOT / recipe, ["parallel.nproc_per_node=1"]), backend=backend, run_id="t")
    run_dir.mkdir(parents=True)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    writer = RecordWriter(run_dir / "steps.jsonl", 0)
    extra = {"rss_after_build_bytes": 300 * 2**20, "rss_peak_since_build": True} if rss else {}
    writer.start(num_ranks=1, warmup_steps=0, steps=2, **extra)
    micro = spec["batch"]["micro"] * spec["derived"]["grad_accum_steps"]
    for step in range(2):
        writer.write("step", step=step, phase="measure", step_time_s=window_s / 2, samples=micro, tokens=0, loss=1.0,
                     mem_alloc_peak_bytes=alloc, mem_reserved_peak_bytes=None,
                     **({"rss_peak_bytes": (350 + step) * 2**20} if rss else {}))
    writer.write("window", window_time_s=window_s, num_steps=2, samples=2 * micro, tokens=0)
    writer.write("applied", framework=backend, framework_version="1", weight_dtype="float32", master_weights=False,
                 amp_level="O0", sharding_impl="none", attention_impl="sdpa", tf32=False, fused_optimizer=False,
                 recompute=False, num_params_total=10, num_params_trainable=5, num_processes=1, grad_accum_steps=1,
                 notes="", **device)
    writer.write("end")
    writer.close()
    (run_dir / "summary.json").write_text(json.dumps({"backend": backend, "recipe": spec["name"], "status": "ok"}))
    return spec


def test_the_sd_rows_of_a_gpu_report_show_mfu_with_the_peak_and_its_datasheet(tmp_path):
    for recipe in ("recipes/sd15_pretrain.yaml", "recipes/sd3_lora.yaml"):
        for backend in ("paddle", "torch"):
            write_run(tmp_path / recipe.split("/")[-1] / backend, recipe, backend, GPU)
    rows = compare_runs(load_runs([tmp_path]), ["paddle", "torch"])
    table = contrast.contrast_table(rows, ["paddle", "torch"])
    assert {"paddle MFU", "torch MFU"} <= set(table.header)
    column = table.header.index("torch MFU")
    assert all(line[column].endswith("%") and line[column] != "0.0%" for line in table.cells)
    for row in rows:  # one FLOPs definition per recipe: both columns divide the same count
        # (SD1.5 at the bs80 script's 256 px: about 0.8 TFLOP a sample; SD3 at 1024 px: far more)
        assert row.sides["paddle"].flops_per_sample == row.sides["torch"].flops_per_sample > 5e11
    page = contrast.contrast_page(rows, ["paddle", "torch"])
    cited = "NVIDIA H100 SXM5 bfloat16 dense 989.4 TFLOP/s (NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column)"
    assert cited in to_markdown(page) and cited in to_html(page)
    assert "torch_mfu" in to_csv(page) and "torch_flops_per_sample" in to_csv(page)


def test_an_unknown_gpu_says_why_it_has_no_mfu_and_a_cpu_shows_none(tmp_path):
    write_run(tmp_path / "gpu" / "paddle", "recipes/sd15_pretrain.yaml", "paddle", {**GPU, "device": "gpu:0",
                                                                                    "device_name": "Tesla V100"})
    write_run(tmp_path / "gpu" / "torch", "recipes/sd15_pretrain.yaml", "torch", GPU)
    rows = compare_runs(load_runs([tmp_path / "gpu"]), ["paddle", "torch"])
    table = contrast.contrast_table(rows, ["paddle", "torch"])
    assert table.cells[0][table.header.index("paddle MFU")] == "n/a"
    assert any("No MFU for paddle on Tesla V100: no datasheet peak for Tesla V100" in n for n in table.notes)
    write_run(tmp_path / "cpu" / "paddle", "recipes/tiny/sd15_pretrain.yaml", "paddle", CPU)
    write_run(tmp_path / "cpu" / "torch", "recipes/tiny/sd15_pretrain.yaml", "torch", {**CPU, "mem_source": "peak_rss"})
    rows = compare_runs(load_runs([tmp_path / "cpu"]), ["paddle", "torch"])
    assert not any("MFU" in h for h in contrast.contrast_table(rows, ["paddle", "torch"]).header)


def test_a_cpu_compare_shows_one_memory_measure_common_to_both_sides(tmp_path):
    write_run(tmp_path / "paddle", "recipes/tiny/llava_sft.yaml", "paddle", CPU)
    write_run(tmp_path / "torch", "recipes/tiny/llava_sft.yaml", "torch", {**CPU, "mem_source": "peak_rss"})
    (row,) = compare_runs(load_runs([tmp_path]), ["paddle", "torch"])
    cells = [contrast.fmt_memory(row.sides[b]) for b in ("paddle", "torch")]
    assert cells == ["51.00 MiB training (peak RSS 351.00 MiB, 300.00 MiB after build; one run, no spread)"] * 2
    assert not any("different sources" in w for w in row.warnings)
    page = to_csv(contrast.contrast_page([row], ["paddle", "torch"]))
    assert "paddle_extra_own_mem_source" in page and "host_allocator" in page  # the framework's own figure, kept as an extra
    history = row_from_result(row_result(tmp_path / "paddle"), {}, night="n", night_started_utc="", suite="s",
                              entry="e", run_dir="")
    assert (history["memory_bytes"], history["memory_source"]) == (51 * 2**20, "rss_training")


def row_result(run_dir) -> RunResult:
    return RunResult.load(run_dir)


def test_a_run_recorded_before_the_shared_measure_still_loads_with_its_own_source(tmp_path):
    write_run(tmp_path / "paddle", "recipes/tiny/llava_sft.yaml", "paddle", CPU, rss=False)
    result = RunResult.load(tmp_path / "paddle")
    assert result.ok and result.measurement.rss_peak_bytes is None
    assert (result.measurement.memory_bytes, result.measurement.memory_source) == (8_000_000, "host_allocator")


def test_the_nightly_trend_draws_mfu_on_gpu_nights_and_memory_measured_one_way(tmp_path):
    from xfw.report import nightly_report

    def row(night, backend, memory, source, mfu=None):
        return {"night": night, "entry": "e", "backend": backend, "status": "ok", "ips": 10.0, "mfu": mfu,
                "memory_bytes": memory, "memory_source": source, "mem_source": "host_allocator"}

    old = {"night": "n1", "entry": "e", "backend": "paddle", "status": "ok", "ips": 10.0, "mfu": None,
           "mem_alloc_peak_bytes": 9_000_000, "mem_source": "host_allocator"}  # before the shared measure
    rows = [old, row("n2", "paddle", 400 * 2**20, "peak_rss"), row("n2", "torch", 380 * 2**20, "peak_rss")]
    assert nightly_report.latest_memory_sources(rows, ["paddle", "torch"]) == {"paddle": "peak_rss",
                                                                               "torch": "peak_rss"}
    assert nightly_report.memory_label({"paddle": "peak_rss", "torch": "peak_rss"}) == "peak memory (MiB)"
    path = nightly_report.trend_plot(rows, "e", ["n1", "n2"], set(), tmp_path / "cpu.png")
    gpu = [row(n, b, 2**30, "cuda_allocator", mfu=0.4) for n in ("n1", "n2") for b in ("paddle", "torch")]
    wide = nightly_report.trend_plot(gpu, "e", ["n1", "n2"], set(), tmp_path / "gpu.png")

    def width(png):  # a PNG's IHDR: the width at bytes 16-20
        return int.from_bytes(png.read_bytes()[16:20], "big")

    assert width(wide) > width(path)  # a third panel, MFU, on GPU nights only
