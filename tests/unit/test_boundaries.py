"""Architecture guards: the core never imports a framework, and the CLI's surface is frozen."""

import re
import subprocess
import sys

from click.testing import CliRunner

from xfw import cli

from conftest import ROOT

FRAMEWORKS = ("torch", "paddle", "paddlenlp", "ppdiffusers", "transformers", "diffusers", "peft",
              "xfw_torch", "xfw_paddle")


def test_importing_the_cli_imports_no_framework():
    code = ("import sys, xfw.cli, xfw.workflow, xfw.launcher, xfw.compare, xfw.render, xfw.plot, xfw.progress, "
            "xfw.sweep, xfw.layouts, xfw.maxbatch, xfw.estimate; "
            f"print([m for m in {FRAMEWORKS!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_core_module_names_a_framework_in_an_import():
    pattern = re.compile(r"^\s*(import|from)\s+(" + "|".join(FRAMEWORKS) + r")\b", re.M)
    offenders = [p.name for p in (ROOT / "xfw").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_the_core_never_branches_on_a_backend_name():
    pattern = re.compile(r"""==\s*["'](torch|paddle)["']""")
    offenders = [p.name for p in (ROOT / "xfw").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_cli_commands_and_options_are_frozen():
    # Changing the CLI breaks users' nightly scripts: update this test deliberately.
    commands = {name: sorted(p.name for p in cmd.params) for name, cmd in cli.main.commands.items()}
    assert commands == {
        "compare": ["backends", "master_addr", "master_port", "node_rank", "out_dir", "overrides", "parity_dirs",
                    "pythons", "recipes", "repeat"],
        "env": ["backends", "pythons"],
        "parity": ["backends", "out_dir", "overrides", "pythons", "recipe", "steps"],
        "estimate": ["overrides", "recipe", "run_dir"],
        "maxbatch": ["backends", "candidates", "max_micro", "out_dir", "overrides", "pythons", "recipe"],
        "nightly": ["history_dir", "night", "only_backends", "overrides", "pythons", "report_only", "suite"],
        "report": ["backends", "layout", "out_dir", "price_per_gpu_hour", "run_dirs"],
        "run": ["backend", "master_addr", "master_port", "node_rank", "out_dir", "overrides", "print_command",
                "pythons", "recipe", "repeat"],
        "sweep": ["axes", "backends", "out_dir", "pythons", "recipe", "repeat"],
        "validate": ["overrides", "print_spec", "recipes"],
    }


def test_help_lists_every_command():
    out = CliRunner().invoke(cli.main, ["--help"]).output
    for name in ("compare", "env", "estimate", "maxbatch", "nightly", "report", "run", "sweep", "validate"):
        assert name in out


def test_test_files_have_unique_names():
    # The test directories are not packages: two files with one basename break collection.
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
