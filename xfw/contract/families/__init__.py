"""Model families: what the core knows about each architecture, framework-free.

A family module (``xfw.contract.families.llava`` ...) owns, for its neutral architecture fields:

* ``check(arch)``: validation, raising ``xfw.contract.presets.ArchError(key, message)``;
* ``make_batch(arch, micro, rng)``: one synthetic micro-batch of numpy arrays;
* ``count_params(arch)`` (optional): analytic parameter counts both adapters must match.

Families are imported on first use, so a recipe only pays for its own.
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES = {
    "llava": "xfw.contract.families.llava",
    "qwen2vl": "xfw.contract.families.qwen2vl",
    "sd15": "xfw.contract.families.sd15",
    "sd3": "xfw.contract.families.sd3",
}


def family_module(name: str) -> ModuleType:
    if name not in FAMILIES:
        raise KeyError(f"unknown model family {name!r}")
    return importlib.import_module(FAMILIES[name])
