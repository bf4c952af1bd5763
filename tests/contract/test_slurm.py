"""xfw under a real Slurm 22.05 (scripts/setup_slurm.sh: slurmctld and two slurmd on loopback, n1 and n2):
jobs are submitted through the real sbatch/squeue/scancel, no mocked scheduler. A detached two-job compare
(its report job writes the report), a job past its time limit, a two-node recipe, a job scancelled mid-run,
a slurmd killed under a running job, and xfw killed and rerun (it attaches; nothing runs twice)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract
SETUP = ROOT / "scripts" / "setup_slurm.sh"
SLURM_DIR = Path(os.environ.get("XFW_SLURM_DIR", "/var/lib/xfw-slurm"))
SHORT = ["--set", "measure.warmup_steps=1", "--set", "measure.steps=3"]
LONG = ["--set", "measure.warmup_steps=1", "--set", "measure.steps=5000", "--set", "measure.timeout_s=300"]


def _nodes_up() -> bool:
    done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True)
    return done.returncode == 0 and sum(line.split()[1] in ("idle", "mix", "alloc")
                                        for line in done.stdout.splitlines()) >= 2


@pytest.fixture(scope="module")
def cluster():
    """The loopback cluster, started (scripts/setup_slurm.sh) when it is not up."""
    if shutil.which("sinfo") is None or not _nodes_up():
        if os.geteuid() != 0:
            pytest.skip("no Slurm cluster up and not root: run scripts/setup_slurm.sh as root (make test does)")
        subprocess.run([str(SETUP)], check=True, timeout=600)
    assert _nodes_up()
    require_interpreter("torch")
    yield
    subprocess.run([str(SETUP)], check=True, timeout=120)  # a node a test took down comes back


FAST_POLL = {**os.environ, "XFW_SLURM_POLL_S": "0.3"}  # the queue looked at often: tests wait less


def xfw(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xfw.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=FAST_POLL)


def start_xfw(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "xfw.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=FAST_POLL)


def slurm_record(run_dir: Path) -> dict:
    return json.loads((run_dir / "slurm.json").read_text())


def wait_running(run_dir: Path, steps: int = 3, timeout: float = 120) -> str:
    """The job id once its run has written ``steps`` step records."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = run_dir / "steps.jsonl"
        if (run_dir / "slurm.json").exists() and records.exists() and records.read_text().count('"step"') >= steps:
            return slurm_record(run_dir)["job_id"]
        time.sleep(0.5)
    raise AssertionError(f"no running job in {run_dir}")


def _scontrol(action: str, job_id: str) -> None:
    subprocess.run(["scontrol", action, job_id], check=True, capture_output=True, timeout=30)


def _wait_gone(job_id: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, f"Slurm job {job_id} still queued"
        time.sleep(0.5)


def test_a_detached_two_job_compare_returns_at_once_and_its_report_job_writes_the_report(cluster, tmp_path):
    """--detach: two jobs and a report job after them (afterany) submitted, xfw returns; the report job (the
    same command without --detach) collects both runs and writes the usual report."""
    out = tmp_path / "cmp"
    started = time.monotonic()
    done = xfw("compare", "recipes/tiny/llava_sft.yaml", "--backends", "torch", "--repeat", "2", *SHORT, "--out",
               str(out), "--executor", "slurm", "--partition", "debug", "--detach")
    assert done.returncode == 0, done.stderr[-4000:]
    assert not (out / "report.md").exists() and time.monotonic() - started < 60
    said = [line for line in done.stderr.splitlines() if line.startswith("detached: Slurm job(s) ")]
    assert said, done.stderr[-3000:]
    report_id = said[0].split("report job ")[1].split()[0]
    assert "to attach or report before then: xfw compare " in done.stderr and "--detach" not in done.stderr
    _wait_gone(report_id, timeout=300)
    report_log = (out / "tiny-llava-sft" / f"slurm-report-{report_id}.out").read_text()
    runs = sorted((out / "tiny-llava-sft").glob("torch-r*"))
    assert len(runs) == 2
    ids = set()
    for run in runs:
        record, env = slurm_record(run), json.loads((run / "env.json").read_text())
        summary = json.loads((run / "summary.json").read_text())
        assert record["state"] == "COMPLETED" and summary["status"] == "ok", report_log[-3000:]
        assert env["slurm"]["job_id"] == record["job_id"] and env["slurm"]["node"] in ("n1", "n2")
        assert (run / f"slurm-{record['job_id']}.out").exists()
        assert f"Slurm job {record['job_id']} ended while no xfw watched it" in report_log
        ids.add(record["job_id"])
    assert len(ids) == 2 and ids == set(said[0].split("job(s) ")[1].split(" submitted")[0].split())
    assert (out / "report.md").exists(), report_log[-3000:]


def test_a_job_past_its_time_limit_is_a_timeout_with_slurms_reason_and_no_other_result_is_lost(cluster, tmp_path):
    """--time 1: one side's job runs far past its minute (its own timeout, a per-backend override, is longer)
    and Slurm ends it; it is recorded as a timeout with Slurm's reason, the other side's run stays ok."""
    out = tmp_path / "late"
    done = xfw("compare", "recipes/tiny/llava_sft.yaml", "--backends", f"torch@slow={sys.executable},torch", *SHORT,
               "--set", "measure.timeout_s=60", "--set", "backends.torch@slow.override.measure.steps=100000",
               "--set", "backends.torch@slow.override.measure.timeout_s=600", "--time", "1", "--out", str(out),
               "--executor", "slurm")
    slow, fine = out / "tiny-llava-sft" / "torch@slow", out / "tiny-llava-sft" / "torch"
    summary = json.loads((slow / "summary.json").read_text())
    assert summary["status"] == "timeout" and "TIMEOUT (TimeLimit)" in summary["reason"], done.stderr[-3000:]
    assert slurm_record(slow)["state"] == "TIMEOUT" and "--time=1" in slurm_record(slow)["sbatch"]
    assert json.loads((fine / "summary.json").read_text())["status"] == "ok"
    assert (out / "report.md").exists()


def test_bad_slurm_input_is_one_line_exit_2_and_nothing_submitted(cluster, tmp_path):
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    for extra, key in ((["--partition", "no-such-partition"], "--partition"),
                       (["--time", "1", "--set", "measure.timeout_s=600"], "--time"),
                       (["--set", "parallel.nnodes=3", "--set", "batch.global=12", "--master-port", "29123"],
                        "--partition")):
        done = xfw("compare", "recipes/tiny/llava_sft.yaml", "--backends", "torch", "--out", str(tmp_path / "bad"),
                   "--executor", "slurm", *extra)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith(f"error: {key}"), done.stderr
    no_slurm = tmp_path / "bin"
    no_slurm.mkdir()
    done = subprocess.run([sys.executable, "-m", "xfw.cli", "compare", "recipes/tiny/llava_sft.yaml", "--out",
                           str(tmp_path / "bad"), "--executor", "slurm"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PATH": str(no_slurm)})
    assert done.returncode == 2 and "--executor slurm: no sbatch" in done.stderr
    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout == before


def test_a_two_node_recipe_is_one_job_on_both_nodes_assembled(cluster, tmp_path):
    out = tmp_path / "mn"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = xfw("compare", "recipes/tiny/llava_sft.yaml", "--backends", "torch", *SHORT, "--set", "parallel.nnodes=2",
               "--master-port", str(port), "--out", str(out), "--executor", "slurm")
    assert done.returncode == 0, done.stderr[-4000:]
    parts = [out / "tiny-llava-sft" / "torch" / f"node-{k}" for k in (0, 1)]
    nodes = {json.loads((p / "env.json").read_text())["slurm"]["node"] for p in parts}
    assert nodes == {"n1", "n2"}
    assert len({json.loads((p / "env.json").read_text())["slurm"]["job_id"] for p in parts}) == 1
    assert "2 processes" in done.stdout


def test_a_scancelled_job_is_cut_off_with_slurms_reason(cluster, tmp_path):
    out = tmp_path / "cancel"
    proc = start_xfw("compare", "recipes/tiny/llava_sft.yaml", "--backends", "torch", *LONG, "--out", str(out),
                     "--executor", "slurm")
    run = out / "tiny-llava-sft" / "torch"
    job_id = wait_running(run)
    subprocess.run(["scancel", job_id], check=True)
    output = proc.communicate(timeout=120)[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "crashed" and "cut off" in summary["reason"] and "CANCELLED" in summary["reason"], output
    assert slurm_record(run)["state"] == "CANCELLED"


def test_a_slurmd_killed_under_its_job_is_recorded_as_node_failed(cluster, tmp_path):
    out = tmp_path / "nodefail"
    proc = start_xfw("compare", "recipes/tiny/llava_sft.yaml", "--backends", "torch", *LONG, "--out", str(out),
                     "--executor", "slurm")
    run = out / "tiny-llava-sft" / "torch"
    wait_running(run)
    node = json.loads((run / "env.json").read_text())["slurm"]["node"]
    os.kill(int((SLURM_DIR / "run" / f"slurmd-{node}.pid").read_text()), signal.SIGKILL)
    try:
        output = proc.communicate(timeout=200)[0]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "crashed" and summary["reason"].startswith("node failed"), output
        assert slurm_record(run)["state"] == "NODE_FAIL"
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run([str(SETUP)], check=True, timeout=120)  # the node back (slurmd restarted, RESUME)


def test_xfw_killed_and_rerun_attaches_to_its_job_and_runs_nothing_twice(cluster, tmp_path):
    """xfw killed (SIGKILL) with two jobs in flight: one is still running when xfw runs again (it is held
    suspended until the rerun says it attached), the other ended while no xfw watched. The rerun attaches to
    the first, collects the second, and submits nothing."""
    out = tmp_path / "attach"
    args = ("compare", "recipes/tiny/llava_sft.yaml", "--backends", "torch", "--repeat", "2", "--set",
            "measure.warmup_steps=1", "--set", "measure.steps=60", "--out", str(out), "--executor", "slurm")
    proc = start_xfw(*args)
    running, ended = (out / "tiny-llava-sft" / f"torch-r{k}" for k in (0, 1))
    ids = [wait_running(running), wait_running(ended)]
    for job_id in ids:
        _scontrol("suspend", job_id)  # both held: the kill below cannot race a job's end
    proc.kill()  # SIGKILL: no chance to cancel; the jobs run on
    proc.communicate()
    _scontrol("resume", ids[1])
    _wait_gone(ids[1])
    rerun = start_xfw(*args)
    lines = []
    try:
        for line in rerun.stdout:
            lines.append(line)
            if f"attached to Slurm job {ids[0]}" in line:
                _scontrol("resume", ids[0])
        rerun.wait(timeout=200)
    finally:
        if rerun.poll() is None:
            rerun.kill()
        subprocess.run(["scancel", *ids], capture_output=True)
    output = "".join(lines)
    assert rerun.returncode == 0, output[-4000:]
    assert f"attached to Slurm job {ids[0]} (suspended)" in output
    assert f"Slurm job {ids[1]} ended while no xfw watched it" in output
    for run, job_id in zip((running, ended), ids):
        assert slurm_record(run)["job_id"] == job_id and slurm_record(run)["state"] == "COMPLETED", output[-3000:]
        assert [p.name for p in run.glob("slurm-*.out")] == [f"slurm-{job_id}.out"]
        assert json.loads((run / "summary.json").read_text())["status"] == "ok"
