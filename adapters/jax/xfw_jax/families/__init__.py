"""Flax NNX builders, one module per model family (the same names as ``xfw.contract.families``).

A family module provides ``build(arch, *, dtype, param_dtype, seed) -> nnx.Module`` (the whole
trained system, frozen encoders included, its module tree named as transformers names it, so paths
are canonical names: ``xfw_jax.names``), ``loss_fn(model, batch) -> scalar`` and
``enable_recompute(model, policy)``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from xfw.contract.harness import Unsupported

FAMILIES = {"llava": "xfw_jax.families.llava", "sd15": "xfw_jax.families.sd15"}
NOT_PORTED = {  # what --describe lists as unsupported, and each run of it says (exit 3, ``unsupported``)
    "qwen2vl": "Qwen2-VL (3-D rotary positions, windowed vision merger) is not ported to the JAX adapter yet",
    "sd3": "Stable Diffusion 3 (MMDiT, three text encoders, flow matching) is not ported to the JAX adapter yet",
}
NOT_PORTED_VARIANTS = {  # a ported family's variant that is not (``model.arch``), said by the family's build
    "llava (anyres: LLaVA-NeXT)": "LLaVA-NeXT (AnyRes tiles, image newline) is not ported to the JAX adapter yet",
}


def family_module(name: str) -> ModuleType:
    if name not in FAMILIES:
        raise Unsupported(NOT_PORTED.get(name, f"model family {name!r} is not built by the JAX adapter"))
    return importlib.import_module(FAMILIES[name])
