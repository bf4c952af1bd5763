"""``xfw selfcheck``: the first command on a new machine. Every tiny family through every settings
path the seed rows use, on every backend installed, all from one exported start; one verdict per
(backend, path) (:mod:`xfw.report.selfcheck`), written beside the machine's environment::

    xfw selfcheck                                   # quick: LLaVA through every path, every backend (~5 min, 2 cores)
    xfw selfcheck --full                            # every family (about 4x as long)
    xfw selfcheck --families llava --paths fp32,bf16-o2,recompute --backends torch,paddle

    runs/selfcheck/
        selfcheck.json          {"env": host facts + each backend's --describe, "verdicts": [...]}
        selfcheck.md/.html      the verdicts, and what could not be checked here and why
        <family>/weights/       the start every run of the family loads
        <family>/<path>/<backend>/...   ordinary run directories

``xfw compare`` reads ``runs/selfcheck/selfcheck.json`` and warns when a run goes through a path that
has no passing verdict on this machine (same host and device).
"""

from __future__ import annotations

import time
from pathlib import Path

from xfw.contract import env as host
from xfw.contract.atomic import UnreadableFile, read_json_object, write_json_atomic
from xfw.report import selfcheck as judge
from xfw.report.results import RunResult
from xfw.run.launch import launcher
from xfw.run.launch.jobs import Backends, Job, run_jobs
from xfw.run.commands.parity import export_initial_weights
from xfw.recipe import load_recipe

FAMILY_RECIPES = {"llava": "recipes/tiny/llava_sft.yaml", "qwen2vl": "recipes/tiny/qwen2vl_sft.yaml",
                  "sd15": "recipes/tiny/sd15_pretrain.yaml", "sd3": "recipes/tiny/sd3_dreambooth.yaml"}
"""One tiny recipe per family, as shipped (relative to the project root)."""
QUICK_FAMILIES = ("llava",)
"""``xfw selfcheck``'s default: one family through every path (``--full``: every family)."""
RUN_ESTIMATE_S = {1: 12.0, 2: 18.0}
"""Seconds one selfcheck run takes on a 2-core CPU, by process count (start-up included; measured: 8-19 s
a run on a loaded 2-core machine), before this machine's own runs say better."""
EXPORT_ESTIMATE_S = 15.0
SHORT = ("measure.warmup_steps=1", "measure.steps=3", "measure.cpu_threads=1", "measure.timeout_s=600")
DEFAULT_OUT = Path("runs") / "selfcheck"
TEST_DEVICE_PATHS = ("bf16-o2", "stage2", "stage3")
"""Paths a backend with no GPU here runs on its CPU test device when its adapter offers one (``--describe``'s
``cpu_test_device``: Paddle's ``testcpu``), so that its GPU-only code (bf16 O2 with master gradients,
``group_sharded_parallel`` stage 2/3) runs for real; the verdict says so (xfw.report.selfcheck)."""
VERDICTS_FILE = judge.VERDICTS_FILE


def overrides_for(path: judge.SettingsPath, backend: str, weights: Path, description: dict | None = None) -> list[str]:
    # Micro-batches of one sample everywhere: 1 process x 4 micro-batches and 2 x 2 then see the very
    # same micro-batches (the data is drawn by place in the global batch), so their losses agree to fp32.
    batch = ["batch.global=4", "batch.micro=1"]
    device = (description or {}).get("cpu_test_device")
    on_test_device = ([f"backends.{backend}.device={device}"] if device and path.name in TEST_DEVICE_PATHS
                      and (description or {}).get("device") == "cpu" else [])
    return [*SHORT, *batch, *(o.format(backend=backend) for o in path.overrides), *on_test_device,
            f"model.weights={weights}"]


def run_selfcheck(root: Path, families: list[str], paths: list[str], backends: Backends, out_dir: Path, *,
                  progress: launcher.Progress | None = None, log=print, extra: tuple[str, ...] = ()) -> list[judge.Verdict]:
    """Export each family's start, run every (path, backend), judge, write ``selfcheck.json``.
    ``extra``: overrides for every run (``comparison=published``: each side's published mechanisms)."""
    reference_name = next(iter(backends))
    runs: dict[tuple[str, str, str], RunResult] = {}
    todo: list[Job] = []
    total = len(families) * len(paths) * len(backends)
    estimate = EXPORT_ESTIMATE_S * len(families) + len(families) * sum(
        RUN_ESTIMATE_S.get(judge.BY_NAME[name].processes, 18.0) for name in paths) * len(backends)
    log(f"selfcheck: {total} runs ({len(families)} famil{'ies' if len(families) != 1 else 'y'} x {len(paths)} paths "
        f"x {len(backends)} backends), about {fmt_minutes(estimate)} on a 2-core CPU"
        + ("; --full checks every family" if len(families) < len(FAMILY_RECIPES) else ""))
    for family in families:  # every start first: then one count over every run, and verdicts as families finish
        recipe_path = str(root / FAMILY_RECIPES[family])
        weights = (out_dir / family / "weights").resolve()
        log(f"{family}: exporting the start every run loads ({reference_name})")
        export_initial_weights(recipe_path, list(SHORT), backends[reference_name][0], weights, 600)
        for name in paths:
            for backend in backends:
                recipe = load_recipe(recipe_path, [*overrides_for(judge.BY_NAME[name], backend, weights,
                                                                  backends[backend][1]), *extra])
                todo.append(Job(recipe=recipe, backend=backend, run_dir=out_dir / family / name / backend,
                                label=f"{family} / {name} / {backend}"))
    family_of = {job.run_dir: job.run_dir.parent.parent.name for job in todo}
    done: list[str] = []
    started = time.monotonic()
    finished = {"runs": 0}

    def on_result(job: Job, result: RunResult) -> None:
        family = family_of[job.run_dir]
        runs[(family, job.run_dir.parent.name, job.backend)] = result
        finished["runs"] += 1
        left = total - finished["runs"]
        if left:
            log(f"selfcheck: {finished['runs']}/{total} runs done, about "
                f"{fmt_minutes((time.monotonic() - started) / finished['runs'] * left)} left")
        if all((family, name, b) in runs for name in paths for b in backends):  # the family is complete
            done.append(family)
            for verdict in judge_runs(runs, [family], paths, backends):
                log(f"selfcheck {family}: {verdict.backend} {verdict.path}: {verdict.verdict} ({verdict.detail})")
            write_verdicts(out_dir, backends, judge_runs(runs, done, paths, backends), complete=len(done) == len(families))

    run_jobs(todo, backends, resume=True, force=True, progress=progress, log=log, on_result=on_result)
    verdicts = judge_runs(runs, families, paths, backends)
    write_verdicts(out_dir, backends, verdicts, complete=True)
    return verdicts


def fmt_minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def judge_runs(runs: dict[tuple[str, str, str], RunResult], families: list[str], paths: list[str],
               backends: Backends) -> list[judge.Verdict]:
    """One verdict per (path, backend) over ``families`` (each of whose runs is in ``runs``)."""
    verdicts = []
    for name in paths:
        path = judge.BY_NAME[name]
        for backend in backends:
            per_family = {}
            for family in families:
                run = runs[(family, name, backend)]
                spread = judge.fp32_spread([runs[k] for k in runs if k[0] == family and k[1] == "fp32"])
                others = [runs[(family, name, b)] for b in backends if b != backend]
                per_family[family] = judge.judge_family(path, run, runs.get((family, "fp32", backend)), others,
                                                        spread)
            verdicts.append(judge.combine(backend, name, per_family))
    return verdicts


def write_verdicts(out_dir: Path, backends: Backends, verdicts: list[judge.Verdict], *, complete: bool) -> None:
    """``selfcheck.json``: written as each family finishes (``complete`` false until the last), so a
    compare started meanwhile, or a killed selfcheck, has the verdicts so far."""
    write_json_atomic(out_dir / VERDICTS_FILE, {
        "env": {**host.host_env(), "backends": {name: d for name, (_, d) in backends.items()}},
        "complete": complete, "verdicts": [v.to_dict() for v in verdicts]})


def _verdicts_problem(data: dict) -> str | None:
    """Why a ``selfcheck.json`` cannot be used ("key: why"), or None: read by every compare, so checked
    by type before anything in it is looked up."""
    env = data.get("env", {})
    if not isinstance(env, dict):
        return "env: not a mapping"
    for key in ("host", "backends"):
        if not isinstance(env.get(key, {}), dict):
            return f"env.{key}: not a mapping"
    if not isinstance(env.get("host", {}).get("hostname", ""), str):
        return "env.host.hostname: not text"
    if not all(isinstance(v, dict) for v in env.get("backends", {}).values()):
        return "env.backends: a backend's description is not a mapping"
    verdicts = data.get("verdicts", [])
    if not isinstance(verdicts, list):
        return "verdicts: not a list"
    for i, v in enumerate(verdicts):
        if not isinstance(v, dict) or not all(isinstance(v.get(k), str) for k in ("backend", "path", "verdict")) \
                or not isinstance(v.get("detail", ""), str):
            return f"verdicts.{i}: needs backend, path, verdict and detail (text)"
    return None


def unchecked_paths(spec_setups: list[tuple[str, dict, dict]], backends: Backends,
                    directory: Path = DEFAULT_OUT) -> list[str]:
    """Warnings for compare: each (backend, path) a run takes that has no passing selfcheck verdict on
    this machine. ``spec_setups``: (backend, setup, knobs) of each run about to launch."""
    warnings = []
    try:
        data = read_json_object(directory / VERDICTS_FILE)
    except UnreadableFile as err:
        data = {}
        warnings.append(f"{err}: ignored (every path reads as never selfchecked)")
    problem = _verdicts_problem(data)
    if problem:
        warnings.append(f"{directory / VERDICTS_FILE}: {problem}: ignored (every path reads as never selfchecked)")
        data = {}
    here = host.host_env()["host"]["hostname"]
    checked = data.get("env", {}).get("host", {}).get("hostname") == here
    verdicts = {(v["backend"], v["path"]): v for v in data.get("verdicts", [])} if checked else {}
    for backend, setup, knobs in spec_setups:
        device = backends[backend][1].get("device_name")
        described = data.get("env", {}).get("backends", {}).get(backend, {})
        same_device = checked and described.get("device_name") == device
        for path in judge.paths_of(setup, knobs):
            verdict = verdicts.get((backend, path)) if same_device else None
            if verdict is None:
                text = (f"{backend} {path}: never selfchecked on this machine ({device}); run xfw selfcheck "
                        "before trusting these numbers")
            elif verdict["verdict"] != "pass":
                text = f"{backend} {path}: selfcheck says {verdict['verdict']} here ({verdict['detail']})"
            else:
                continue
            if text not in warnings:
                warnings.append(text)
    return warnings
