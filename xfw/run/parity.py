"""Parity: do both backends train the same model? One recipe, the same start, losses compared.

``run_parity`` forces what makes the two sides comparable (fp32, AMP O0, one process, no
warm-up), exports the PyTorch side's seeded initial weights once to a neutral file
(``xfw.contract.weights``; LoRA adapters included), points both runs' ``model.weights`` at it, and
runs each backend through the launcher with the gradient norm recorded per step (the
harness's ``grad_norm`` knob). The batches are the same by construction (``xfw.contract.synthetic``
draws every input, noise and timestep included, from the spec's seed). Then it compares the
loss and the gradient norm per step::

    report = run_parity("recipes/tiny/llava_sft.yaml", [], 10, Path("runs/parity"), {},
                        backends=("torch", "paddle"))
    print(report.markdown())   # also runs/parity/parity.json
    # runs/parity/{weights/model.safetensors, torch/..., paddle/..., parity.json}

Tolerances (the targets of issue 5): the step-0 loss, computed from identical weights on
identical inputs, may differ only by fp32 rounding (relative ≤ 1e-5); every later step
(after the optimizer has amplified rounding differences) relative ≤ 1e-3. The gradient norm:
the same two bounds (measured values and why: GRAD_NORM_REL, docs/parity.md).
``find_parity`` gives a compare report the status of a parity run of the same recipe.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from xfw.run import launcher
from xfw.contract import records as rec
from xfw.contract.harness import GRAD_NORM_KNOB
from xfw.run.recipe import Recipe, RecipeError, load_recipe, resolve_spec, to_dict
from xfw.contract.atomic import write_json_atomic

PARITY_SCHEMA = 1


# An interpreter's description does not change while this process lives; asking once per
# backend saves a framework import (~2 s) per parity run after the first.
describe_backend = functools.lru_cache(maxsize=None)(launcher.describe_backend)


GRAD_NORM_REL = 1e-3
"""Relative gradient-norm difference allowed after step 0, the loss trajectory's tolerance. Measured over 10
steps of every tiny recipe (fp32, CPU): ≤ 1e-5, 10-40x the loss differences (a gradient is a difference of
nearly equal terms, so it carries rounding further); 1e-3 leaves two orders of magnitude for longer runs.
A side that kept its own LoRA A measured 3.1e-4 at step 0 (over step 0's 1e-5) and 9.0e-3 at step 1, while
its losses stayed within theirs (docs/parity.md)."""


class ParityError(ValueError):
    """Parity could not start (a bad recipe, a missing backend, an export that failed); one line."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Tolerances:
    step0_rel: float = 1e-5
    """Relative loss difference allowed at the first step: same weights, same batch, fp32 rounding only."""
    step_rel: float = 1e-3
    """Relative loss difference allowed at every step of the trajectory."""
    grad_norm_step0_rel: float | None = 1e-5
    """Relative gradient-norm difference allowed at the first step (same weights, same batch:
    measured ≤ 1.1e-7); None: reported, never failed."""
    grad_norm_rel: float | None = GRAD_NORM_REL
    """Relative gradient-norm difference allowed at every later step; None: reported, never failed."""

    def for_step(self, index: int) -> float:
        return self.step0_rel if index == 0 else self.step_rel

    def grad_norm_for_step(self, index: int) -> float | None:
        return self.grad_norm_step0_rel if index == 0 else self.grad_norm_rel


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
    grad_norm_reference: float | None = None
    """Global L2 norm of the trainable gradients before this step's optimizer update."""
    grad_norm_other: float | None = None
    grad_norm_abs_diff: float | None = None
    grad_norm_rel_diff: float | None = None
    """|other − reference| / |reference| of the gradient norms (against Tolerances.grad_norm_rel)."""


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
    recipe_fingerprint: str | None = None
    """:func:`recipe_fingerprint` of the recipe as given (what a compare report matches on)."""

    @property
    def passed(self) -> bool:
        return not self.problems and len(self.steps) == self.num_steps and all(s.passed for s in self.steps)

    @property
    def first_failing_step(self) -> int | None:
        return next((s.step for s in self.steps if not s.passed), None)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(schema=PARITY_SCHEMA, passed=self.passed, first_failing_step=self.first_failing_step,
                    backends=list(self.backends), worst=self.worst())
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ParityReport":
        data = {k: v for k, v in data.items() if k not in ("schema", "passed", "first_failing_step", "worst")}
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
        t = self.tolerances
        g_tol = (f"≤ {t.grad_norm_step0_rel:g} at step 0, ≤ {t.grad_norm_rel:g} at every step"
                 if t.grad_norm_step0_rel is not None and t.grad_norm_rel is not None else "reported only")
        lines = [f"## Parity: {self.recipe} — {verdict}", "",
                 f"{self.num_steps} steps, fp32 AMP O0, 1 process, both sides from `{self.weights_dir}`. "
                 f"Tolerance: relative loss difference ≤ {t.step0_rel:g} at step 0, "
                 f"≤ {t.step_rel:g} at every step; relative gradient-norm difference {g_tol}.", "",
                 f"| step | {ref} loss | {other} loss | abs diff | rel diff | tolerance "
                 f"| {ref} grad norm | {other} grad norm | grad abs diff | grad rel diff | |",
                 "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|"]
        for s in self.steps:
            cells = [_num(s.loss_reference, ".8f"), _num(s.loss_other, ".8f"), _num(s.abs_diff, ".2e"),
                     _num(s.rel_diff, ".2e"), f"{s.tolerance_rel:g}", _num(s.grad_norm_reference, ".6g"),
                     _num(s.grad_norm_other, ".6g"), _num(s.grad_norm_abs_diff, ".2e"),
                     _num(s.grad_norm_rel_diff, ".2e")]
            lines.append(f"| {s.step} | {' | '.join(cells)} | {'✓' if s.passed else '✗'} |")
        worst = self.worst()
        if worst["loss_rel_diff"] is not None:
            lines += ["", f"Worst relative difference: loss {worst['loss_rel_diff']:.2e} (step {worst['loss_step']})"
                      + (f", gradient norm {worst['grad_norm_rel_diff']:.2e} (step {worst['grad_norm_step']})"
                         if worst["grad_norm_rel_diff"] is not None else "") + "."]
        if self.first_failing_step is not None:
            lines += ["", f"First step outside tolerance: {self.first_failing_step}."]
            if self.first_differing_module:
                lines.append(f"First module whose output differs (first batch, starting weights): "
                             f"`{self.first_differing_module}`.")
        if self.problems or self.notes:
            lines += ["", *(f"* {p}" for p in self.problems + self.notes)]
        return "\n".join(lines) + "\n"

    def worst(self) -> dict:
        """The largest relative loss and gradient-norm differences and their steps (None: none)."""
        out: dict = {"loss_rel_diff": None, "loss_step": None, "grad_norm_rel_diff": None, "grad_norm_step": None}
        for s in self.steps:
            for key, value in (("loss", s.rel_diff), ("grad_norm", s.grad_norm_rel_diff)):
                if value is not None and (out[f"{key}_rel_diff"] is None or not value <= out[f"{key}_rel_diff"]):
                    out[f"{key}_rel_diff"], out[f"{key}_step"] = value, s.step
        return out


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _diff(values: tuple[list, list], i: int) -> tuple[float | None, float | None, float | None, float | None]:
    """(reference, other, abs diff, rel diff) at index i; None where a side has no value."""
    a = values[0][i] if i < len(values[0]) else None
    b = values[1][i] if i < len(values[1]) else None
    if a is None or b is None:
        return a, b, None, None
    return a, b, abs(b - a), abs(b - a) / max(abs(a), 1e-30)


def compare_losses(reference: list[float | None], other: list[float | None],
                   tolerances: Tolerances = Tolerances(), *,
                   grad_norms: tuple[list[float | None], list[float | None]] | None = None) -> list[StepParity]:
    """Per step: absolute and relative difference, and pass/fail against its tolerance. A step
    with a loss missing on either side, or not finite, fails. With ``grad_norms`` (reference's,
    other's per step) the gradient norms are compared too, against
    ``tolerances.grad_norm_for_step`` where both sides have one (a norm missing on a side is
    shown as missing, not failed: runs recorded before the knob existed have none)."""
    out = []
    for i in range(max(len(reference), len(other))):
        a, b, abs_diff, rel = _diff((reference, other), i)
        ok = rel is not None and rel <= tolerances.for_step(i)  # NaN compares false: fails
        g = _diff(grad_norms, i) if grad_norms is not None else (None, None, None, None)
        g_tol = tolerances.grad_norm_for_step(i)
        if g[0] is not None and g[1] is not None and g_tol is not None:
            ok = ok and g[3] <= g_tol  # NaN compares false: fails
        out.append(StepParity(step=i, loss_reference=a, loss_other=b, abs_diff=abs_diff, rel_diff=rel,
                              tolerance_rel=tolerances.for_step(i), passed=ok, grad_norm_reference=g[0],
                              grad_norm_other=g[1], grad_norm_abs_diff=g[2], grad_norm_rel_diff=g[3]))
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
    try:
        launcher.adapter_task(backend, ["--probe-modules", str(path), "--spec", str(run_dir / "spec.json")],
                              timeout_s=timeout_s, failed="the module probe failed")
        return json.loads(path.read_text())["modules"]
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
    directory.mkdir(parents=True, exist_ok=True)
    spec_path = directory / "spec.json"
    write_json_atomic(spec_path, resolve_spec(recipe, backend=backend.name, run_id=f"{directory.parent.name}/export"))
    try:
        launcher.adapter_task(backend, ["--export-weights", str(directory), "--spec", str(spec_path)],
                              timeout_s=timeout_s, failed="could not export the initial weights")
    except launcher.BackendError as err:
        raise ParityError(str(err)) from None


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
        result = launcher.launch(recipe, backend, run_dir, description=described[name])
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
            report.notes.append("the module probe did not run on both sides")
        else:
            report.first_differing_module = first_differing_module(*probes)
    if any(len(v) != steps for v in losses.values()):
        report.problems.append(f"measured steps: {reference} {len(losses[reference])}, {other} {len(losses[other])}, "
                               f"asked {steps}")
    report.save(out_dir)
    return report


# What parity sets itself (and a compare run may set differently): not part of "the same recipe".
_NOT_FINGERPRINTED = ("precision", "parallel", "measure", "backends")


def recipe_fingerprint(recipe: Recipe) -> str:
    """A digest of what the model and its training are: the recipe without the sections parity
    forces (precision, parallel, measure, backends) and without ``model.weights``. A compare run
    and a parity run of one recipe, with the same ``--set`` on anything else, share it."""
    data = {k: v for k, v in to_dict(recipe).items() if k not in _NOT_FINGERPRINTED}
    data["model"] = {k: v for k, v in data["model"].items() if k != "weights"}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def find_parity(recipe: Recipe, search: list[Path]) -> dict:
    """The parity status a compare report shows for ``recipe``: the newest ``parity.json`` in a
    ``search`` directory or one level below it whose fingerprint matches. ``{"status": "passed" |
    "failed" | "none", "path", "num_steps", "first_failing_step", "worst": {...}, "note"}``."""
    fingerprint, found, others = recipe_fingerprint(recipe), [], []
    candidates = {p.resolve() for d in search for p in (Path(d) / "parity.json", *Path(d).glob("*/parity.json"))
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
