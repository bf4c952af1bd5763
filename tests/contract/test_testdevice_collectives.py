"""The CPU test device's shared-memory collectives called directly, for what Paddle cannot call on a custom
device (docs/testdevice.md): ReduceOp.AVG (Paddle 3.3.1's ProcessGroupCustom takes only sum/max/min/prod,
and ``dist.all_reduce``'s AVG path asks for NCCL's version, so no Paddle code reaches the device's AVG), and
reduce_scatter with it. adapters/paddle/testdevice/check/collectives_check.cc is compiled against
collectives.cc (about 1 s) and run: 2 and 3 forked ranks, fp32 and bf16, all_reduce (sum, avg, max),
reduce, reduce_scatter (sum, avg), all_gather and broadcast, each checked exactly. The sources are
``XFW_TESTDEVICE_SRC``'s when set (benchmarks/testdevice_mutation.py), else the repository's.

And through Paddle (issue 43) on 2 and 3 processes: every collective Paddle reaches (all_reduce sum in fp32 and
bf16, max; reduce; broadcast; all_gather; reduce_scatter) with payloads of 36 MB, over one 32 MiB slot and not
a multiple of it, twice in a row with different payloads (testdevice_worker.py ``collectives_big``), every
element against numpy. A reduction that is right for 2 ranks only, a chunk boundary off by one, or a missing
barrier between consecutive calls (a rank reading a slot its peer has not rewritten yet, or already has)
leaves mismatching elements."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, require_interpreter
from test_testdevice import device_env, run_worker  # noqa: F401  (the fixture is shared)

pytestmark = pytest.mark.contract


def test_collectives_avg_and_reduce_scatter_on_2_and_3_ranks(tmp_path):
    python = require_interpreter("paddle")
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler})")
    src = Path(os.environ.get("XFW_TESTDEVICE_SRC") or ROOT / "adapters" / "paddle" / "testdevice")
    if not src.is_absolute():
        src = ROOT / src
    include = subprocess.run([str(python), "-c", "import importlib.util as u; "
                              "print(u.find_spec('paddle').submodule_search_locations[0])"],
                             capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    binary = tmp_path / "collectives_check"
    built = subprocess.run([compiler, "-std=c++17", "-O1", f"-I{include}/include", f"-I{src}",
                            str(ROOT / "adapters/paddle/testdevice/check/collectives_check.cc"),
                            str(src / "collectives.cc"), "-o", str(binary), "-lrt"],
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-3000:]
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "XFW_TESTCPU_TIMEOUT_S": "30"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.parametrize("nproc", [2, 3])
def test_every_collective_over_one_slot_through_paddle_on_2_and_3_ranks(device_env, tmp_path, nproc):
    ranks = run_worker(device_env, tmp_path, "collectives_big", nproc=nproc)
    for got in ranks:
        assert got["world"] == nproc
        assert len(got["mismatches"]) == 14, sorted(got["mismatches"])  # 7 collectives x 2 calls
        wrong = {k: v for k, v in got["mismatches"].items() if v}
        assert not wrong, f"rank {got['rank']} of {nproc}: mismatching elements per collective and call: {wrong}"
