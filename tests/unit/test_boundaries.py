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
    code = ("import sys, pkgutil, importlib, xfw; "
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages(xfw.__path__, 'xfw.')]; "
            f"print([m for m in {FRAMEWORKS!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_core_module_names_a_framework_in_an_import():
    pattern = re.compile(r"^\s*(import|from)\s+(" + "|".join(FRAMEWORKS) + r")\b", re.M)
    offenders = [p.name for p in (ROOT / "xfw").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


# The layers, lowest first. A module may import its own layer and the layers below it, never above.
# xfw.recipe shares xfw.run's layer (it reads a command's log pattern, run/ reads recipes); inside one layer the
# direction is held by tests/unit/test_import_graph.py (no circle).
LAYERS = ("contract", "report", "run", "app")
SAME_LAYER = {"recipe": "run"}


def _layer(module: str) -> str:
    parts = module.split(".")
    name = SAME_LAYER.get(parts[1], parts[1]) if len(parts) > 1 else ""
    return name if len(parts) > 2 and name in LAYERS else "app"  # xfw.cli, xfw.workflow


def _xfw_imports(path) -> set[str]:
    """Every xfw module a file imports, at top level or inside a function."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("xfw"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("xfw"))
    return {m for m in found if m.split(".")[0] == "xfw"}


def test_imports_only_go_down_the_layers():
    offenders = []
    for path in (ROOT / "xfw").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        own = LAYERS.index(_layer(module))
        offenders += [f"{module} -> {m}" for m in _xfw_imports(path)
                      if m.count(".") >= 1 and LAYERS.index(_layer(m)) > own and m not in ("xfw.contract", "xfw.run", "xfw.report", "xfw.recipe")]
    assert offenders == []


def test_adapters_import_only_the_contract():
    offenders = []
    for path in (ROOT / "adapters").rglob("*.py"):
        offenders += [f"{path.relative_to(ROOT)} -> {m}" for m in _xfw_imports(path)
                      if m != "xfw" and not m.startswith("xfw.contract") and not m.startswith("xfw_")]
    assert offenders == []


def test_the_contract_imports_nothing_the_adapters_lack():
    # Adapters run beside their framework with numpy + PyYAML only (the Paddle stack pins numpy<=1.26).
    code = ("import sys, pkgutil, importlib, xfw.contract as c; "
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages(c.__path__, 'xfw.contract.')]; "
            "print(sorted(m for m in ('pandas', 'click', 'matplotlib', 'rich', 'xfw.run', 'xfw.report', 'xfw.cli') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_core_never_branches_on_a_backend_name():
    pattern = re.compile(r"""==\s*["'](torch|paddle)["']""")
    offenders = [p.name for p in (ROOT / "xfw").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_cli_commands_and_options_are_frozen():
    # Changing the CLI breaks users' nightly scripts: update this test deliberately.
    commands = {name: sorted(p.name for p in cmd.params) for name, cmd in cli.main.commands.items()}
    slurm = {"account", "constraint", "cpus_per_task", "detach", "exclusive", "executor", "gpus_per_node", "max_queued",
             "partition", "qos", "sbatch_args", "time_min"}  # --executor and Slurm's options (docs/slurm.md), on every many-run command
    for name in ("compare", "sweep", "maxbatch", "converge", "bisect", "nightly", "selfcheck"):
        assert slurm <= set(commands[name]), name
        commands[name] = sorted(set(commands[name]) - slurm)
    assert commands == {
        "assemble": ["force", "node_dirs", "out_dir"],
        "converge": ["backends", "comparison", "direction", "eval_every", "eval_samples", "force", "margin",
                     "max_seeds", "out_dir", "overrides", "pythons", "recipe", "seeds", "steps", "target"],
        "bisect": ["bad", "builds_path", "force", "good", "margin", "max_pairs", "out_dir", "overrides", "recipe", "repeat"],
        "compare": ["ab", "backends", "comparison", "contrast", "explain", "force", "margin", "master_addr", "master_port", "max_pairs", "node_rank", "out_dir",
                    "overrides", "parity_dirs", "pythons", "recipes", "repeat"],
        "explain": ["backends", "categories", "comparison", "force", "out_dir", "overrides", "pythons", "recipe", "repeat"],
        "env": ["backends", "clean", "pythons", "remove"],
        "parity": ["backends", "force", "out_dir", "overrides", "pythons", "recipe", "steps", "weights"],
        "estimate": ["overrides", "recipe", "run_dir"],
        "maxbatch": ["backends", "candidates", "force", "max_micro", "out_dir", "overrides", "pythons", "recipe"],
        "nightly": ["comparison", "history_dir", "master_addr", "master_port", "night", "node_rank", "only_backends", "overrides",
                    "pythons", "report_only", "suite"],
        "report": ["backends", "layout", "out_dir", "price_per_gpu_hour", "run_dirs"],
        "selfcheck": ["backends", "comparison", "families", "full", "out_dir", "paths", "pythons"],
        "run": ["backend", "comparison", "force", "master_addr", "master_port", "node_rank", "out_dir", "overrides",
                "print_command", "pythons", "recipe", "repeat"],
        "sweep": ["axes", "backends", "comparison", "force", "out_dir", "pythons", "recipe", "repeat"],
        "validate": ["overrides", "prepare", "print_spec", "recipes"],
    }


def test_help_lists_every_command():
    out = CliRunner().invoke(cli.main, ["--help"]).output
    for name in ("assemble", "compare", "converge", "env", "estimate", "maxbatch", "nightly", "parity", "report", "run", "selfcheck",
                 "sweep", "validate"):
        assert name in out


def test_test_files_have_unique_names():
    # The test directories are not packages: two files with one basename break collection.
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def test_inside_run_launching_and_data_never_import_what_a_command_decides():
    """xfw/run/ by concern (docs/design.md §2): ``commands`` (converge, bisect, nightly, ...) start runs through
    ``launch`` and read ``data``; neither of those reaches back up into a command."""
    offenders = []
    for folder in ("launch", "data"):
        for path in (ROOT / "xfw" / "run" / folder).rglob("*.py"):
            offenders += [f"{path.relative_to(ROOT)} -> {m}" for m in _xfw_imports(path)
                          if m.startswith("xfw.run.commands")]
    assert offenders == []
    assert sorted(p.name for p in (ROOT / "xfw" / "run").glob("*.py")) == ["__init__.py"], "a module at xfw/run/'s top"
