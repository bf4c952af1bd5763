"""The max-batch search: largest first or doubling, each probe a run directory, the edge reported."""

import json

import pytest
from click.testing import CliRunner

from xfw import cli
from xfw.run.launch import launcher
from xfw.run.commands import maxbatch
from xfw.report.nodes import load_runs


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def fake(fake_backend):
    backend = launcher.resolve_backend("fake", fake_backend)
    return backend, launcher.describe_backend(backend)


def oom_recipe(write_recipe, threshold, **knobs):
    return write_recipe(batch={"global": 2, "micro": 2}, measure={"warmup_steps": 0, "steps": 2, "timeout_s": 60},
                        backends={"fake": {"ips": 40, "oom_above_micro": threshold, **knobs}})


def test_candidates_run_largest_first_and_stop_at_the_first_that_fits(write_recipe, tmp_path, fake):
    found = maxbatch.search(str(oom_recipe(write_recipe, 8)), *fake, tmp_path, candidates=[4, 16, 8, 2], log=str)
    assert [(p.micro, p.status) for p in found.probes] == [(16, "oom"), (8, "ok")]
    assert found.edge.micro == 8 and found.oom_above.micro == 16 and found.edge.ips == pytest.approx(40)
    assert (tmp_path / "tiny-test" / "micro16" / "fake" / "summary.json").exists()


def test_doubling_grows_from_the_recipe_micro_batch_until_out_of_memory(write_recipe, tmp_path, fake):
    found = maxbatch.search(str(oom_recipe(write_recipe, 8)), *fake, tmp_path, log=str)
    assert [(p.micro, p.status) for p in found.probes] == [(2, "ok"), (4, "ok"), (8, "ok"), (16, "oom")]
    assert (found.edge.micro, found.oom_above.micro, found.stopped) == (8, 16, "")


def test_doubling_halves_when_the_first_probe_runs_out_of_memory(write_recipe, tmp_path, fake):
    path = write_recipe(batch={"global": 8, "micro": 8}, measure={"warmup_steps": 0, "steps": 2, "timeout_s": 60},
                        backends={"fake": {"oom_above_micro": 3}})
    found = maxbatch.search(str(path), *fake, tmp_path, log=str)
    assert [(p.micro, p.status) for p in found.probes] == [(8, "oom"), (4, "oom"), (2, "ok")]


def test_doubling_stops_at_max_micro_and_says_so(write_recipe, tmp_path, fake):
    found = maxbatch.search(str(oom_recipe(write_recipe, 1000)), *fake, tmp_path, max_micro=8, log=str)
    assert found.edge.micro == 8 and found.oom_above is None and "no OOM up to --max-micro 8" in found.stopped


def test_a_probe_that_crashes_stops_the_search_without_claiming_an_edge(write_recipe, tmp_path, fake):
    found = maxbatch.search(str(oom_recipe(write_recipe, 8, behave="crash")), *fake, tmp_path, log=str)
    assert len(found.probes) == 1 and found.edge is None and found.stopped.startswith("micro-batch 2 ended crashed")


def test_cli_reports_the_edge_writes_json_and_probes_render_in_the_batch_layout(write_recipe, tmp_path,
                                                                                fake_backend):
    out = tmp_path / "mb"
    result = invoke("maxbatch", oom_recipe(write_recipe, 4), "--backends", "fake", "--candidates", "16,8,4",
                    "--out", out, "--python", f"fake={fake_backend['fake']}")
    assert result.exit_code == 0, result.output
    assert "tiny-test on fake: largest micro-batch that fits: 4 (40.00 samples/s); 8 runs out of memory" \
        in result.output
    (saved,) = json.loads((out / "maxbatch.json").read_text())
    assert saved["edge_micro"] == 4 and saved["oom_micro"] == 8
    assert {r.variant["batch.micro"] for r in load_runs([out])} == {8, 16, 4}
    table = invoke("report", out, "--layout", "batch", "--out", tmp_path / "rep").output
    assert "| 1 process on none | fake | tiny-test | 8 | 8 | OOM |" in table and "| 4 | 4 | 40 |" in table
    # the recipe's global batch (4) is kept where the micro-batch divides it, and said where it is not
    assert "| 4 | 4 | ok |" in result.output and "| 8 | 8 | **oom** |" in result.output
    again = invoke("maxbatch", oom_recipe(write_recipe, 4), "--backends", "fake", "--candidates", "16,8,4",
                   "--out", out, "--python", f"fake={fake_backend['fake']}")
    assert again.output.count("kept from an earlier run") == 3


def test_bad_candidates_and_a_probe_that_breaks_the_recipe_launch_nothing(write_recipe, tmp_path, fake_backend):
    args = ["--backends", "fake", "--out", tmp_path / "mb", "--python", f"fake={fake_backend['fake']}"]
    bad = invoke("maxbatch", write_recipe(), "--candidates", "8,x", *args)
    assert bad.exit_code == 2 and "--candidates '8,x'" in bad.output
    assert not (tmp_path / "mb").exists()
