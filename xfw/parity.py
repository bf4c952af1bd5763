"""Parity: do both backends train the same model? One recipe, the same start, losses compared.

``run_parity`` forces what makes the two sides comparable (fp32, AMP O0, one process, no
warm-up), exports the PyTorch side's seeded initial weights once to a neutral file
(``xfw.weights``), points both runs' ``model.weights`` at it, and runs each backend through
the launcher. The batches are the same by construction (``xfw.synthetic`` draws every input,
noise and timestep included, from the spec's seed). Then it compares the loss per step::

    report = run_parity("recipes/tiny/llava_sft.yaml", [], 10, Path("runs/parity"), {})
    print(report.markdown())   # also runs/parity/parity.json
    # runs/parity/{weights/model.safetensors, torch/..., paddle/..., parity.json}

Tolerances (the targets of issue 5): the step-0 loss, computed from identical weights on
identical inputs, may differ only by fp32 rounding (relative ≤ 1e-5); every later step
(after the optimizer has amplified rounding differences) relative ≤ 1e-3.
"""

from __future__ import annotations

import functools
import json
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from xfw import launcher
from xfw import records as rec
from xfw.recipe import RecipeError, load_recipe, resolve_spec
from xfw.results import write_json_atomic

PARITY_SCHEMA = 1


# An interpreter's description does not change while this process lives; asking once per
# backend saves a framework import (~2 s) per parity run after the first.
describe_backend = functools.lru_cache(maxsize=None)(launcher.describe_backend)


class ParityError(ValueError):
    """Parity could not start (a bad recipe, a missing backend, an export that failed); one line."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Tolerances:
    step0_rel: float = 1e-5
    """Relative loss difference allowed at the first step: same weights, same batch, fp32 rounding only."""
    step_rel: float = 1e-3
    """Relative loss difference allowed at every step of the trajectory."""

    def for_step(self, index: int) -> float:
        return self.step0_rel if index == 0 else self.step_rel


@dataclass(frozen=True, kw_only=True, slots=True)
class StepParity:
    step: int
    loss_reference: float | None
    loss_other: float | None
    abs_diff: float | None
    rel_diff: float | None
    """|other − reference| / |reference|."""
    tolerance_rel: float
    passed: bool


@dataclass(kw_only=True)
class ParityReport:
    recipe: str
    num_steps: int
    weights_dir: str
    run_dirs: dict[str, str]
    tolerances: Tolerances
    steps: list[StepParity] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """Why the comparison is incomplete (a run failed, steps missing); empty when it is whole."""
    notes: list[str] = field(default_factory=list)
    """What the reader should know that is not a failure (a side given its own weights)."""
    first_differing_module: str | None = None
    """When a step fails: the first module (canonical name, forward order) whose output norm
    differs on the first batch from each side's starting weights; None if none does or no probe ran."""
    backends: tuple[str, str] = ("reference", "other")
    """(reference, other): the reference exports the starting weights both sides load."""

    @property
    def passed(self) -> bool:
        return not self.problems and len(self.steps) == self.num_steps and all(s.passed for s in self.steps)

    @property
    def first_failing_step(self) -> int | None:
        return next((s.step for s in self.steps if not s.passed), None)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(schema=PARITY_SCHEMA, passed=self.passed, first_failing_step=self.first_failing_step,
                    backends=list(self.backends))
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ParityReport":
        data = {k: v for k, v in data.items() if k not in ("schema", "passed", "first_failing_step")}
        return cls(**{**data, "tolerances": Tolerances(**data["tolerances"]),
                      "steps": [StepParity(**s) for s in data["steps"]], "backends": tuple(data["backends"])})

    def save(self, out_dir: str | Path) -> Path:
        path = Path(out_dir) / "parity.json"
        write_json_atomic(path, self.to_dict())
        return path

    @classmethod
    def load(cls, out_dir: str | Path) -> "ParityReport":
        return cls.from_dict(json.loads((Path(out_dir) / "parity.json").read_text()))

    def markdown(self) -> str:
        ref, other = self.backends
        verdict = "PASS" if self.passed else "FAIL"
        lines = [f"## Parity: {self.recipe} — {verdict}", "",
                 f"{self.num_steps} steps, fp32 AMP O0, 1 process, both sides from `{self.weights_dir}`. "
                 f"Tolerance: relative loss difference ≤ {self.tolerances.step0_rel:g} at step 0, "
                 f"≤ {self.tolerances.step_rel:g} at every step.", "",
                 f"| step | {ref} loss | {other} loss | abs diff | rel diff | tolerance | |",
                 "|---:|---:|---:|---:|---:|---:|:-:|"]
        for s in self.steps:
            cells = [_num(s.loss_reference, ".8f"), _num(s.loss_other, ".8f"), _num(s.abs_diff, ".2e"),
                     _num(s.rel_diff, ".2e")]
            lines.append(f"| {s.step} | {' | '.join(cells)} | {s.tolerance_rel:g} | {'✓' if s.passed else '✗'} |")
        if self.first_failing_step is not None:
            lines += ["", f"First step outside tolerance: {self.first_failing_step}."]
            if self.first_differing_module:
                lines.append(f"First module whose output differs (first batch, starting weights): "
                             f"`{self.first_differing_module}`.")
        if self.problems or self.notes:
            lines += ["", *(f"* {p}" for p in self.problems + self.notes)]
        return "\n".join(lines) + "\n"


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def compare_losses(reference: list[float | None], other: list[float | None],
                   tolerances: Tolerances = Tolerances()) -> list[StepParity]:
    """Per step: absolute and relative difference, and pass/fail against its tolerance. A step
    with a loss missing on either side, or not finite, fails."""
    out = []
    for i in range(max(len(reference), len(other))):
        a = reference[i] if i < len(reference) else None
        b = other[i] if i < len(other) else None
        abs_diff = rel = None
        if a is not None and b is not None:
            abs_diff = abs(b - a)
            rel = abs_diff / max(abs(a), 1e-30)
        ok = rel is not None and rel <= tolerances.for_step(i)  # NaN compares false: fails
        out.append(StepParity(step=i, loss_reference=a, loss_other=b, abs_diff=abs_diff, rel_diff=rel,
                              tolerance_rel=tolerances.for_step(i), passed=ok))
    return out


MODULE_REL_TOL = 1e-5
"""Relative output-norm difference that marks a module as differing: fp32 rounding through the
tiny models reaches ~1e-7 (measured on tiny-llava), a changed weight far more."""


def first_differing_module(reference: list[dict], other: list[dict], rel_tol: float = MODULE_REL_TOL) -> str | None:
    """The first module, in the reference's forward order, whose output norm differs beyond
    ``rel_tol`` (``{"name", "norm"}`` entries from ``--probe-modules``). Modules only one side
    calls as a module (a parameter used directly) are skipped."""
    norms = {m["name"]: m["norm"] for m in other}
    for m in reference:
        theirs = norms.get(m["name"])
        if theirs is not None and not abs(theirs - m["norm"]) <= rel_tol * max(abs(m["norm"]), 1e-30):
            return m["name"]
    return None


def probe(backend: launcher.Backend, run_dir: Path, timeout_s: float) -> list[dict] | None:
    """``--probe-modules`` on the spec a run used; None if the adapter could not."""
    path = run_dir / "modules.json"
    cmd = [backend.python, "-m", backend.module, "--probe-modules", str(path), "--spec", str(run_dir / "spec.json")]
    try:
        subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        return json.loads(path.read_text())["modules"]
    except (subprocess.TimeoutExpired, OSError, ValueError, KeyError):
        return None


def measured_losses(run_dir: Path) -> list[float | None]:
    """Rank 0's measured losses in step order, from the run's ``steps.jsonl``."""
    steps = [r for r in rec.load_records(run_dir / "steps.jsonl")
             if r.get("kind") == "step" and r.get("rank") == 0 and r.get("phase") == "measure"]
    return [r.get("loss") for r in sorted(steps, key=lambda r: r["step"])]


def forced_overrides(steps: int, weights_dir: Path | str | None = None) -> list[str]:
    """What parity forces, applied after the user's overrides (``model.weights`` only once the
    shared starting point exists: the export itself starts from the recipe's own)."""
    forced = ["precision.dtype=fp32", "precision.amp_level=O0", "parallel.nproc_per_node=1",
              "parallel.nnodes=1", "parallel.sharding=none", "measure.warmup_steps=0",
              f"measure.steps={int(steps)}", "measure.repeat=1"]
    return forced + ([f"model.weights={weights_dir}"] if weights_dir is not None else [])


def export_initial_weights(recipe_path: str, overrides: list[str], backend: launcher.Backend, directory: Path,
                           timeout_s: float) -> None:
    """Ask ``backend``'s adapter to write the recipe's initial model to ``directory``."""
    recipe = load_recipe(recipe_path, overrides)
    directory.mkdir(parents=True, exist_ok=True)
    spec_path = directory / "spec.json"
    write_json_atomic(spec_path, resolve_spec(recipe, backend=backend.name, run_id=f"{directory.parent.name}/export"))
    cmd = [backend.python, "-m", backend.module, "--export-weights", str(directory), "--spec", str(spec_path)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise ParityError(f"exporting the initial weights took over {timeout_s:g} s: {' '.join(cmd)}") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise ParityError(f"{backend.name} could not export the initial weights ({last})")


def run_parity(recipe_path: str, overrides: list[str], steps: int, out_dir: Path,
               interpreters: dict[str, str], *, backends: tuple[str, str], tolerances: Tolerances = Tolerances(),
               weights: dict[str, str] | None = None) -> ParityReport:
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
        base = load_recipe(recipe_path, [*overrides, *forced_overrides(steps)])
    except (RecipeError, launcher.BackendError) as err:
        raise ParityError(str(err)) from None
    export_initial_weights(recipe_path, [*overrides, *forced_overrides(steps)], resolved[reference], weights_dir,
                           base.measure.timeout_s)
    report = ParityReport(recipe=base.name, num_steps=steps, weights_dir=str(weights_dir), run_dirs={},
                          tolerances=tolerances, backends=(reference, other))
    losses = {}
    for name, backend in resolved.items():
        start = Path((weights or {}).get(name, weights_dir)).resolve()
        recipe = load_recipe(recipe_path, [*overrides, *forced_overrides(steps, start)])
        run_dir = out_dir / name
        result = launcher.launch(recipe, backend, run_dir, description=described[name])
        report.run_dirs[name] = str(run_dir)
        if start != weights_dir:
            report.notes.append(f"{name} started from {start}, not the shared export")
        if not result.ok:
            report.problems.append(f"{name} run {result.status}: {result.reason}")
        losses[name] = measured_losses(run_dir)
    report.steps = compare_losses(losses[reference], losses[other], tolerances)
    if report.first_failing_step is not None:
        probes = [probe(resolved[name], out_dir / name, base.measure.timeout_s) for name in (reference, other)]
        if None in probes:
            report.notes.append("the module probe did not run on both sides")
        else:
            report.first_differing_module = first_differing_module(*probes)
    if any(len(v) != steps for v in losses.values()):
        report.problems.append(f"measured steps: {reference} {len(losses[reference])}, {other} {len(losses[other])}, "
                               f"asked {steps}")
    report.save(out_dir)
    return report
