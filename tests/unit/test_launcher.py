"""The launcher: classification of every way a backend can end, and nothing lost on failure.

These use a fake adapter that writes canned records (tests/fakes/xfw_fake); real training is
tested in tests/contract.
"""

import json
from pathlib import Path

import pytest

from xfw.run.launch import launcher
from xfw.recipe import load_recipe
from xfw.report.results import RunResult


def launch_fake(write_recipe, tmp_path, fake_backend, behave, **measure):
    path = write_recipe(backends={"fake": {"behave": behave, "ips": 50}},
                        measure={"warmup_steps": 1, "steps": 3, "timeout_s": 120, **measure})
    recipe = load_recipe(path)
    backend = launcher.resolve_backend("fake", fake_backend)
    description = launcher.describe_backend(backend)
    return launcher.launch(recipe, backend, tmp_path / "run", description=description)


def test_a_successful_run_writes_every_file_of_a_run_directory(write_recipe, tmp_path, fake_backend):
    result = launch_fake(write_recipe, tmp_path, fake_backend, "ok")
    assert result.status == "ok" and result.reason == ""
    assert result.measurement.ips == pytest.approx(50.0)
    run_dir = Path(result.run_dir)
    for name in ("spec.json", "env.json", "steps.jsonl", "summary.json", "stderr.log"):
        assert (run_dir / name).exists(), name
    env = json.loads((run_dir / "env.json").read_text())
    assert env["backend"]["framework"] == "fake" and env["host"]["num_cpus"] >= 1
    assert not list(run_dir.glob(".*.tmp"))


def test_a_run_directory_loads_back_with_statistics_recomputed(write_recipe, tmp_path, fake_backend):
    result = launch_fake(write_recipe, tmp_path, fake_backend, "ok")
    loaded = RunResult.load(result.run_dir)
    assert loaded.status == "ok" and loaded.backend == "fake"
    assert loaded.measurement == result.measurement
    assert loaded.applied["num_params_total"] == 1000


def test_a_crash_is_classified_with_the_last_line_of_stderr(write_recipe, tmp_path, fake_backend):
    result = launch_fake(write_recipe, tmp_path, fake_backend, "crash")
    assert result.status == "crashed"
    assert result.reason == "RuntimeError: fake adapter crashed on purpose (exit code 1)"
    assert result.measurement.num_warmup_steps == 1  # the steps it finished are kept


def test_a_hung_backend_is_killed_at_its_timeout(write_recipe, tmp_path, fake_backend):
    result = launch_fake(write_recipe, tmp_path, fake_backend, "hang", timeout_s=3)
    assert result.status == "timeout"
    assert "measure.timeout_s = 3 s" in result.reason and "finished 1 steps" in result.reason
    assert result.wall_time_s < 30


def test_an_abort_after_all_records_were_written_is_still_a_success(write_recipe, tmp_path, fake_backend):
    result = launch_fake(write_recipe, tmp_path, fake_backend, "abort_after_end")
    assert result.status == "ok"
    assert "records complete" in result.reason and result.exit_code != 0


def test_a_launcher_that_does_not_exit_after_every_rank_ended_is_stopped_and_the_run_kept(
        write_recipe, tmp_path, fake_backend, monkeypatch):
    # torchrun's exit barrier waits up to 300 s for another node's agent: the measurement is complete.
    monkeypatch.setattr(launcher.attached, "ADAPTER_EXIT_GRACE_S", 1.0)
    result = launch_fake(write_recipe, tmp_path, fake_backend, "hang_after_end", timeout_s=60)
    assert result.status == "ok" and result.measurement.ips == pytest.approx(50.0)
    assert "had not exited 1 s after every rank's end record, so xfw stopped it" in result.reason
    assert result.wall_time_s < 30


def test_out_of_memory_on_stderr_without_an_error_record_is_a_crash_that_says_so(write_recipe, tmp_path,
                                                                                fake_backend):
    # Only the adapter's own error record makes a run "oom": a probe must not mistake a crash for the edge.
    result = launch_fake(write_recipe, tmp_path, fake_backend, "oom_stderr")
    assert result.status == "crashed" and "out of memory" in result.reason and "(exit code 1)" in result.reason


@pytest.mark.parametrize("code", [2, 3, 4, 1])
def test_an_exit_code_without_an_error_record_is_a_crash_with_the_last_stderr_line(code):
    got = launcher.classify(exit_code=code, timed_out=False, records=[], num_processes=1, stderr_tail="boom\n",
                            timeout_s=10)
    assert got == ("crashed", f"boom (exit code {code})")


def test_an_error_record_wins_over_the_exit_code():
    records = [{"kind": "error", "rank": 0, "status": "unsupported", "message": "stage2 is GPU-only"}]
    assert launcher.classify(exit_code=1, timed_out=False, records=records, num_processes=1, stderr_tail="",
                             timeout_s=10) == ("unsupported", "stage2 is GPU-only")


def test_a_killed_process_names_the_signal():
    status, reason = launcher.classify(exit_code=-9, timed_out=False, records=[], num_processes=1,
                                       stderr_tail="", timeout_s=10)
    assert status == "crashed" and "SIGKILL" in reason


def test_missing_interpreter_is_a_clear_error_before_launch(tmp_path):
    (tmp_path / "adapters" / "nothing" / "xfw_nothing").mkdir(parents=True)  # an adapter, never set up
    with pytest.raises(launcher.BackendError, match=r"no interpreter at .venv/nothing/bin/python"):
        launcher.resolve_backend("nothing", {}, root=tmp_path)
    # a misspelt backend is unknown, with the known ones listed (not told to run make setup)
    with pytest.raises(launcher.BackendError, match=r"unknown backend 'padle' \(known: nothing;"):
        launcher.resolve_backend("padle", {}, root=tmp_path)
    with pytest.raises(launcher.BackendError, match="no such interpreter"):
        launcher.resolve_backend("x", {"x": str(tmp_path / "python")})


def test_an_interpreter_without_the_adapter_is_named(fake_backend):
    backend = launcher.Backend("nosuchadapter", fake_backend["fake"])
    with pytest.raises(launcher.BackendError, match="cannot run xfw_nosuchadapter"):
        launcher.describe_backend(backend)


def test_multi_process_runs_use_the_launcher_the_adapter_describes(write_recipe, tmp_path):
    backend = launcher.Backend("torch", "/venv/bin/python")
    description = {"launcher": ["{python}", "-m", "torch.distributed.run", "--nnodes", "{nnodes}", "--node_rank",
                                "{node_rank}", "--master_addr", "{master_addr}", "--master_port", "{master_port}",
                                "--nproc_per_node", "{nproc}", "-m", "xfw_torch"]}
    two_nodes = load_recipe(write_recipe(parallel={"nproc_per_node": 2, "nnodes": 2}, batch={"global": 8, "micro": 2}))
    rdzv = launcher.Rendezvous(node_rank=1, master_addr="10.0.0.5", master_port=29400)
    cmd = launcher.build_command(backend, description, two_nodes, tmp_path / "s.json", tmp_path / "r.jsonl", rdzv)
    assert cmd[:13] == ["/venv/bin/python", "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", "1",
                        "--master_addr", "10.0.0.5", "--master_port", "29400", "--nproc_per_node", "2"]
    single = launcher.build_command(backend, description, load_recipe(write_recipe()), tmp_path / "s.json",
                                    tmp_path / "r.jsonl")
    assert single[:3] == ["/venv/bin/python", "-m", "xfw_torch"]


def test_a_single_node_run_gets_a_free_master_port(write_recipe, tmp_path):
    backend = launcher.Backend("torch", "/venv/bin/python")
    description = {"launcher": ["{python}", "--port", "{master_port}"]}
    recipe = load_recipe(write_recipe(parallel={"nproc_per_node": 2}))
    port = int(launcher.build_command(backend, description, recipe, tmp_path / "s", tmp_path / "r")[2])
    assert 1024 < port < 65536
