"""Paddle builders, one module per model family (the same names as ``xfw.contract.families``).

A family module provides the framework objects; what each stage trains and where LoRA goes are
the family's facts in ``xfw.contract.families``, applied by ``xfw_paddle.session`` through the
canonical names. A family module provides:

* ``build(arch, *, use_sdpa, recompute) -> paddle.nn.Layer``: the whole trained system,
  randomly initialised in fp32, frozen encoders included;
* ``canonical_names(model) -> {our name: (canonical name, transposed?)}``: the name map through
  which weights are read and written and ``xfw_paddle.session`` selects what trains;
* ``loss_fn(model, batch, autocast) -> Tensor``: the loss of one micro-batch; ``autocast()``
  is the AMP context to run the forward in.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from xfw.contract.harness import Unsupported

FAMILIES = {
    "llava": "xfw_paddle.families.llava",
    "qwen2vl": "xfw_paddle.families.qwen2vl",
    "sd15": "xfw_paddle.families.sd15",
    "sd3": "xfw_paddle.families.sd3",
}


def family_module(name: str) -> ModuleType:
    if name not in FAMILIES:
        raise Unsupported(f"model family {name!r} is not built by the Paddle adapter")
    try:
        return importlib.import_module(FAMILIES[name])
    except ModuleNotFoundError as err:
        if err.name == FAMILIES[name]:
            raise Unsupported(f"model family {name!r} is not built by the Paddle adapter yet") from None
        raise
