"""Parity verdicts: two backends' losses and gradient norms per step, held to stated tolerances.

:func:`compare_losses` compares the per-step values of a reference and another backend; a
:class:`ParityReport` (``parity.json``) keeps them with the tolerances, what went wrong and, when a
step failed, the first module whose output differs (:func:`first_differing_module`)::

    steps = compare_losses([2.0, 1.9], [2.0 + 1e-6, 1.9 + 1e-4])
    [s.passed for s in steps]            # [True, True]: 5e-7 ≤ 1e-5 at step 0, 5e-5 ≤ 1e-3 after

Tolerances: the step-0 loss, computed from identical weights on identical inputs, may differ only by
fp32 rounding (relative ≤ 1e-5); every later step (after the optimizer has amplified rounding
differences) relative ≤ 1e-3. The gradient norm is part of the verdict, with the same two bounds
(:data:`GRAD_NORM_REL`, docs/parity.md). A module's output differs beyond :data:`MODULE_REL_TOL`,
element by element. Running parity is :mod:`xfw.run.commands.parity`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from xfw.contract.atomic import write_json_atomic
from xfw.report.table import Bullets, Page, Paragraph, Strong, Table, to_markdown

PARITY_SCHEMA = 1
PARITY_FILE = "parity.json"


GRAD_NORM_REL = 1e-3
"""Relative gradient-norm difference allowed after step 0, the loss trajectory's tolerance. Measured over 10
steps of every tiny recipe (fp32, CPU): ≤ 1e-5, 10-40x the loss differences (a gradient is a difference of
nearly equal terms, so it carries rounding further); 1e-3 leaves two orders of magnitude for longer runs.
A side that kept its own LoRA A measured 3.1e-4 at step 0 (over step 0's 1e-5) and 9.0e-3 at step 1, while
its losses stayed within theirs (docs/parity.md)."""


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
    """When a step fails: the first module (canonical name, forward order) whose output differs,
    element by element, on the first batch from each side's starting weights; None when none could
    be named (``module_note`` says why)."""
    module_difference: dict | None = None
    """How that module's outputs differ (:func:`module_differences`' entry)."""
    module_note: str = ""
    """When a step failed and no module was named: why (the probe did not run, or no module's output
    differs on the first batch: the difference arises later, in backward or the optimizer step)."""
    backends: tuple[str, str] = ("reference", "other")
    """(reference, other): the reference exports the starting weights both sides load."""
    recipe_fingerprint: str | None = None
    """``xfw.run.commands.parity.recipe_fingerprint`` of the recipe as given (what a compare report matches on)."""

    @property
    def passed(self) -> bool:
        return not self.problems and len(self.steps) == self.num_steps and all(s.passed for s in self.steps)

    @property
    def first_failing_step(self) -> int | None:
        return next((s.step for s in self.steps if not s.passed), None)

    def locate(self, reference: Probe, other: Probe) -> None:
        """Name the first module whose output differs, or say why none could be."""
        self.module_difference = first_differing_module(reference, other)
        self.first_differing_module = self.module_difference["name"] if self.module_difference else None
        if self.module_difference is None:
            compared = len(module_differences(reference, other))
            self.module_note = (f"no module could be named: none of the {compared} modules both sides call has an "
                                f"output that differs beyond {MODULE_REL_TOL:g} of its largest magnitude on the first "
                                "batch, so the difference arises later (backward, the gradient norm, the optimizer)")

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
        path = Path(out_dir) / PARITY_FILE
        write_json_atomic(path, self.to_dict())
        return path

    @classmethod
    def load(cls, out_dir: str | Path) -> "ParityReport":
        from xfw.contract.atomic import read_json_object

        return cls.from_dict(read_json_object(Path(out_dir) / PARITY_FILE))

    def page(self) -> Page:
        ref, other = self.backends
        t = self.tolerances
        g_tol = (f"≤ {t.grad_norm_step0_rel:g} at step 0, ≤ {t.grad_norm_rel:g} at every step"
                 if t.grad_norm_step0_rel is not None and t.grad_norm_rel is not None else "reported only")
        header = ["step", f"{ref} loss", f"{other} loss", "abs diff", "rel diff", "tolerance", f"{ref} grad norm",
                  f"{other} grad norm", "grad abs diff", "grad rel diff", ""]
        cells = [[str(s.step), _num(s.loss_reference, ".8f"), _num(s.loss_other, ".8f"), _num(s.abs_diff, ".2e"),
                  _num(s.rel_diff, ".2e"), f"{s.tolerance_rel:g}", _num(s.grad_norm_reference, ".6g"),
                  _num(s.grad_norm_other, ".6g"), _num(s.grad_norm_abs_diff, ".2e"), _num(s.grad_norm_rel_diff, ".2e"),
                  "✓" if s.passed else Strong("✗")] for s in self.steps]
        blocks: list = [Paragraph(f"{self.num_steps} steps, fp32 AMP O0, 1 process, both sides from "
                                  f"`{self.weights_dir}`. Tolerance: relative loss difference ≤ {t.step0_rel:g} at "
                                  f"step 0, ≤ {t.step_rel:g} at every step; relative gradient-norm difference "
                                  f"{g_tol}. A step passes only when both are within: the gradient norm is part of the "
                                  "verdict, and catches a difference the loss hides (a changed vision weight can move "
                                  "the loss by less than its tolerance)."),
                        Table(header=header, cells=cells, numeric=tuple(range(10)),
                              records=[asdict(s) for s in self.steps], name="parity")]
        worst = self.worst()
        if worst["loss_rel_diff"] is not None:
            blocks.append(Paragraph(
                f"Worst relative difference: loss {worst['loss_rel_diff']:.2e} (step {worst['loss_step']})"
                + (f", gradient norm {worst['grad_norm_rel_diff']:.2e} (step {worst['grad_norm_step']})"
                   if worst["grad_norm_rel_diff"] is not None else "") + "."))
        if self.first_failing_step is not None:
            blocks.append(Paragraph(f"First step outside tolerance: {self.first_failing_step}."))
            blocks.append(Paragraph(self.module_line()))
        if self.problems or self.notes:
            blocks.append(Bullets(self.problems + self.notes))
        return Page(title=f"Parity: {self.recipe} — {'PASS' if self.passed else 'FAIL'}", blocks=blocks)

    def module_line(self) -> str:
        """Which module's output differs first, and how; or why none could be named."""
        d = self.module_difference
        if self.first_differing_module and d:
            how = (f"{d['num_differing']:,} of {d['size']:,} elements beyond tolerance, max |Δ| {d['max_abs_diff']:.3g} "
                   f"({d['rel_diff']:.2e} of the output's largest magnitude)" if d["compared"] == "elements" else
                   f"output norms differ by {d['rel_diff']:.2e} (outputs not comparable element by element)")
            return (f"First module whose output differs (first batch, each side's starting weights): "
                    f"`{self.first_differing_module}`: {how}.")
        if self.first_differing_module:
            return f"First module whose output differs (first batch, starting weights): `{self.first_differing_module}`."
        return (self.module_note or "No module could be named.").rstrip(".") + "."

    def markdown(self) -> str:
        return to_markdown(self.page())

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


MODULE_REL_TOL = 1e-4
"""A module's output differs when some element differs by more than this fraction of the output's
largest magnitude (max |other − reference| > MODULE_REL_TOL × max |reference|), compared element by
element on the first batch from each side's starting weights. Measured with identical weights (fp32,
CPU, every tiny recipe): at most 1.5e-6 (docs/parity.md); a changed weight moves its module's output
by far more, and a negated one by 2x its magnitude while its norm stays the same."""

Probe = tuple[list[dict], dict]
"""A side's module probe (``xfw.contract.module_outputs.read_probe``): modules in call order, their outputs."""


def module_differences(reference: Probe, other: Probe, rel_tol: float = MODULE_REL_TOL) -> list[dict]:
    """Every module both sides called, in the reference's forward order, with how its outputs differ:
    element by element where both kept an output of the same shape (or as many elements with the
    same last dimension, in row-major order), else by the output norm (a probe written before
    outputs were kept, or a layout one side does not share). Each entry::

        {"name", "compared": "elements" | "norm", "max_abs_diff", "rel_diff", "num_differing", "size", "differs"}

    ``rel_diff``: max |Δ| over max |reference| (elements), or |Δ norm| over the norm."""
    (ref_modules, ref_out), (other_modules, other_out) = reference, other
    norms = {m["name"]: m["norm"] for m in other_modules}
    out = []
    for m in ref_modules:
        name = m["name"]
        if name not in norms:
            continue  # only one side calls it as a module (a parameter used directly)
        a, b = ref_out.get(name), other_out.get(name)
        if a is not None and b is not None and a.shape != b.shape and a.size == b.size and a.shape[-1:] == b.shape[-1:]:
            b = b.reshape(a.shape)  # one side batches what the other flattens (Qwen2-VL's vision blocks)
        if a is not None and b is not None and a.shape == b.shape:
            diff = np.abs(b.astype(np.float64) - a.astype(np.float64))
            scale = max(float(np.abs(a).max()) if a.size else 0.0, 1e-30)
            worst = float(diff.max()) if diff.size else 0.0
            differing = diff > rel_tol * scale
            entry = {"compared": "elements", "max_abs_diff": worst, "rel_diff": worst / scale,
                     "num_differing": int(np.count_nonzero(differing | np.isnan(diff))), "size": int(a.size)}
        else:
            worst = abs(norms[name] - m["norm"])
            entry = {"compared": "norm", "max_abs_diff": worst, "rel_diff": worst / max(abs(m["norm"]), 1e-30),
                     "num_differing": None, "size": None}
        entry["differs"] = not entry["rel_diff"] <= rel_tol  # NaN differs
        out.append({"name": name, **entry})
    return out


def first_differing_module(reference: Probe, other: Probe, rel_tol: float = MODULE_REL_TOL) -> dict | None:
    """The first module, in the reference's forward order, whose output differs beyond ``rel_tol``
    (:func:`module_differences`); None when none does."""
    return next((d for d in module_differences(reference, other, rel_tol) if d["differs"]), None)
