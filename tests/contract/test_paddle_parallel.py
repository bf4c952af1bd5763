"""Multi-process Paddle runs on plain CPU (paddle.distributed.launch, gloo): stage 2/3 need a GPU or a custom
device in Paddle and say so (on the CPU test device: test_paddle_sharding.py).

DataParallel and fleet sharding stage 1 giving the single process's losses for the same global batch are
test_paddle_sharding.py's (issue 44: they share one one-process run there, ``cpu-one``):
``test_data_parallel_with_plain_fp32_grads_equals_one_process`` (plain fp32 gradients, the DataParallel case
this file ran with a one-process run of its own), ``test_data_parallel_with_fp32_main_grad_equals_one_process_and_pytorch``
and ``test_fleet_stage1_with_fp32_main_grad_equals_one_process``."""

import pytest

from test_torch_parallel import run

pytestmark = pytest.mark.contract


def test_group_sharded_stages_are_unsupported_on_cpu_not_a_crash(write_recipe, tmp_path):
    result = run(write_recipe, tmp_path, "stage2", "paddle", parallel={"nproc_per_node": 2, "sharding": "stage2"})
    assert result.status == "unsupported" and "needs a GPU or a custom device" in result.reason
