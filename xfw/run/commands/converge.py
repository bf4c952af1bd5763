"""Converge: speed at equal quality. Both sides train the recipe as it says, for several seeds, from
one exported start per seed, on identical batches; a held-out split is evaluated every K steps.

``run_converge`` builds, under ``out_dir``::

    speed/<backend>/             the ordinary speed measurement of the recipe (its measured window: ips)
    speed-window/<backend>/      ...measured longer instead, when the recipe's window is under compare's minimum
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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from xfw.contract import records as rec
from xfw.contract.atomic import UnreadableFile, read_json_object
from xfw.report.compare import compare_runs
from xfw.report.converge import DEFAULT_MARGIN, ConvergeReport, SeedRun, Speed, analyse
from xfw.report.converge_target import speed_of
from xfw.report.decision import check_margin
from xfw.report.results import RunResult
from xfw.report.trust import MIN_WINDOW_S, TARGET_WINDOW_S
from xfw.run.launch import jobs, launcher
from xfw.run.commands import parity as par
from xfw.recipe import Recipe, RecipeError, load_recipe
from xfw.recipe.spec import resolve_spec

PRECISION_MECHANISMS = ("mechanism.master_weights", "mechanism.master_grads", "mechanism.grad_reduce_dtype")
"""How each side carried out its precision (``applied.mechanisms``): compare shows them; converge, which
asks whether precision cost quality, lists every difference among them (and among the backends' knobs)."""
MAX_SEEDS = 100
"""The most seeds one converge may run (``--seeds``, ``--max-seeds``): checked before anything launches."""
AUTO_START = 2
"""``--seeds auto`` starts with this many seeds: the fewest that give an interval."""
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
    margin: float = DEFAULT_MARGIN
    direction: str = "two-sided"
    max_seeds: int | None = None
    """Sequential (``--seeds auto`` or ``--max-seeds``): add seeds one at a time up to this many until decided."""
    """The recipe as the user gave it (the speed runs' recipe)."""
    num_samples: int
    timeout_s: float
    """Each learning curve's limit: ``--set measure.timeout_s`` as given, else the recipe's (meant for
    its own warm-up and measured steps) scaled by how many more steps a curve takes."""
    notes: list[str] = field(default_factory=list)

    @property
    def looks(self) -> int:
        """How many decisions a sequential converge may take: at the start count and after each added seed."""
        return 1 if self.max_seeds is None else self.max_seeds - len(self.seeds) + 1

    def seed_overrides(self, seed: int) -> list[str]:
        """What a learning-curve run forces on the recipe: its seed for both the start and the data,
        no warm-up (step 0 is the first step from the shared start), N steps, the evaluations."""
        return [f"measure.seed={seed}", f"data.seed={seed}", "measure.warmup_steps=0", f"measure.steps={self.steps}",
                "measure.repeat=1", f"measure.eval_every={self.eval_every}", f"data.eval_samples={self.eval_samples}",
                f"measure.timeout_s={self.timeout_s:g}"]


def plan(recipe_path: str, overrides: list[str], *, backends: tuple[str, str], seeds: int | str, steps: int,
         eval_every: int, eval_samples: int | None = None, target: float | None = None,
         margin: float | str = DEFAULT_MARGIN, direction: str = "two-sided", max_seeds: int | None = None) -> Plan:
    """Every input checked (ConvergeError / RecipeError, one line naming the key); nothing launched.
    ``seeds``: a count, or ``auto`` (start at :data:`AUTO_START`, needs ``max_seeds``); with ``max_seeds``
    the seeds are added one at a time until the decision is reached (alpha spent across the looks)."""
    import math

    if len(backends) != 2 or backends[0] == backends[1]:
        raise ConvergeError(f"--backends {','.join(backends)!r}: converge compares exactly two backends")
    try:
        margin = check_margin(margin)
    except ValueError as err:
        raise ConvergeError(str(err)) from None
    directions = ("two-sided", *(f"{b}-worse" for b in backends))
    if direction not in directions:
        raise ConvergeError(f"--direction: {direction!r} (one of {', '.join(directions)})")
    if seeds == "auto":
        if max_seeds is None:
            raise ConvergeError("--seeds auto: needs --max-seeds N, the budget (how many seeds at most)")
        seeds = AUTO_START
    if isinstance(seeds, str):
        try:
            seeds = int(seeds)
        except ValueError:
            raise ConvergeError(f"--seeds: {seeds!r} (a count, or auto with --max-seeds)") from None
    if not 1 <= seeds <= MAX_SEEDS:
        raise ConvergeError(f"--seeds: {seeds} (must be 1 to {MAX_SEEDS})")
    if max_seeds is not None and not seeds <= max_seeds <= MAX_SEEDS:
        raise ConvergeError(f"--max-seeds: {max_seeds} (must be at least --seeds {seeds} and at most {MAX_SEEDS})")
    if max_seeds is not None and max_seeds < 2:
        raise ConvergeError(f"--max-seeds: {max_seeds} (a decision needs at least 2 seeds)")
    if target is not None and not isinstance(target, bool) and isinstance(target, (int, float)) and target <= 0:
        raise ConvergeError(f"--target: {target} (an eval loss is a cross-entropy or a mean squared error, never "
                            "below 0: no curve can reach a target at or below 0)")
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
    num_samples = int(_prepared(recipe, recipe_path)["stats"]["num_samples"])
    if eval_samples is None:
        eval_samples = recipe.data.eval_samples or max(1, round(num_samples * DEFAULT_EVAL_FRACTION))
    if eval_samples < 1:
        raise ConvergeError(f"--eval-samples: {eval_samples} (hold out at least 1 sample)")
    # The converge's data step: prepared with its split, the split checked against the prepared samples.
    _prepared(load_recipe(recipe_path, [*overrides, f"data.eval_samples={eval_samples}"]), recipe_path)
    base, m = recipe.measure.seed, recipe.measure
    given = any(o.split("=", 1)[0].strip() == "measure.timeout_s" for o in overrides)
    timeout_s = m.timeout_s if given else m.timeout_s * max(1.0, steps / (m.warmup_steps + m.steps))
    chosen = Plan(recipe_path=recipe_path, overrides=list(overrides), backends=tuple(backends),
                  seeds=[base + k for k in range(seeds)], steps=steps, eval_every=eval_every,
                  eval_samples=eval_samples, target=None if target is None else float(target), recipe=recipe,
                  num_samples=num_samples, timeout_s=min(timeout_s, 7 * 24 * 3600.0), margin=margin,
                  direction=direction, max_seeds=max_seeds)
    for seed in range(base, base + (max_seeds or seeds)):  # every run's recipe validates (an override, a seed past the key's bound)
        load_recipe(recipe_path, [*overrides, *chosen.seed_overrides(seed)])
    trained = num_samples - eval_samples
    epochs = steps * recipe.batch.global_size / trained
    chosen.notes.append(f"data: {trained} training samples, {eval_samples} held out (the same for every seed); "
                        f"{steps} steps of {recipe.batch.global_size} samples = {epochs:.1f} epochs")
    if seeds < 2 and max_seeds is None:
        chosen.notes.append("one seed: no interval can be estimated, so the decision is undecided")
    if max_seeds is not None:
        chosen.notes.append(f"sequential: {seeds} seeds first, then one more at a time until decided, at most "
                            f"{max_seeds}; α {0.05:g} spent across the {chosen.looks} looks (Kim-DeMets, ρ = 2)")
    return chosen


def _prepared(recipe: Recipe, recipe_path: str) -> dict:
    """The recipe's real data prepared (``xfw.run.data.prepare_data``, the one writer of the cache), before
    anything launches; a refusal is a RecipeError naming the recipe file."""
    from xfw.run import data as real

    try:
        return real.prepare_data(recipe)
    except real.DataError as err:
        raise RecipeError(f"{recipe_path}: {err}") from None


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


def _export_seeds(chosen: Plan, seeds: list[int], backend: launcher.Backend, out_dir: Path,
                  log=lambda line: None) -> dict[int, object]:
    """The reference side's start for each seed into ``seed-<s>/weights``: fp32, one process, as parity
    exports it, and without the reference's own per-backend override (the start is both sides'; an override
    changes how one side trains from it); both sides load it. A start is kept when its directory already
    holds an export of the same spec (a resumed or repeated converge; ``--force`` replaces runs, and an
    export of the same spec is the same file); the others are exported together, by one process (the
    framework imported once), and one by one only when that fails, so that each failure names its seed.
    Returns, per seed, True (exported), False (kept) or the :class:`ConvergeError` that stopped it."""
    wanted = {}
    for seed in seeds:
        overrides = [*chosen.overrides, *chosen.seed_overrides(seed), *par.forced_overrides(chosen.steps),
                     f"backends.{backend.name}.override={{}}"]
        wanted[seed] = resolve_spec(load_recipe(chosen.recipe_path, overrides), backend=backend.name,
                                    run_id=f"seed-{seed}/export")
    done: dict[int, object] = {}
    for seed, spec in wanted.items():
        directory = _weights_dir(out_dir, seed)
        try:
            old = read_json_object(directory / "spec.json")
        except UnreadableFile:
            old = {}
        if (directory / "model.safetensors").is_file() and jobs.same_spec(old, spec):
            done[seed] = False
    todo = [seed for seed in seeds if seed not in done]
    timeout_s = chosen.recipe.measure.timeout_s
    try:
        if len(todo) > 1:
            log(f"seeds {', '.join(map(str, todo))}: {backend.name} exports their starts (one process)")
        if todo:
            par.export_starts(backend, [(_weights_dir(out_dir, s), wanted[s]) for s in todo], timeout_s)
        done.update((seed, True) for seed in todo)
    except par.ParityError as err:
        if len(todo) == 1:
            return {**done, todo[0]: ConvergeError(f"seed {todo[0]}: {err}")}
        for seed in todo:  # again one at a time: which seed's start could not be written, and why
            try:
                par.export_starts(backend, [(_weights_dir(out_dir, seed), wanted[seed])], timeout_s)
                done[seed] = True
            except par.ParityError as err:
                done[seed] = ConvergeError(f"seed {seed}: {err}")
    return done


def _weights_dir(out_dir: Path, seed: int) -> Path:
    return (Path(out_dir) / f"seed-{seed}" / "weights").resolve()  # absolute: the adapters may run elsewhere


def _settled(result: RunResult) -> SeedRun:
    return SeedRun(status=result.status, reason=result.reason, run_dir=result.run_dir)


def _speed(chosen: Plan, out_dir: Path, resolved: jobs.Backends, *, force: bool, progress, log,
           variant: dict | None, curve_step_s: float | None = None) -> tuple[dict[str, Speed], list[RunResult]]:
    """Each side's ips from the recipe's ordinary measured window, with its interval (over repeats, else
    over the window's steps). A window shorter than compare's minimum is measured again, longer, under
    ``speed-window/`` (the recipe's steps scaled to about :data:`TARGET_WINDOW_S`), and that one is used.
    ``curve_step_s``: the faster side's median step in the learning curves (:func:`curve_step_s`); when
    the recipe's window at that pace is below the minimum, the ordinary window is not run at all and the
    longer one is measured at once (one run per side fewer; it is re-measured only as before)."""
    m = chosen.recipe.measure
    results, windows = [], []
    if ordinary_first(m.steps, curve_step_s):
        speed_jobs = speed_jobs_for(chosen, out_dir, variant)
        log(f"speed: the recipe's ordinary measured window on each side ({len(speed_jobs)} runs)")
        results, _ = jobs.run_jobs(speed_jobs, resolved, resume=True, force=force, progress=progress, log=log)
        windows = [r.measurement.window_time_s for r in results if r.ok and r.measurement.window_time_s]
    if not results or (windows and min(windows) < MIN_WINDOW_S):
        wanted = longer_steps(m.steps, min(windows) / m.steps if windows else curve_step_s)
        log(f"speed: the recipe's window is below compare's minimum of {MIN_WINDOW_S:g} s "
            + (f"(measured {min(windows):.2g} s)" if windows else
               f"at the learning curves' pace ({m.steps} steps of {curve_step_s:.2g} s)")
            + f": measuring {wanted} steps")
        longer = load_recipe(chosen.recipe_path, [*chosen.overrides, f"measure.steps={wanted}"])
        more = jobs.jobs_for(longer, list(chosen.backends), Path(out_dir) / "speed-window", label="speed (longer)",
                             variant=variant)
        results, _ = jobs.run_jobs(more, resolved, resume=True, force=force, progress=progress, log=log)
    speed = {}
    for name in chosen.backends:
        runs = [r for r in results if r.backend == name]
        ok = [r for r in runs if r.ok and r.measurement.ips]
        if not ok:
            speed[name] = Speed(status=runs[0].status, reason=runs[0].reason, run_dir=runs[0].run_dir)
            continue
        windows = [(r.measurement.ips, r.measurement.window_time_s or 0.0,
                    [tuple(x) for x in r.measurement.rank0_steps[-r.measurement.num_measured_steps:]]) for r in ok]
        speed[name] = Speed(status="ok", run_dir=ok[0].run_dir, **speed_of(windows))
    return speed, results


def ordinary_first(steps: int, curve_step_s: float | None) -> bool:
    """Whether the recipe's own window is worth running: no pace known, or ``steps`` at that pace reach
    compare's minimum window (a curve synchronises every step and has no warm-up, so its step is rarely
    shorter than a measured one; a window that still turns out short is measured again, longer)."""
    return curve_step_s is None or steps * curve_step_s >= MIN_WINDOW_S


def longer_steps(steps: int, step_s: float) -> int:
    """The measured steps of a window of about :data:`TARGET_WINDOW_S` at ``step_s`` a step: more than
    ``steps``, at most 20 times as many."""
    return min(steps * 20, max(steps + 1, int(TARGET_WINDOW_S / max(step_s, 1e-6)) + 1))


def curve_step_s(results: list[RunResult]) -> float | None:
    """The faster side's median step time over its learning curves that finished, or None."""
    paces: dict[str, list[float]] = {}
    for r in results:
        if r.ok and r.measurement.step_time_median_s:
            paces.setdefault(r.backend, []).append(r.measurement.step_time_median_s)
    return min(sorted(p)[len(p) // 2] for p in paces.values()) if paces else None


def run_converge(chosen: Plan, out_dir: Path, resolved: jobs.Backends, *, comparison: str, force: bool = False,
                 progress: launcher.Progress | None = None, log: Callable[[str], None] = print,
                 variant: dict | None = None, ordinary_speed: bool = False) -> ConvergeReport:
    """Run the plan (each seed's export and both sides' curves, then the speed runs) and analyse it;
    writes nothing but run directories (the caller writes the report). A run that fails is a result:
    the other seeds and sides go on. The speed runs come after the first seeds' curves, which give
    their pace: a recipe window that pace puts under compare's minimum is measured longer at once
    (:func:`_speed`); ``ordinary_speed``: always run the recipe's own window first (a nightly entry's
    history records that run). Sequential (``chosen.max_seeds``): after the first seeds, one seed
    more at a time until the final eval loss is decided or the budget is spent; each look spends its
    share of α (:func:`xfw.report.decision.spend`), and the progress says what it waits for. Ctrl-C
    raises :class:`jobs.JobsInterrupted`. ``variant``: what the speed runs' summaries record as their
    variant (a nightly entry's label), so reports keep them apart."""
    other, reference = chosen.backends  # as compare orders them: the second is the baseline
    out_dir = Path(out_dir)
    curves: dict[str, dict[int, SeedRun]] = {name: {} for name in chosen.backends}
    seed_results: list[RunResult] = []
    most = chosen.max_seeds or len(chosen.seeds)
    todo_seeds = list(chosen.seeds)
    seeds_done = 0

    starts: dict[int, object] = {}

    def one_seed(seed: int) -> None:
        weights = _weights_dir(out_dir, seed)
        if seed not in starts:
            starts.update(_export_seeds(chosen, [seed], resolved[reference][0], out_dir))
        exported = starts[seed]
        if isinstance(exported, ConvergeError):
            for name in chosen.backends:
                curves[name][seed] = SeedRun(status="crashed", reason=str(exported))
            log(str(exported))
            return
        log(f"seed {seed} ({seeds_done + 1} of {len(todo_seeds) if chosen.max_seeds is None else f'at most {most}'}"
            "): " + (f"{reference} exported the start" if exported else "the start exported earlier is kept"))
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
        seed_results.extend(results)

    def judge(look: int) -> ConvergeReport:
        differences, deliberate = settings_differences(speed_results, seed_results, list(chosen.backends))
        return analyse(curves, speed, backends=(reference, other), recipe=chosen.recipe.name, comparison=comparison,
                       steps=chosen.steps, eval_every=chosen.eval_every,
                       samples_per_step=chosen.recipe.batch.global_size, target=chosen.target, margin=chosen.margin,
                       direction=chosen.direction, look=look, max_looks=chosen.looks, deliberate=deliberate,
                       settings_differences=differences, notes=chosen.notes)

    starts.update(_export_seeds(chosen, todo_seeds, resolved[reference][0], out_dir, log=log))
    for seed in todo_seeds:
        one_seed(seed)
        seeds_done += 1
    speed, speed_results = _speed(chosen, out_dir, resolved, force=force, progress=progress, log=log, variant=variant,
                                  curve_step_s=None if ordinary_speed else curve_step_s(seed_results))
    look = 1
    report = judge(look)
    while chosen.max_seeds is not None:
        go_on, line = next_look(report.decision, seeds_done, most, look, chosen.looks, chosen.margin)
        log(line + (f"; adding seed {chosen.seeds[0] + seeds_done}" if go_on else ""))
        if not go_on:
            break
        seed = chosen.seeds[0] + seeds_done
        todo_seeds.append(seed)
        one_seed(seed)
        seeds_done += 1
        look += 1
        report = judge(look)
    return report


def next_look(d, n: int, most: int, look: int, looks: int, margin: float) -> tuple[bool, str]:
    """Whether a sequential converge adds a seed after this look, and the line that says why: decided,
    the budget spent, or what it waits for ("undecided at 3 seeds: interval −0.4%…+2.1%, margin 2.0%")."""
    if d is not None and d.decided:
        return False, f"decided at {n} seeds (look {look} of at most {looks}): {d.outcome}"
    need = f", needs about {d.needed} seeds in all" if d is not None and d.needed else ""
    if n >= most:
        return False, f"budget spent: still undecided at {n} seeds (--max-seeds {most}){need}"
    interval = (f"interval {_signed(d.low)}…{_signed(d.high)}" if d is not None and d.low is not None
                else "no interval yet")
    return True, (f"undecided at {n} seeds: {interval}, margin {margin:.1%}{need} "
                  f"(look {look} of at most {looks})")


def _signed(x: float) -> str:
    return ("+" if x >= 0 else "−") + f"{abs(x):.1%}"


def speed_jobs_for(chosen: Plan, out_dir: Path, variant: dict | None = None) -> list[jobs.Job]:
    """The speed runs of ``chosen`` under ``out_dir/speed/`` (one per backend and repeat)."""
    return jobs.jobs_for(chosen.recipe, list(chosen.backends), Path(out_dir) / "speed", label="speed",
                         variant=variant)


def settings_differences(speed_results: list[RunResult], seed_results: list[RunResult],
                         backends: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Every applied setting that differs between the sides (as ``compare`` warns about them), the
    deliberate per-backend overrides (each listed once: a warning the override explains is left out),
    and whether each seed's batches were identical on both sides; and backend -> the keys its override
    set (the default target is never taken from a side that carries one)."""
    lines: list[str] = []
    deliberate: dict[str, list[str]] = {}
    for row in compare_runs(speed_results, backends):
        lines += [d for d in row.deliberate if d not in lines]  # per-backend overrides first: asked for
        for key, names in row.deliberate_by.items():
            for name in names:
                deliberate.setdefault(name, [])
                if key.removeprefix("override.") not in deliberate[name]:
                    deliberate[name].append(key.removeprefix("override."))
        lines += [w for w in row.warnings if w not in lines and "(deliberate: " not in w]
        fp32 = all(str(v).lower() in ("float32", "fp32") for k, vals in row.settings.items()
                   if k in ("compute_dtype", "weight_dtype") for v in vals.values())
        for key, values in row.settings.items():  # what compare shows without warning, but quality depends on
            if not (key.startswith("knob.") or key in PRECISION_MECHANISMS) or len({repr(v) for v in values.values()}) < 2:
                continue
            if key in PRECISION_MECHANISMS and (fp32 or row.deliberate):  # plain fp32: both hold fp32; or asked for
                continue
            lines.append(f"{key} differs: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    rows = compare_runs(seed_results, backends)  # one row per seed (its variant)
    for row in rows:  # a curve has no warm-up step, where the attention kernel is observed: the speed runs say
        lines += [w for w in row.warnings if w not in lines and "batches" not in w and "attention_kernel" not in w
                  and "(deliberate: " not in w]
    same = [row for row in rows if row.data_line.startswith("Batches: identical")]
    if rows:
        lines.append(f"Batches: identical on both sides in {len(same)} of {len(rows)} seeds (micro-batch hashes)"
                     if len(same) == len(rows) else
                     "Batches: " + "; ".join(f"seed {row.variant.get('seed')}: {row.data_line}" for row in rows))
    return lines, deliberate
