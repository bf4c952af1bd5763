"""Stage ``lora`` in Flax NNX: low-rank adapters beside the family's LoRA module's linears, as peft adds them.

Every ``nnx.Linear`` under ``LORA_MODULE`` (``xfw.contract.families``) whose dotted name is one of
``lora.targets`` or ends with ``.TARGET`` (peft's rule: ``to_out.0``) is replaced by :class:`LoRALinear`: the frozen linear kept as ``base_layer`` (peft's
name, which ``xfw.contract.hf_names.peft_to_canonical`` folds away), ``lora_A`` (``[r, in]`` in the
checkpoint, initialised as peft does: uniform in +-1/sqrt(in)) and ``lora_B`` (zeros), the output
``base(x) + lora_B(lora_A(x)) * alpha / r``. Dropout on the adapters' input is not wired in.
"""

from __future__ import annotations

from flax import nnx

from xfw.contract import families
from xfw.contract.harness import InvalidSpec, Unsupported

PEFT_A_INIT = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")  # kaiming_uniform(a=sqrt(5))


class LoRALinear(nnx.Module):
    def __init__(self, base: nnx.Linear, r: int, alpha: float, rngs: nnx.Rngs):
        self.base_layer = base
        n_in, n_out = base.kernel[...].shape
        self.lora_A = nnx.Linear(n_in, r, use_bias=False, dtype=base.dtype, param_dtype=base.param_dtype,
                                 kernel_init=PEFT_A_INIT, rngs=rngs)
        self.lora_B = nnx.Linear(r, n_out, use_bias=False, dtype=base.dtype, param_dtype=base.param_dtype,
                                 kernel_init=nnx.initializers.zeros, rngs=rngs)
        self.scaling = alpha / r

    def __call__(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def _module(root, dotted: str):
    node = root
    for part in dotted.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def add_lora(model, spec: dict) -> None:
    """Adapters on the spec's targets, seeded from ``measure.seed`` (their own stream: the frameworks'
    draws differ anyway; parity starts both sides from one exported file)."""
    lora, arch = spec["lora"], spec["model"]["arch"]
    if lora["dropout"]:
        raise Unsupported(f"lora.dropout {lora['dropout']}: adapter dropout is not wired into the JAX adapter; use 0")
    target = _module(model, families.lora_module(arch))
    def matched(path) -> str | None:  # peft's rule: the module's dotted name is the target or ends with ".target"
        dotted = ".".join(str(p) for p in path)
        return next((t for t in lora["targets"] if dotted == t or dotted.endswith("." + t)), None)

    found = [(path, node) for path, node in nnx.iter_graph(target)
             if isinstance(node, nnx.Linear) and path and matched(path)]
    missing = sorted(set(lora["targets"]) - {matched(p) for p, _ in found})
    if missing:
        raise InvalidSpec(f"lora.targets: {missing[0]!r} matches no linear under {families.lora_module(arch)}")
    rngs = nnx.Rngs(params=spec["measure"]["seed"] + 1)
    for path, node in found:
        parent = target
        for part in path[:-1]:
            parent = parent[part] if isinstance(part, int) else getattr(parent, part)
        adapted = LoRALinear(node, lora["r"], lora["alpha"], rngs)
        if isinstance(path[-1], int):  # a list slot (diffusers' to_out.0)
            parent[path[-1]] = adapted
        else:
            setattr(parent, str(path[-1]), adapted)
