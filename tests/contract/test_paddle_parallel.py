"""Multi-process Paddle runs on CPU (paddle.distributed.launch, gloo): DataParallel and fleet
sharding stage 1 give the single process's losses for the same global batch; stage 2/3 need a GPU
or a custom device in Paddle and say so (on the CPU test device: test_paddle_sharding.py)."""

import pytest
import yaml

from xfw.run.launch import launcher
from xfw.recipe import load_recipe

from conftest import TINY_RECIPE, require_interpreter
from test_torch_parallel import STEPS, mean_losses, run

pytestmark = pytest.mark.contract


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    path = tmp_path_factory.mktemp("single") / "one.yaml"
    path.write_text(yaml.safe_dump({**TINY_RECIPE, "measure": STEPS, "batch": {"global": 4, "micro": 2}}))
    backend = launcher.Backend("paddle", str(require_interpreter("paddle")))
    result = launcher.launch(load_recipe(path), backend, path.parent / "run", description=launcher.describe_backend(backend))
    assert result.status == "ok", result.reason
    return result


# Fleet's stage 1 (fleet_sharding_stage1) against one process, with these assertions, is
# test_paddle_sharding.py::test_fleet_stage1_with_fp32_main_grad_equals_one_process's (LLaVA, master gradients);
# plain fp32 gradients over two processes are the DataParallel case here (issue 44: one launch fewer).
@pytest.mark.parametrize("sharding,impl", [("none", "data_parallel")])
def test_two_processes_match_one_process_for_the_same_global_batch(write_recipe, tmp_path, single, sharding, impl):
    result = run(write_recipe, tmp_path, impl, "paddle", parallel={"nproc_per_node": 2, "sharding": sharding})
    assert result.status == "ok", result.reason
    assert result.applied["sharding_impl"] == impl and result.applied["num_processes"] == 2
    assert result.measurement.num_ranks == 2
    assert mean_losses(result) == pytest.approx(mean_losses(single), rel=1e-5)


def test_group_sharded_stages_are_unsupported_on_cpu_not_a_crash(write_recipe, tmp_path):
    result = run(write_recipe, tmp_path, "stage2", "paddle", parallel={"nproc_per_node": 2, "sharding": "stage2"})
    assert result.status == "unsupported" and "needs a GPU or a custom device" in result.reason
