"""Predicted memory per GPU before running: model states under each ZeRO stage and AMP level,
plus activations with and without recompute, from the neutral architecture alone::

    xfw estimate recipes/llava7b_lora.yaml                  # the recipe as written
    xfw estimate --run results/h100/llava7b-lora/micro16/torch   # that run's spec, next to its measurement

Model states, bytes per parameter (mixed-precision accounting of Rajbhandari et al. 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", Sec. 3.1):

    weights   4 (O0, O1: fp32)  or 2 (O2: bf16/fp16), for every parameter, frozen ones included
    master    4 under O2 (fp32 copy), trainable parameters only
    grads     the weight dtype (4 or 2), trainable parameters only
    Adam      8 (fp32 m and v), trainable parameters only

ZeRO stage 1 divides Adam and master weights by the number of processes, stage 2 also the
gradients, stage 3 also the weights.

Activations come from the model's family (``activation_bytes`` in ``xfw.contract.families.<family>``:
the decoder layers of LLaVA and Qwen2-VL, SD3's joint blocks, SD1.5's UNet walked block by block),
each written from the per-tensor accounting of Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Sec. 4.1. Parameter counts, trainable ones included,
come from the same family facts the adapters freeze by (``analytic_counts``), LoRA adapters
included. Allocator fragmentation, CUDA workspaces and transient buffers of the optimizer step
are not counted: the estimate aims at the allocator's peak *allocated*, from below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xfw.contract import families, presets
from xfw.report.table import Bullets, Page, Paragraph, Strong, Table

GIB = 1024**3
ZERO_STAGES = ("none", "stage1", "stage2", "stage3")
AMP_SETTINGS = (("fp32", "O0"), ("bf16", "O1"), ("bf16", "O2"))


def trainable_params(spec: dict) -> tuple[int, int]:
    """(trainable, total) parameters of the spec's model, LoRA adapters and ``model.trainable`` included."""
    counts = families.analytic_counts(spec["model"]["arch"], spec["stage"], spec.get("lora"),
                                      spec["model"].get("trainable"))
    return counts["trainable"], counts["total"]


def peak_arch(spec: dict) -> dict:
    """The architecture at the longest sequence the run can train (``data.longest``: variable-length
    synthetic data's or real data's longest sample; ``data.seq_len`` is then only a cap)."""
    arch, longest = spec["model"]["arch"], spec["data"].get("longest")
    return families.with_seq_len(arch, longest) if longest and arch["data"].get("seq_len") else arch


def model_state_bytes(total: int, trainable: int, *, amp_level: str, sharding: str, num_processes: int) -> dict:
    """Bytes per GPU of weights, master weights, gradients and Adam states (module docstring)."""
    weight_bytes = 2 if amp_level == "O2" else 4
    stage = ZERO_STAGES.index(sharding)
    shard = lambda n, from_stage: n / num_processes if stage >= from_stage else n  # noqa: E731
    return {"weights": shard(total * weight_bytes, 3),
            "master weights": shard(trainable * 4, 1) if amp_level == "O2" else 0,
            "gradients": shard(trainable * weight_bytes, 2),
            "optimizer states": shard(trainable * 8, 1)}


def activation_bytes(spec: dict, *, recompute: bool) -> float | None:
    """Stored activations at the peak for one micro-batch on one GPU; None where not estimated."""
    return families.activation_bytes(peak_arch(spec), spec["batch"]["micro"],
                                     dtype=spec["precision"]["dtype"], recompute=recompute)


@dataclass(kw_only=True)
class Estimate:
    states: dict
    """Component -> bytes per GPU for the spec's own precision and sharding."""
    activations: float | None
    activations_other: float | None
    """The same with recompute flipped."""
    recompute: bool
    trainable: int
    total: int
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> float | None:
        return sum(self.states.values()) + self.activations if self.activations is not None else None


def estimate(spec: dict) -> Estimate:
    """Estimate one resolved spec (``resolve_spec`` output or a run's spec.json)."""
    trainable, total = trainable_params(spec)
    nproc = spec["derived"]["num_processes"]
    recompute = bool(spec["recompute"])
    states = model_state_bytes(total, trainable, amp_level=spec["precision"]["amp_level"],
                               sharding=spec["parallel"]["sharding"], num_processes=nproc)
    activations = activation_bytes(spec, recompute=recompute)
    note = families.activation_note(spec["model"]["arch"], spec["batch"]["micro"], dtype=spec["precision"]["dtype"],
                                    recompute=recompute)
    notes = [note] if note else []
    longest, cap = spec["data"].get("longest"), spec["model"]["arch"]["data"].get("seq_len")
    if longest and cap and longest != cap:
        notes.append(f"activations at the longest sample the data can hold, {longest} tokens (data.seq_len {cap} "
                     "is only a cap here)")
    if activations is None:
        notes.append(f"no activation estimate for the {spec['model']['arch']['family']} family: model states only")
    return Estimate(states=states, activations=activations,
                    activations_other=activation_bytes(spec, recompute=not recompute), recompute=recompute,
                    trainable=trainable, total=total, notes=notes)


def states_matrix(spec: dict) -> Table:
    """Model states (GiB per GPU) for every ZeRO stage x AMP level, at the spec's process count."""
    trainable, total = trainable_params(spec)
    nproc = spec["derived"]["num_processes"]
    cells, records = [], []
    for stage in ZERO_STAGES:
        row = [stage]
        for dtype, level in AMP_SETTINGS:
            states = model_state_bytes(total, trainable, amp_level=level, sharding=stage, num_processes=nproc)
            row.append(f"{sum(states.values()) / GIB:.2f}")
            records.append({"sharding": stage, "dtype": dtype, "amp_level": level,
                            "model_state_bytes": sum(states.values())})
        cells.append(row)
    return Table(title=f"Model states (GiB per GPU) by sharding and precision, at {nproc} process{'es' if nproc != 1 else ''}:",
                 header=["Sharding"] + [f"{dtype} {level}" for dtype, level in AMP_SETTINGS], cells=cells,
                 numeric=tuple(range(1, 1 + len(AMP_SETTINGS))))


def _gib(value: float | None) -> str:
    return "–" if value is None else f"{value / GIB:.2f}"


def to_page(spec: dict, est: Estimate, measured: dict | None = None) -> Page:
    """The estimate of one spec as a page: components, the total, the measurement beside it when
    given, recompute flipped, and model states for every sharding stage and precision."""
    nproc = spec["derived"]["num_processes"]
    recompute = "on" if est.recompute else "off"
    rows = [[k, _gib(v)] for k, v in est.states.items()]
    rows += [[f"activations (recompute {recompute})", _gib(est.activations)], [Strong("total"), Strong(_gib(est.total_bytes))]]
    if measured:
        alloc, reserved = measured.get("mem_alloc_peak_bytes"), measured.get("mem_reserved_peak_bytes")
        err = (est.total_bytes - alloc) / alloc if est.total_bytes is not None and alloc else None
        rows += [[f"measured peak allocated ({measured.get('mem_source')})", _gib(alloc)],
                 ["measured peak reserved", _gib(reserved)],
                 ["estimate error vs allocated", f"{err:+.0%}" if err is not None else "–"]]
    blocks: list = [
        Paragraph(f"{presets.display_name(spec['model']['preset'])} {spec['stage']}, micro-batch "
                  f"{spec['batch']['micro']}, {spec['precision']['dtype']} {spec['precision']['amp_level']}, sharding "
                  f"{spec['parallel']['sharding']} over {nproc} process{'es' if nproc != 1 else ''}, recompute {recompute}; "
                  f"{est.trainable:,} trainable of {est.total:,} parameters."),
        Table(header=["Component", "GiB per GPU"], cells=rows, numeric=(1,), name="estimate"),
        Paragraph(f"With recompute {'off' if est.recompute else 'on'}, activations would be "
                  f"{_gib(est.activations_other)} GiB."),
        states_matrix(spec)]
    blocks += [Bullets(est.notes)] if est.notes else []
    blocks.append(Paragraph("Formulas and sources: `xfw/report/estimate.py` (ZeRO, Rajbhandari et al. 2020; "
                            "activations, Korthikanti et al. 2022).", muted=True))
    return Page(title=f"Memory estimate: {spec['name']}", blocks=blocks)
