"""Backends that run a command (xfw.recipe.command): recipe checks, the launcher's side, the log
fallback and the probe's framework-neutral half. Real frameworks under the probe are in
tests/contract/test_attach_real.py; these need none.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from xfw.contract import harness, lifeline, probe
from xfw.contract.probe import core, imports, observe, window
from xfw.contract.records import read_records
from xfw.report import contrast, layouts
from xfw.report.compare import compare_runs
from xfw.report.results import RunResult
from xfw.run.launch import launcher
from xfw.recipe import RecipeError, load_recipe, recipe_from_dict
from xfw.recipe.spec import resolve_spec
from xfw.workflow import UsageError, prepare_backends

from conftest import ROOT, TINY_RECIPE
from test_reliability import invoke, one_line_error, wait_for, xfw_process

PY = sys.executable


def command_recipe(tmp_path: Path, knobs: dict, name: str = "recipe.yaml", **sections) -> Path:
    data = {**TINY_RECIPE, "measure": {"warmup_steps": 1, "steps": 3, "timeout_s": 60}, **sections,
            "backends": {"mine": knobs}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def script(tmp_path: Path, text: str, name: str = "script.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# --- the recipe -------------------------------------------------------------------------------------

def test_a_command_backend_is_checked_and_its_cwd_resolved_against_the_recipe_file(tmp_path):
    (tmp_path / "work").mkdir()
    recipe = load_recipe(command_recipe(tmp_path, {"command": [PY, "x.py"], "cwd": "work", "env": {"A": "1"}}))
    knobs = resolve_spec(recipe, backend="mine", run_id="r")["backend_knobs"]
    assert knobs == {"command": [PY, "x.py"], "cwd": str(tmp_path / "work"), "env": {"A": "1"}}


@pytest.mark.parametrize("knobs, key, words", [
    ({"command": []}, "backends.mine.command", "non-empty list"),
    ({"command": "python x.py"}, "backends.mine.command", "non-empty list"),
    ({"command": [PY, 3]}, "backends.mine.command.1", "non-empty string"),
    ({"command": [PY], "cwd": "nowhere"}, "backends.mine.cwd", "is not a directory"),
    ({"command": [PY], "env": {"A": 1}}, "backends.mine.env.A", "must be a string"),
    ({"command": [PY], "env": {"XFW_PROBE_SPEC": "x"}}, "backends.mine.env", "not a variable name"),
    ({"command": [PY], "env": ["A=1"]}, "backends.mine.env", "mapping"),
    ({"command": [PY], "shell": True}, "backends.mine.shell", "unknown key"),
    ({"command": ["no-such-program-xfw"]}, "backends.mine.command.0", "on PATH"),
    ({"command": ["./missing.sh"]}, "backends.mine.command.0", "no executable file"),
    ({"cwd": "."}, "backends.mine.cwd", "only with backends.mine.command"),
    ({"command": [PY], "log_pattern": {"ips": "ips: [0-9.]+"}}, "backends.mine.log_pattern.ips", "one group"),
    ({"command": [PY], "log_pattern": {"ips": "(", }}, "backends.mine.log_pattern.ips", "not a regular"),
    ({"command": [PY], "log_pattern": {"ips": "(1)", "step_time_s": "(2)"}}, "backends.mine.log_pattern",
     "exactly one"),
    ({"command": [PY], "log_pattern": {"ips": "(1)", "stream": "stdin"}}, "backends.mine.log_pattern.stream",
     "one of"),
])
def test_a_bad_command_backend_is_one_line_naming_the_file_and_key(tmp_path, knobs, key, words):
    path = command_recipe(tmp_path, knobs)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(err.value).startswith(f"{path}: {key}: ") and words in str(err.value)
    assert "\n" not in str(err.value)


def test_a_probed_command_needs_a_warm_up_step_to_open_its_window(tmp_path):
    path = command_recipe(tmp_path, {"command": [PY]}, measure={"warmup_steps": 0, "steps": 3})
    with pytest.raises(RecipeError, match="measure.warmup_steps: must be at least 1"):
        load_recipe(path)
    path = command_recipe(tmp_path, {"command": [PY], "log_pattern": {"ips": "(1)"}},
                          measure={"warmup_steps": 0, "steps": 3})
    assert load_recipe(path).measure.warmup_steps == 0  # a log's lines need no warm-up


def test_set_replaces_a_command_item_and_an_environment_variable(tmp_path):
    path = command_recipe(tmp_path, {"command": [PY, "train.py", "--max-steps", "10"], "env": {"A": "1"}})
    recipe = load_recipe(path, ["backends.mine.command.3=40", "backends.mine.env.B=x y", "backends.mine.env.A=2"])
    assert recipe.backends["mine"]["command"] == [PY, "train.py", "--max-steps", "40"]  # text as typed
    assert recipe.backends["mine"]["env"] == {"A": "2", "B": "x y"}
    with pytest.raises(RecipeError, match=r"backends.mine.command is a list of 4 items; '9' is not one of its indices"):
        load_recipe(path, ["backends.mine.command.9=x"])
    recipe = load_recipe(path, ["backends.mine.command=[python3, other.py]"])  # the whole list: YAML
    assert recipe.backends["mine"]["command"] == ["python3", "other.py"]


def test_a_command_backend_needs_no_interpreter_and_refuses_one(tmp_path):
    recipe = load_recipe(command_recipe(tmp_path, {"command": [PY]}))
    backends = prepare_backends(["mine"], {}, [recipe])  # there is no .venv/mine
    assert backends["mine"][1] == {"command": True}
    with pytest.raises(UsageError, match="runs the recipe's command"):
        prepare_backends(["mine"], {"mine": PY}, [recipe])


def test_maxbatch_and_parity_refuse_a_command_backend(tmp_path):
    path = command_recipe(tmp_path, {"command": [PY]})
    assert "batch.micro, which the command itself decides" in one_line_error(
        invoke("maxbatch", path, "--backends", "mine", "--candidates", "2"))
    assert "exported model" in one_line_error(invoke("parity", path, "--backends", "mine,other"))


def test_print_command_shows_the_directory_the_guard_and_the_probe_variables(tmp_path):
    path = command_recipe(tmp_path, {"command": [PY, "train.py"], "cwd": "."})
    result = invoke("run", path, "--backend", "mine", "--out", tmp_path / "out", "--print-command")
    assert result.exit_code == 0, result.output
    assert f"cd {tmp_path} && " in result.output and "xfw.run.launch.guard" in result.output
    assert f"{probe.ENV_SPEC}=" in result.output and str(probe.SITE_DIR) in result.output
    assert result.output.rstrip().endswith(f"-- {PY} train.py")


# --- running a command: the log fallback, failures, the guard ---------------------------------------

def run_command(tmp_path, knobs, run_dir: Path | None = None, **sections) -> RunResult:
    recipe = load_recipe(command_recipe(tmp_path, knobs, **sections))
    backends = prepare_backends(["mine"], {}, [recipe])
    backend, description = backends["mine"]
    return launcher.launch(recipe, backend, run_dir or tmp_path / "out" / "mine", description=description)


LOG_SCRIPT = """
    import sys, time
    for i in range(int(sys.argv[1])):
        print(f"step {i} | samples/s: {100 + i} | loss 1.0", flush=True)
        time.sleep(0.05)
    time.sleep(float(sys.argv[2]))
"""


def test_a_log_pattern_run_is_parsed_stopped_and_marked_as_not_measured_by_xfw(tmp_path):
    path = script(tmp_path, LOG_SCRIPT)
    result = run_command(tmp_path, {"command": [PY, str(path), "100", "600"],
                                    "log_pattern": {"ips": r"samples/s: ([0-9.]+)"}})
    assert result.status == "ok" and result.reason == "" and result.wall_time_s < 30  # stopped, not timed out
    records, problem = read_records(Path(result.run_dir) / "steps.jsonl")
    assert problem == ""
    measured = [r for r in records if r["kind"] == "step" and r["phase"] == "measure"]
    assert [r["step_time_s"] for r in measured] == pytest.approx([4 / 101, 4 / 102, 4 / 103])  # global batch / ips
    loaded = RunResult.load(result.run_dir)
    assert loaded.status == "ok" and loaded.measurement.source == "command_log"
    assert loaded.measurement.ips == pytest.approx(12 / sum(4 / v for v in (101, 102, 103)))
    rows = compare_runs([loaded], ["mine"])
    table = contrast.contrast_table(rows, ["mine"])
    assert table.cells[0][2].endswith(contrast.PARSED_MARK) and contrast.PARSED_LINE in table.notes
    assert table.records[0]["mine_measured_by"] == "parsed from the command's log: not measured by xfw"
    for name in ("strategies", "batch", "ranks"):  # scaling needs runs at several process counts
        notes = [n for t in layouts.build(name, [loaded]) for n in t.notes]
        assert contrast.PARSED_LINE in notes, name


def test_a_parsed_side_beside_a_measured_one_renders_in_compare(tmp_path, fake_backend):
    path = script(tmp_path, LOG_SCRIPT)
    recipe = command_recipe(tmp_path, {"command": [PY, str(path), "100", "600"],
                                       "log_pattern": {"ips": r"samples/s: ([0-9.]+)"}})
    data = yaml.safe_load(recipe.read_text())
    data["backends"]["fake"] = {"behave": "ok", "ips": 50}
    recipe.write_text(yaml.safe_dump(data))
    result = invoke("compare", recipe, "--backends", "fake,mine", "--out", tmp_path / "out",
                    "--python", f"fake={fake_backend['fake']}")
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.startswith("| Tiny LLaVA"))
    assert f"{contrast.PARSED_MARK} |" in row and contrast.PARSED_LINE in result.output
    assert "mine_measured_by" in (tmp_path / "out" / "report.csv").read_text().splitlines()[0]


def test_sweep_and_nightly_run_a_command_recipe_unchanged(tmp_path):
    path = script(tmp_path, LOG_SCRIPT)
    recipe = command_recipe(tmp_path, {"command": [PY, str(path), "100", "600"],
                                       "log_pattern": {"ips": r"samples/s: ([0-9.]+)"}})
    swept = invoke("sweep", recipe, "--set", "backends.mine.command.2=50,100", "--backends", "mine",
                   "--out", tmp_path / "sweep")
    assert swept.exit_code == 0, swept.output
    assert sorted(p.parent.parent.name for p in (tmp_path / "sweep").rglob("summary.json")) == \
        ["backends.mine.command.2-100", "backends.mine.command.2-50"]
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({"name": "s", "backends": ["mine"], "entries": [recipe.name]}))
    night = invoke("nightly", suite, "--history", tmp_path / "history")
    assert night.exit_code == 0, night.output
    row = json.loads((tmp_path / "history" / "history.jsonl").read_text().splitlines()[0])
    assert row["status"] == "ok" and row["ips"] > 0
    assert contrast.PARSED_LINE in next((tmp_path / "history" / "nights").glob("*/report.html")).read_text() \
        .replace("&#x27;", "'")


def test_a_log_with_too_few_lines_is_invalid_and_says_how_many(tmp_path):
    path = script(tmp_path, LOG_SCRIPT)
    result = run_command(tmp_path, {"command": [PY, str(path), "2", "0"], "log_pattern": {"ips": r"samples/s: (\S+)"}})
    assert result.status == "invalid"
    assert "stdout had 2 line(s) matching log_pattern.ips; the recipe measures 1 warm-up + 3 steps" in result.reason


def test_a_command_that_never_steps_says_xfw_saw_no_step(tmp_path):
    result = run_command(tmp_path, {"command": [PY, "-c", "print('hello')"]})
    assert result.status == "crashed" and "before xfw saw an optimizer step" in result.reason


FORGER = """
    import json, os, sys, time
    token = os.environ.get("XFW_PROBE_TOKEN", "") if sys.argv[1] == "probe" else "guessed"
    def write(kind, **fields):
        with open(os.environ["XFW_PROBE_RECORDS"], "a") as f:
            f.write(json.dumps({"schema": 1, "kind": kind, "rank": 0, **fields, "xfw_probe": token}) + "\\n")
    write("start", num_ranks=1, warmup_steps=1, steps=3, t_unix_s=time.time())
    for i in range(4):
        write("step", step=i, phase="warmup" if i == 0 else "measure", step_time_s=1e-6, samples=4, tokens=0,
              loss=None, mem_alloc_peak_bytes=None, mem_reserved_peak_bytes=None)
    write("window", window_time_s=3e-6, num_steps=3, samples=12, tokens=0)
    write("end")
    while sys.argv[1] == "probe":  # as a script that caught the probe's SystemExit and trained on
        try:
            time.sleep(600)
        except BaseException:
            pass
"""


def test_records_the_probe_did_not_write_are_not_a_measurement(tmp_path):
    """Well-formed records written into XFW_PROBE_RECORDS by the command itself: no run token."""
    path = script(tmp_path, FORGER)
    result = run_command(tmp_path, {"command": [PY, str(path), "forge"]},
                         measure={"warmup_steps": 1, "steps": 3, "timeout_s": 20})
    assert result.status == "invalid" and "were not written by xfw's probe" in result.reason
    assert read_records(Path(result.run_dir) / "steps.jsonl")[1] == ""  # the kept file reads clean


def test_a_probed_command_is_stopped_once_every_rank_ended(tmp_path, monkeypatch):
    """The probe's SystemExit caught by the script: xfw stops it after the grace period."""
    from xfw.run.launch import attached

    monkeypatch.setattr(attached, "ENDED_GRACE_S", 0.5)
    path = script(tmp_path, FORGER)  # stands in for a probe: it writes with this run's token
    result = run_command(tmp_path, {"command": [PY, str(path), "probe"]},
                         measure={"warmup_steps": 1, "steps": 3, "timeout_s": 60})
    assert result.status == "ok" and result.wall_time_s < 30, result.reason
    records, problem = read_records(Path(result.run_dir) / "steps.jsonl")
    assert problem == "" and not any("xfw_probe" in r for r in records)


def test_a_command_that_fails_is_crashed_with_its_last_words(tmp_path):
    result = run_command(tmp_path, {"command": [PY, "-c", "raise SystemExit('no data at /x')"]})
    assert result.status == "crashed" and result.reason == "no data at /x (exit code 1)"


def test_a_hanging_command_times_out(tmp_path):
    result = run_command(tmp_path, {"command": [PY, "-c", "import time; time.sleep(600)"]},
                         measure={"warmup_steps": 1, "steps": 3, "timeout_s": 2})
    assert result.status == "timeout" and result.wall_time_s < 30


def test_the_command_runs_in_its_directory_with_its_environment_and_the_probes(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path)  # a relative --out, as `--out runs/x` gives: the command runs elsewhere
    code = ("import os, json; print(json.dumps({'cwd': os.getcwd(), 'A': os.environ.get('A'), "
            "'path': os.environ['PYTHONPATH'], 'spec': os.environ.get('XFW_PROBE_SPEC')}))")
    result = run_command(tmp_path, {"command": [PY, "-c", code], "cwd": "work", "env": {"A": "a b"}},
                         run_dir=Path("out") / "mine")
    seen = json.loads((Path(result.run_dir) / "stdout.log").read_text())
    assert seen["cwd"] == str(tmp_path / "work") and seen["A"] == "a b"
    assert seen["path"].split(os.pathsep)[:2] == [str(probe.SITE_DIR), str(ROOT)]
    assert seen["spec"] == str(tmp_path / "out" / "mine" / "spec.json")
    env = json.loads((Path(result.run_dir) / "env.json").read_text())
    assert env["backend"]["command"] == [PY, "-c", code] and env["interpreter"] is None


def test_killing_xfw_with_sigkill_ends_the_command_it_runs(tmp_path):
    marker = tmp_path / "pid"
    path = command_recipe(tmp_path, {"command": [PY, "-c", f"import os, time; open({str(marker)!r}, 'w').write("
                                                 "str(os.getpid())); time.sleep(600)"]},
                          measure={"warmup_steps": 1, "steps": 3, "timeout_s": 600})
    first = xfw_process("run", path, "--backend", "mine", "--out", tmp_path / "out")
    wait_for(lambda: marker.exists() and marker.read_text())
    command_pid = int(marker.read_text())
    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    wait_for(lambda: lifeline.process_start_time(command_pid) is None,
             timeout_s=lifeline.POLL_S + lifeline.GRACE_S + 10)


# --- the probe's framework-neutral half ---------------------------------------------------------------

def test_the_probe_imports_only_the_standard_library():
    code = ("import sys, xfw.contract.probe as p, xfw.contract.probe.core, xfw.contract.probe.applied, "
            "xfw.contract.probe.imports; print(sorted(m for m in ('numpy', 'yaml', 'xfw.run', 'xfw.report', "
            "'xfw.contract.harness', 'xfw.contract.synthetic') if m in sys.modules))")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_probe_site_directory_holds_only_sitecustomize():
    assert sorted(p.name for p in probe.SITE_DIR.iterdir() if p.name != "__pycache__") == ["sitecustomize.py"]


def test_the_probes_drain_interval_is_the_harness_one():
    assert window.DRAIN_INTERVAL_S == harness.DRAIN_INTERVAL_S


def site_run(tmp_path, env_extra: dict, code: str = "print('script ran')") -> subprocess.CompletedProcess:
    other = tmp_path / "other_site"
    other.mkdir(exist_ok=True)
    (other / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITE_RAN'] = '1'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("XFW_")}
    env["PYTHONPATH"] = os.pathsep.join([str(probe.SITE_DIR), str(ROOT), str(other)])
    return subprocess.run([PY, "-c", f"import os; print(os.environ.get('SHADOWED_SITE_RAN')); {code}"],
                          capture_output=True, text=True, env={**env, **env_extra}, timeout=60)


def test_the_sitecustomize_loads_the_one_it_shadows_and_nothing_else_without_xfws_variables(tmp_path):
    out = site_run(tmp_path, {}, "import sys; print('xfw.contract.probe.core' in sys.modules)")
    assert out.returncode == 0 and out.stdout.split() == ["1", "False"] and out.stderr == ""


def test_a_probe_that_cannot_start_says_so_in_one_line_and_the_script_still_runs(tmp_path):
    out = site_run(tmp_path, {probe.ENV_SPEC: str(tmp_path / "missing.json"), probe.ENV_RECORDS: "x"})
    assert out.returncode == 0 and out.stdout.splitlines() == ["1", "script ran"]
    assert out.stderr.startswith("xfw probe: not active (FileNotFoundError") and len(out.stderr.splitlines()) == 1


def test_an_import_callback_runs_after_the_module_and_leaves_its_loader_alone(tmp_path, monkeypatch):
    (tmp_path / "xfw_watched_mod.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    imports.when_imported("xfw_watched_mod", lambda module: seen.append(module.VALUE + 1))
    import xfw_watched_mod  # noqa: F401 - the import is the test

    assert seen == [42] and type(xfw_watched_mod.__loader__).__name__ == "SourceFileLoader"
    imports.when_imported("xfw_watched_mod", lambda module: seen.append("again"))  # already imported: at once
    assert seen == [42, "again"]


def test_a_spec_look_up_keeps_the_callback_for_the_import_that_follows_from_a_thread(tmp_path, monkeypatch):
    """datasets, transformers and peft call importlib.util.find_spec("torch") before importing it."""
    import importlib.util
    import threading

    (tmp_path / "xfw_looked_up_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    imports.when_imported("xfw_looked_up_mod", lambda module: seen.append(module.VALUE))
    assert importlib.util.find_spec("xfw_looked_up_mod") is not None and seen == []
    assert importlib.util.find_spec("xfw_looked_up_mod") is not None and seen == []
    assert imports.missed() == []
    loading = threading.Thread(target=importlib.import_module, args=("xfw_looked_up_mod",))
    loading.start()
    loading.join()
    assert seen == [1] and imports.missed() == []


def test_a_framework_imported_past_the_watcher_is_recorded_as_not_measured(tmp_path, monkeypatch):
    (tmp_path / "xfw_hidden_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    p, path = make_probe(tmp_path)
    imports.when_imported("xfw_hidden_mod", lambda module: None)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f is not imports._WATCHER])
    import xfw_hidden_mod  # noqa: F401 - imported past the watcher

    assert imports.missed() == ["xfw_hidden_mod"]
    p._at_exit()
    error = read_records(path)[0][-1]
    assert error["status"] == "crashed" and "could not install its hooks: xfw_hidden_mod" in error["message"]
    del sys.modules["xfw_hidden_mod"]


@pytest.mark.parametrize("batch, counts", [
    ({"input_ids": __import__("numpy").zeros((4, 64)), "labels": __import__("numpy").zeros((4, 64))}, (4, 256)),
    ({"pixel_values": __import__("numpy").zeros((2, 3, 8, 8)), "input_ids": __import__("numpy").zeros((2, 9))}, (2, 0)),
    ((__import__("numpy").zeros((8, 3)), __import__("numpy").zeros(8)), (8, 0)),
    ({"meta": "text"}, None),
])
def test_a_batch_is_counted_from_its_shapes(batch, counts):
    assert observe.batch_counts(batch) == counts


def test_a_forward_is_counted_from_its_first_positional_tensor_or_its_keywords():
    import numpy as np

    assert observe.forward_counts((np.zeros((4, 4, 8, 8)), 7), {"encoder_hidden_states": np.zeros((4, 2))}) == (4, 0)
    assert observe.forward_counts((), {"input_ids": np.zeros((2, 5)), "labels": np.zeros((2, 5))}) == (2, 10)
    assert observe.forward_counts((np.zeros(()),), {}) is None
    assert observe.forward_counts(({"input_ids": np.zeros((3, 4)), "labels": np.zeros((3, 4))},), {}) == (3, 12)


class ClockHooks:
    """The framework hook interface (core.Framework) answered from the host clock: a stand-in for
    the half of xfw_torch.probe / xfw_paddle.probe the core calls, with counts given by the test."""

    name = "clock"

    def __init__(self, world: int = 1):
        self.world = world
        self.watching = True

    def start(self): pass
    def rank(self): return 0
    def world_size(self): return self.world
    def mem_source(self): return "peak_rss"
    def timestamp(self): return time.perf_counter()
    def is_done(self, stamp): return True
    def elapsed_s(self, start, end): return end - start
    def synchronize(self): pass
    def memory_peaks(self): return observe.peak_rss_bytes(), None
    def count_params(self, model, optimizer): return (len(model), len(model) // 2) if model else (0, 0)
    def stop_watching_forward(self): self.watching = False
    def watch_inputs(self, modules): self.inputs = [id(m) for m in modules]

    def parameters(self, model):  # a "model" is a list of parameter sizes; every other one trains
        return [(id(model) + i, n, i % 2 == 0) for i, n in enumerate(model)]

    def facts(self, model, wrapper, optimizer):
        return {"framework_version": "0", "device": "cpu", "device_name": "cpu", "weight_dtype": "float32",
                "attention_impl": "eager", "recompute": False, "sharding_impl": "none", "master_weights": False,
                "fused_optimizer": False, "tf32": False, "versions": {}}


def make_probe(tmp_path, **measure) -> tuple[core.Probe, Path]:
    spec = resolve_spec(recipe_from_dict({**TINY_RECIPE, "measure": {"warmup_steps": 1, "steps": 3, **measure}}),
                        backend="mine", run_id="r")
    made = core.Probe(spec, str(tmp_path / "steps.jsonl"))
    atexit.unregister(made._at_exit)  # the tests call it; pytest's own exit must not
    return made, tmp_path / "steps.jsonl"


def test_the_probe_writes_a_harness_shaped_run_from_boundaries_and_then_ends_the_script(tmp_path):
    import numpy as np

    p, path = make_probe(tmp_path)
    hooks = ClockHooks()
    p.add_framework(hooks)
    p.saw_batch({"input_ids": [[0]] * 2}, source="eval")  # no shape: not a batch it can count
    p.saw_model(hooks, [1] * 10)
    p.saw_batch({"input_ids": np.zeros((2, 5)), "labels": np.zeros((2, 5))}, source="train")
    p.saw_batch({"input_ids": np.zeros((2, 5)), "labels": np.zeros((2, 5))}, source="train")
    p.boundary(hooks, "optimizer")  # warm-up step 0: the training data is the one that fed it
    assert not hooks.watching
    for _ in range(2):
        p.saw_batch({"input_ids": np.zeros((9, 5))}, source="eval")  # another data source: not counted
        p.saw_batch({"input_ids": np.zeros((2, 5)), "labels": np.zeros((2, 5))}, source="train")
        p.saw_batch({"input_ids": np.zeros((2, 5)), "labels": np.zeros((2, 5))}, source="train")
        p.boundary(hooks, "optimizer")
    p.saw_batch({"input_ids": np.zeros((2, 5)), "labels": np.zeros((2, 5))}, source="train")
    p.saw_batch({"input_ids": np.zeros((2, 5)), "labels": np.zeros((2, 5))}, source="train")
    with pytest.raises(SystemExit) as stop:
        p.boundary(hooks, "optimizer")
    assert stop.value.code == 0 and p.done
    records, problem = read_records(path)
    assert problem == ""
    assert [r["kind"] for r in records] == ["start", "step", "step", "step", "step", "window", "applied", "end"]
    assert [r["samples"] for r in records if r["kind"] == "step"] == [4, 4, 4, 4]
    assert records[5]["samples"] == 12 and records[5]["tokens"] == 60
    applied = records[6]
    assert (applied["num_params_total"], applied["num_params_trainable"]) == (10, 5)
    assert (applied["micro_batch"], applied["grad_accum_steps"], applied["step_boundary"]) == (2, 2, "optimizer step")
    p._at_exit()  # finished: nothing more is written
    assert len(read_records(path)[0]) == len(records)


def test_a_trainers_callback_marks_the_steps_and_its_arguments_fill_the_settings(tmp_path):
    p, path = make_probe(tmp_path)
    hooks = ClockHooks()
    p.trainer_began(hooks, {"recompute": True, "micro_batch": 2, "grad_accum_steps": 2, "compute_dtype": "bfloat16"},
                    list(range(8)))
    for _ in range(3):
        p.boundary(hooks, "optimizer")  # the Trainer's callback marks its steps, not the optimizer
        p.boundary(hooks, "trainer")
    with pytest.raises(SystemExit):
        p.boundary(hooks, "trainer")
    applied = [r for r in read_records(path)[0] if r["kind"] == "applied"][0]
    assert applied["recompute"] is True and applied["step_boundary"] == "trainer callback"
    assert "samples from the recipe's batch" in applied["notes"]
    assert "the Trainer's arguments ask for bfloat16" in applied["notes"]
    steps = [r for r in read_records(path)[0] if r["kind"] == "step"]
    assert len(steps) == 4 and all(r["samples"] == 4 for r in steps)  # the recipe's global batch / 1 process


def test_a_script_that_ends_early_is_invalid_and_one_that_raised_is_crashed(tmp_path, monkeypatch):
    p, path = make_probe(tmp_path)
    p.boundary(ClockHooks(), "optimizer")
    p._at_exit()
    error = read_records(path)[0][-1]
    assert error["status"] == "invalid" and error["message"].startswith(
        "the command ended after 1 optimizer step(s); the recipe measures 1 warm-up + 3 steps")
    (tmp_path / "b").mkdir()
    p, path = make_probe(tmp_path / "b")
    p.boundary(ClockHooks(), "optimizer")
    monkeypatch.setattr(sys, "last_value", MemoryError("out of memory on gpu 0"), raising=False)
    p._at_exit()
    assert read_records(path)[0][-1]["status"] == "oom"


def test_a_world_size_other_than_the_recipes_is_invalid_and_stops_the_script(tmp_path):
    p, path = make_probe(tmp_path)
    with pytest.raises(SystemExit) as stop:
        p.boundary(ClockHooks(world=2), "optimizer")
    assert stop.value.code == core.EXIT_INVALID
    error = read_records(path)[0][-1]
    assert error["status"] == "invalid" and "the command runs 2" in error["message"]


def test_a_failing_hook_turns_the_probe_off_and_records_why_without_raising(tmp_path, capsys):
    p, path = make_probe(tmp_path)

    class Broken(ClockHooks):
        def world_size(self):
            raise RuntimeError("no process group")

    assert p.boundary(Broken(), "optimizer") is None and p.disabled
    error = read_records(path)[0][-1]
    assert error == {**error, "status": "crashed", "message": "xfw probe failed: RuntimeError: no process group"}
    assert "the command runs on unmeasured" in capsys.readouterr().err


def test_samples_are_what_reached_the_model_and_parameters_every_module_that_took_part(tmp_path):
    """A prefetching loader hands out batches a step early (accelerate's): the loader's count is
    shifted, the model's inputs are not. Frozen modules count in the parameters; autocast counts
    where a layer ran under it, not at the outermost forward."""
    import numpy as np

    p, path = make_probe(tmp_path, warmup_steps=1, steps=3)
    hooks = ClockHooks()
    p.add_framework(hooks)
    unet, vae, text = [4] * 6, [1000], [3] * 4  # sizes 24, 1000, 12; every other one trains (fake)
    latents = np.zeros((4, 4, 8, 8))
    for step in range(4):
        p.saw_batch({"pixel_values": np.zeros((6 if step % 2 == 0 else 2, 3))}, source="train")  # shifted
        for _ in range(2):  # accumulation 2: two micro-batches of 4 reach the UNet
            for module in (vae, text, unet):
                p.saw_model(hooks, module)
            p.saw_amp(unet, {"enabled": False})
            p.saw_amp(unet, {"enabled": True, "dtype": "bfloat16"})  # inside the wrapped forward
            p.saw_forward(unet, (latents, 7), {"encoder_hidden_states": np.zeros((4, 77, 32))})
            p.saw_forward(text, (np.zeros((4, 77)),), {})
        if step < 3:
            p.boundary(hooks, "optimizer")
            if step == 0:
                assert p.model is unet and hooks.inputs == [id(unet)]  # fed with gradients, most trainable
    with pytest.raises(SystemExit):
        p.boundary(hooks, "optimizer")
    records = read_records(path)[0]
    assert [r["samples"] for r in records if r["kind"] == "step"] == [8, 8, 8, 8]
    applied = next(r for r in records if r["kind"] == "applied")
    assert (applied["micro_batch"], applied["grad_accum_steps"]) == (4, 2)
    assert (applied["num_params_total"], applied["num_params_trainable"]) == (1000 + 24 + 12, 1000 + 12 + 6)
    assert (applied["compute_dtype"], applied["amp_level"]) == ("bfloat16", "O1")
    assert "parameters over list 1000" in applied["notes"] and "reached list's forward" in applied["notes"]
    assert applied["params_by_module"]["list"] == {"total": 1000, "trainable": 1000}

