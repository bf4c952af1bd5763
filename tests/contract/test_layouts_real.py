"""The seed layouts on real runs: one `xfw sweep` of a tiny LLaVA over 1 and 2 processes x no sharding
and sharding stage 2, on both backends, then `xfw report --layout strategies|scaling|ranks|cost`: README's
sweep and reports as written but for their directory and a window of 1 + 2 steps (so test_documented_commands
does not run them again: its COVERED).

Each rendered table must carry its seed's header exactly (seeds 000, 001, 004), one row per
(GPU count, framework, strategy), and numbers that follow from the runs' own summary.json and
spec.json, recomputed here: throughput per batch, step time, memory, linear-scaling efficiency
against the framework's 1-process run, cost per 1M samples. Runs that cannot run on CPU (ZeRO at
1 process, Paddle's group-sharded stages 2/3) stay in the tables as ``unsupported``.

The sweep's points are the fewest that reach every kind of row the layouts render: one process with
nothing to shard (single device), two processes unsharded (DDP / DataParallel), a sharded stage that
runs (torch ZeRO-2), and both kinds of unsupported point (a stage at one process; Paddle's GPU-only
stage 2 at two). Stages 1 and 3 add rows of the same kinds (their adapters' paths are run by
test_torch_parallel and test_paddle_sharding); dropping them took the sweep from 16 launches (24
processes) to 8 (12). One sweep is shared by every test in this module.
"""

import contextlib
import json
import math
import re
from html.parser import HTMLParser

import pandas as pd
import pytest
from click.testing import CliRunner

from xfw import cli

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract

# The seeds' header rows, verbatim (shared/seeds/000, 001, 004).
# The seeds' headers as CPU runs show them: processes and memory, never GPUs and VRAM.
# Memory on a CPU: the training memory both backends share, in MiB (as in the contrast table).
SEED_000 = ["Framework", "Strategy", "Time for 100 iters (s)", "Throughput (batches/s)",
            "Training memory / process (MiB)", "MiB / batch"]
SEED_001 = ["Rank", "Time", "Training memory"]  # a CPU: the training memory, in MiB
SEED_004_SCALING = ["Processes", "Batch Size", "Throughput", "Linear Scaling"]
SEED_004_COST = ["Model", "Hardware", "Recipe", "Cost/1M Samples", "Notes"]
# Seed 002 is a list ("- *2x T4*: global batch size 8, ~14 images/s"); the table puts its fields in
# columns, and the bullets under it repeat the seed's form.
SEED_002 = ["Hardware", "Framework", "Recipe", "Variant", "Global batch size", "Micro-batch", "Throughput (samples/s)"]
SEEDS = {"strategies": SEED_000, "ranks": SEED_001, "batch": SEED_002, "scaling": SEED_004_SCALING,
         "cost": SEED_004_COST}

BACKENDS = ("torch", "paddle")
SHARDINGS = ("none", "stage2")  # the fewest that reach every kind of row (module docstring)
STRATEGY = {"none": "DDP", "stage1": "ZeRO-1", "stage2": "ZeRO-2", "stage3": "ZeRO-3"}
PRICE = 2.5


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    pythons = [x for b in BACKENDS for x in ("--python", f"{b}={require_interpreter(b)}")]
    out = tmp_path_factory.mktemp("layouts") / "sweep"
    short = ["--set", "measure.warmup_steps=1", "--set", "measure.steps=2", "--set", "measure.timeout_s=240"]
    with contextlib.chdir(ROOT):  # README's command, from the repository's root
        result = invoke("sweep", "recipes/tiny/llava_sft.yaml", "--set", "parallel.nproc_per_node=1,2", "--set",
                        "parallel.sharding=none,stage2", "--backends", "paddle,torch", "--out", out, *short, *pythons)
    assert result.exit_code == 0, result.output  # unsupported points are not applicable, not failures; nothing crashed
    return out


@pytest.fixture(scope="module")
def runs(sweep_dir) -> dict[tuple[int, str, str], dict]:
    """(processes, sharding, backend) -> summary.json with its spec.json, read raw from disk."""
    found = {}
    for summary_path in sweep_dir.rglob("summary.json"):
        summary = json.loads(summary_path.read_text())
        spec = json.loads((summary_path.parent / "spec.json").read_text())
        key = (spec["derived"]["num_processes"], spec["parallel"]["sharding"], summary["backend"])
        assert key not in found
        found[key] = {**summary, "spec": spec}
    return found


@pytest.fixture(scope="module")
def reports(sweep_dir, tmp_path_factory):
    """layout -> (markdown printed, directory with report-<layout>.md/.csv/.html)."""
    out = tmp_path_factory.mktemp("reports")
    rendered = {}
    for layout in SEEDS:
        extra = ["--price-per-gpu-hour", PRICE] if layout == "cost" else []
        result = invoke("report", sweep_dir, "--layout", layout, "--out", out, *extra)
        assert result.exit_code == 0, result.output  # the unsupported points: shown as not applicable
        assert "3 of 8 sweep points are not applicable here" in result.output
        rendered[layout] = result.output[:result.output.index("markdown: ")]
    return rendered, out


def tables_in(markdown: str) -> list[dict]:
    """Every table of a rendered layout: its title (the line above it), header, rows and the lines
    under it (notes)."""
    tables, pending, lines = [], [], markdown.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            if lines[i].strip() and not lines[i].startswith("## "):
                pending.append(lines[i].strip())
            i += 1
            continue
        block = []
        while i < len(lines) and lines[i].startswith("|"):
            block.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
            i += 1
        if tables:  # what came between two tables: the last table's notes, then this one's title
            tables[-1]["notes"] = pending[:-1]
        tables.append({"title": pending[-1] if pending else "", "header": block[0], "rows": block[2:], "notes": []})
        pending = []
    if tables:
        tables[-1]["notes"] = pending
    return tables


def ok(run: dict) -> bool:
    return run["status"] == "ok"


def test_the_sweep_ran_every_point_on_both_backends_and_only_cpu_gaps_are_unsupported(runs):
    assert set(runs) == {(n, s, b) for n in (1, 2) for s in SHARDINGS for b in BACKENDS}
    unsupported = {k for k, r in runs.items() if r["status"] == "unsupported"}
    # One process has nothing to shard; Paddle's group_sharded_parallel (stages 2/3) is GPU-only.
    assert unsupported == {(1, s, b) for s in SHARDINGS[1:] for b in BACKENDS} | {(2, "stage2", "paddle")}
    assert all(ok(r) for k, r in runs.items() if k not in unsupported), \
        {k: (r["status"], r["reason"]) for k, r in runs.items() if k not in unsupported and not ok(r)}
    assert all(r["measurement"]["num_ranks"] == k[0] for k, r in runs.items() if ok(r))


def test_strategies_has_the_seed_000_columns_and_one_row_per_gpu_count_framework_and_strategy(runs, reports):
    tables = tables_in(reports[0]["strategies"])
    assert [t["title"].split(" on ")[0] for t in tables] == ["For 1 process", "For 2 processes"]  # a CPU: processes
    seen = set()
    for table, gpus in zip(tables, (1, 2)):
        assert table["header"] == SEED_000
        assert len(table["rows"]) == len(BACKENDS) * len(SHARDINGS)
        for framework, strategy, time_100, batches_per_s, vram_gb, gb_per_batch in table["rows"]:
            name = strategy.split(" (")[0]
            sharding = next(s for s in SHARDINGS if STRATEGY[s] == name) if name != "single device" else "none"
            assert name == ("single device" if gpus == 1 and sharding == "none" else STRATEGY[sharding])
            seen.add((gpus, framework, sharding))
            run = runs[(gpus, sharding, framework)]
            if not ok(run):
                assert [time_100, batches_per_s, vram_gb, gb_per_batch] == ["**unsupported**", "–", "–", "–"]
                continue
            m, batch = run["measurement"], run["spec"]["batch"]
            vram = max(p["rss_peak_bytes"] - p["rss_after_build_bytes"] for p in m["per_rank"])
            assert float(batches_per_s) == pytest.approx(m["ips"] / batch["global"], rel=5e-3)
            assert float(time_100) == pytest.approx(100 * m["step_time_median_s"], abs=0.051)
            assert vram > 0 and float(vram_gb) == pytest.approx(vram / 2**20, rel=5e-3)
            assert float(gb_per_batch) == pytest.approx(vram / batch["micro"] / 2**20, rel=5e-3)
    assert seen == {(n, b, s) for n in (1, 2) for b in BACKENDS for s in SHARDINGS}


def test_scaling_efficiency_is_per_gpu_throughput_against_the_frameworks_one_process_run(runs, reports):
    tables = tables_in(reports[0]["scaling"])
    assert len(tables) == len(BACKENDS) * len(SHARDINGS)  # one per (framework, strategy)
    checked = 0
    for table in tables:
        assert table["header"] == SEED_004_SCALING
        framework = next(b for b in BACKENDS if f"({b})" in table["title"])
        sharding = next(s for s in SHARDINGS if f"parallel.sharding={s}]" in table["title"])
        assert [row[0] for row in table["rows"]] == ["1x", "2x"]
        base = runs[(1, "none", framework)]  # the same framework, one process: nothing to shard
        for gpus_cell, batch_cell, throughput, efficiency in table["rows"]:
            run = runs[(int(gpus_cell[:-1]), sharding, framework)]
            assert batch_cell == str(run["spec"]["batch"]["global"])
            if not ok(run):
                assert (throughput, efficiency) == ("**unsupported**", "–")
                continue
            ips, gpus = run["measurement"]["ips"], run["spec"]["derived"]["num_processes"]
            expected = (ips / gpus) / (base["measurement"]["ips"] / 1)
            assert throughput == f"{ips:,.1f} samples/s"
            assert efficiency == f"{expected:.2f}x" and expected > 0
            checked += 1
    assert checked == sum(ok(r) for r in runs.values())


def test_ranks_lists_both_ranks_of_a_two_process_run_with_time_memory_and_final_loss(runs, reports):
    tables = tables_in(reports[0]["ranks"])
    assert len(tables) == len(runs) and all(t["header"] == SEED_001 for t in tables)
    two_process = [t for t in tables if "parallel.nproc_per_node=2" in t["title"]]
    checked = 0
    for table in two_process:
        framework = table["title"].split(":")[0]
        sharding = next(s for s in SHARDINGS if f"parallel.sharding={s}]" in table["title"])
        run = runs[(2, sharding, framework)]
        if not ok(run):
            assert table["rows"] == [] and any(n.startswith("status: unsupported") for n in table["notes"])
            continue
        per_rank = run["measurement"]["per_rank"]
        assert [row[0] for row in table["rows"]] == ["0", "1"]
        for row, rank in zip(table["rows"], per_rank):
            assert row[1] == f"{rank['window_time_s']:.3f} seconds" and rank["window_time_s"] > 0
            training = rank["rss_peak_bytes"] - rank["rss_after_build_bytes"]
            assert row[2] == f"{training / 2**20:.2f} MiB" and training > 0
        loss = run["measurement"]["loss_last"]
        assert math.isfinite(loss) and f"loss: {loss:.4f}" in table["notes"]
        checked += 1
    assert checked == 3  # torch: DDP, ZeRO-2; paddle: DataParallel


def test_cost_per_million_samples_follows_from_the_price_and_each_runs_throughput(runs, reports):
    (table,) = tables_in(reports[0]["cost"])
    assert table["header"] == SEED_004_COST
    assert len(table["rows"]) == len(runs)
    for model, gpu, recipe, usd, notes in table["rows"]:
        framework = notes.split(",")[0].split(":")[0]
        gpus = int(gpu.split(" ")[0])  # "2 processes on AMD EPYC": a CPU says processes
        sharding = next(s for s in SHARDINGS if recipe.endswith(f"parallel.sharding={s})"))
        run = runs[(gpus, sharding, framework)]
        assert model == "Tiny LLaVA"
        if ok(run):
            expected = PRICE * gpus * 1e6 / run["measurement"]["ips"] / 3600
            assert usd == f"${expected:,.2f}"
        else:
            assert usd == "–" and notes == f"{framework}: unsupported"


def test_batch_lists_every_run_with_its_throughput_or_status_in_the_seed_002_form(runs, reports):
    (table,) = tables_in(reports[0]["batch"])
    assert table["header"] == SEED_002 and len(table["rows"]) == len(runs)
    for hardware, framework, _, variant, size, micro, throughput in table["rows"]:
        run = runs[(int(hardware.split(" ")[0]), variant.removeprefix("parallel.sharding="), framework)]
        assert size == str(run["spec"]["batch"]["global"]) and micro == str(run["spec"]["batch"]["micro"])
        assert throughput == (f"{run['measurement']['ips']:,.3g}" if ok(run) else "**unsupported**")
    bullet = re.compile(r"^- \*[12] process(es)? on .+\* \((torch|paddle), tiny-llava-sft\): global batch size 8 "
                        r"\(micro-batch \d+\)[^:]*: ([\d.,]+ samples/s|unsupported)$")
    assert len([n for n in table["notes"] if bullet.match(n)]) == len(runs)


class _Headers(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tables, self._in_th = [], False

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        self._in_th = tag == "th"

    def handle_endtag(self, tag):
        self._in_th = self._in_th and tag != "th"

    def handle_data(self, data):
        if self._in_th and data.strip():
            self.tables[-1].append(data.strip())


@pytest.mark.parametrize("layout", list(SEEDS))
def test_csv_and_html_carry_the_seeds_columns_too(reports, layout):
    markdown, out = reports
    parser = _Headers()
    parser.feed((out / f"report-{layout}.html").read_text())
    num_tables = len(tables_in(markdown[layout]))
    assert parser.tables == [SEEDS[layout]] * num_tables
    frame = pd.read_csv(out / f"report-{layout}.csv")
    shown = [c for c in frame.columns if c != "section"]  # the section column comes only with several titled tables
    assert shown[:len(SEEDS[layout])] == SEEDS[layout]
    assert "**" not in frame.to_csv()  # emphasis is for markdown only
