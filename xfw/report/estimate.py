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
and text tokens. SD1.5's UNet is walked block by block (:func:`unet_activation_bytes`: each
ResnetBlock2D and attention block, checkpointed or not, at its own resolution and width), and its
peak is the larger of the UNet's backward and the frozen VAE encoder's transient pass
(:func:`vae_encoder_bytes`), which at 512 px is the larger. Allocator fragmentation, CUDA
workspaces and transient buffers of the optimizer step are not counted: the estimate aims at the
allocator's peak *allocated*, from below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xfw.contract import presets
from xfw.contract.families.llava import count_lora_params

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
    if family == "sd15":  # the peak is in the UNet's backward or, for large images, the VAE encoder
        act, autocast = (4, False) if spec["precision"]["dtype"] == "fp32" else (2, True)
        return max(unet_activation_bytes(arch, b, act=act, autocast=autocast, recompute=recompute),
                   vae_encoder_bytes(arch, b, act=act, autocast=autocast))
    if family == "sd3":
        t, size = arch["transformer"], arch["data"]["image_size"]
        vae_factor = 2 ** (len(arch["vae"]["block_out_channels"]) - 1)
        s = (size // vae_factor // t["patch_size"]) ** 2 + arch["text"]["seq_len"]
        d = t["num_heads"] * t["head_dim"]
        per_block = 34 * s * b * d if not recompute else 2 * s * b * d
        return scale * (t["num_layers"] * per_block + (34 * s * b * d if recompute else 0))
    return None


# --- SD1.5: a UNet is no stack of equal layers, so walk it block by block ------------------------
# Bytes saved for backward, per pixel (per token) and sample, counted tensor by tensor as in
# Korthikanti et al. 2022, Sec. 4.1, for diffusers' blocks. Under autocast (bf16/fp16) convs and
# linears keep a low-precision copy of their input (act = 2 bytes) while GroupNorm, LayerNorm and
# the SiLU after a GroupNorm run in fp32 (4 bytes): CUDA autocast's fp32 op list. In fp32, act = 4
# and inputs a cast would have copied are shared.

def _resnet_per_px(c_in: int, c_out: int, act: int, autocast: bool) -> int:
    """ResnetBlock2D: per side GroupNorm input (4c), SiLU input (4c), conv input (act c); the 1x1
    shortcut keeps the block input where the width changes (shared with the norm's in fp32)."""
    return (8 + act) * (c_in + c_out) + (act * c_in if autocast and c_in != c_out else 0)


def _attention_block_per_token(d: int, act: int, autocast: bool) -> int:
    """BasicTransformerBlock (SD1.5: self-attention, cross-attention over 77 text tokens, GEGLU MLP
    of width 4d), fused SDPA (no score matrix): 3 LayerNorm inputs (12d); self-attention's q/k/v
    inputs (3 autocast copies, else one), q, k, v, output and to_out input (5 act d); cross-attention
    q input, q, output, to_out input (4 act d); MLP input, GEGLU projection (8d), GELU output (4d),
    product (4d) (17 act d)."""
    return 12 * d + (3 if autocast else 1) * act * d + 26 * act * d


def unet_activation_bytes(arch: dict, micro: int, *, act: int, autocast: bool, recompute: bool) -> float:
    """SD1.5 UNet activations at the start of backward, for one micro-batch.

    Recompute is diffusers' gradient checkpointing: each ResnetBlock2D and each
    BasicTransformerBlock keeps only its input (act bytes per element) and is run again in
    backward; the Transformer2DModel around a block (GroupNorm 4c, proj_in and proj_out inputs),
    the down/upsampler convs and the output head are not checkpointed. The backward then holds
    one recomputed unit on top, the largest."""
    unet = arch["unet"]
    widths, num_layers = unet["block_out_channels"], unet["layers_per_block"]
    side = arch["data"]["image_size"] // 2 ** (len(arch["vae"]["block_out_channels"]) - 1)
    saved, largest = 0.0, 0.0

    def resnet(c_in: int, c_out: int, px: int) -> None:
        nonlocal saved, largest
        full = _resnet_per_px(c_in, c_out, act, autocast) * px
        saved += act * c_in * px if recompute else full
        largest = max(largest, full)

    def attention(c: int, px: int) -> None:
        nonlocal saved, largest
        full = _attention_block_per_token(c, act, autocast) * px
        saved += (4 + 2 * act) * c * px + (act * c * px if recompute else full)
        largest = max(largest, full)

    skips, c_prev = [widths[0]], widths[0]  # conv_in's output is the first skip
    for i, kind in enumerate(unet["down_block_types"]):
        px = (side >> i) ** 2
        for _ in range(num_layers):
            resnet(c_prev, widths[i], px)
            c_prev = widths[i]
            if kind.startswith("CrossAttn"):
                attention(c_prev, px)
            skips.append(c_prev)
        if i < len(widths) - 1:  # Downsample2D: a stride-2 conv keeps its input
            saved += act * c_prev * px
            skips.append(c_prev)
    mid_px = (side >> (len(widths) - 1)) ** 2
    resnet(c_prev, c_prev, mid_px), attention(c_prev, mid_px), resnet(c_prev, c_prev, mid_px)
    for j, kind in enumerate(unet["up_block_types"]):
        level = len(widths) - 1 - j
        px, c_out = (side >> level) ** 2, widths[level]
        for _ in range(num_layers + 1):
            resnet(c_prev + skips.pop(), c_out, px)  # the concatenation is the resnet's input
            c_prev = c_out
            if kind.startswith("CrossAttn"):
                attention(c_prev, px)
        if level > 0:  # Upsample2D: nearest 2x, then a conv keeping its (4x larger) input
            saved += act * c_prev * 4 * px
    saved += (8 + act) * widths[0] * side**2  # conv_norm_out (4c), SiLU (4c), conv_out input
    return micro * (saved + (largest if recompute else 0))


def vae_encoder_bytes(arch: dict, micro: int, *, act: int, autocast: bool) -> float:
    """The frozen VAE encoder's transient peak (no grad: nothing is kept for backward, but a UNet-sized
    batch at full resolution is large). It sits in norm2 of the first block's second ResnetBlock2D,
    at full resolution and the first width c: the block's input (held by the Encoder's loop), the
    resnet's input (the first resnet's output, held for the residual), conv1's output (act c each),
    its fp32 copy for GroupNorm (autocast only) and the fp32 GroupNorm output (4c each); plus the
    fp32 pixels. At 512 px this exceeds the checkpointed UNet: SD1.5's H100 OOMs at micro 128 failed
    there."""
    vae = arch["vae"]
    c, px = vae["block_out_channels"][0], arch["data"]["image_size"] ** 2
    held = act if vae["layers_per_block"] > 1 else 0  # with one resnet the block input is its input
    per_element = held + 2 * act + (4 if autocast else 0) + 4
    return micro * px * (per_element * c + 3 * 4)


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
    if spec["model"]["arch"]["family"] == "sd15":
        arch, b, fp32 = spec["model"]["arch"], spec["batch"]["micro"], spec["precision"]["dtype"] == "fp32"
        act, autocast = (4, False) if fp32 else (2, True)
        unet = unet_activation_bytes(arch, b, act=act, autocast=autocast, recompute=recompute)
        vae = vae_encoder_bytes(arch, b, act=act, autocast=autocast)
        notes.append(f"activations = the larger of the UNet's backward ({unet / GIB:.2f} GiB) and the frozen VAE "
                     f"encoder's pass ({vae / GIB:.2f} GiB); gradients are counted although set_to_none frees them "
                     "before the VAE runs")
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
    lines += ["", "Formulas and sources: `xfw/report/estimate.py` (ZeRO, Rajbhandari et al. 2020; activations, "
              "Korthikanti et al. 2022)."]
    return "\n".join(lines) + "\n"
