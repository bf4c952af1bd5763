"""Model families: what the core knows about each architecture, framework-free, one module each.

A family module (``xfw.contract.families.llava`` ...) owns, for its neutral architecture fields:

* ``check(arch)``: validation, raising :class:`ArchError` ``(key, message)``;
* ``make_batch(arch, micro, rng)``: one synthetic micro-batch of numpy arrays;
* ``PARTS``: the model's named parts, each a tuple of prefixes of canonical parameter names
  (transformers' / diffusers' own, ``xfw.contract.weights``);
* ``count_params(arch)``: the analytic parameter count of each part (its keys are the part names,
  plus ``total``), which both adapters must match;
* ``STAGE_PARTS``: the stages the family supports and the parts each trains; stage ``lora``
  adds adapters on top;
* ``LORA_MODULE``: the canonical name of the module LoRA adapters go into; ``LORA_TARGETS``: the
  module names a recipe's ``lora.targets`` may use; ``lora_linears(arch)``: (in, out) of every
  linear under ``LORA_MODULE`` each of those names matches;
* ``flop_ledger(arch, trained, lora, recompute)``: every matrix product of one sample's training
  step when the parts ``trained`` train (:mod:`xfw.contract.families.flops`; ``lora`` the spec's lora
  section in stage lora, else None), whose tally gives model FLOPs per part and the recomputation on top;
* ``activation_bytes(arch, micro, *, dtype, recompute)``: stored activations at the peak, and
  optionally ``activation_note(...)``, a sentence for the estimate's report;
* optionally ``PAD``: ``{key: (axis, value)}`` for the batch keys whose length varies per sample
  (a value may be a function of the architecture), used by :func:`collate`, and ``BATCH_AXES``:
  ``{key: axis}`` where samples stack on another axis than 0; ``fixed_tokens(arch)``: the
  sequence positions of a sample that are not text (image tokens and their markers).

The functions below ask those facts for any architecture; both adapters select what trains with
them, and ``xfw.report.estimate`` / ``xfw.report.mfu`` count with them. For LLaVA-1.6 pretraining::

    >>> arch = xfw.contract.presets.resolve_arch("tiny-llava-next", {}, None, None)
    >>> trainable_parts(arch, "pretrain")
    ('projector', 'newline')
    >>> trains(arch, ("projector", "newline"), "model.image_newline")
    True
    >>> analytic_counts(arch, "pretrain")["trainable_parts"]
    {'projector': 6272, 'newline': 64}

Family modules import numpy and this package only, so ``xfw.contract.presets`` can read them all.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Iterable

import numpy as np

from xfw.contract.families import flops
from xfw.contract.families.flops import FlopCount
from xfw.contract.hf_names import is_lora

FAMILIES = {
    "llava": "xfw.contract.families.llava",
    "qwen2vl": "xfw.contract.families.qwen2vl",
    "sd15": "xfw.contract.families.sd15",
    "sd3": "xfw.contract.families.sd3",
}
LORA = "lora"
"""The part LoRA adapters are counted under (they sit inside ``LORA_MODULE`` but belong to no base part)."""


class ArchError(ValueError):
    """An architecture a family cannot build; ``key`` is the recipe key to change."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def family_module(name: str) -> ModuleType:
    if name not in FAMILIES:
        raise KeyError(f"unknown model family {name!r}")
    return importlib.import_module(FAMILIES[name])


def _facts(arch: dict) -> ModuleType:
    return family_module(arch["family"])


def part_of(arch: dict, name: str) -> str:
    """The part a canonical parameter name belongs to (:data:`LORA` for LoRA adapters); a name in
    no part is an error: the model has a parameter its family does not know about."""
    if is_lora(name):
        return LORA
    for part, prefixes in _facts(arch).PARTS.items():
        if name.startswith(prefixes):
            return part
    raise KeyError(f"parameter {name!r} is in no part of the {arch['family']} model "
                   f"(parts: {', '.join(_facts(arch).PARTS)})")


def trainable_parts(arch: dict, stage: str, chosen: Iterable[str] | None = None) -> tuple[str, ...]:
    """The parts ``stage`` trains, besides the LoRA adapters of stage lora; ``chosen`` (a recipe's
    ``model.trainable``, checked by :func:`check_parts`) replaces the stage's own choice."""
    table = _facts(arch).STAGE_PARTS
    if stage not in table:
        raise KeyError(f"stage {stage!r} for the {arch['family']} family (known: {', '.join(table)})")
    return table[stage] if chosen is None else tuple(chosen)


def check_parts(arch: dict, names: Iterable[str], stage: str) -> None:
    """A recipe's ``model.trainable``: every name must be one of the family's parts, and in stage lora
    none may hold the LoRA module (its base weights stay frozen under the adapters) (ArchError)."""
    facts = _facts(arch)
    known = tuple(facts.PARTS)
    for name in names:
        if name not in known:
            raise ArchError("model.trainable", f"{name!r} is not a part of the {arch['family']} model "
                            f"(parts: {', '.join(known)})")
        if stage == "lora" and any(f"{facts.LORA_MODULE}.".startswith(p) or p.startswith(f"{facts.LORA_MODULE}.")
                                   for p in facts.PARTS[name]):
            raise ArchError("model.trainable", f"{name!r} holds {facts.LORA_MODULE}, where stage lora trains only "
                            "the adapters")


def trains(arch: dict, parts: Iterable[str], name: str) -> bool:
    """Whether the parameter with this canonical name trains when ``parts`` do. LoRA adapters
    always train: they exist only to."""
    part = part_of(arch, name)
    return part == LORA or part in tuple(parts)


def lora_module(arch: dict) -> str:
    """The canonical name of the module stage lora injects adapters into, e.g. ``model.language_model``."""
    return _facts(arch).LORA_MODULE


def count_lora_params(arch: dict, lora: dict) -> int:
    """Parameters LoRA adds: r x (in + out) for every linear a target names (``lora_linears``)."""
    linears = _facts(arch).lora_linears(arch)
    return sum(lora["r"] * (n_in + n_out) for target in lora["targets"] for n_in, n_out in linears[target])


def analytic_counts(arch: dict, stage: str, lora: dict | None = None, trainable: Iterable[str] | None = None) -> dict:
    """What a model built for ``stage`` must hold, from the architecture alone::

        {"total": N, "trainable": M, "parts": {part: N_part, ..., "lora": N_lora},
         "trainable_parts": {part: M_part, ...}}        # parts that train, none empty

    ``lora`` (the spec's lora section) only for stage lora; ``trainable`` the recipe's
    ``model.trainable`` (None: the stage's parts); the same shape as :func:`tally`."""
    parts = {part: n for part, n in _facts(arch).count_params(arch).items() if part != "total"}
    trained = trainable_parts(arch, stage, trainable)
    if stage == "lora":
        parts[LORA] = count_lora_params(arch, lora)
        trained = (*trained, LORA)
    return {"total": sum(parts.values()), "trainable": sum(parts[p] for p in trained), "parts": parts,
            "trainable_parts": {p: parts[p] for p in trained if parts[p]}}


def tally(arch: dict, params: Iterable[tuple[str, int, bool]]) -> dict:
    """The same counts from a built model: ``(canonical name, size, trainable?)`` per parameter."""
    parts = {part: 0 for part in _facts(arch).PARTS}
    trainable: dict[str, int] = {}
    for name, size, trainable_now in params:
        part = part_of(arch, name)
        parts[part] = parts.get(part, 0) + size
        if trainable_now:
            trainable[part] = trainable.get(part, 0) + size
    return {"total": sum(parts.values()), "trainable": sum(trainable.values()), "parts": parts,
            "trainable_parts": trainable}


def count_flops(arch: dict, stage: str, lora: dict | None = None, *, recompute: bool = False,
                trainable: Iterable[str] | None = None) -> FlopCount | None:
    """One sample's training FLOPs by term, model and recomputed (``xfw.contract.families.flops``)
    when the stage's parts train (or ``trainable``, a recipe's ``model.trainable``); ``lora``: the
    spec's lora section (stage lora). None where the family keeps no ledger."""
    ledger = getattr(_facts(arch), "flop_ledger", None)
    if ledger is None:
        return None
    trained = trainable_parts(arch, stage, trainable)
    return flops.tally(ledger(arch, trained, lora if stage == "lora" else None, recompute))


def flops_per_sample(arch: dict, stage: str, lora: dict | None = None,
                     trainable: Iterable[str] | None = None) -> float | None:
    """Model training FLOPs of one sample (``xfw.report.mfu``): recomputation excluded; None where
    the family keeps no ledger."""
    count = count_flops(arch, stage, lora, trainable=trainable)
    return count.model if count is not None else None


def flop_term(arch: dict, module: str) -> str:
    """The ledger term a module's products belong to, by its canonical name: :data:`LORA` for
    adapters (``...q_proj.lora_A...``), else its part; ``other`` for a module in no part (a wrapper
    around the parts, e.g. the root)."""
    if ".lora_A" in f".{module}" or ".lora_B" in f".{module}":
        return LORA
    for part, prefixes in _facts(arch).PARTS.items():
        if f"{module}.".startswith(prefixes):
            return part
    return "other"


def spec_parts(spec: dict) -> tuple[str, ...]:
    """The parts a resolved spec trains (its ``model.trainable``, else its stage's)."""
    return trainable_parts(spec["model"]["arch"], spec["stage"], spec["model"].get("trainable"))


# -- batches --------------------------------------------------------------------------------------

def fixed_tokens(arch: dict) -> int:
    """Sequence positions of one sample that are not text (image tokens and their markers); 0
    for families without a language sequence."""
    count = getattr(_facts(arch), "fixed_tokens", None)
    return count(arch) if count else 0


def with_seq_len(arch: dict, seq_len: int) -> dict:
    """The architecture with another ``data.seq_len`` (a shallow copy: the rest is shared)."""
    return {**arch, "data": {**arch["data"], "seq_len": seq_len}}


def collate(arch: dict, samples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Batches of one sample each, joined into one micro-batch: every key concatenated on its batch
    axis (``BATCH_AXES``, else 0), the keys of the family's ``PAD`` padded first, at the end of
    their axis, to the micro-batch's longest sample. Samples of equal length are only stacked."""
    facts = _facts(arch)
    axes, pads = getattr(facts, "BATCH_AXES", {}), getattr(facts, "PAD", {})
    out = {}
    for key in samples[0]:
        arrays = [s[key] for s in samples]
        if key in pads:
            axis, value = pads[key]
            longest = max(a.shape[axis] for a in arrays)
            if any(a.shape[axis] != longest for a in arrays):
                fill = value(arch) if callable(value) else value
                arrays = [a if a.shape[axis] == longest else
                          np.pad(a, [(0, longest - a.shape[axis]) if i == axis else (0, 0) for i in range(a.ndim)],
                                 constant_values=fill) for a in arrays]
        out[key] = np.concatenate(arrays, axis=axes.get(key, 0))
    return out


def activation_bytes(arch: dict, micro: int, *, dtype: str, recompute: bool) -> float | None:
    """Stored activations at the peak for one micro-batch on one GPU (``xfw.report.estimate``);
    None where the family has no count."""
    count = getattr(_facts(arch), "activation_bytes", None)
    return count(arch, micro, dtype=dtype, recompute=recompute) if count else None


def activation_note(arch: dict, micro: int, *, dtype: str, recompute: bool) -> str | None:
    """A sentence on how the family's activation count was reached, where it has one to say."""
    note = getattr(_facts(arch), "activation_note", None)
    return note(arch, micro, dtype=dtype, recompute=recompute) if note else None
