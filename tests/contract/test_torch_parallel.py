"""Multi-process PyTorch runs on CPU (gloo): the same global batch gives the same losses.

Each run goes through xfw's launcher and torchrun exactly as a user's would. Data are seeded
by sample position in the global batch, so 1 process x 2 micro-batches and 2 processes x 1
train on the same samples; DDP averages gradients, so the mean of the ranks' losses must equal
the single process's loss at every step, up to fp32 reduction order.
"""

import pytest
import yaml

from xfw.run.launch import launcher
from xfw.recipe import load_recipe
from xfw.contract.records import load_records

from conftest import TINY_RECIPE, require_interpreter

pytestmark = pytest.mark.contract
STEPS = {"warmup_steps": 1, "steps": 3, "timeout_s": 240}


def run(write_recipe, tmp_path, name, backend_name="torch", **sections):
    backend = launcher.Backend(backend_name, str(require_interpreter(backend_name)))
    recipe = load_recipe(write_recipe(f"{name}.yaml", **{"measure": STEPS, "batch": {"global": 4, "micro": 2},
                                                         **sections}))
    return launcher.launch(recipe, backend, tmp_path / name, description=launcher.describe_backend(backend))


def mean_losses(result):
    records = [r for r in load_records(f"{result.run_dir}/steps.jsonl") if r["kind"] == "step"]
    steps = sorted({r["step"] for r in records})
    return [sum(r["loss"] for r in records if r["step"] == s) / result.applied["num_processes"] for s in steps]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    path = tmp_path_factory.mktemp("single") / "one.yaml"
    path.write_text(yaml.safe_dump({**TINY_RECIPE, "measure": STEPS, "batch": {"global": 4, "micro": 2}}))
    backend = launcher.Backend("torch", str(require_interpreter("torch")))
    result = launcher.launch(load_recipe(path), backend, path.parent / "run", description=launcher.describe_backend(backend))
    assert result.status == "ok", result.reason
    return result


@pytest.mark.parametrize("sharding,impl", [("none", "ddp"), ("stage1", "zero_redundancy"), ("stage2", "fsdp2"),
                                           ("stage3", "fsdp2"), ("stage1", "deepspeed"), ("stage2", "deepspeed"),
                                           ("stage3", "deepspeed")])
def test_two_processes_match_one_process_for_the_same_global_batch(write_recipe, tmp_path, single, sharding, impl):
    result = run(write_recipe, tmp_path, impl, parallel={"nproc_per_node": 2, "sharding": sharding},
                 backends={"torch": {"sharding_impl": impl}})
    assert result.status == "ok", result.reason
    assert result.applied["sharding_impl"] == impl and result.applied["num_processes"] == 2
    assert result.applied["num_params_total"] == single.applied["num_params_total"]
    assert result.measurement.num_ranks == 2
    assert mean_losses(result) == pytest.approx(mean_losses(single), rel=1e-5)


def test_deepspeed_accumulates_micro_batches_like_one_process(write_recipe, tmp_path):
    # 2 processes x 2 micro-batches of 2 against 1 process x 4: DeepSpeed owns the accumulation.
    batch = {"global": 8, "micro": 2}
    one = run(write_recipe, tmp_path, "one", batch=batch)
    zero3 = run(write_recipe, tmp_path, "zero3", batch=batch, parallel={"nproc_per_node": 2, "sharding": "stage3"},
                backends={"torch": {"sharding_impl": "deepspeed"}})
    assert one.status == zero3.status == "ok", zero3.reason
    assert zero3.applied["grad_accum_steps"] == 2 and "DeepSpeed" in zero3.applied["notes"]
    assert mean_losses(zero3) == pytest.approx(mean_losses(one), rel=1e-5)


def test_fsdp1_on_cpu_is_unsupported_not_a_crash(write_recipe, tmp_path):
    result = run(write_recipe, tmp_path, "fsdp1", parallel={"nproc_per_node": 2, "sharding": "stage2"},
                 backends={"torch": {"sharding_impl": "fsdp1"}})
    assert result.status == "unsupported" and "FSDP1 needs a GPU" in result.reason


def test_a_sharding_implementation_that_does_not_fit_the_stage_is_invalid(write_recipe, tmp_path):
    result = run(write_recipe, tmp_path, "bad", parallel={"nproc_per_node": 2, "sharding": "stage1"},
                 backends={"torch": {"sharding_impl": "fsdp2"}})
    assert result.status == "invalid" and "sharding_impl" in result.reason
