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

Activations of one decoder layer, in bytes for 16-bit activations (x2 for fp32), following the
per-tensor accounting of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Sec. 4.1 (their Eq. 1 gives 34sbh + 5as^2b for a GPT layer), redone for
the Llama/Qwen2 layer these presets use (RMSNorm, GQA, SwiGLU, no dropout) with fused SDPA
attention, which keeps no s x s score matrix (so no 5as^2b term)::

    per layer = 4sbh (2 norm inputs) + 2sbh (q/k/v input) + 2sbh + 4sb·kv (q, k, v)
              + 2sbh (o_proj input) + 2sbh (MLP input) + 8sbf (gate, up, silu(gate), product)
              = 12sbh + 4sb·kv + 8sbf
    full recompute: 2sbh per layer (its input) + one layer's full activations while it is recomputed
    loss: 4sbV (fp32 log-probabilities kept for backward) + 6sbV transient (the logits and their fp32 copy)

s = sequence length (image tokens included), b = micro-batch, h = hidden size, f = MLP size,
kv = key/value width, V = vocabulary. The frozen vision tower runs without gradients and keeps
no activations; projector and LoRA intermediates are ignored (small). SD3's joint blocks are
counted as two GPT layers (34sbh each, Korthikanti Eq. 1 without the score term) over the image
and text tokens; SD1.5's UNet has no estimate. Allocator fragmentation, CUDA workspaces and
transient buffers of the optimizer step are not counted: the estimate aims at the allocator's
peak *allocated*, from below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xfw import presets
from xfw.families.llava import count_lora_params

GIB = 1024**3
ZERO_STAGES = ("none", "stage1", "stage2", "stage3")
AMP_SETTINGS = (("fp32", "O0"), ("bf16", "O1"), ("bf16", "O2"))


def trainable_params(spec: dict) -> tuple[int, int, str]:
    """(trainable, total, note) from the neutral architecture and the stage."""
    arch, stage = spec["model"]["arch"], spec["stage"]
    counts = presets.count_params(arch)
    family, note = arch["family"], ""
    if family in ("llava", "qwen2vl"):  # the vision tower is frozen in every stage
        lora = count_lora_params(arch, spec["lora"]) if stage == "lora" else 0  # adapters add parameters
        trainable = {"pretrain": counts["projector"], "sft": counts["projector"] + counts["text"],
                     "lora": counts["projector"] + lora}
        return trainable[stage], counts["total"] + lora, note
    if family == "sd15" and stage == "pretrain":
        return counts["unet"], counts["total"], note
    if family == "sd3" and stage == "dreambooth":
        return counts["transformer"], counts["total"], note
    return 0, counts["total"], "LoRA adapters on a diffusion model are not counted (well under 1% of the weights)"


def model_state_bytes(total: int, trainable: int, *, amp_level: str, sharding: str, num_processes: int) -> dict:
    """Bytes per GPU of weights, master weights, gradients and Adam states (module docstring)."""
    weight_bytes = 2 if amp_level == "O2" else 4
    stage = ZERO_STAGES.index(sharding)
    shard = lambda n, from_stage: n / num_processes if stage >= from_stage else n  # noqa: E731
    return {"weights": shard(total * weight_bytes, 3),
            "master weights": shard(trainable * 4, 1) if amp_level == "O2" else 0,
            "gradients": shard(trainable * weight_bytes, 2),
            "optimizer states": shard(trainable * 8, 1)}


def _decoder_layer_bytes(text: dict, s: int, b: int) -> tuple[float, int]:
    h, f = text["hidden_size"], text["intermediate_size"]
    kv = h // text["num_heads"] * text["num_kv_heads"]
    return 12 * s * b * h + 4 * s * b * kv + 8 * s * b * f, 2 * s * b * h


def activation_bytes(spec: dict, *, recompute: bool) -> float | None:
    """Stored activations at the peak for one micro-batch on one GPU; None where not estimated."""
    arch, b = spec["model"]["arch"], spec["batch"]["micro"]
    scale = 2 if spec["precision"]["dtype"] == "fp32" else 1  # the formulas count 16-bit activations
    family = arch["family"]
    if family in ("llava", "qwen2vl"):
        text, s = arch["text"], arch["data"]["seq_len"]
        layer, layer_input = _decoder_layer_bytes(text, s, b)
        layers = text["num_layers"] * (layer_input if recompute else layer) + (layer if recompute else 0)
        loss = 10 * s * b * text["vocab_size"]  # 4sbV kept + 6sbV transient; fp32 whatever the AMP level
        return scale * layers + loss
    if family == "sd3":
        t, size = arch["transformer"], arch["data"]["image_size"]
        vae_factor = 2 ** (len(arch["vae"]["block_out_channels"]) - 1)
        s = (size // vae_factor // t["patch_size"]) ** 2 + arch["text"]["seq_len"]
        d = t["num_heads"] * t["head_dim"]
        per_block = 34 * s * b * d if not recompute else 2 * s * b * d
        return scale * (t["num_layers"] * per_block + (34 * s * b * d if recompute else 0))
    return None


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
    trainable, total, note = trainable_params(spec)
    nproc = spec["derived"]["num_processes"]
    recompute = bool(spec["recompute"])
    states = model_state_bytes(total, trainable, amp_level=spec["precision"]["amp_level"],
                               sharding=spec["parallel"]["sharding"], num_processes=nproc)
    notes = [note] if note else []
    activations = activation_bytes(spec, recompute=recompute)
    if activations is None:
        notes.append(f"no activation estimate for the {spec['model']['arch']['family']} family: model states only")
    return Estimate(states=states, activations=activations,
                    activations_other=activation_bytes(spec, recompute=not recompute), recompute=recompute,
                    trainable=trainable, total=total, notes=notes)


def states_matrix(spec: dict) -> tuple[list[str], list[list[str]]]:
    """Model states (GiB per GPU) for every ZeRO stage x AMP level, at the spec's process count."""
    trainable, total, _ = trainable_params(spec)
    nproc = spec["derived"]["num_processes"]
    header = ["Sharding"] + [f"{dtype} {level}" for dtype, level in AMP_SETTINGS]
    cells = []
    for stage in ZERO_STAGES:
        row = [stage]
        for _, level in AMP_SETTINGS:
            states = model_state_bytes(total, trainable, amp_level=level, sharding=stage, num_processes=nproc)
            row.append(f"{sum(states.values()) / GIB:.2f}")
        cells.append(row)
    return header, cells


def _gib(value: float | None) -> str:
    return "–" if value is None else f"{value / GIB:.2f}"


def to_markdown(spec: dict, est: Estimate, measured: dict | None = None) -> str:
    name, nproc = spec["name"], spec["derived"]["num_processes"]
    precision = f"{spec['precision']['dtype']} {spec['precision']['amp_level']}"
    lines = [f"## Memory estimate: {name}", "",
             f"{presets.display_name(spec['model']['preset'])} {spec['stage']}, micro-batch {spec['batch']['micro']}, "
             f"{precision}, sharding {spec['parallel']['sharding']} over {nproc} processes, "
             f"recompute {'on' if est.recompute else 'off'}; {est.trainable:,} trainable of {est.total:,} parameters.",
             "", "| Component | GiB per GPU |", "|---|---:|"]
    lines += [f"| {k} | {_gib(v)} |" for k, v in est.states.items()]
    lines.append(f"| activations (recompute {'on' if est.recompute else 'off'}) | {_gib(est.activations)} |")
    lines.append(f"| **total** | **{_gib(est.total_bytes)}** |")
    if measured:
        alloc, reserved = measured.get("mem_alloc_peak_bytes"), measured.get("mem_reserved_peak_bytes")
        err = (est.total_bytes - alloc) / alloc if est.total_bytes is not None and alloc else None
        lines.append(f"| measured peak allocated ({measured.get('mem_source')}) | {_gib(alloc)} |")
        lines.append(f"| measured peak reserved | {_gib(reserved)} |")
        lines.append(f"| estimate error vs allocated | {f'{err:+.0%}' if err is not None else '–'} |")
    other = "off" if est.recompute else "on"
    lines += ["", f"With recompute {other}, activations would be {_gib(est.activations_other)} GiB.", "",
              f"Model states (GiB per GPU) by sharding and precision, at {nproc} processes:", ""]
    header, cells = states_matrix(spec)
    lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    lines += ["", *[f"- {n}" for n in est.notes]] if est.notes else []
    lines += ["", "Formulas and sources: `xfw/estimate.py` (ZeRO, Rajbhandari et al. 2020; activations, "
              "Korthikanti et al. 2022)."]
    return "\n".join(lines) + "\n"
