"""Converge: speed at equal quality. Both sides train the recipe as it says, for several seeds, from
one exported start per seed, on identical batches; a held-out split is evaluated every K steps.

``run_converge`` builds, under ``out_dir``::

    speed/<backend>/             the ordinary speed measurement of the recipe (its measured window: ips)
    seed-<s>/weights/            the reference side's exported start for seed s (both sides load it)
    seed-<s>/<backend>/          a learning curve: measure.seed = data.seed = s, no warm-up, N steps,
                                 every step synchronised, eval records every K steps (xfw.contract.harness)
    converge.json .md .csv .html .png    xfw.report.converge: the verdict per eval point, time to target

What a seed varies: the initial weights (``measure.seed``) and the batch order and per-step draws
(``data.seed``); the held-out split is the same for every seed (``xfw.contract.batches.held_out``).
Every run is an ordinary run directory, kept when the same command runs again (a killed converge
resumes: settled runs are kept, a crashed or cut-off one runs again), and ``xfw report`` reads them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from xfw.contract import records as rec
from xfw.contract.atomic import UnreadableFile, read_json_object
from xfw.report.compare import compare_runs
from xfw.report.converge import ConvergeReport, SeedRun, Speed, analyse
from xfw.report.results import RunResult
from xfw.run import jobs, launcher
from xfw.run import parity as par
from xfw.run.recipe import Recipe, load_recipe
from xfw.run.spec import resolve_spec

PRECISION_MECHANISMS = ("mechanism.master_weights", "mechanism.master_grads", "mechanism.grad_reduce_dtype")
"""How each side carried out its precision (``applied.mechanisms``): compare shows them; converge, which
asks whether precision cost quality, lists every difference among them (and among the backends' knobs)."""
DEFAULT_EVAL_FRACTION = 0.1
"""Without ``data.eval_samples`` (or ``--eval-samples``), converge holds out this share of the data set."""


class ConvergeError(ValueError):
    """Converge could not start (bad input, an export that failed); one line naming the key."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What one converge command runs: checked before anything launches (:func:`plan`)."""

    recipe_path: str
    overrides: list[str]
    backends: tuple[str, str]
    """(other, reference) as the user named them, compare's order: the reference (second) exports each
    seed's start, and the first side is contrasted against it."""
    seeds: list[int]
    steps: int
    eval_every: int
    eval_samples: int
    target: float | None
    recipe: Recipe
    """The recipe as the user gave it (the speed runs' recipe)."""
    num_samples: int
    timeout_s: float
    """Each learning curve's limit: ``--set measure.timeout_s`` as given, else the recipe's (meant for
    its own warm-up and measured steps) scaled by how many more steps a curve takes."""
    notes: list[str] = field(default_factory=list)

    def seed_overrides(self, seed: int) -> list[str]:
        """What a learning-curve run forces on the recipe: its seed for both the start and the data,
        no warm-up (step 0 is the first step from the shared start), N steps, the evaluations."""
        return [f"measure.seed={seed}", f"data.seed={seed}", "measure.warmup_steps=0", f"measure.steps={self.steps}",
                "measure.repeat=1", f"measure.eval_every={self.eval_every}", f"data.eval_samples={self.eval_samples}",
                f"measure.timeout_s={self.timeout_s:g}"]


def plan(recipe_path: str, overrides: list[str], *, backends: tuple[str, str], seeds: int, steps: int,
         eval_every: int, eval_samples: int | None = None, target: float | None = None) -> Plan:
    """Every input checked (ConvergeError / RecipeError, one line naming the key); nothing launched."""
    import math

    if len(backends) != 2 or backends[0] == backends[1]:
        raise ConvergeError(f"--backends {','.join(backends)!r}: converge compares exactly two backends")
    if seeds < 1:
        raise ConvergeError(f"--seeds: {seeds} (must be at least 1)")
    if eval_every < 1:
        raise ConvergeError(f"--eval-every: {eval_every} (must be at least 1 step)")
    if steps < eval_every:
        raise ConvergeError(f"--steps: {steps} is fewer than --eval-every {eval_every}: no evaluation would happen "
                            "during training (give more steps or evaluate more often)")
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                               or not math.isfinite(target)):
        raise ConvergeError(f"--target: {target!r} is not a finite number (a loss to reach)")
    recipe = load_recipe(recipe_path, overrides)
    if recipe.data.kind == "synthetic":
        raise ConvergeError(f"{recipe_path}: data.kind: converge needs real data (llava_json or image_captions) to "
                            "hold out an eval split; synthetic batches are a cycled pool of random samples")
    num_samples = _num_samples(recipe)
    if eval_samples is None:
        eval_samples = recipe.data.eval_samples or max(1, round(num_samples * DEFAULT_EVAL_FRACTION))
    if eval_samples < 1:
        raise ConvergeError(f"--eval-samples: {eval_samples} (hold out at least 1 sample)")
    load_recipe(recipe_path, [*overrides, f"data.eval_samples={eval_samples}"])  # the split checked here
    base, m = recipe.measure.seed, recipe.measure
    given = any(o.split("=", 1)[0].strip() == "measure.timeout_s" for o in overrides)
    timeout_s = m.timeout_s if given else m.timeout_s * max(1.0, steps / (m.warmup_steps + m.steps))
    chosen = Plan(recipe_path=recipe_path, overrides=list(overrides), backends=tuple(backends),
                  seeds=[base + k for k in range(seeds)], steps=steps, eval_every=eval_every,
                  eval_samples=eval_samples, target=None if target is None else float(target), recipe=recipe,
                  num_samples=num_samples, timeout_s=min(timeout_s, 7 * 24 * 3600.0))
    for seed in chosen.seeds:  # every run's recipe validates (an override, a seed past the key's bound)
        load_recipe(recipe_path, [*overrides, *chosen.seed_overrides(seed)])
    trained = num_samples - eval_samples
    epochs = steps * recipe.batch.global_size / trained
    chosen.notes.append(f"data: {trained} training samples, {eval_samples} held out (the same for every seed); "
                        f"{steps} steps of {recipe.batch.global_size} samples = {epochs:.1f} epochs")
    if seeds < 2:
        chosen.notes.append("one seed: no seed-to-seed spread can be estimated, so no verdict is given")
    return chosen


def _num_samples(recipe: Recipe) -> int:
    from xfw.contract import presets
    from xfw.run import data as real

    arch = presets.resolve_arch(recipe.model.preset, recipe.model.arch, recipe.data.image_size, recipe.data.seq_len)
    return int(real.prepare(recipe, arch)["stats"]["num_samples"])  # prepared once by load_recipe: a lookup


def _rank0(run_dir: Path) -> tuple[list, list]:
    """(train points, eval points) of rank 0: (step, samples seen after it, loss)."""
    try:
        per_step = int(read_json_object(run_dir / "spec.json")["batch"]["global"])
    except (UnreadableFile, KeyError, TypeError, ValueError):
        return [], []
    train, evals = [], []
    for r in rec.load_records(run_dir / "steps.jsonl"):
        if r.get("rank") == 0 and r.get("kind") == "step":
            train.append((r["step"], (r["step"] + 1) * per_step, r.get("loss")))
        elif r.get("rank") == 0 and r.get("kind") == "eval":
            evals.append((r["step"], r["samples_seen"], r.get("eval_loss")))
    return sorted(train), sorted(evals)


def _export(chosen: Plan, seed: int, backend: launcher.Backend, directory: Path) -> bool:
    """The reference side's start for ``seed`` into ``directory``: fp32, one process, as parity exports
    it, and without the reference's own per-backend override (the start is both sides'; an override
    changes how one side trains from it); both sides load it. Kept when the directory already holds an
    export of the same spec (a resumed or repeated converge; ``--force`` replaces runs, and an export of
    the same spec is the same file). Returns whether it exported."""
    overrides = [*chosen.overrides, *chosen.seed_overrides(seed), *par.forced_overrides(chosen.steps),
                 f"backends.{backend.name}.override={{}}"]
    wanted = resolve_spec(load_recipe(chosen.recipe_path, overrides), backend=backend.name, run_id="export")
    try:
        old = read_json_object(directory / "spec.json")
    except UnreadableFile:
        old = {}
    if (directory / "model.safetensors").is_file() and jobs.same_spec(old, wanted):
        return False
    try:
        par.export_initial_weights(chosen.recipe_path, overrides, backend, directory, chosen.recipe.measure.timeout_s)
    except par.ParityError as err:
        raise ConvergeError(f"seed {seed}: {err}") from None
    return True


def _settled(result: RunResult) -> SeedRun:
    return SeedRun(status=result.status, reason=result.reason, run_dir=result.run_dir)


def run_converge(chosen: Plan, out_dir: Path, resolved: jobs.Backends, *, comparison: str, force: bool = False,
                 progress: launcher.Progress | None = None, log: Callable[[str], None] = print,
                 variant: dict | None = None) -> ConvergeReport:
    """Run the plan (the speed runs, then each seed's export and both sides' curves) and analyse it;
    writes nothing but run directories (the caller writes the report). A run that fails is a result:
    the other seeds and sides go on. Ctrl-C raises :class:`jobs.JobsInterrupted`. ``variant``: what the
    speed runs' summaries record as their variant (a nightly entry's label), so reports keep them apart."""
    other, reference = chosen.backends  # as compare orders them: the second is the baseline
    out_dir = Path(out_dir)
    speed_jobs = speed_jobs_for(chosen, out_dir, variant)
    log(f"speed: the recipe's ordinary measured window on each side ({len(speed_jobs)} runs)")
    speed_results, _ = jobs.run_jobs(speed_jobs, resolved, resume=True, force=force, progress=progress, log=log)
    speed = {}
    for name in chosen.backends:
        runs = [r for r in speed_results if r.backend == name]
        ok = [r.measurement.ips for r in runs if r.ok and r.measurement.ips]
        speed[name] = Speed(status="ok" if ok else runs[0].status, reason="" if ok else runs[0].reason,
                            run_dir=runs[0].run_dir, ips=statistics.median(ok) if ok else None,
                            window_s=runs[0].measurement.window_time_s)
    curves: dict[str, dict[int, SeedRun]] = {name: {} for name in chosen.backends}
    seed_results: list[RunResult] = []
    for i, seed in enumerate(chosen.seeds, 1):
        weights = (out_dir / f"seed-{seed}" / "weights").resolve()
        try:
            exported = _export(chosen, seed, resolved[reference][0], weights)
            log(f"seed {seed} ({i} of {len(chosen.seeds)}): " + (f"{reference} exported the start" if exported else
                                                                  "the start exported earlier is kept"))
        except ConvergeError as err:
            for name in chosen.backends:
                curves[name][seed] = SeedRun(status="crashed", reason=str(err))
            log(f"seed {seed}: {err}")
            continue
        recipe = load_recipe(chosen.recipe_path, [*chosen.overrides, *chosen.seed_overrides(seed),
                                                  f"model.weights={weights}"])
        curve = {"seed": seed, "run": "learning curve (every step synchronised)"}
        todo = [jobs.Job(recipe=recipe, backend=name, run_dir=out_dir / f"seed-{seed}" / name, variant=curve,
                         label=f"seed {seed} / {name}") for name in chosen.backends]
        results, _ = jobs.run_jobs(todo, resolved, resume=True, force=force, progress=progress, log=log)
        for result in results:
            run = _settled(result)
            run.train, run.eval = _rank0(Path(result.run_dir))
            curves[result.backend][seed] = run
        seed_results += results
    differences = settings_differences(speed_results, seed_results, list(chosen.backends))
    return analyse(curves, speed, backends=(reference, other), recipe=chosen.recipe.name, comparison=comparison,
                   steps=chosen.steps, eval_every=chosen.eval_every,
                   samples_per_step=chosen.recipe.batch.global_size, target=chosen.target,
                   settings_differences=differences, notes=chosen.notes)


def speed_jobs_for(chosen: Plan, out_dir: Path, variant: dict | None = None) -> list[jobs.Job]:
    """The speed runs of ``chosen`` under ``out_dir/speed/`` (one per backend and repeat)."""
    return jobs.jobs_for(chosen.recipe, list(chosen.backends), Path(out_dir) / "speed", label="speed",
                         variant=variant)


def settings_differences(speed_results: list[RunResult], seed_results: list[RunResult],
                         backends: list[str]) -> list[str]:
    """Every applied setting that differs between the sides (as ``compare`` warns about them), the
    deliberate per-backend overrides, and whether each seed's batches were identical on both sides."""
    lines: list[str] = []
    for row in compare_runs(speed_results, backends):
        lines += [d for d in row.deliberate if d not in lines]  # per-backend overrides first: asked for
        lines += [w for w in row.warnings if w not in lines]
        for key, values in row.settings.items():  # what compare shows without warning, but quality depends on
            if (key.startswith("knob.") or key in PRECISION_MECHANISMS) and len({repr(v) for v in values.values()}) > 1:
                lines.append(f"{key} differs: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    rows = compare_runs(seed_results, backends)  # one row per seed (its variant)
    for row in rows:  # a curve has no warm-up step, where the attention kernel is observed: the speed runs say
        lines += [w for w in row.warnings if w not in lines and "batches" not in w and "attention_kernel" not in w]
    same = [row for row in rows if row.data_line.startswith("Batches: identical")]
    if rows:
        lines.append(f"Batches: identical on both sides in {len(same)} of {len(rows)} seeds (micro-batch hashes)"
                     if len(same) == len(rows) else
                     "Batches: " + "; ".join(f"seed {row.variant.get('seed')}: {row.data_line}" for row in rows))
    return lines
