"""Shared fixtures: paths to the project, the backends' interpreters, and a tiny recipe.

``make test`` runs the suite in three pytest-xdist workers with ``--dist loadscope``: every test
function of a file runs in one worker, so a module-scoped fixture (a sweep, a night, the FLOP
counts) is built once (a class is a scope of its own: test_documented_commands.py splits its long
run into classes that go to several workers); the workers share the run's prepared data, kept --describe
answers and compiled JAX programs (below). Tests never
share a fixed path or port: their output goes under ``tmp_path`` and a rendezvous takes a free port.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
FAKES = Path(__file__).resolve().parent / "fakes"
# Three caches of one test run, shared by its workers: made by the process that collects the tests (xdist's
# controller, or the one pytest process) and handed to the workers it starts through the environment (SHARED).
# Sharing is safe: a preparation writes a locked temporary directory and renames it (xfw.run.data.cache), a kept
# answer and a compiled JAX program are written whole; three workers each building their own repeated every
# --describe and every preparation three times.
SHARED = "XFW_TEST_RUN_CACHES"
OWNER = not (os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(SHARED))
if OWNER:
    os.environ[SHARED] = os.pathsep.join(tempfile.mkdtemp(prefix=f"xfw-test-{what}-")
                                         for what in ("data", "described", "jax"))
# Real data the tests prepare (the tiny recipes' fixtures, in-test data) goes to one directory per test run,
# shared by its tests and every xfw process they start, never ~/.cache.
# Each backend's --describe answer, kept for the next xfw command that asks the same question (same interpreter,
# adapter files, packages and environment but for the worker's name: xfw.run.launch.described); never across runs.
# JAX's own persistent compilation cache: the JAX runs of one test run compile the same step programs again and
# again (test_jax_adapter: 177 -> 139 CPU s). Never set for users: their compile_time_s would then count loading a
# cached program, not compiling it.
TEST_DATA_CACHE, DESCRIBED, JAX_PROGRAMS = os.environ[SHARED].split(os.pathsep)
os.environ["XFW_CACHE_DIR"], os.environ["XFW_DESCRIBE_CACHE"] = TEST_DATA_CACHE, DESCRIBED
os.environ["JAX_COMPILATION_CACHE_DIR"] = JAX_PROGRAMS
# Every program kept, not only those compiling over JAX's default 1 s: a tiny LLaVA's optimizer update and its
# parameters' initialisers compile again in every run otherwise (one run of it: 11.8 -> 7.2 CPU s, warm).
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# One host thread per process, for this process and every process it starts (a recipe's measure.cpu_threads
# still sets its runs' own): the workers on two cores already run more processes than cores, and a
# framework's OpenMP team of one thread per core then waits for threads the host has descheduled, spinning.
# Measured beside two busy loops, one tiny SD1.5 training test: 155 CPU s (165 s wall) with the default, 20 CPU s
# (35 s wall) with one thread. Set before any test imports a framework; a value set outside is kept.
for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")


def pytest_collection_modifyitems(session, config, items):
    """Longest scopes first (tests/durations.json, measured by scripts/test_durations.py), so the workers of
    ``--dist loadscope`` finish together; the order inside a scope is kept, and unknown scopes go last."""
    import json

    known = json.loads((ROOT / "tests" / "durations.json").read_text(encoding="utf-8"))
    position = {item.nodeid: i for i, item in enumerate(items)}

    def scope(item) -> str:
        return item.nodeid.rsplit("::", 1)[0] if "::" in item.nodeid.split("[", 1)[0].split("::", 1)[1] else \
            item.nodeid.split("::", 1)[0]

    items.sort(key=lambda item: (-known.get(scope(item), 0.0), position[item.nodeid]))


def pytest_sessionfinish(session, exitstatus):
    import shutil

    if not OWNER:  # a worker: the run's caches are its controller's to remove, after every worker ended
        return
    shutil.rmtree(TEST_DATA_CACHE, ignore_errors=True)
    shutil.rmtree(DESCRIBED, ignore_errors=True)
    shutil.rmtree(JAX_PROGRAMS, ignore_errors=True)


def interpreter(backend: str) -> Path:
    return ROOT / ".venv" / backend / "bin" / "python"


def require_interpreter(backend: str) -> Path:
    python = interpreter(backend)
    if not python.exists():
        pytest.skip(f".venv/{backend} is missing: run `make setup` (make test does it)")
    return python


TINY_RECIPE = {
    "name": "tiny-test",
    "model": {"preset": "tiny-llava"},
    "stage": "sft",
    "batch": {"global": 4, "micro": 2},
    "optimizer": {"lr": 1.0e-3},
    "measure": {"warmup_steps": 1, "steps": 4, "timeout_s": 120},
}


def recipe_file(directory: Path, name: str = "recipe.yaml", **sections) -> Path:
    """Write a recipe (TINY_RECIPE updated with the given top-level sections) into ``directory``; its path."""
    path = directory / name
    path.write_text(yaml.safe_dump({**TINY_RECIPE, **sections}))
    return path


@pytest.fixture
def write_recipe(tmp_path):
    """:func:`recipe_file` into the test's own directory."""
    return lambda name="recipe.yaml", **sections: recipe_file(tmp_path, name, **sections)


def fake_interpreters(monkeypatch) -> dict[str, str]:
    """Make the fake adapter importable by the interpreter running the tests (through ``monkeypatch``, of any
    scope); return the --python values for its two backends."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]))
    return {"fake": sys.executable, "fake2": sys.executable}


@pytest.fixture
def fake_backend(monkeypatch):
    """Make the fake adapter importable by the interpreter running the tests; return --python args."""
    return fake_interpreters(monkeypatch)


def run_adapter(backend: str, tmp_path: Path, *, timeout_s: float = 300, edit_spec=None, in_process: bool = False,
                **sections):
    """Run a real adapter on TINY_RECIPE (updated with sections) in its own interpreter.

    ``edit_spec(spec)`` may change the resolved spec afterwards, to reach an adapter's own
    checks with input the recipe validation would already stop.
    Returns (exit code, records, stderr). The subprocess is exactly what the launcher runs.
    ``in_process`` (torch only: the tests run under .venv/torch): what that subprocess runs (harness.main with the
    adapter's session), here, without an interpreter start and its ~6 CPU s of imports; stderr is then "" (a
    traceback goes to pytest's captured stderr).
    """
    import json
    import subprocess

    from xfw.recipe import recipe_from_dict
    from xfw.recipe.spec import resolve_spec
    from xfw.contract.records import load_records

    python = require_interpreter(backend)
    spec = resolve_spec(recipe_from_dict({**TINY_RECIPE, **sections}), backend=backend, run_id="test")
    if edit_spec:
        edit_spec(spec)
    spec_path, records_path = tmp_path / f"{backend}-spec.json", tmp_path / f"{backend}-steps.jsonl"
    spec_path.write_text(json.dumps(spec))
    records_path.unlink(missing_ok=True)
    if in_process:
        assert backend == "torch", backend
        pytest.importorskip("torch")
        from xfw.contract import harness
        from xfw_torch.session import build_session, describe

        code = harness.main(build_session, describe, ["--spec", str(spec_path), "--records", str(records_path)])
        return code, load_records(records_path), ""
    proc = subprocess.run([str(python), "-m", f"xfw_{backend}", "--spec", str(spec_path), "--records",
                           str(records_path)], capture_output=True, text=True, timeout=timeout_s)
    return proc.returncode, load_records(records_path), proc.stderr


# Readers of an adapter's records, shared by the contract tests.
def kinds(records):
    return [r["kind"] for r in records]


def applied(records):
    return next(r for r in records if r["kind"] == "applied")


def losses(records):
    return [r["loss"] for r in records if r["kind"] == "step"]


def spread_weights(model) -> None:
    """Scale a torch model's matrices 5x and jitter its vectors, so every part of it moves the
    output: a same-weights comparison then cannot pass with a part ignored or mis-mapped."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0) if p.ndim > 1 else p.normal_(1.0 if p.abs().min() == 1 else 0.0, 0.1)


def save_neutral_weights(model, directory: Path) -> Path:
    """A torch model's parameters as a ``model.weights`` directory under the canonical names
    (peft's adapter names mapped), the file both adapters load a run's start from."""
    from xfw.contract import hf_names, weights

    tensors = {hf_names.peft_to_canonical(n): p.detach().numpy() for n, p in model.named_parameters()}
    weights.save_file(tensors, directory / weights.WEIGHTS_FILE)
    return directory
