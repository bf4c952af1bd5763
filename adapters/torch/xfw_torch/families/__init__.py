"""PyTorch builders, one module per model family (the same names as ``xfw.contract.families``).

A family module provides the framework objects; what each stage trains and where LoRA goes are
the family's facts in ``xfw.contract.families``, applied by ``xfw_torch.session`` by parameter
name. A family module provides:

* ``build(arch, *, attn_implementation) -> torch.nn.Module``: the whole trained system, randomly
  initialised in fp32 (frozen encoders included: their parameters count and their cost is
  part of the step);
* ``loss_fn(model, batch) -> Tensor``: the training loss for one micro-batch (dict of tensors);
* ``enable_recompute(model)``: activation checkpointing per block.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from xfw.contract.harness import Unsupported

FAMILIES = {
    "llava": "xfw_torch.families.llava",
    "qwen2vl": "xfw_torch.families.qwen2vl",
    "sd15": "xfw_torch.families.sd15",
    "sd3": "xfw_torch.families.sd3",
}


def family_module(name: str) -> ModuleType:
    if name not in FAMILIES:
        raise Unsupported(f"model family {name!r} is not built by the PyTorch adapter")
    try:
        return importlib.import_module(FAMILIES[name])
    except ModuleNotFoundError as err:
        if err.name == FAMILIES[name]:
            raise Unsupported(f"model family {name!r} is not built by the PyTorch adapter yet") from None
        raise
