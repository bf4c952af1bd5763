"""Two nodes on one machine (loopback rendezvous), for both backends: each node's xfw runs its own
ranks and says so; one command assembles the whole run from the nodes' directories; on a shared
--out the nodes assemble it themselves. PyTorch's two nodes run twice (a shared --out, a nightly
entry), Paddle's once (separate --outs, then xfw assemble): every test is two nodes' worth of
framework processes (~35 CPU s), so each path runs on one backend."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from xfw.report.nodes import load_runs

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract
TWO_NODES = ["--set", "parallel.nnodes=2", "--set", "parallel.nproc_per_node=1", "--set", "measure.warmup_steps=1",
             "--set", "measure.steps=4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(backend: str, outs: list, port: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-m", "xfw.cli", "run", "recipes/tiny/llava_sft.yaml", "--backend",
                              backend, *TWO_NODES, "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                              "--master-port", str(port), "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for rank, out in enumerate(outs)]


def finish(procs: list[subprocess.Popen]) -> list[str]:
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-8000:]  # the status table and its reasons, not only the notes
    return outputs


# Paddle only: PyTorch's two nodes (torchrun --nnodes 2 --node_rank) run in the two tests below, each asserting
# both ranks' results; what this test adds (each node's part marked as such, xfw assemble) is the core's, the same
# for both backends.
@pytest.mark.parametrize("backend", ["paddle"])
def test_two_nodes_each_report_their_part_and_assemble_gives_both_ranks(backend, tmp_path):
    require_interpreter(backend)
    outs = [tmp_path / "node0", tmp_path / "node1"]
    outputs = finish(start_nodes(backend, outs, free_port()))
    for rank, output in enumerate(outputs):
        assert f"node={rank} of 2 (ranks {rank}-{rank})" in output  # the node's part, marked as such
        assert f"node {rank}'s part only" in output
    done = subprocess.run([sys.executable, "-m", "xfw.cli", "assemble", *map(str, outs), "--out", str(tmp_path / "all")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (run,) = load_runs([tmp_path / "all"])
    assert run.ok and run.node["count"] == 2 and run.measurement.num_ranks == 2
    per_rank = [p["ips"] for p in run.measurement.per_rank]
    assert run.measurement.ips == pytest.approx(sum(per_rank))  # the global throughput: both ranks
    assert "| 0 |" in done.stdout and "| 1 |" in done.stdout  # the per-rank table shows both ranks


def test_two_nodes_on_a_shared_out_assemble_the_run_themselves(tmp_path):
    require_interpreter("torch")
    shared = tmp_path / "shared"
    outputs = finish(start_nodes("torch", [shared, shared], free_port()))
    for output in outputs:
        assert "part only" not in output and "| Tiny LLaVA | SFT |" in output
    (run,) = load_runs([shared])
    assert run.ok and run.measurement.num_ranks == 2 and len(run.node["parts"]) == 2
    assert [p["rank"] for p in run.measurement.per_rank] == [0, 1]  # each node's torchrun gave its rank
    assert run.measurement.ips == pytest.approx(sum(p["ips"] for p in run.measurement.per_rank))


def test_a_nightly_suite_can_name_a_multi_node_entry(tmp_path):
    require_interpreter("torch")
    suite = tmp_path / "suite.yaml"
    suite.write_text(json.dumps({"name": "two-nodes", "backends": ["torch"],
                                 "set": [s for s in TWO_NODES if s != "--set"],
                                 "entries": [str(ROOT / "recipes/tiny/llava_sft.yaml")]}))
    history, port = tmp_path / "history", free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "xfw.cli", "nightly", str(suite), "--history", str(history),
                               "--night", "n1", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                               "--master-port", str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = finish(procs)
    assert "node 0 records the assembled runs" in outputs[1]
    rows = [json.loads(line) for line in (history / "history.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["status"] == "ok" and rows[0]["num_ranks"] == 2
