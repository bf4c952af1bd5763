"""Parity: do both backends train the same model? One recipe, the same start, losses compared.

``run_parity`` forces what makes the two sides comparable (fp32, AMP O0, one process, no
warm-up), exports the PyTorch side's seeded initial weights once to a neutral file
(``xfw.contract.weights``; LoRA adapters included), points both runs' ``model.weights`` at it, and
runs each backend through the launcher with the gradient norm recorded per step (the
harness's ``grad_norm`` knob). The batches are the same by construction (``xfw.contract.synthetic``
draws every input, noise and timestep included, from the spec's seed). Then it compares the
loss and the gradient norm per step (:mod:`xfw.report.parity`: the verdict and its tolerances)::

    report = run_parity("recipes/tiny/llava_sft.yaml", [], 10, Path("runs/parity"), {},
                        backends=("torch", "paddle"))
    print(to_markdown(report.page()))   # also runs/parity/parity.json
    # runs/parity/{weights/model.safetensors, torch/..., paddle/..., parity.json}

``find_parity`` gives a compare report the status of a parity run of the same recipe.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from xfw.contract import records as rec
from xfw.contract import weights as neutral
from xfw.contract.atomic import write_json_atomic
from xfw.contract.harness import GRAD_NORM_KNOB
from xfw.contract.module_outputs import read_probe
from xfw.report.parity import PARITY_FILE, ParityReport, Probe, Tolerances, compare_losses
from xfw.run.launch import jobs, launcher
from xfw.recipe.overrides import backend_overrides
from xfw.recipe import Recipe, RecipeError, load_recipe
from xfw.recipe.schema import to_dict
from xfw.recipe.spec import resolve_spec

# An interpreter's description does not change while this process lives; asking once per
# backend saves a framework import (~2 s) per parity run after the first.
describe_backend = functools.lru_cache(maxsize=None)(launcher.describe_backend)


class ParityError(ValueError):
    """Parity could not start (a bad recipe, a missing backend, an export that failed); one line."""


def probe(backend: launcher.Backend, run_dir: Path, timeout_s: float) -> Probe | None:
    """``--probe-modules`` on the spec a run used (its own starting weights): every module's output
    on the first batch (``xfw.contract.module_outputs``); None if the adapter could not."""
    path = run_dir / "modules.json"
    try:
        launcher.adapter_task(backend, ["--probe-modules", str(path), "--spec", str(run_dir / "spec.json")],
                              timeout_s=timeout_s, failed="the module probe failed")
        return read_probe(path)
    except (launcher.BackendError, OSError, ValueError, KeyError):
        return None


def _measured(run_dir: Path, key: str) -> list[float | None]:
    steps = [r for r in rec.load_records(run_dir / "steps.jsonl")
             if r.get("kind") == "step" and r.get("rank") == 0 and r.get("phase") == "measure"]
    return [r.get(key) for r in sorted(steps, key=lambda r: r["step"])]


def measured_losses(run_dir: Path) -> list[float | None]:
    """Rank 0's measured losses in step order, from the run's ``steps.jsonl``."""
    return _measured(run_dir, "loss")


def measured_grad_norms(run_dir: Path) -> list[float | None]:
    """Rank 0's gradient norms in step order (None where the run did not record them)."""
    return _measured(run_dir, "grad_norm_l2")


def forced_overrides(steps: int, weights_dir: Path | str | None = None, backends: tuple[str, ...] = ()) -> list[str]:
    """What parity forces, applied after the user's overrides (``model.weights`` only once the
    shared starting point exists: the export itself starts from the recipe's own), and the
    gradient norm recorded per step on each of ``backends`` (the harness's knob)."""
    forced = ["precision.dtype=fp32", "precision.amp_level=O0", "parallel.nproc_per_node=1",
              "parallel.nnodes=1", "parallel.sharding=none", "measure.warmup_steps=0",
              f"measure.steps={int(steps)}", "measure.repeat=1"]
    forced += [f"backends.{name}.{GRAD_NORM_KNOB}=true" for name in backends]
    return forced + ([f"model.weights={weights_dir}"] if weights_dir is not None else [])


def export_initial_weights(recipe_path: str, overrides: list[str], backend: launcher.Backend, directory: Path,
                           timeout_s: float) -> None:
    """Ask ``backend``'s adapter to write the recipe's initial model to ``directory``."""
    recipe = load_recipe(recipe_path, overrides)
    export_starts(backend, [(directory, resolve_spec(recipe, backend=backend.name,
                                                     run_id=f"{directory.parent.name}/export"))], timeout_s)


def export_starts(backend: launcher.Backend, starts: list[tuple[Path, dict]], timeout_s: float) -> None:
    """Each resolved spec's initial model written to its directory (``spec.json`` beside it) by one process
    of ``backend``'s adapter: the framework is imported once however many starts (converge's seeds).
    ``timeout_s`` is each start's. ParityError when any of them was not written."""
    args = []
    for directory, spec in starts:
        directory.mkdir(parents=True, exist_ok=True)
        write_json_atomic(directory / "spec.json", spec)
        args += ["--export-weights", str(directory), "--spec", str(directory / "spec.json")]
    try:
        launcher.adapter_task(backend, args, timeout_s=timeout_s * len(starts),
                              failed="could not export the initial weights")
    except launcher.BackendError as err:
        raise ParityError(str(err)) from None


def run_parity(recipe_path: str, overrides: list[str], steps: int, out_dir: Path,
               interpreters: dict[str, str], *, backends: tuple[str, str], tolerances: Tolerances = Tolerances(),
               weights: dict[str, str] | None = None, force: bool = False) -> ParityReport:
    """Train ``recipe_path`` for ``steps`` steps on both backends from the same weights and
    compare the losses. ``weights`` optionally gives a backend its own ``model.weights``
    directory instead of the shared export (to check that a changed weight is caught).
    ``backends`` is (reference, other): the reference's adapter exports the starting weights.
    Writes ``out_dir/parity.json``; raises ParityError when parity cannot start."""
    reference, other = backends
    out_dir = Path(out_dir)
    if steps < 1:
        raise ParityError(f"steps: {steps} (must be ≥ 1)")
    weights_dir = (out_dir / "weights").resolve()  # absolute: the adapters may run elsewhere than here
    try:
        resolved = {name: launcher.resolve_backend(name, interpreters) for name in (reference, other)}
        described = {name: describe_backend(b) for name, b in resolved.items()}
        base = load_recipe(recipe_path, [*overrides, *forced_overrides(steps, backends=backends)])
    except (RecipeError, launcher.BackendError) as err:
        raise ParityError(str(err)) from None
    export_initial_weights(recipe_path, [*overrides, *forced_overrides(steps, backends=backends)],
                           resolved[reference], weights_dir, base.measure.timeout_s)
    report = ParityReport(recipe=base.name, num_steps=steps, weights_dir=str(weights_dir), run_dirs={},
                          tolerances=tolerances, backends=(reference, other),
                          recipe_fingerprint=recipe_fingerprint(base))
    losses, grad_norms = {}, {}
    for name, backend in resolved.items():
        start = Path((weights or {}).get(name, weights_dir)).resolve()
        recipe = load_recipe(recipe_path, [*overrides, *forced_overrides(steps, start, backends)])
        run_dir = out_dir / name
        (result,), _ = jobs.run_jobs([jobs.Job(recipe=recipe, backend=name, run_dir=run_dir)],
                                     {name: (backend, described[name])}, resume=False, force=force, log=lambda _: None)
        report.run_dirs[name] = str(run_dir)
        if start != weights_dir:
            report.notes.append(f"{name} started from {start}, not the shared export")
        if not result.ok:
            report.problems.append(f"{name} run {result.status}: {result.reason}")
        losses[name] = measured_losses(run_dir)
        grad_norms[name] = measured_grad_norms(run_dir)
    report.steps = compare_losses(losses[reference], losses[other], tolerances,
                                  grad_norms=(grad_norms[reference], grad_norms[other]))
    if report.first_failing_step is not None:
        probes = [probe(resolved[name], out_dir / name, base.measure.timeout_s) for name in (reference, other)]
        if None in probes:
            report.module_note = "no module could be named: the module probe did not run on both sides"
        else:
            report.locate(*probes)
    if any(len(v) != steps for v in losses.values()):
        report.problems.append(f"measured steps: {reference} {len(losses[reference])}, {other} {len(losses[other])}, "
                               f"asked {steps}")
    report.save(out_dir)
    return report


# What parity sets itself (and a compare run may set differently): not part of "the same recipe".
_NOT_FINGERPRINTED = ("precision", "parallel", "measure", "backends")


def recipe_fingerprint(recipe: Recipe) -> str:
    """A digest of what the model and its training are, from where they start: the recipe without the
    sections parity forces (precision, parallel, measure, backends), with ``model.weights`` as the
    checkpoint's content fingerprint (``random`` for a seeded start). A compare run and a parity run
    of one recipe from the same start, with the same ``--set`` on anything else, share it; a parity
    run from a checkpoint never vouches for a compare from random weights, nor the other way round.
    Parity computes it before it points both sides at its own export of that start. Per-backend
    overrides (``backends.<name>.override``, any key) are part of it: a run where one side deliberately
    differs is not the recipe a parity run without that difference vouched for (absent without any,
    so a recipe's fingerprint is what it was before overrides existed)."""
    data = {k: v for k, v in to_dict(recipe).items() if k not in _NOT_FINGERPRINTED}
    if backend_overrides(recipe):
        data["overrides"] = backend_overrides(recipe)
    weights = data["model"].get("weights", "random")
    data["model"] = {**data["model"], "weights": "random" if weights == "random" else neutral.fingerprint(weights)}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def find_parity(recipe: Recipe, search: list[Path]) -> dict:
    """The parity status a compare report shows for ``recipe``: the newest ``parity.json`` in a
    ``search`` directory or one level below it whose fingerprint matches. ``{"status": "passed" |
    "failed" | "none", "path", "num_steps", "first_failing_step", "worst": {...}, "note"}``."""
    fingerprint, found, others = recipe_fingerprint(recipe), [], []
    candidates = {p.resolve() for d in search for p in (Path(d) / PARITY_FILE, *Path(d).glob(f"*/{PARITY_FILE}"))
                  if p.is_file()}
    for path in candidates:
        try:
            report = ParityReport.load(path.parent)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a parity report this version reads
        if report.recipe_fingerprint == fingerprint:
            found.append((path.stat().st_mtime, str(path), report))
        elif report.recipe == recipe.name:
            others.append(str(path))
    if not found:
        note = f"{sorted(others)[0]} is for another configuration of {recipe.name}" if others else ""
        return {"status": "none", "path": None, "note": note}
    _, path, report = max(found, key=lambda f: f[0])
    return {"status": "passed" if report.passed else "failed", "path": path, "num_steps": report.num_steps,
            "first_failing_step": report.first_failing_step, "worst": report.worst(), "note": ""}
