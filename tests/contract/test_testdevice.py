"""The CPU test device for Paddle (``testcpu``, docs/testdevice.md): it builds from the wheel, Paddle
loads it, its collectives give the right numbers across two processes, in-place ops on views of a
buffer change the buffer (with a negative control showing what a CPU fallback does), bf16 matmul
agrees with numpy, and Paddle's real ``group_sharded_parallel`` stage 2 and stage 3 on two processes
give the one-process losses of the same global batch. The Paddle side runs in
tests/contract/testdevice_worker.py (the Paddle environment has no pytest)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract

WORKER = Path(__file__).with_name("testdevice_worker.py")
BUILD = ROOT / "scripts" / "build_testdevice.sh"
LOSS_TOL = 1e-5


@pytest.fixture(scope="module")
def device_env():
    """Build the plugin (a no-op when up to date) and return the environment that selects it."""
    python = require_interpreter("paddle")
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}): the testcpu plugin cannot be built here")
    built = subprocess.run(["bash", str(BUILD)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    assert built.stdout.startswith("testdevice: "), built.stdout
    # XFW_TESTDEVICE_DIR (with XFW_TESTDEVICE_SRC: benchmarks/testdevice_mutation.py's mutants) as the
    # build script and xfw_paddle.testdevice read it
    plugin_dir = Path(os.environ.get("XFW_TESTDEVICE_DIR") or ROOT / ".venv" / "paddle" / "lib" / "xfw-testdevice")
    assert (plugin_dir / "libxfw_testcpu.so").is_file()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "FLAGS_selected"))}
    # Fresh device memory filled with NaN: a run that reads memory nothing wrote cannot pass.
    env.update(CUSTOM_DEVICE_ROOT=str(plugin_dir), XFW_TESTDEVICE="1", OMP_NUM_THREADS="1", XFW_TESTCPU_FILL="nan")
    return python, env


def run_worker(device_env, out: Path, *args: str, nproc: int = 1) -> list[dict]:
    python, env = device_env
    out.mkdir(parents=True, exist_ok=True)
    if nproc == 1:
        cmd = [str(python), str(WORKER), str(out), *args]
    else:
        cmd = [str(python), "-m", "paddle.distributed.launch", "--log_dir", str(out / "log"),
               "--nproc_per_node", str(nproc), str(WORKER), str(out), *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    logs = "".join(p.read_text()[-2000:] for p in sorted((out / "log").glob("workerlog.*"))) if nproc > 1 else ""
    assert done.returncode == 0, (done.stdout[-2000:] + done.stderr[-3000:] + logs)
    return [json.loads((out / f"{args[0]}.{rank}.json").read_text()) for rank in range(nproc)]


def test_plugin_builds_skips_when_unchanged_and_paddle_loads_it(device_env, tmp_path):
    again = subprocess.run(["bash", str(BUILD)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "up to date" in again.stdout, again.stdout + again.stderr
    python, env = device_env
    code = ("from xfw_paddle import testdevice as t; p = t.activate()\n"
            "x = p.ones([2, 2])\n"
            "with p.amp.auto_cast(level='O1', dtype='bfloat16'): y = p.matmul(x, x)\n"
            "print(p.get_device(), t.is_active(), y.dtype)")
    done = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["testcpu:0", "True", "paddle.bfloat16"], done.stdout


def expected(rank: int) -> np.ndarray:
    return np.arange(8) * (rank + 1) + 3 * rank  # as testdevice_worker.values


def test_collectives_on_two_processes_give_the_right_numbers(device_env, tmp_path):
    ranks = run_worker(device_env, tmp_path, "collectives", nproc=2)
    a, b = expected(0), expected(1)
    for got in ranks:
        rank = got["rank"]
        assert got["world"] == 2 and got["device"] == f"testcpu:{rank}"
        for dtype in ("float32", "bfloat16", "float16", "int32", "int64"):
            r = got[dtype]
            assert r["all_reduce_sum"] == (a + b).tolist(), (dtype, rank)
            assert r["all_reduce_max"] == np.maximum(a, b).tolist(), (dtype, rank)
            assert r["all_reduce_min"] == np.minimum(a, b).tolist(), (dtype, rank)
            prod = (a * b).astype("float32")
            if dtype == "bfloat16":  # products above 256 need more than bf16's 8 bits: compare rounded
                np.testing.assert_allclose(r["all_reduce_prod"], prod, rtol=2**-8)
            elif dtype == "float16":
                np.testing.assert_allclose(r["all_reduce_prod"], prod, rtol=2**-11)
            else:
                assert r["all_reduce_prod"] == prod.tolist(), (dtype, rank)
            if rank == 0:
                assert r["reduce_to_0"] == (a + b).tolist(), dtype
            else:
                assert r["reduce_to_0"] == b.tolist(), dtype  # a non-root keeps its input
            assert r["broadcast_from_1"] == b.tolist(), (dtype, rank)
            assert r["all_gather"] == [a.tolist(), b.tolist()], (dtype, rank)
            assert r["reduce_scatter"] == (a + b)[4 * rank:4 * rank + 4].tolist(), (dtype, rank)
        assert got["big_all_reduce"] == [3.0, 3.0, 27_000_000.0]


def test_in_place_ops_on_a_view_change_the_buffer(device_env, tmp_path):
    [got] = run_worker(device_env, tmp_path, "views")
    want = {"scale_": 3.0, "fill_": 2.0, "zero_": 0.0, "add_": 1.0, "subtract_": -1.0, "multiply_": 6.0,
            "divide_": 3.0, "assign": 7.0, "copy_": 9.0, "adamw_": 0.9}
    for op, value in want.items():
        view, buffer = got[op]["view"], got[op]["buffer"]
        np.testing.assert_allclose(view, [value] * 4, rtol=1e-6, err_msg=op)
        np.testing.assert_allclose(buffer, [0.0] * 4 + [value] * 4 + [0.0] * 4, rtol=1e-6, err_msg=op)
    # Negative control: an op without a native kernel falls back to Paddle's CPU kernel on a copy;
    # the view shows the result and the buffer does not. This is the failure the checks above catch.
    assert got["fresh_memory"] == [1.0], got["fresh_memory"]  # XFW_TESTCPU_FILL=nan: all of it NaN
    control = got["control_int16_scale_"]
    assert control["view"] == [1.0] * 4 and control["buffer"] == [0.0] * 12, control


def bf16(x: np.ndarray) -> np.ndarray:
    """Round fp32 to bf16 (nearest even), as fp32 values."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def test_bf16_matmul_agrees_with_numpy_within_bf16_rounding(device_env, tmp_path):
    [got] = run_worker(device_env, tmp_path, "bf16")
    assert got["dtype"] == "paddle.bfloat16"
    assert got["ties"] == [1.0, 1.015625, -1.0]  # round to nearest, ties to even
    x, y = np.array(got["x_bf16"], dtype=np.float32), np.array(got["y_bf16"], dtype=np.float32)
    assert np.array_equal(bf16(x), x)  # the inputs really are bf16 values
    exact = x @ y
    out = np.array(got["matmul"], dtype=np.float32)
    assert np.array_equal(bf16(out), out)
    np.testing.assert_allclose(out, bf16(exact), rtol=2**-7, atol=1e-2)


def test_each_bf16_kernel_forward_and_backward_agrees_with_fp32(device_env, tmp_path):
    """Each bf16 op the tiny models run (matmul, activations, norms, conv2d/3d, masks, ...), its output
    and every input gradient, against fp32 on the same bf16 inputs: within a few bf16 roundings."""
    [got] = run_worker(device_env, tmp_path, "bf16_ops")
    ops = [k for k in got if not k.endswith(":dtype")]
    assert len(ops) >= 19
    for op in ops:
        assert got[op + ":dtype"] == "paddle.bfloat16", op
        assert max(got[op]) < 2e-2, (op, got[op])  # relative to the largest fp32 magnitude; bf16 eps 2**-8


def test_native_fp32_kernels_train_like_paddles_own_cpu_kernels(device_env, tmp_path):
    """The one-process reference below runs on the device's kernels; this ties them to Paddle's."""
    [got] = run_worker(device_env, tmp_path, "against_cpu")
    np.testing.assert_allclose(got["testcpu"]["losses"], got["cpu"]["losses"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["testcpu"]["weight"], got["cpu"]["weight"], rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def one_process(device_env, tmp_path_factory):
    [got] = run_worker(device_env, tmp_path_factory.mktemp("mlp1"), "mlp", "none")
    assert got["world"] == 1
    return got


@pytest.mark.parametrize("level", ["os_g", "p_g_os"])
def test_group_sharded_stage_2_and_3_on_two_processes_equal_one_process(device_env, tmp_path, one_process, level):
    """Losses and the global norm of the gradients the optimizer applies, every step, to 1e-5 (fp32; only
    the reduction order differs, measured ~1e-7): gradients summed instead of averaged double the norm
    (AdamW and the clip would hide it in the loss). Stage 3 with both weight matrices sliced (segment_size
    64), so a rank that used stale or wrong gathered parameters changes its loss from step 2 on."""
    ranks = run_worker(device_env, tmp_path, "mlp", level, nproc=2)
    for got in ranks:
        assert got["world"] == 2
        assert got["sliced"] == (2 if level == "p_g_os" else 0), got["sliced"]
        np.testing.assert_allclose(got["losses"], one_process["losses"], atol=LOSS_TOL, rtol=0)
        np.testing.assert_allclose(got["norms"], one_process["norms"], rtol=LOSS_TOL, atol=0)
    assert one_process["losses"][-1] < one_process["losses"][0]  # it trains
    assert min(one_process["norms"]) > 1.0  # the clip acts every step (the norm is the one before clipping)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
