"""Commands xfw did not write, measured under its probe with the real frameworks on CPU.

The Trainer and hand-written-loop scripts are examples/attach/ (none imports xfw); the ones that
fail in each way a command can fail are written here, in plain PyTorch or Paddle.
"""

from __future__ import annotations

import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from xfw.contract.records import read_records
from xfw.run.launch import launcher
from xfw.recipe import load_recipe
from xfw.workflow import prepare_backends

from conftest import ROOT, TINY_RECIPE, require_interpreter

pytestmark = pytest.mark.contract
QUICK = ("--set", "measure.warmup_steps=1", "--set", "measure.steps=2")  # a warm-up and a measured window of two


def xfw(*args, timeout=600):
    python = require_interpreter("torch")
    require_interpreter("paddle")
    return subprocess.run([str(python), "-m", "xfw.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def table_row(stdout: str) -> list[str]:
    row = next(line for line in stdout.splitlines() if line.startswith("| Tiny LLaVA"))
    return [c.strip() for c in row.strip("|").split("|")]


def settings(stdout: str) -> dict[str, list[str]]:
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and line.count("|") == 5]
    return {cells[0]: cells[1:3] for cells in ([c.strip() for c in r.strip("|").split("|")] for r in rows)}


def test_the_example_scripts_do_not_import_xfw():
    for path in (ROOT / "examples" / "attach").glob("*.py"):
        assert not re.search(r"^\s*(import|from)\s+xfw", path.read_text(), re.M), path


@pytest.mark.parametrize("recipe, boundary", [("attach_trainer", "trainer callback"),
                                              ("attach_loop", "optimizer step")])
def test_compare_measures_a_paddle_and_a_torch_command_like_its_own_adapters(tmp_path, recipe, boundary):
    out = tmp_path / "out"
    result = xfw("compare", f"recipes/tiny/{recipe}.yaml", "--backends", "paddle,torch", "--out", out, *QUICK)
    assert result.returncode == 0, result.stderr[-3000:]
    cells = table_row(result.stdout)
    assert float(cells[2].split(" (")[0].replace(",", "")) > 0 and float(cells[4].split(" (")[0].replace(",", "")) > 0
    assert cells[-1] == "190,656 / 190,656 (trainable 154,048 / 154,048) ✓"  # the preset's network on both sides
    # The shared CPU measure: a whole process's peak, never under training memory's header or name
    assert all(" MiB whole-process peak RSS (start-up included, not training memory" in c for c in cells[5:7])
    seen = settings(result.stdout)
    assert seen["micro_batch"] == ["4", "4"] and seen["grad_accum_steps"] == ["2", "2"]
    assert seen["step_boundary"] == [boundary, boundary] and seen["num_processes"] == ["1", "1"]
    assert seen["framework_version"][0].startswith("3.") and "+cpu" in seen["framework_version"][1]
    name = f"tiny-llava-{recipe.replace('_', '-')}"
    for backend in ("paddle", "torch"):
        run_dir = out / name / backend
        records, problem = read_records(run_dir / "steps.jsonl")
        assert problem == ""
        steps = [r for r in records if r["kind"] == "step"]
        assert [r["phase"] for r in steps] == ["warmup"] + ["measure"] * 2
        assert all(r["samples"] == 8 and r["tokens"] == 8 * 64 for r in steps[1:])
        assert "ending the command" in (run_dir / "stderr.log").read_text()


FAILING = """
    import sys, time
    import torch

    behave, steps = sys.argv[1], int(sys.argv[2])
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1 and behave == "crash":
            raise RuntimeError("boom at step 2")
        if step == 1 and behave == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if step == 1 and behave == "hang":
            time.sleep(600)
        if step == 1 and behave == "exit":
            sys.exit(3)
"""


def run_script(tmp_path: Path, backend: str, code: str, args: list[str], *, timeout_s: float = 120,
               nproc: int = 1, launcher_args: tuple = ()) -> launcher.RunResult:
    python = require_interpreter(backend)
    (tmp_path / "script.py").write_text(textwrap.dedent(code))
    data = {**TINY_RECIPE, "parallel": {"nproc_per_node": nproc}, "batch": {"global": 4 * nproc, "micro": 4},
            "measure": {"warmup_steps": 1, "steps": 3, "timeout_s": timeout_s, "cpu_threads": 1},
            "backends": {backend: {"command": [str(python), *launcher_args, "script.py", *args]}}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(data))
    recipe = load_recipe(tmp_path / "recipe.yaml")
    backend_obj, description = prepare_backends([backend], {}, [recipe])[backend]
    return launcher.launch(recipe, backend_obj, tmp_path / "out" / backend, description=description)


HANG_S = 12  # the hanging command's limit: its test waits this long (the others end at their step 2 well inside 20 s)


@pytest.mark.parametrize("behave, status, reason", [
    ("crash", "crashed", "RuntimeError: boom at step 2"),
    ("oom", "oom", "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    ("hang", "timeout", f"exceeded measure.timeout_s = {HANG_S} s"),
    ("early", "invalid", "the command ended after 2 optimizer step(s); the recipe measures 1 warm-up + 3 steps"),
    ("exit", "crashed", "(exit code 3; the command ended after 2 optimizer step(s))"),
])
def test_a_command_that_fails_gets_its_own_status_in_one_line(tmp_path, behave, status, reason):
    result = run_script(tmp_path, "torch", FAILING, [behave, "2" if behave == "early" else "100"],
                        timeout_s=HANG_S if behave == "hang" else 20)
    assert result.status == status and reason in result.reason, result.reason
    assert "\n" not in result.reason


def test_a_paddle_script_that_crashes_is_recorded_by_its_probe(tmp_path):
    code = """
        import paddle
        model = paddle.nn.Linear(8, 1)
        optimizer = paddle.optimizer.AdamW(learning_rate=0.1, parameters=model.parameters())
        for step in range(100):
            model(paddle.randn([4, 8])).pow(2).mean().backward()
            optimizer.step()
            optimizer.clear_grad()
            if step == 1:
                raise ValueError("bad batch at step 2")
    """
    result = run_script(tmp_path, "paddle", code, [])
    assert result.status == "crashed" and result.reason == "ValueError: bad batch at step 2"
    records, _ = read_records(Path(result.run_dir) / "steps.jsonl")
    assert [r["kind"] for r in records] == ["start", "step", "step", "error"]


DDP_LOOP = """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(800, 8), torch.randn(800, 1))
    sampler = torch.utils.data.distributed.DistributedSampler(data)
    for x, y in torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler):
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
"""


def test_a_torchrun_command_is_recorded_per_rank(tmp_path):
    result = run_script(tmp_path, "torch", DDP_LOOP, [], nproc=2, timeout_s=240,
                        launcher_args=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"))
    assert result.status == "ok", result.reason
    assert result.measurement.num_ranks == 2 and result.measurement.ips > 0
    assert result.applied["num_processes"] == 2 and result.applied["sharding_impl"] == "ddp"
    assert result.applied["num_params_total"] == 8 * 16 + 16 + 16 + 1
    records, _ = read_records(Path(result.run_dir) / "steps.jsonl")
    assert sorted(r["rank"] for r in records if r["kind"] == "end") == [0, 1]


PADDLE_DP_LOOP = """
    import paddle
    import paddle.distributed as dist

    dist.init_parallel_env()
    model = paddle.DataParallel(paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.Linear(16, 1)))
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    data = paddle.io.TensorDataset([paddle.randn([800, 8]), paddle.randn([800, 1])])
    sampler = paddle.io.DistributedBatchSampler(data, batch_size=4)
    for x, y in paddle.io.DataLoader(data, batch_sampler=sampler):
        paddle.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.clear_grad()
"""


def test_a_paddle_distributed_launch_command_is_recorded_per_rank(tmp_path):
    result = run_script(tmp_path, "paddle", PADDLE_DP_LOOP, [], nproc=2, timeout_s=240,
                        launcher_args=("-m", "paddle.distributed.launch", "--nproc_per_node", "2",
                                       "--log_dir", str(tmp_path / "launch_log")))
    assert result.status == "ok", result.reason
    assert result.measurement.num_ranks == 2 and result.measurement.ips > 0
    assert result.applied["num_processes"] == 2 and result.applied["sharding_impl"] == "data_parallel"
    assert result.applied["num_params_total"] == 8 * 16 + 16 + 16 + 1
    records, _ = read_records(Path(result.run_dir) / "steps.jsonl")
    assert sorted(r["rank"] for r in records if r["kind"] == "end") == [0, 1]
