"""Multi-process PyTorch runs on CPU (gloo): the same global batch gives the same losses.

Each run goes through xfw's launcher and torchrun exactly as a user's would. Data are seeded
by sample position in the global batch, so 1 process x 4 micro-batches and 2 processes x 2
train on the same samples; DDP averages gradients, so the mean of the ranks' losses must equal
the single process's loss at every step, up to fp32 reduction order. Every sharded run accumulates
two micro-batches per rank (:data:`ACCUM`), so the same runs also show each implementation's
accumulation (DeepSpeed's its own) equal to one process's; the one-micro-batch layout (global 4 in
micro-batches of 2 on two ranks) is run by test_paddle_sharding.py's PyTorch FSDP2 runs and
test_text_only_sharded.py. A process start costs ~15 s of CPU and a tiny step ~0.1 s: runs, not
steps, are what this file is counted in.
"""

import pytest
import yaml

from xfw.run.launch import launcher
from xfw.recipe import load_recipe
from xfw.contract.records import load_records

from conftest import TINY_RECIPE, require_interpreter

pytestmark = pytest.mark.contract
STEPS = {"warmup_steps": 1, "steps": 3, "timeout_s": 240}
ACCUM = {"global": 8, "micro": 2}  # 1 process x 4 micro-batches; 2 processes x 2 each


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
def launched(tmp_path_factory):
    """Runs of TINY_RECIPE at :data:`ACCUM`, each launched once per module, keyed by (sharding, impl);
    ("none", "one") is the one-process run every two-process run is held to."""
    out, done = tmp_path_factory.mktemp("runs"), {}

    def get(sharding: str, impl: str):
        if (sharding, impl) not in done:
            sections = {**TINY_RECIPE, "measure": STEPS, "batch": ACCUM}
            if impl != "one":
                sections.update(parallel={"nproc_per_node": 2, "sharding": sharding},
                                backends={"torch": {"sharding_impl": impl}})
            path = out / f"{sharding}-{impl}.yaml"
            path.write_text(yaml.safe_dump(sections))
            backend = launcher.Backend("torch", str(require_interpreter("torch")))
            done[sharding, impl] = launcher.launch(load_recipe(path), backend, out / f"{sharding}-{impl}",
                                                   description=launcher.describe_backend(backend))
            assert done[sharding, impl].status == "ok", done[sharding, impl].reason
        return done[sharding, impl]
    return get


# Two layouts are run elsewhere, not here (a two-process run costs ~30 CPU s): stage2 fsdp2 (FSDP2 without
# resharding) by test_paddle_sharding.py's "torch-fsdp2-stage2" runs on two ranks, and stage2 deepspeed, whose
# xfw path is stage1's and stage3's (deepspeed_engine: only ZeRO's stage number differs) and whose DeepSpeed
# optimizer is stage1's (ZeRO-1 and ZeRO-2 are one class, runtime/zero/stage_1_and_2.py).
@pytest.mark.parametrize("sharding,impl", [("none", "ddp"), ("stage1", "zero_redundancy"), ("stage3", "fsdp2"),
                                           ("stage1", "deepspeed"), ("stage3", "deepspeed")])
def test_two_processes_match_one_process_for_the_same_global_batch(launched, sharding, impl):
    single, result = launched("none", "one"), launched(sharding, impl)
    assert result.applied["sharding_impl"] == impl and result.applied["num_processes"] == 2
    assert result.applied["grad_accum_steps"] == 2 and single.applied["grad_accum_steps"] == 4
    assert result.applied["num_params_total"] == single.applied["num_params_total"]
    assert result.measurement.num_ranks == 2
    assert mean_losses(result) == pytest.approx(mean_losses(single), rel=1e-5)


def test_deepspeed_accumulates_micro_batches_like_one_process(launched):
    # 2 processes x 2 micro-batches of 2 against 1 process x 4: DeepSpeed owns the accumulation (the
    # parametrized stage-3 run above, launched once).
    one, zero3 = launched("none", "one"), launched("stage3", "deepspeed")
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
