"""The pure parts of the Slurm executor (xfw.run.launch.slurm): the sbatch line and the checks made before
anything is submitted. The real cluster is exercised in tests/contract/test_slurm.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from xfw.recipe.load import load_recipe
from xfw.run.launch import slurm

from conftest import ROOT

RECIPE = ROOT / "recipes" / "tiny" / "llava_sft.yaml"


def test_sbatch_line_defaults_to_exclusive_no_requeue_and_the_recipes_timeout_plus_a_margin():
    recipe = load_recipe(RECIPE, ["measure.timeout_s=600"])
    argv = slurm.sbatch_argv(slurm.SlurmOptions(partition="h800", account="bench"), recipe, "r / torch", Path("/o/r"))
    assert argv[0] == "sbatch" and argv[-1] == "/o/r/slurm-job.sh"
    assert "--time=12" in argv and "--exclusive" in argv and "--no-requeue" in argv and "--nodes=1" in argv
    assert "--partition=h800" in argv and "--account=bench" in argv and not any(a.startswith("--qos") for a in argv)
    assert "--output=/o/r/slurm-%j.out" in argv


def test_sbatch_line_takes_the_users_time_shared_gpus_and_extra_arguments():
    recipe = load_recipe(RECIPE, ["parallel.nnodes=2"])
    options = slurm.SlurmOptions(time_min=30, exclusive=False, gpus_per_node=8, sbatch_args=("--constraint=h800",))
    argv = slurm.sbatch_argv(options, recipe, "x", Path("/o"))
    assert "--time=30" in argv and "--exclusive" not in argv and "--gpus-per-node=8" in argv
    assert "--nodes=2" in argv and argv[-2] == "--constraint=h800"


def test_a_time_limit_below_the_recipes_timeout_and_too_many_nodes_are_refused():
    recipe = load_recipe(RECIPE, ["measure.timeout_s=600"])
    partition = {"name": "debug", "nodes": 2}
    slurm.check_jobs(slurm.SlurmOptions(time_min=10), partition, [recipe])  # 600 s fits 10 minutes
    with pytest.raises(slurm.SlurmError, match=r"^--time: 9 min is below .*timeout_s \(600 s\)"):
        slurm.check_jobs(slurm.SlurmOptions(time_min=9), partition, [recipe])
    big = load_recipe(RECIPE, ["parallel.nnodes=3", "batch.global=12"])
    with pytest.raises(slurm.SlurmError, match=r"^--partition: debug has 2 node\(s\); .*nnodes=3"):
        slurm.check_jobs(slurm.SlurmOptions(), partition, [big])


def test_every_unfinished_slurm_state_is_recorded_as_a_failure_never_as_ok():
    assert slurm.ENDED_AS["CANCELLED"][1] == "cut off" and slurm.ENDED_AS["TIMEOUT"] == ("timeout", "timeout")
    assert slurm.ENDED_AS["NODE_FAIL"] == ("crashed", "node failed")
    assert all(status != "ok" for status, _ in slurm.ENDED_AS.values())
