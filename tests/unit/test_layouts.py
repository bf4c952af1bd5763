"""The seed layouts: each rendered table has its seed's columns, and the numbers follow from the runs.

Runs come from real sweeps of the fake adapter (1- and 2-process runs, an OOM above a micro-batch),
loaded back from their run directories as ``xfw report`` does.
"""

import pandas as pd
import pytest
from click.testing import CliRunner

from xfw import cli
from xfw.report import layouts
from xfw.report.compare import Side
from xfw.report.nodes import load_runs

from conftest import fake_interpreters, recipe_file

# The header rows of the seeds, copied verbatim (shared/seeds/000, 001, 004).
# The seeds' headers as CPU runs show them: processes and memory, never GPUs and VRAM.
SEED_000 = ["Framework", "Strategy", "Time for 100 iters (s)", "Throughput (batches/s)", "Memory / process (GB)",
            "GB / batch"]
SEED_001 = ["Rank", "Time", "Max Memory Allocated"]
SEED_004_SCALING = ["Processes", "Batch Size", "Throughput", "Linear Scaling"]
SEED_004_COST = ["Model", "Hardware", "Recipe", "Cost/1M Samples", "Notes"]


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)


def header_of(markdown: str, first_column: str) -> list[str]:
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {first_column} |"))
    return [c.strip() for c in line.strip("|").split("|")]


@pytest.fixture(scope="module")
def strategy_runs(tmp_path_factory):
    """fake and fake2 at 1 and 2 processes, unsharded and stage1: 8 runs; 2 processes at 90% efficiency.
    One sweep for the module (each test reads it or renders a report of it elsewhere; a report without
    --out adds its files beside the runs, which every reader skips)."""
    base = tmp_path_factory.mktemp("layouts")
    recipe = recipe_file(base, batch={"global": 8, "micro": 2},
                         backends={"fake": {"ips": 100, "scale_eff": 0.9, "mem_per_sample_bytes": 10**8},
                                   "fake2": {"ips": 50, "scale_eff": 0.9}})
    out = base / "sweep"
    with pytest.MonkeyPatch.context() as env:
        python = fake_interpreters(env)
        result = invoke("sweep", recipe, "--set", "parallel.nproc_per_node=1,2", "--set",
                        "parallel.sharding=none,stage1", "--backends", "fake,fake2", "--out", out,
                        *[x for n, p in python.items() for x in ("--python", f"{n}={p}")])
    assert result.exit_code == 0, result.output
    return out


def test_strategies_has_one_seed_000_table_per_gpu_count(strategy_runs):
    tables = layouts.strategies(load_runs([strategy_runs]))
    assert [t.title for t in tables] == ["For 1 process on none:", "For 2 processes on none:"]  # counts ascending
    two = tables[1]
    assert two.header == SEED_000
    assert [row[:2] for row in two.cells] == [["fake", "DDP"], ["fake", "ZeRO-1"], ["fake2", "DDP"],
                                              ["fake2", "ZeRO-1"]]
    # fake at 2 processes: 90 samples/s per rank, global batch 8 -> 180 / 8 = 22.5 batches/s; one step of
    # 4 samples per rank at 90/s -> 100 steps in 4.44 s; peak reserved 2 x (1 MiB + 2 x 1e8) + rank 1's 4 KiB
    assert two.cells[0][2:] == ["4.4", "22.5", "0.402", "0.201"]
    assert two.records[0]["batches_per_s"] == pytest.approx(22.5)
    assert tables[0].cells[0][1] == "single device"


def test_ranks_lists_every_rank_with_time_memory_and_the_final_loss(strategy_runs):
    runs = [r for r in load_runs([strategy_runs]) if r.setup["num_processes"] == 2]
    tables = layouts.ranks(runs)
    assert all(t.header == SEED_001 for t in tables)
    first = tables[0]
    assert [row[0] for row in first.cells] == ["0", "1"]
    assert first.cells[0][1].endswith(" seconds") and first.cells[1][2].endswith(" bytes")
    assert first.cells[1][2] != first.cells[0][2]
    assert first.notes[0] == "loss: 4.6000"  # 5 - 0.1 x step 4, the last of 1 warm-up + 4 measured


def test_scaling_gives_linear_scaling_against_the_smallest_gpu_count(strategy_runs):
    tables = layouts.scaling(load_runs([strategy_runs]))
    assert len(tables) == 4  # (fake, fake2) x (none, stage1)
    table = tables[0]
    assert table.header == SEED_004_SCALING
    assert table.cells == [["1x", "8", "100.0 samples/s", "1.00x"], ["2x", "8", "180.0 samples/s", "0.90x"]]


def test_cost_per_million_samples_follows_from_price_and_throughput(strategy_runs):
    (table,) = layouts.cost(load_runs([strategy_runs]), price_per_gpu_hour=3.6)
    assert table.header == SEED_004_COST
    # fake, 1 GPU, 100 samples/s: 10^6 / 100 = 10^4 s = 2.78 h x $3.6 = $10.00
    row = next(c for c, r in zip(table.cells, table.records) if r["framework"] == "fake" and r["gpu"] == "1 process on none"
               and "sharding=none" in r["variant"])
    assert row[3] == "$10.00"


def test_batch_keeps_oom_rows_next_to_the_throughput_rows(write_recipe, tmp_path, fake_backend):
    recipe = write_recipe(batch={"global": 2, "micro": 2}, backends={"fake": {"ips": 40, "oom_above_micro": 4}})
    out = tmp_path / "sweep"
    result = invoke("sweep", recipe, "--set", "batch.micro=2,4,8", "--set", "batch.global=8", "--backends", "fake",
                    "--out", out, "--python", f"fake={fake_backend['fake']}")
    assert result.exit_code == 1  # one point ran out of memory
    (table,) = layouts.batch(load_runs([out]))
    assert table.header == ["Hardware", "Framework", "Recipe", "Global batch size", "Micro-batch",
                            "Throughput (samples/s)"]
    assert [row[-3:] for row in table.cells] == [["8", "8", "OOM"], ["8", "4", "40"], ["8", "2", "40"]]
    assert "global batch size 8 (micro-batch 8): OOM" in table.notes[0]


def test_report_layouts_write_markdown_csv_and_html(strategy_runs, tmp_path):
    for layout in ("strategies", "ranks", "batch", "scaling"):
        result = invoke("report", strategy_runs, "--layout", layout, "--out", tmp_path / "rep")
        assert result.exit_code == 0, result.output
        for ext in ("md", "csv", "html"):
            assert (tmp_path / "rep" / f"report-{layout}.{ext}").exists()
    result = invoke("report", strategy_runs, "--layout", "strategies", "--out", tmp_path / "rep")
    assert header_of(result.output, "Framework") == SEED_000
    frame = pd.read_csv(tmp_path / "rep" / "report-strategies.csv")
    # the seed's own column names, and the raw keys beside them never differing from one only in case
    assert {"section", "Framework", "framework_value", "strategy_value", "batches_per_s", "vram_per_gpu_bytes"} <= set(frame.columns)
    assert len({c.lower() for c in frame.columns}) == len(frame.columns)


def test_cost_without_a_price_is_a_clear_error(strategy_runs):
    result = invoke("report", strategy_runs, "--layout", "cost")
    assert result.exit_code == 2 and "--price-per-gpu-hour" in result.output
    ok = invoke("report", strategy_runs, "--layout", "cost", "--price-per-gpu-hour", "2.5")
    assert ok.exit_code == 0 and header_of(ok.output, "Model") == SEED_004_COST


def _entry(backend, gpus, sharding, status="ok", ips=None):
    return Side(backend=backend, recipe="r", model="m", stage="SFT", variant={"parallel.sharding": sharding},
                         setup={"num_processes": gpus, "sharding": sharding}, device="cpu", status=status, reason="",
                         ips=ips)


def test_scaling_baseline_is_the_one_process_unsharded_run_when_a_strategy_cannot_run_on_one():
    single = _entry("fake", 1, "none", ips=100.0)
    group = [_entry("fake", 1, "stage1", status="unsupported"), _entry("fake", 2, "stage1", ips=150.0)]
    other = _entry("fake2", 1, "none", ips=10.0)  # another framework never serves as the baseline
    base, how = layouts.scaling_baseline(group, [other, single, *group])
    assert base is single and "1x unsharded run" in how
    assert layouts.scaling_baseline(group, [other, *group])[0] is group[1]  # else the smallest count that ran
    assert layouts.scaling_baseline([single], [single]) == (single, "")


def test_csv_and_html_lead_with_the_seed_columns_without_markdown_emphasis(strategy_runs, tmp_path):
    invoke("report", strategy_runs, "--layout", "scaling", "--out", tmp_path)
    frame = pd.read_csv(tmp_path / "report-scaling.csv")
    assert list(frame.columns[:5]) == ["section", *SEED_004_SCALING]
    assert frame["Linear Scaling"].tolist()[:2] == ["1.00x", "0.90x"]
    html = (tmp_path / "report-scaling.html").read_text()
    assert "<th>Linear Scaling</th>" in html and "**" not in html


def test_a_micro_batch_sweep_is_not_presented_as_scaling(write_recipe, tmp_path, fake_backend):
    recipe = write_recipe(batch={"global": 8, "micro": 1}, backends={"fake": {"ips": 40}})
    out = tmp_path / "sweep"
    assert invoke("sweep", recipe, "--set", "batch.micro=1,2,4", "--backends", "fake", "--out", out,
                  "--python", f"fake={fake_backend['fake']}").exit_code == 0
    result = CliRunner().invoke(cli.main, ["report", str(out), "--layout", "scaling"])
    assert result.exit_code == 2 and "form no series at several process counts" in result.output
    assert "batch.micro" in result.output
    (table,) = layouts.batch(load_runs([out]))  # the batch layout is where a micro-batch sweep belongs
    assert [row[3:] for row in table.cells] == [["8", "4", "40"], ["8", "2", "40"], ["8", "1", "40"]]
    assert table.cells[0][0] == "1 process on none"  # a CPU run says processes, never GPUs
