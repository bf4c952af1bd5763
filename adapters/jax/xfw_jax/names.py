"""NNX parameter paths <-> the neutral checkpoint's canonical names (``xfw.contract.weights``).

The family modules mirror transformers' attribute names, so a path joined with dots is the canonical
name once Flax's own leaf names are translated: ``kernel`` (a linear's ``[in, out]``, a convolution's
``[kh, kw, in, out]``), ``embedding`` and ``scale`` are ``weight`` (``[out, in]``, ``[out, in, kh, kw]``); a LoRA-adapted linear's ``base_layer`` is peft's name.
"""

from __future__ import annotations

import numpy as np

from xfw.contract.hf_names import peft_to_canonical

_LEAF = {"kernel": "weight", "embedding": "weight", "scale": "weight"}


def canonical(path: tuple) -> str:
    parts = [str(p) for p in path]
    parts[-1] = _LEAF.get(parts[-1], parts[-1])
    return peft_to_canonical(".".join(parts))  # a LoRA-adapted linear's base_layer is the linear itself


def to_canonical(path: tuple, value: np.ndarray) -> np.ndarray:
    """A parameter's value in the checkpoint's layout (PyTorch's)."""
    if str(path[-1]) == "kernel":
        return np.transpose(value, (3, 2, 0, 1)) if value.ndim == 4 else value.T
    return value


def from_canonical(path: tuple, value: np.ndarray) -> np.ndarray:
    """The checkpoint's tensor in this parameter's layout (the inverse of :func:`to_canonical`)."""
    if str(path[-1]) == "kernel":
        return np.transpose(value, (2, 3, 1, 0)) if value.ndim == 4 else value.T
    return value


def canonical_shape(path: tuple, shape: tuple) -> tuple:
    if str(path[-1]) == "kernel":
        return (shape[3], shape[2], shape[0], shape[1]) if len(shape) == 4 else (shape[1], shape[0])
    return tuple(shape)
