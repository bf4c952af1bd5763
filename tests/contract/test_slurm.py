"""xfw under a real Slurm 22.05 (scripts/setup_slurm.sh: slurmctld and two slurmd on loopback, n1 and n2):
jobs are submitted through the real sbatch/squeue/scancel, no mocked scheduler. A detached two-entry nightly
whose suite has a slurm: section (its report job writes the report), a two-node recipe, a job scancelled
mid-run, a slurmd killed under another and a third past its time limit (one command), and xfw killed and
rerun (it attaches; nothing runs twice)."""

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
SHORT = ["--set", "measure.warmup_steps=1", "--set", "measure.steps=2"]
# one host thread per adapter: three of them run on for a minute or more on 2 cores
LONG = ["--set", "measure.warmup_steps=1", "--set", "measure.steps=5000", "--set", "measure.timeout_s=300",
        "--set", "measure.cpu_threads=1"]


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


def _scontrol_update(job_id: str, setting: str) -> None:
    subprocess.run(["scontrol", "update", f"JobId={job_id}", setting], check=True, capture_output=True, timeout=30)


def _wait_gone(job_id: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, f"Slurm job {job_id} still queued"
        time.sleep(0.5)


def test_a_detached_nightly_from_its_suites_slurm_section_returns_at_once_and_its_report_job_reports(cluster,
                                                                                                   tmp_path):
    """A two-entry suite whose slurm: section chooses the executor, partition, time and shared nodes (the
    command line's --time wins over the suite's), run with --detach: two jobs and a report job after them
    (afterany) submitted, xfw returns; the report job (the same command without --detach) writes the night's
    history and report from the two runs."""
    recipe = ROOT / "recipes" / "tiny" / "llava_sft.yaml"
    suite = tmp_path / "two.yaml"
    suite.write_text("name: slurm-two\nbackends: [torch]\nset: [measure.warmup_steps=1, measure.steps=2]\n"
                     "slurm: {executor: slurm, partition: debug, time: 5, exclusive: false}\n"
                     f"entries:\n  - {{recipe: {recipe}, label: a}}\n  - {{recipe: {recipe}, label: b}}\n")
    history = tmp_path / "h"
    started = time.monotonic()
    done = xfw("nightly", str(suite), "--history", str(history), "--time", "6", "--detach")
    assert done.returncode == 0, done.stderr[-4000:]
    assert time.monotonic() - started < 60 and not (history / "history.jsonl").exists()
    said = [line for line in done.stderr.splitlines() if line.startswith("detached: Slurm job(s) ")]
    assert said, done.stderr[-3000:]
    ids, report_id = said[0].split("job(s) ")[1].split(" submitted")[0].split(), said[0].split("report job ")[1].split()[0]
    assert len(ids) == 2 and f"to attach or report before then: xfw nightly {suite}" in done.stderr
    assert "--detach" not in done.stderr.split("to attach or report before then:")[1]
    _wait_gone(report_id, timeout=300)
    (report_log,) = [p.read_text() for p in history.rglob(f"slurm-report-{report_id}.out")]
    records = {p.parent.parent.name: json.loads(p.read_text()) for p in history.rglob("slurm.json")}
    assert sorted(records) == ["a", "b"] and sorted(r["job_id"] for r in records.values()) == sorted(ids)
    for record in records.values():
        assert "--time=6" in record["sbatch"] and "--partition=debug" in record["sbatch"]
        assert "--exclusive" not in record["sbatch"]
    for summary in history.rglob("summary.json"):
        assert json.loads(summary.read_text())["status"] == "ok", report_log[-3000:]
    nights = [json.loads(line) for line in (history / "history.jsonl").read_text().splitlines()]
    assert {row["entry"] for row in nights} == {"a", "b"}, report_log[-3000:]
    assert (history / "report.html").exists()


def test_bad_slurm_input_is_one_line_exit_2_and_nothing_submitted(cluster, tmp_path):
    from click.testing import CliRunner  # in this process: one start-up for every case

    from xfw import cli

    runner, recipe = CliRunner(), str(ROOT / "recipes" / "tiny" / "llava_sft.yaml")
    for extra, key in ((["--partition", "no-such-partition"], "--partition"),
                       (["--time", "1", "--set", "measure.timeout_s=600"], "--time"),
                       (["--set", "parallel.nnodes=3", "--set", "batch.global=12", "--master-port", "29123"],
                        "--partition")):
        done = runner.invoke(cli.main, ["compare", recipe, "--backends", "torch", "--out", str(tmp_path / "bad"),
                                        "--executor", "slurm", *extra])
        assert done.exit_code == 2, done.output
        assert done.output.strip().splitlines()[-1].startswith(f"error: {key}"), done.output
    done = runner.invoke(cli.main, ["compare", recipe, "--out", str(tmp_path / "bad"), "--executor", "slurm"],
                         env={"PATH": str(tmp_path)})
    assert done.exit_code == 2 and "--executor slurm: no sbatch" in done.output
    queued = subprocess.run(["squeue", "-h", "-o", "%o"], capture_output=True, text=True).stdout  # others' jobs may run
    assert str(tmp_path) not in queued and not list(tmp_path.rglob("slurm*"))


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


def _suspend(job_id: str, run_dir: Path, timeout: float = 30) -> None:
    """``scontrol suspend``, returning once slurmd has stopped the job (the adapter, or the job's script over it:
    here it stops the script): slurmctld answers at once and slurmd stops the processes later, so a resume sent
    10 ms after (xfw killed in between) was applied first and the suspend after it, leaving the job stopped for
    good (a full run here, job 356, queued 240 s after its resume)."""
    _scontrol("suspend", job_id)
    pid = _adapter_pid(run_dir)
    deadline = time.monotonic() + timeout
    while not any(state == "T" for state in _states_up_from(pid)):  # the adapter or the job's script over it
        assert time.monotonic() < deadline, f"Slurm job {job_id}: none of its processes was stopped"
        time.sleep(0.1)


def _adapter_pid(run_dir: Path) -> int:
    """The adapter's pid, from the ``adapter.json`` the launcher writes while it runs."""
    return int(json.loads((run_dir / "adapter.json").read_text())["process"].split(":")[0])


def _states_up_from(pid: int) -> list[str]:
    """The state letter (``T``: stopped) of ``pid`` and of each process above it, up to slurmstepd."""
    states = []
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if name.startswith("slurmstepd"):
            break
        states.append(rest[0])
        pid = int(rest[1])
    return states


def _signal_adapter(run_dir: Path, signum: int) -> None:
    """SIGSTOP: an adapter whose job's fate Slurm decides (slurmctld's NODE_FAIL for a dead slurmd, the time
    limit's TIMEOUT) computes nothing while it waits for it; SIGKILL: the one a dead slurmd no longer watches
    ends with the test, not minutes later."""
    try:
        os.killpg(_adapter_pid(run_dir), signum)
    except (OSError, ValueError, KeyError):
        pass


def test_a_scancelled_job_a_killed_slurmd_and_a_time_limit_are_each_recorded_with_slurms_reason(cluster, tmp_path):
    """One command, three jobs: the first two start (one per node), the third waits. The first is scancelled
    mid-run (the third starts in its place, its time limit cut to Slurm's smallest, one minute, while it
    waited), the second's slurmd is killed. Each is recorded with Slurm's own state and reason, none as a
    finished run, and none loses another's result. (sbatch's --time itself: tests/unit/test_slurm_args.py.)"""
    out = tmp_path / "faults"
    proc = start_xfw("compare", "recipes/tiny/llava_sft.yaml", "--backends", "torch", "--repeat", "3", *LONG,
                     "--out", str(out), "--executor", "slurm")
    cancelled, failed, late = (out / "tiny-llava-sft" / f"torch-r{k}" for k in (0, 1, 2))
    try:
        job_id = wait_running(cancelled)
        wait_running(failed)
        deadline = time.monotonic() + 60
        while not (late / "slurm.json").exists():
            assert time.monotonic() < deadline, "the third job was not submitted"
            time.sleep(0.3)
        _scontrol_update(slurm_record(late)["job_id"], "TimeLimit=1")
        node = json.loads((failed / "env.json").read_text())["slurm"]["node"]
        os.kill(int((SLURM_DIR / "run" / f"slurmd-{node}.pid").read_text()), signal.SIGKILL)
        _signal_adapter(failed, signal.SIGSTOP)
        subprocess.run(["scancel", job_id], check=True)
        wait_running(late)  # it started in the cancelled job's place and measures; then it is held till its limit:
        _signal_adapter(late, signal.SIGSTOP)  # Slurm's SIGCONT, SIGTERM (KillWait: SIGKILL) still end it
        output = proc.communicate(timeout=300)[0]
        summary = json.loads((cancelled / "summary.json").read_text())
        assert summary["status"] == "crashed" and "cut off" in summary["reason"] and \
            "CANCELLED" in summary["reason"], output
        assert slurm_record(cancelled)["state"] == "CANCELLED"
        summary = json.loads((failed / "summary.json").read_text())
        assert summary["status"] == "crashed" and summary["reason"].startswith("node failed"), output
        assert slurm_record(failed)["state"] == "NODE_FAIL"
        summary = json.loads((late / "summary.json").read_text())
        assert summary["status"] == "timeout" and "TIMEOUT (TimeLimit)" in summary["reason"], output
        assert slurm_record(late)["state"] == "TIMEOUT" and summary["measurement"]["num_measured_steps"] > 0
        assert (out / "report.md").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        for run in (failed, late):
            _signal_adapter(run, signal.SIGKILL)
        subprocess.run([str(SETUP)], check=True, timeout=120)  # the node back (slurmd restarted, RESUME)


def test_xfw_killed_and_rerun_attaches_to_its_job_and_runs_nothing_twice(cluster, tmp_path):
    """xfw killed (SIGKILL) with two jobs in flight: one is still running when xfw runs again (it is held
    suspended until the rerun says it attached), the other ended while no xfw watched. The rerun attaches to
    the first, collects the second, and submits nothing."""
    out = tmp_path / "attach"
    args = ("compare", "recipes/tiny/llava_sft.yaml", "--backends", "torch", "--repeat", "2", "--set",
            "measure.warmup_steps=1", "--set", "measure.steps=40", "--out", str(out), "--executor", "slurm")
    proc = start_xfw(*args)
    running, ended = (out / "tiny-llava-sft" / f"torch-r{k}" for k in (0, 1))
    ids, rerun, lines = [], None, []
    try:  # whatever fails, no job of this test is left suspended on a node (it would hold the next test's job)
        for run in (running, ended):  # each held as soon as it runs: the kill below cannot race a job's end
            ids.append(wait_running(run))
            _suspend(ids[-1], run)
        proc.kill()  # SIGKILL: no chance to cancel; the jobs run on
        proc.communicate()
        _scontrol("resume", ids[1])
        _wait_gone(ids[1], timeout=240)  # 40 steps and its xfw's start on a loaded machine
        rerun = start_xfw(*args)
        for line in rerun.stdout:
            lines.append(line)
            if f"attached to Slurm job {ids[0]}" in line:
                _scontrol("resume", ids[0])
        rerun.wait(timeout=200)
    finally:
        for started in (proc, rerun):
            if started is not None and started.poll() is None:
                started.kill()
        subprocess.run(["scancel", *ids], capture_output=True)
    output = "".join(lines)
    assert rerun.returncode == 0, output[-4000:]
    assert f"attached to Slurm job {ids[0]} (suspended)" in output
    assert f"Slurm job {ids[1]} ended while no xfw watched it" in output
    for run, job_id in zip((running, ended), ids):
        assert slurm_record(run)["job_id"] == job_id and slurm_record(run)["state"] == "COMPLETED", output[-3000:]
        assert [p.name for p in run.glob("slurm-*.out")] == [f"slurm-{job_id}.out"]
        assert json.loads((run / "summary.json").read_text())["status"] == "ok"
