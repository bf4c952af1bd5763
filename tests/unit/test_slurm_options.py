"""The Slurm executor's pure decisions (xfw.run.launch.slurm): which runs share one job (an A/B's alternated
pairs), the time such a job asks for, and the options a suite file's ``slurm:`` section gives. The real
cluster is exercised in tests/contract/test_slurm.py."""

from __future__ import annotations

from pathlib import Path

from xfw.recipe.load import load_recipe
from xfw.run.launch import jobs, slurm

from conftest import ROOT

RECIPE = ROOT / "recipes" / "tiny" / "llava_sft.yaml"


def test_an_ab_is_one_slurm_job_in_its_alternated_order_and_other_runs_one_job_each(tmp_path):
    recipe = load_recipe(RECIPE, ["measure.repeat=3"])
    ab = jobs.jobs_for(recipe, ["torch@a", "torch"], tmp_path, ("r",), alternate=True)
    assert slurm.units_of(ab) == [[0, 1, 2, 3, 4, 5]]
    assert [j.run_dir.name for j in ab] == ["torch@a-r0", "torch-r0", "torch-r1", "torch@a-r1", "torch@a-r2",
                                           "torch-r2"]
    assert slurm.job_dir([ab[i] for i in range(6)]) == (tmp_path / "r").resolve()
    plain = jobs.jobs_for(recipe, ["torch@a", "torch"], tmp_path, ("r",))
    assert slurm.units_of(plain) == [[i] for i in range(6)]
    two = ab + jobs.jobs_for(recipe, ["torch@a", "torch"], tmp_path, ("s",), alternate=True)
    assert slurm.units_of(two) == [list(range(6)), list(range(6, 12))]


def test_a_job_of_several_runs_asks_for_each_runs_timeout():
    recipe = load_recipe(RECIPE, ["measure.timeout_s=600"])
    assert "--time=12" in slurm.sbatch_argv(slurm.SlurmOptions(), recipe, "x", Path("/o"))
    assert "--time=62" in slurm.sbatch_argv(slurm.SlurmOptions(), recipe, "x", Path("/o"), runs=6)
    assert "--time=30" in slurm.sbatch_argv(slurm.SlurmOptions(time_min=30), recipe, "x", Path("/o"), runs=6)


def test_a_node_type_constraint_is_passed_to_sbatch():
    recipe = load_recipe(RECIPE)
    argv = slurm.sbatch_argv(slurm.SlurmOptions(constraint="h800&ib"), recipe, "x", Path("/o"))
    assert "--constraint=h800&ib" in argv and argv[-1] == "/o/slurm-job.sh"
    assert not any(a.startswith("--constraint") for a in slurm.sbatch_argv(slurm.SlurmOptions(), recipe, "x", Path("/o")))


def test_detach_without_the_slurm_executor_is_one_line_exit_2(tmp_path):
    from click.testing import CliRunner

    from xfw import cli

    done = CliRunner().invoke(cli.main, ["compare", str(RECIPE), "--out", str(tmp_path / "o"), "--detach"])
    assert done.exit_code == 2 and done.output.strip().splitlines()[-1] == \
        "error: --detach: only with --executor slurm (a local run has nothing to leave running)"
    assert not (tmp_path / "o").exists()


def test_a_suites_slurm_section_gives_the_executor_options():
    from xfw.run.commands.suite import slurm_section

    assert slurm_section(None, "s.yaml") == {}
    assert slurm_section({"executor": "slurm", "partition": "h800", "account": "bench", "qos": "high", "time": 90,
                          "gpus_per_node": 8, "cpus_per_task": 16, "exclusive": False, "max_queued": 4,
                          "sbatch_args": ["--constraint=h800"], "constraint": "ib"}, "s.yaml") == {
        "executor": "slurm", "partition": "h800", "account": "bench", "qos": "high", "time_min": 90,
        "gpus_per_node": 8, "cpus_per_task": 16, "exclusive": False, "max_queued": 4,
        "sbatch_args": ("--constraint=h800",), "constraint": "ib"}


def test_a_bad_slurm_value_in_a_suite_is_one_line_naming_the_file_and_key():
    import pytest

    from xfw.run.commands.suite import SuiteError, slurm_section

    for data, key in (({"executor": "pbs"}, "slurm.executor: local or slurm"), ({"time": 0}, "slurm.time: a whole"),
                      ({"time": "90"}, "slurm.time: a whole"), ({"gpus_per_node": True}, "slurm.gpus_per_node: a whole"),
                      ({"exclusive": "yes"}, "slurm.exclusive: true or false"), ({"partition": ""}, "slurm.partition: "),
                      ({"sbatch_args": "--x"}, "slurm.sbatch_args: a list"), ({"nodes": 2}, "slurm.nodes: unknown key"),
                      ([1], "slurm: a mapping")):
        with pytest.raises(SuiteError) as err:
            slurm_section(data, "suites/x.yaml")
        assert str(err.value).startswith(f"suites/x.yaml: {key}") and "\n" not in str(err.value)


def test_the_command_line_overrides_a_suites_slurm_section(tmp_path):
    """The suite says slurm (so, with no Slurm here, the night stops before anything runs); --executor local
    on the command line overrides it (here shown by --detach, which only a Slurm night takes); a bad value is
    the nightly's one line, exit 2."""
    from click.testing import CliRunner

    from xfw import cli

    suite = tmp_path / "s.yaml"
    suite.write_text((ROOT / "suites" / "cpu_smoke.yaml").read_text().replace(
        "entries:", "slurm: {executor: slurm, partition: nowhere}\nentries:", 1))
    runner, history = CliRunner(), str(tmp_path / "h")
    no_slurm = {"PATH": str(tmp_path)}
    done = runner.invoke(cli.main, ["nightly", str(suite), "--history", history], env=no_slurm)
    assert done.exit_code == 2 and "error: --executor slurm: no sbatch" in done.output
    done = runner.invoke(cli.main, ["nightly", str(suite), "--history", history, "--executor", "local", "--detach"])
    assert done.exit_code == 2 and "error: --detach: only with --executor slurm" in done.output
    suite.write_text(suite.read_text().replace("partition: nowhere", "time: -3"))
    done = runner.invoke(cli.main, ["nightly", str(suite), "--history", history])
    assert done.exit_code == 2 and done.output.strip().splitlines()[-1] == \
        f"error: {suite}: slurm.time: a whole number >= 1 (minutes), got -3"
    assert not (tmp_path / "h").exists()
